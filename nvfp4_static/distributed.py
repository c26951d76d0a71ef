"""Data-parallel calibration: every rank calibrates a shard of the data, then all end with the
same observer statistics, hence the same scales at convert.

    dist.init_process_group("nccl", timeout=timedelta(minutes=5))   # or "gloo" on CPU
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    with nvfp4_static.data_parallel_calibration(model):              # syncs on exit
        for batch in my_shard:
            model(batch)
    nvfp4_static.convert_data_parallel(model)   # quantize_'s convert, shared out across ranks

``sync_calibration(model)`` gathers every rank's observer states and every rank folds them the
same way, by each state's ``STATE_REDUCTIONS``. What the ranks compare (layers, recipes, state
shapes, errors) travels as Python objects (``all_gather_object``); the states themselves as one
flat byte tensor per rank (``all_gather_into``, on the GPU under NCCL, on the CPU under
gloo), folded where they arrive, without a host copy:

- integer sums (histogram counts, token counts) and maxima (literal max, ``max`` recipe amax)
  are exact whatever the order, so the result equals, bit for bit, one process that calibrated
  on all the ranks' data, in any order;
- float32 sums (the Hessians of ``weight_scale="hessian_mse"``, the loss sums of
  ``act_calibration="mse"``) are rounded differently by every grouping of the batches, so no
  parallel scheme can reproduce a single process's running sum in general. They are folded in
  rank order, ``((S_0 + S_1) + S_2) + ...`` (ranks that saw nothing skipped), where ``S_r`` is
  rank r's own running sum. That is exactly what ``MergeableObserver.merge`` gives in one
  process, and what ``calibrate_in_shards`` reproduces: one process calibrating the same shards
  one after another and merging them in the same order. With one shard it is the plain run.

Mixture-of-experts layers sync their experts' linears as any linear, and the experts module's
own statistics beside them: the pooled calibrators, and the tokens per expert (summed), from
which convert picks the experts that take the pooled statistics, so every rank pools the
experts one process on all the data pools.

Convert then gives every rank the same layers; ``convert_data_parallel``
(``nvfp4_static.data_parallel_convert``) shares its work out across the ranks.

``act_calibration="mse"`` searches a grid anchored at the first batch's max, so the ranks must
share that anchor: the lowest rank with data runs its first batch, then every rank calls
``sync_mse_anchors(model)`` (the layer-by-layer driver does this itself).

Errors are raised on every rank alike, never on one rank while the others wait: ranks whose
models, recipes or observer states differ (naming the rank and the layer), and a rank whose
calibration failed (e.g. a NaN batch) when it ran under ``data_parallel_calibration`` or passed
its exception as ``sync_calibration(..., error=...)``. A rank that dies outside them leaves the
others waiting until the process group's timeout (``init_process_group(timeout=...)``).
"""

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch

from nvfp4_static.experts.observed import NVFP4StaticObservedExperts
from nvfp4_static.numerics import non_finite_summary
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.observers.anchored_mse import FirstBatchMseCalibrator
from nvfp4_static.observers.base import _REDUCE, MergeableObserver
from nvfp4_static.observers.mse import MseCalibrator

__all__ = [
    "calibrate_in_shards",
    "data_parallel_calibration",
    "sync_calibration",
    "sync_mse_anchors",
]

# Observed layers whose statistics a sync made every rank's: a second sync would add the other
# ranks' data again.
_SYNCED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

# --- what one process holds: its observers and their states -------------------------------------


