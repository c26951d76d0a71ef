"""references.py: the histogram binning, the Hessian blocks and the sweep's structural rules.

The sweep's choices against a brute force over the 126 candidates are checked through its
public entry point in test_observers.py (NVFP4MSECalibrator).
"""

import math

import pytest
import torch

from nvfp4_static import references
from nvfp4_static.numerics import BLOCK_SIZE

BINS = dict(num_bins=512, log2_min=-40.0, log2_max=40.0)
WIDTH = (BINS["log2_max"] - BINS["log2_min"]) / BINS["num_bins"]


def expected_bin(value: float) -> int:
    """Bin of a positive value from its log2, clamped into range (the definition, in float64)."""
    index = math.floor((math.log2(value) - BINS["log2_min"]) / WIDTH)
    return min(max(index, 0), BINS["num_bins"] - 1)


def test_bin_edges_are_increasing_powers_of_two_between_the_bins():
    edges = references.histogram_bin_edges(**BINS)
    assert edges.shape == (BINS["num_bins"] - 1,) and edges.dtype == torch.float32
    assert bool((edges[1:] > edges[:-1]).all())
    assert edges[0].item() == pytest.approx(2.0 ** (BINS["log2_min"] + WIDTH), rel=1e-7)
    assert edges[255].item() == 1.0  # log2 = -40 + 256 * 80 / 512 = 0


def test_each_bin_centre_is_counted_in_its_own_bin():
    centres = references.histogram_bin_centres(**BINS)
    x = torch.zeros(BINS["num_bins"], BLOCK_SIZE)
    x[:, 3] = centres.to(torch.float32)
    counts, amax = references.block_amax_histogram(x, references.histogram_bin_edges(**BINS))
    assert torch.equal(counts, torch.ones(BINS["num_bins"], dtype=torch.int64))
    assert amax.item() == pytest.approx(2.0 ** (BINS["log2_max"] - WIDTH / 2), rel=1e-6)


def test_block_amax_histogram_counts_nonzero_block_amaxes_by_log2():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, 16, generator=generator) * 2.0 ** torch.randint(
        -30, 30, (64, 8, 1), generator=generator
    )
    x[::5, 2] = 0.0  # all-zero blocks: not counted
    counts, amax = references.block_amax_histogram(
        x.reshape(64, 128), references.histogram_bin_edges(**BINS)
    )
    block_amaxes = x.abs().amax(dim=-1).flatten()
    expected = torch.zeros(BINS["num_bins"], dtype=torch.int64)
    for value in block_amaxes[block_amaxes > 0].tolist():
        expected[expected_bin(value)] += 1
    assert torch.equal(counts, expected)
    assert int(counts.sum()) == 64 * 8 - 13
    assert amax.item() == x.abs().max().item()


def test_block_amax_histogram_puts_out_of_range_values_in_the_end_bins():
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = 2.0**-60, 2.0**60
    counts, _ = references.block_amax_histogram(x, references.histogram_bin_edges(**BINS))
    assert counts[0] == 1 and counts[-1] == 1 and int(counts.sum()) == 2


def test_block_amax_histogram_of_all_zeros_is_empty_with_zero_max():
    counts, amax = references.block_amax_histogram(
        torch.zeros(3, 40), references.histogram_bin_edges(**BINS)
    )
    assert int(counts.sum()) == 0 and amax.item() == 0.0


def test_block_hessian_is_the_sum_of_outer_products_per_block():
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    hessian = references.block_hessian(x.to(torch.float32))
    tokens = x.reshape(10, 48)
    for b in range(3):
        block = tokens[:, b * 16 : (b + 1) * 16]
        expected = sum(torch.outer(row, row) for row in block)
        torch.testing.assert_close(hessian[b].double(), expected, rtol=1e-5, atol=1e-5)


def test_fp8_scale_sweep_picks_the_smallest_candidate_for_an_all_zero_block():
    """Every candidate quantizes zeros exactly: a tie, which goes to the lowest, 2^-9."""
    weight = torch.cat([torch.zeros(2, 16), torch.randn(2, 16)], dim=1)
    scales = references.fp8_scale_sweep(weight, weight.abs().max())
    assert bool((scales[:, 0].to(torch.float32) == 2.0**-9).all())


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "hessian"])
def test_fp8_scale_sweep_refuses_a_global_amax_whose_reciprocals_overflow(weighted):
    """Below ~4e-33 the smallest candidate's reciprocal is inf and zeros would quantize to
    0 * inf = NaN: the sweep says so instead of choosing among NaN errors."""
    weight = torch.cat([torch.zeros(2, 16), torch.full((2, 16), 1e-34)], dim=1)
    hessian = references.block_hessian(torch.randn(4, 32)) if weighted else None
    assert references.sweep_reciprocals_overflow(torch.tensor(1e-34))
    with pytest.raises(ValueError, match="global amax 1e-34 is too small"):
        references.fp8_scale_sweep(weight, torch.tensor(1e-34), hessian)


def test_sweep_reciprocals_overflow_only_below_the_float32_limit():
    smallest_candidate = 2.0**-9
    # per_tensor_scale = amax / 2688; the largest reciprocal is 1 / per_tensor_scale / 2^-9.
    limit = 2688 * (1 / smallest_candidate) / torch.finfo(torch.float32).max
    assert not references.sweep_reciprocals_overflow(torch.tensor(limit * 1.01))
    assert references.sweep_reciprocals_overflow(torch.tensor(limit * 0.99))


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "hessian"])
def test_fp8_scale_sweep_rows_are_independent_across_chunks(weighted):
    k = 8192
    chunk = references.sweep_rows_per_chunk(k, torch.device("cpu"))
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(chunk + 5, k, generator=generator)
    hessian = references.block_hessian(torch.randn(8, k, generator=generator)) if weighted else None
    global_amax = weight.abs().max()
    whole = references.fp8_scale_sweep(weight, global_amax, hessian)
    # Split where the sweep's own chunks do not.
    pieces = [references.fp8_scale_sweep(w, global_amax, hessian) for w in weight.split(chunk // 2 + 1)]
    assert torch.equal(whole.view(torch.uint8), torch.cat(pieces).view(torch.uint8))


def test_fp8_scale_sweep_block_of_the_global_max_is_near_the_top_candidate():
    """A block holding the global amax needs scale ~448 (max-based); the MSE optimum may trade
    a little clipping for finer steps, but not by more than one binade."""
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    scales = references.fp8_scale_sweep(weight, weight.abs().max()).to(torch.float32)
    row, col = divmod(int(weight.abs().argmax()), 64)
    assert 224.0 <= scales[row, col // 16].item() <= 448.0


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_the_cpu_sweep_runs_on_one_thread_and_gives_the_callers_threads_back(raises, monkeypatch):
    """Its many small ops stall on a busy machine when two threads wait on each other."""
    seen = set()
    block_errors = references._block_errors

    def block_errors_seeing_threads(*args, **kwargs):
        seen.add(torch.get_num_threads())
        if raises:
            raise RuntimeError("a failing step")
        return block_errors(*args, **kwargs)

    monkeypatch.setattr(references, "_block_errors", block_errors_seeing_threads)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weight = torch.randn(8, 32)
        if raises:
            with pytest.raises(RuntimeError, match="a failing step"):
                references.fp8_scale_sweep(weight, weight.abs().max())
        else:
            references.fp8_scale_sweep(weight, weight.abs().max())
        assert seen == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
