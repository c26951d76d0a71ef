"""What ``quantize_(model, NVFP4StaticActivationConfig(...))`` does to each layer, step by step.

1. ``step="prepare"``: an eligible ``nn.Linear`` becomes an ``NVFP4StaticObservedLinear`` that
   feeds its inputs to an activation calibrator (and, for ``weight_scale="hessian_mse"``, a
   Hessian accumulator) while the user runs calibration data through the model.
2. ``step="convert"``: the activation calibrator gives the activation global amax, the public
   weight calibrator ``NVFP4MSECalibrator`` gives the FP8 block scales, and both are baked into
   an ``NVFP4StaticTensor`` held by an ``NVFP4StaticLinear``. Layers that
   ``nvfp4_static.tie_fused_layers`` tied read their fusion group's shared amaxes instead.
3. ``step="prepare_for_loading"``: empty ``NVFP4StaticLinear`` layers for ``load_state_dict``
   (``nvfp4_static.load_quantized`` does this from what a checkpoint records instead).

torchao hands a handler the module alone. ``is_quantizable``, the ``filter_fn`` of this config,
is what sees the whole model: it records each module's name as ``quantize_`` walks the model,
finds the linears tied to another module's weight and selects registered experts. Prepare warns
where a layer comes through another filter (torchao's default among them).
"""

import weakref
from typing import Optional

import torch
from torchao.quantization.transform_module import register_quantize_module_handler

from nvfp4_static.backends import check_runs_on
from nvfp4_static.checkpoint import check_converted_layers_on_load, later_names, replace_submodule
from nvfp4_static.config import NVFP4StaticActivationConfig
from nvfp4_static.convert_progress import ConvertProgress
from nvfp4_static.experts import (
    NVFP4StaticExperts,
    NVFP4StaticObservedExperts,
    experts_layout,
)
from nvfp4_static.experts.layouts import why_experts_left_float
from nvfp4_static.gptq import GPTQResult, gptq_quantize_nvfp4
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.messages import warn
from nvfp4_static.numerics import (
    BLOCK_SIZE,
    check_dtype,
    dequantize_nvfp4,
    is_usable_act_per_tensor_scale,
    non_finite_summary,
    per_tensor_amax_to_scale,
    times_block_scales,
)
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.observers import BlockHessianAccumulator, NVFP4MSECalibrator
from nvfp4_static.observers.full_hessian import FullHessianAccumulator, block_diagonal
from nvfp4_static.observers.nvfp4_mse import GlobalAmaxTooSmallError
from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = ["is_quantizable", "layer_name", "sweep_weight_block_scales"]

_LAYER_NAMES: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
# What the error for a layer without calibration data adds: a layer the batches never reach.
_UNREACHED = (
    "A layer these batches never reach (an unused branch) cannot be calibrated: leave it out "
    "with filter_fn, at prepare and convert. Layers converted before this one stay converted"
)
_CONVERT_PROGRESS = ConvertProgress()
# ``with converts_without_bar():`` around a convert shows no bar over its layers.
converts_without_bar = _CONVERT_PROGRESS.without_bar
_WEIGHT_HELD_ELSEWHERE: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
# Each expert's observed linear inside observed experts, and the experts' name: the steps take the
# experts as one module, never one of their linears alone.
EXPERTS_HOLDING: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
# The Hessian each weight recipe reads, gathered during calibration.
HESSIAN_ACCUMULATORS = {"hessian_mse": BlockHessianAccumulator, "gptq": FullHessianAccumulator}
# A module's later names where the model holds it under several (in one parent quantize_ visits
# the first only), and the replacements put there, by the step that made them: the same step
# may meet them under those names, and leaves them as they are.
_LATER_NAMES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_PUT_UNDER_LATER_NAMES: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
# What each step put in place of a module, so that a module two parents hold (visited twice by
# quantize_) gets one replacement, not two diverging copies.
_REPLACEMENTS: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = (
    weakref.WeakKeyDictionary()
)


