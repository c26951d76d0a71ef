"""A mixture-of-experts layer's routing and weighted sum, one Triton launch each, for eager calls.

``experts.routing`` routes tokens with about 25 shape-static torch ops (a sort, searchsorted,
gathers and a loop of adds); an eager decode step pays each op's host time in every layer, far
more than their GPU time. These two kernels give the same integers and the same rounded sums
as those ops, bit for bit:

- ``launch_route``: the stable sort of the ``T * k`` (token, slot) pairs by expert, as
  ``experts.routing.route`` sorts them (slot-major pairs, an index outside ``[0, E]`` taken as
  ``E + 1``). Up to ``SORTED_IN_ONE_PROGRAM`` pairs in one program: every pair's (expert, pair)
  key sorted in registers, the experts' first rows from a histogram of the experts. Above, a
  one-program sort takes longer than the torch ops, and the pairs go in chunks of
  ``ROUTE_CHUNK``, three launches: each chunk's pairs counted by expert; one program adding the
  counts up (each chunk's pairs of each expert in the chunks before it, and the experts' first
  rows); each chunk's pairs placed at their expert's first row plus those counts plus the
  chunk's earlier pairs of the same expert. Both give the same rows. ``MAX_ROUTED_PAIRS`` bounds
  the pairs routed here; longer batches take the torch ops.
- ``launch_combine``: each token's weighted expert rows summed in ascending row order (its
  experts in ascending order), each product rounded to the output dtype and each add rounded
  to it, as ``experts.routing.combine``'s torch ops round them (the products in fp32: exact for
  bf16 and fp16 operands, the one fp32 rounding of torch's own for an fp32 one).

Both are launched on CUDA tensors outside tracing, as prepared launches (``launch_prepared``:
Triton's own launch path costs tens of microseconds of host time), and on CPU tensors under
Triton's interpreter (the tests); a compiled graph keeps the torch ops, which Inductor fuses.
"""

import torch
import triton
import triton.language as tl

from nvfp4_static.kernels.launch import KernelCall, ceil_div, launch_prepared, next_power_of_2

__all__ = ["MAX_ROUTED_PAIRS", "COMBINED_DTYPES", "launch_route", "launch_combine"]

# Above this many (token, slot) pairs the torch ops route (the chunked route's counts are
# ``pairs / ROUTE_CHUNK`` rows of one program's sum).
MAX_ROUTED_PAIRS = 65536
# Up to this many pairs the route sorts them in one program (one launch), above in chunks.
SORTED_IN_ONE_PROGRAM = 512
# Pairs per program of the chunked route, and the rows of counts its sum adds per step.
ROUTE_CHUNK = 128
COUNT_ROWS_PER_STEP = 32
# Output and routing-weight dtypes whose products and sums the combine kernel rounds as torch.
COMBINED_DTYPES = frozenset((torch.bfloat16, torch.float16, torch.float32))
# Hidden columns per combine program.
HIDDEN_BLOCK = 256


