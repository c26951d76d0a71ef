"""Tokens to experts and back, as transformers' eager experts forward routes them.

``route`` sorts the (token, slot) pairs of ``top_k_index [T, k]`` into rows grouped by expert, in
the order transformers' loop gives each expert its tokens (by slot, then by token), so each
expert's linear sees exactly the rows it sees there. ``combine`` adds each token's weighted
expert outputs in ascending expert order, the order of transformers' ``index_add_`` over experts,
so the sums round as they do there. On CUDA each is a Triton kernel (``kernels.expert_routing``):
launched directly by an eager call, and in a traced graph an opaque op of its own
(``kernels.ops.route_experts``, ``combine_experts``), so that a compiled forward does not depend
on how many tokens each expert gets. Elsewhere, and past the kernels' limits, they are
shape-static torch ops, few of them, with the same results bit for bit.
"""

from typing import NamedTuple

import torch

from nvfp4_static.kernels.launch import runs_eagerly
from nvfp4_static.kernels.ops import HAS_TRITON, combine_experts, route_experts

if HAS_TRITON:
    from nvfp4_static.kernels.expert_routing import COMBINED_DTYPES, MAX_ROUTED_PAIRS, launch_route

__all__ = ["Routing", "check_expert_indices", "check_routing", "route", "combine"]


def check_routing(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, name: str, device: torch.device
):
    """Refuse routing tensors that do not describe ``T`` tokens' ``k`` experts each, or that are
    not on ``device``, the experts' weights': ``route`` and ``combine`` would otherwise drop or mix
    up tokens without an error, or fail inside torch without naming the layer."""
    tokens = hidden_states.shape[0] if hidden_states.dim() == 2 else None
    if (
        tokens is None
        or top_k_index.dim() != 2
        or top_k_index.shape[0] != tokens
        or top_k_index.dtype.is_floating_point
        or top_k_index.dtype.is_complex
        or not top_k_index.dtype.is_signed  # bool, and unsigned types, where -1 wraps around
        or top_k_weights.shape != top_k_index.shape
        or not top_k_weights.dtype.is_floating_point
    ):
        raise ValueError(
            f"nvfp4_static: experts '{name}' take hidden_states [tokens, hidden], a signed integer top_k_index "
            f"[tokens, k] and floating-point top_k_weights of the same shape; got hidden_states "
            f"{list(hidden_states.shape)}, top_k_index {list(top_k_index.shape)} {top_k_index.dtype}, "
            f"top_k_weights {list(top_k_weights.shape)} {top_k_weights.dtype}"
        )
    if hidden_states.device != device or top_k_index.device != device or top_k_weights.device != device:
        inputs = {"hidden_states": hidden_states, "top_k_index": top_k_index, "top_k_weights": top_k_weights}
        where = ", ".join(f"{label} on {x.device}" for label, x in inputs.items() if x.device != device)
        raise ValueError(
            f"nvfp4_static: experts '{name}' hold their weights on {device}, but got {where}; move the "
            f"inputs (or the model) so that all are on one device"
        )


def check_expert_indices(top_k_index: torch.Tensor, num_experts: int, name: str, after: str = "") -> None:
    """Refuse expert indices outside ``0..num_experts`` (``num_experts`` is transformers' index
    for a slot routed to no expert; one_hot refuses any other there): ``route`` would send them
    to no expert without a word. Reads the device; ``after`` ends the message."""
    outside = (top_k_index < 0) | (top_k_index > num_experts)
    if bool(outside.any()):
        bad = top_k_index[outside]
        raise ValueError(
            f"nvfp4_static: experts '{name}': top_k_index holds {bad.numel()} expert indices outside "
            f"0..{num_experts} (first: {int(bad[0])}); {num_experts} routes a slot to no expert{after}"
        )


class Routing(NamedTuple):
    """Rows of the experts' GEMMs.

    Attributes:
        pair_of_row: ``[T * k]``: row ``r`` holds the pair ``j * T + t`` (slot ``j`` of token
            ``t``: ``top_k_index.t()`` flattened).
        expert_offsets: ``[E + 1]`` int64: expert ``e`` owns rows ``expert_offsets[e]`` to
            ``expert_offsets[e + 1]``; rows from ``expert_offsets[E]`` on go to no expert.
        tokens: ``T``.
        pairs_in_range: ``[1]`` int64: how many pairs hold an index in ``0..E`` (``E`` routes a
            slot to no expert); each of the others is a router's error.
        row_of_pair: ``[T * k]``: the inverse of ``pair_of_row``.
        token_of_row: ``[T * k]``: the token whose hidden state row ``r`` takes.
    """

    pair_of_row: torch.Tensor
    expert_offsets: torch.Tensor
    tokens: int
    pairs_in_range: torch.Tensor
    row_of_pair: torch.Tensor
    token_of_row: torch.Tensor


def routed_by_kernel(top_k_index: torch.Tensor) -> bool:
    """Whether ``route`` runs the route kernel on ``top_k_index`` (an eager call on CUDA of at
    most ``MAX_ROUTED_PAIRS`` pairs) rather than the torch ops."""
    return (
        HAS_TRITON and top_k_index.is_cuda and top_k_index.numel() <= MAX_ROUTED_PAIRS and runs_eagerly(top_k_index)
    )


