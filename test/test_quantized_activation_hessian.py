"""The second calibration pass: Hessians gathered under quantized activations, float weights."""

import pytest
import torch
import torch.nn.functional as F

from conftest import calibration_batches, convert, make, prepare, requires_cuda
from models import MLP
from nvfp4_static import NVFP4StaticLinear, calibrate_hessians_under_quantized_activations, kernels
from nvfp4_static.numerics import per_tensor_amax_to_scale
from nvfp4_static.observers import BlockHessianAccumulator, nvfp4_fake_quantize_with_amax


def calibrated_mlp(device="cpu", **config):
    model = prepare(make(MLP).to(device), act_calibration="max", **config)
    with torch.no_grad():
        for batch in calibration_batches():
            model(batch.to(device))
    return model


def run_batches(device="cpu"):
    def forward_loop(model):
        for batch in calibration_batches():
            model(batch.to(device))

    return forward_loop


def expected_hessians(model, own_input_quantized: bool) -> dict:
    """The MLP's two Hessians worked out by hand: ``up`` reads the batch; ``down`` reads
    ``gelu(up(fake_quantize(batch)))`` with ``up``'s float weight."""
    up, down = model.up, model.down
    a_up, a_down = (layer.act_calibrator.compute_amax() for layer in (up, down))
    hessians = {"up": torch.zeros(4, 16, 16), "down": torch.zeros(8, 16, 16)}
    for x in calibration_batches():
        x_q = nvfp4_fake_quantize_with_amax(x, a_up)
        h = F.gelu(F.linear(x_q, up.weight, up.bias))
        h_q = nvfp4_fake_quantize_with_amax(h, a_down)
        seen_by = {"up": x_q, "down": h_q} if own_input_quantized else {"up": x, "down": h}
        for name, seen in seen_by.items():
            tokens = seen.reshape(-1, seen.shape[-1]).double()
            blocks = tokens.reshape(tokens.shape[0], -1, 16).transpose(0, 1)
            hessians[name] += (blocks.transpose(1, 2) @ blocks).float()
    return hessians


@pytest.mark.parametrize("own_input_quantized", [False, True], ids=["before_own", "after_own"])
def test_each_layer_gets_the_hessian_of_its_inputs_under_quantized_activations(own_input_quantized):
    model = calibrated_mlp(weight_scale="hessian_mse")
    float_down = model.down.hessian_accumulator.hessian.clone()
    calibrate_hessians_under_quantized_activations(
        model, run_batches(), own_input_quantized=own_input_quantized
    )
    expected = expected_hessians(model, own_input_quantized)
    for name in ("up", "down"):
        got = getattr(model, name).hessian_accumulator.hessian
        torch.testing.assert_close(got, expected[name], rtol=1e-5, atol=1e-5)
    assert model.down.hessian_accumulator.num_tokens == 4 * 2 * 16
    # The upstream quantization reached the second layer's input.
    assert not torch.allclose(model.down.hessian_accumulator.hessian, float_down, rtol=1e-3)


def test_activation_statistics_stay_and_convert_sweeps_under_the_new_hessians():
    model = calibrated_mlp(weight_scale="hessian_mse")
    act_amaxes = {n: getattr(model, n).act_calibrator.compute_amax() for n in ("up", "down")}
    calibrate_hessians_under_quantized_activations(model, run_batches())
    hessians = {n: getattr(model, n).hessian_accumulator.hessian.clone() for n in ("up", "down")}
    weights = {n: getattr(model, n).weight.detach().clone() for n in ("up", "down")}
    convert(model, act_calibration="max", weight_scale="hessian_mse")
    for name in ("up", "down"):
        layer = getattr(model, name)
        assert isinstance(layer, NVFP4StaticLinear)
        act_scale = per_tensor_amax_to_scale(act_amaxes[name])
        assert torch.equal(layer.weight.act_per_tensor_scale, act_scale)
        global_amax = weights[name].abs().amax()
        expected = kernels.fp8_scale_sweep(weights[name], global_amax, hessians[name])
        assert torch.equal(layer.weight.scale.view(torch.uint8), expected.view(torch.uint8))


def test_a_model_prepared_without_hessians_gets_them_and_converts_with_hessian_mse():
    model = calibrated_mlp(weight_scale="mse")
    assert model.up.hessian_accumulator is None
    calibrate_hessians_under_quantized_activations(model, run_batches())
    assert isinstance(model.up.hessian_accumulator, BlockHessianAccumulator)
    expected = expected_hessians(model, own_input_quantized=False)["up"]
    torch.testing.assert_close(model.up.hessian_accumulator.hessian, expected, rtol=1e-5, atol=1e-5)
    convert(model, act_calibration="max", weight_scale="hessian_mse")
    assert isinstance(model.down, NVFP4StaticLinear)


