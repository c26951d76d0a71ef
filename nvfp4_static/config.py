"""``NVFP4StaticActivationConfig``: which step ``quantize_`` runs and with which recipe.

The handlers that carry the steps out are in ``nvfp4_static.workflow``.
"""

import dataclasses
import math
from typing import Optional, Union

import torchao.core.config
from torchao.core.config import AOBaseConfig
from torchao.quantization.quantize_.common.quantization_step import QuantizationStep

from nvfp4_static.arguments import check_flags
from nvfp4_static.backends import BACKENDS
from nvfp4_static.gptq import DEFAULT_DAMPENING
from nvfp4_static.numerics import E4M3_DYNAMIC_RANGE
from nvfp4_static.observers import MaxCalibrator, NVFP4BMinCalibrator, PercentileCalibrator
from nvfp4_static.observers.anchored_mse import FirstBatchMseCalibrator
from nvfp4_static.observers.base import check_numbers
from nvfp4_static.observers.b_min import DEFAULT_B_MAX_PERCENTILE

__all__ = ["NVFP4StaticActivationConfig"]

STEPS = ("prepare", "convert", "prepare_for_loading")
# The knobs each activation recipe reads: what prepare fixes and convert must agree with.
ACT_CALIBRATION_KNOBS = {
    "b_min": (
        "rho", "b_min_percentile", "b_max_percentile", "margin", "num_bins", "log2_min", "log2_max"
    ),
    "max": (),
    "percentile": ("percentile", "num_bins", "log2_min", "log2_max"),
    "mse": ("mse_start_multiplier", "mse_stop_multiplier", "mse_step_size"),
}
ACT_CALIBRATIONS = ("b_min", "max", "percentile", "mse")
WEIGHT_SCALES = ("mse", "max", "hessian_mse", "gptq")

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
            histogram recipe, see docs/design.md), ``"max"``, ``"percentile"`` or ``"mse"`` (search
            of ``amax * m`` minimising fake-quant error; the grid is anchored at the first
            calibration batch's amax).
        rho, b_min_percentile, b_max_percentile, margin, num_bins, log2_min, log2_max: the
            B_min recipe's knobs: ``g_amax = max(rho * B_min, margin * B_max)``.
        percentile: the percentile of block amaxes used by ``act_calibration="percentile"``.
        mse_start_multiplier, mse_stop_multiplier, mse_step_size: the ``"mse"`` search grid.
        weight_scale: per-block FP8 weight scales: ``"hessian_mse"`` (the default: the
            126-candidate sweep weighted by the layer's per-block input Hessian, gathered during
            calibration), ``"mse"`` (the plain sweep: no data needed, a quicker calibration),
            ``"max"`` (block max, torchao's choice) or ``"gptq"`` (GPTQ: columns
            rounded in order under the layer's whole ``K x K`` input Hessian, each block's scale
            searched when it is reached; ``nvfp4_static.gptq``; the Hessian costs ``K^2 * 4``
            bytes per layer during calibration).
        gptq_dampening: ``"gptq"`` adds this fraction of the Hessian's mean diagonal to its
            diagonal before inverting it.
        strict: raise instead of warning when a linear's dims are not multiples of 16.
        expert_min_tokens: experts of a mixture-of-experts layer that saw fewer calibration
            tokens than this take the layer's statistics pooled over all its experts (a warning
            names them); at least 1.
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
    weight_scale: str = "hessian_mse"
    gptq_dampening: float = DEFAULT_DAMPENING
    strict: bool = False
    backend: Optional[str] = None
    expert_min_tokens: int = 16

    def __post_init__(self):
        fields = dataclasses.fields(self)
        numbers = {f.name: getattr(self, f.name) for f in fields if f.type in (float, "float")}
        flags = {f.name: getattr(self, f.name) for f in fields if f.type in (bool, "bool")}
        check_numbers("NVFP4StaticActivationConfig", **numbers)
        check_flags("NVFP4StaticActivationConfig", **flags)
        if isinstance(self.step, QuantizationStep):
            self.step = self.step.value
        _check_choice("step", self.step, STEPS)
        _check_choice("act_calibration", self.act_calibration, ACT_CALIBRATIONS)
        _check_choice("weight_scale", self.weight_scale, WEIGHT_SCALES)
        if self.backend is not None:
            _check_choice("backend", self.backend, BACKENDS)
        if not 0 < self.gptq_dampening < math.inf:
            raise ValueError(
                f"NVFP4StaticActivationConfig: gptq_dampening={self.gptq_dampening} must be a "
                f"finite value > 0"
            )
        if not 0 < self.rho < E4M3_DYNAMIC_RANGE:
            raise ValueError(
                f"NVFP4StaticActivationConfig: rho={self.rho} must lie in (0, {E4M3_DYNAMIC_RANGE:g})"
            )
        if not isinstance(self.expert_min_tokens, int) or self.expert_min_tokens < 1:
            raise ValueError(
                f"NVFP4StaticActivationConfig: expert_min_tokens={self.expert_min_tokens!r} must "
                f"be an integer >= 1 (an expert without tokens has no statistics of its own)"
            )
        try:  # the calibrator checks its own knobs; a config that cannot build one is refused now
            self.activation_calibrator()
        except ValueError as error:
            raise ValueError(f"NVFP4StaticActivationConfig: {error}") from error

    def activation_calibrator(self, name: Optional[str] = None):
        """A fresh calibrator for ``act_calibration``, built with this config's knobs."""
        if self.act_calibration == "b_min":
            return NVFP4BMinCalibrator(
                rho=self.rho,
                b_min_percentile=self.b_min_percentile,
                b_max_percentile=self.b_max_percentile,
                margin=self.margin,
                num_bins=self.num_bins,
                log2_min=self.log2_min,
                log2_max=self.log2_max,
                name=name,
            )
        if self.act_calibration == "max":
            return MaxCalibrator(name=name)
        if self.act_calibration == "percentile":
            return PercentileCalibrator(
                percentile=self.percentile,
                num_bins=self.num_bins,
                log2_min=self.log2_min,
                log2_max=self.log2_max,
                name=name,
            )
        return FirstBatchMseCalibrator(
            step_size=self.mse_step_size,
            start_multiplier=self.mse_start_multiplier,
            stop_multiplier=self.mse_stop_multiplier,
            name=name,
        )

    def activation_recipe(self) -> dict:
        """``act_calibration`` and the knobs it reads, as prepare builds its calibrator."""
        knobs = ACT_CALIBRATION_KNOBS[self.act_calibration]
        return {"act_calibration": self.act_calibration, **{k: getattr(self, k) for k in knobs}}

    def recipe(self) -> dict:
        """What a converted checkpoint records and checks on load."""
        return {"act_calibration": self.act_calibration, "weight_scale": self.weight_scale}


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(
            f"NVFP4StaticActivationConfig: {name}={value!r} is not one of {', '.join(choices)}"
        )


def config_or_default(function: str, config: Optional[NVFP4StaticActivationConfig]) -> NVFP4StaticActivationConfig:
    """``config``, or the default recipe for None; anything else (a dict, the class itself,
    another torchao config) refused, naming ``function``, before it changes the model."""
    if config is None:
        return NVFP4StaticActivationConfig()
    if not isinstance(config, NVFP4StaticActivationConfig):
        what = f"the class {config.__name__}" if isinstance(config, type) else f"a {type(config).__name__}"
        raise TypeError(
            f"nvfp4_static: {function}: config must be an NVFP4StaticActivationConfig instance "
            f"(e.g. NVFP4StaticActivationConfig(weight_scale='mse')) or None, got {what}"
        )
    return config
