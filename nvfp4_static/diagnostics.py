"""Per-layer diagnostics of a converted model: what calibration chose and what it costs on data.

After ``step="convert"`` each ``NVFP4StaticLinear``, and each expert's two GEMMs in an
``NVFP4StaticExperts``, hold a fixed activation global amax. Whether
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

from nvfp4_static.arguments import uncompiled
from nvfp4_static.experts import NVFP4StaticExperts, experts_layout
from nvfp4_static.experts.converted import PROJECTIONS
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.numerics import (
    E4M3_DYNAMIC_RANGE,
    block_amax,
    dequantize_nvfp4,
    fake_quantize_nvfp4,
    largest_at_most,
    non_finite_summary,
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

    An expert's GEMM of a mixture-of-experts layer is a layer of its own here: its own scales,
    calibrator and inputs (the rows routed to that expert).

    Attributes:
        name: the module's name in the model passed to ``layer_diagnostics``; for an expert,
            its experts module's name and ``gate_up_proj.{e}`` or ``down_proj.{e}``, as
            calibration names it.
        recipe: ``{"act_calibration": ..., "weight_scale": ...}`` the layer was converted with.
        act_global_amax: the static activation global amax baked into the layer.
        calibration_stats: the calibrator's diagnostics (for ``b_min``: ``literal_max``,
            ``b_min``, ``b_max``, ``g_amax``, ``set_by``, ...); for an expert also ``tokens``
            (calibration tokens it saw) and ``pooled`` (it saw too few and took the layer's
            pooled statistics, whose diagnostics these are); empty after loading a checkpoint.
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
    """Running sums for one layer over every call in the batch (float64, bounded).
    ``reference``: the float layer's ``(weight, bias)``, or None."""

    def __init__(self, name: str, module: NVFP4StaticLinear, reference: Optional[tuple]):
        self.name = name
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
        if x.numel() == 0:  # a call without tokens: nothing to measure
            self.counts["calls"] += 1
            return
        amax = x.abs().amax().to(torch.float32)
        if not bool(torch.isfinite(amax)):
            raise ValueError(
                f"nvfp4_static.diagnostics: layer '{self.name}' got an input holding {non_finite_summary(x)}; "
                f"the diagnostics measure finite activations (check the batch, or the layers before this one)"
            )
        x64 = x.double()
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
        # As the clip monitor counts: g_amax rounded to x's dtype would miss the values between.
        limit = largest_at_most(self.act_per_tensor_scale.to(x.device) * 448 * 6, x.dtype)
        self.counts["clipped"] += int((x.abs() > limit).sum())
        self.counts["blocks"] += int(nonzero.sum())
        self.counts["subnormal"] += int((nonzero & (blocks < g_amax / E4M3_DYNAMIC_RANGE)).sum())
        self.counts["calls"] += 1
        self.batch_amax = max(self.batch_amax, float(amax))
        if self.reference is not None:
            weight, bias = self.reference
            expected = F.linear(x.to(weight.dtype), weight, bias).double()
            self.sums["out_signal"] += float(expected.pow(2).sum())
            self.sums["out_noise"] += float((expected - output.detach().double()).pow(2).sum())

    def result(self, name: str) -> LayerDiagnostics:
        module, sums, counts = self.module, self.sums, self.counts
        stats = dict(module.calibration_stats)
        weight_snr = output_snr = None
        if self.reference is not None:
            weight = module.weight
            dequantized = dequantize_nvfp4(weight.qdata, weight.scale, weight.per_tensor_scale)
            weight_snr = snr_db(self.reference[0].detach(), dequantized)
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


def _reference_module(reference_model: torch.nn.Module, name: str, is_float, expected: str):
    try:
        reference = reference_model.get_submodule(name)
    except AttributeError as error:
        raise ValueError(
            f"nvfp4_static.diagnostics: reference_model has no module '{name}'; pass the float "
            f"model the quantized one was converted from"
        ) from error
    if not is_float(reference):
        raise ValueError(
            f"nvfp4_static.diagnostics: reference_model's '{name}' is a {type(reference).__name__}, "
            f"expected the float {expected} it was converted from"
        )
    return reference


def _reference_linear(reference_model: torch.nn.Module, name: str) -> tuple:
    """The float linear's ``(weight, bias)``."""
    reference = _reference_module(
        reference_model,
        name,
        lambda m: isinstance(m, torch.nn.Linear) and not isinstance(m, NVFP4StaticLinear),
        "nn.Linear",
    )
    return reference.weight, reference.bias