def _observers(model: torch.nn.Module) -> list[tuple[str, str, Any, torch.nn.Module]]:
    """``(layer name, role, observer, layer)`` for every observed layer, in module order; an
    observer shared by several layers (``tie_fused_layers``) is listed once. An experts
    module's own statistics are listed under its name: its two pooled calibrators and its
    tokens per expert (``_ExpertTokenCounts``), which convert reads to pick the experts that
    take the pooled statistics."""
    found, seen = [], set()
    for fqn, module in model.named_modules():
        if isinstance(module, NVFP4StaticObservedExperts):
            name = module.layer_name or fqn
            found += [
                (name, "pooled gate_up_proj act", module.pooled_gate_up_calibrator, module),
                (name, "pooled down_proj act", module.pooled_down_calibrator, module),
                (name, "tokens per expert", _ExpertTokenCounts(module), module),
            ]
            continue
        if not isinstance(module, NVFP4StaticObservedLinear):
            continue
        name = module.layer_name or fqn
        for role, observer in (("act", module.act_calibrator), ("hessian", module.hessian_accumulator)):
            if observer is None or id(observer) in seen:
                continue
            seen.add(id(observer))
            found.append((name, role, observer, module))
    return found


class _ExpertTokenCounts:
    """An experts module's calibration tokens per expert, seen as an observer whose state is
    one int64 sum, so that the ranks add them up as they add histogram counts."""

    STATE_REDUCTIONS = {"tokens_per_expert": "sum"}

    def __init__(self, experts: NVFP4StaticObservedExperts):
        self.experts = experts

    @property
    def _state(self) -> Optional[dict]:
        counts = self.experts.tokens_per_expert
        return {"tokens_per_expert": torch.tensor(counts, dtype=torch.int64)} if any(counts) else None

    def _merge_config(self) -> dict:
        return {"num_experts": self.experts.num_experts}

    def settle(self) -> None:
        pass

    def load_state_dict(self, state: dict, values_checked: bool = False) -> None:
        self.experts.tokens_per_expert = state["tokens_per_expert"].tolist()

    def reset(self) -> None:
        self.experts.tokens_per_expert = [0] * self.experts.num_experts


def _device(layer: torch.nn.Module) -> torch.device:
    """Where a layer's observers keep their state: its (first) weight's device."""
    return next(layer.parameters()).device


