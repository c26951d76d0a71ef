"""Tokens to experts and back, as transformers' eager experts forward routes them.

``route`` sorts the (token, slot) pairs of ``top_k_index [T, k]`` into rows grouped by expert, in
the order transformers' loop gives each expert its tokens (by slot, then by token), so each
expert's linear sees exactly the rows it sees there. ``combine`` adds each token's weighted
expert outputs in ascending expert order, the order of transformers' ``index_add_`` over experts,
so the sums round as they do there. Both use only shape-static torch ops: a compiled forward does
not depend on how many tokens each expert gets.
"""

from typing import NamedTuple

import torch

__all__ = ["Routing", "route", "combine"]


class Routing(NamedTuple):
    """Rows of the experts' GEMMs.

    Attributes:
        pair_of_row: ``[T * k]``: row ``r`` holds the pair ``t * k + j`` (token ``t``, slot ``j``).
        expert_offsets: ``[E + 1]`` int64: expert ``e`` owns rows ``expert_offsets[e]`` to
            ``expert_offsets[e + 1]``; rows from ``expert_offsets[E]`` on go to no expert.
    """

    pair_of_row: torch.Tensor
    expert_offsets: torch.Tensor

    def token_of_row(self, top_k: int) -> torch.Tensor:
        return torch.div(self.pair_of_row, top_k, rounding_mode="floor")


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Group the pairs of ``top_k_index [T, k]`` by expert (an index outside ``[0, E)``: by no
    expert, after all the others)."""
    tokens, top_k = top_k_index.shape
    pairs = tokens * top_k
    expert = top_k_index.reshape(-1).to(torch.int64)
    expert = torch.where((expert >= 0) & (expert < num_experts), expert, num_experts)
    pair = torch.arange(pairs, device=expert.device)
    slot, token = pair % top_k, torch.div(pair, top_k, rounding_mode="floor")
    pair_of_row = torch.argsort(expert * pairs + slot * tokens + token)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    expert_offsets = torch.cat((counts.new_zeros(1), counts[:num_experts].cumsum(0)))
    return Routing(pair_of_row, expert_offsets)


def combine(
    expert_rows: torch.Tensor,
    routing: Routing,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[T, H]`` in ``dtype``: each token's rows of ``expert_rows [T * k, H]`` times their routing
    weights, summed in ascending expert order; rows that went to no expert add nothing (they
    may hold anything, even NaN)."""
    tokens, top_k = top_k_index.shape
    row_of_pair = torch.empty_like(routing.pair_of_row)
    row_of_pair[routing.pair_of_row] = torch.arange(tokens * top_k, device=row_of_pair.device)
    slots_by_expert = torch.argsort(top_k_index, dim=1, stable=True)
    pairs = torch.arange(tokens, device=top_k_index.device)[:, None] * top_k + slots_by_expert
    rows = row_of_pair[pairs]
    experts = top_k_index.gather(1, slots_by_expert)
    weights = top_k_weights.gather(1, slots_by_expert)
    out = torch.zeros(tokens, expert_rows.shape[-1], dtype=dtype, device=expert_rows.device)
    for j in range(top_k):
        contribution = (expert_rows[rows[:, j]] * weights[:, j, None]).to(dtype)
        routed = ((experts[:, j] >= 0) & (experts[:, j] < num_experts))[:, None]
        out = out + torch.where(routed, contribution, 0)
    return out
