"""The benchmark scripts import on a CPU-only install and answer ``--help`` before touching a GPU.

They run only on a GPU, where no test suite runs: a name the package renamed or a script that
starts timing when asked for its usage would otherwise show only on the next device run. Each
script is imported here in the test process (they import each other, and torch is loaded once)
and its ``main`` called with ``--help``."""

import importlib
import pathlib
import sys

import pytest
from test_kernels_gemm_decode_warp_specialized import CUDA, kernel_call_tensors, stand_in_hopper

from nvfp4_static.kernels import gemm_decode_warp_specialized as decode

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


def test_the_warp_specialized_benchmark_forms_of_the_table_take_the_rows_they_name(benchmarks_on_path):
    """Its "table-whole" column: the tile's rows per program at every M; "table-192": 192 rows per
    tall program where that leaves the programs as many (1-192, 257-384), else 256, and the square
    tile's 128; the patch undone after each call."""
    from nvfp4_static.kernels import gemm_warp_specialized

    bench = importlib.import_module("bench_warp_specialized")
    tall_rows_192_or_whole = {1: 192, 160: 192, 200: 256, 300: 192, 384: 192, 385: 256, 512: 256}
    whole, rows_192 = bench.whole_tile_rows, bench.rows_192_or_whole_tile
    for M, tall_rows in tall_rows_192_or_whole.items():
        forms = ((256, whole, 256), (128, whole, 128), (256, rows_192, tall_rows), (128, rows_192, 128))
        for tile, rows, expected in forms:
            form = bench.with_rows_per_program(lambda: gemm_warp_specialized.tokens_per_program(M, tile), rows)
            assert form() == expected, (M, tile)
    assert gemm_warp_specialized.tokens_per_program(129, 256) == 144


@pytest.mark.skipif(not decode.HAS_GLUON_HOPPER, reason="this Triton has no Gluon Hopper API")
def test_the_mma_forms_benchmark_launches_the_forms_it_names(benchmarks_on_path):
    """Each form of ``bench_decode_mma_forms`` reaches the decode tile's launch (a renamed
    constant or rule would only fail on a GPU), "n16 whole" differs from the kernel at one row
    in both, and "n8 halves" is the kernel's own form at every row count."""
    bench = importlib.import_module("bench_decode_mma_forms")
    N, K = 256, 1024

    def launched_form(M):
        a, qdata, codes, scale, out = kernel_call_tensors(M, N, K)
        _, _, meta = decode.kernel_arguments(a, qdata, codes, scale, scale, None, out, None, None, 1)
        return meta["TOKENS"], meta["MMA_CHUNKS"]

    own = {M: launched_form(M) for M in (1, 8, 9, 16)}
    assert own == {1: (8, 2), 8: (8, 2), 9: (16, 2), 16: (16, 2)}
    for name, (tokens, parts) in bench.FORMS.items():
        with bench.decode_tile_form(name):
            for M in own:
                expected_tokens = own[M][0] if tokens is None else tokens
                assert launched_form(M) == (expected_tokens, parts), (name, M)
    with bench.decode_tile_form("n16 whole"):
        assert launched_form(1) == (16, 1)
    assert {M: launched_form(M) for M in own} == own  # the patches are undone


def test_the_one_row_benchmark_runs_the_forms_it_names(benchmarks_on_path, monkeypatch):
    """``bench_decode_one_row``'s forms give the route at one row the tiles they name (a renamed
    constant would only fail on a GPU): the entry, the decode tile on the operand kernel's
    operand, the decode tile quantizing its row, and that with the splits summed across
    programs where the table's rule sums them in one (8192 x 8192: 4 splits of 8 K tiles); the
    patches undone after."""
    from nvfp4_static.kernels import gemm

    stand_in_hopper(monkeypatch)
    bench = importlib.import_module("bench_decode_one_row")
    split, K = gemm.split_k_for(gemm.DECODE_TILE, 8192, 8192, CUDA), 8192
    expected = {
        "entry": (gemm.gemm_config(1), True),
        "after operand": (gemm.DECODE_TILE, True),
        "quantizing": (gemm.DECODE_TILE_AT_ONE_ROW, True),
        "quantizing across": (gemm.DECODE_TILE_AT_ONE_ROW, False),
    }
    assert set(bench.FORMS) == set(expected)
    for name, (min_k_tiles, context) in bench.FORMS.items():
        rule = dict(DECODE_TILE_MIN_K_TILES=min_k_tiles, DECODE_TILE_MIN_K_TILES_IN_GRAPHS=min_k_tiles)
        with context(), monkeypatch.context() as patched:
            for constant, value in rule.items():
                patched.setattr(gemm, constant, value)
            tile, in_program = expected[name]
            assert gemm.table_config(1, None, 8192, 8192, CUDA) == tile, name
            assert decode.sums_in_program(split, K, 1) == in_program, name
    assert gemm.table_config(1, None, 8192, 8192, CUDA) == gemm.gemm_config(1)  # 8 K tiles per split: the entry
    assert gemm.decode_tile_for_one_row(split, K) == gemm.DECODE_TILE


def test_the_decode_tile_benchmarks_name_both_forms_of_the_decode_tile(benchmarks_on_path):
    """Their ``takes`` column names the tile the table runs: at one row the decode tile may be the
    form that quantizes its row, which is the decode tile too."""
    from nvfp4_static.kernels import gemm

    tile_name = importlib.import_module("bench_decode_tile").tile_name
    assert [tile_name(t) for t in (gemm.DECODE_TILE, gemm.DECODE_TILE_AT_ONE_ROW)] == ["decode", "decode"]
    assert tile_name(gemm.GEMM_CONFIGS[0][1]) == "entry"


def test_the_route_benchmark_patches_names_the_package_has(benchmarks_on_path):
    """Its forms patch the route's threshold and the kernel-or-ops choice; a renamed one would
    only fail on a GPU, where ``mock.patch.object`` meets it."""
    bench = importlib.import_module("bench_route")
    assert isinstance(bench.expert_routing.SORTED_IN_ONE_PROGRAM, int)
    assert bench.MOST_PAIRS_SORTED_IN_ONE_PROGRAM <= bench.expert_routing.MAX_ROUTED_PAIRS
    assert callable(bench.experts_routing.routed_by_kernel)
