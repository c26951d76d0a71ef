"""The calibrators and the Hessian accumulator: recipes against independent computations,
merging, and the behaviour on bad input."""

import math
import re
import warnings

import pytest
import torch
from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

from nvfp4_static.numerics import (
    compute_block_scales,
    dequantize_nvfp4,
    fake_quantize_nvfp4,
    quantize_nvfp4,
)
from nvfp4_static.observers import (
    BlockHessianAccumulator,
    FullHessianAccumulator,
    MaxCalibrator,
    MseCalibrator,
    NVFP4ActMaxCalibrator,
    NVFP4BMinCalibrator,
    NVFP4MSECalibrator,
    PercentileCalibrator,
    nvfp4_fake_quantize_with_amax,
)
from nvfp4_static.observers.anchored_mse import FirstBatchMseCalibrator

LAYER = "model.layers.3.mlp.down_proj"
LOG2_MIN, LOG2_MAX, NUM_BINS = -40.0, 40.0, 512
BIN_WIDTH = (LOG2_MAX - LOG2_MIN) / NUM_BINS


def bin_of(value: float) -> int:
    return math.floor((math.log2(value) - LOG2_MIN) / BIN_WIDTH)


def bin_centre(index: int) -> float:
    return 2.0 ** (LOG2_MIN + (index + 0.5) * BIN_WIDTH)


