"""Bad input gets a clear error or a correct result, never a silent wrong one, and a refused
batch or load leaves everything as it was. One test per class of bad input, several variants
each."""

import copy
import math
import re
import warnings

import pytest
import torch
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from conftest import DIM, calibration_batches, convert, make, prepare, quantized, sqnr_db
from models import MLP, aliased_linear
from tiny_llama import tiny_llama, token_ids
from nvfp4_static import (
    NVFP4StaticActivationConfig,
    NVFP4StaticLinear,
    NVFP4StaticObservedLinear,
    NVFP4StaticTensor,
    calibrate_layer_by_layer,
    calibrate_model,
    convert_data_parallel,
    export_checkpoint,
    is_quantizable,
    load_quantized,
)
from nvfp4_static.numerics import fake_quantize_nvfp4, per_tensor_amax_to_scale


def calibrate(model, batches):
    with torch.no_grad():
        for batch in batches:
            model(batch)


# --- a recipe's state decided by one batch ------------------------------------------------------


@pytest.mark.parametrize("first_scale", [1e-3, 1e-6], ids=["1e-3", "1e-6"])
def test_mse_search_is_not_anchored_for_good_by_a_small_first_batch(first_scale):
    model = prepare(make(MLP), act_calibration="mse")
    normal = calibration_batches(4)
    with pytest.warns(UserWarning, match="'up'.*restarts anchored"):
        calibrate(model, [normal[0] * first_scale] + normal)
    convert(model, act_calibration="mse")
    literal_max = max(float(b.abs().max()) for b in normal)
    assert 0.25 * literal_max <= model.up.act_global_amax <= 4 * literal_max
    assert model.up.calibration_stats["restarts"] == 1


def test_mse_search_with_a_large_first_batch_keeps_every_batch():
    model = prepare(make(MLP), act_calibration="mse")
    batches = calibration_batches(4)
    calibrate(model, [batches[0] * 3] + batches[1:])
    assert model.up.act_calibrator.restarts == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_refused_first_batch_leaves_no_mse_anchor(bad):
    refused_first, clean = prepare(make(MLP), act_calibration="mse"), prepare(make(MLP), act_calibration="mse")
    poisoned = calibration_batches(1, seed=7)[0] * 1e-3
    poisoned[0, 0, 0] = bad
    with pytest.raises(ValueError, match="NaN"):
        calibrate(refused_first, [poisoned])
    calibrate(refused_first, calibration_batches())
    calibrate(clean, calibration_batches())
    assert refused_first.up.act_calibrator.compute_amax() == clean.up.act_calibrator.compute_amax()


# --- convert's recipe disagrees with prepare's --------------------------------------------------


@pytest.mark.parametrize(
    "prepared, converting, field",
    [
        (dict(), dict(act_calibration="max"), "act_calibration"),
        (dict(rho=8192.0), dict(), "rho"),
        (dict(act_calibration="percentile", percentile=99.0), dict(act_calibration="percentile"), "percentile"),
        (dict(act_calibration="mse"), dict(act_calibration="mse", mse_stop_multiplier=2.0), "mse_stop"),
    ],
    ids=["act_calibration", "rho", "percentile", "mse_grid"],
)
def test_convert_refuses_an_activation_recipe_prepare_did_not_calibrate(prepared, converting, field):
    model = prepare(make(MLP), **prepared)
    calibrate(model, calibration_batches())
    with pytest.raises(ValueError, match=f"'up' was prepared with another activation recipe.*{field}"):
        convert(model, **converting)
    assert isinstance(model.up, NVFP4StaticObservedLinear)  # nothing converted: fix and retry
    convert(model, **prepared)
    assert isinstance(model.up, NVFP4StaticLinear)


def test_convert_may_choose_another_weight_recipe_than_prepare():
    model = quantized(make(MLP), act_calibration="max")
    fresh = prepare(make(MLP), act_calibration="max")
    calibrate(fresh, calibration_batches())
    convert(fresh, act_calibration="max", weight_scale="max")
    assert fresh.up.recipe == {"act_calibration": "max", "weight_scale": "max"}
    assert fresh.up.act_global_amax == model.up.act_global_amax


