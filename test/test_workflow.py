"""The quantize_ flow: prepare, calibrate, convert, compile, save/load, and its errors."""

import copy
import os
import subprocess
import sys
import textwrap
import warnings
import weakref

import pytest
import torch
from expecttest import assert_expected_inline
from torchao.core.config import config_from_dict, config_to_dict
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
from torchao.quantization import quantize_
from torchao.quantization.quantize_.common.quantization_step import QuantizationStep
from torchao.utils import unwrap_tensor_subclass
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import (
    DIM, requires_cuda, calibration_batches, convert, device_waits, make, prepare, quantized, sqnr_db,
)
from models import MLP, TransformerBlock
from nvfp4_static import (
    NVFP4MSECalibrator,
    NVFP4StaticActivationConfig,
    NVFP4StaticLinear,
    NVFP4StaticObservedLinear,
    NVFP4StaticTensor,
    is_quantizable,
)
from nvfp4_static.numerics import dequantize_nvfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_cls", [MLP, TransformerBlock], ids=["mlp", "block"])
def test_prepare_observes_without_changing_outputs(model_cls, dtype):
    model = make(model_cls, dtype)
    x = calibration_batches(1, seed=5, dtype=dtype)[0]
    expected = model(x)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    observed = [m for m in model.modules() if isinstance(m, NVFP4StaticObservedLinear)]
    assert len(observed) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(model(x), expected)


class TensorOpsOnRealDevices(TorchDispatchMode):
    """Records every tensor operation that reads or makes a tensor outside the meta device."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(not t.is_meta for t in tensors):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize(
    "act, weight", [("b_min", "hessian_mse"), ("percentile", "mse"), ("max", "mse"), ("mse", "mse")]
)
def test_prepare_allocates_and_copies_nothing_but_swaps_modules(act, weight):
    """Prepare's cost must not grow with the weights (5 s for 224 large linears is wrong):
    observers allocate their state at the first batch, the histogram's bin tables are made once
    and shared, and the observed layer holds the float layer's own parameters."""
    config = NVFP4StaticActivationConfig(step="prepare", act_calibration=act, weight_scale=weight)
    quantize_(make(MLP), config, filter_fn=is_quantizable)  # the shared bin tables, made once
    model = make(TransformerBlock)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    with TensorOpsOnRealDevices() as recorded:
        quantize_(model, config, filter_fn=is_quantizable)
    assert recorded.ops == []
    for name, linear in linears.items():
        observed = model.get_submodule(name)
        assert isinstance(observed, NVFP4StaticObservedLinear)
        assert observed.weight is linear.weight and observed.bias is linear.bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_cls", [MLP, TransformerBlock], ids=["mlp", "block"])