def blocks_with_amaxes(amaxes: list[float]) -> torch.Tensor:
    """``[len(amaxes), 16]``: one block per amax, its amax in element 5 (negated on odd rows),
    the rest a quarter of it."""
    amaxes = torch.tensor(amaxes, dtype=torch.float32)
    x = (amaxes / 4)[:, None].repeat(1, 16)
    x[:, 5] = amaxes * torch.tensor([1.0, -1.0]).repeat(len(amaxes) // 2 + 1)[: len(amaxes)]
    return x


def three_bin_activation(lo=250, mid=260, hi=270, tiny=0) -> torch.Tensor:
    """10000 blocks at three bin centres: 100 at ``lo``, 9800 at ``mid``, 100 at ``hi``, so that
    the 1st percentile is bin ``lo`` and the 99.99th bin ``hi``; plus ``tiny`` blocks at 2^-30."""
    amaxes = [bin_centre(lo)] * 100 + [bin_centre(mid)] * 9800 + [bin_centre(hi)] * 100
    return blocks_with_amaxes(amaxes + [2.0**-30] * tiny).reshape(-1, 80)


def lognormal_activation(seed: int, rows: int = 256) -> torch.Tensor:
    """Normal values, each 16-wide block scaled by its own log-normal gain; every 7th block zero."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randn(rows, 20, 16, generator=generator)
    gains = torch.exp(torch.randn(rows, 20, 1, generator=generator))
    blocks = blocks * gains
    blocks.view(-1, 16)[::7] = 0.0
    return blocks.reshape(rows, 320)


# --- NVFP4ActMaxCalibrator / PercentileCalibrator: the histogram recipe -----------------------


@pytest.mark.parametrize("percentile", [0.5, 1.0, 10.0, 50.0, 90.0, 99.0, 99.99])
def test_percentile_agrees_with_torch_quantile_within_one_bin(percentile):
    x = lognormal_activation(seed=0)
    calibrator = PercentileCalibrator(percentile)
    calibrator.collect(x)
    block_amaxes = x.reshape(-1, 16).abs().amax(dim=-1).double()
    expected = torch.quantile(block_amaxes[block_amaxes > 0], percentile / 100.0).item()
    actual = calibrator.compute_amax().item()
    assert abs(bin_of(actual) - bin_of(expected)) <= 1


@pytest.mark.parametrize("percentile, error", [(float("nan"), ValueError), (-5.0, ValueError), (0.0, ValueError),
                                               (101.0, ValueError), ("50", TypeError)],
                         ids=["nan", "negative", "zero", "above 100", "string"])
def test_a_percentile_outside_0_to_100_is_refused_naming_the_layer(percentile, error):
    """NaN raised IndexError (index 512 is out of bounds); -5 read the first percentile."""
    calibrator = PercentileCalibrator(name=LAYER)
    calibrator.collect(lognormal_activation(seed=1))
    with pytest.raises(error, match=rf"{LAYER}.*percentile"):
        calibrator.percentile(percentile)


def test_percentile_100_is_the_literal_max():
    x = lognormal_activation(seed=1)
    calibrator = PercentileCalibrator(100.0)
    calibrator.collect(x)
    assert calibrator.compute_amax().item() == x.abs().max().item()


@pytest.mark.parametrize(
    "rho, margin, b_max_percentile, set_by",
    [
        (16384.0, 1.0, 99.99, "rho*B_min"),
        (4.0, 1.0, 99.99, "margin*B_max"),
        (16384.0, 1e5, 100.0, "margin*B_max"),
        (100.0, 1.0, 100.0, "rho*B_min"),
    ],
    ids=["rho_term", "margin_term", "margin_term_literal_max", "rho_term_literal_max"],
)
def test_g_amax_is_the_larger_of_rho_b_min_and_margin_b_max(rho, margin, b_max_percentile, set_by):
    """Blocks at known bin centres, so B_min and B_max are known exactly: bins 250 and 270,
    which are 2^3.125 (8.7x) apart: rho 4 loses to margin 1, rho 100 wins."""
    calibrator = NVFP4ActMaxCalibrator(rho=rho, margin=margin, b_max_percentile=b_max_percentile)
    calibrator.collect(three_bin_activation())
    g_amax = calibrator.compute_amax()
    b_min = bin_centre(250)
    literal_max = torch.tensor(bin_centre(270), dtype=torch.float32).item()
    b_max = literal_max if b_max_percentile == 100.0 else bin_centre(270)
    stats = calibrator.stats
    assert stats["b_min"] == pytest.approx(b_min, rel=1e-12)
    assert stats["b_max"] == pytest.approx(b_max, rel=1e-12)
    assert stats["literal_max"] == literal_max
    assert stats["set_by"] == set_by
    assert g_amax.dtype == torch.float32 and g_amax.shape == ()
    expected = torch.tensor(max(rho * b_min, margin * b_max), dtype=torch.float32)
    assert g_amax.item() == expected.item()
    assert stats["g_amax"] == pytest.approx(max(rho * b_min, margin * b_max), rel=1e-12)


def test_default_b_max_keeps_a_massive_activation_block_from_clipping():
    """One block in 24,576 far above the rest, like the first-token "massive activation" of
    SmolLM2's ``layers.11.mlp.down_proj`` (about 2,800 against a bulk below 8). With B_max at
    the 99.99th percentile ``rho * B_min`` sets g_amax well below that block (it clips to ~60%);
    the default reads B_max at the block itself, so g_amax covers it up to half a bin."""
    bulk = torch.logspace(math.log10(0.1), math.log10(8.0), 24_575).tolist()
    outlier = 2_800.0
    x = blocks_with_amaxes(bulk + [outlier])
    default, first_choice = NVFP4ActMaxCalibrator(), NVFP4ActMaxCalibrator(b_max_percentile=99.99)
    for calibrator in (default, first_choice):
        calibrator.collect(x)
    half_bin = 2.0 ** (BIN_WIDTH / 2)
    assert default.compute_amax().item() >= outlier / half_bin
    assert default.stats["set_by"] == "margin*B_max"
    assert first_choice.compute_amax().item() < 0.7 * outlier
    assert first_choice.stats["set_by"] == "rho*B_min"


def test_b_min_ignores_blocks_below_a_millionth_of_b_max():
    """500 blocks at 2^-30 (2^32 below B_max) would be the 1st percentile; the floor skips them,
    and the raw reading still reports them."""
    calibrator = NVFP4ActMaxCalibrator()
    calibrator.collect(three_bin_activation(tiny=500))
    calibrator.compute_amax()
    assert calibrator.stats["b_min"] == pytest.approx(bin_centre(250), rel=1e-12)
    assert bin_of(calibrator.stats["b_min_percentile_value"]) == bin_of(2.0**-30)


def test_zero_blocks_are_not_counted():
    x = lognormal_activation(seed=2)
    with_zeros = torch.cat([x, torch.zeros(100, 320)])
    plain, padded = NVFP4ActMaxCalibrator(), NVFP4ActMaxCalibrator()
    plain.collect(x)
    padded.collect(with_zeros)
    assert torch.equal(plain.state_dict()["counts"], padded.state_dict()["counts"])
    assert plain.compute_amax().item() == padded.compute_amax().item()


def test_dynamic_range_warning_names_the_layer_once():
    """Block amaxes from 2^-10 to 2^10: a span of 2^20 > 28672, but within the 1e6 floor."""
    amaxes = [2.0**-10] * 100 + [1.0] * 9800 + [2.0**10] * 100
    calibrator = NVFP4ActMaxCalibrator(name=LAYER)
    calibrator.collect(blocks_with_amaxes(amaxes))
    with pytest.warns(UserWarning, match=rf"{LAYER}.*B_max / B_min = .*28672"):
        calibrator.compute_amax()
    assert calibrator.stats["set_by"] == "margin*B_max"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrator.compute_amax()


def test_no_dynamic_range_warning_within_the_fp8_window():
    """B_max / B_min = 2^3.125 (bins 250 and 270): far inside FP8's 28672, so no warning, and
    the default rho (16384) sets g_amax from B_min."""
    calibrator = NVFP4ActMaxCalibrator(name=LAYER)
    calibrator.collect(three_bin_activation())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g_amax = calibrator.compute_amax()
    assert calibrator.stats["set_by"] == "rho*B_min"
    assert g_amax.item() == torch.tensor(16384 * bin_centre(250), dtype=torch.float32).item()


@pytest.mark.parametrize(
    "rho", [0.0, -1.0, 28672.0, 1e5], ids=["zero", "negative", "edge", "above"]
)
def test_rho_outside_the_fp8_window_is_rejected(rho):
    with pytest.raises(ValueError, match=r"rho must be in \(0, 28672\)"):
        NVFP4ActMaxCalibrator(rho=rho)


def test_rho_just_inside_the_window_is_accepted():
    assert NVFP4ActMaxCalibrator(rho=28671.0).rho == 28671.0


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_bits=4), dict(axis=0), dict(unsigned=True), dict(block_size=32),
     dict(b_min_percentile=0.0), dict(b_max_percentile=101.0), dict(margin=0.0)],
    ids=["num_bits", "axis", "unsigned", "block_size", "b_min_percentile", "b_max_percentile",
         "margin"],
)
def test_nvfp4_act_max_rejects_settings_nvfp4_cannot_use(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        NVFP4ActMaxCalibrator(**kwargs)


@pytest.mark.parametrize("calibrator_class", [NVFP4ActMaxCalibrator, PercentileCalibrator])
def test_merge_equals_one_calibrator_that_saw_both_batches(calibrator_class):
    first, second = lognormal_activation(seed=3), lognormal_activation(seed=4, rows=100) * 50
    together, a, b = calibrator_class(), calibrator_class(), calibrator_class()
    together.collect(first)
    together.collect(second)
    a.collect(first)
    b.collect(second)
    a.merge(b)
    for key, value in together.state_dict().items():
        assert torch.equal(a.state_dict()[key], value), key
    assert a.compute_amax().item() == together.compute_amax().item()


def test_state_dicts_combine_by_their_declared_reductions_like_an_all_reduce():
    first, second = lognormal_activation(seed=5), lognormal_activation(seed=6) * 30
    together, a, b = NVFP4ActMaxCalibrator(), NVFP4ActMaxCalibrator(), NVFP4ActMaxCalibrator()
    for x, calibrator in ((first, a), (second, b)):
        calibrator.collect(x)
        together.collect(x)
    reduce = {"sum": torch.add, "max": torch.maximum}
    sa, sb = a.state_dict(), b.state_dict()
    combined = {k: reduce[op](sa[k], sb[k]) for k, op in a.STATE_REDUCTIONS.items()}
    fresh = NVFP4ActMaxCalibrator()
    fresh.load_state_dict(combined)
    assert fresh.compute_amax().item() == together.compute_amax().item()
    assert torch.equal(fresh.state_dict()["counts"], together.state_dict()["counts"])


def test_merge_into_an_empty_calibrator_copies_and_does_not_alias():
    source, target = NVFP4ActMaxCalibrator(), NVFP4ActMaxCalibrator()
    source.collect(lognormal_activation(seed=7))
    target.merge(source)
    target.collect(lognormal_activation(seed=8))
    assert int(target.state_dict()["counts"].sum()) > int(source.state_dict()["counts"].sum())


def test_merge_rejects_a_histogram_with_other_bins():
    a, b = NVFP4ActMaxCalibrator(), NVFP4ActMaxCalibrator(num_bins=256)
    b.collect(lognormal_activation(seed=9))
    with pytest.raises(ValueError, match="cannot merge"):
        a.merge(b)


def test_ragged_last_dim_counts_like_its_zero_padded_tensor():
    x = lognormal_activation(seed=10)[:, :20]
    padded = torch.nn.functional.pad(x, (0, 12))
    ragged_calibrator, padded_calibrator = NVFP4ActMaxCalibrator(), NVFP4ActMaxCalibrator()
    ragged_calibrator.collect(x)
    padded_calibrator.collect(padded)
    assert torch.equal(
        ragged_calibrator.state_dict()["counts"], padded_calibrator.state_dict()["counts"]
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_inputs_count_like_their_float32_values(dtype):
    x = lognormal_activation(seed=11).clamp(-6e4, 6e4).to(dtype)
    low, full = NVFP4ActMaxCalibrator(), NVFP4ActMaxCalibrator()
    low.collect(x)
    full.collect(x.float())
    assert torch.equal(low.state_dict()["counts"], full.state_dict()["counts"])


@pytest.mark.parametrize("calibrator_class", [NVFP4ActMaxCalibrator, PercentileCalibrator])
def test_all_zero_activations_give_the_documented_finite_fallback(calibrator_class):
    calibrator = calibrator_class(name=LAYER)
    calibrator.collect(torch.zeros(8, 64))
    with pytest.warns(UserWarning, match=rf"{LAYER}.*all-zero"):
        amax = calibrator.compute_amax()
    assert amax.item() == 1.0


def test_reset_forgets_everything():
    calibrator = NVFP4ActMaxCalibrator(name=LAYER)
    calibrator.collect(lognormal_activation(seed=12))
    calibrator.compute_amax()
    calibrator.reset()
    assert calibrator.stats is None
    with pytest.raises(RuntimeError, match=LAYER):
        calibrator.compute_amax()


# --- MaxCalibrator -------------------------------------------------------------------------------


def test_max_calibrator_tracks_the_literal_max_per_tensor_and_per_channel():
    first, second = lognormal_activation(seed=13), lognormal_activation(seed=14)
    per_tensor, per_row = MaxCalibrator(), MaxCalibrator(axis=0)
    for x in (first, second):
        per_tensor.collect(x)
        per_row.collect(x)
    both = torch.stack([first, second]).abs()
    assert per_tensor.compute_amax().item() == both.max().item()
    assert torch.equal(per_row.compute_amax(), both.amax(dim=(0, 2))[:, None])


def test_max_calibrator_merges_by_max_and_rejects_a_changed_channel_count():
    a, b = MaxCalibrator(axis=0), MaxCalibrator(axis=0)
    a.collect(torch.ones(4, 16))
    b.collect(torch.full((4, 16), 3.0))
    a.merge(b)
    assert torch.equal(a.compute_amax(), torch.full((4, 1), 3.0))
    with pytest.raises(ValueError, match="amax shape changed"):
        a.collect(torch.ones(5, 16))


def test_merging_observers_that_saw_other_channel_counts_is_refused_naming_both():
    """The merge raised torch's broadcast error, naming neither observer."""
    a, b = MaxCalibrator(axis=0, name=LAYER), MaxCalibrator(axis=0, name="other")
    a.collect(torch.ones(8, 16))
    b.collect(torch.ones(4, 16))
    with pytest.raises(ValueError, match=rf"{LAYER}.*cannot merge MaxCalibrator\('other'\).*amax \(8, 1\) vs \(4, 1\)"):
        a.merge(b)
    assert torch.equal(a.compute_amax(), torch.ones(8, 1))


def test_max_calibrator_of_zeros_is_zero():
    calibrator = MaxCalibrator()
    calibrator.collect(torch.zeros(2, 16))
    assert calibrator.compute_amax().item() == 0.0


# --- MseCalibrator -------------------------------------------------------------------------------


def brute_force_mse_amax(batches, amax, multipliers, reduce_dims):
    """argmin over multipliers of the summed squared NVFP4 fake-quant error, per channel."""
    losses = []
    for m in multipliers.tolist():
        scale = per_tensor_amax_to_scale(amax * m)
        losses.append(
            sum(((x.float() - fake_quantize_nvfp4(x.float(), scale)) ** 2).sum(dim=reduce_dims)
                for x in batches)
        )
    best = torch.stack(losses).argmin(dim=0)
    return amax * multipliers[best].reshape(amax.shape)


def test_mse_multiplier_grid_follows_step_size():
    assert torch.equal(MseCalibrator(torch.tensor(1.0)).multipliers, torch.linspace(0.25, 4.0, 39))
    # (1.0 - 0.5) / 0.1 is 5.000000000000001 in floats: still 6 points, not 7.
    grid = MseCalibrator(torch.tensor(1.0), start_multiplier=0.5, stop_multiplier=1.0)
    assert torch.equal(grid.multipliers, torch.linspace(0.5, 1.0, 6))


UNSEARCHABLE_AMAXES = {
    "NaN": (torch.tensor(float("nan")), {}, r"1 of its 1 values are not \(first nan at index \(\)\)"),
    "negative": (torch.tensor(-2.0), {}, r"1 of its 1 values are not \(first -2.0 at index \(\)\)"),
    "Inf in one row": (torch.tensor([[1.0], [float("inf")], [2.0]]), {"axis": 0}, r"1 of its 3 values .*index \(1, 0\)"),
    "overflowing at the grid's top": (torch.tensor(1e38), {}, r"stop_multiplier \(4.0\) finite"),
    "overflowing at a wider grid's top": (torch.tensor(1e37), {"stop_multiplier": 100.0}, r"stop_multiplier \(100.0\)"),
}


@pytest.mark.parametrize("amax, kwargs, message", UNSEARCHABLE_AMAXES.values(), ids=UNSEARCHABLE_AMAXES.keys())
def test_mse_calibrator_refuses_an_amax_it_cannot_search_around(amax, kwargs, message):
    """Taken as they were: a NaN or negative amax came back from compute_amax, and an amax whose
    multiples overflow made collect blame the activations for an overflowing statistic."""
    with pytest.raises(ValueError, match=rf"{LAYER}.*amax must be finite and >= 0.*{message}"):
        MseCalibrator(amax, name=LAYER, **kwargs)


def test_mse_calibrator_searches_around_a_zero_amax():
    calibrator = MseCalibrator(torch.tensor(0.0), name=LAYER)
    calibrator.collect(torch.randn(4, 32))
    assert calibrator.compute_amax().item() == 0.0


def test_mse_calibrator_per_tensor_picks_the_brute_force_argmin():
    batches = [lognormal_activation(seed, rows=32).bfloat16() for seed in (15, 16)]
    amax = torch.stack(batches).abs().max().float()
    calibrator = MseCalibrator(amax)
    for x in batches:
        calibrator.collect(x)
    expected = brute_force_mse_amax(batches, amax, torch.linspace(0.25, 4.0, 39), (0, 1))
    assert calibrator.compute_amax().item() == expected.item()
    assert calibrator.state_dict()["losses"].shape == (39,)


def test_mse_calibrator_per_channel_picks_the_brute_force_argmin_per_row():
    generator = torch.Generator().manual_seed(17)
    weight = torch.randn(12, 64, generator=generator) * torch.rand(12, 1, generator=generator)
    amax = weight.abs().amax(dim=1, keepdim=True)
    calibrator = MseCalibrator(amax, axis=0, step_size=0.25)
    calibrator.collect(weight)
    multipliers = torch.linspace(0.25, 4.0, 16)
    expected = brute_force_mse_amax([weight], amax, multipliers, (1,))
    assert torch.equal(calibrator.compute_amax(), expected)
    assert calibrator.state_dict()["losses"].shape == (16, 12)


def test_mse_calibrator_uses_the_given_quant_and_error_funcs_and_breaks_ties_low():
    """Clipping at amax * m is exact once amax * m >= max |x|: every such m ties at zero error,
    and the smallest wins."""
    x = torch.linspace(-3.0, 3.0, 64).reshape(4, 16)
    calibrator = MseCalibrator(
        torch.tensor(3.0),
        quant_func=lambda x, amax: x.clamp(-amax, amax),
        error_func=lambda x, xq: (x - xq).abs(),
    )
    calibrator.collect(x)
    grid = torch.linspace(0.25, 4.0, 39)
    assert calibrator.compute_amax().item() == (3.0 * grid[grid >= 1.0][0]).item()


def test_mse_calibrator_merge_equals_one_that_saw_both_batches():
    first, second = lognormal_activation(seed=18, rows=16), lognormal_activation(seed=19, rows=16)
    amax = torch.tensor(100.0)
    together, a, b = MseCalibrator(amax), MseCalibrator(amax), MseCalibrator(amax)
    together.collect(first)
    together.collect(second)
    a.collect(first)
    b.collect(second)
    a.merge(b)
    assert torch.equal(a.state_dict()["losses"], together.state_dict()["losses"])
    assert a.compute_amax().item() == together.compute_amax().item()


def test_mse_calibrator_with_zero_amax_stays_zero_and_finite():
    calibrator = MseCalibrator(torch.tensor(0.0))
    calibrator.collect(torch.zeros(2, 32))
    assert calibrator.compute_amax().item() == 0.0
    assert bool(torch.isfinite(calibrator.state_dict()["losses"]).all())


def test_default_quant_func_maps_a_zero_amax_to_zero_and_others_to_nvfp4():
    x = lognormal_activation(seed=32, rows=3)
    amax = torch.tensor([[0.0], [5.0], [70.0]])
    xq = nvfp4_fake_quantize_with_amax(x, amax)
    assert torch.equal(xq[0], torch.zeros(320))
    for row in (1, 2):
        expected = fake_quantize_nvfp4(x[row], per_tensor_amax_to_scale(amax[row, 0]))
        assert torch.equal(xq[row], expected)


def test_mse_calibrator_on_zero_data_returns_a_finite_positive_amax():
    calibrator = MseCalibrator(torch.tensor(2.0))
    calibrator.collect(torch.zeros(2, 32))
    assert calibrator.compute_amax().item() == 0.5  # all losses tie at 0: the smallest, 0.25 * 2


def test_mse_calibrator_handles_a_ragged_last_dim():
    x = lognormal_activation(seed=20, rows=8)[:, :40]
    amax = x.abs().max()
    calibrator = MseCalibrator(amax)
    calibrator.collect(x)
    padded = torch.nn.functional.pad(x, (0, 8))
    expected = brute_force_mse_amax([padded], amax, torch.linspace(0.25, 4.0, 39), (0, 1))
    assert calibrator.compute_amax().item() == expected.item()


@pytest.mark.parametrize(
    "amax, axis, match",
    [
        (torch.ones(4, 1), None, "amax has 4 values"),
        (torch.ones(3, 1), 0, "amax has 3 values"),
        (torch.ones(1, 32), -1, "last dim"),
    ],
    ids=["per_tensor_with_channel_amax", "wrong_channel_count", "last_dim_axis"],
)
def test_mse_calibrator_rejects_mismatched_amax_and_axis(amax, axis, match):
    calibrator = MseCalibrator(amax, axis=axis)
    with pytest.raises(ValueError, match=match):
        calibrator.collect(torch.ones(4, 32))


def test_mse_calibrator_rejects_an_empty_grid():
    with pytest.raises(ValueError, match="start_multiplier <= stop_multiplier"):
        MseCalibrator(torch.tensor(1.0), start_multiplier=2.0, stop_multiplier=1.0)


# --- NVFP4MSECalibrator and BlockHessianAccumulator ----------------------------------------------

FP8_CANDIDATES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)


