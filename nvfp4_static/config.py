"""``NVFP4StaticActivationConfig`` and its ``quantize_`` handlers (prepare / convert / load).

    quantize_(model, NVFP4StaticActivationConfig(step="prepare"))
    for batch in calibration_data:
        model(batch)
    quantize_(model, NVFP4StaticActivationConfig(step="convert"))
"""

import dataclasses
import inspect
import warnings
from typing import Optional, Union

import torch
import torchao.core.config
from torchao.core.config import AOBaseConfig
from torchao.quantization.quantize_.common.quantization_step import QuantizationStep
from torchao.quantization.transform_module import register_quantize_module_handler

from nvfp4_static import kernels, statistics
from nvfp4_static.backends import BACKENDS
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.numerics import (
    BLOCK_SIZE,
    E4M3_DYNAMIC_RANGE,
    check_dtype,
    per_tensor_amax_to_scale,
    scale_reciprocal_overflows,
)
from nvfp4_static.observed import NVFP4ObservedLinear
from nvfp4_static.observers import (
    BlockHessianAccumulator,
    MaxCalibrator,
    NVFP4ActMaxCalibrator,
    PercentileCalibrator,
)
from nvfp4_static.observers.anchored_mse import FirstBatchMseCalibrator
from nvfp4_static.observers.nvfp4_act_max import DEFAULT_B_MAX_PERCENTILE
from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = ["NVFP4StaticActivationConfig"]

STEPS = ("prepare", "convert", "prepare_for_loading")
ACT_CALIBRATIONS = ("b_min", "max", "percentile", "mse")
WEIGHT_SCALES = ("mse", "max", "hessian_mse")

# config_from_dict looks classes up only in torchao's own modules; registering ours there is
# what lets a saved config dict name NVFP4StaticActivationConfig.
torchao.core.config.ALLOWED_AO_MODULES.add("nvfp4_static")


@dataclasses.dataclass
class NVFP4StaticActivationConfig(AOBaseConfig):
    """Static-activation NVFP4 (W4A4) for ``nn.Linear`` layers, in two ``quantize_`` steps.

    Args:
        step: ``"prepare"`` (insert observers), ``"convert"`` (bake scales into NVFP4 weights),
            or ``"prepare_for_loading"`` (empty converted layers for ``load_state_dict``).
            torchao's ``QuantizationStep`` is accepted and stored as its string.
        act_calibration: how the activation global amax is chosen: ``"b_min"`` (B_min-anchored
            histogram recipe, see DESIGN.md), ``"max"``, ``"percentile"`` or ``"mse"`` (search
            of ``amax * m`` minimising fake-quant error; the grid is anchored at the first
            calibration batch's amax).
        rho, b_min_percentile, b_max_percentile, margin, num_bins, log2_min, log2_max: the
            B_min recipe's knobs: ``g_amax = max(rho * B_min, margin * B_max)``.
        percentile: the percentile of block amaxes used by ``act_calibration="percentile"``.
        mse_start_multiplier, mse_stop_multiplier, mse_step_size: the ``"mse"`` search grid.
        weight_scale: per-block FP8 weight scales: ``"mse"`` (126-candidate sweep), ``"max"``
            (block max, torchao's choice) or ``"hessian_mse"`` (sweep weighted by the layer's
            input Hessian, gathered during calibration).
        strict: raise instead of warning when a linear's dims are not multiples of 16.
        backend: force the inference route (``"cpu"``, ``"triton"``, ``"blackwell"``); None
            picks by device.
    """

    step: Union[str, QuantizationStep] = "prepare"
    act_calibration: str = "b_min"
    rho: float = 16384.0
    b_min_percentile: float = 1.0
    b_max_percentile: float = DEFAULT_B_MAX_PERCENTILE
    margin: float = 1.0
    num_bins: int = 512
    log2_min: float = -40.0
    log2_max: float = 40.0
    percentile: float = 99.99
    mse_start_multiplier: float = 0.25
    mse_stop_multiplier: float = 4.0
    mse_step_size: float = 0.1
    weight_scale: str = "mse"
    strict: bool = False
    backend: Optional[str] = None

    def __post_init__(self):
        if isinstance(self.step, QuantizationStep):
            self.step = self.step.value
        _check_choice("step", self.step, STEPS)
        _check_choice("act_calibration", self.act_calibration, ACT_CALIBRATIONS)
        _check_choice("weight_scale", self.weight_scale, WEIGHT_SCALES)
        if self.backend is not None:
            _check_choice("backend", self.backend, BACKENDS)
        if not 0 < self.rho < E4M3_DYNAMIC_RANGE:
            raise ValueError(
                f"NVFP4StaticActivationConfig: rho={self.rho} must lie in (0, {E4M3_DYNAMIC_RANGE:g})"
            )

    def recipe(self) -> dict:
        """What a converted checkpoint records and checks on load."""
        return {"act_calibration": self.act_calibration, "weight_scale": self.weight_scale}


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(
            f"NVFP4StaticActivationConfig: {name}={value!r} is not one of {', '.join(choices)}"
        )