def test_converted_model_tracks_the_float_model(model_cls, dtype):
    float_model = make(model_cls, dtype)
    model = quantized(make(model_cls, dtype), dtype)
    assert all(
        type(m.weight) is NVFP4StaticTensor for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    x = calibration_batches(1, seed=7, dtype=dtype)[0]
    with torch.no_grad():
        # NVFP4 (E2M1, 16-wide blocks) alone gives about 20 dB SQNR on Gaussian data per
        # operand; two quantized operands per product and several layers cost a few dB more.
        # 13 dB is well above what a broken scale (sign, factor of 2, wrong block) produces.
        assert sqnr_db(float_model(x), model(x)) > 13


def test_max_recipe_weight_is_torchaos_nvfp4_bit_for_bit():
    model = make(MLP)
    float_weight = model.up.weight.detach().clone()
    act_max = max(batch.abs().max() for batch in calibration_batches())
    quantized(model, act_calibration="max", weight_scale="max")
    theirs = NVFP4Tensor.to_nvfp4(
        float_weight,
        per_tensor_scale=per_tensor_amax_to_scale(float_weight.abs().amax()),
        act_per_tensor_scale=per_tensor_amax_to_scale(act_max),
    )
    ours = model.up.weight
    assert torch.equal(ours.qdata, theirs.qdata)
    assert torch.equal(ours.scale.view(torch.uint8), theirs.scale.view(torch.uint8))
    assert torch.equal(ours.per_tensor_scale, theirs.per_tensor_scale)
    assert torch.equal(ours.act_per_tensor_scale, theirs.act_per_tensor_scale)


def test_convert_refuses_an_activation_amax_too_small_for_nvfp4():
    model = make(MLP)
    quantize_(
        model, NVFP4StaticActivationConfig(step="prepare", act_calibration="max"), filter_fn=is_quantizable
    )
    with torch.no_grad():
        model(calibration_batches(1)[0] * 1e-36)
    with pytest.raises(ValueError, match="layer 'up': calibrated activation amax is .*at least about 5e-34"):
        quantize_(
            model, NVFP4StaticActivationConfig(step="convert", act_calibration="max"), filter_fn=is_quantizable
        )


@pytest.mark.parametrize("weight_scale", ["mse", "hessian_mse", "gptq"])
def test_weight_too_small_for_the_sweep_gets_block_max_scales_with_a_warning(weight_scale):
    model = make(MLP)
    with torch.no_grad():
        model.up.weight.mul_(1e-35 / model.up.weight.abs().max())
    float_weight = model.up.weight.detach().clone()
    with pytest.warns(UserWarning, match="'up': weight amax 1e-35 is too small"):
        quantized(model, weight_scale=weight_scale)
    theirs = NVFP4Tensor.to_nvfp4(float_weight, per_tensor_scale=per_tensor_amax_to_scale(float_weight.abs().amax()))
    assert torch.equal(model.up.weight.qdata, theirs.qdata)
    assert torch.equal(model.up.weight.scale.view(torch.uint8), theirs.scale.view(torch.uint8))


def weight_sqnr(float_weight, converted):
    w = dequantize_nvfp4(converted.qdata, converted.scale, converted.per_tensor_scale)
    return sqnr_db(float_weight, w)


@pytest.mark.parametrize("mse_recipe", ["mse", "hessian_mse"])
def test_mse_weight_scales_beat_block_max(mse_recipe):
    float_weights = {name: m.weight.detach().clone() for name, m in make(MLP).named_children()}
    by_max = quantized(make(MLP), weight_scale="max")
    by_mse = quantized(make(MLP), weight_scale=mse_recipe)
    for name, w in float_weights.items():
        max_sqnr = weight_sqnr(w, getattr(by_max, name).weight)
        mse_sqnr = weight_sqnr(w, getattr(by_mse, name).weight)
        if mse_recipe == "mse":
            assert mse_sqnr > max_sqnr
        else:  # the Hessian sweep minimises output error, not weight error; judged below
            assert mse_sqnr > max_sqnr - 1.0
    x = calibration_batches(1, seed=9)[0]
    reference = make(MLP)(x)
    with torch.no_grad():
        assert sqnr_db(reference, by_mse(x)) > sqnr_db(reference, by_max(x))


@pytest.mark.parametrize("act_calibration", ["b_min", "max", "percentile", "mse"])
def test_every_activation_calibrator_converts(act_calibration):
    model = quantized(make(MLP), act_calibration=act_calibration)
    literal_max = max(batch.abs().max() for batch in calibration_batches())
    amax = model.up.act_global_amax
    assert 0 < amax < float("inf")
    if act_calibration == "max":
        assert amax == pytest.approx(float(literal_max), rel=1e-6)
    if act_calibration == "b_min":  # the recipe's headroom: never below the calibration max
        assert amax >= float(literal_max) * (1 - 2 ** -4)


def test_filter_fn_selects_layers():
    model = make(MLP)
    only_up = lambda module, name: isinstance(module, torch.nn.Linear) and name == "up"  # noqa: E731
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=only_up)
    assert isinstance(model.up, NVFP4StaticObservedLinear)
    assert type(model.down) is torch.nn.Linear
    model(calibration_batches(1)[0])
    quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=only_up)
    assert isinstance(model.up, NVFP4StaticLinear) and type(model.down) is torch.nn.Linear