@triton.jit
def _expert_of_pairs(index_ptr, stride_token, stride_slot, pairs, tokens, num_pairs, num_experts):
    """The expert of each pair ``p = slot * tokens + token``: its index, or ``num_experts + 1``
    for one outside ``[0, num_experts]``, or ``num_experts + 2`` for ``p`` past the pairs."""
    valid = pairs < num_pairs
    index = tl.load(index_ptr + (pairs % tokens) * stride_token + (pairs // tokens) * stride_slot, mask=valid, other=0)
    expert = tl.where((index < 0) | (index > num_experts), num_experts + 1, index)
    return tl.where(valid, expert, num_experts + 2)


@triton.jit
def _route_kernel(
    index_ptr,
    stride_token,
    stride_slot,
    pair_of_row_ptr,
    row_of_pair_ptr,
    token_of_row_ptr,
    starts_ptr,
    tokens,
    num_pairs,
    num_experts,
    PAIRS: tl.constexpr,
    BINS: tl.constexpr,
):
    """One program: the pairs ``p = slot * tokens + token`` sorted by (expert, p), an index
    outside ``[0, num_experts]`` taken as expert ``num_experts + 1``: ``pair_of_row`` (the pair
    at each row), its inverse ``row_of_pair``, ``token_of_row``, and ``starts[e]`` for ``e`` in
    ``0..E+1``, the pairs of an expert below ``e``. ``PAIRS`` (a power of 2, at least
    ``num_pairs``) and ``BINS`` (a power of 2, above ``E + 2``) size the blocks."""
    pairs = tl.arange(0, PAIRS)
    # The padding's expert sorts past every pair, in a bin of its own.
    expert = _expert_of_pairs(index_ptr, stride_token, stride_slot, pairs, tokens, num_pairs, num_experts).to(tl.int64)
    # Distinct keys, so the sort's order is (expert, p) whatever its algorithm.
    pair_at_row = tl.sort(expert * PAIRS + pairs) % PAIRS
    rows = tl.arange(0, PAIRS)
    routed = rows < num_pairs  # the padding sorts after every pair
    tl.store(pair_of_row_ptr + rows, pair_at_row, mask=routed)
    tl.store(token_of_row_ptr + rows, pair_at_row % tokens, mask=routed)
    tl.store(row_of_pair_ptr + pair_at_row, rows.to(tl.int64), mask=routed)
    counts = tl.histogram(expert.to(tl.int32), BINS).to(tl.int64)
    bins = tl.arange(0, BINS)
    tl.store(starts_ptr + bins, tl.cumsum(counts, axis=0) - counts, mask=bins < num_experts + 2)


@triton.jit
def _route_count_kernel(
    index_ptr, stride_token, stride_slot, counts_ptr, tokens, num_pairs, num_experts,
    CHUNK: tl.constexpr, BINS: tl.constexpr,
):
    """Row ``c`` of ``counts``: chunk ``c``'s pairs (``CHUNK`` from ``c * CHUNK``) by expert."""
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = _expert_of_pairs(index_ptr, stride_token, stride_slot, pairs, tokens, num_pairs, num_experts)
    tl.store(counts_ptr + chunk * BINS + tl.arange(0, BINS), tl.histogram(expert.to(tl.int32), BINS))


@triton.jit
def _route_sum_kernel(counts_ptr, starts_ptr, chunks, num_experts, BINS: tl.constexpr, ROWS: tl.constexpr):
    """One program: each chunk's row of ``counts`` replaced by the pairs of each expert in the
    chunks before it, and ``starts[e]`` for ``e`` in ``0..E+1``, the pairs of an expert below
    ``e``, from every chunk's. ``ROWS`` rows per step."""
    bins = tl.arange(0, BINS)
    before = tl.zeros([BINS], tl.int32)
    for first in range(0, chunks, ROWS):
        rows = first + tl.arange(0, ROWS)
        offsets = rows[:, None] * BINS + bins[None, :]
        in_chunks = tl.broadcast_to((rows < chunks)[:, None], (ROWS, BINS))
        counts = tl.load(counts_ptr + offsets, mask=in_chunks, other=0)
        tl.store(counts_ptr + offsets, tl.cumsum(counts, axis=0) - counts + before[None, :], mask=in_chunks)
        before += tl.sum(counts, axis=0)
    totals = before.to(tl.int64)
    tl.store(starts_ptr + bins, tl.cumsum(totals, axis=0) - totals, mask=bins < num_experts + 2)


@triton.jit
def _route_place_kernel(
    index_ptr, stride_token, stride_slot, before_ptr, starts_ptr, pair_of_row_ptr, row_of_pair_ptr, token_of_row_ptr,
    tokens, num_pairs, num_experts, CHUNK: tl.constexpr, BINS: tl.constexpr,
):
    """Chunk ``c``'s pairs at their rows: their expert's first row (``starts``), plus its pairs
    in the chunks before (``before``, row ``c``), plus its pairs earlier in this chunk."""
    chunk = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + local
    expert = _expert_of_pairs(index_ptr, stride_token, stride_slot, pairs, tokens, num_pairs, num_experts)
    bins = tl.arange(0, BINS)
    first_rows = tl.load(starts_ptr + bins, mask=bins < num_experts + 2, other=0)
    first_rows += tl.load(before_ptr + chunk * BINS + bins).to(tl.int64)
    earlier = tl.sum(((expert[:, None] == expert[None, :]) & (local[None, :] < local[:, None])).to(tl.int32), axis=1)
    rows = tl.gather(first_rows, expert.to(tl.int32), 0) + earlier
    routed = pairs < num_pairs
    tl.store(pair_of_row_ptr + rows, pairs.to(tl.int64), mask=routed)
    tl.store(token_of_row_ptr + rows, (pairs % tokens).to(tl.int64), mask=routed)
    tl.store(row_of_pair_ptr + pairs, rows, mask=routed)


def launch_route(
    top_k_index: torch.Tensor,
    num_experts: int,
    pair_of_row: torch.Tensor,
    row_of_pair: torch.Tensor,
    token_of_row: torch.Tensor,
    starts: torch.Tensor,
) -> None:
    """Fill ``pair_of_row``, ``row_of_pair`` and ``token_of_row`` (int64 ``[T * k]``) and
    ``starts`` (int64 ``[E + 2]``) for the integer ``top_k_index [T, k]``, at most
    ``MAX_ROUTED_PAIRS`` pairs: in one program up to ``SORTED_IN_ONE_PROGRAM``, else in chunks."""
    tokens, top_k = top_k_index.shape
    num_pairs = tokens * top_k
    if num_pairs > MAX_ROUTED_PAIRS:
        raise ValueError(f"nvfp4_static: the route kernel takes at most {MAX_ROUTED_PAIRS} pairs, got {num_pairs}")
    index = (top_k_index, top_k_index.stride(0), top_k_index.stride(1))
    routing = (pair_of_row, row_of_pair, token_of_row)
    sizes = (max(tokens, 1), num_pairs, num_experts)
    bins = next_power_of_2(num_experts + 3)
    device = top_k_index.device
    if num_pairs <= SORTED_IN_ONE_PROGRAM:
        # 8 warps past 1024 pairs, which only bench_route.py's one-program column sorts here.
        meta = dict(PAIRS=max(next_power_of_2(num_pairs), 16), BINS=bins, num_warps=4 if num_pairs <= 1024 else 8)
        launch_prepared(KernelCall(_route_kernel, (1,), (*index, *routing, starts, *sizes), meta), device)
        return
    chunks = ceil_div(num_pairs, ROUTE_CHUNK)
    counts = torch.empty(chunks, bins, dtype=torch.int32, device=device)
    chunked = dict(CHUNK=ROUTE_CHUNK, BINS=bins, num_warps=4)
    launch_prepared(KernelCall(_route_count_kernel, (chunks,), (*index, counts, *sizes), chunked), device)
    summed = dict(BINS=bins, ROWS=COUNT_ROWS_PER_STEP, num_warps=4)
    launch_prepared(KernelCall(_route_sum_kernel, (1,), (counts, starts, chunks, num_experts), summed), device)
    launch_prepared(KernelCall(_route_place_kernel, (chunks,), (*index, counts, starts, *routing, *sizes), chunked), device)


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype``, ties to even, as torch rounds. To bf16 by bit arithmetic
    (the top 16 bits after adding half an ulp, ties to the even one, NaN kept), so that the
    rounding is the same on the GPU and in Triton's interpreter, whose cast truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)
    return x.to(dtype)


@triton.jit
def _combine_kernel(
    rows_ptr,
    stride_row,
    row_of_pair_ptr,
    routed_end_ptr,
    weights_ptr,
    stride_weight_token,
    stride_weight_slot,
    out_ptr,
    stride_out,
    tokens,
    hidden,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One token's ``BLOCK_H`` output columns: its ``TOP_K`` expert rows in ascending order
    (rows from ``routed_end`` on went to no expert and add zero), each times its slot's weight
    rounded to the output dtype, added one by one with the output dtype's rounding."""
    token = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_hidden = columns < hidden
    slots = tl.arange(0, SLOTS)
    rows = tl.load(row_of_pair_ptr + slots * tokens + token, mask=slots < TOP_K, other=0)
    # Sort the slots by row: rows are distinct, so the keys row * SLOTS + slot are too, and the
    # slot comes back out of the key. Slots past TOP_K sort last.
    keys = tl.where(slots < TOP_K, rows * SLOTS + slots, tl.cast(2**62, tl.int64))
    keys = tl.sort(keys)
    routed_end = tl.load(routed_end_ptr)
    total = tl.zeros([BLOCK_H], tl.float32).to(out_ptr.dtype.element_ty)
    for j in tl.static_range(TOP_K):
        key = tl.sum(tl.where(slots == j, keys, 0))
        row, slot = key // SLOTS, key % SLOTS
        routed = (row + tl.zeros([BLOCK_H], tl.int64)) < routed_end
        weight = tl.load(weights_ptr + token * stride_weight_token + slot * stride_weight_slot)
        values = tl.load(rows_ptr + row * stride_row + columns, mask=in_hidden & routed, other=0.0)
        product = _rounded(values.to(tl.float32) * weight.to(tl.float32), out_ptr.dtype.element_ty)
        product = tl.where(routed, product, 0.0).to(out_ptr.dtype.element_ty)
        total = _rounded(total.to(tl.float32) + product.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out + columns, total, mask=in_hidden)


def launch_combine(
    expert_rows: torch.Tensor,
    row_of_pair: torch.Tensor,
    routed_end: torch.Tensor,
    top_k_weights: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write ``out [T, H]``: each token's rows of ``expert_rows [T * k, H]`` (``row_of_pair``
    int64 ``[T * k]``, slot-major pairs; rows from ``routed_end`` (one element) on add nothing)
    times their ``top_k_weights [T, k]``, summed in ascending row order. ``expert_rows``, the
    weights and ``out`` in ``COMBINED_DTYPES``; ``expert_rows`` and ``out`` with unit column
    stride."""
    tokens, top_k = top_k_weights.shape
    hidden = out.shape[1]
    if tokens == 0 or hidden == 0:
        return
    call = KernelCall(
        _combine_kernel,
        (tokens, ceil_div(hidden, HIDDEN_BLOCK)),
        (
            expert_rows,
            expert_rows.stride(0),
            row_of_pair,
            routed_end,
            top_k_weights,
            top_k_weights.stride(0),
            top_k_weights.stride(1),
            out,
            out.stride(0),
            tokens,
            hidden,
        ),
        dict(TOP_K=top_k, SLOTS=next_power_of_2(max(top_k, 2)), BLOCK_H=HIDDEN_BLOCK, num_warps=4),
    )
    launch_prepared(call, out.device)