def _module_fqn(module: torch.nn.Module) -> str:
    """The fully qualified name ``quantize_`` is visiting.

    torchao's handlers receive only the module; its name lives in the caller's frame
    (``cur_fqn`` while walking the tree, ``module_fqn`` with ``FqnToConfig``). Names are what
    makes an error actionable, so look there, and fall back to a shape description.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(4):
            frame = frame.f_back
            if frame is None:
                break
            name = frame.f_locals.get("cur_fqn", frame.f_locals.get("module_fqn"))
            if name:
                return name.rstrip(".")
    finally:
        del frame
    return f"{type(module).__name__}({module.in_features}->{module.out_features})"


def _make_act_calibrator(config: NVFP4StaticActivationConfig, name: str):
    if config.act_calibration == "b_min":
        return NVFP4ActMaxCalibrator(
            rho=config.rho,
            b_min_percentile=config.b_min_percentile,
            b_max_percentile=config.b_max_percentile,
            margin=config.margin,
            num_bins=config.num_bins,
            log2_min=config.log2_min,
            log2_max=config.log2_max,
            name=name,
        )
    if config.act_calibration == "max":
        return MaxCalibrator(name=name)
    if config.act_calibration == "percentile":
        return PercentileCalibrator(
            percentile=config.percentile,
            num_bins=config.num_bins,
            log2_min=config.log2_min,
            log2_max=config.log2_max,
            name=name,
        )
    return FirstBatchMseCalibrator(
        step_size=config.mse_step_size,
        start_multiplier=config.mse_start_multiplier,
        stop_multiplier=config.mse_stop_multiplier,
        name=name,
    )


def _has_block_dims(module: torch.nn.Linear) -> bool:
    return module.in_features % BLOCK_SIZE == 0 and module.out_features % BLOCK_SIZE == 0


def _is_quantizable(module: torch.nn.Linear, name: str, strict: bool) -> bool:
    if _has_block_dims(module):
        return True
    message = (
        f"nvfp4_static: layer '{name}' ({module.in_features} -> {module.out_features}) is left "
        f"unquantized: NVFP4 needs in_features and out_features divisible by {BLOCK_SIZE}"
    )
    if strict:
        raise ValueError(message)
    warnings.warn(message, stacklevel=4)
    return False


def _prepare(module: torch.nn.Linear, config: NVFP4StaticActivationConfig) -> torch.nn.Module:
    name = _module_fqn(module)
    if isinstance(module, (NVFP4ObservedLinear, NVFP4StaticLinear)):
        raise ValueError(f"nvfp4_static: layer '{name}' is already {type(module).__name__}")
    check_dtype(module.weight, f"weight of layer '{name}'")
    if not _is_quantizable(module, name, config.strict):
        return module
    hessian = (
        BlockHessianAccumulator(module.in_features, name=name)
        if config.weight_scale == "hessian_mse" else None
    )
    return NVFP4ObservedLinear.from_float(
        module, _make_act_calibrator(config, name), hessian, layer_name=name
    )


def _weight_block_scales(
    module: NVFP4ObservedLinear, config: NVFP4StaticActivationConfig
) -> Optional[torch.Tensor]:
    """FP8 block scales of the weight per ``config.weight_scale``; None means block max."""
    if config.weight_scale == "max":
        return None
    weight = module.weight.detach()
    global_amax = weight.abs().amax().to(torch.float32)
    if global_amax == 0:
        return None
    if statistics.sweep_reciprocals_overflow(global_amax):
        warnings.warn(
            f"nvfp4_static: layer '{module.layer_name}': weight amax {float(global_amax):.3g} is too "
            f"small for the FP8 scale sweep (float32 reciprocals overflow); its block scales are "
            f"block max, as torchao computes them",
            stacklevel=2,
        )
        return None
    hessian = None
    if config.weight_scale == "hessian_mse":
        if module.hessian_accumulator is None:
            raise ValueError(
                f"nvfp4_static: layer '{module.layer_name}' was prepared without a Hessian; "
                f"prepare with weight_scale='hessian_mse' to convert with it"
            )
        hessian = module.hessian_accumulator.hessian
    return kernels.fp8_scale_sweep(weight, global_amax, hessian)


def _convert(module: torch.nn.Module, config: NVFP4StaticActivationConfig) -> torch.nn.Module:
    if isinstance(module, NVFP4StaticLinear):
        return module
    if not isinstance(module, NVFP4ObservedLinear):
        if isinstance(module, torch.nn.Linear) and _has_block_dims(module):
            raise RuntimeError(
                f"nvfp4_static: layer '{_module_fqn(module)}' has no observer: run "
                f"quantize_(model, NVFP4StaticActivationConfig(step='prepare')) and calibration "
                f"before step='convert', with the same filter_fn"
            )
        return module
    name = module.layer_name
    try:
        act_amax = module.act_calibrator.compute_amax()
    except RuntimeError as error:
        raise RuntimeError(f"nvfp4_static: cannot convert layer '{name}': {error}") from error
    if act_amax is None:
        raise RuntimeError(
            f"nvfp4_static: cannot convert layer '{name}': it saw no calibration data; run "
            f"calibration batches through the prepared model before step='convert'"
        )
    act_amax = torch.as_tensor(act_amax, dtype=torch.float32)
    too_small = act_amax <= 0 or scale_reciprocal_overflows(per_tensor_amax_to_scale(act_amax))
    if not torch.isfinite(act_amax) or too_small:
        raise ValueError(
            f"nvfp4_static: layer '{name}': calibrated activation amax is {float(act_amax)}; it "
            f"must be finite and at least about 5e-34, below which NVFP4's block-scale "
            f"reciprocals overflow float32 (did calibration feed only zeros?)"
        )
    weight = NVFP4StaticTensor.from_float(
        module.weight,
        act_amax,
        _weight_block_scales(module, config),
        backend_override=config.backend,
    )
    stats = dict(getattr(module.act_calibrator, "stats", None) or {"g_amax": float(act_amax)})
    return NVFP4StaticLinear(weight, module.bias, config.recipe(), name, stats)


def _prepare_for_loading(
    module: torch.nn.Linear, config: NVFP4StaticActivationConfig
) -> torch.nn.Module:
    name = _module_fqn(module)
    if not _is_quantizable(module, name, config.strict):
        return module
    return NVFP4StaticLinear.placeholder(module, config.recipe(), name, config.backend)


@register_quantize_module_handler(NVFP4StaticActivationConfig)
def _nvfp4_static_transform(
    module: torch.nn.Module, config: NVFP4StaticActivationConfig
) -> torch.nn.Module:
    if config.step == "prepare":
        return _prepare(module, config)
    if config.step == "convert":
        return _convert(module, config)
    return _prepare_for_loading(module, config)