def test_config_round_trips_through_torchao_dict_and_accepts_quantization_step():
    config = NVFP4StaticActivationConfig(step=QuantizationStep.CONVERT, rho=4096.0, weight_scale="max")
    assert config.step == "convert" and type(config.step) is str
    assert config_from_dict(config_to_dict(config)) == config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"step": "calibrate"}, "step='calibrate'"),
        ({"act_calibration": "minmax"}, "act_calibration='minmax'"),
        ({"weight_scale": "awq"}, "weight_scale='awq'"),
        ({"rho": 30000.0}, "rho=30000"),
        ({"backend": "cuda"}, "backend='cuda'"),
    ],
    ids=["step", "act_calibration", "weight_scale", "rho", "backend"],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NVFP4StaticActivationConfig(**kwargs)


def test_printed_forms_are_pinned():
    model = quantized(make(MLP), act_calibration="max", weight_scale="max")
    assert_expected_inline(
        str(model),
        """\
MLP(
  (up): NVFP4StaticLinear(in_features=64, out_features=128, bias=True, act_calibration=max, weight_scale=max, act_global_amax=4.101, backend=cpu)
  (down): NVFP4StaticLinear(in_features=128, out_features=64, bias=True, act_calibration=max, weight_scale=max, act_global_amax=2.43, backend=cpu)
)""",
    )
    assert_expected_inline(
        repr(model.up.weight),
        """NVFP4StaticTensor(shape=(128, 64), dtype=torch.float32, device=cpu, backend=cpu, act_global_amax=4.10149, weight_global_amax=0.12498)""",
    )
    assert_expected_inline(
        repr(NVFP4StaticActivationConfig(step="convert")),
        """NVFP4StaticActivationConfig(step='convert', act_calibration='b_min', rho=16384.0, b_min_percentile=1.0, b_max_percentile=99.999, margin=1.0, num_bins=512, log2_min=-40.0, log2_max=40.0, percentile=99.99, mse_start_multiplier=0.25, mse_stop_multiplier=4.0, mse_step_size=0.1, weight_scale='hessian_mse', gptq_dampening=0.01, strict=False, backend=None, expert_min_tokens=16)""",
    )


def test_compiled_model_with_unwrapped_weights_gives_the_same_outputs():
    """torchao's unwrap_tensor_subclass (the README's advice for less host time per compiled
    call) holds each weight as plain tensors and rebuilds the NVFP4StaticTensor in the graph:
    scales and backend survive, so the outputs are the compiled subclass model's exactly, and
    called eagerly the unwrapped model gives the eager model's."""
    model = quantized(make(TransformerBlock))
    unwrapped = unwrap_tensor_subclass(copy.deepcopy(model))
    assert "mlp.up.parametrizations.weight.original0" in dict(unwrapped.named_parameters())
    assert type(unwrapped.mlp.up.weight) is NVFP4StaticTensor
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        assert torch.equal(unwrapped(x), model(x))
        expected = torch.compile(model, fullgraph=True)(x)
        out = torch.compile(unwrapped, fullgraph=True)(x)
    assert torch.equal(out, expected)


UNWRAPPED_CASTS = {
    "float()": lambda m: m.float(),
    "to(float32)": lambda m: m.to(torch.float32),
    "to(cpu)": lambda m: m.to("cpu"),
    "to(cpu, float32)": lambda m: m.to("cpu", torch.float32),
}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("cast", UNWRAPPED_CASTS.values(), ids=UNWRAPPED_CASTS.keys())
def test_an_unwrapped_model_moved_or_cast_to_its_own_dtype_keeps_its_scales(cast):
    """Module casts convert every floating tensor: the FP8 block scales and float32 global
    scales the unwrapped weight holds would be converted as numbers."""
    model = quantized(make(MLP))
    x = calibration_batches(1)[0]
    with torch.no_grad():
        expected = model(x)
    unwrapped = unwrap_tensor_subclass(model)
    before = {name: t.clone() for name, t in unwrapped.named_parameters()}
    cast(unwrapped)
    assert all(same_bits(t, before[name]) for name, t in unwrapped.named_parameters())
    with torch.no_grad():
        assert torch.equal(unwrapped(x), expected)