def test_a_linear_two_parents_hold_is_run_and_restored_at_both_places():
    model = calibrated_mlp(weight_scale="hessian_mse")
    holder = torch.nn.Module()
    holder.shared = model.up
    model.alias = holder  # model.up and model.alias.shared are one observed layer
    seen = []
    calibrate_hessians_under_quantized_activations(
        model, lambda m: seen.append(m.alias.shared is m.up) or run_batches()(m)
    )
    assert seen == [True] and model.alias.shared is model.up
    assert model.up.hessian_accumulator.num_tokens == 4 * 2 * 16


def snapshot(model):
    """What the pass may change: which module sits where, and each layer's Hessian."""
    modules = dict(model.named_modules())
    hessians = {n: (m.hessian_accumulator, m.hessian_accumulator.hessian.clone())
                for n, m in modules.items() if hasattr(m, "hessian_accumulator")}
    return modules, hessians


def assert_unchanged(model, before):
    modules, hessians = before
    assert dict(model.named_modules()) == modules
    for name, (accumulator, values) in hessians.items():
        layer = modules[name]
        assert layer.hessian_accumulator is accumulator
        assert torch.equal(accumulator.hessian, values)


def failing_loop(model):
    model(calibration_batches()[0])
    raise KeyboardInterrupt("stopped by the user")


def loop_skipping_down(model):
    for batch in calibration_batches():
        model.up(batch)


def loop_with_nan(model):
    model(torch.full((2, 16, 64), float("nan")))


@pytest.mark.parametrize(
    "forward_loop, error, match",
    [
        (failing_loop, KeyboardInterrupt, "stopped by the user"),
        (loop_skipping_down, ValueError, "layers down saw no input"),
        (loop_with_nan, ValueError, "2048 NaN"),
    ],
    ids=["loop_raises", "layer_not_reached", "nan_input"],
)
def test_a_refused_pass_leaves_the_model_as_it_was(forward_loop, error, match):
    model = calibrated_mlp(weight_scale="hessian_mse")
    before = snapshot(model)
    with pytest.raises(error, match=match):
        calibrate_hessians_under_quantized_activations(model, forward_loop)
    assert_unchanged(model, before)


def test_a_layer_without_calibration_is_named_and_nothing_changes():
    model = calibrated_mlp(weight_scale="hessian_mse")
    model.down.act_calibrator.reset()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="static scale.*layer 'down'.*before any collect"):
        calibrate_hessians_under_quantized_activations(model, run_batches())
    assert_unchanged(model, before)


@pytest.mark.parametrize("flag", ["yes", 1], ids=["string", "one"])
def test_an_own_input_flag_that_is_not_a_bool_is_refused_and_nothing_changes(flag):
    model = calibrated_mlp(weight_scale="hessian_mse")
    before = snapshot(model)
    with pytest.raises(TypeError, match=f"own_input_quantized={flag!r} must be True or False"):
        calibrate_hessians_under_quantized_activations(model, run_batches(), own_input_quantized=flag)
    assert_unchanged(model, before)


@pytest.mark.parametrize("model", [make(MLP), torch.nn.Sequential()], ids=["float_mlp", "empty"])
def test_a_model_without_observed_linears_is_refused(model):
    with pytest.raises(ValueError, match="found no observed linear.*step='prepare'"):
        calibrate_hessians_under_quantized_activations(model, run_batches())


@requires_cuda
def test_the_pass_on_cuda_gathers_what_it_gathers_on_cpu():
    """The fake quantization runs the same torch ops on both devices; the Hessians differ only
    by the order of the fp32 sums (the Triton kernel against the torch reference)."""
    on_cpu = calibrated_mlp(weight_scale="hessian_mse")
    on_cuda = calibrated_mlp("cuda", weight_scale="hessian_mse")
    calibrate_hessians_under_quantized_activations(on_cpu, run_batches())
    calibrate_hessians_under_quantized_activations(on_cuda, run_batches("cuda"))
    for name in ("up", "down"):
        torch.testing.assert_close(
            getattr(on_cuda, name).hessian_accumulator.hessian.cpu(),
            getattr(on_cpu, name).hessian_accumulator.hessian,
            rtol=1e-4, atol=1e-4,
        )
