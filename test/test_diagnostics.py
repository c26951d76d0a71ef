"""Layer diagnostics on toy models: one report per converted layer, numbers checked independently."""

import copy
import math

import pytest
import torch

from conftest import DIM, calibration_batches, make, quantized
from models import MLP, TransformerBlock
from nvfp4_static import NVFP4StaticLinear, clip_counts, enable_clip_monitor
from nvfp4_static.diagnostics import format_diagnostics, layer_diagnostics, snr_db
from nvfp4_static.numerics import fake_quantize_nvfp4, largest_at_most, per_tensor_amax_to_scale


def float_and_converted(model_cls, **config):
    torch.manual_seed(0)
    float_model = model_cls()
    return float_model, quantized(copy.deepcopy(float_model), **config)


@pytest.mark.parametrize("model_cls", [MLP, TransformerBlock], ids=["mlp", "block"])
def test_one_report_per_converted_layer_carrying_its_calibration(model_cls):
    float_model, model = float_and_converted(model_cls)
    report = layer_diagnostics(model, calibration_batches(1, seed=1)[0], reference_model=float_model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4StaticLinear)}
    assert [d.name for d in report] == list(layers)
    for d in report:
        assert d.act_global_amax == layers[d.name].act_global_amax
        assert d.calibration_stats["g_amax"] == pytest.approx(d.act_global_amax, rel=1e-6)
        assert d.calibration_stats["set_by"] in ("rho*B_min", "margin*B_max")
        assert d.recipe == {"act_calibration": "b_min", "weight_scale": "hessian_mse"}  # the defaults
        assert d.calls == 1 and not d.warned
        # NVFP4 keeps about 20 dB on Gaussian-like data per operand; 12 dB is far above what a
        # wrong scale or a mismatched reference layer (near 0 dB or below) would give.
        assert d.weight_snr_db > 12 and d.output_snr_db > 12 and d.act_snr_db > 12
    assert not model._forward_hooks and not any(m._forward_hooks for m in layers.values())


def test_first_layer_numbers_match_an_independent_computation():
    _, model = float_and_converted(MLP, act_calibration="max", weight_scale="max")
    x = calibration_batches(1, seed=2, scale=4.0)[0]  # 4x the calibration scale: some elements clip
    up = layer_diagnostics(model, x)[0]
    g_amax = model.up.act_global_amax
    static = fake_quantize_nvfp4(x, per_tensor_amax_to_scale(torch.tensor(g_amax)))
    dynamic = fake_quantize_nvfp4(x, per_tensor_amax_to_scale(x.abs().amax()))
    assert up.name == "up" and up.batch_amax == float(x.abs().amax())
    assert up.clipped_fraction == float((x.abs() > g_amax).double().mean()) > 0
    assert up.act_snr_db == pytest.approx(snr_db(x, static), abs=1e-9)
    assert up.act_dynamic_snr_db == pytest.approx(snr_db(x, dynamic), abs=1e-9)
    assert up.act_snr_db < up.act_dynamic_snr_db  # clipping costs the static scale
    assert up.weight_snr_db is None and up.output_snr_db is None


def test_in_range_batch_does_not_clip_and_small_blocks_count_as_subnormal():
    _, model = float_and_converted(MLP, act_calibration="max")
    x = calibration_batches(1, seed=3, scale=0.5)[0]
    x[0, 0, :16] = model.up.act_global_amax / 1e5  # one block far below g_amax / 28672
    up = layer_diagnostics(model, x)[0]
    assert up.clipped_fraction == 0
    assert up.subnormal_block_fraction == pytest.approx(1 / (x.numel() // 16))


def test_a_layer_called_twice_is_summed_over_both_calls():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(DIM, DIM)

        def forward(self, x):
            return self.linear(torch.tanh(self.linear(x)))

    float_model, model = float_and_converted(Twice, act_calibration="max")
    # Twice the calibration range: the first call's input clips, the second's (tanh) cannot.
    x = calibration_batches(1, seed=4)[0] * 2
    clipped_in_first_call = int((x.abs() > model.linear.act_global_amax).sum())
    assert clipped_in_first_call > 0
    (d,) = layer_diagnostics(model, x, reference_model=float_model)
    assert d.calls == 2 and math.isfinite(d.output_snr_db)
    assert d.clipped_fraction == pytest.approx(clipped_in_first_call / (2 * x.numel()))
    assert d.batch_amax == pytest.approx(float(x.abs().max()))


def test_wide_block_amax_range_is_flagged():
    torch.manual_seed(0)
    calibration = calibration_batches(2, seed=5, scale=1e-2)
    for batch in calibration:
        batch[:, :4, :16] *= 1e5  # a few blocks ~1e5x larger than the rest: beyond 28672
    with pytest.warns(UserWarning, match="B_max / B_min"):
        model = quantized(MLP(), batches=calibration)
    report = {d.name: d for d in layer_diagnostics(model, calibration[0])}
    assert report["up"].warned
    assert "!" in format_diagnostics(report.values()).splitlines()[2]


@pytest.mark.parametrize(
    "wrap", [lambda x: x, lambda x: (x,), lambda x: {"x": x}], ids=["tensor", "tuple", "mapping"]
)
def test_batch_may_be_a_tensor_a_tuple_or_a_mapping(wrap):
    _, model = float_and_converted(MLP)
    assert len(layer_diagnostics(model, wrap(calibration_batches(1, seed=6)[0]))) == 2


def test_format_lists_every_layer_or_only_the_worst():
    float_model, model = float_and_converted(TransformerBlock)
    report = layer_diagnostics(model, calibration_batches(1, seed=7)[0], reference_model=float_model)
    table = format_diagnostics(report)
    assert all(d.name in table for d in report)
    worst = min(report, key=lambda d: d.act_snr_db)
    short = format_diagnostics(report, max_rows=1).splitlines()
    assert len(short) == 3 and short[2].startswith(worst.name)


def test_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="no NVFP4StaticLinear"):
        layer_diagnostics(MLP(), calibration_batches(1, seed=8)[0])
    _, model = float_and_converted(MLP)
    with pytest.raises(ValueError, match="no module 'up'"):
        layer_diagnostics(model, calibration_batches(1, seed=8)[0], reference_model=torch.nn.Sequential())


REFERENCE_MISMATCHES = {
    "other out_features": lambda ref: setattr(ref, "down", torch.nn.Linear(128, 32)),
    "a broadcastable weight": lambda ref: setattr(ref.down, "weight", torch.nn.Parameter(torch.randn(1, 128))),
    "no bias": lambda ref: setattr(ref.down, "bias", None),
}


@pytest.mark.parametrize("mismatch", REFERENCE_MISMATCHES.values(), ids=REFERENCE_MISMATCHES.keys())
def test_a_reference_linear_of_another_shape_is_refused_naming_the_layer(mismatch):
    """'down' is refused after 'up' is watched: no hook is left behind on either."""
    float_model, model = float_and_converted(MLP)
    mismatch(float_model)
    with pytest.raises(ValueError, match=r"reference_model's 'down' has weight .*; the converted layer has weight \[64, 128\]"):
        layer_diagnostics(model, calibration_batches(1)[0], reference_model=float_model)
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in model.modules())