@pytest.mark.parametrize(
    "dtype, problem",
    [(torch.float16, "its weight is held unwrapped .* cast the model before unwrapping"),
     (torch.bfloat16, "its weight is held unwrapped .* cast the model before unwrapping"),
     (torch.float64, "a converted layer computes in float32, bfloat16 or float16")],
    ids=str,
)
def test_an_unwrapped_model_cast_to_another_dtype_is_refused_naming_the_layer(dtype, problem):
    """The rebuild keeps the weight's dtype, so the output would stay float32."""
    unwrapped = unwrap_tensor_subclass(quantized(make(MLP)))
    before = {name: t.clone() for name, t in unwrapped.up.named_parameters()}
    with pytest.raises(ValueError, match=rf"layer 'up' cannot become {dtype}: {problem}"):
        unwrapped.to(dtype)
    assert all(same_bits(t, before[name]) for name, t in unwrapped.up.named_parameters())


def test_compiled_model_matches_eager_without_recompiling():
    model = quantized(make(TransformerBlock))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    frames = []
    for batch, seq in [(2, 16), (3, 5), (4, 33)]:
        x = torch.randn(batch, seq, DIM)
        with torch.no_grad():
            eager, out = model(x), compiled(x)
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        # One E2M1 code may flip where compiled float rounding differs in the last bit of a
        # block's scaled value; the result then differs by one code step in a few outputs.
        assert sqnr_db(eager, out) > 40
    assert frames[0] == frames[-1] == 1


@requires_cuda
def test_gpu_compiled_model_serves_every_token_count_from_one_graph():
    """On the Triton backend the token count picks the GEMM's tiles at run time (a cond per
    tile bucket), so one dynamic graph covers decode and prefill sizes alike, with the outputs
    of a graph compiled for each size on its own. Inductor may fuse a linear's epilogue into
    the op reading its output, and by default it then keeps the value in fp32 instead of
    rounding it to bf16; a graph compiled for one size fuses across the branch boundary that
    the dynamic graph keeps, so without ``emulate_precision_casts`` the two differ by that
    rounding (above 512 tokens, where the GEMM's epilogue is torch ops)."""
    model = quantized(make(TransformerBlock, torch.bfloat16), torch.bfloat16).cuda()
    assert model.proj.weight.linear_backend in ("triton", "blackwell")
    inputs = [
        torch.randn(batch, seq, DIM, device="cuda", dtype=torch.bfloat16)
        # Distinct sizes first: dynamo would otherwise give batch and seq one symbol (duck
        # sizing) and recompile at the first pair that differs.
        for batch, seq in [(2, 3), (3, 5), (4, 8), (6, 9), (8, 128), (2, 2)]  # M = 6 ... 1024, 4
    ]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    dynamic = torch.compile(model, fullgraph=True, dynamic=True)
    with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=True):
        outputs = [dynamic(x) for x in inputs]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        for x, out in zip(inputs, outputs):
            torch._dynamo.reset()
            static = torch.compile(model, fullgraph=True, dynamic=False)(x)
            assert torch.equal(out, static), tuple(x.shape)


@requires_cuda
@pytest.mark.parametrize("weight_scale, waits_per_linear", [("mse", 8), ("hessian_mse", 9)])
def test_gpu_convert_waits_for_the_device_a_few_times_per_linear(weight_scale, waits_per_linear):
    """Each wait stops the host from queueing the next layer's work. Per linear: the histogram
    (one read), the activation scale's usability, the weight amax's finiteness, the sweep's
    global amax, the weight's finiteness read with its per-tensor scale, the sweep's candidate
    factors (a read and a blocking copy of the FP8 values), from_float's one read of its scales
    and the weight's max; and for hessian_mse the Hessian's finiteness."""

    def calibrated():
        model = prepare(make(MLP, torch.bfloat16).cuda(), weight_scale=weight_scale)
        with torch.no_grad():
            for batch in calibration_batches(dtype=torch.bfloat16):
                model(batch.cuda())
        return model

    convert(calibrated(), weight_scale=weight_scale)  # Triton compiles the kernels
    model = calibrated()
    waits = device_waits(lambda: convert(model, weight_scale=weight_scale))
    assert len(waits) <= 2 * waits_per_linear, waits