def routing_buffer(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The int64 memory the route kernel fills for ``top_k_index``, new and unfilled
    (``routing_in`` reads it)."""
    return torch.empty(3 * top_k_index.numel() + num_experts + 2, dtype=torch.int64, device=top_k_index.device)


def routing_in(buffer: torch.Tensor, tokens: int, num_experts: int) -> Routing:
    """The ``Routing`` the route kernel wrote into ``buffer`` for ``tokens`` tokens: views of it,
    ``pair_of_row``, ``row_of_pair``, ``token_of_row``, then the kernel's ``[E + 2]`` starts."""
    pairs = (buffer.numel() - num_experts - 2) // 3
    return routing_of(buffer.split([pairs, pairs, pairs, num_experts + 2]), tokens, num_experts)


def traced_on_cuda(*tensors: torch.Tensor) -> bool:
    """Whether a call on CUDA tensors is being traced, so that it reaches the routing kernels
    through their ops."""
    return HAS_TRITON and tensors[0].is_cuda and not runs_eagerly(*tensors)


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Group the pairs of ``top_k_index [T, k]`` by expert (an index outside ``[0, E)``: by no
    expert, after all the others), counting those in ``0..E``."""
    tokens, pairs = top_k_index.shape[0], top_k_index.numel()
    if routed_by_kernel(top_k_index):
        buffer = routing_buffer(top_k_index, num_experts)
        launch_route(top_k_index, num_experts, *buffer.split([pairs, pairs, pairs, num_experts + 2]))
        return routing_in(buffer, tokens, num_experts)
    if traced_on_cuda(top_k_index):
        return routing_of(route_experts(top_k_index, num_experts), tokens, num_experts)
    return routing_of(routing_by_torch_ops(top_k_index, num_experts), tokens, num_experts)


def routing_of(parts: tuple, tokens: int, num_experts: int) -> Routing:
    """The ``Routing`` of ``(pair_of_row, row_of_pair, token_of_row, starts)``, the route kernel's
    four outputs (``starts`` ``[E + 2]``: the experts' offsets, then the count in range). Traced,
    they are tensors of their own (``kernels.ops.route_experts``), so ``expert_offsets`` starts
    its storage: Inductor's CUDA lowering of searchsorted ignores a view's offset
    (pytorch/pytorch#160964)."""
    pair_of_row, row_of_pair, token_of_row, starts = parts
    return Routing(pair_of_row, starts[: num_experts + 1], tokens, starts[num_experts + 1 :], row_of_pair, token_of_row)


def routing_by_torch_ops(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """The route kernel's four outputs (``routing_of``) from torch ops, on any device and any
    number of pairs."""
    tokens, pairs = top_k_index.shape[0], top_k_index.numel()
    # Slot-major pairs, so that a stable sort by expert orders each expert's pairs by slot,
    # then by token. Clamping to [-1, E + 1] and taking the remainder modulo E + 2 keeps E
    # and sends every index outside [0, E] to E + 1.
    expert = top_k_index.t().reshape(-1).clamp(-1, num_experts + 1).remainder(num_experts + 2)
    sorted_expert, pair_of_row = torch.sort(expert, stable=True)
    boundaries = torch.arange(num_experts + 2, dtype=sorted_expert.dtype, device=sorted_expert.device)
    starts = torch.searchsorted(sorted_expert, boundaries)
    row_of_pair = torch.empty_like(pair_of_row)
    row_of_pair[pair_of_row] = torch.arange(pairs, device=row_of_pair.device)
    return pair_of_row, row_of_pair, pair_of_row % tokens, starts


def combine(
    expert_rows: torch.Tensor,
    routing: Routing,
    top_k_weights: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[T, H]`` in ``dtype``: each token's rows of ``expert_rows [T * k, H]`` times their routing
    weights, summed in ascending expert order; rows that went to no expert add nothing (they
    may hold anything, even NaN)."""
    combined = combine_experts if combined_by_kernel(expert_rows, top_k_weights, dtype) else combine_by_torch_ops
    return combined(expert_rows, routing.row_of_pair, routing.expert_offsets[-1:], top_k_weights, dtype)


def combined_by_kernel(expert_rows: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``combine`` runs the combine kernel (CUDA, its dtypes, rows of unit column stride:
    ``kernels.ops.combine_experts``)."""
    return (
        HAS_TRITON
        and expert_rows.is_cuda
        and {dtype, expert_rows.dtype, top_k_weights.dtype} <= COMBINED_DTYPES
        and expert_rows.stride(-1) == 1
    )


def combine_by_torch_ops(
    expert_rows: torch.Tensor,
    row_of_pair: torch.Tensor,
    routed_end: torch.Tensor,
    top_k_weights: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``combine`` in torch ops, on any device: ``routed_end`` (one element) is the first row that
    went to no expert."""
    tokens, top_k = top_k_weights.shape
    # Rows are sorted by expert (ties by slot), so each token's rows in ascending order are its
    # experts in ascending order, rows routed nowhere last.
    rows, slots = row_of_pair.reshape(top_k, tokens).t().sort(dim=1)
    weights = top_k_weights.gather(1, slots)
    contributions = (expert_rows[rows] * weights[..., None]).to(dtype)
    contributions = torch.where((rows < routed_end)[..., None], contributions, 0)
    out = torch.zeros(tokens, expert_rows.shape[-1], dtype=dtype, device=expert_rows.device)
    for j in range(top_k):
        out = out + contributions[:, j]
    return out