def weight_with_varied_blocks(seed: int, rows: int = 24, cols: int = 64) -> torch.Tensor:
    """Blocks spanning 2^-16..1 of the global max (some need subnormal scales), two zeroed."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randn(rows, cols // 16, 16, generator=generator)
    gains = 2.0 ** torch.randint(-16, 1, (rows, cols // 16, 1), generator=generator).float()
    weight = (blocks * gains).reshape(rows, cols)
    weight[0, :16] = 0.0
    weight[5, 32:48] = 0.0
    return weight


def block_errors(weight, global_amax, block_scales, hessian=None):
    """Per-block ``sum dw^2`` or ``dw^T H dw`` of quantizing with the given FP8 block scales."""
    scale = per_tensor_amax_to_scale(global_amax)
    qdata, scales = quantize_nvfp4(weight, scale, block_scales)
    dw = (weight - dequantize_nvfp4(qdata, scales, scale)).reshape(*block_scales.shape, 16)
    if hessian is None:
        return (dw * dw).sum(dim=-1)
    return torch.einsum("rbi,bij,rbj->rb", dw, hessian, dw)


def brute_force_sweep(weight, global_amax, hessian=None):
    """Try each of the 126 FP8 values as every block's scale; keep the first of least error."""
    shape = (weight.shape[0], weight.shape[1] // 16)
    errors = torch.stack(
        [block_errors(weight, global_amax, c.repeat(*shape), hessian) for c in FP8_CANDIDATES]
    )
    return FP8_CANDIDATES[errors.argmin(dim=0)]


def random_block_hessian(seed: int, in_features: int = 64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    accumulator = BlockHessianAccumulator(in_features)
    x = torch.randn(256, in_features, generator=generator)
    accumulator.collect(x * torch.rand(in_features, generator=generator) * 4)
    return accumulator.hessian


def sweep(weight, hessian=None, global_amax=None):
    global_amax = weight.abs().max() if global_amax is None else global_amax
    calibrator = NVFP4MSECalibrator(
        torch.zeros(weight.shape[0], weight.shape[1] // 16), global_amax, hessian=hessian
    )
    calibrator.collect(weight)
    return calibrator


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_weight_sweep_refuses_a_hessian_holding_nan_or_inf_naming_the_layer(value):
    """Every candidate's error was NaN and the sweep kept block scales of 0: an all-zero weight."""
    weight = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    hessian = torch.eye(16).repeat(2, 1, 1)
    hessian[1, 2, 2] = value
    calibrator = NVFP4MSECalibrator(torch.zeros(4, 2), weight.abs().max(), hessian=hessian, name=LAYER)
    with pytest.raises(ValueError, match=f"'{LAYER}'.*the Hessian holds NaN or Inf"):
        calibrator.collect(weight)


@pytest.mark.parametrize("fraction", [0.25, 0.99, 1e-6], ids=["a quarter", "just under", "a millionth"])
def test_weight_sweep_refuses_a_global_amax_below_the_weights_max_naming_the_layer(fraction):
    """Every block scale saturated at 448 and the largest blocks were clipped, silently."""
    weight = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    calibrator = NVFP4MSECalibrator(torch.zeros(4, 2), fraction * weight.abs().max(), name=LAYER)
    with pytest.raises(ValueError, match=f"'{LAYER}'.*global_amax .* is below the weight's max"):
        calibrator.collect(weight)


def test_weight_sweep_takes_a_global_amax_at_or_above_the_weights_max():
    """A tied group's amax is at least each member's max |w|."""
    weight = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    for global_amax in (weight.abs().max(), 2 * weight.abs().max()):
        assert sweep(weight, global_amax=global_amax).block_scales_e4m3.float().min() > 0


def test_weight_sweep_refuses_a_global_amax_too_small_for_it_naming_the_layer():
    weight = torch.full((4, 32), 1e-35)
    calibrator = NVFP4MSECalibrator(torch.zeros(4, 2), torch.tensor(1e-35), name=LAYER)
    with pytest.raises(ValueError, match=f"'{LAYER}'.*global amax 1e-35 is too small"):
        calibrator.collect(weight)


@pytest.mark.parametrize("weighting", ["plain", "hessian"])
def test_weight_sweep_matches_a_brute_force_over_the_126_candidates(weighting):
    weight = weight_with_varied_blocks(seed=21)
    hessian = random_block_hessian(seed=22) if weighting == "hessian" else None
    chosen = sweep(weight, hessian).block_scales_e4m3
    expected = brute_force_sweep(weight, weight.abs().max(), hessian)
    assert torch.equal(chosen.view(torch.uint8), expected.view(torch.uint8))


def test_weight_sweep_with_identity_hessian_equals_the_plain_sweep():
    weight = weight_with_varied_blocks(seed=23)
    identity = torch.eye(16).expand(4, 16, 16).contiguous()
    plain = sweep(weight).block_scales_e4m3
    weighted = sweep(weight, identity).block_scales_e4m3
    assert torch.equal(plain.view(torch.uint8), weighted.view(torch.uint8))


@pytest.mark.parametrize("weighting", ["plain", "hessian"])
def test_weight_sweep_error_is_never_above_the_max_scale_error(weighting):
    """The max-based scale is one of the 126 candidates, so the sweep cannot do worse."""
    weight = weight_with_varied_blocks(seed=24)
    hessian = random_block_hessian(seed=25) if weighting == "hessian" else None
    global_amax = weight.abs().max()
    chosen = sweep(weight, hessian).block_scales_e4m3
    max_scales = compute_block_scales(weight, per_tensor_amax_to_scale(global_amax))
    swept = block_errors(weight, global_amax, chosen, hessian)
    max_based = block_errors(weight, global_amax, max_scales, hessian)
    assert bool((swept <= max_based).all())
    assert bool((swept < max_based).any())


def test_weight_sweep_amax_reproduces_the_chosen_block_scales():
    weight = weight_with_varied_blocks(seed=26)
    calibrator = sweep(weight)
    amax = calibrator.compute_amax()
    assert amax.shape == (24, 4) and amax.dtype == torch.float32
    scale = per_tensor_amax_to_scale(weight.abs().max())
    recomputed = (amax / 6.0 / scale).to(torch.float8_e4m3fn)
    assert torch.equal(recomputed.view(torch.uint8), calibrator.block_scales_e4m3.view(torch.uint8))


def test_weight_sweep_of_an_all_zero_weight_uses_the_smallest_normal_scale():
    calibrator = sweep(torch.zeros(4, 32), global_amax=torch.tensor(0.0))
    assert bool((calibrator.block_scales_e4m3.to(torch.float32) == 2.0**-6).all())
    assert torch.equal(calibrator.compute_amax(), torch.zeros(4, 2))


def test_weight_sweep_pads_a_ragged_last_dim():
    weight = weight_with_varied_blocks(seed=27)[:, :40]
    calibrator = NVFP4MSECalibrator(torch.zeros(24, 3), weight.abs().max())
    calibrator.collect(weight)
    padded = torch.nn.functional.pad(weight, (0, 8))
    expected = brute_force_sweep(padded, weight.abs().max())
    assert torch.equal(calibrator.block_scales_e4m3.view(torch.uint8), expected.view(torch.uint8))


def test_weight_sweep_is_one_shot_until_reset():
    weight = weight_with_varied_blocks(seed=28)
    calibrator = sweep(weight)
    with pytest.raises(RuntimeError, match="reset"):
        calibrator.collect(weight)
    calibrator.reset()
    calibrator.collect(weight)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(axis=0), ValueError, "axis must be None"),
        (dict(quant_func=lambda x, a: x), NotImplementedError, "quant_func"),
        (dict(error_func=lambda x, xq: x), NotImplementedError, "error_func"),
        (dict(global_amax=torch.tensor(-1.0)), ValueError, "global_amax"),
        (dict(global_amax=torch.tensor(float("nan"))), ValueError, "global_amax"),
    ],
    ids=["axis", "quant_func", "error_func", "negative_global_amax", "nan_global_amax"],
)
def test_weight_sweep_rejects_unsupported_settings(kwargs, error, match):
    arguments = dict(amax=torch.zeros(4, 2), global_amax=torch.tensor(1.0)) | kwargs
    with pytest.raises(error, match=match):
        NVFP4MSECalibrator(**arguments)