def test_convert_without_calibration_names_the_layer():
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    with pytest.raises(RuntimeError, match="'up'"):
        quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable)


def test_convert_without_prepare_is_an_error():
    with pytest.raises(RuntimeError, match="has no observer"):
        quantize_(make(MLP), NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_calibration_data_names_the_layer(bad):
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    x = calibration_batches(1)[0]
    x[0, 3, 5] = bad
    with pytest.raises(ValueError, match="'up'"):
        model(x)


def test_activations_whose_squares_overflow_are_refused_by_both_observers_of_the_layer():
    """Finite, but the Hessian's sum of squares overflows float32: a clear error, and neither the
    Hessian nor the activation statistics take the batch (they stay as after the good one)."""
    model = make(MLP)
    quantize_(
        model, NVFP4StaticActivationConfig(step="prepare", weight_scale="hessian_mse"), filter_fn=is_quantizable
    )
    good, huge = calibration_batches(2)
    model(good)
    before = {key: value.clone() for key, value in model.up.act_calibrator.state_dict().items()}
    hessian_before = model.up.hessian_accumulator.hessian.clone()
    with pytest.raises(ValueError, match=r"'up'.*finite, but the Hessian \(a sum of the activations' squares\) overflowed float32"):
        model(huge * 1e30)
    after = model.up.act_calibrator.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert torch.equal(model.up.hessian_accumulator.hessian, hessian_before)


@pytest.mark.parametrize("scales", [(1.0, 1e30), (8e17, 8e17), (7e17, 7e17, 7e17)], ids=["one batch", "two", "three"])
def test_an_mse_loss_sum_that_overflows_is_refused_at_its_batch_naming_the_sum(scales):
    """Each batch's losses finite, their sum not: the sum is checked where the batch is taken,
    not first at convert (where the error could only say NaN or Inf was collected)."""
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare", act_calibration="mse", weight_scale="max"),
              filter_fn=is_quantizable)
    batches = calibration_batches(len(scales))
    for x, scale in zip(batches[:-1], scales[:-1]):
        model(x * scale)
    search = model.up.act_calibrator.search
    before = search.state_dict()["losses"].clone()
    with pytest.raises(ValueError, match=r"'up'.*finite, but the search's loss sum overflowed float32"):
        model(batches[-1] * scales[-1])
    assert model.up.act_calibrator.search is search and torch.equal(search.state_dict()["losses"], before)


@pytest.mark.parametrize("weight_scale", ["hessian_mse", "mse"])
@pytest.mark.parametrize(
    "bad_input",
    [
        lambda x: torch.cat([x, x], dim=-1),  # twice the features
        lambda x: x[..., :16],  # a quarter of them
        lambda x: x.to(torch.bfloat16),
        lambda x: x.to(torch.float16),
        lambda x: x[0, 0, 0],  # 0-D
    ],
    ids=["wider", "narrower", "bf16", "fp16", "0-d"],
)
def test_a_batch_the_linear_would_refuse_is_refused_before_its_statistics_are_taken(weight_scale, bad_input):
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare", weight_scale=weight_scale), filter_fn=is_quantizable)
    good, other = calibration_batches(2)
    model(good)
    before = {key: value.clone() for key, value in model.up.act_calibrator.state_dict().items()}
    hessian = model.up.hessian_accumulator
    hessian_before = None if hessian is None else hessian.hessian.clone()
    bad = bad_input(other * 50)
    with pytest.raises(ValueError, match=rf"'up' takes inputs of {DIM} features in torch.float32; got shape "
                                         rf"\[{', '.join(map(str, bad.shape))}\] in {bad.dtype}.*not observed"):
        model(bad)
    after = model.up.act_calibrator.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert hessian is None or torch.equal(hessian.hessian, hessian_before)


