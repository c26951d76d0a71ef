"""The clip monitor counts, per converted layer, the inputs above its act_global_amax: eagerly
and compiled, equal to a count made outside the model."""

import pytest
import torch

from conftest import calibration_batches, make, quantized
from models import MLP
from nvfp4_static import clip_counts, disable_clip_monitor, enable_clip_monitor


def inputs_of(model, x):
    """Each converted layer's input for ``x``, captured by hooks."""
    seen = {}
    hooks = [
        getattr(model, name).register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, args[0]))
        for name in ("up", "down")
    ]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return seen


def expected_counts(model, batches):
    expected = {"up": [0, 0, 0.0], "down": [0, 0, 0.0]}
    for x in batches:
        for name, layer_input in inputs_of(model, x).items():
            limit = getattr(model, name).act_global_amax
            expected[name][0] += int((layer_input.abs() > limit).sum())
            expected[name][1] += layer_input.numel()
            expected[name][2] = max(expected[name][2], float(layer_input.abs().max()))
    return expected


def observed_counts(model):
    return {name: [c.clipped, c.seen, c.max_abs] for name, c in clip_counts(model).items()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_clip_counts_equal_a_count_made_outside_the_model(compiled):
    model = quantized(make(MLP), act_calibration="max")
    batches = [b * s for b, s in zip(calibration_batches(3, seed=11), (0.5, 4.0, 100.0))]
    expected = expected_counts(model, batches)
    assert expected["up"][0] > 0  # the 4x and 100x batches clip
    enable_clip_monitor(model)
    run = torch.compile(model, fullgraph=True) if compiled else model
    with torch.no_grad():
        for x in batches:
            run(x)
    assert observed_counts(model) == expected


def test_enabling_again_restarts_from_zero_and_disabling_drops_the_counters():
    model = quantized(make(MLP), act_calibration="max")
    enable_clip_monitor(model)
    with torch.no_grad():
        model(calibration_batches(1)[0] * 100)
    assert clip_counts(model)["up"].clipped > 0
    enable_clip_monitor(model)
    assert clip_counts(model)["up"].clipped == 0
    disable_clip_monitor(model)
    assert clip_counts(model) == {}


def test_a_model_without_converted_layers_cannot_be_monitored():
    with pytest.raises(ValueError, match="MLP has no converted NVFP4 layer"):
        enable_clip_monitor(make(MLP))


@pytest.mark.parametrize(
    "dtype, above, below", [(torch.float16, 19280.0, 19264.0), (torch.bfloat16, 19328.0, 19200.0)], ids=["fp16", "bf16"]
)
def test_inputs_just_above_the_amax_count_though_it_rounds_up_in_their_dtype(dtype, above, below):
    """19274.09 rounds up to ``above`` in fp16 and bf16: compared with the rounded limit, an
    input of ``above`` (which the quantizer clips) was not counted. ``below`` is the largest
    value of the dtype under the amax."""
    model = quantized(make(MLP), act_calibration="max").to(dtype)
    model.up.weight.act_per_tensor_scale.fill_(19274.09 / 2688)
    amax = model.up.act_global_amax
    assert below < amax < above and torch.tensor(amax).to(dtype) == above
    x = torch.zeros(1, 64, dtype=dtype)
    x[0, 0], x[0, 1] = above, below
    enable_clip_monitor(model)
    with torch.no_grad():
        model(x)
    assert clip_counts(model)["up"].clipped == 1
