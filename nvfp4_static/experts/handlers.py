"""What ``quantize_(model, NVFP4StaticActivationConfig(...))`` does to a registered experts module.

Each expert is two linears, gate/up ``[2I, H]`` (one GEMM: gate and up share its scales) and down
``[H, I]``, and each step hands every one of them to the step that ``nvfp4_static.workflow``
runs for an ``nn.Linear``, so the calibrators, the activation recipe, the weight sweep (with the
expert's own Hessian) and every check are the linears' own:

1. prepare: each expert linear, a view of the 3-D weight, becomes an ``NVFP4StaticObservedLinear``
   inside an ``NVFP4StaticObservedExperts``, which routes each expert its own tokens.
2. convert: experts that saw fewer than ``config.expert_min_tokens`` calibration tokens take the
   layer's pooled statistics (one warning names the layer and them); each expert linear is
   converted, and the results are stacked into an ``NVFP4StaticExperts``.
3. prepare_for_loading: an empty ``NVFP4StaticExperts``.

``workflow`` hands this module's ``EXPERTS_STEPS`` the registered experts modules
(``experts.layouts``) and the ones it made of them.
"""

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from nvfp4_static import workflow
from nvfp4_static.config import NVFP4StaticActivationConfig
from nvfp4_static.experts.converted import NVFP4StaticExperts, NVFP4StaticGroupedLinear, experts_backend
from nvfp4_static.experts.layouts import experts_layout
from nvfp4_static.experts.observed import NVFP4StaticObservedExperts
from nvfp4_static.messages import warn
from nvfp4_static.numerics import check_dtype
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.observers import BlockHessianAccumulator

__all__ = ["EXPERTS_STEPS"]


def _prepare(module: torch.nn.Module, config: NVFP4StaticActivationConfig) -> torch.nn.Module:
    name = workflow.layer_name(module)
    if isinstance(module, (NVFP4StaticObservedExperts, NVFP4StaticExperts)):
        raise ValueError(workflow.already_prepared_message(name, module))
    if workflow.left_float_says_why(module, name, config.strict):
        return module
    layout = experts_layout(module)
    gate_up, down = layout.weights(module)
    check_dtype(gate_up, f"{layout.gate_up} of layer '{name}'")
    check_dtype(down, f"{layout.down} of layer '{name}'")
    return NVFP4StaticObservedExperts(
        [_observed_expert_linear(gate_up, e, name, "gate_up_proj", config) for e in range(len(gate_up))],
        [_observed_expert_linear(down, e, name, "down_proj", config) for e in range(len(down))],
        getattr(module, layout.act_fn),
        layout,
        config.activation_calibrator(f"{name}.gate_up_proj (pooled over experts)"),
        config.activation_calibrator(f"{name}.down_proj (pooled over experts)"),
        layer_name=name,
        activation_recipe=config.activation_recipe(),
    )


def _observed_expert_linear(
    weights: torch.Tensor, expert: int, experts_name: str, projection: str, config: NVFP4StaticActivationConfig
) -> NVFP4StaticObservedLinear:
    """Expert ``expert``'s linear of the 3-D ``weights``, sharing its memory, prepared as any
    linear, named after the experts module ``experts_name`` and its ``projection``."""
    name = f"{experts_name}.{projection}.{expert}"
    out_features, in_features = weights.shape[1:]
    with torch.device("meta"):
        linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight = torch.nn.Parameter(weights.detach()[expert], requires_grad=weights.requires_grad)
    workflow._LAYER_NAMES[linear] = name
    observed = workflow.prepare_linear(linear, config)
    workflow.EXPERTS_HOLDING[observed] = experts_name
    return observed