def is_quantizable(module: torch.nn.Module, fqn: str) -> bool:
    """``quantize_``'s ``filter_fn`` for this config: selects ``nn.Linear`` layers, as torchao's
    default does, and the experts of mixture-of-experts layers registered with
    ``register_experts``, and records ``fqn`` so that every message names the layer.

    Combine it with your own rule, e.g. to keep ``lm_head`` in float::

        quantize_(model, config, filter_fn=lambda m, fqn: is_quantizable(m, fqn) and fqn != "lm_head")
    """
    selected = isinstance(module, torch.nn.Linear) or _is_experts(module)
    if fqn == "":  # quantize_ asks about the root first: the one time the whole model is seen
        if selected:
            raise ValueError(
                f"nvfp4_static: the model given to quantize_ is itself a {type(module).__name__}, which "
                f"quantize_ cannot replace (it keeps the root it was given, so the step would do "
                f"nothing); wrap it in a parent module, e.g. torch.nn.Sequential(layer)"
            )
        record_weights_held_elsewhere(module)
        _record_later_names(module)
        check_converted_layers_on_load(module)
    _LAYER_NAMES[module] = fqn
    return selected


WITHOUT_IS_QUANTIZABLE = (
    "nvfp4_static: quantize_ reached a layer through a filter_fn that does not call "
    "is_quantizable (torchao's default selects nn.Linear alone). Without it, messages name layers "
    "by their shapes, a linear whose weight another module also holds (an lm_head tied to the "
    "embedding) is quantized apart from it, the experts of mixture-of-experts layers stay float, "
    "and load_state_dict checks converted layers one at a time (a refused load can leave the "
    "layers before it loaded). Pass filter_fn=is_quantizable, or a filter that calls it"
)


def selects_a_layer(model: torch.nn.Module, filter_fn) -> bool:
    """Whether ``filter_fn`` selects any linear or registered experts module of ``model``: a
    filter that selects none would leave a calibration run with nothing to quantize."""
    return any(
        (isinstance(module, torch.nn.Linear) or _is_experts(module)) and filter_fn(module, name)
        for name, module in model.named_modules()
    )


def _is_experts(module: torch.nn.Module) -> bool:
    """A registered experts module, or what prepare or convert made of one."""
    return experts_layout(module) is not None or isinstance(
        module, (NVFP4StaticObservedExperts, NVFP4StaticExperts)
    )


def record_weights_held_elsewhere(model: torch.nn.Module) -> None:
    """For each linear whose weight another module also holds (an ``lm_head`` tied to the
    embedding), the other holder's name: converting the linear would silently untie them."""
    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        for parameter in module.parameters(recurse=False):
            holders.setdefault(id(parameter), []).append((name, module))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            others = [n for n, m in holders.get(id(module.weight), []) if m is not module]
            if others:
                _WEIGHT_HELD_ELSEWHERE[module] = others[0]


def _record_later_names(model: torch.nn.Module) -> None:
    """For each module ``model`` holds under several names, the later names, where the step
    puts the module's replacement too (else they would keep the float layer)."""
    _LATER_NAMES.clear()
    _PUT_UNDER_LATER_NAMES.clear()
    for first, later in later_names(model).items():
        _LATER_NAMES[model.get_submodule(first)] = (weakref.ref(model), later)


def layer_name(module: torch.nn.Module) -> str:
    """The name ``is_quantizable`` recorded for ``module`` or, for a layer prepare or convert
    made, the name it carries; else a description of its shape."""
    if module in _LAYER_NAMES:
        return _LAYER_NAMES[module]
    if getattr(module, "layer_name", ""):
        return module.layer_name
    if not isinstance(module, torch.nn.Linear):
        return type(module).__name__
    return f"{type(module).__name__}({module.in_features} -> {module.out_features})"