@pytest.mark.parametrize(
    "again",
    [dict(act_calibration="max", weight_scale="mse"), dict(weight_scale="max"), dict(weight_scale="gptq")],
    ids=["act_calibration", "weight_scale", "gptq"],
)
def test_converting_a_converted_layer_with_another_recipe_is_refused(again):
    model = quantized(make(MLP), weight_scale="mse")
    before = model.up.weight.qdata.clone(), model.up.weight.scale.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=r"'up' is already converted with \{'act_calibration': 'b_min', "
                                         r"'weight_scale': 'mse'\}, and convert asks for"):
        convert(model, **again)
    assert model.up.recipe == {"act_calibration": "b_min", "weight_scale": "mse"}
    assert torch.equal(model.up.weight.qdata, before[0])
    assert torch.equal(model.up.weight.scale.view(torch.uint8), before[1])
    x = calibration_batches(1, seed=5)[0]
    expected = model(x)
    convert(model, weight_scale="mse")  # the same recipe again: nothing to do
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("weight_scale", ["max", "mse", "hessian_mse", "gptq"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_weight_with_non_finite_values_is_refused_at_convert_naming_the_layer(weight_scale, bad):
    model = prepare(make(MLP), weight_scale=weight_scale)
    calibrate(model, calibration_batches())
    with torch.no_grad():
        model.down.weight[7, 40] = bad
    with pytest.raises(ValueError, match=rf"cannot convert layer 'down': its weight of shape \[{DIM}, 128\] holds "
                                         rf"{int(math.isnan(bad))} NaN and {int(math.isinf(bad))} Inf values "
                                         rf"\(first at index \(7, 40\)\)"):
        convert(model, weight_scale=weight_scale)
    assert type(model.down) is NVFP4StaticObservedLinear


@pytest.mark.parametrize("weight_scale", ["max", "mse", "hessian_mse", "gptq"])
def test_an_all_zero_weight_converts_to_a_layer_that_outputs_its_bias(weight_scale):
    model = prepare(make(MLP), weight_scale=weight_scale)
    with torch.no_grad():
        model.down.weight.zero_()
    calibrate(model, calibration_batches())
    convert(model, weight_scale=weight_scale)
    codes = model.down.weight.scale.view(torch.uint8)
    assert not bool(((codes & 0x7F) == 0x7F).any())  # no NaN block scale
    hidden = torch.randn(5, 128)
    with torch.no_grad():
        assert torch.equal(model.down(hidden), model.down.bias.expand(5, DIM))


@pytest.mark.parametrize("gain", [2.0**-80, 2.0**-60, 2.0**60, 2.0**80], ids=["2^-80", "2^-60", "2^60", "2^80"])
@pytest.mark.parametrize("weight_scale", ["mse", "hessian_mse", "gptq"])
def test_a_weight_scaled_by_a_power_of_two_converts_to_the_same_codes_and_block_scales(weight_scale, gain):
    """The searches sum squared errors in float32: a weight far from unit magnitude had every
    candidate's error underflow to 0 (the smallest scale won) or overflow (scale 0), and came out
    at 0 dB without a warning."""
    converted = []
    for factor in (1.0, gain):
        model = prepare(make(MLP), weight_scale=weight_scale)
        with torch.no_grad():
            model.down.weight.mul_(factor)
        calibrate(model, calibration_batches())
        convert(model, weight_scale=weight_scale)
        converted.append(model.down.weight)
    unit, scaled = converted
    assert torch.equal(scaled.qdata, unit.qdata)
    assert torch.equal(scaled.scale.view(torch.uint8), unit.scale.view(torch.uint8))
    assert torch.equal(scaled.per_tensor_scale, unit.per_tensor_scale * gain)


# --- modules replaced that should not be --------------------------------------------------------


class ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class GatedLinear(torch.nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.gate = torch.nn.Parameter(torch.ones(self.out_features))


class PlainSubclass(torch.nn.Linear):
    """Adds nothing: quantizing it keeps what it computes."""


@pytest.mark.parametrize("cls, what", [(ScaledLinear, "own forward"), (GatedLinear, "parameters")],
                         ids=["own_forward", "extra_parameter"])
def test_a_linear_subclass_that_changes_the_layer_is_left_float(cls, what):
    torch.manual_seed(0)
    model = torch.nn.Sequential(cls(DIM, DIM))
    with pytest.warns(UserWarning, match=f"'0' is left unquantized.*{cls.__name__}.*{what}"):
        prepare(model)
    assert type(model[0]) is cls
    with pytest.raises(ValueError, match=cls.__name__):
        prepare(torch.nn.Sequential(cls(DIM, DIM)), strict=True)


def test_a_model_with_layers_prepare_left_float_converts():
    torch.manual_seed(0)
    model = torch.nn.Sequential(ScaledLinear(DIM, DIM), torch.nn.Linear(DIM, 48), torch.nn.Linear(48, DIM))
    with pytest.warns(UserWarning, match="left unquantized"):
        prepare(model)
    calibrate(model, calibration_batches())
    convert(model)
    assert [type(m) for m in model] == [ScaledLinear, NVFP4StaticLinear, NVFP4StaticLinear]


def test_a_linear_subclass_that_adds_nothing_is_quantized():
    model = prepare(torch.nn.Sequential(PlainSubclass(DIM, DIM)))
    assert isinstance(model[0], NVFP4StaticObservedLinear)


@pytest.mark.parametrize("holders", [2, 3])
def test_a_linear_several_parents_hold_stays_one_layer(holders):
    torch.manual_seed(0)
    shared = torch.nn.Linear(DIM, DIM)
    model = torch.nn.Sequential(*[torch.nn.Sequential(shared) for _ in range(holders)])
    float_model = copy.deepcopy(model)
    prepare(model)
    assert len({id(parent[0]) for parent in model}) == 1
    calibrate(model, calibration_batches())
    convert(model)
    layer = model[0][0]
    assert len({id(parent[0]) for parent in model}) == 1 and isinstance(layer, NVFP4StaticLinear)
    assert torch.equal(layer.bias, float_model[0][0].bias)
    x = calibration_batches(1, seed=3)[0]
    with torch.no_grad():
        expected = x
        for _ in range(holders):
            expected = layer(expected)
        assert torch.equal(model(x), expected)


def test_a_linear_one_parent_holds_under_several_names_stays_one_layer():
    """quantize_ visits a module once per parent: its later names would keep the float layer,
    and the model would run it float there and quantized at the first name."""
    model = aliased_linear()
    prepare(model)
    assert isinstance(model[0], NVFP4StaticObservedLinear) and model[2] is model[0] and model[3] is model[0]
    calibrate(model, calibration_batches())
    convert(model)
    layer = model[0]
    assert isinstance(layer, NVFP4StaticLinear) and model[2] is layer and model[3] is layer
    x = calibration_batches(1, seed=3)[0]
    with torch.no_grad():
        expected = layer(layer(torch.nn.functional.gelu(layer(x))))
        assert torch.equal(model(x), expected)
    # Saved and loaded into the same architecture, and into its placeholders.
    state = model.state_dict()
    for target in (load_quantized(aliased_linear(seed=1), state), aliased_linear(seed=1)):
        if not isinstance(target[0], NVFP4StaticLinear):
            quantize_(target, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable)
            target.load_state_dict(state)
        assert isinstance(target[0], NVFP4StaticLinear) and target[2] is target[0] and target[3] is target[0]
        with torch.no_grad():
            assert torch.equal(target(x), expected)


# --- values outside the histogram's range, degenerate settings ----------------------------------


@pytest.mark.parametrize("act_calibration", ["b_min", "percentile"])
@pytest.mark.parametrize("magnitude", [1e20, 1e-20], ids=["1e20", "1e-20"])
def test_activations_beyond_the_histogram_range_get_a_usable_amax_and_a_warning(act_calibration, magnitude):
    # The plain sweep: the Hessian recipes refuse inputs whose squares overflow float32.
    model = prepare(make(MLP), act_calibration=act_calibration, weight_scale="mse")
    batches = [b * magnitude for b in calibration_batches()]
    calibrate(model, batches)
    with pytest.warns(UserWarning, match="outside|above|below"):
        convert(model, act_calibration=act_calibration, weight_scale="mse")
    g_amax = model.up.act_global_amax
    literal_max = max(float(b.abs().max()) for b in batches)
    assert math.isfinite(g_amax) and g_amax >= literal_max * 0.99
    x = batches[0]
    static = fake_quantize_nvfp4(x, per_tensor_amax_to_scale(torch.tensor(g_amax)))
    assert sqnr_db(x, static) > 15


def test_a_reading_from_the_bottom_bin_warns_even_when_the_literal_max_lies_in_range():
    """Blocks below the range and one outlier in it: B_min's percentile falls in the bottom
    bin, whose centre (about 1e-12) lies far above the data there (near 1e-20), so every input
    would quantize to zero: the reading warns."""
    model = prepare(make(MLP), weight_scale="mse")
    batches = [b * 1e-20 for b in calibration_batches()]
    batches[0][0, 0] = 1.0
    calibrate(model, batches)
    with pytest.warns(UserWarning, match="percentile lies in the histogram's bottom bin"):
        convert(model, weight_scale="mse")


def test_a_reading_inside_the_range_does_not_warn():
    model = prepare(make(MLP), weight_scale="mse")
    calibrate(model, calibration_batches())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(model, weight_scale="mse")


@pytest.mark.parametrize(
    "field, named",
    [
        (dict(num_bins=2.5), "num_bins"), (dict(num_bins=True), "num_bins"), (dict(num_bins=1), "num_bins"),
        (dict(log2_min=5.0, log2_max=6.0), "range"), (dict(log2_min=float("nan")), "log2_min"),
        (dict(log2_min=3.0, log2_max=-3.0), "log2_min"),
        (dict(b_min_percentile=50.0, b_max_percentile=10.0), "b_min_percentile"),
        (dict(margin=-1.0), "margin"),
        (dict(act_calibration="percentile", percentile=0.0), "percentile"),
        (dict(act_calibration="mse", mse_start_multiplier=2.0, mse_stop_multiplier=1.0), "start_multiplier"),
        (dict(act_calibration="mse", mse_step_size=0.0), "step_size"),
        (dict(num_bins=159), r"159 bins over 2\^-40..2\^40 are 0.503 octaves wide.*at least 160 bins"),
        (dict(act_calibration="percentile", num_bins=2), r"2 bins over .* are 40 octaves wide"),
        (dict(log2_max=2000.0), r"512 bins over 2\^-40..2\^2000 are 3.98 octaves wide"),
        (dict(num_bins=10**9), "num_bins must be an integer from 2 to 65536, got 1000000000"),
        (dict(num_bins="abc"), "num_bins must be an integer from 2 to 65536, got 'abc'"),
        (dict(num_bins=float("nan")), "num_bins must be an integer from 2 to 65536, got nan"),
        (dict(margin=float("inf")), "margin must be a finite value > 0, got inf"),
        (dict(margin=float("nan")), "margin must be a finite value > 0, got nan"),
        (dict(act_calibration="mse", mse_stop_multiplier=float("inf")), "all finite; got start=0.25, stop=inf"),
        (dict(act_calibration="mse", mse_step_size=float("inf")), "all finite; got start=0.25, stop=4.0, step=inf"),
        (dict(act_calibration="mse", mse_step_size=1e-9), "has 3750000001 multipliers, more than 1000"),
    ],
    ids=["fractional_bins", "bool_bins", "one_bin", "narrow_range", "nan_range", "inverted_range",
         "b_min_above_b_max", "negative_margin", "zero_percentile", "inverted_mse_grid", "zero_mse_step",
         "bins_half_an_octave_wide", "two_bins", "wide_range", "billion_bins", "string_bins", "nan_bins",
         "infinite_margin", "nan_margin", "infinite_mse_stop", "infinite_mse_step", "tiny_mse_step"],
)
def test_degenerate_settings_are_refused_when_the_config_is_made(field, named):
    with pytest.raises(ValueError, match=f"NVFP4StaticActivationConfig.*{named}"):
        NVFP4StaticActivationConfig(**field)


def test_the_finest_settings_the_checks_allow_are_accepted():
    NVFP4StaticActivationConfig(num_bins=160)  # half an octave per bin over 80
    NVFP4StaticActivationConfig(act_calibration="mse", mse_start_multiplier=1.0, mse_stop_multiplier=10.99,
                                mse_step_size=0.01)  # 1000 multipliers


@pytest.mark.parametrize(
    "field, message",
    [
        (dict(rho="16384"), "rho='16384' must be a number"),
        (dict(margin=None), "margin=None must be a number"),
        (dict(percentile=True), "percentile=True must be a number"),
        (dict(log2_min=[-40.0]), r"log2_min=\[-40.0\] must be a number"),
        (dict(strict="yes"), "strict='yes' must be True or False"),
        (dict(strict=1), "strict=1 must be True or False"),
    ],
    ids=["string_rho", "none_margin", "bool_percentile", "list_log2_min", "string_strict", "int_strict"],
)
def test_settings_of_the_wrong_type_are_refused_naming_them(field, message):
    with pytest.raises(TypeError, match=f"NVFP4StaticActivationConfig: {message}"):
        NVFP4StaticActivationConfig(**field)


# --- empty batches ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [dict(act_calibration="max"), dict(), dict(act_calibration="mse"), dict(weight_scale="hessian_mse")],
    ids=["max", "b_min", "mse", "hessian"],
)
def test_an_empty_calibration_batch_changes_nothing(config):
    with_empty, without = prepare(make(MLP), **config), prepare(make(MLP), **config)
    empty = torch.empty(0, DIM)
    calibrate(with_empty, [empty, calibration_batches(1)[0], empty.reshape(2, 0, DIM)] + calibration_batches()[1:])
    calibrate(without, calibration_batches())
    convert(with_empty, **config)
    convert(without, **config)
    assert with_empty.up.act_global_amax == without.up.act_global_amax
    assert torch.equal(with_empty.up.weight.scale.view(torch.uint8), without.up.weight.scale.view(torch.uint8))


# --- unchecked loads and misuse after convert ---------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf"), 1e-40, 1e36, 3e38],
                         ids=["nan", "zero", "negative", "inf", "too_small", "too_large", "near_float32_max"])
def test_a_checkpoint_with_an_impossible_activation_scale_is_refused(bad):
    state = quantized(make(MLP)).state_dict()
    state["down.weight"].act_per_tensor_scale.fill_(bad)
    target = make(MLP, seed=1)
    with pytest.raises(ValueError, match="'down' has activation scale"):
        load_quantized(target, state)
    assert type(target.up) is torch.nn.Linear and type(target.down) is torch.nn.Linear
    placeholder = make(MLP, seed=1)
    quantize_(placeholder, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable)
    with pytest.raises(ValueError, match="'down' has activation scale"):
        placeholder.load_state_dict(state)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("-inf"), 1e36, 1e38],
                         ids=["nan", "negative", "minus_inf", "too_large", "overflowing"])