def _convert(module: torch.nn.Module, config: NVFP4StaticActivationConfig) -> torch.nn.Module:
    if isinstance(module, NVFP4StaticExperts):
        workflow.check_converted_with(module, config)
        return module
    if not isinstance(module, NVFP4StaticObservedExperts):
        if workflow.why_left_float(module) is None:
            raise RuntimeError(
                f"nvfp4_static: experts '{workflow.layer_name(module)}' have no observer: run "
                f"quantize_(model, NVFP4StaticActivationConfig(step='prepare')) and calibration "
                f"before step='convert', with the same filter_fn"
            )
        return module
    workflow.check_recipe_matches_prepare(module, config)
    # Refused before any expert is converted: a backend the experts cannot run.
    experts_backend(module.gate_up_proj[0].weight.device, config.backend, module.layer_name)
    if sum(module.tokens_per_expert) == 0:
        raise RuntimeError(
            f"nvfp4_static: cannot convert experts '{module.layer_name}': they saw no calibration "
            f"data; run calibration batches through the prepared model before step='convert'"
        )
    starved = starved_experts(module, config)
    if starved:
        seen = ", ".join(str(module.tokens_per_expert[e]) for e in starved)
        warn(
            f"nvfp4_static: layer '{module.layer_name}': experts {', '.join(map(str, starved))} saw "
            f"fewer than {config.expert_min_tokens} calibration tokens ({seen}); they take the "
            f"layer's statistics pooled over all experts (calibrate on more data, or lower "
            f"expert_min_tokens)"
        )
    with pooled_statistics_for(module, starved):
        gate_up = [workflow.convert_linear(linear, config) for linear in module.gate_up_proj]
        down = [workflow.convert_linear(linear, config) for linear in module.down_proj]
    stats = {
        "tokens_per_expert": list(module.tokens_per_expert),
        "pooled_experts": starved,
        "gate_up_proj": [linear.calibration_stats for linear in gate_up],
        "down_proj": [linear.calibration_stats for linear in down],
    }
    return NVFP4StaticExperts(
        NVFP4StaticGroupedLinear.from_linears(gate_up),
        NVFP4StaticGroupedLinear.from_linears(down),
        module.act_fn,
        module.layout,
        module.gate_up_proj[0].weight.dtype,
        config.recipe(),
        module.layer_name,
        stats,
        backend_override=config.backend,
    )


def starved_experts(module: NVFP4StaticObservedExperts, config: NVFP4StaticActivationConfig) -> list[int]:
    """The experts that saw fewer than ``config.expert_min_tokens`` calibration tokens."""
    return [e for e, n in enumerate(module.tokens_per_expert) if n < config.expert_min_tokens]


@contextlib.contextmanager
def pooled_statistics_for(module: NVFP4StaticObservedExperts, starved: list[int]) -> Iterator[None]:
    """While the block runs, the ``starved`` experts' linears read the layer's pooled
    calibrators, and their Hessians the sum of all experts' (a Hessian of few or no tokens would
    weight the sweep by almost nothing); their own observers are back afterwards."""
    if not starved:
        yield
        return
    substitutes = []
    for projection, linears, pooled_calibrator in (
        ("gate_up_proj", module.gate_up_proj, module.pooled_gate_up_calibrator),
        ("down_proj", module.down_proj, module.pooled_down_calibrator),
    ):
        pooled_hessian = _summed_hessian(linears, f"{module.layer_name}.{projection} (pooled over experts)")
        substitutes += [(linears[e], pooled_calibrator, pooled_hessian) for e in starved]
    own = [(linear, linear.act_calibrator, linear.hessian_accumulator) for linear, _, _ in substitutes]
    try:
        for linear, calibrator, hessian in substitutes:
            linear.act_calibrator, linear.hessian_accumulator = calibrator, hessian
        yield
    finally:
        for linear, calibrator, hessian in own:
            linear.act_calibrator, linear.hessian_accumulator = calibrator, hessian


def _summed_hessian(linears, name: str) -> Optional[BlockHessianAccumulator]:
    """The sum of the Hessians of ``linears`` (None without Hessians), of their accumulators'
    kind (per block, or whole for GPTQ): each expert's own Hessian is a sum over its tokens, so
    this is the Hessian of all the layer's tokens."""
    accumulator = linears[0].hessian_accumulator
    if accumulator is None:
        return None
    pooled = type(accumulator)(linears[0].in_features, name=name)
    for linear in linears:
        pooled.merge(linear.hessian_accumulator)
    return pooled


def _prepare_for_loading(module: torch.nn.Module, config: NVFP4StaticActivationConfig) -> torch.nn.Module:
    name = workflow.layer_name(module)
    if isinstance(module, NVFP4StaticObservedExperts):
        raise ValueError(workflow.prepared_before_loading_message(name, module))
    if isinstance(module, NVFP4StaticExperts) or workflow.left_float_says_why(module, name, config.strict):
        return module
    return NVFP4StaticExperts.placeholder(module, experts_layout(module), config.recipe(), name, config.backend)


# What each step of the config does to an experts module (``workflow.LINEAR_STEPS`` for linears).
EXPERTS_STEPS = {"prepare": _prepare, "convert": _convert, "prepare_for_loading": _prepare_for_loading}
