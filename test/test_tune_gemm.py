"""examples/benchmarks/tune_gemm.py's summary, which names the entries of the tile table: per M and
per bucket, the candidate whose slowest case against bf16 is fastest."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
import tune_gemm  # noqa: E402

from nvfp4_static.kernels.gemm import GemmConfig, gemm_bucket  # noqa: E402

STEADY = GemmConfig(128, 64, 128, 4, 3)
FAST_AT_200 = GemmConfig(64, 64, 128, 4, 4)
NOT_EVERYWHERE = GemmConfig(32, 64, 256, 4, 3)


def summary_rows() -> list:
    """(K, N, M, bf16 ms, table ms, [(ms, config), ...] fastest first): at M = 200 and 256 (one
    bucket) on two shapes, and M = 64 (another) on one. bf16 takes 1 ms everywhere."""
    return [
        (8192, 8192, 256, 1.0, 1.5, [(1.25, STEADY), (2.0, FAST_AT_200)]),
        (8192, 8192, 200, 1.0, 1.4, [(1.0, FAST_AT_200), (1.2, STEADY), (0.5, NOT_EVERYWHERE)]),
        (4096, 14336, 200, 1.0, 1.6, [(1.0, FAST_AT_200), (1.1, STEADY)]),
        (4096, 14336, 256, 1.0, 1.3, [(1.2, STEADY), (1.9, FAST_AT_200)]),
        (8192, 8192, 64, 1.0, 0.9, [(0.8, NOT_EVERYWHERE), (0.85, STEADY)]),
    ]


def summary_lines(capsys) -> dict:
    tune_gemm.print_summary(summary_rows())
    lines = capsys.readouterr().out.splitlines()
    return {
        "per_m": {"M=" + line.split("=")[1].split()[0]: line for line in lines if line.startswith("M=")},
        "per_bucket": [line for line in lines if line.startswith("bucket ")],
    }


def test_per_m_names_the_best_worst_case_among_candidates_that_ran_on_every_shape(capsys):
    per_m = summary_lines(capsys)["per_m"]
    # At 200 FAST_AT_200 wins on both shapes; NOT_EVERYWHERE, faster on one, missed the other.
    assert per_m["M=200"].endswith(tune_gemm.describe(FAST_AT_200))
    assert "best 1.00x (1.00 / 1.00)" in per_m["M=200"] and "table 0.62x" in per_m["M=200"]
    assert per_m["M=256"].endswith(tune_gemm.describe(STEADY))
    assert per_m["M=64"].endswith(tune_gemm.describe(NOT_EVERYWHERE))


def test_per_bucket_weighs_every_m_and_shape_of_the_bucket(capsys):
    assert gemm_bucket(200) == gemm_bucket(256) != gemm_bucket(64)
    (line,) = summary_lines(capsys)["per_bucket"]  # M = 64 alone in its bucket: no line
    assert line.startswith(f"bucket {gemm_bucket(256)} (M 200, 256)")
    # FAST_AT_200's slowest case is 1 / 2.0 = 0.50x, STEADY's 1 / 1.25 = 0.80x.
    assert line.endswith(tune_gemm.describe(STEADY))
    assert "best 0.80x" in line and "table 0.62x" in line
    # Its ratios in M order: both M = 200 rows, then both M = 256 rows.
    assert "(0.83 / 0.91 / 0.80 / 0.83)" in line


@pytest.mark.parametrize("M", [1, 16, 100, 200, 300, 4096])
def test_programs_candidates_vary_only_the_split_of_the_entry_serving_m(M):
    """``--candidates programs``: the table's entry for M, its programs per SM 1 to 8 (the K
    split, without growing it to fill the SMs), plus unsplit where the entry plans one row tile;
    none for an unsplit entry."""
    entry = tune_gemm.gemm.gemm_config(M)
    configs = tune_gemm.programs_candidates(M)
    if not getattr(entry, "programs_per_sm", 0):
        assert configs == []
        return
    expected = set(range(1, 9)) | ({0} if entry.row_tiles_for_split == 1 else set())
    assert {config.programs_per_sm for config in configs} == expected
    assert len(configs) == len(expected)
    assert all(config.fill_programs_per_sm == 0 for config in configs)
    same = dict(programs_per_sm=entry.programs_per_sm, fill_programs_per_sm=entry.fill_programs_per_sm)
    assert all(tune_gemm.replace(config, **same) == entry for config in configs)


@pytest.mark.parametrize("M", [1, 16, 32, 64, 4096])
def test_unfilled_candidates_are_the_filling_entry_without_its_fill(M):
    """``--candidates unfilled``: the entry for M without ``fill_programs_per_sm`` where it has
    one, else nothing to compare."""
    entry = tune_gemm.gemm.gemm_config(M)
    configs = tune_gemm.unfilled_candidates(M)
    if not getattr(entry, "fill_programs_per_sm", 0):
        assert configs == []
        return
    assert configs == [tune_gemm.replace(entry, fill_programs_per_sm=0)]
    assert configs[0] != entry