@register_quantize_module_handler(NVFP4StaticActivationConfig)
def _nvfp4_static_transform(
    module: torch.nn.Module, config: NVFP4StaticActivationConfig
) -> torch.nn.Module:
    if _PUT_UNDER_LATER_NAMES.get(module) == config.step:
        return module  # this step's replacement, met under a later name
    if module in EXPERTS_HOLDING:
        raise ValueError(
            f"nvfp4_static: layer '{module.layer_name}' is one expert's linear of experts "
            f"'{EXPERTS_HOLDING[module]}', which step='{config.step}' takes as one module: run it "
            f"with the filter_fn prepare ran with (is_quantizable, or a filter that calls it); the "
            f"layers quantize_ reached before this one are done, and running it again finishes the rest"
        )
    if config.step != "convert" and module not in _LAYER_NAMES:
        warn(WITHOUT_IS_QUANTIZABLE)
    if _is_experts(module):
        # Imported here: the experts' steps are built on this module's steps for linears.
        from nvfp4_static.experts.handlers import EXPERTS_STEPS

        replacement = EXPERTS_STEPS[config.step](module, config)
    else:
        replacement = LINEAR_STEPS[config.step](module, config)
    model, later = _LATER_NAMES.pop(module, (None, ()))
    if replacement is not module and later and model() is not None:
        for name in later:
            replace_submodule(model(), name, replacement)
        _PUT_UNDER_LATER_NAMES[replacement] = config.step
    # In the mode of the module it replaces, as the rest of the model is.
    return replacement.train(module.training)


# --- step 1: prepare ----------------------------------------------------------------------------


def prepare_linear(module: torch.nn.Linear, config: NVFP4StaticActivationConfig) -> torch.nn.Module:
    name = layer_name(module)
    shared = _REPLACEMENTS.get(module)
    if isinstance(shared, NVFP4StaticObservedLinear) and shared.weight is module.weight:
        return shared  # a linear two parents hold: one observed layer serves both
    if isinstance(module, (NVFP4StaticObservedLinear, NVFP4StaticLinear)):
        raise ValueError(already_prepared_message(name, module))
    check_dtype(module.weight, f"weight of layer '{name}'")
    if left_float_says_why(module, name, config.strict):
        return module
    hessian_accumulator = HESSIAN_ACCUMULATORS.get(config.weight_scale)
    hessian = hessian_accumulator(module.in_features, name=name) if hessian_accumulator else None
    observed = NVFP4StaticObservedLinear.from_float(
        module,
        config.activation_calibrator(name),
        hessian,
        layer_name=name,
        activation_recipe=config.activation_recipe(),
    )
    _REPLACEMENTS[module] = observed
    _CONVERT_PROGRESS.prepared(observed)
    return observed


def already_prepared_message(name: str, module: torch.nn.Module) -> str:
    """What prepare says of a layer it prepared or converted before: each layer is prepared
    once, and a prepare refused at one layer has already prepared the layers before it."""
    return (
        f"nvfp4_static: layer '{name}' is already {type(module).__name__}; prepare runs once per "
        f"model (a prepare refused at a later layer leaves the layers before it prepared): load "
        f"the float model again to prepare it again"
    )


def prepared_before_loading_message(name: str, module: torch.nn.Module) -> str:
    """What ``step="prepare_for_loading"`` says of a layer prepared for calibration: it makes
    empty converted layers of a float model, and would drop the layer's statistics."""
    return (
        f"nvfp4_static: layer '{name}' is {type(module).__name__}, prepared for calibration; "
        f"step='prepare_for_loading' makes empty converted layers of the float model: load the "
        f"float model again to load a checkpoint into it, or convert this one"
    )