def test_a_checkpoint_with_an_impossible_weight_scale_is_refused(bad):
    state = quantized(make(MLP)).state_dict()
    state["up.weight"].per_tensor_scale.fill_(bad)
    target = make(MLP, seed=1)
    before = {name: value.clone() for name, value in target.state_dict().items()}
    with pytest.raises(ValueError, match="'up' has weight scale"):
        load_quantized(target, state)
    assert all(torch.equal(before[name], value) for name, value in target.state_dict().items())


@pytest.mark.parametrize("act, weight", [(1e20, 1e20), (1e30, 1e10), (1e35, 1e4)])
def test_a_checkpoint_whose_global_scales_multiply_past_float32_is_refused(act, weight):
    """Each within what convert makes, their product is every output's factor: Inf or NaN."""
    state = quantized(make(MLP)).state_dict()
    state["down.weight"].act_per_tensor_scale.fill_(act)
    state["down.weight"].per_tensor_scale.fill_(weight)
    target = make(MLP, seed=1)
    with pytest.raises(ValueError, match="'down' has activation scale .* whose product .* overflows float32"):
        load_quantized(target, state)
    assert type(target.up) is torch.nn.Linear and type(target.down) is torch.nn.Linear


@pytest.mark.parametrize("in_features", [65, 60, 72])
def test_a_checkpoint_loaded_into_a_linear_nvfp4_cannot_hold_is_refused(in_features):
    """Sized by in_features // 2 and // 16, a 65-wide layer's tensors would take a 64-wide
    checkpoint and fail only at the first call."""
    state = quantized(torch.nn.Sequential(torch.nn.Linear(64, 32))).state_dict()
    target = torch.nn.Sequential(torch.nn.Linear(in_features, 32))
    with pytest.raises(ValueError, match=rf"layer '0' is Linear\({in_features} -> 32\); a converted layer needs in_features a multiple of 16"):
        load_quantized(target, state)
    assert type(target[0]) is torch.nn.Linear