def _plain(value):
    """A settings value as plain, comparable data (functions by qualified name)."""
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _plain(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return tuple(value.flatten().tolist())
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    return value


def _slot(name: str, role: str, observer, layer) -> dict:
    """What a rank says about one observer: its kind and settings (which must agree across
    ranks), its MSE anchor, and its state (the observer's own tensors; None: it saw no data)."""
    recipe = _plain(layer.activation_recipe) if role == "act" else None
    if isinstance(observer, FirstBatchMseCalibrator):
        search = observer.search
        if search is not None:
            search.settle()
        return {
            "layer": name, "role": role, "kind": type(observer).__name__,
            "settings": (recipe, _plain(observer.search_args)),
            "anchor": _anchor(observer),
            "restarts": observer.restarts,
            "reductions": dict(MseCalibrator.STATE_REDUCTIONS),
            "state": None if search is None else search._state,
        }
    if isinstance(observer, (MergeableObserver, _ExpertTokenCounts)):
        observer.settle()  # raises for a refused batch still being checked (CUDA)
        return {
            "layer": name, "role": role, "kind": type(observer).__name__,
            "settings": (recipe, _plain(observer._merge_config())),
            "anchor": None, "restarts": 0, "state": observer._state,
            "reductions": dict(observer.STATE_REDUCTIONS),
        }
    raise TypeError(
        f"nvfp4_static: layer '{name}': its {role} observer {type(observer).__name__} cannot be "
        f"synchronised across processes: it is neither a MergeableObserver nor the MSE recipe's"
    )


def _snapshot(model: torch.nn.Module) -> list[dict]:
    return [_slot(*entry) for entry in _observers(model)]


def _describe(slot: dict) -> str:
    return f"{slot['kind']} {slot['settings']}"


# --- the fold: the same on every rank, and in calibrate_in_shards ---------------------------------


def _check_same_structure(snapshots: Sequence[list]) -> None:
    reference = snapshots[0]
    for rank, slots in enumerate(snapshots[1:], start=1):
        for i, (ours, theirs) in enumerate(zip(reference, slots)):
            if (ours["layer"], ours["role"]) != (theirs["layer"], theirs["role"]):
                raise ValueError(
                    f"nvfp4_static: rank {rank}'s model differs from rank 0's: observer {i} is "
                    f"layer '{theirs['layer']}' ({theirs['role']}) on rank {rank} but layer "
                    f"'{ours['layer']}' ({ours['role']}) on rank 0; every rank must prepare the "
                    f"same model with the same filter_fn and config"
                )
            if (ours["kind"], ours["settings"]) != (theirs["kind"], theirs["settings"]):
                raise ValueError(
                    f"nvfp4_static: layer '{ours['layer']}' was prepared differently on rank "
                    f"{rank} ({_describe(theirs)}) than on rank 0 ({_describe(ours)}); every rank "
                    f"must prepare with the same config"
                )
        if len(slots) != len(reference):
            extra, rank_of_longer = _first_unmatched(reference, slots, rank)
            raise ValueError(
                f"nvfp4_static: rank {rank}'s model has {len(slots)} observers, rank 0's has "
                f"{len(reference)}; the first unmatched is layer '{extra['layer']}' "
                f"({extra['role']}) on rank {rank_of_longer}; every rank must prepare the same "
                f"model with the same filter_fn and config"
            )


def _first_unmatched(reference: Sequence, theirs: Sequence, rank: int) -> tuple[Any, int]:
    """For rank 0's ``reference`` and rank ``rank``'s list of another length: the first item the
    shorter one lacks, and the rank whose list holds it."""
    longer, holder = (theirs, rank) if len(theirs) > len(reference) else (reference, 0)
    return longer[min(len(theirs), len(reference))], holder


def _without_tensors(slot: dict) -> dict:
    """A slot as the ranks compare it: its state's tensors replaced by their (shape, dtype)."""
    state = slot["state"]
    spec = None if state is None else {key: (tuple(v.shape), v.dtype) for key, v in state.items()}
    return {**slot, "state": spec}


def _folded_slot(per_rank: Sequence[dict]) -> dict:
    """One observer's slots from every rank (rank order, states as (shape, dtype)) checked
    against each other: what the folded slot says besides its state's values (its state the
    spec of the ranks that have one; None: no rank saw data)."""
    having = [(rank, slot) for rank, slot in enumerate(per_rank) if slot["state"] is not None]
    first = per_rank[0]
    if not having:
        return {**first, "state": None}
    rank0, base = having[0]
    for rank, slot in having[1:]:
        if slot["anchor"] is not None and not torch.equal(slot["anchor"], base["anchor"]):
            raise ValueError(
                f"nvfp4_static: layer '{first['layer']}': the MSE search grid differs between "
                f"rank {rank0} (anchored at {base['anchor'].flatten().tolist()}) and rank {rank} "
                f"(at {slot['anchor'].flatten().tolist()}), so their losses cannot be added. The "
                f"lowest rank with data must run its first batch, then every rank call "
                f"sync_mse_anchors(model), before the other batches; a batch above the grid's top "
                f"(a restart) also moves it: put a representative batch first, or use "
                f"act_calibration='b_min'. An expert's grid is anchored at the first batch "
                f"routed to it, so each expert must get tokens in that first batch"
            )
        for key in slot["state"].keys() | base["state"].keys():
            theirs, ours = slot["state"].get(key), base["state"].get(key)
            if theirs != ours:
                raise ValueError(
                    f"nvfp4_static: layer '{first['layer']}' ({first['role']}): state '{key}' is "
                    f"{theirs} on rank {rank} but {ours} on rank {rank0}"
                )
    return {**base, "restarts": sum(slot["restarts"] for _, slot in having)}


# States travel as one flat byte buffer per rank: the states of one dtype and reduction end to
# end (a "run"), each run starting on this many bytes, so that every run can be viewed as its
# dtype in the buffer and in the all-gathered rows.
_ALIGNMENT = 16
# At most this many bytes of each rank's buffer per all-gather: the gathered rows take the
# number of ranks times this (full GPTQ Hessians are hundreds of MiB per layer).
_GATHER_CHUNK_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class _Run:
    """States of one dtype and reduction at bytes ``[start, end)`` of the flat buffer; each
    member ``(slot index, state key, shape, first element in the run)``."""

    dtype: torch.dtype
    reduction: str
    start: int
    end: int
    members: tuple

    def of(self, buffer: torch.Tensor) -> torch.Tensor:
        """This run in ``buffer`` (its last dim the flat bytes), viewed as its dtype."""
        return _bytes_as(buffer, self.start, self.end, self.dtype)


def _bytes_as(buffer: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[start, end)`` of ``buffer``'s last dim (uint8), viewed as ``dtype``."""
    return buffer[..., start:end].view(dtype)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each observer's state sits in the flat buffer every rank (or shard) contributes,
    and the folded slots (their states still (shape, dtype) specs), from every rank's slots."""

    runs: tuple
    nbytes: int
    slots: list


def _layout(described: Sequence[list]) -> _Layout:
    """The layout of the ranks' slots (``_without_tensors``, rank order); raises, naming the
    rank and layer, where they cannot be folded. Every rank computes the same one."""
    _check_same_structure(described)
    slots = [_folded_slot([ranks_slots[i] for ranks_slots in described])
             for i in range(len(described[0]))]
    grouped: dict[tuple, list] = {}
    for i, slot in enumerate(slots):
        for key, (shape, dtype) in (slot["state"] or {}).items():
            grouped.setdefault((dtype, slot["reductions"][key]), []).append((i, key, shape))
    runs, offset = [], 0
    for (dtype, reduction), entries in grouped.items():
        members, elements = [], 0
        for i, key, shape in entries:
            members.append((i, key, shape, elements))
            elements += math.prod(shape)
        end = offset + elements * dtype.itemsize
        runs.append(_Run(dtype, reduction, offset, end, tuple(members)))
        offset = -(-end // _ALIGNMENT) * _ALIGNMENT
    return _Layout(tuple(runs), offset, slots)


def _identity(dtype: torch.dtype, reduction: str):
    """What a rank without a state contributes, leaving the fold as if it were skipped, bit for
    bit: ``x + -0.0`` is ``x`` for every float ``x`` (``-0.0`` and ``+0.0`` included), and
    ``max(x, -inf)`` is ``x``."""
    if reduction == "sum":
        return -0.0 if dtype.is_floating_point else 0
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _pack(layout: _Layout, slots: Sequence[dict], device: torch.device) -> torch.Tensor:
    """This rank's (or shard's) states in ``layout``: a flat uint8 tensor on ``device``."""
    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    for run in layout.runs:
        parts = []
        for i, key, shape, _ in run.members:
            state = slots[i]["state"]
            if state is None:
                parts.append(torch.full((math.prod(shape),), _identity(run.dtype, run.reduction),
                                        dtype=run.dtype, device=device))
            else:
                parts.append(state[key].detach().reshape(-1).to(device))
        torch.cat(parts, out=run.of(flat))
    return flat


def _fold_rows(layout: _Layout, rows: torch.Tensor, into: torch.Tensor, offset: int = 0) -> None:
    """Fold ``rows`` ``[ranks, n]``, bytes ``[offset, offset + n)`` of every rank's buffer, in
    rank order, into the same bytes of ``into``: ``((S_0 + S_1) + S_2) + ...`` (or max) per
    element, as ``MergeableObserver.merge`` folds states."""
    for run in layout.runs:
        start, end = max(run.start, offset), min(run.end, offset + rows.shape[-1])
        if start >= end:
            continue
        ranks = _bytes_as(rows, start - offset, end - offset, run.dtype)
        folded = _bytes_as(into, start, end, run.dtype)
        folded.copy_(ranks[0])
        for theirs in ranks[1:]:
            _REDUCE[run.reduction](folded, theirs, out=folded)


def _unpack(layout: _Layout, flat: torch.Tensor) -> list[dict]:
    """The folded slots, their states views of ``flat`` (the folded buffer)."""
    states = [{} for _ in layout.slots]
    for run in layout.runs:
        values = run.of(flat)
        for i, key, shape, first in run.members:
            states[i][key] = values[first:first + math.prod(shape)].view(shape)
    return [{**slot, "state": state if slot["state"] is not None else None}
            for slot, state in zip(layout.slots, states)]


def _apply(model: torch.nn.Module, folded: list[dict]) -> None:
    """Load each observer's folded state, once every state is known to be finite (a sum that
    overflowed is refused, naming its layer, before any observer changes)."""
    _refuse_non_finite(folded)
    for (name, role, observer, layer), slot in zip(_observers(model), folded):
        if slot["state"] is None:
            continue  # no rank saw data: convert says so, naming the layer
        if isinstance(observer, FirstBatchMseCalibrator):
            device = _device(layer)
            if observer.search is None or not torch.equal(observer.search.initial_amax.cpu(), slot["anchor"]):
                _adopt_anchor(observer, slot["anchor"], device)
            observer.search.load_state_dict({k: v.to(device) for k, v in slot["state"].items()}, values_checked=True)
            observer.restarts = slot["restarts"]
            continue
        device = _device(layer) if observer._state is None else next(iter(observer._state.values())).device
        observer.load_state_dict({k: v.to(device) for k, v in slot["state"].items()}, values_checked=True)


def _refuse_non_finite(folded: list[dict]) -> None:
    """Refuse folded states holding NaN or Inf with one wait for the device for them all. Each
    rank's states passed their observers' checks, and folding non-negative ones (sums, maxima)
    keeps them non-negative, so finiteness is what is left to check."""
    floating = [
        (slot, key, value)
        for slot in folded
        if slot["state"] is not None
        for key, value in slot["state"].items()
        if value.is_floating_point()
    ]
    if not floating or bool(torch.stack([torch.isfinite(value).all() for _, _, value in floating]).all()):
        return
    slot, key, value = next(item for item in floating if not bool(torch.isfinite(item[2]).all()))
    raise ValueError(
        f"nvfp4_static: the ranks' statistics of layer '{slot['layer']}' ({slot['role']}) fold "
        f"into a state '{key}' of shape {tuple(value.shape)} holding {non_finite_summary(value)}; "
        f"no observer's state was changed"
    )


# --- across processes ----------------------------------------------------------------------------


def _dist():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "nvfp4_static: data-parallel calibration needs torch.distributed initialised "
            "(dist.init_process_group, e.g. under torchrun) before it is called"
        )
    return dist


def _gather(obj, group) -> list:
    dist = _dist()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor`` end to end in ``output``: ``all_gather_single`` where torch has
    it (2.13 deprecates ``all_gather_into_tensor`` for it), else ``all_gather_into_tensor``."""
    dist = _dist()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def ranks_that_failed(failed: bool, group, device: torch.device) -> list[int]:
    """The ranks of ``group`` whose ``failed`` is true, on every rank: one int32 per rank
    all-gathered on ``device`` (the device the group's backend takes)."""
    flag = torch.tensor([failed], dtype=torch.int32, device=device)
    every_rank = torch.empty(_dist().get_world_size(group), dtype=torch.int32, device=device)
    all_gather_into(every_rank, flag, group)
    return every_rank.nonzero().flatten().tolist()


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _raise_any_rank_error(gathered: list, step: str = "calibration") -> None:
    """Every rank raises the same error when any rank reported one."""
    failed = [(rank, item["error"]) for rank, item in enumerate(gathered) if item["error"]]
    if not failed:
        return
    rank, text = failed[0]
    others = f" (and on ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    raise RuntimeError(
        f"nvfp4_static: data-parallel {step} failed on rank {rank}{others}: {text}"
    )


def sync_calibration(
    model: torch.nn.Module, group=None, *, error: Optional[BaseException] = None
) -> None:
    """Give every rank the statistics of all ranks' calibration data; call it on every rank of
    ``group`` after its calibration batches and before ``step="convert"``.

    A rank with no data (or no data for some layers) contributes nothing. ``error``: an
    exception this rank's calibration raised; every rank then raises a ``RuntimeError`` naming
    this rank and the error, instead of waiting for it (``data_parallel_calibration`` passes
    it). Works with gloo (states gathered on the CPU) and NCCL (on the current CUDA device).
    See the module docstring for the exact equality guaranteed.

    Raises (on every rank alike):
        RuntimeError: some rank's calibration failed.
        ValueError: ranks prepared different models or recipes (naming the rank and layer),
            or an MSE layer's ranks searched different grids.
    """
    local: dict = {"error": None, "slots": None}
    slots = None
    if error is not None:
        local["error"] = _error_text(error)
    else:
        try:
            _refuse_a_second_sync(model)
            slots = _snapshot(model)
            local["slots"] = [_without_tensors(slot) for slot in slots]
        except Exception as caught:  # e.g. a NaN batch reported late (CUDA): tell the others
            local["error"] = _error_text(caught)
    gathered = _gather(local, group)
    _raise_any_rank_error(gathered)
    layout = _layout([item["slots"] for item in gathered])
    flat = _pack(layout, slots, _collective_device(group))
    _fold_across_ranks(layout, flat, group)
    _apply(model, _unpack(layout, flat))
    _SYNCED.update(layer for _, _, _, layer in _observers(model))


def _refuse_a_second_sync(model: torch.nn.Module) -> None:
    synced = next((name for name, _, _, layer in _observers(model) if layer in _SYNCED), None)
    if synced is not None:
        raise ValueError(
            f"nvfp4_static: sync_calibration: layer '{synced}' was synced already, so its "
            f"statistics hold every rank's data and a second sync would count the other ranks' "
            f"data again. Sync once, after all of a rank's batches (to calibrate anew, prepare "
            f"the float model again)"
        )


def _fold_across_ranks(layout: _Layout, flat: torch.Tensor, group) -> None:
    """Every rank's ``flat`` all-gathered and folded in rank order, into ``flat``, a chunk of
    at most ``_GATHER_CHUNK_BYTES`` at a time."""
    dist = _dist()
    world = dist.get_world_size(group)
    for start in range(0, layout.nbytes, _GATHER_CHUNK_BYTES):
        chunk = flat[start:start + _GATHER_CHUNK_BYTES]
        rows = torch.empty(world * chunk.numel(), dtype=torch.uint8, device=flat.device)
        all_gather_into(rows, chunk, group)
        _fold_rows(layout, rows.view(world, -1), flat, start)


def _collective_device(group) -> torch.device:
    """Where the group's collectives take their tensors: the current CUDA device for NCCL,
    else the CPU (gloo)."""
    if _dist().get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def data_parallel_calibration(model: torch.nn.Module, group=None):
    """Run this rank's calibration batches inside it; on exit, ``sync_calibration(model)``.

    If the body raises (e.g. a NaN batch), the exception is passed to the other ranks, and
    every rank raises the same ``RuntimeError`` naming the failing rank instead of hanging.
    """
    try:
        yield model
    except Exception as caught:
        sync_calibration(model, group, error=caught)
        raise  # not reached: sync raises for the error it was given
    sync_calibration(model, group)


def sync_mse_anchors(
    model: torch.nn.Module, group=None, *, error: Optional[BaseException] = None
) -> None:
    """Give every rank the MSE search grid of the lowest rank that has one, for
    ``act_calibration="mse"`` (a no-op for other recipes, apart from the collective).

    The lowest rank with data runs its first calibration batch (which anchors each layer's
    grid at that batch's max, as in a single process), then every rank calls this, then every
    rank runs its remaining batches. A rank that already collected on another grid is refused.
    """
    mse = [(name, obs, layer) for name, _, obs, layer in _observers(model)
           if isinstance(obs, FirstBatchMseCalibrator)]
    local: dict = {"error": _error_text(error) if error is not None else None, "anchors": None}
    if error is None:
        try:
            local["anchors"] = [(name, _anchor(obs)) for name, obs, _ in mse]
        except Exception as caught:
            local["error"] = _error_text(caught)
    gathered = _gather(local, group)
    _raise_any_rank_error(gathered)
    lists = [item["anchors"] for item in gathered]
    for rank, anchors in enumerate(lists[1:], start=1):
        if [n for n, _ in anchors] != [n for n, _ in lists[0]]:
            raise ValueError(
                f"nvfp4_static: rank {rank}'s MSE-calibrated layers differ from rank 0's "
                f"({len(anchors)} vs {len(lists[0])} layers); every rank must prepare the same "
                f"model with the same filter_fn and config"
            )
    for i, (name, observer, layer) in enumerate(mse):
        anchors = [(rank, lists[rank][i][1]) for rank in range(len(lists))
                   if lists[rank][i][1] is not None]
        if not anchors:
            continue
        source, anchor = anchors[0]
        for rank, theirs in anchors[1:]:
            if not torch.equal(theirs, anchor):
                raise ValueError(
                    f"nvfp4_static: layer '{name}': rank {rank} anchored its MSE grid at "
                    f"{theirs.flatten().tolist()} before sync_mse_anchors, rank {source} at "
                    f"{anchor.flatten().tolist()}; only the lowest rank with data may run a "
                    f"batch before the anchors are shared"
                )
        if observer.search is None:
            _adopt_anchor(observer, anchor, _device(layer))


def _anchor(observer: FirstBatchMseCalibrator) -> Optional[torch.Tensor]:
    """A CPU copy of the observer's MSE grid anchor; None before its first batch."""
    return None if observer.search is None else observer.search.initial_amax.detach().cpu().clone()


def _adopt_anchor(observer: FirstBatchMseCalibrator, anchor: torch.Tensor, device) -> None:
    observer.search = MseCalibrator(anchor.to(device), name=observer.name, **observer.search_args)


# --- the single-process reference ----------------------------------------------------------------


def calibrate_in_shards(
    model: torch.nn.Module,
    shards: Sequence[Iterable],
    forward: Optional[Callable[[torch.nn.Module, Any], Any]] = None,
) -> None:
    """Calibrate a prepared ``model`` in one process exactly as ``len(shards)`` ranks would,
    rank r seeing ``shards[r]``: each shard is collected into fresh observer states (MSE layers
    anchored at the first batch of the first non-empty shard), and the states are folded in
    shard order as ``sync_calibration`` folds them. The result, bit for bit, is what every rank
    holds after ``sync_calibration``. ``forward(model, batch)`` defaults to ``model(batch)``.
    """
    forward = forward or (lambda m, batch: m(batch))
    entries = _observers(model)
    snapshots, anchors = [], [None] * len(entries)
    for shard in shards:
        for i, (_, _, observer, layer) in enumerate(entries):
            observer.reset()
            if anchors[i] is not None:
                _adopt_anchor(observer, anchors[i], _device(layer))
        with torch.no_grad():
            for index, batch in enumerate(shard):
                forward(model, batch)
                if index == 0:  # as sync_mse_anchors after the first batch of the first rank
                    _record_anchors(entries, anchors)
        snapshots.append([_on_cpu(slot) for slot in _snapshot(model)])
    if not snapshots:
        return
    for _, _, observer, _ in entries:
        observer.reset()
    layout = _layout([[_without_tensors(slot) for slot in slots] for slots in snapshots])
    rows = torch.stack([_pack(layout, slots, torch.device("cpu")) for slots in snapshots])
    _fold_rows(layout, rows, rows[0])
    _apply(model, _unpack(layout, rows[0]))


def _on_cpu(slot: dict) -> dict:
    """``slot`` with a CPU copy of its state: the shards' states wait on the host."""
    state = slot["state"]
    return {**slot, "state": None if state is None else
            {key: value.detach().to("cpu", copy=True) for key, value in state.items()}}


def _record_anchors(entries: list, anchors: list) -> None:
    for i, (_, _, observer, _) in enumerate(entries):
        if anchors[i] is None and isinstance(observer, FirstBatchMseCalibrator):
            anchors[i] = _anchor(observer)
