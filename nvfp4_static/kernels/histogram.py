"""Per-block-amax histogram collection as one Triton pass over the activation.

Counts exactly what ``references.block_amax_histogram`` counts: a block amax ``v > 0`` lands in
bin ``#(edges <= v)`` against the same float32 edges, zero blocks are not counted, and the
literal max is the max block amax. Each program reads a tile of blocks once, keeps their amaxes
in registers, bins them (a log2 guess, then one comparison against the edge on each side, which
makes it exact), counts them with ``tl.histogram`` over a window of bins starting at the tile's
lowest, and adds the nonzero bins to the int64 counts (bins past the window one by one); the
tile's max goes in with one float atomic max. The atomics are relaxed (no fences: only the sums
matter). Nothing per block reaches memory.

The bin guess assumes log-spaced edges (``references.histogram_bin_edges``): it is then off by
at most one bin, next to an edge, which the comparisons fix.

``launch_block_amax_histogram`` is the CUDA kernel of the custom op
``nvfp4_static::collect_block_amax_histogram`` (``kernels.ops``).
"""

import torch
import triton
import triton.language as tl

from nvfp4_static.kernels.launch import ceil_div, next_power_of_2
from nvfp4_static.numerics import BLOCK_SIZE, check_dtype

# Blocks per program, as (rows, blocks along a row): 1024 blocks (32 KB of bf16) keep the
# atomics per counted bin to one per program; tuned on an H100 with a 4096 x 8192 bf16 input.
BLOCKS_PER_PROGRAM = 1024
MAX_BLOCKS_PER_ROW = 64
# 16 warps and a 64-bin window: 0.0389 ms against 0.0412 with 4 warps and 128 bins, the best of
# 108 configs (blocks per program 512-4096, 32-128 blocks per row, windows 32-128, 4-16 warps)
# on an H100, 4096 x 8192 bf16, CUDA-graph timing; every config within 10% of it.
NUM_WARPS = 16
# Bins counted per program with tl.histogram: 10 octaves of the default 512 bins over 2^+-40.
WINDOW_BINS = 64


@triton.jit
def _approximate_log2(value):
    """``log2`` of a positive normal float to within 0.008: its exponent plus a quadratic fit of
    ``log2(1 + m)`` in the mantissa (a few integer and FMA ops instead of a libm call)."""
    bits = value.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) - 127).to(tl.float32)
    mantissa = (bits & 0x7FFFFF).to(tl.float32) * (1.0 / 8388608.0)
    return exponent + mantissa + 0.34657 * mantissa * (1.0 - mantissa)


@triton.jit
def _bin_index(value, edges_ptr, num_edges):
    """``#(edges <= value)`` for ``value > 0``, as ``torch.searchsorted(edges, value, right=True)``."""
    log2_first = _approximate_log2(tl.load(edges_ptr))
    log2_span = _approximate_log2(tl.load(edges_ptr + num_edges - 1)) - log2_first
    bins_per_log2 = (num_edges - 1) / tl.where(log2_span > 0.0, log2_span, 1.0)
    guess = (_approximate_log2(value) - log2_first) * bins_per_log2 + 1.0
    index = tl.minimum(tl.maximum(guess, 0.0), num_edges * 1.0).to(tl.int32)
    has_lower = index > 0
    has_upper = index < num_edges
    lower_edge = tl.load(edges_ptr + index - 1, mask=has_lower, other=0.0)
    upper_edge = tl.load(edges_ptr + index, mask=has_upper, other=0.0)
    too_high = has_lower & (lower_edge > value)
    too_low = has_upper & (upper_edge <= value)
    return index - too_high.to(tl.int32) + too_low.to(tl.int32)


@triton.jit
def _block_amax_propagating_nan(x):
    """Per-row (16-wide block) max of ``|x|`` as float32, NaN if the block holds one.

    Works on the bit patterns: with the sign cleared, a float's bits order like its magnitude
    as an integer, NaN above Inf above every finite value. So one integer max per element does
    what a float conversion, ``abs``, ``max`` and a separate NaN test did, and only the block's
    winner is converted.
    """
    if x.dtype.primitive_bitwidth == 16:
        # tl.max widens 16-bit integers; narrowing back is exact (the bits are non-negative).
        winner_bits = tl.max(x.to(tl.int16, bitcast=True) & 0x7FFF, axis=1).to(tl.int16)
    else:
        winner_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    return winner_bits.to(x.dtype, bitcast=True).to(tl.float32)