def test_a_prepared_layer_observes_a_lower_precision_batch_under_autocast():
    """Autocast casts the float linear's operands, so its inputs may differ from the weight's dtype."""
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    x = calibration_batches(1)[0].to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert int(model.up.act_calibrator.state_dict()["counts"].sum()) == x.numel() // 16


class Odd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.narrow = torch.nn.Linear(DIM, 100)
        self.wide = torch.nn.Linear(100, DIM)

    def forward(self, x):
        return self.wide(self.narrow(x))


def test_non_multiple_of_16_layers_are_skipped_with_a_warning():
    model = Odd()
    with pytest.warns(UserWarning, match="'narrow'"):
        quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    assert type(model.narrow) is torch.nn.Linear and type(model.wide) is torch.nn.Linear


def test_strict_mode_raises_on_a_100_wide_linear():
    with pytest.raises(ValueError, match="'narrow'.*100"):
        quantize_(
            Odd(), NVFP4StaticActivationConfig(step="prepare", strict=True), filter_fn=is_quantizable
        )


@pytest.mark.parametrize("again_filter", [is_quantizable, None], ids=["is_quantizable", "torchao's default filter"])
@pytest.mark.parametrize("step", ["prepare", "convert"], ids=["prepared", "converted"])
def test_preparing_a_layer_again_names_it_and_says_how_to_start_over(step, again_filter):
    """A prepare refused at a later layer (strict, a weight dtype) has prepared the layers before
    it; preparing again then meets one of those."""
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    if step == "convert":
        with torch.no_grad():
            model(torch.randn(8, DIM))
        quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable)
    message = r"'up' is already NVFP4Static\w+; prepare runs once .* load the float model again"
    with pytest.raises(ValueError, match=message):
        quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=again_filter)


@pytest.mark.parametrize("strict", [False, True])
def test_prepare_for_loading_refuses_a_prepared_model_as_it_was_and_keeps_a_converted_one(strict):
    """Empty converted layers are made of float layers: a prepared layer would lose its
    statistics (refused, naming it), a converted one is what loading needs already."""
    loading = NVFP4StaticActivationConfig(step="prepare_for_loading", strict=strict)
    prepared = prepare(make(MLP))
    layers = (prepared.up, prepared.down)
    with pytest.raises(ValueError, match=r"layer 'up' is NVFP4StaticObservedLinear, prepared for calibration; "
                       r"step='prepare_for_loading' makes empty converted layers .* load the float model again"):
        quantize_(prepared, loading, filter_fn=is_quantizable)
    assert (prepared.up, prepared.down) == layers
    converted = quantized(make(MLP))
    layers = (converted.up, converted.down)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_(converted, loading, filter_fn=is_quantizable)
    assert converted.up is layers[0] and converted.down is layers[1]


def test_unsupported_weight_dtype_is_an_error():
    model = make(MLP).to(torch.float64)
    with pytest.raises(TypeError, match="float64"):
        quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)