@pytest.mark.parametrize(
    "amax, hessian, match",
    [
        (torch.zeros(4, 3), None, "amax has shape"),
        (torch.zeros(4, 2), torch.zeros(3, 16, 16), "hessian has shape"),
    ],
    ids=["amax_shape", "hessian_shape"],
)
def test_weight_sweep_rejects_mismatched_shapes(amax, hessian, match):
    calibrator = NVFP4MSECalibrator(amax, torch.tensor(1.0), hessian=hessian, name=LAYER)
    with pytest.raises(ValueError, match=match):
        calibrator.collect(torch.ones(4, 32))


def test_block_hessian_sums_outer_products_over_batches_and_counts_tokens():
    generator = torch.Generator().manual_seed(29)
    first = torch.randn(3, 5, 40, generator=generator)
    second = torch.randn(7, 40, generator=generator)
    accumulator = BlockHessianAccumulator(40)
    accumulator.collect(first)
    accumulator.collect(second.bfloat16())
    tokens = torch.cat([first.reshape(15, 40), second.bfloat16().float()]).double()
    padded = torch.nn.functional.pad(tokens, (0, 8))
    expected = torch.stack([block.T @ block for block in padded.split(16, dim=1)])
    torch.testing.assert_close(accumulator.hessian.double(), expected, rtol=1e-5, atol=1e-5)
    assert accumulator.num_tokens == 22
    assert bool((accumulator.hessian[2, 8:] == 0).all())