def test_a_checkpoint_loaded_into_a_model_on_the_meta_device_is_refused():
    state = quantized(make(MLP)).state_dict()
    with torch.device("meta"):
        target = make(MLP, seed=1)
    with pytest.raises(ValueError, match=r"load_quantized: the model's tensors are on the meta device \(first: 'up.weight'\)"):
        load_quantized(target, state)
    assert type(target.up) is torch.nn.Linear


def test_the_largest_global_scales_convert_makes_load():
    """A weight holding float32's largest value gets convert's largest weight scale, and a
    checkpoint of it loads: the bound on checkpoint scales refuses only what convert never makes."""
    model = make(MLP)
    with torch.no_grad():
        model.down.weight[0, 0] = torch.finfo(torch.float32).max
    state = quantized(model).state_dict()
    assert float(state["down.weight"].per_tensor_scale) > 1e35
    target = make(MLP, seed=1)
    load_quantized(target, state)
    assert torch.equal(target.down.weight.per_tensor_scale, state["down.weight"].per_tensor_scale)


def converted_tensors(model):
    """Every converted weight's four tensors and every float tensor, cloned, by name."""
    tensors = {}
    for name, value in model.state_dict().items():
        if isinstance(value, torch.Tensor) and hasattr(value, "qdata"):
            for field in ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale"):
                tensors[f"{name}.{field}"] = getattr(value, field).view(torch.uint8).clone() if field == "scale" \
                    else getattr(value, field).clone()
        elif isinstance(value, torch.Tensor):
            tensors[name] = value.clone()
    return tensors


def assert_same_tensors(before, after):
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before), [
        key for key in before if not torch.equal(before[key], after[key])
    ]


