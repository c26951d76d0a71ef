"""Convert on many ranks, each doing a share of the work: ``convert_data_parallel``.

After ``sync_calibration`` every rank holds the same statistics, so a plain ``quantize_``
convert on each gives the same layers, every rank computing all of them. Here each rank
converts a disjoint share of the linears and broadcasts the result: a converted linear travels
as its packed weight, block scales and two global scales (its calibration diagnostics beside
them as an object), and the others take it as their convert's result for that layer. The
linears of an experts module convert together with their module (which pools statistics
across them), so for those only the weight computation is shared: the FP8 sweep's block scales
or GPTQ's codes, which each rank's convert then uses.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import torch
from torchao.quantization import quantize_
from tqdm.auto import tqdm

from nvfp4_static.config import NVFP4StaticActivationConfig, config_or_default
from nvfp4_static.convert_progress import MIN_LAYERS_FOR_A_BAR
from nvfp4_static.distributed import (
    _collective_device,
    _dist,
    _error_text,
    _first_unmatched,
    _gather,
    _raise_any_rank_error,
    _snapshot,
)
from nvfp4_static.experts.handlers import pooled_statistics_for, starved_experts
from nvfp4_static.experts.observed import NVFP4StaticObservedExperts
from nvfp4_static.fingerprints import SAMPLED_ELEMENTS, first_difference, tensor_digest
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.numerics import BLOCK_SIZE, pack_e2m1
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.observers.nvfp4_mse import GlobalAmaxTooSmallError
from nvfp4_static.tensor import NVFP4StaticTensor
from nvfp4_static.workflow import (
    adopt_converted,
    converted_linear,
    is_quantizable,
    layer_weight_global_amax,
    run_gptq,
    sweep_weight_block_scales,
)

__all__ = ["convert_data_parallel"]

# What a layer's share of convert costs besides its weight's size, in weight elements: the host
# work of converting one linear, about what sweeping 2^24 weights takes on an H100 (from a
# profile of the 8B-shaped layers' convert).
_COST_PER_LAYER = 2**24


class SideTask(NamedTuple):
    """Other work for one rank during a data-parallel convert: rank ``rank`` calls ``run()``
    after its share of the convert and before the results are exchanged, and takes a share
    smaller by ``cost`` (in the shares' unit: weight elements converted)."""

    rank: int
    cost: int
    run: Callable[[], None]


def convert_data_parallel(
    model: torch.nn.Module,
    config: Optional[NVFP4StaticActivationConfig] = None,
    filter_fn: Callable[[torch.nn.Module, str], bool] = is_quantizable,
    group=None,
    *,
    side_task: Optional[SideTask] = None,
) -> torch.nn.Module:
    """``quantize_(model, config with step="convert", filter_fn)`` on every rank of ``group``,
    each rank converting a disjoint share of the linears (for experts' linears: running their
    FP8 sweep or GPTQ) and broadcasting the results.

    Call it on every rank after ``sync_calibration``, with the same model (weights included),
    config and filter. Every rank ends with the converted layers a single-process convert
    gives, bit for bit (convert is deterministic and the ranks' statistics are equal). Layers
    are shared out largest first, each to the least-loaded rank. Before any work the ranks
    compare their configs, the layers they convert, and a sampled hash of each layer's weight,
    bias and statistics; a difference, or a rank whose share fails, makes every rank raise the
    same error, with the model unchanged. ``side_task``: a ``SideTask`` one rank runs beside
    its (smaller) share.
    """
    config = dataclasses.replace(config_or_default("convert_data_parallel", config), step="convert")
    linears = _converted_linears(model, filter_fn)
    _check_ranks_agree(model, linears, config, group)
    jobs = [_CONVERT if experts is None else _EXPERT_JOBS.get(config.weight_scale) for _, experts in linears]
    try:
        _share_out_convert(linears, jobs, config, group, side_task)
        quantize_(model, config, filter_fn=filter_fn)
    finally:
        for (linear, _), job in zip(linears, jobs):
            if job is not None and job.attribute is not None:
                setattr(linear, job.attribute, None)
    return model


def _check_ranks_agree(model: torch.nn.Module, linears: list[tuple], config, group) -> None:
    """Refuse, on every rank alike, ranks that would convert with other configs, other layers,
    or other weights or statistics (another model, or calibration not synced): each rank would
    otherwise take the other ranks' results for their layers, a mix of models."""
    local: dict = {"error": None, "config": dataclasses.asdict(config), "layers": [], "statistics": []}
    try:
        local["layers"] = [
            (layer.layer_name, tuple(layer.weight.shape),
             [tensor_digest(t, SAMPLED_ELEMENTS) for t in (layer.weight, layer.bias) if t is not None])
            for layer, _ in linears
        ]
        local["statistics"] = [
            (slot["layer"], slot["role"],
             None if slot["state"] is None else [tensor_digest(v, SAMPLED_ELEMENTS) for v in slot["state"].values()])
            for slot in _snapshot(model)
        ]
    except Exception as caught:
        local["error"] = _error_text(caught)
    gathered = _gather(local, group)
    _raise_any_rank_error(gathered, "convert")
    reference = gathered[0]
    for rank, item in enumerate(gathered[1:], start=1):
        if item["config"] != reference["config"]:
            key, ours, theirs = first_difference(reference["config"], item["config"])
            raise ValueError(
                f"nvfp4_static: rank {rank} converts with {key}={theirs!r}, rank 0 with "
                f"{key}={ours!r}; every rank must convert with the same config"
            )
    _check_same_layers([[(name, shape) for name, shape, _ in item["layers"]] for item in gathered])
    for rank, item in enumerate(gathered[1:], start=1):
        for (name, _, ours), (_, _, theirs) in zip(reference["layers"], item["layers"]):
            if ours != theirs:
                raise ValueError(
                    f"nvfp4_static: layer '{name}' has another weight or bias on rank {rank} than "
                    f"on rank 0 (a sampled hash); every rank must convert the same model, weights "
                    f"included"
                )
        for (name, role, ours), (_, _, theirs) in zip(reference["statistics"], item["statistics"]):
            if ours != theirs:
                raise ValueError(
                    f"nvfp4_static: layer '{name}' has other {role} statistics on rank {rank} than "
                    f"on rank 0; call sync_calibration(model) on every rank before convert_data_parallel"
                )


def _converted_linears(model: torch.nn.Module, filter_fn) -> list[tuple]:
    """``(observed linear, experts module holding it or None)`` for every linear that
    ``quantize_(model, config, filter_fn)`` converts: it hands ``filter_fn`` each module from
    the root down and converts the first it selects on each path (an experts module converts
    its expert linears)."""
    found, seen = [], set()

    def walk(module: torch.nn.Module, fqn: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if filter_fn(module, fqn):
            if isinstance(module, NVFP4StaticObservedLinear):
                found.append((module, None))
            elif isinstance(module, NVFP4StaticObservedExperts):
                found.extend((linear, module) for linear in (*module.gate_up_proj, *module.down_proj))
            return
        for name, child in module.named_children():
            walk(child, f"{fqn}.{name}" if fqn else name)

    walk(model, "")
    return found


@dataclasses.dataclass(frozen=True)
class _SharedJob:
    """A part of convert that the ranks share out. ``run(layer, config)`` computes a layer's
    result on the rank it falls to (or raises ``GlobalAmaxTooSmallError``: every rank's convert
    then finds the weight too small at once, and warns); the result travels as
    ``nbytes(layer)`` bytes (``to_bytes``) and a small picklable ``note``, and becomes a result
    again with ``from_bytes(data, note, layer, config)``. ``adopt`` hands it to convert: into the
    observed layer's ``attribute``, which ``convert_data_parallel`` clears afterwards, or, without
    one, as the converted layer itself."""

    run: Callable
    nbytes: Callable[[torch.nn.Module], int]
    to_bytes: Callable[[Any], torch.Tensor]
    note: Callable[[Any], Any]
    from_bytes: Callable[[torch.Tensor, Any, torch.nn.Module, NVFP4StaticActivationConfig], Any]
    attribute: Optional[str] = None

    def adopt(self, layer: torch.nn.Module, result: Any) -> None:
        if self.attribute is None:
            adopt_converted(layer, result)
        else:
            setattr(layer, self.attribute, result)


def _block_scale_count(layer) -> int:
    return layer.weight.shape[0] * (layer.weight.shape[1] // BLOCK_SIZE)


def _block_scales_from_bytes(data: torch.Tensor, layer) -> torch.Tensor:
    rows, columns = layer.weight.shape
    # a copy per layer: a view would keep (and a checkpoint save) the whole broadcast
    scales = data.view(rows, columns // BLOCK_SIZE).view(torch.float8_e4m3fn)
    return scales.to(layer.weight.device, copy=True)


def _codes_and_scales_from_bytes(data: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed E2M1 codes ``[N, K/2]``, FP8 block scales and what follows them, from ``data``."""
    rows, columns = layer.weight.shape
    code_bytes, scale_bytes = rows * columns // 2, _block_scale_count(layer)
    codes, scales, rest = data.split([code_bytes, scale_bytes, data.numel() - code_bytes - scale_bytes])
    codes = codes.view(rows, columns // 2).to(layer.weight.device, copy=True)
    return codes, _block_scales_from_bytes(scales, layer), rest


def _fp32_scalar_bytes(value: torch.Tensor) -> torch.Tensor:
    return value.detach().to(torch.float32).reshape(1).view(torch.uint8)


def _converted_bytes(converted: NVFP4StaticLinear) -> torch.Tensor:
    weight = converted.weight
    return torch.cat([
        weight.qdata.flatten(), weight.scale.view(torch.uint8).flatten(),
        _fp32_scalar_bytes(weight.per_tensor_scale), _fp32_scalar_bytes(weight.act_per_tensor_scale),
    ])


def _converted_from_bytes(data, note, layer, config) -> NVFP4StaticLinear:
    """The linear ``converted_linear`` gave on the rank that converted ``layer``; ``note`` holds
    its diagnostics and the host copy of its scale product (read there, not again here)."""
    stats, output_scale = note
    codes, block_scales, scalars = _codes_and_scales_from_bytes(data, layer)
    per_tensor_scale, act_per_tensor_scale = scalars.clone().view(torch.float32).to(layer.weight.device)
    weight = NVFP4StaticTensor(codes, block_scales, BLOCK_SIZE, layer.weight.dtype, per_tensor_scale,
                               act_per_tensor_scale, backend_override=config.backend, output_scale=output_scale)
    return NVFP4StaticLinear(weight, layer.bias, config.recipe(), layer.layer_name, stats)


_CONVERT = _SharedJob(
    run=lambda layer, config: converted_linear(layer, config),  # looked up when called (a test wraps it)
    nbytes=lambda layer: layer.weight.numel() // 2 + _block_scale_count(layer) + 8,
    to_bytes=_converted_bytes,
    note=lambda converted: (converted.calibration_stats, converted.weight.output_scale),
    from_bytes=_converted_from_bytes,
)


def _sweep(layer, config) -> torch.Tensor:
    """``sweep_weight_block_scales``, looked up when called (a test wraps it)."""
    return sweep_weight_block_scales(layer, config, layer_weight_global_amax(layer))


def _gptq_codes(layer, config) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's result as the packed E2M1 codes (element ``2i`` in the low nibble) and the FP8
    block scales: an eighth of the float32 values' bytes, to hold and to send."""
    result = run_gptq(layer, config, layer_weight_global_amax(layer))
    return pack_e2m1(result.values), result.block_scales_e4m3


_SWEEP = _SharedJob(
    run=_sweep,
    nbytes=_block_scale_count,
    to_bytes=lambda scales: scales.view(torch.uint8).flatten(),
    note=lambda scales: None,
    from_bytes=lambda data, note, layer, config: _block_scales_from_bytes(data, layer),
    attribute="swept_block_scales",
)
_GPTQ = _SharedJob(
    run=_gptq_codes,
    nbytes=lambda layer: layer.weight.numel() // 2 + _block_scale_count(layer),
    to_bytes=lambda codes: torch.cat([codes[0].flatten(), codes[1].view(torch.uint8).flatten()]),
    note=lambda codes: None,
    from_bytes=lambda data, note, layer, config: _codes_and_scales_from_bytes(data, layer)[:2],
    attribute="gptq_codes",
)
# What the ranks share of an expert linear's convert, by weight recipe ("max": nothing).
_EXPERT_JOBS = {"mse": _SWEEP, "hessian_mse": _SWEEP, "gptq": _GPTQ}


def _share_out_convert(
    linears: list[tuple], jobs: list[Optional[_SharedJob]], config: NVFP4StaticActivationConfig, group,
    side_task: Optional[SideTask] = None,
) -> None:
    """Run this rank's share of ``jobs`` (an expert's with the pooled statistics its experts
    module gives convert) and its side task, then hand every layer its result from the rank
    that computed it, one broadcast per rank. Nothing is handed over unless every rank
    succeeded."""
    dist = _dist()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layers = [layer for layer, _ in linears]
    loads = [0] * world
    if side_task is not None:
        loads[side_task.rank] = side_task.cost
    owners = _share_out([layer.weight.numel() + _COST_PER_LAYER if job else 0
                         for layer, job in zip(layers, jobs)], loads)
    local: dict = {"error": None, "computed": [], "notes": {}}
    mine = {}
    try:
        with contextlib.ExitStack() as scope:
            for experts in {id(e): e for _, e in linears if e is not None}.values():
                scope.enter_context(pooled_statistics_for(experts, starved_experts(experts, config)))
            own = [i for i, job in enumerate(jobs) if job is not None and owners[i] == rank]
            bar = scope.enter_context(tqdm(
                total=len(own), desc=f"nvfp4_static convert, rank {rank}'s share", unit="layer",
                disable=rank != 0 or len(own) < MIN_LAYERS_FOR_A_BAR,
            ))
            for i in own:
                bar.set_postfix_str(layers[i].layer_name)
                try:
                    mine[i] = jobs[i].run(layers[i], config)
                except GlobalAmaxTooSmallError:
                    pass  # every rank's convert finds it too small at once, and warns
                bar.update()
        if side_task is not None and side_task.rank == rank:
            side_task.run()
        local["computed"] = sorted(mine)
        local["notes"] = {i: jobs[i].note(result) for i, result in mine.items()}
    except Exception as caught:
        local["error"] = _error_text(caught)
    gathered = _gather(local, group)
    _raise_any_rank_error(gathered, "convert")
    device = _collective_device(group)
    results = dict(mine)
    for source, item in enumerate(gathered):
        if not item["computed"]:
            continue
        sizes = [jobs[i].nbytes(layers[i]) for i in item["computed"]]
        if source == rank:
            flat = torch.cat([jobs[i].to_bytes(mine[i]).to(device) for i in item["computed"]])
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        global_source = source if group is None else dist.get_global_rank(group, source)
        dist.broadcast(flat, src=global_source, group=group)
        if source == rank:
            continue
        for i, chunk in zip(item["computed"], flat.split(sizes)):
            results[i] = jobs[i].from_bytes(chunk, item["notes"][i], layers[i], config)
    for i, result in results.items():
        jobs[i].adopt(layers[i], result)


def _share_out(costs: Sequence[int], loads: list[int]) -> list[int]:
    """The rank that computes each layer: largest first, each to the least-loaded rank (the
    lowest on a tie), each rank starting from its ``loads`` (updated), so that every rank
    computes the same split."""
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += costs[i]
    return owners


def _check_same_layers(per_rank: Sequence[list]) -> None:
    reference = per_rank[0]
    for rank, layers in enumerate(per_rank[1:], start=1):
        for ours, theirs in zip(reference, layers):
            if ours != theirs:
                raise ValueError(
                    f"nvfp4_static: rank {rank} converts layer '{theirs[0]}' (weight "
                    f"{theirs[1]}) where rank 0 converts '{ours[0]}' (weight {ours[1]}); every "
                    f"rank must convert the same model with the same filter_fn"
                )
        if len(layers) != len(reference):
            (unmatched, _), rank_of_longer = _first_unmatched(reference, layers, rank)
            raise ValueError(
                f"nvfp4_static: rank {rank} converts {len(layers)} layers, rank 0 "
                f"{len(reference)}; the first unmatched is layer '{unmatched}' on rank "
                f"{rank_of_longer}; every rank must convert the same model with the same filter_fn"
            )