def test_block_hessian_merge_equals_one_accumulator_that_saw_both():
    generator = torch.Generator().manual_seed(30)
    first, second = torch.randn(9, 32, generator=generator), torch.randn(4, 32, generator=generator)
    together, a, b = (BlockHessianAccumulator(32) for _ in range(3))
    together.collect(first)
    together.collect(second)
    a.collect(first)
    b.collect(second)
    a.merge(b)
    assert torch.equal(a.hessian, together.hessian) and a.num_tokens == 13


def test_block_hessian_rejects_the_wrong_width():
    with pytest.raises(ValueError, match="in_features=32"):
        BlockHessianAccumulator(32, name=LAYER).collect(torch.ones(4, 48))


# --- Bad input, for every observer ---------------------------------------------------------------

OBSERVERS = {
    "nvfp4_act_max": lambda: NVFP4ActMaxCalibrator(name=LAYER),
    "percentile": lambda: PercentileCalibrator(name=LAYER),
    "max": lambda: MaxCalibrator(name=LAYER),
    "mse": lambda: MseCalibrator(torch.tensor(1.0), name=LAYER),
    "mse_anchored_at_the_first_batch": lambda: FirstBatchMseCalibrator(name=LAYER),
    "nvfp4_mse": lambda: NVFP4MSECalibrator(torch.zeros(4, 2), torch.tensor(8.0), name=LAYER),
    "block_hessian": lambda: BlockHessianAccumulator(32, name=LAYER),
}
CALIBRATORS = {key: make for key, make in OBSERVERS.items() if key != "block_hessian"}