def test_a_batch_without_tokens_gives_no_row():
    """Rows of infinite SNR read as lossless layers; nothing was measured."""
    float_model, model = float_and_converted(MLP)
    assert layer_diagnostics(model, torch.empty(0, DIM), reference_model=float_model) == []


class EmptyCallFirst(torch.nn.Module):
    """Runs its model on no tokens, then on the batch."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        self.model(x[:0])
        return self.model(x)


def test_a_call_without_tokens_is_counted_beside_one_with_tokens():
    _, model = float_and_converted(MLP)
    x = calibration_batches(1)[0]
    one_call = {d.name: d for d in layer_diagnostics(model, x)}
    rows = {d.name: d for d in layer_diagnostics(EmptyCallFirst(model), x)}
    assert rows["model.up"].calls == 2 and rows["model.up"].act_snr_db == one_call["up"].act_snr_db


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_an_input_holding_nan_or_inf_is_refused_naming_the_layer(value):
    """Its batch amax read 0.0 (Python's max(0.0, nan)) and its SNRs NaN."""
    float_model, model = float_and_converted(MLP)
    x = calibration_batches(1)[0].clone()
    x[0, 3, 5] = value
    with pytest.raises(ValueError, match=r"layer 'up' got an input holding .* values \(first at index \(0, 3, 5\)\)"):
        layer_diagnostics(model, x, reference_model=float_model)
    assert all(not module._forward_hooks for module in model.modules())


@pytest.mark.parametrize("max_rows", [-1, 1.5, True, "2"], ids=["negative", "fraction", "bool", "string"])
def test_format_diagnostics_refuses_a_row_count_that_is_not_a_whole_number(max_rows):
    _, model = float_and_converted(MLP)
    with pytest.raises(ValueError, match=f"max_rows={max_rows!r} must be a whole number >= 0"):
        format_diagnostics(layer_diagnostics(model, calibration_batches(1)[0]), max_rows=max_rows)


def test_a_compiled_model_is_measured_as_the_eager_module_it_wraps(monkeypatch):
    """Hooks do not fire inside a compiled graph: the compiled model gave no rows."""
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    model = quantized(copy.deepcopy(make(MLP)))
    float_model = make(MLP)
    x = calibration_batches(1, seed=3)[0]
    eager = layer_diagnostics(model, x, reference_model=float_model)
    compiled = layer_diagnostics(torch.compile(model), x, reference_model=torch.compile(float_model))
    assert [d.name for d in compiled] == ["up", "down"] and compiled == eager


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clipping_is_counted_as_the_clip_monitor_counts_in_low_precision(dtype):
    """Compared with g_amax as a Python float, the comparison rounds g_amax to x's dtype, and
    an input just above g_amax whose dtype rounds g_amax up was not counted."""
    model = quantized(make(MLP, dtype), dtype)
    limit = model.up.weight.act_per_tensor_scale.float() * 448 * 6
    just_above = largest_at_most(limit, dtype)
    just_above = torch.nextafter(just_above, torch.tensor(torch.inf, dtype=dtype))
    x = torch.zeros(1, DIM, dtype=dtype)
    x[0, 0] = just_above
    enable_clip_monitor(model)
    with torch.no_grad():
        model(x)
    assert clip_counts(model)["up"].clipped == 1
    assert layer_diagnostics(model, x)[0].clipped_fraction * DIM == 1