@triton.jit
def _block_amax_histogram_kernel(
    x_ptr,
    n_rows,
    n_cols,
    row_stride,
    edges_ptr,
    num_edges,
    counts_ptr,
    amax_ptr,
    ROWS: tl.constexpr,
    BLOCKS_PER_ROW: tl.constexpr,
    WINDOW: tl.constexpr,
):
    tile = tl.arange(0, ROWS * BLOCKS_PER_ROW)
    rows = tl.program_id(0) * ROWS + tile // BLOCKS_PER_ROW
    block_cols = (tl.program_id(1) * BLOCKS_PER_ROW + tile % BLOCKS_PER_ROW) * 16
    cols = block_cols[:, None] + tl.arange(0, 16)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)  # a ragged last block reads as zeros
    # Read once and never again: don't let the stream displace what L2 holds for others.
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * row_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first"
    )
    block_amax = _block_amax_propagating_nan(x)
    # tl.max on floats drops NaN; the observer detects a bad batch by a non-finite running max,
    # so a NaN block amax must win here (it does as a bit pattern, see above).
    tile_max = tl.max(block_amax.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    tl.atomic_max(amax_ptr, tile_max, sem="relaxed")
    counted = block_amax > 0.0
    bins = _bin_index(tl.where(counted, block_amax, 1.0), edges_ptr, num_edges)
    # The tile's amaxes usually span a few octaves: count a window of WINDOW bins from the
    # lowest (tl.histogram's cost grows with its bins), and add the rare bins past it one by one.
    lowest = tl.min(tl.where(counted, bins, num_edges))
    in_window = counted & (bins - lowest < WINDOW)
    local_counts = tl.histogram(bins - lowest, WINDOW, mask=in_window)
    window = lowest + tl.arange(0, WINDOW)
    tl.atomic_add(
        counts_ptr + window,
        local_counts.to(tl.int64),
        mask=(window <= num_edges) & (local_counts > 0),
        sem="relaxed",
    )
    tl.atomic_add(
        counts_ptr + bins, tl.full(bins.shape, 1, tl.int64), mask=counted & ~in_window, sem="relaxed"
    )


def launch_block_amax_histogram(
    x: torch.Tensor, counts: torch.Tensor, amax: torch.Tensor, bin_edges: torch.Tensor
) -> None:
    """Add ``x``'s block-amax histogram to ``counts`` and its max into ``amax``, in place."""
    check_dtype(x, "nvfp4_static.kernels.collect_block_amax_histogram: the activation")
    if counts.dtype != torch.int64 or counts.numel() != bin_edges.numel() + 1:
        raise ValueError(
            f"nvfp4_static.kernels.collect_block_amax_histogram: counts must be int64 with "
            f"len(bin_edges) + 1 = {bin_edges.numel() + 1} bins, got {counts.dtype} "
            f"{tuple(counts.shape)}"
        )
    if bin_edges.numel() == 0:
        raise ValueError(
            "nvfp4_static.kernels.collect_block_amax_histogram: needs at least one bin edge"
        )
    if bin_edges.device != x.device or bin_edges.dtype != torch.float32 or not bin_edges.is_contiguous():
        bin_edges = bin_edges.to(device=x.device, dtype=torch.float32).contiguous()
    n_cols = x.shape[-1] if x.ndim else 1
    x = x.reshape(-1, n_cols)
    if x.shape[1] and x.stride(1) != 1:
        x = x.contiguous()
    n_rows = x.shape[0]
    if n_rows == 0 or n_cols == 0:
        amax.clamp_(min=0.0)  # no blocks: the batch max is 0
        return
    blocks_per_row = min(MAX_BLOCKS_PER_ROW, next_power_of_2(ceil_div(n_cols, BLOCK_SIZE)))
    rows = min(BLOCKS_PER_PROGRAM // blocks_per_row, next_power_of_2(n_rows))
    grid = (ceil_div(n_rows, rows), ceil_div(ceil_div(n_cols, BLOCK_SIZE), blocks_per_row))
    _block_amax_histogram_kernel[grid](
        x,
        n_rows,
        n_cols,
        x.stride(0),
        bin_edges,
        bin_edges.numel(),
        counts,
        amax,
        ROWS=rows,
        BLOCKS_PER_ROW=blocks_per_row,
        WINDOW=min(WINDOW_BINS, next_power_of_2(bin_edges.numel() + 1)),
        num_warps=NUM_WARPS,
    )