def why_left_float(module: torch.nn.Linear):
    """Why prepare leaves ``module`` float (None: it quantizes it): a quantized copy would
    change what the layer computes, untie a shared weight, or NVFP4 cannot hold its shape."""
    if experts_layout(module) is not None:
        return why_experts_left_float(module)
    own_parameters = {n for n, _ in module.named_parameters(recurse=False)} - {"weight", "bias"}
    overrides_forward = type(module).forward is not torch.nn.Linear.forward
    if overrides_forward or own_parameters or any(True for _ in module.children()):
        what = "its own forward" if overrides_forward else "parameters or submodules nn.Linear lacks"
        return (
            f"it is a {type(module).__name__}, an nn.Linear subclass with {what}, which the "
            f"quantized layer would not keep"
        )
    if module in _WEIGHT_HELD_ELSEWHERE:
        return (
            f"its weight is tied to '{_WEIGHT_HELD_ELSEWHERE[module]}', and a quantized copy "
            f"would untie them"
        )
    if module.in_features % BLOCK_SIZE or module.out_features % BLOCK_SIZE:
        return (
            f"NVFP4 needs in_features and out_features divisible by {BLOCK_SIZE}, and it is "
            f"{module.in_features} -> {module.out_features}"
        )
    return None


def left_float_says_why(module: torch.nn.Linear, name: str, strict: bool) -> bool:
    """Whether prepare leaves ``module`` float; says why in a warning (an error if strict)."""
    reason = why_left_float(module)
    if reason is None:
        return False
    message = f"nvfp4_static: layer '{name}' is left unquantized: {reason}"
    if strict:
        raise ValueError(message)
    warn(message)
    return True


# --- step 2: convert ----------------------------------------------------------------------------


def convert_linear(module: torch.nn.Module, config: NVFP4StaticActivationConfig) -> torch.nn.Module:
    if isinstance(module, NVFP4StaticLinear):
        check_converted_with(module, config)
        return module
    if not isinstance(module, NVFP4StaticObservedLinear):
        if isinstance(module, torch.nn.Linear) and why_left_float(module) is None:
            raise RuntimeError(
                f"nvfp4_static: layer '{layer_name(module)}' has no observer: run "
                f"quantize_(model, NVFP4StaticActivationConfig(step='prepare')) and calibration "
                f"before step='convert', with the same filter_fn"
            )
        return module
    shared = _REPLACEMENTS.get(module)
    if isinstance(shared, NVFP4StaticLinear):
        return shared
    _CONVERT_PROGRESS.converting(module, module.layer_name)
    converted = converted_linear(module, config)
    adopt_converted(module, converted)
    return converted


def check_converted_with(module: torch.nn.Module, config: NVFP4StaticActivationConfig) -> None:
    """Refuse to convert again, with another recipe, a layer converted before: convert dropped
    the statistics another recipe needs, and keeping the layer would label it with the wrong
    recipe. The same recipe leaves it as it is."""
    if module.recipe != config.recipe():
        raise ValueError(
            f"nvfp4_static: layer '{module.layer_name}' is already converted with {module.recipe}, and "
            f"convert asks for {config.recipe()}; converting again needs the calibration statistics, "
            f"which convert dropped: prepare and calibrate the float model with that recipe"
        )


def adopt_converted(module: NVFP4StaticObservedLinear, converted: NVFP4StaticLinear) -> None:
    """Make ``converted`` what convert puts in place of ``module`` (``convert_data_parallel``
    hands over the layers another rank converted this way)."""
    _REPLACEMENTS[module] = converted
    _CONVERT_PROGRESS.converted(module)


def converted_linear(
    module: NVFP4StaticObservedLinear, config: NVFP4StaticActivationConfig
) -> NVFP4StaticLinear:
    """The converted layer of a calibrated ``module``; changes nothing (``convert_linear``
    swaps it in)."""
    check_recipe_matches_prepare(module, config)
    act_amax = layer_activation_global_amax(module)
    weight_global_amax = layer_weight_global_amax(module)
    if config.weight_scale == "gptq":
        float_weight, block_scales = _gptq_weight(module, config, weight_global_amax)
    else:
        float_weight = module.weight
        block_scales = _weight_block_scales(module, config, weight_global_amax)
    weight = NVFP4StaticTensor.from_float(
        float_weight,
        act_amax,
        block_scales,
        backend_override=config.backend,
        weight_global_amax=weight_global_amax,
    ).to(module.weight.dtype)  # GPTQ's float32 weight; a no-op for the others
    check_runs_on(weight.linear_backend, weight.device, f"layer '{module.layer_name}'")
    stats = dict(getattr(module.act_calibrator, "stats", None) or {"g_amax": float(act_amax)})
    return NVFP4StaticLinear(weight, module.bias, config.recipe(), module.layer_name, stats)