@pytest.mark.parametrize("make", OBSERVERS.values(), ids=OBSERVERS.keys())
def test_non_finite_input_is_refused_with_counts_shape_and_name(make):
    x = torch.ones(4, 32)
    x[0, 1] = x[2, 3] = float("nan")
    x[3, 0] = float("-inf")
    observer = make()
    with pytest.raises(ValueError, match=rf"{LAYER}.*shape \(4, 32\).*2 NaN and 1 Inf.*\(0, 1\)"):
        observer.collect(x)


@pytest.mark.parametrize("make", OBSERVERS.values(), ids=OBSERVERS.keys())
def test_a_0d_input_is_refused_naming_the_layer(make):
    """It raised IndexError from deep inside (a tuple index out of range)."""
    with pytest.raises(ValueError, match=rf"{LAYER}.*takes a tensor with a last \(feature\) dim; got a 0-d tensor"):
        make().collect(torch.tensor(3.0))


ACTIVATION_CALIBRATORS = {key: make for key, make in CALIBRATORS.items() if key != "nvfp4_mse"}


@pytest.mark.parametrize("make", ACTIVATION_CALIBRATORS.values(), ids=ACTIVATION_CALIBRATORS.keys())
def test_a_batch_without_tokens_is_skipped(make):
    """MaxCalibrator raised IndexError (amax over no elements), MseCalibrator a reshape error."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
    alone, with_empty = make(), make()
    alone.collect(x)
    with_empty.collect(torch.empty(0, 32))
    with_empty.collect(x)
    assert torch.equal(with_empty.compute_amax(), alone.compute_amax())


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64], ids=["fp64", "int64"])
@pytest.mark.parametrize("make", OBSERVERS.values(), ids=OBSERVERS.keys())
def test_unsupported_dtypes_are_refused(make, dtype):
    with pytest.raises(TypeError, match=rf"{LAYER}.*supported dtypes"):
        make().collect(torch.ones(4, 32, dtype=dtype))


@pytest.mark.parametrize("make", CALIBRATORS.values(), ids=CALIBRATORS.keys())
def test_compute_amax_before_collect_raises_naming_the_layer(make):
    with pytest.raises(RuntimeError, match=rf"{LAYER}.*before any collect"):
        make().compute_amax()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("make", OBSERVERS.values(), ids=OBSERVERS.keys())
def test_supported_dtypes_are_accepted(make, dtype):
    observer = make()
    observer.collect(torch.randn(4, 32, generator=torch.Generator().manual_seed(31)).to(dtype))
    if isinstance(observer, BlockHessianAccumulator):
        result = observer.hessian.diagonal(dim1=1, dim2=2)  # sums of squares: positive
    else:
        result = observer.compute_amax()
    assert bool(torch.isfinite(result).all()) and bool((result > 0).all())


def test_state_dict_before_collect_raises():
    with pytest.raises(RuntimeError, match="state_dict"):
        NVFP4ActMaxCalibrator(name=LAYER).state_dict()


def test_load_state_dict_rejects_wrong_keys_and_shapes():
    calibrator = NVFP4ActMaxCalibrator()
    with pytest.raises(ValueError, match="keys"):
        calibrator.load_state_dict({"counts": torch.zeros(512, dtype=torch.int64)})
    calibrator.collect(torch.ones(2, 16))
    with pytest.raises(ValueError, match="shape"):
        calibrator.load_state_dict(
            {"counts": torch.zeros(3, dtype=torch.int64), "literal_max": torch.zeros(())}
        )


FRESH_STATES = {
    "histogram of 10 bins": (lambda: PercentileCalibrator(name=LAYER),
                             {"counts": torch.ones(10, dtype=torch.int64), "literal_max": torch.tensor(1.0)},
                             r"state 'counts' has shape \(10,\), expected \(512,\)"),
    "literal max of two": (lambda: PercentileCalibrator(name=LAYER),
                           {"counts": torch.ones(512, dtype=torch.int64), "literal_max": torch.ones(2)},
                           r"state 'literal_max' has shape \(2,\), expected \(\)"),
    "hessian of 3 blocks": (lambda: BlockHessianAccumulator(64, name=LAYER),
                            {"hessian": torch.zeros(3, 16, 16), "num_tokens": torch.tensor(0)},
                            r"state 'hessian' has shape \(3, 16, 16\), expected \(4, 16, 16\)"),
    "full hessian of another width": (lambda: FullHessianAccumulator(32, name=LAYER),
                                      {"hessian": torch.zeros(16, 16), "num_tokens": torch.tensor(0)},
                                      r"expected \(32, 32\)"),
    "a float amax": (lambda: MaxCalibrator(name=LAYER), {"amax": 3.0}, r"state 'amax' is a float, not a tensor"),
}


@pytest.mark.parametrize("make, state, message", FRESH_STATES.values(), ids=FRESH_STATES.keys())
def test_a_fresh_observer_refuses_a_state_its_settings_do_not_fit(make, state, message):
    """Taken as it was: the histogram read 2.5e-12 from 10 counts, the Hessian failed at the next
    collect with a broadcast error, a float amax raised AttributeError."""
    observer = make()
    with pytest.raises(ValueError, match=rf"{LAYER}.*{message}"):
        observer.load_state_dict(state)
    with pytest.raises(RuntimeError):
        observer.state_dict()


def test_a_fresh_observer_takes_a_state_of_its_shapes():
    full = FullHessianAccumulator(32, name=LAYER)
    full.load_state_dict({"hessian": torch.eye(32), "num_tokens": torch.tensor(4)})
    assert torch.equal(full.state_dict()["hessian"], torch.eye(32))


IMPOSSIBLE_STATES = {
    "NaN amax": (lambda: MaxCalibrator(name=LAYER), {"amax": torch.tensor(float("nan"))},
                 r"state 'amax' of shape \(\) holds 1 NaN and 0 Inf values"),
    "Inf literal max": (lambda: PercentileCalibrator(name=LAYER),
                        {"counts": torch.ones(512, dtype=torch.int64), "literal_max": torch.tensor(float("inf"))},
                        r"state 'literal_max' of shape \(\) holds 0 NaN and 1 Inf values"),
    "negative counts": (lambda: PercentileCalibrator(name=LAYER),
                        {"counts": -torch.ones(512, dtype=torch.int64), "literal_max": torch.tensor(1.0)},
                        r"state 'counts' of shape \(512,\) holds 512 negative values"),
    "negative token count": (lambda: BlockHessianAccumulator(32, name=LAYER),
                             {"hessian": torch.zeros(2, 16, 16), "num_tokens": torch.tensor(-3)},
                             r"state 'num_tokens' of shape \(\) holds 1 negative values"),
    "NaN in a Hessian": (lambda: FullHessianAccumulator(16, name=LAYER),
                         {"hessian": torch.eye(16).index_fill(0, torch.tensor([2]), float("nan")),
                          "num_tokens": torch.tensor(4)},
                         r"state 'hessian' of shape \(16, 16\) holds 16 NaN"),
}


@pytest.mark.parametrize("make, state, message", IMPOSSIBLE_STATES.values(), ids=IMPOSSIBLE_STATES.keys())
def test_load_state_dict_refuses_values_no_data_could_give(make, state, message):
    """Taken as they were: negative counts raised IndexError when the histogram was read, a NaN
    amax came back from compute_amax. A refused load leaves the collected state as it was."""
    observer = make()
    width = 16 if isinstance(observer, FullHessianAccumulator) else 32
    observer.collect(torch.rand(4, width))
    before = observer.state_dict()
    with pytest.raises(ValueError, match=rf"{LAYER}.*{message}"):
        observer.load_state_dict(state)
    after = observer.state_dict()
    assert all(torch.equal(after[key], before[key]) for key in before)


def test_a_hessian_state_may_hold_negative_entries():
    """Off the diagonal a sum of x x^T is negative wherever two inputs are anticorrelated."""
    hessian = torch.tensor([[1.0, -0.5], [-0.5, 1.0]]).repeat(8, 8)
    observer = FullHessianAccumulator(16, name=LAYER)
    observer.load_state_dict({"hessian": hessian, "num_tokens": torch.tensor(2)})
    assert torch.equal(observer.state_dict()["hessian"], hessian)


def test_a_refused_batch_leaves_the_histogram_as_it_was():
    calibrator = NVFP4ActMaxCalibrator(name="layer")
    calibrator.collect(torch.randn(8, 64))
    before = calibrator.state_dict()
    bad = torch.randn(8, 64) * 100
    bad[3, 7] = float("inf")
    with pytest.raises(ValueError, match="1 Inf"):
        calibrator.collect(bad)
    after = calibrator.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize(
    "make",
    [lambda: NVFP4ActMaxCalibrator(name=LAYER), lambda: BlockHessianAccumulator(64, name=LAYER)],
    ids=["histogram", "block_hessian"],
)
def test_calibration_goes_on_after_a_refused_batch_as_if_it_never_came(make, device):
    """The state before each batch is kept in reused buffers: a refusal restores it, and the
    batches after it accumulate exactly as in a run that never saw the bad one (on CUDA the
    refusal is reported later, at settle() or the next collect)."""
    batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).to(device) for i in range(4)]
    bad = batches[1].clone()
    bad[2, 5] = float("nan")
    clean, interrupted = make(), make()
    for batch in batches:
        clean.collect(batch)
    for batch in batches[:2]:
        interrupted.collect(batch)
    with pytest.raises(ValueError, match=f"{LAYER}.*NaN"):
        interrupted.collect(bad)
        interrupted.settle()
    for batch in batches[2:]:
        interrupted.collect(batch)
    expected, got = clean.state_dict(), interrupted.state_dict()
    assert all(torch.equal(expected[key], got[key]) for key in expected)


@pytest.mark.parametrize("width", [0, -16, 64.5, float("nan"), "64", True], ids=["zero", "negative", "fraction", "nan",
                                                                         "string", "bool"])
def test_block_hessian_needs_a_positive_integer_width(width):
    """64.5 became 64; NaN and a string raised bare errors."""
    with pytest.raises(ValueError, match=rf"{LAYER}.*in_features must be an integer >= 1, got {re.escape(repr(width))}"):
        BlockHessianAccumulator(width, name=LAYER)


BADLY_TYPED_ARGUMENTS = {
    "percentile string": (lambda: PercentileCalibrator(percentile="50", name=LAYER), "percentile='50' must be a number"),
    "percentile bool": (lambda: PercentileCalibrator(percentile=True, name=LAYER), "percentile=True must be a number"),
    "rho string": (lambda: NVFP4BMinCalibrator(rho="1", name=LAYER), "rho='1' must be a number"),
    "margin tensor": (lambda: NVFP4BMinCalibrator(margin=torch.tensor(1.0), name=LAYER), "margin=tensor"),
    "log2_min string": (lambda: PercentileCalibrator(log2_min="-40", name=LAYER), "log2_min='-40' must be a number"),
    "step string": (lambda: MseCalibrator(torch.tensor(1.0), step_size="0.1", name=LAYER), "step_size='0.1' must be"),
    "max axis string": (lambda: MaxCalibrator(axis="0", name=LAYER), "axis='0' must be None or an integer"),
    "max axis bool": (lambda: MaxCalibrator(axis=True, name=LAYER), "axis=True must be None or an integer"),
    "mse axis float": (lambda: MseCalibrator(torch.ones(4, 1), axis=0.0, name=LAYER), "axis=0.0 must be None or"),
    "sweep amax list": (lambda: NVFP4MSECalibrator([1.0] * 8, torch.tensor(8.0), name=LAYER), "amax must be a tensor"),
    "sweep hessian list": (lambda: NVFP4MSECalibrator(torch.zeros(4, 2), torch.tensor(8.0), hessian=[[1.0]], name=LAYER),
                           "hessian must be a tensor"),
}


@pytest.mark.parametrize("make, message", BADLY_TYPED_ARGUMENTS.values(), ids=BADLY_TYPED_ARGUMENTS.keys())
def test_badly_typed_constructor_arguments_are_refused_naming_the_observer(make, message):
    """Each raised a bare TypeError ('<' not supported ...) or AttributeError, or read a bool as 1."""
    with pytest.raises(TypeError, match=rf"{LAYER}.*{re.escape(message)}"):
        make()
