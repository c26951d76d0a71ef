"""An opt-in count of the activations each converted layer clips at inference.

A static activation scale saturates every input element above the layer's ``act_global_amax``
(its block scale would need more than FP8's 448). Calibration bounds how often that happens on
data like the calibration set; this counts it on the data a model actually sees. Each converted
layer keeps three counters on its device, updated inside the forward, so eager and compiled
models both count without a host sync per call. In a mixture-of-experts layer each expert's
GEMM counts the rows routed to it, under its own scale, as a layer of its own
(``<experts>.gate_up_proj.{e}``, ``<experts>.down_proj.{e}``)::

    enable_clip_monitor(model)
    model(batch)                      # or a compiled model, or model.generate(...)
    for name, stats in clip_counts(model).items():
        print(name, stats.clipped, stats.seen, stats.max_abs / stats.act_global_amax)
"""

import dataclasses

import torch

from nvfp4_static.experts import NVFP4StaticGroupedLinear
from nvfp4_static.linear import NVFP4StaticLinear

__all__ = ["ClipCounts", "clip_counts", "disable_clip_monitor", "enable_clip_monitor"]


@dataclasses.dataclass(frozen=True)
class ClipCounts:
    """One layer's counters since the monitor was enabled.

    Attributes:
        clipped: input elements whose magnitude exceeded ``act_global_amax``.
        seen: input elements counted.
        max_abs: the largest input magnitude seen.
        act_global_amax: the layer's static activation global amax.
    """

    clipped: int
    seen: int
    max_abs: float
    act_global_amax: float


def enable_clip_monitor(model: torch.nn.Module) -> None:
    """Start (or restart from zero) counting clipped inputs in every converted layer."""
    for layer in _converted_layers(model):
        layer.start_clip_monitor()


def disable_clip_monitor(model: torch.nn.Module) -> None:
    """Stop counting and drop the counters (the forward then costs nothing extra)."""
    for layer in _converted_layers(model):
        layer.stop_clip_monitor()


def clip_counts(model: torch.nn.Module) -> dict[str, ClipCounts]:
    """``{layer name: ClipCounts}`` for every converted layer (and expert GEMM) being monitored
    (one host sync per layer)."""
    counts = {}
    for name, layer in model.named_modules():
        if isinstance(layer, NVFP4StaticLinear) and layer.clip_counters is not None:
            clipped, seen = layer.clip_counters["elements"].tolist()
            counts[name] = ClipCounts(
                clipped=clipped,
                seen=seen,
                max_abs=float(layer.clip_counters["max_abs"]),
                act_global_amax=layer.act_global_amax,
            )
        elif isinstance(layer, NVFP4StaticGroupedLinear) and layer.clip_counters is not None:
            counters = {key: value[:-1].tolist() for key, value in layer.clip_counters.items()}
            per_expert = zip(counters["clipped"], counters["seen"], counters["max_abs"], layer.act_global_amax.tolist())
            for expert, (clipped, seen, max_abs, act_global_amax) in enumerate(per_expert):
                counts[f"{name}.{expert}"] = ClipCounts(clipped, seen, max_abs, act_global_amax)
    return counts


def _converted_layers(model: torch.nn.Module) -> list:
    """The converted linears and the experts' grouped GEMMs of ``model``."""
    layers = [m for m in model.modules() if isinstance(m, (NVFP4StaticLinear, NVFP4StaticGroupedLinear))]
    if not layers:
        raise ValueError(
            f"nvfp4_static: {type(model).__name__} has no converted NVFP4 layer to monitor; "
            f"convert it first"
        )
    return layers