@pytest.mark.parametrize("code", [0x7F, 0xFF, 0xB8, 0x81], ids=["nan", "negative-nan", "minus-one", "negative-tiny"])
def test_a_checkpoint_with_an_impossible_block_scale_is_refused_before_anything_is_copied(code):
    state = quantized(make(MLP)).state_dict()
    state["down.weight"].scale.view(torch.uint8)[5, 1] = code
    target = make(MLP, seed=1)
    before = converted_tensors(target)
    with pytest.raises(ValueError, match=r"'down' has 1 FP8 block scale\(s\) that are NaN or negative \(the first at index \[5, 1\]"):
        load_quantized(target, state)
    assert type(target.up) is torch.nn.Linear and type(target.down) is torch.nn.Linear
    assert_same_tensors(before, converted_tensors(target))
    placeholder = make(MLP, seed=1)
    quantize_(placeholder, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable)
    empty = converted_tensors(placeholder)
    with pytest.raises(ValueError, match="'down' has 1 FP8 block scale"):
        placeholder.load_state_dict(state)
    assert not placeholder.up.loaded and not placeholder.down.loaded
    assert_same_tensors(empty, converted_tensors(placeholder))


def with_fields(weight, **fields):
    """``weight`` rebuilt with some of its four tensors replaced."""
    parts = {name: getattr(weight, name) for name in ("qdata", "scale", "per_tensor_scale", "act_per_tensor_scale")}
    parts.update(fields)
    return NVFP4StaticTensor(parts["qdata"], parts["scale"], 16, weight.orig_dtype, parts["per_tensor_scale"],
                             parts["act_per_tensor_scale"])


def filled(weight, part, value):
    """``weight`` after filling ``part`` of it with ``value``."""
    part.fill_(value)
    return weight


def with_attribute(weight, name, value):
    """``weight`` with one of its tensors set as ``torch.load`` restores a damaged one (the
    constructor's checks do not run)."""
    setattr(weight, name, value)
    return weight


# Damage that a layer's checks see; the last two would each copy part of the layer (and the
# layers before it) and then fail. (Codes or block scales of another dtype the tensor refuses.)
DAMAGES = {
    "block-scale": lambda w: filled(w, w.scale.view(torch.uint8)[0, 0], 0x7F),
    "activation-scale": lambda w: filled(w, w.act_per_tensor_scale, float("nan")),
    "weight-scale": lambda w: filled(w, w.per_tensor_scale, -1.0),
    "float-weight": lambda w: w.dequantize(),
    "activation-scale-of-shape-1": lambda w: with_fields(w, act_per_tensor_scale=w.act_per_tensor_scale.reshape(1)),
    "block-scales-as-uint8": lambda w: with_attribute(w, "scale", w.scale.view(torch.uint8)),
    "block-scales-as-float32": lambda w: with_attribute(w, "scale", w.scale.float()),
    "codes-as-int8": lambda w: with_attribute(w, "qdata", w.qdata.view(torch.int8)),
    "codes-as-int64": lambda w: with_attribute(w, "qdata", w.qdata.long()),
}


def damage_down(state: dict, damage: str) -> None:
    """Make ``state``'s last converted layer, ``down``, one a load refuses."""
    if damage == "recipe":
        state["down._extra_state"] = {**state["down._extra_state"], "weight_scale": "max"}
    else:
        state["down.weight"] = DAMAGES[damage](state["down.weight"])


