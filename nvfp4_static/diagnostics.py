"""Per-layer diagnostics of a converted model: what calibration chose and what it costs on data.

After ``step="convert"`` each ``NVFP4StaticLinear`` holds a fixed activation global amax. Whether
it was a good choice shows only on data: does the batch clip against it (elements above
``g_amax`` saturate), do small blocks fall below FP8's normal range (block scales below 2^-6 are
clamped, so those blocks lose resolution), and what signal-to-noise ratio the activation, the
weight and the layer output keep. ``layer_diagnostics`` measures all of it with forward hooks on
one batch, so examples and studies do not each reimplement it; ``format_diagnostics`` prints it.

    report = layer_diagnostics(quantized_model, batch, reference_model=float_model)
    print(format_diagnostics(report))
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.nn.functional as F

from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.numerics import (
    E4M3_DYNAMIC_RANGE,
    block_amax,
    dequantize_nvfp4,
    fake_quantize_nvfp4,
    per_tensor_amax_to_scale,
)

__all__ = ["LayerDiagnostics", "layer_diagnostics", "format_diagnostics", "snr_db"]


def snr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (ref - approx)^2)`` in float64; inf when they are equal."""
    reference, approximation = reference.double(), approximation.double()
    return _ratio_db(reference.pow(2).sum(), (reference - approximation).pow(2).sum())


def _ratio_db(signal, noise) -> float:
    signal, noise = float(signal), float(noise)
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


@dataclasses.dataclass
class LayerDiagnostics:
    """One converted layer on one batch.

    Attributes:
        name: the module's name in the model passed to ``layer_diagnostics``.
        recipe: ``{"act_calibration": ..., "weight_scale": ...}`` the layer was converted with.
        act_global_amax: the static activation global amax baked into the layer.
        calibration_stats: the calibrator's diagnostics (for ``b_min``: ``literal_max``,
            ``b_min``, ``b_max``, ``g_amax``, ``set_by``, ...); empty after loading a checkpoint.
        warned: the calibrator saw ``B_max / B_min`` beyond FP8's normal range (28672).
        batch_amax: ``max |x|`` of the layer's input on this batch.
        act_snr_db: SNR of the input fake-quantized under the static global scale, as inference
            quantizes it.
        act_dynamic_snr_db: the same under a global scale computed from this batch's own max:
            what a dynamic (per-call) scale would get; the gap is the cost of being static.
        clipped_fraction: fraction of input elements above ``act_global_amax`` (they saturate).
        subnormal_block_fraction: fraction of nonzero 16-wide input blocks whose amax is below
            ``act_global_amax / 28672``: their FP8 block scale would be subnormal and is clamped
            up to 2^-6, so small values in them round to zero.
        weight_snr_db: SNR of the dequantized weight against ``reference_model``'s (None without).
        output_snr_db: SNR of the layer's output against the float linear applied to the same
            input (None without ``reference_model``): the layer's own error, upstream excluded.
        calls: how many times the layer ran on the batch (sums above cover every call).
    """

    name: str
    recipe: dict
    act_global_amax: float
    calibration_stats: dict
    warned: bool
    batch_amax: float
    act_snr_db: float
    act_dynamic_snr_db: float
    clipped_fraction: float
    subnormal_block_fraction: float
    weight_snr_db: Optional[float]
    output_snr_db: Optional[float]
    calls: int


class _LayerAccumulator:
    """Running sums for one layer over every call in the batch (float64, bounded)."""

    def __init__(self, module: NVFP4StaticLinear, reference: Optional[torch.nn.Linear]):
        self.module = module
        self.reference = reference
        self.act_per_tensor_scale = module.weight.act_per_tensor_scale.to(torch.float32)
        self.act_global_amax = module.act_global_amax
        self.sums = dict.fromkeys(
            ("signal", "noise", "dynamic_noise", "out_signal", "out_noise"), 0.0
        )
        self.counts = dict.fromkeys(("elements", "clipped", "blocks", "subnormal", "calls"), 0)
        self.batch_amax = 0.0

    @torch.no_grad()
    def observe(self, x: torch.Tensor, output: torch.Tensor) -> None:
        x = x.detach()
        x64 = x.double()
        amax = x.abs().amax().to(torch.float32)
        static = fake_quantize_nvfp4(x, self.act_per_tensor_scale.to(x.device)).double()
        self.sums["signal"] += float(x64.pow(2).sum())
        self.sums["noise"] += float((x64 - static).pow(2).sum())
        if amax > 0:
            dynamic = fake_quantize_nvfp4(x, per_tensor_amax_to_scale(amax)).double()
            self.sums["dynamic_noise"] += float((x64 - dynamic).pow(2).sum())
        g_amax = self.act_global_amax
        blocks = block_amax(x)
        nonzero = blocks > 0
        self.counts["elements"] += x.numel()
        self.counts["clipped"] += int((x.abs() > g_amax).sum())
        self.counts["blocks"] += int(nonzero.sum())
        self.counts["subnormal"] += int((nonzero & (blocks < g_amax / E4M3_DYNAMIC_RANGE)).sum())
        self.counts["calls"] += 1
        self.batch_amax = max(self.batch_amax, float(amax))
        if self.reference is not None:
            expected = F.linear(
                x.to(self.reference.weight.dtype), self.reference.weight, self.reference.bias
            ).double()
            self.sums["out_signal"] += float(expected.pow(2).sum())
            self.sums["out_noise"] += float((expected - output.detach().double()).pow(2).sum())

    def result(self, name: str) -> LayerDiagnostics:
        module, sums, counts = self.module, self.sums, self.counts
        stats = dict(module.calibration_stats)
        weight_snr = output_snr = None
        if self.reference is not None:
            weight = module.weight
            dequantized = dequantize_nvfp4(weight.qdata, weight.scale, weight.per_tensor_scale)
            weight_snr = snr_db(self.reference.weight.detach(), dequantized)
            output_snr = _ratio_db(sums["out_signal"], sums["out_noise"])
        return LayerDiagnostics(
            name=name,
            recipe=dict(module.recipe),
            act_global_amax=self.act_global_amax,
            calibration_stats=stats,
            warned=stats.get("b_max_over_b_min", 0.0) > E4M3_DYNAMIC_RANGE,
            batch_amax=self.batch_amax,
            act_snr_db=_ratio_db(sums["signal"], sums["noise"]),
            act_dynamic_snr_db=_ratio_db(sums["signal"], sums["dynamic_noise"]),
            clipped_fraction=counts["clipped"] / max(counts["elements"], 1),
            subnormal_block_fraction=counts["subnormal"] / max(counts["blocks"], 1),
            weight_snr_db=weight_snr,
            output_snr_db=output_snr,
            calls=counts["calls"],
        )