def check_recipe_matches_prepare(
    module: NVFP4StaticObservedLinear, config: NVFP4StaticActivationConfig
) -> None:
    """The activation recipe was fixed at prepare (it built the calibrator); a convert config
    that names another would label the layer with a recipe it was not calibrated with."""
    prepared, asked = module.activation_recipe, config.activation_recipe()
    if prepared is not None and prepared != asked:
        differing = {k: (prepared.get(k), asked.get(k)) for k in prepared.keys() | asked.keys()
                     if prepared.get(k) != asked.get(k)}
        details = ", ".join(f"{k}: prepared {p!r}, convert {c!r}" for k, (p, c) in sorted(differing.items()))
        raise ValueError(
            f"nvfp4_static: layer '{module.layer_name}' was prepared with another activation "
            f"recipe than convert asks for ({details}); convert with the config it was prepared "
            f"with, or prepare again"
        )


def layer_activation_global_amax(module: NVFP4StaticObservedLinear) -> torch.Tensor:
    """The layer's calibrated activation global amax, refused where NVFP4 cannot use it."""
    name = module.layer_name
    try:
        act_amax = module.act_calibrator.compute_amax()
    except RuntimeError as error:
        raise RuntimeError(f"nvfp4_static: cannot convert layer '{name}': {error}. {_UNREACHED}") from error
    if act_amax is None:
        raise RuntimeError(
            f"nvfp4_static: cannot convert layer '{name}': it saw no calibration data; run "
            f"calibration batches through the prepared model before step='convert'. {_UNREACHED}"
        )
    act_amax = torch.as_tensor(act_amax, dtype=torch.float32)
    if not is_usable_act_per_tensor_scale(per_tensor_amax_to_scale(act_amax)):
        raise ValueError(
            f"nvfp4_static: layer '{name}': calibrated activation amax is {float(act_amax)}; it "
            f"must be finite and at least about 5e-34, below which NVFP4's block-scale "
            f"reciprocals overflow float32 (did calibration feed only zeros?)"
        )
    return act_amax


def layer_weight_global_amax(module: NVFP4StaticObservedLinear) -> torch.Tensor:
    """The weight's own ``max |w|``, or its fusion group's shared amax where
    ``tie_fused_layers`` recorded one (``nvfp4_static.fused_layers``); refused for a weight
    with NaN or Inf values, whose block scales would be NaN."""
    weight = module.weight.detach()
    own = weight.abs().amax().to(torch.float32)
    if not bool(torch.isfinite(own)):
        raise ValueError(
            f"nvfp4_static: cannot convert layer '{module.layer_name}': its weight of shape "
            f"{list(weight.shape)} holds {non_finite_summary(weight)}; NVFP4 needs a finite weight"
        )
    if module.tied_weight_global_amax is not None:
        return module.tied_weight_global_amax.to(module.weight.device)
    return own


def _weight_block_scales(
    module: NVFP4StaticObservedLinear,
    config: NVFP4StaticActivationConfig,
    global_amax: torch.Tensor,
):
    """FP8 block scales of the weight from ``NVFP4MSECalibrator``, swept against the weight
    global amax the tensor will store (or as another rank swept them, see
    ``nvfp4_static.data_parallel_convert``); None (block max, as torchao computes
    them) for ``weight_scale="max"`` and for a weight too small for the sweep."""
    if config.weight_scale == "max":
        return None
    if module.swept_block_scales is not None:
        return module.swept_block_scales
    try:
        return sweep_weight_block_scales(module, config, global_amax)
    except GlobalAmaxTooSmallError:
        warn(
            f"nvfp4_static: layer '{module.layer_name}': weight amax {float(global_amax):.3g} is too "
            f"small for the FP8 scale sweep (float32 reciprocals overflow); its block scales are "
            f"block max, as torchao computes them"
        )
        return None


