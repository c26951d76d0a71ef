"""calibrate_model: the default recipe in one call equals the layer-by-layer run and the
explicit quantize_ flow, and refuses bad calls before changing anything."""

import pytest
import torch
from conftest import convert, prepare
from distributed_worker import converted_scales
from tiny_llama import all_but_lm_head, convert_llama, logits, prepared_and_calibrated, tiny_llama, token_ids

from nvfp4_static import (
    NVFP4StaticActivationConfig,
    NVFP4StaticLinear,
    calibrate_layer_by_layer,
    calibrate_model,
    smooth_norm_inputs,
)

CONFIG = NVFP4StaticActivationConfig(act_calibration="b_min", weight_scale="hessian_mse")


def batches():
    return [token_ids(0), token_ids(1)]  # the seeds prepared_and_calibrated runs


def assert_same_model(a, b):
    x, y = converted_scales(a), converted_scales(b)
    assert x.keys() == y.keys() and len(x) == 14
    for name in x:
        assert all(torch.equal(p, q) for p, q in zip(x[name], y[name], strict=True)), name
    assert torch.equal(logits(a, seed=7), logits(b, seed=7))


def test_equals_the_layer_by_layer_run_bit_for_bit():
    whole = calibrate_model(tiny_llama(), batches(), CONFIG, filter_fn=all_but_lm_head, progress=False)
    layered = calibrate_layer_by_layer(tiny_llama(), batches(), CONFIG, device="cpu",
                                       filter_fn=all_but_lm_head, progress=False)
    assert_same_model(whole, layered)
    assert not isinstance(whole.lm_head, NVFP4StaticLinear)


@pytest.mark.parametrize("smooth", [True, False])
def test_equals_the_explicit_flow(smooth):
    explicit = tiny_llama()
    if smooth:
        smooth_norm_inputs(explicit, lambda m: m(token_ids(0)))
    recipe = dict(act_calibration="b_min", weight_scale="hessian_mse")
    explicit = convert_llama(prepared_and_calibrated(explicit, **recipe), **recipe)
    one_call = calibrate_model(tiny_llama(), batches(), CONFIG, filter_fn=all_but_lm_head,
                               smooth_alpha=0.5 if smooth else None, progress=False)
    assert_same_model(one_call, explicit)


def test_a_model_without_norms_is_quantized_unsmoothed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    reference = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    reference.load_state_dict(model.state_dict())
    data = [torch.randn(8, 32, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    calibrate_model(model, data, CONFIG, progress=False)
    prepare(reference, act_calibration="b_min", weight_scale="hessian_mse")
    with torch.no_grad():
        for x in data:
            reference(x)
    convert(reference, act_calibration="b_min", weight_scale="hessian_mse")
    probe = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(model(probe), reference(probe))
    assert isinstance(model[0], NVFP4StaticLinear) and isinstance(model[2], NVFP4StaticLinear)


class OnePlusWeightNorm(torch.nn.Module):
    """Gemma's norm: the output scales with 1 + weight, so no scale folds into it."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return x * (1 + self.weight)


def gemma_like_llama():
    model = tiny_llama()
    for layer in model.model.layers:
        layer.input_layernorm = OnePlusWeightNorm(64)
    return model


@pytest.mark.parametrize(
    "model_fn, data, options, message",
    [
        (tiny_llama, [], {}, "needs at least one calibration batch"),
        (tiny_llama, None, {"smooth_alpha": -0.5}, "smooth_alpha=-0.5 must be a number in"),
        (tiny_llama, None, {"smooth_alpha": 2.0}, "smooth_alpha=2.0 must be a number in"),
        (tiny_llama, None, {"smooth_alpha": float("nan")}, "smooth_alpha=nan must be a number in"),
        (gemma_like_llama, None, {}, "does not scale its output with its weight"),
        (tiny_llama, None, {"filter_fn": lambda m, fqn: False}, "filter_fn selects no linear layer"),
        (tiny_llama, None, {"filter_fn": lambda m, fqn: fqn == "lm_head.weight"}, "filter_fn selects no linear layer"),
        (tiny_llama, None, {"filter_fn": lambda m, fqn: not isinstance(m, torch.nn.Linear)},
         "filter_fn selects no linear layer"),
    ],
    ids=["no batches", "alpha below 0", "alpha above 1", "alpha nan", "gemma norm", "filter selects nothing",
         "filter names a parameter", "filter selects only other modules"],
)
def test_bad_calls_are_refused_and_nothing_changes(model_fn, data, options, message):
    model = model_fn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    options = {"filter_fn": all_but_lm_head, **options}
    with pytest.raises(ValueError, match=message):
        calibrate_model(model, batches() if data is None else data, CONFIG, progress=False, **options)
    assert [type(m) for m in model.modules()] == kinds
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("progress", ["no", 1], ids=["string", "one"])
def test_a_progress_flag_that_is_not_a_bool_is_refused_and_nothing_changes(progress):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=f"calibrate_model: progress={progress!r} must be True or False"):
        calibrate_model(model, batches(), CONFIG, filter_fn=all_but_lm_head, progress=progress)
    assert all(type(m) is not NVFP4StaticLinear for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("data", [token_ids(0), {"input_ids": token_ids(0)}, (ids for ids in batches())],
                         ids=["a tensor", "a dict", "a generator"])
@pytest.mark.parametrize("function", ["calibrate_model", "calibrate_layer_by_layer"])
def test_batches_that_are_not_a_sequence_are_refused_and_nothing_changes(data, function):
    """A tensor would be taken row by row as batches, and a generator has no len()."""
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=rf"{function} takes a sequence of batches \(a list\), got a {type(data).__name__}"):
        if function == "calibrate_model":
            calibrate_model(model, data, CONFIG, filter_fn=all_but_lm_head, progress=False)
        else:
            calibrate_layer_by_layer(model, data, CONFIG, filter_fn=all_but_lm_head, progress=False, device="cpu")
    assert all(type(m) is not NVFP4StaticLinear for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("progress", [False, True])
def test_progress_false_shows_no_bar_and_true_shows_the_calibration_and_convert_bars(capsys, progress):
    """tiny_llama's 14 linears are enough for convert's own bar (8 or more layers)."""
    calibrate_model(tiny_llama(), batches(), filter_fn=all_but_lm_head, progress=progress)
    err = capsys.readouterr().err
    assert ("nvfp4_static calibrate" in err) == progress
    assert ("nvfp4_static convert" in err) == progress


def test_a_model_left_in_training_mode_is_calibrated_in_eval_mode_and_given_its_modes_back():
    """Dropout active during calibration would double the amax after Dropout(0.5)."""
    def model_in(mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(256, 64))
        getattr(model, mode)()
        return model

    data = [torch.randn(64, 64, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    config = NVFP4StaticActivationConfig(act_calibration="max", weight_scale="max")
    trained = model_in("train")
    trained[1].eval()  # a module's own mode comes back too
    calibrate_model(trained, data, config, progress=False)
    evaluated = calibrate_model(model_in("eval"), data, config, progress=False)
    assert trained[3].act_global_amax == evaluated[3].act_global_amax
    assert trained.training and trained[2].training and not trained[1].training
    # Converted layers take the mode of the layers they replace.
    assert trained[0].training and trained[3].training and not evaluated[0].training and not evaluated[3].training