SAVE_LOAD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {test_dir!r})
    from models import TransformerBlock
    from nvfp4_static import load_quantized
    model = TransformerBlock()
    load_quantized(model, {path!r})
    torch.save(model(torch.load({x_path!r}, weights_only=True)), {out_path!r})
    """
)


def test_save_load_round_trip_in_a_fresh_process(tmp_path):
    """The documented route: the loading process names no recipe and no filter."""
    model = quantized(make(TransformerBlock), weight_scale="hessian_mse")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    x = torch.randn(2, 8, DIM)
    torch.save(x, tmp_path / "x.pt")
    script = SAVE_LOAD_SCRIPT.format(
        test_dir=os.path.dirname(__file__),
        path=str(tmp_path / "model.pt"),
        x_path=str(tmp_path / "x.pt"),
        out_path=str(tmp_path / "out.pt"),
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "out.pt"), model(x))


def test_loading_refreshes_each_weights_host_copy_of_its_output_scale():
    source = quantized(make(MLP))
    model = make(MLP)
    quantize_(
        model, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable
    )
    model.load_state_dict(source.state_dict())
    for name in ("up", "down"):
        loaded, original = getattr(model, name).weight, getattr(source, name).weight
        assert loaded.output_scale == original.output_scale


def test_loading_a_checkpoint_of_another_recipe_is_an_error():
    state = quantized(make(MLP), weight_scale="max").state_dict()
    model = make(MLP)
    quantize_(
        model, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable
    )
    with pytest.raises(ValueError, match="recipe"):
        model.load_state_dict(state)


def test_loading_a_checkpoint_of_other_shapes_is_an_error():
    state = quantized(make(MLP)).state_dict()
    model = MLP(dim=DIM, hidden=256)
    quantize_(
        model, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable
    )
    biases = [model.up.bias.clone(), model.down.bias.clone()]
    with pytest.raises(ValueError, match=r"layer 'up': the NVFP4 weight's qdata has shape \(128, 32\), the model's "
                                         r"\(256, 32\)"):
        model.load_state_dict(state)
    assert not model.up.loaded and not model.down.loaded
    assert torch.equal(model.up.bias, biases[0]) and torch.equal(model.down.bias, biases[1])


def test_loading_a_float_checkpoint_into_a_quantized_model_is_an_error():
    """Refused before anything is copied: torch would load the biases and leave the weights."""
    state = make(MLP).state_dict()
    model = make(MLP, seed=1)
    quantize_(
        model, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable
    )
    biases = [model.up.bias.clone(), model.down.bias.clone()]
    with pytest.raises(ValueError, match="layer 'up': a Tensor cannot be copied into an NVFP4StaticTensor.*prepare_for_loading"):
        model.load_state_dict(state)
    assert not model.up.loaded and not model.down.loaded
    assert torch.equal(model.up.bias, biases[0]) and torch.equal(model.down.bias, biases[1])


@pytest.mark.parametrize("weight_scale", ["mse", "hessian_mse"])
def test_compiled_calibration_collects_what_eager_collects(weight_scale):
    eager, compiled_model = make(MLP), make(MLP)
    for model in (eager, compiled_model):
        quantize_(
            model, NVFP4StaticActivationConfig(step="prepare", weight_scale=weight_scale), filter_fn=is_quantizable
        )
    compiled = torch.compile(compiled_model, fullgraph=True)
    with torch.no_grad():
        for batch in calibration_batches():
            eager(batch)
            compiled(batch)
    for name in ("up", "down"):
        ours, theirs = getattr(compiled_model, name), getattr(eager, name)
        assert torch.equal(
            ours.act_calibrator.state_dict()["counts"], theirs.act_calibrator.state_dict()["counts"]
        )
        if weight_scale == "hessian_mse":
            torch.testing.assert_close(
                ours.hessian_accumulator.hessian, theirs.hessian_accumulator.hessian
            )


def test_non_finite_data_in_compiled_calibration_fails_at_convert():
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    compiled = torch.compile(model, fullgraph=True)
    x = calibration_batches(1)[0]
    x[1, 2, 3] = float("nan")
    with torch.no_grad():
        compiled(x)
    with pytest.raises(ValueError, match="'up'.*NaN or Inf"):
        quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable)


def test_convert_chooses_weight_scales_through_the_public_calibrator(monkeypatch):
    """Convert asks NVFP4MSECalibrator for each layer's block scales and stores what it answers."""
    asked = []
    chosen = torch.tensor(0.5).to(torch.float8_e4m3fn)

    def answer(self, weight):
        asked.append((self.name, tuple(weight.shape), self.hessian is not None))
        self._block_scales_e4m3 = chosen.expand(weight.shape[0], weight.shape[1] // 16)

    monkeypatch.setattr(NVFP4MSECalibrator, "collect", answer)
    model = quantized(make(MLP), weight_scale="hessian_mse")
    assert asked == [("up", (128, DIM), True), ("down", (DIM, 128), True)]
    for layer in (model.up, model.down):
        assert bool((layer.weight.scale.float() == 0.5).all())


def test_convert_shows_a_progress_bar_only_for_models_with_many_layers(capsys):
    quantized(make(MLP))
    assert "nvfp4_static convert" not in capsys.readouterr().err
    many = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(9)])
    quantized(many)
    err = capsys.readouterr().err
    assert "nvfp4_static convert" in err and "9/9" in err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_eager_layer_call_equals_f_linear_through_the_weight_subclass(dtype):
    """The converted layer's eager forward skips the subclass's dispatch; same numbers."""
    model = quantized(make(MLP, dtype), dtype)
    x = calibration_batches(1, seed=4, dtype=dtype)[0]
    with torch.no_grad():
        for layer in (model.up, model.down):
            layer_input = x if layer is model.up else torch.nn.functional.gelu(model.up(x))
            through_dispatch = torch.nn.functional.linear(layer_input, layer.weight, layer.bias)
            assert torch.equal(layer(layer_input), through_dispatch)