def sweep_weight_block_scales(
    module: NVFP4StaticObservedLinear,
    config: NVFP4StaticActivationConfig,
    global_amax: torch.Tensor,
) -> torch.Tensor:
    """The sweep convert runs for ``weight_scale`` ``"mse"`` or ``"hessian_mse"``: the FP8
    block scales ``[N, K/16]``. Raises ``GlobalAmaxTooSmallError`` for a weight too small."""
    hessian = None
    if config.weight_scale == "hessian_mse":
        if module.hessian_accumulator is None:
            raise ValueError(
                f"nvfp4_static: layer '{module.layer_name}' was prepared without a Hessian; "
                f"prepare with weight_scale='hessian_mse' to convert with it"
            )
        hessian = module.hessian_accumulator.hessian
        if isinstance(module.hessian_accumulator, FullHessianAccumulator):  # prepared for gptq
            hessian = block_diagonal(hessian)
    weight = module.weight.detach()
    blocks = torch.empty(weight.shape[0], weight.shape[1] // BLOCK_SIZE, device="meta")
    calibrator = NVFP4MSECalibrator(blocks, global_amax, hessian=hessian, name=module.layer_name)
    calibrator.collect(weight)
    return calibrator.block_scales_e4m3


def run_gptq(
    module: NVFP4StaticObservedLinear,
    config: NVFP4StaticActivationConfig,
    global_amax: torch.Tensor,
) -> GPTQResult:
    """GPTQ of the layer's weight under its full input Hessian. Raises
    ``GlobalAmaxTooSmallError`` for a weight too small for FP8 block scales."""
    if not isinstance(module.hessian_accumulator, FullHessianAccumulator):
        raise ValueError(
            f"nvfp4_static: layer '{module.layer_name}' was prepared without a full input "
            f"Hessian; prepare with weight_scale='gptq' to convert with it"
        )
    return gptq_quantize_nvfp4(
        module.weight, module.hessian_accumulator.hessian, global_amax,
        dampening=config.gptq_dampening, name=module.layer_name,
    )


def _gptq_weight(
    module: NVFP4StaticObservedLinear,
    config: NVFP4StaticActivationConfig,
    global_amax: torch.Tensor,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``weight_scale="gptq"``: the weight GPTQ rounded (dequantized, float32: quantizing it
    with its block scales gives back GPTQ's codes exactly) and those scales, from GPTQ or from
    the codes another rank's GPTQ gave (``gptq_codes``). A weight too small for FP8 scales gets
    ``_weight_block_scales``'s fallback instead."""
    per_tensor_scale = per_tensor_amax_to_scale(global_amax)
    if module.gptq_codes is not None:
        qdata, block_scales = module.gptq_codes
        return dequantize_nvfp4(qdata, block_scales, per_tensor_scale), block_scales
    try:
        result = run_gptq(module, config, global_amax)
    except GlobalAmaxTooSmallError:
        return module.weight, _weight_block_scales(module, config, global_amax)
    scales = per_tensor_scale * result.block_scales_e4m3.to(torch.float32)
    return times_block_scales(result.values, scales), result.block_scales_e4m3


# --- loading: empty converted layers ------------------------------------------------------------


def _prepare_for_loading(
    module: torch.nn.Linear, config: NVFP4StaticActivationConfig
) -> torch.nn.Module:
    name = layer_name(module)
    if isinstance(module, NVFP4StaticLinear):
        return module
    if isinstance(module, NVFP4StaticObservedLinear):
        raise ValueError(prepared_before_loading_message(name, module))
    if left_float_says_why(module, name, config.strict):
        return module
    return NVFP4StaticLinear.placeholder(module, config.recipe(), name, config.backend)


# What each step of the config does to a linear (``experts.handlers.EXPERTS_STEPS`` for experts).
LINEAR_STEPS = {"prepare": prepare_linear, "convert": convert_linear, "prepare_for_loading": _prepare_for_loading}
