"""The benchmark scripts import on a CPU-only install and answer ``--help`` before touching a GPU.

They run only on a GPU, where no test suite runs: a name the package renamed or a script that
starts timing when asked for its usage would otherwise show only on the next device run. Each
script is imported here in the test process (they import each other, and torch is loaded once)
and its ``main`` called with ``--help``."""

import importlib
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py"))


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def test_the_glob_finds_the_benchmark_scripts():
    """A wrong folder would leave the test below nothing to check."""
    assert {"bench_linear", "bench_decode", "bench_compile_time", "bench_decode_tile"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_imports_and_answers_help_without_a_gpu(script, benchmarks_on_path, monkeypatch, capsys):
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith(f"usage: {script}.py")
    assert module.__doc__.split()[0] in usage  # the description is the script's docstring