CONVERSIONS = {
    "to(torch.bfloat16)": (lambda layer: layer.to(torch.bfloat16), torch.bfloat16),
    "half()": (lambda layer: layer.half(), torch.float16),
    "cpu()": (lambda layer: layer.cpu(), torch.float32),
    "to('cpu', torch.bfloat16)": (lambda layer: layer.to("cpu", torch.bfloat16), torch.bfloat16),
}


@pytest.mark.parametrize("conversion, dtype", CONVERSIONS.values(), ids=CONVERSIONS.keys())
def test_a_weakly_referenced_weight_is_converted_as_a_new_parameter(conversion, dtype):
    """torch converts a subclass parameter in place, which it refuses while something holds a
    weak reference to it (a compiled graph's tracing state can); the layer takes a new one."""
    model = quantized(make(MLP))
    plain = copy.deepcopy(model)
    weight, bias = model.up.weight, model.up.bias
    held = weakref.ref(weight)
    conversion(model.up)
    conversion(plain.up)
    assert model.up.weight is not weight and held() is weight
    assert model.up.weight.dtype == dtype and model.up.bias.dtype == dtype and model.up.bias is bias
    assert isinstance(model.up.weight, torch.nn.Parameter) and not model.up.weight.requires_grad
    assert list(dict(model.up.named_parameters())) == ["weight", "bias"]
    x = calibration_batches(1, seed=5, dtype=dtype)[0]
    with torch.no_grad():
        assert torch.equal(model.up(x), plain.up(x))


def bfloat16_weight_failing_bias(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, NVFP4StaticTensor):
        return t.to(torch.bfloat16)
    raise RuntimeError("this conversion fails on plain tensors")


REFUSED_CONVERSIONS = {
    "to(torch.float64)": (lambda layer: layer.to(torch.float64), "layer 'up' cannot become torch.float64"),
    "double()": (lambda layer: layer.double(), "layer 'up' cannot become torch.float64"),
    "to('cpu', torch.float64)": (lambda layer: layer.to("cpu", torch.float64), "layer 'up' cannot become torch.float64"),
    "the weight converts, the bias fails": (
        lambda layer: layer._apply(bfloat16_weight_failing_bias), "fails on plain tensors"
    ),
}


@pytest.mark.parametrize("conversion, message", REFUSED_CONVERSIONS.values(), ids=REFUSED_CONVERSIONS.keys())
def test_a_refused_conversion_of_a_weakly_referenced_weight_leaves_the_layer_as_it_was(conversion, message):
    model = quantized(make(MLP))
    weight, bias = model.up.weight, model.up.bias
    held = weakref.ref(weight)
    with pytest.raises((ValueError, RuntimeError), match=message):
        conversion(model.up)
    assert model.up.weight is weight and model.up.bias is bias and held() is weight
    assert weight.dtype == bias.dtype == torch.float32
    assert list(dict(model.up.named_parameters())) == ["weight", "bias"]