def _run(model: torch.nn.Module, batch) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def _reference_linear(reference_model: torch.nn.Module, name: str) -> torch.nn.Linear:
    try:
        reference = reference_model.get_submodule(name)
    except AttributeError as error:
        raise ValueError(
            f"nvfp4_static.diagnostics: reference_model has no module '{name}'; pass the float "
            f"model the quantized one was converted from"
        ) from error
    if not isinstance(reference, torch.nn.Linear) or isinstance(reference, NVFP4StaticLinear):
        raise ValueError(
            f"nvfp4_static.diagnostics: reference_model's '{name}' is a {type(reference).__name__}, "
            f"expected the float nn.Linear it was converted from"
        )
    return reference


@torch.no_grad()
def layer_diagnostics(
    model: torch.nn.Module,
    batch,
    reference_model: Optional[torch.nn.Module] = None,
) -> list[LayerDiagnostics]:
    """Run ``model`` on ``batch`` once and measure every ``NVFP4StaticLinear`` in it.

    Forward hooks see each layer's actual input, so the activation numbers include whatever
    error upstream layers already added. Pass the eager model: hooks do not fire inside a
    ``torch.compile``'d graph.

    Args:
        model: a converted model (``step="convert"`` or a loaded checkpoint).
        batch: a tensor (``model(batch)``), a tuple (``model(*batch)``) or a mapping
            (``model(**batch)``).
        reference_model: optional float model with the same module names (the model before
            ``prepare``); enables ``weight_snr_db`` and ``output_snr_db``.

    Returns:
        One ``LayerDiagnostics`` per converted layer that ran, in module order.
    """
    accumulators: dict[str, _LayerAccumulator] = {}
    handles = []
    for name, module in model.named_modules():
        if not isinstance(module, NVFP4StaticLinear):
            continue
        reference = None if reference_model is None else _reference_linear(reference_model, name)
        accumulator = _LayerAccumulator(module, reference)
        accumulators[name] = accumulator
        handles.append(
            module.register_forward_hook(
                lambda _module, args, output, acc=accumulator: acc.observe(args[0], output)
            )
        )
    if not accumulators:
        raise ValueError(
            "nvfp4_static.diagnostics: the model has no NVFP4StaticLinear; convert it with "
            "quantize_(model, NVFP4StaticActivationConfig(step='convert')) first"
        )
    try:
        _run(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return [acc.result(name) for name, acc in accumulators.items() if acc.counts["calls"]]


def _short_name(name: str, width: int) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _format_db(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_diagnostics(
    diagnostics: Sequence[LayerDiagnostics], max_rows: Optional[int] = None
) -> str:
    """A plain-text table, one row per layer; ``max_rows`` keeps the worst by activation SNR.

    Columns: name, g_amax and which term set it, the batch's max, activation SNR under the
    static and a dynamic scale, clipped fraction, subnormal-block fraction, weight and output
    SNR, and ``!`` where the calibrator warned about the block-amax range.
    """
    rows = list(diagnostics)
    if max_rows is not None and len(rows) > max_rows:
        worst = sorted(rows, key=lambda d: d.act_snr_db)[:max_rows]
        rows = [d for d in rows if d in worst]
    header = (
        f"{'layer':<36} {'g_amax':>9} {'set by':<13} {'batch max':>9} {'act dB':>6} "
        f"{'dyn dB':>6} {'clip %':>7} {'subn %':>7} {'w dB':>5} {'out dB':>6} warn"
    )
    lines = [header, "-" * len(header)]
    for d in rows:
        lines.append(
            f"{_short_name(d.name, 36):<36} {d.act_global_amax:>9.4g} "
            f"{d.calibration_stats.get('set_by', '-'):<13} {d.batch_amax:>9.4g} "
            f"{_format_db(d.act_snr_db):>6} {_format_db(d.act_dynamic_snr_db):>6} "
            f"{100 * d.clipped_fraction:>7.3f} {100 * d.subnormal_block_fraction:>7.3f} "
            f"{_format_db(d.weight_snr_db):>5} {_format_db(d.output_snr_db):>6} "
            f"{'!' if d.warned else ''}"
        )
    return "\n".join(lines)