class Outer(torch.nn.Module):
    """A model holding the quantized one as a child, loaded as a whole."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.head = torch.nn.Linear(DIM, 4)


@pytest.mark.parametrize("damage", [*DAMAGES, "recipe"])
@pytest.mark.parametrize("target", ["placeholder", "converted", "placeholder-inside-another-model"])
def test_model_load_state_dict_refusing_its_last_layer_loads_none_of_the_others(damage, target):
    """torch loads module by module; the layers before the refused one were loaded when each
    layer checked only its own entries as it loaded them."""
    source = quantized(make(MLP, seed=3))
    if target == "converted":
        model = quantized(make(MLP, seed=1))
    else:
        model = make(MLP, seed=1)
        quantize_(model, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable)
    state = source.state_dict()
    damage_down(state, damage)
    if target == "placeholder-inside-another-model":
        model = Outer(model)
        state = {**{f"inner.{key}": value for key, value in state.items()}, **{
            f"head.{key}": value for key, value in model.head.state_dict().items()}}
    before = converted_tensors(model)
    with pytest.raises(ValueError, match="'down'"):
        model.load_state_dict(state)
    assert_same_tensors(before, converted_tensors(model))
    quantized_model = model.inner if target == "placeholder-inside-another-model" else model
    assert quantized_model.up.loaded == (target == "converted")


@pytest.mark.parametrize("into", ["converted", "converted_load_state_dict", "placeholder"])
def test_a_checkpoint_of_another_recipe_is_refused_before_anything_is_copied(into):
    state = quantized(make(MLP, seed=3), weight_scale="max").state_dict()
    if into == "placeholder":
        target = make(MLP, seed=1)
        quantize_(target, NVFP4StaticActivationConfig(step="prepare_for_loading", weight_scale="mse"),
                  filter_fn=is_quantizable)
    else:
        target = quantized(make(MLP, seed=1), weight_scale="mse")
    before = converted_tensors(target)
    with pytest.raises(ValueError, match=r"'up' was made with recipe \{'act_calibration': 'b_min', 'weight_scale': 'max'\}"):
        if into == "converted":
            load_quantized(target, state)
        else:
            target.load_state_dict(state)
    assert_same_tensors(before, converted_tensors(target))
    assert target.up.loaded == (into != "placeholder")


@pytest.mark.parametrize("value", [None, [0.0] * DIM, "bias", 1.5], ids=["none", "list", "string", "float"])
def test_a_checkpoint_entry_that_is_not_a_tensor_is_refused_and_the_float_model_keeps_its_values(value):
    state = quantized(make(MLP)).state_dict()
    state["down.bias"] = value
    target = make(MLP, seed=1)
    before = converted_tensors(target)
    with pytest.raises(RuntimeError, match=rf"'down.bias' is a {type(value).__name__} in the checkpoint and a Tensor"):
        load_quantized(target, state)
    assert type(target.up) is torch.nn.Linear and type(target.down) is torch.nn.Linear
    assert_same_tensors(before, converted_tensors(target))


def torchao_nvfp4(shape):
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    return NVFP4Tensor.to_nvfp4(torch.randn(shape))


@pytest.mark.parametrize("entry, value, message", [
    ("1.weight", lambda: torchao_nvfp4((64, 64)), "'1.weight' is a NVFP4Tensor in the checkpoint and a Tensor"),
    ("1.bias", lambda: torch.empty(64, device="meta"), "'1.bias' is on the meta device in the checkpoint"),
    ("0.bias", lambda: torch.empty(64, device="meta"), "'0.bias' is on the meta device in the checkpoint"),
], ids=["torchao-nvfp4-into-a-float-weight", "meta-float-bias", "meta-converted-bias"])
def test_a_checkpoint_entry_whose_copy_would_fail_is_refused_before_anything_is_copied(entry, value, message):
    """Each passes the shape checks; its copy would fail after the entries before it are copied."""
    def two_layers(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))

    only_first = lambda module, fqn: is_quantizable(module, fqn) and fqn == "0"  # noqa: E731
    source = two_layers(0)
    quantize_(source, NVFP4StaticActivationConfig(step="prepare"), filter_fn=only_first)
    with torch.no_grad():
        source(torch.randn(8, 64))
    quantize_(source, NVFP4StaticActivationConfig(step="convert"), filter_fn=only_first)
    state = {**source.state_dict(), entry: value()}
    target = two_layers(1)
    before = converted_tensors(target)
    with pytest.raises(RuntimeError, match=f"nothing was loaded\\): {message}"):
        load_quantized(target, state)
    assert type(target[0]) is torch.nn.Linear
    assert_same_tensors(before, converted_tensors(target))


@pytest.mark.parametrize("checkpoint", [[1, 2, 3], torch.zeros(3), None], ids=["list", "tensor", "none"])
def test_load_quantized_refuses_what_is_not_a_state_dict(checkpoint):
    with pytest.raises(TypeError, match=rf"takes a state dict or the path of a file holding one; got a {type(checkpoint).__name__}"):
        load_quantized(make(MLP), checkpoint)


@pytest.mark.parametrize(
    "recipe",
    [
        {"act_calibration": "bogus", "weight_scale": "mse"},
        {"act_calibration": "b_min", "weight_scale": "MSE"},
        {"act_calibration": "b_min", "weight_scale": None},
        {"weight_scale": "gptq", "margin": 2.0},
        {"act_calibration": "b_min", "weight_scale": "mse", "margin": 2.0},
        {"act_calibration": "imported", "weight_scale": ["mse"]},
    ],
    ids=["unknown_calibration", "wrong_case", "none", "an_entry_for_another", "extra_entry", "list"],
)
@pytest.mark.parametrize("into", ["load_quantized", "placeholder"])
def test_a_checkpoint_recording_a_recipe_no_convert_makes_is_refused(recipe, into):
    """load_quantized builds each layer from the recipe its checkpoint records, so a damaged
    record would otherwise become the model's recipe, reported by the layer and exported."""
    state = quantized(make(MLP)).state_dict()
    state["up._extra_state"] = {"format": "nvfp4_static", "version": 1, **recipe}
    target = make(MLP, seed=1)
    if into == "placeholder":
        quantize_(target, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable)
    before = converted_tensors(target)
    with pytest.raises(ValueError, match=r"'up' records recipe .*the checkpoint is damaged or was edited"):
        load_quantized(target, state) if into == "load_quantized" else target.load_state_dict(state)
    assert_same_tensors(before, converted_tensors(target))
    assert type(target.up) is (torch.nn.Linear if into == "load_quantized" else NVFP4StaticLinear)


@pytest.mark.parametrize("version", [2, "1", None], ids=["newer", "string", "missing"])
def test_a_checkpoint_of_an_unknown_format_version_is_refused(version):
    state = quantized(make(MLP)).state_dict()
    state["up._extra_state"] = {**state["up._extra_state"], "version": version}
    if version is None:
        del state["up._extra_state"]["version"]
    target = make(MLP, seed=1)
    with pytest.raises(ValueError, match=rf"'up' is of format version {version!r}; this nvfp4_static reads versions up to 1"):
        load_quantized(target, state)
    assert type(target.up) is torch.nn.Linear


def test_an_empty_placeholder_is_neither_saved_as_a_checkpoint_nor_exported(tmp_path):
    placeholder = make(MLP)
    quantize_(placeholder, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable)
    for format in ("compressed-tensors", "modelopt"):
        with pytest.raises(ValueError, match=r"cannot export: 2 layer\(s\) are empty placeholders.*first: 'up'"):
            export_checkpoint(placeholder, tmp_path / format, format)
        assert not (tmp_path / format).exists()
    target = make(MLP, seed=1)
    with pytest.raises(ValueError, match="'up' was saved from an empty placeholder"):
        load_quantized(target, placeholder.state_dict())
    assert type(target.up) is torch.nn.Linear
    source = quantized(make(MLP, seed=2))
    placeholder.load_state_dict(source.state_dict())
    loaded = load_quantized(make(MLP, seed=1), placeholder.state_dict())  # once loaded, it saves as usual
    x = calibration_batches(1, seed=4)[0]
    with torch.no_grad():
        assert torch.equal(loaded(x), source(x))


INPUTS_ON_ANOTHER_DEVICE = {
    "input on meta": ("cpu", lambda model, x: model(x.to("meta")), "is on meta, the NVFP4 weight .* on cpu"),
    "model on meta": ("meta", lambda model, x: model(x), "is on cpu, the NVFP4 weight .* on meta"),
    "F.linear with the weight": ("cpu", lambda model, x: torch.nn.functional.linear(x.to("meta"), model.up.weight),
                                 r"\(2, 16, 64\) is on meta, the NVFP4 weight of shape \(128, 64\) on cpu"),
}


