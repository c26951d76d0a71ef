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


def test_the_eager_rules_benchmark_patches_constants_the_table_has(benchmarks_on_path):
    """Its rules are patches of ``kernels.gemm``'s constants; a renamed constant would only fail
    on a GPU, where ``mock.patch.object`` meets it. Each rule also changes what it names."""
    from nvfp4_static.kernels import gemm

    rules = importlib.import_module("bench_eager_decode_rules").RULES
    assert rules["table"] == {}
    for rule, patches in rules.items():
        for name, value in patches.items():
            assert getattr(gemm, name) != value, (rule, name)


@pytest.mark.parametrize(
    "rows,expected",
    [
        (256, {1: 256, 160: 256, 200: 256, 300: 256, 384: 256, 512: 256}),
        (160, {1: 160, 160: 160, 161: 192, 200: 256, 257: 160, 320: 160, 321: 192, 384: 192, 385: 256}),
    ],
    ids=["256", "160"],
)
def test_the_warp_specialized_benchmark_sets_the_tall_tiles_rows_per_program(benchmarks_on_path, rows, expected):
    """Its columns with other rows per tall program: 256 at every M; the 160-row candidate where
    ceil(M / 160) row tiles are as many as of 256, elsewhere the table's rule (192 where that
    leaves them as many, else 256). The square tile keeps its 128 rows in both."""
    from nvfp4_static.kernels import gemm_warp_specialized

    bench = importlib.import_module("bench_warp_specialized")
    for M, tokens in expected.items():
        route = bench.with_rows_per_program(lambda: gemm_warp_specialized.tokens_per_program(M, 256), rows)
        assert route() == tokens, M
        square = bench.with_rows_per_program(lambda: gemm_warp_specialized.tokens_per_program(M, 128), rows)
        assert square() == 128, M
    assert gemm_warp_specialized.tokens_per_program(200, 256) == 256  # the patch is undone