def _reference_experts(reference_model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The float experts' 3-D weights by projection (``gate_up_proj``, ``down_proj``)."""
    reference = _reference_module(
        reference_model, name, lambda m: experts_layout(m) is not None, "experts module"
    )
    return dict(zip(PROJECTIONS, experts_layout(reference).weights(reference)))


def _watch_linear(name, module, reference_model, accumulators) -> list:
    """An accumulator for the linear ``module`` and the hook that feeds it."""
    reference = None if reference_model is None else _reference_linear(reference_model, name)
    if reference is not None and (
        tuple(reference[0].shape) != tuple(module.weight.shape)
        or (reference[1] is None) != (module.bias is None)
        or (reference[1] is not None and tuple(reference[1].shape) != tuple(module.bias.shape))
    ):
        raise ValueError(
            f"nvfp4_static.diagnostics: reference_model's '{name}' has weight {list(reference[0].shape)} and "
            f"{'no bias' if reference[1] is None else 'a bias'}; the converted layer has weight "
            f"{list(module.weight.shape)} and {'no bias' if module.bias is None else 'a bias'}: pass the float "
            f"model it was converted from"
        )
    accumulator = accumulators[name] = _LayerAccumulator(name, module, reference)
    return [
        module.register_forward_hook(
            lambda _module, args, output: accumulator.observe(args[0], output)
        )
    ]


def _watch_experts(name, module: NVFP4StaticExperts, reference_model, accumulators) -> list:
    """An accumulator per expert GEMM of ``module`` and, on each grouped GEMM, the hook that
    hands each expert's accumulator its rows of the input and the output."""
    references = None if reference_model is None else _reference_experts(reference_model, name)
    linears = module.projection_linears()
    handles = []
    for projection in PROJECTIONS:
        experts = []
        for expert in range(module.num_experts):
            reference = None if references is None else (references[projection][expert], None)
            key = f"{projection}.{expert}"
            experts.append(_LayerAccumulator(f"{name}.{key}", linears[key], reference))
            accumulators[f"{name}.{key}"] = experts[-1]
        handles.append(
            getattr(module, projection).register_forward_hook(
                lambda _module, args, output, experts=experts: _observe_experts(experts, args, output)
            )
        )
    return handles


def _observe_experts(accumulators: list[_LayerAccumulator], args: tuple, output: torch.Tensor) -> None:
    """Hand each expert its rows of a grouped GEMM's call ``(x, expert_offsets[, source_rows])``."""
    x, expert_offsets = args[:2]
    rows = x if len(args) < 3 or args[2] is None else x[args[2]]
    bounds = expert_offsets.tolist()
    for accumulator, first, end in zip(accumulators, bounds[:-1], bounds[1:]):
        if end > first:
            accumulator.observe(rows[first:end], output[first:end])


@torch.no_grad()
def layer_diagnostics(
    model: torch.nn.Module,
    batch,
    reference_model: Optional[torch.nn.Module] = None,
) -> list[LayerDiagnostics]:
    """Run ``model`` on ``batch`` once and measure every ``NVFP4StaticLinear`` in it, and every
    expert's GEMMs of each ``NVFP4StaticExperts`` on the rows routed to it.

    Forward hooks see each layer's actual input, so the activation numbers include whatever
    error upstream layers already added. A ``torch.compile``'d model is run as the eager
    module it wraps (hooks do not fire inside a compiled graph).

    Args:
        model: a converted model (``step="convert"`` or a loaded checkpoint).
        batch: a tensor (``model(batch)``), a tuple (``model(*batch)``) or a mapping
            (``model(**batch)``).
        reference_model: optional float model with the same module names (the model as it
            was right before ``prepare``: after ``smooth_norm_inputs`` where the recipe smooths,
            since smoothing changes the weights the quantized layers approximate); enables
            ``weight_snr_db`` and ``output_snr_db``.

    Returns:
        One ``LayerDiagnostics`` per converted layer (and expert GEMM) that ran on at least one
        token, in module order (an experts module's gate/up GEMMs by expert, then its down
        GEMMs).

    Raises:
        ValueError: a layer's input holds NaN or Inf (no number would mean anything).
    """
    model = uncompiled(model)  # run eagerly: the hooks measure each layer's call
    reference_model = None if reference_model is None else uncompiled(reference_model)
    accumulators: dict[str, _LayerAccumulator] = {}
    handles = []
    try:
        for name, module in model.named_modules():
            if isinstance(module, NVFP4StaticLinear):
                handles += _watch_linear(name, module, reference_model, accumulators)
            elif isinstance(module, NVFP4StaticExperts):
                handles += _watch_experts(name, module, reference_model, accumulators)
        if not accumulators:
            raise ValueError(
                "nvfp4_static.diagnostics: the model has no NVFP4StaticLinear or "
                "NVFP4StaticExperts; convert it with quantize_(model, "
                "NVFP4StaticActivationConfig(step='convert')) first"
            )
        _run(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return [acc.result(name) for name, acc in accumulators.items() if acc.counts["elements"]]


def _short_name(name: str, width: int) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _format_db(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_diagnostics(
    diagnostics: Sequence[LayerDiagnostics], max_rows: Optional[int] = None
) -> str:
    """A plain-text table, one row per layer; ``max_rows`` keeps the worst by activation SNR.

    Columns: name, g_amax and which term set it (``pooled`` for an expert that took its
    layer's pooled statistics), the batch's max, activation SNR under the static and a dynamic
    scale, clipped fraction, subnormal-block fraction, weight and output SNR, and ``!`` where
    the calibrator warned about the block-amax range.
    """
    rows = list(diagnostics)
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
        raise ValueError(f"nvfp4_static: format_diagnostics: max_rows={max_rows!r} must be a whole number >= 0")
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
            f"{_set_by(d.calibration_stats):<13} {d.batch_amax:>9.4g} "
            f"{_format_db(d.act_snr_db):>6} {_format_db(d.act_dynamic_snr_db):>6} "
            f"{100 * d.clipped_fraction:>7.3f} {100 * d.subnormal_block_fraction:>7.3f} "
            f"{_format_db(d.weight_snr_db):>5} {_format_db(d.output_snr_db):>6} "
            f"{'!' if d.warned else ''}"
        )
    return "\n".join(lines)


def _set_by(stats: dict) -> str:
    return "pooled" if stats.get("pooled") else stats.get("set_by", "-")