@pytest.mark.parametrize("device, run, message", INPUTS_ON_ANOTHER_DEVICE.values(), ids=INPUTS_ON_ANOTHER_DEVICE.keys())
def test_an_input_on_another_device_than_the_weight_is_refused(device, run, message):
    """Taken as it was, the error came from deep inside torch without a shape; on two GPUs the
    Triton kernels would read one device's memory with another's pointers."""
    model = quantized(make(MLP)).to(device)
    with pytest.raises(ValueError, match=rf"nvfp4_static: (layer 'up': )?activation of shape .*{message}.*move the input"):
        run(model, calibration_batches(1)[0])


def test_a_placeholder_refuses_to_run_until_loaded():
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable)
    with pytest.raises(RuntimeError, match="'up' is an empty placeholder"):
        model(calibration_batches(1)[0])
    assert "empty placeholder" in repr(model)
    model.load_state_dict(quantized(make(MLP)).state_dict())
    assert model(calibration_batches(1)[0]).shape == (2, 16, DIM)


@pytest.mark.parametrize("entries", [["up._extra_state"], ["up._extra_state", "up.bias"], ["up.bias"]], ids=str)
def test_a_placeholder_given_only_some_entries_stays_empty_until_its_weight_is_loaded(entries):
    """With strict=False a load may bring the extra state without the weight: the placeholder
    would otherwise run its all-zero weight."""
    model = make(MLP)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare_for_loading"), filter_fn=is_quantizable)
    state = quantized(make(MLP)).state_dict()
    model.load_state_dict({key: state[key] for key in entries}, strict=False)
    with pytest.raises(RuntimeError, match="'up' is an empty placeholder"):
        model(calibration_batches(1)[0])
    assert "empty placeholder" in repr(model.up)
    model.load_state_dict({"up.weight": state["up.weight"]}, strict=False)
    assert model.up.loaded and not model.down.loaded


def test_a_model_on_the_meta_device_prints():
    model = quantized(make(MLP)).to("meta")
    assert "act_global_amax=? (meta)" in repr(model)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad_from", ["input", "bias", "both"])
def test_backward_through_a_converted_layer_names_the_problem(grad_from, compiled, monkeypatch):
    """Compiled too: the forward runs and gives what it gives without gradients; the backward,
    not the compile, raises."""
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    model = quantized(make(MLP))
    run = torch.compile(model, fullgraph=True) if compiled else model
    x = calibration_batches(1)[0]
    with torch.no_grad():
        expected = run(x)
    x.requires_grad_(grad_from in ("input", "both"))
    if grad_from in ("bias", "both"):
        model.down.bias.requires_grad_(True)
    out = run(x)
    assert out.requires_grad and torch.equal(out.detach(), expected)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()
    assert x.grad is None and model.down.bias.grad is None


# --- inference on odd inputs and a route the device cannot run ---------------------------------


@pytest.mark.parametrize("shape", [(0, DIM), (2, 0, DIM), (0, 3, DIM)], ids=["0xK", "2x0xK", "0x3xK"])
def test_a_batch_without_tokens_gives_an_empty_output_like_nn_linear(shape):
    float_model = make(MLP)
    model = quantized(copy.deepcopy(float_model))
    x = torch.empty(shape)
    with torch.no_grad():
        out = model(x)
        expected = float_model(x)
    assert out.shape == expected.shape and out.dtype == expected.dtype


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.bool], ids=str)
@pytest.mark.parametrize("rows", [0, 2])
def test_an_activation_of_a_dtype_the_kernels_do_not_take_is_refused_with_or_without_tokens(dtype, rows):
    model = quantized(make(MLP))
    with pytest.raises(ValueError, match=rf"layer 'up': static NVFP4 linear of an activation \({rows}, {DIM}\): "
                                         rf"activation dtype {dtype} \(float32, bfloat16 or float16\)"):
        with torch.no_grad():
            model.up(torch.zeros(rows, DIM, dtype=dtype))


@pytest.mark.parametrize("shape", [(2, DIM + 16), (2, DIM // 2), ()], ids=["wider", "narrower", "0-d"])
def test_an_activation_of_another_width_is_refused_naming_the_layer(shape):
    model = quantized(make(MLP))
    with pytest.raises(ValueError, match=rf"nvfp4_static: layer 'down': activation of shape {re.escape(str(shape))} "
                                         rf"does not match weight of shape \({DIM}, {2 * DIM}\)"):
        with torch.no_grad():
            model.down(torch.zeros(shape))


def test_a_converted_or_observed_linear_takes_its_input_by_keyword_as_nn_linear_does():
    model = make(MLP)
    x = calibration_batches(1)[0]
    prepare(model)
    with torch.no_grad():
        assert torch.equal(model.up(input=x), model.up(x))
        model(x)
    convert(model)
    with torch.no_grad():
        assert torch.equal(model.up(input=x), model.up(x))


@pytest.mark.parametrize("route", ["config", "environment"])
def test_the_blackwell_route_on_a_cpu_model_is_refused_at_convert(route, monkeypatch):
    config = {"backend": "blackwell"} if route == "config" else {}
    if route == "environment":
        monkeypatch.setenv("NVFP4_STATIC_BACKEND", "blackwell")
    model = prepare(make(MLP), **config)
    calibrate(model, calibration_batches())
    with pytest.raises(ValueError, match="'up': backend 'blackwell'.*sm100.*cpu"):
        convert(model, **config)


class TiedLM(torch.nn.Module):
    """An embedding whose weight the output projection shares, as tied LLM heads do."""

    def __init__(self, vocab: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, DIM)
        self.mlp = MLP()
        self.lm_head = torch.nn.Linear(DIM, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.mlp(self.embed(ids)))


def test_a_linear_whose_weight_is_tied_to_another_module_stays_float_and_tied():
    model = make(TiedLM)
    with pytest.warns(UserWarning, match="'lm_head' is left unquantized: its weight is tied to 'embed'"):
        prepare(model)
    calibrate(model, [torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)])
    convert(model)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.embed.weight
    assert isinstance(model.mlp.up, NVFP4StaticLinear)
    with pytest.raises(ValueError, match="'lm_head'.*tied to 'embed'"):
        prepare(make(TiedLM), strict=True)


def _warnings_of(call) -> list[str]:
    """The messages of the warnings ``call()`` gives under Python's default filter, which shows
    a message once per line of code that leads to it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        call()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("step", ["prepare", "prepare_for_loading"])
@pytest.mark.parametrize(
    "filter_fn",
    [None, lambda module, fqn: isinstance(module, torch.nn.Linear) and fqn != "mlp.down"],
    ids=["torchao's default", "a filter of its own"],
)
def test_a_filter_that_does_not_call_is_quantizable_is_warned_about_once_per_call(filter_fn, step):
    """Only ``is_quantizable`` sees the whole model: without it the tied ``lm_head`` is
    quantized apart from the embedding, which the warning says, once for the call's 2-3 layers."""
    model = make(TiedLM)
    messages = _warnings_of(
        lambda: quantize_(model, NVFP4StaticActivationConfig(step=step), filter_fn=filter_fn)
    )
    assert len(messages) == 1, messages
    for part in ("filter_fn that does not call is_quantizable", "an lm_head tied to the embedding",
                 "experts of mixture-of-experts layers stay float", "Pass filter_fn=is_quantizable"):
        assert part in messages[0]
    assert type(model.lm_head) is not torch.nn.Linear  # what the warning is about


def test_a_filter_that_calls_is_quantizable_gets_no_such_warning():
    model = make(TiedLM)
    messages = _warnings_of(lambda: prepare(model, filter_fn=lambda m, fqn: is_quantizable(m, fqn) and fqn != "mlp.down"))
    assert messages == [
        "nvfp4_static: layer 'lm_head' is left unquantized: its weight is tied to 'embed', and a "
        "quantized copy would untie them"
    ]
    assert type(model.mlp.down) is torch.nn.Linear and isinstance(model.mlp.up, NVFP4StaticObservedLinear)


# --- what quantize_ and the whole-model functions are handed ------------------------------------


@pytest.mark.parametrize("step", ["prepare", "prepare_for_loading", "convert"])
@pytest.mark.parametrize("filter_fn", [is_quantizable, lambda m, fqn: is_quantizable(m, fqn) and fqn != "lm_head"],
                         ids=["is_quantizable", "a filter calling it"])
def test_a_bare_linear_handed_to_quantize_is_refused_telling_to_wrap_it(step, filter_fn):
    """quantize_ keeps the root it was handed: the step would silently do nothing (and convert
    would then blame a missing prepare)."""
    layer = torch.nn.Linear(DIM, 32)
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(ValueError, match=r"the model given to quantize_ is itself a Linear.*wrap it in a parent "
                                         r"module, e.g. torch.nn.Sequential\(layer\)"):
        quantize_(layer, NVFP4StaticActivationConfig(step=step), filter_fn=filter_fn)
    assert type(layer) is torch.nn.Linear
    assert all(torch.equal(value, layer.state_dict()[key]) for key, value in before.items())


def test_calibrate_model_on_a_bare_linear_is_refused_telling_to_wrap_it():
    layer = torch.nn.Linear(DIM, 32)
    with pytest.raises(ValueError, match="is itself a Linear.*wrap it"):
        calibrate_model(layer, [torch.randn(4, DIM)], progress=False)
    assert type(layer) is torch.nn.Linear


NOT_OUR_CONFIGS = {
    "a dict": {"act_calibration": "max"},
    "the class": NVFP4StaticActivationConfig,
    "another torchao config": Int8WeightOnlyConfig(),
    "a recipe's name": "b_min+mse",
}
NOT_OUR_CONFIGS_NAMED = {"a dict": "a dict", "the class": "the class NVFP4StaticActivationConfig",
                         "another torchao config": "a Int8WeightOnlyConfig", "a recipe's name": "a str"}


@pytest.mark.parametrize("kind", NOT_OUR_CONFIGS)
@pytest.mark.parametrize("entry", ["calibrate_model", "calibrate_layer_by_layer", "convert_data_parallel"])
def test_a_config_that_is_not_ours_is_refused_naming_it_before_the_model_changes(entry, kind):
    """calibrate_model folded the smoothing into the norms first, then failed inside
    dataclasses.replace: a retry smoothed the model twice."""
    model = tiny_llama()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    calls = {
        "calibrate_model": lambda: calibrate_model(model, [token_ids(0)], NOT_OUR_CONFIGS[kind], progress=False),
        "calibrate_layer_by_layer": lambda: calibrate_layer_by_layer(model, [token_ids(0)], NOT_OUR_CONFIGS[kind],
                                                                     device="cpu", progress=False),
        "convert_data_parallel": lambda: convert_data_parallel(model, NOT_OUR_CONFIGS[kind]),
    }
    with pytest.raises(TypeError, match=rf"{entry}: config must be an NVFP4StaticActivationConfig instance .* or "
                                        rf"None, got {NOT_OUR_CONFIGS_NAMED[kind]}$"):
        calls[entry]()
    after = model.state_dict()
    assert all(torch.equal(value, after[key]) for key, value in before.items())


class WithUnusedBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(DIM, DIM)
        self.unused = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.used(x)


def test_a_layer_the_batches_never_reach_is_named_with_the_way_out():
    model = prepare(WithUnusedBranch())
    calibrate(model, calibration_batches())
    with pytest.raises(RuntimeError, match="cannot convert layer 'unused': .*leave it out with filter_fn"):
        convert(model)
    leave_out = lambda module, fqn: is_quantizable(module, fqn) and fqn != "unused"  # noqa: E731
    quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=leave_out)
    assert type(model.used) is NVFP4StaticLinear and type(model.unused) is NVFP4StaticObservedLinear
