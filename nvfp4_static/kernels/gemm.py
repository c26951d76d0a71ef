"""The faithful NVFP4 GEMM for GPUs without FP4 tensor cores, in Triton.

``out = (A @ dequant(W)^T) * act_scale * weight_scale + bias``. ``A`` is the activation already
rounded onto the NVFP4 grid without its global scale (fp16 ``q * s_b``, block-deinterleaved, from
``ops.gemm_activation_operand``); ``W`` stays packed: E2M1 codes, two per byte, plus FP8
E4M3 block scales. Each weight tile is dequantized in registers to fp16 ``q * s_b`` (exact: E2M1
x E4M3 needs 5 significant bits), multiplied on the fp16 tensor cores with fp32 accumulation, and
the two global scales and the bias are applied in the epilogue. This equals a real FP4
tensor-core GEMM up to the order of the fp32 sums.

A byte holds an even-K element (low nibble) and the next odd one (high nibble), so each K tile
is two dots, ``A_even @ W_even^T + A_odd @ W_odd^T``: every thread then keeps its dequantized
values in K order without shuffles, which matters because at decode sizes the kernel's
instruction issue, not only memory, bounds the time. Wide tiles (``GemmConfig.mma_order``)
instead permute K within 32-element groups so that each thread's 4 packed bytes dequantize
straight into its wgmma operand registers, one dot per K tile, the activation operand written in
the same order. Small and mid-size batches may split K over several programs
(``GemmConfig.programs_per_sm``) and sum the fp32 partials in split order: eagerly in the GEMM
itself, by the last program to finish each tile (one launch; it counts arrivals in the stream's
``tile_counts``), in a traced graph as torch ops that apply the epilogue too, which Inductor
fuses into whatever reads the output (same sums, same output). Large batches
dequantize the weight once and hand the product to cuBLAS (``CublasAfterDequantize``); the
numerics are the same. There, when the caller knows the scale product on the host
(``output_scale``) and the output is bf16 or fp16, both operands take the output's dtype (``q *
s_b`` is exact in either) and cuBLAS applies the scale as its ``alpha`` and adds the bias before
its one rounding, so no fp32 product travels through memory. That is the eager route: a
traced weight has no host copy (a graph must read the scales from their tensors, as a checkpoint
loaded in place may change them), so a compiled graph takes the fp32 product and scales it in
torch ops that Inductor fuses into the output's reader. At M = 1 the kernel takes the raw
activation instead and quantizes it in its K loop (``GemmConfig.activation_rows``) with
``act_quantize``'s arithmetic, so no operand kernel runs before it; eager calls of 2-16 rows do
the same with that entry's tiles (``eager_quantizing_tiles``), where the table's entries, faster
on the GPU, take the operand kernel first.

On Hopper the tall and square tiles (``TALL_TILE``, ``SQUARE_TILE``) run as
``gemm_warp_specialized``'s Gluon kernel, and the decode tile (``DECODE_TILE``, 1-16 rows) as
``gemm_decode_warp_specialized``'s: the same products, with the loads and each multiplying
warpgroup's dequantization overlapped. At one row the decode tile also quantizes the row
itself where each of its programs runs one K split (``DECODE_TILE_AT_ONE_ROW``,
``decode_tile_for_one_row``).

This file holds the kernels, their launchers and the tile table; the ops that call them
(``nvfp4_gemm``, ``quantizing_nvfp4_gemm``) are registered in ``kernels.ops``.
"""

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from nvfp4_static.kernels import gemm_decode_warp_specialized, gemm_warp_specialized
from nvfp4_static.kernels.act_quantize import MMA_GROUP, in_mma_order, quantize_to_operand_halves
from nvfp4_static.kernels.e2m1_ptx import E2M1_BYTES_TO_FP16_PTX
from nvfp4_static.kernels.graph_capture import capture_id
from nvfp4_static.kernels.launch import KernelCall, ceil_div, next_power_of_2, runs_eagerly, splits_hold_k_tiles, traced
from nvfp4_static.numerics import BLOCK_SIZE, check_dtype

_E2M1_BYTES_TO_FP16_PTX = tl.constexpr(E2M1_BYTES_TO_FP16_PTX)


@triton.jit
def _e2m1_as_e4m3_fp16(nibbles):
    """The pure-Triton twin of the PTX above, one nibble per element (interpreter, pre-sm89)."""
    e4m3 = ((nibbles & 7) << 2) | ((nibbles & 8) << 4)
    return e4m3.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def dequantize_weight_tile(packed, scale_codes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr):
    """``[BLOCK_N, BLOCK_K / 2]`` packed codes + ``[BLOCK_N, BLOCK_K / 16]`` FP8 scale bytes -> the fp16
    ``q * s_b`` of the even-K (low nibble) and odd-K (high nibble) elements, each
    ``[BLOCK_N, BLOCK_K / 2]``: two tensors rather than one interleaved, so that no thread has to
    shuffle values into K order."""
    if PTX:
        low, high = tl.inline_asm_elementwise(
            _E2M1_BYTES_TO_FP16_PTX,
            "=r,=r,=r,=r,r",
            [packed],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        low = _e2m1_as_e4m3_fp16(packed & 0xF)
        high = _e2m1_as_e4m3_fp16(packed >> 4)
    # Undo the 2^-6 of the FP8 trick on the scale: s_b * 64 <= 28672 stays exact in fp16.
    scales = (scale_codes.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0)[:, :, None]
    even = tl.reshape(tl.reshape(low, (BLOCK_N, BLOCK_K // 16, 8)) * scales, (BLOCK_N, BLOCK_K // 2))
    odd = tl.reshape(tl.reshape(high, (BLOCK_N, BLOCK_K // 16, 8)) * scales, (BLOCK_N, BLOCK_K // 2))
    return even, odd


@triton.jit
def accumulate(acc, a, w, WEIGHT_AS_A: tl.constexpr):
    """``acc`` plus the product of an activation tile ``a`` and a weight tile ``w`` (both
    ``[rows, K]``): ``W @ A^T`` (``acc [BLOCK_N, BLOCK_M]``) where ``WEIGHT_AS_A``, else
    ``A @ W^T`` (``acc [BLOCK_M, BLOCK_N]``)."""
    if WEIGHT_AS_A:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def accumulate_halves(acc, a_even, a_odd, w_even, w_odd, WEIGHT_AS_A: tl.constexpr):
    """``acc`` plus the product of the activation and weight tiles given as their even-K and
    odd-K halves, one dot per half (see ``accumulate``)."""
    acc = accumulate(acc, a_even, w_even, WEIGHT_AS_A)
    return accumulate(acc, a_odd, w_odd, WEIGHT_AS_A)


@triton.jit
def dequantize_weight_tile_in_mma_order(
    packed, scale_codes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr
):
    """``dequantize_weight_tile``'s values as one ``[BLOCK_N, BLOCK_K]`` tile in the MMA order
    (``GemmConfig.mma_order``; ``BLOCK_K`` a multiple of 32). Byte ``4t + 2c + i`` of each 16 bytes
    holds elements ``8t + 4c + 2i`` (low nibble) and ``+ 1`` (high, h = 1); they go to positions
    ``16c + 8h + 2t + i``, which is where the wgmma's register operand wants the values of a
    thread that holds those 4 bytes: its 32-bit load feeds the PTX as it is, with no byte moves."""
    even, odd = dequantize_weight_tile(packed, scale_codes, BLOCK_N, BLOCK_K, PTX)
    return in_mma_order(even, odd, BLOCK_N, BLOCK_K)


@triton.jit
def spread_rows(rows, ROWS: tl.constexpr, SPREAD: tl.constexpr, WIDTH: tl.constexpr):
    """``[ROWS, WIDTH]`` -> ``[ROWS * SPREAD, WIDTH]`` with row r at r * SPREAD and zeros between."""
    if SPREAD == 1:
        return rows
    slot = tl.arange(0, SPREAD)
    spread = tl.where(slot[None, :, None] == 0, rows[:, None, :], 0.0)
    return tl.reshape(spread, (ROWS * SPREAD, WIDTH))


@triton.jit
def _nvfp4_gemm_kernel(
    a_ptr,
    w_ptr,
    w_scales_ptr,
    act_scale_ptr,
    weight_scale_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    tile_counts_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    stride_am: tl.constexpr,
    stride_om: tl.constexpr,
    split_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    SUM_SPLITS: tl.constexpr,
    GROUP_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PTX: tl.constexpr,
    WEIGHT_AS_A: tl.constexpr,
    QUANTIZE_ROWS: tl.constexpr,
    MMA_ORDER: tl.constexpr,
):
    # Grouped tile order: when M spans several tiles, GROUP_N weight tiles sweep over all
    # activation tiles together, so the weight tiles stay in L2 while the activation streams by.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Activation rows per tile: BLOCK_M, or QUANTIZE_ROWS spread over the MMA's BLOCK_M rows
    # (row r of a tile on MMA row r * SPREAD, zeros between), so that a decode tile quantizes
    # only its real rows rather than all BLOCK_M.
    ROWS: tl.constexpr = QUANTIZE_ROWS if QUANTIZE_ROWS > 0 else BLOCK_M
    SPREAD: tl.constexpr = BLOCK_M // ROWS
    tiles_m = tl.cdiv(M, ROWS)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_N * tiles_m)
    first_n = group * GROUP_N
    group_size = tl.minimum(tiles_n - first_n, GROUP_N)
    pid_n = first_n + (pid % (GROUP_N * tiles_m)) % group_size
    pid_m = (pid % (GROUP_N * tiles_m)) // group_size

    mma_rows = tl.arange(0, BLOCK_M)
    offs_m = pid_m * ROWS + mma_rows // SPREAD
    valid_m = (mma_rows % SPREAD == 0) & (offs_m < M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(tiles_k, split_k)
    k_first = pid_k * tiles_per_split
    k_last = tl.minimum(k_first + tiles_per_split, tiles_k)
    # No split is empty (split_k_for). Said here, the loop has no zero-trip path, whose zeroed
    # accumulator would make ptxas serialize the wgmmas with the dequantization between them.
    tl.assume(k_last > k_first)

    # WEIGHT_AS_A computes the transposed tile, W @ A^T: the dequantized weight is then the
    # MMA's first operand, which Hopper's wgmma reads straight from registers.
    if WEIGHT_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QUANTIZE_ROWS > 0:
        act_scale = tl.load(act_scale_ptr)
        rows_x = (pid_m * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    for k_tile in range(k_first, k_last):
        offs_half = tl.arange(0, BLOCK_K // 2)
        offs_kb = k_tile * (BLOCK_K // 2) + offs_half
        offs_ks = k_tile * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        if QUANTIZE_ROWS > 0:
            # a_ptr is the raw activation: quantize this tile's rows here (whole 16-blocks, so
            # a masked tail quantizes to zeros) and spread them onto the MMA rows.
            offs_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(
                a_ptr + rows_x[:, None] * stride_am + offs_k[None, :],
                mask=(rows_x[:, None] < M) & ((offs_k[None, :] < K) | EVEN_K),
                other=0.0,
            )
            a_even, a_odd = quantize_to_operand_halves(x, act_scale, ROWS, BLOCK_K)
            if MMA_ORDER:
                a = spread_rows(in_mma_order(a_even, a_odd, ROWS, BLOCK_K), ROWS, SPREAD, BLOCK_K).to(tl.float16)
            else:
                a_even = spread_rows(a_even, ROWS, SPREAD, BLOCK_K // 2).to(tl.float16)
                a_odd = spread_rows(a_odd, ROWS, SPREAD, BLOCK_K // 2).to(tl.float16)
        elif MMA_ORDER:
            # The activation operand is stored in the MMA order, the weight tile's below.
            offs_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
            a_mask = valid_m[:, None] & ((offs_k[None, :] < K) | EVEN_K)
            a = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_k[None, :], mask=a_mask, other=0.0)
        else:
            # The activation operand is stored block-deinterleaved (each 16-block: its 8 even
            # elements, then its 8 odd ones), so the even and odd halves load as 16-byte runs.
            offs_even = k_tile * BLOCK_K + (offs_half // 8) * 16 + offs_half % 8
            a_mask = valid_m[:, None] & ((offs_even[None, :] < K) | EVEN_K)
            a_even = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_even[None, :], mask=a_mask, other=0.0)
            a_odd = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_even[None, :] + 8, mask=a_mask, other=0.0)
        packed = tl.load(
            w_ptr + rows_n[:, None] * (K // 2) + offs_kb[None, :],
            mask=(offs_n[:, None] < N) & ((offs_kb[None, :] < K // 2) | EVEN_K),
            other=0,
        )
        scale_codes = tl.load(
            w_scales_ptr + rows_n[:, None] * (K // 16) + offs_ks[None, :],
            mask=(offs_n[:, None] < N) & ((offs_ks[None, :] < K // 16) | EVEN_K),
            other=0,
        )
        if MMA_ORDER:
            w = dequantize_weight_tile_in_mma_order(packed, scale_codes, BLOCK_N, BLOCK_K, PTX)
            acc = accumulate(acc, a, w, WEIGHT_AS_A)
        else:
            w_even, w_odd = dequantize_weight_tile(packed, scale_codes, BLOCK_N, BLOCK_K, PTX)
            acc = accumulate_halves(acc, a_even, a_odd, w_even, w_odd, WEIGHT_AS_A)

    # Output coordinates of each accumulator element, in either orientation.
    if WEIGHT_AS_A:
        m_index = rows_m[None, :]
        n_index = offs_n[:, None]
        out_mask = valid_m[None, :] & (n_index < N)
    else:
        m_index = rows_m[:, None]
        n_index = offs_n[None, :]
        out_mask = valid_m[:, None] & (n_index < N)
    if not WRITE_PARTIALS:
        acc = scaled_and_biased(acc, act_scale_ptr, weight_scale_ptr, bias_ptr, n_index, N, HAS_BIAS)
        tl.store(out_ptr + m_index * stride_om + n_index, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(partials_ptr + (pid_k * M + m_index) * N + n_index, acc, mask=out_mask)
        if SUM_SPLITS:
            # The program that stores a tile's last split sums them all, in split order as
            # _epilogue_kernel does (the same result bit for bit), and applies the epilogue, so
            # no second kernel runs. Its count of arrived splits, zero before the launch, is
            # left zero for the next one. Every thread's partials are stored before the count
            # goes up (the barrier, then a release) and read after it is seen complete (an
            # acquire), from L2 (.cg), where other SMs' stores land.
            tl.debug_barrier()
            arrived = tl.atomic_add(tile_counts_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = tl.zeros_like(acc)
                for split in range(split_k):
                    total += tl.load(
                        partials_ptr + (split * M + m_index) * N + n_index,
                        mask=out_mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                total = scaled_and_biased(total, act_scale_ptr, weight_scale_ptr, bias_ptr, n_index, N, HAS_BIAS)
                tl.store(out_ptr + m_index * stride_om + n_index, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.store(tile_counts_ptr + pid, 0)


@triton.jit
def scaled_and_biased(acc, act_scale_ptr, weight_scale_ptr, bias_ptr, n_index, N, HAS_BIAS: tl.constexpr):
    """The GEMM's epilogue on the fp32 product ``acc``: both global scales, then the bias of
    each element's output column ``n_index``."""
    acc = acc * (tl.load(act_scale_ptr) * tl.load(weight_scale_ptr))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_index, mask=n_index < N, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _epilogue_kernel(
    partials_ptr,
    act_scale_ptr,
    weight_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N: tl.constexpr,
    stride_om: tl.constexpr,
    split_k,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Sum the fp32 partial products over the K splits (or take the one product), then the
    GEMM's epilogue: both global scales, the bias, the cast to the output dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(split_k):
        acc += tl.load(partials_ptr + split * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    acc = scaled_and_biased(acc, act_scale_ptr, weight_scale_ptr, bias_ptr, n, N, HAS_BIAS)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_weight_kernel(
    w_ptr,
    w_scales_ptr,
    out_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PTX: tl.constexpr,
):
    """The packed weight as ``q * s_b`` ``[N, K]`` in ``out``'s dtype (fp16 or bf16: exact in
    both), block-deinterleaved like the activation operand (the product does not depend on the
    order of K, only on both operands sharing it)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = offs_n.to(tl.int64)
    offs_half = tl.arange(0, BLOCK_K // 2)
    offs_kb = tl.program_id(1) * (BLOCK_K // 2) + offs_half
    offs_ks = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    packed = tl.load(
        w_ptr + rows_n[:, None] * (K // 2) + offs_kb[None, :],
        mask=(offs_n[:, None] < N) & (offs_kb[None, :] < K // 2),
        other=0,
    )
    scale_codes = tl.load(
        w_scales_ptr + rows_n[:, None] * (K // 16) + offs_ks[None, :],
        mask=(offs_n[:, None] < N) & (offs_ks[None, :] < K // 16),
        other=0,
    )
    even, odd = dequantize_weight_tile(packed, scale_codes, BLOCK_N, BLOCK_K, PTX)
    offs_even = tl.program_id(1) * BLOCK_K + (offs_half // 8) * 16 + offs_half % 8
    mask = (offs_n[:, None] < N) & (offs_even[None, :] < K)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows_n[:, None] * K + offs_even[None, :], even.to(out_dtype), mask=mask)
    tl.store(out_ptr + rows_n[:, None] * K + offs_even[None, :] + 8, odd.to(out_dtype), mask=mask)


@dataclass(frozen=True)
class GemmConfig:
    """One tile shape and launch setting.

    ``programs_per_sm > 0`` splits K into as many parts as keep the grid within that many
    programs per SM (a decode GEMM has few output tiles, and streaming the weight at full
    bandwidth needs many loads in flight, as does a mid-size GEMM whose N spans few column tiles)
    when M spans ``row_tiles_for_split`` row tiles (``split_k_for``). The split is fixed per
    entry, not a function of M (a graph compiled for a dynamic M launches each bucket's GEMM with
    one split), so where a bucket spans several row tiles its grid grows with M around the
    planned size; each split's partial products
    cover all M rows (``[split, M, N]`` fp32, allocated per call) and each tile counts its arrived
    splits in ``tile_counts``. ``weight_as_mma_a`` computes each tile transposed (``W @ A^T``), so
    that the dequantized weight feeds the tensor cores from registers rather than shared memory.
    ``activation_rows > 0`` hands the GEMM the raw activation: each program quantizes that many
    rows of it (its tile) in its K loop, so a decode linear needs no activation kernel (one
    launch fewer, and no operand round trip); ``block_m`` is then the MMA's row count.
    ``fill_programs_per_sm`` (above ``programs_per_sm``, no more than an SM holds at once) lets
    the split grow to that many programs per SM where its grid fills more of those slots than
    the planned one fills of its own (``split_k_for``).
    ``mma_order`` permutes K within each 32-element group into the order in which the wgmma's
    register operand takes the dequantized weight (``dequantize_weight_tile_in_mma_order``), the
    activation operand stored in the same order (``ops.gemm_activation_operand(...,
    mma_order=True)``) or, with ``activation_rows``, quantized into it in the K loop: each thread
    then dequantizes 4 contiguous packed bytes straight into its operand registers, and each K
    tile takes one dot rather than one per even/odd half (whose MMAs run as two groups, the first
    waited on before the second starts). It needs K to be a multiple of 32; on other K the same
    tiles run without it (``config_for_width``).
    ``warp_specialized`` runs the tile, where the GPU and the call's tensors allow, as
    ``gemm_warp_specialized``'s kernel or, at 16 rows, ``gemm_decode_warp_specialized``'s
    (Hopper, Gluon): the same product bit for bit, with the loads and each multiplying
    warpgroup's dequantization overlapped; only the tiles those kernels implement
    (``WARP_SPECIALIZED_TILES_IN_TRITON``) may ask for it.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_n: int = 8
    programs_per_sm: int = 0
    weight_as_mma_a: bool = False
    activation_rows: int = 0
    mma_order: bool = False
    row_tiles_for_split: int = 1
    fill_programs_per_sm: int = 0
    warp_specialized: bool = False

    def __post_init__(self):
        if self.row_tiles_for_split < 1 or (self.row_tiles_for_split > 1 and not self.programs_per_sm):
            raise ValueError(
                f"nvfp4_static: GemmConfig.row_tiles_for_split sizes the K split: at least 1, and above 1 only "
                f"with programs_per_sm > 0; got {self.row_tiles_for_split} with programs_per_sm = "
                f"{self.programs_per_sm}"
            )
        if self.fill_programs_per_sm and not 0 < self.programs_per_sm < self.fill_programs_per_sm:
            raise ValueError(
                f"nvfp4_static: GemmConfig.fill_programs_per_sm lets a K split grow past programs_per_sm: "
                f"0, or above programs_per_sm = {self.programs_per_sm} > 0; got {self.fill_programs_per_sm}"
            )
        rows = self.activation_rows
        if rows < 0 or (rows and (rows & (rows - 1) or self.block_m % rows)):
            raise ValueError(
                f"nvfp4_static: GemmConfig.activation_rows must be 0 or a power of 2 dividing "
                f"block_m = {self.block_m}, got {rows}"
            )
        if self.warp_specialized and not self._warp_specialized_tile():
            raise ValueError(
                f"nvfp4_static: GemmConfig.warp_specialized runs gemm_warp_specialized's kernel (or, at 16 rows, "
                f"gemm_decode_warp_specialized's), whose tiles are {WARP_SPECIALIZED_TILES_IN_TRITON}, the wide "
                f"ones also with a K split for one program per SM, the decode one also quantizing one activation "
                f"row; got {replace(self, warp_specialized=False)}"
            )
        if self.mma_order and self.block_k % MMA_GROUP:
            raise ValueError(
                f"nvfp4_static: GemmConfig.mma_order permutes K within whole 32-element groups, so "
                f"block_k must be a multiple of 32; got {self.block_k}"
            )

    def _warp_specialized_tile(self) -> bool:
        """Whether a warp-specialized kernel computes these tiles: one of
        ``WARP_SPECIALIZED_TILES_IN_TRITON``, the decode one also quantizing one activation row,
        or a wide one with its K split for one program per SM."""
        plain = replace(self, warp_specialized=False)
        if plain in WARP_SPECIALIZED_TILES_IN_TRITON or plain == replace(DECODE_TILE_IN_TRITON, activation_rows=1):
            return True
        if self.programs_per_sm != 1 or self.fill_programs_per_sm:
            return False
        unsplit = replace(plain, programs_per_sm=0, row_tiles_for_split=1)
        return unsplit in (TALL_TILE_IN_TRITON, SQUARE_TILE_IN_TRITON)

    @property
    def rows_per_tile(self) -> int:
        """Activation rows one program covers: its quantized rows, else the MMA's."""
        return self.activation_rows or self.block_m


# The tiles the warp-specialized kernels compute, as the Triton kernel runs them:
# gemm_warp_specialized's two warpgroups of 64 weight rows by 256 activation rows (tall) or 128
# (square), and gemm_decode_warp_specialized's 16 rows, whose program holds four of the Triton
# tile's 64-row programs (its K split is theirs at four per SM: one program per SM).
WARP_SPECIALIZED_TILES_IN_TRITON = tuple(
    GemmConfig(
        tokens,
        gemm_warp_specialized.WEIGHT_ROWS_PER_TILE,
        gemm_warp_specialized.BLOCK_K,
        8,
        3,
        weight_as_mma_a=True,
        mma_order=True,
    )
    for tokens in gemm_warp_specialized.TOKENS_PER_TILE
) + (
    GemmConfig(
        gemm_decode_warp_specialized.TOKENS,
        gemm_warp_specialized.ROWS_PER_CONSUMER,
        gemm_decode_warp_specialized.BLOCK_K,
        4,
        4,
        programs_per_sm=gemm_decode_warp_specialized.CONSUMERS,
        weight_as_mma_a=True,
        mma_order=True,
    ),
)
TALL_TILE_IN_TRITON, SQUARE_TILE_IN_TRITON, DECODE_TILE_IN_TRITON = WARP_SPECIALIZED_TILES_IN_TRITON


@dataclass(frozen=True)
class CublasAfterDequantize:
    """Large M: dequantize the whole weight once (``block_n x block_k`` tiles), then a cuBLAS
    GEMM: with the scale and bias as its alpha and bias where ``fuses_epilogue_into_cublas``,
    else fp16 with fp32 output and the epilogue kernel. At prefill sizes the in-register
    kernel re-dequantizes each weight tile for every M tile and its tensor cores wait on that;
    one extra pass over the weight (2 bytes per element written, read back by cuBLAS) is cheaper.

    The dequantization tile: 4 x 512 with 8 warps streams at 77% of copy bandwidth on an H200
    (0.053 ms for 8192 x 8192), best of a 64-config sweep on three weight shapes and 2.2x faster
    than 64 x 256 tiles with 4 warps (examples/benchmarks/RESULTS.md)."""

    block_n: int = 4
    block_k: int = 512
    num_warps: int = 8


# Keyed on the largest M each serves. Chosen with examples/benchmarks/tune_gemm.py on one H100
# 80GB HBM3 (torch 2.11, triton 3.6) over (K, N) = (8192, 8192), (4096, 14336), (14336, 4096),
# each by its worst shape (examples/benchmarks/RESULTS.md, "GEMM tile table"). At M = 1, tiles
# that quantize their one activation row themselves (no activation kernel) took 2%, 2% and 21%
# less time for the whole linear than the M <= 4 entry after the activation kernel; at M = 1-4,
# 16 x 64 x 256 tiles with K split took 7-14% less time than the M <= 16 entry on
# two shapes and 1-5% more on the third; at M = 16 the same tiles transposed in the MMA order
# (the weight rows the wgmma's 64-row side, the 16 activation rows its N) took 8-18% less time
# than untransposed 16 x 128 x 256 tiles on 4096 x 4096, 8192 x 8192 and 4096 x 14336, and the
# same on 14336 x 4096.
# From 17 rows the wide tiles in the MMA order, each dequantized weight tile shared by up to 128
# rows (2026-11-27, the K loop's wgmmas asynchronous as test_gemm_hopper_code.py checks), every
# one a single warpgroup of 64 weight rows with two or more programs per SM, which hide each
# other's dequantization better than one 8-warp program of 128 x 128 (whose two warpgroups wait
# for each other's MMAs at every K tile): at M = 17-32, 32 x 64 x 256 tiles ran at 1.48-1.74x
# bf16's speed (the untransposed 32 x 128 x 256 tiles 1.17-1.43x); at M = 33-64, 64 x 64 x 128
# tiles at 1.32-1.59x (64 x 128 x 128 ones 1.05-1.37x); at M = 128 128 x 64 x 128 tiles at
# 1.00-1.30x (8-warp 128 x 128 x 128 tiles 0.77-0.96x, 64 x 128 x 128 ones 0.84-1.04x), at
# M = 256 0.81-0.90x (0.76-0.83x), at M = 512 0.67-0.71x (0.64-0.65x). The split entries split
# K into as many parts as keep the grid within two programs per SM (``split_k_for``) over one row
# tile, the 129-256 one over two; from 257 rows unsplit. Up to 32 rows, where three programs fit
# on an SM, a weight whose split grid would leave many of the two-per-SM slots empty splits for
# three per SM instead (``fill_programs_per_sm``): 1.01-1.23x faster on the weights it changes at
# M = 1-32 (4096 x 6144, 4096 x 12288, 8192 x 10240), the others unchanged. From 513 rows cuBLAS
# after dequantizing.
# At 513-2048 rows on Hopper the warp-specialized tall tile takes cuBLAS's place where its programs
# fill the SMs from 513 rows (``wide_tile``; 4096 x 4096 at 513 rows, 96 programs on 132 SMs: as
# fast as cuBLAS's route): dequantizing each weight tile in registers once per 256 rows costs
# less there than writing the whole weight in fp16 and reading it back, and the activation
# operand is the same pass either way. The route with the tall tile against cuBLAS's (operand
# kernel, weight dequantization, cuBLAS), bf16 / ours on an H200 at M = 1024 / 2048
# (bench_warp_specialized.py): 8192 x 8192 0.79x / 0.95x -> 0.93x / 1.00x, 4096 x 14336 0.80x /
# 0.92x -> 0.84x / 0.95x, 14336 x 4096 0.74x / 0.90x -> 0.90x / 0.92x; at 4096 rows cuBLAS's
# route was as fast or faster (0.95x / 0.96x / 0.90x against 0.93x / 0.90x / 0.91x, a scratch
# probe; examples/benchmarks/RESULTS.md).
PREFILL_TALL_TILE_BUCKET = 2048
# Few buckets on purpose: a graph compiled for a dynamic M holds every bucket's kernels behind a
# cond (backends.triton_route), so each bucket adds compile time and host work per call.
GEMM_CONFIGS = (
    (1, GemmConfig(16, 128, 256, 4, 3, programs_per_sm=2, activation_rows=1, fill_programs_per_sm=3)),
    (4, GemmConfig(16, 64, 256, 4, 4, programs_per_sm=2, fill_programs_per_sm=3)),
    (16, GemmConfig(16, 64, 256, 4, 4, programs_per_sm=2, weight_as_mma_a=True, mma_order=True,
                    fill_programs_per_sm=3)),
    (32, GemmConfig(32, 64, 256, 4, 3, programs_per_sm=2, weight_as_mma_a=True, mma_order=True,
                    fill_programs_per_sm=3)),
    (64, GemmConfig(64, 64, 128, 4, 4, programs_per_sm=2, weight_as_mma_a=True, mma_order=True)),
    (128, GemmConfig(128, 64, 128, 4, 3, programs_per_sm=2, weight_as_mma_a=True, mma_order=True)),
    (256, GemmConfig(128, 64, 128, 4, 3, programs_per_sm=2, weight_as_mma_a=True, mma_order=True,
                     row_tiles_for_split=2)),
    (512, GemmConfig(128, 64, 128, 4, 3, weight_as_mma_a=True, mma_order=True)),
    (PREFILL_TALL_TILE_BUCKET, CublasAfterDequantize()),
    (None, CublasAfterDequantize()),
)
# Wide weights at 129-512 rows: one program per SM of 256 activation rows by 128 weight rows
# dequantizes each weight tile once per 256 rows, half as often as the entries above, and where
# its programs at the bucket's largest M fill most SMs that is faster (the Triton tile, 8 warps;
# H100, bf16 / ours):
# 8192 x 8192 at M = 384 0.55 -> 0.63x, 512 0.69 -> 0.83x; 4096 x 14336 at M = 200 0.75 -> 0.91x,
# 256 0.81 -> 0.98x, 512 0.69 -> 0.83x, M = 384 0.68 -> 0.61x (1.7 waves of half-empty row tiles).
# On Hopper it runs warp-specialized (gemm_warp_specialized; the same output): GPU time at
# M = 512 on an H200, 8192 x 8192 0.1141 -> 0.1012 ms (bf16 0.0957), 4096 x 14336 0.1149 ->
# 0.1049 (bf16 0.0935); examples/benchmarks/RESULTS.md. There its programs take 144 or 192 rows
# where that leaves them as many (M = 1-144 and 257-288, 145-192 and 289-384;
# ``gemm_warp_specialized.tokens_per_program``): operand kernel and GEMM, ms on an H200, 256 ->
# 192 rows per program, 8192 x 8192 at M = 300 / 384 0.1346 / 0.1023 -> 0.0834 / 0.0844, 4096 x
# 14336 at M = 384 0.1044 -> 0.0889; the whole route, 256 -> 192 -> 144 rows, 8192 x 8192 at
# M = 129 0.0754 -> 0.0557 -> 0.0507, 4096 x 14336 at M = 257 0.1389 -> 0.0838 -> 0.0781
# (bench_warp_specialized.py).
# Above 128 rows, where the tall programs leave SMs idle, the tall tile runs with K split for one
# program per SM where that fills them (``SPLIT_TALL_TILES``; warp-specialized only, its partial
# products summed by the epilogue kernel). Operand kernel, GEMM and split sum, ms on an H200
# (bench_warp_specialized.py), the square tile or its split -> the tall split (splits): 8192 x
# 8192 at M = 129 / 200 / 256 0.0852 / 0.0659 / 0.0664 -> 0.0557 / 0.0587 / 0.0605 (2; bf16
# 0.0486 / 0.0504 / 0.0540), 14336 x 4096 at M = 200 / 256 0.0635 / 0.0652 -> 0.0550 / 0.0577
# (4), at M = 384 / 512 0.1063 / 0.1110 -> 0.0808 / 0.0958 (2), 4096 x 4096 at M = 129 / 384
# 0.0316 / 0.0393 -> 0.0246 / 0.0357; it loses a little on 4096 x 4096 at M = 256 / 512 (0.0300
# / 0.0398 -> 0.0306 / 0.0410).
# Where neither fills them, and at 65-128 rows (where the tall programs would hold more rows than
# the bucket's), the square tile (128 activation rows) takes their place if its programs fill
# them, warp-specialized only (in Triton it is slower than the entries): operand kernel and GEMM,
# ms on an H200, entry -> square, 4096 x 14336 at M = 128 0.0422 -> 0.0401. Else the square tile
# with K split for one program per SM where that fills them (``SPLIT_SQUARE_TILES``), entry ->
# split square (splits): 8192 x 8192 at M = 100 / 128 0.0493 / 0.0492 -> 0.0431 / 0.0443 (2; bf16
# 0.0474 / 0.0470), 14336 x 4096 at M = 128 0.0475 -> 0.0419 (4), 4096 x 4096 at M = 128 0.0249
# -> 0.0229 (4). At a bucket's first rows, with 128 rows per program, it loses a little (8192 x
# 8192 at M = 65 0.0490 -> 0.0507); its programs take 80 rows there (M = 1-80, 129-160;
# ``gemm_warp_specialized.PROGRAM_TOKENS``): the whole route 0.0402 ms against bf16's 0.0453.
# N and K are fixed per layer, so the choice needs no guard in a compiled graph; the route
# prepares the operand of the tile the bucket runs (``operand_config``).
TALL_TILE = replace(TALL_TILE_IN_TRITON, warp_specialized=True)
SQUARE_TILE = replace(SQUARE_TILE_IN_TRITON, warp_specialized=True)
# Decode on Hopper: gemm_decode_warp_specialized's tile in place of the entries up to 16 rows,
# for weights whose split gives each program enough K tiles (its TMA ring needs a few K tiles to
# fill and drain). Whole linear on an H200 from a CUDA graph, M = 16, entry -> decode tile (ms,
# examples/benchmarks/RESULTS.md): 8192 x 8192 0.0302 -> 0.0238 (8 K tiles per split), 4096 x
# 28672 0.0486 -> 0.0342 (16), 28672 x 8192 0.0749 -> 0.0537 (28), 14336 x 4096 0.0289 -> 0.0255
# (7); 5120 x 5120 0.0196 -> 0.0188 (4), slower at 2 (4096 x 4096 0.0167 -> 0.0175).
DECODE_TILE = replace(DECODE_TILE_IN_TRITON, warp_specialized=True)
# At one row the decode tile may quantize its row itself, as the one-row entry it replaces does:
# its load warpgroup writes each stage's operand tile, so no operand kernel runs before it
# (``decode_tile_for_one_row``).
DECODE_TILE_AT_ONE_ROW = replace(DECODE_TILE, activation_rows=1)
DECODE_TILE_BUCKETS = (1, 4, 16)  # the largest M of the entries it may replace
# Called eagerly, the decode tile's launch costs more host time than an entry's (Triton encodes
# its three TMA descriptors at each launch) and an eager decode step is bound by its host, so
# eagerly it runs only where its GPU saving outweighs that: from 16 K tiles per split (H200, 8
# Llama-8B-shaped layers decoding eagerly, ms per step, from 6 K tiles -> from 16: 2 tokens
# 3.235 -> 2.595, 4 tokens 2.641 -> 2.072, 16 tokens 3.079 -> 2.513; fused siblings 3.409 ->
# 2.930, 2.545 -> 2.261, 3.431 -> 2.943; bench_eager_decode_rules.py).
DECODE_TILE_MIN_K_TILES = 16
# In a graph (traced, usually then replayed from a CUDA graph, or eager calls captured into one)
# no launch costs host time per call, and the decode tile runs from 6 K tiles per split, at one
# row where its programs also fill most SMs (H200, a compiled linear + add from a CUDA graph, M =
# 1, entry -> decode tile, ms, bench_compiled_decode.py: 8192 x 8192 0.0256 -> 0.0237, 4096 x
# 14336 0.0252 -> 0.0231, 14336 x 4096 0.0244 -> 0.0235, with 97%, 85% and 97% of the SMs given
# a program; 4096 x 12288, 73%: 0.0224 -> 0.0233, so below 80% it keeps the entry, whose split
# fills them). From the eager rule's 16 K tiles a graph takes it whatever the fill: the two rules
# then agree wherever the graphs' rule keeps the entry, as the ops traced inside a graph, which
# choose by the eager rule, must.
DECODE_TILE_MIN_K_TILES_IN_GRAPHS = 6
DECODE_TILE_SM_FILL_AT_ONE_ROW_IN_GRAPHS = 0.8
# Eager calls of 2-16 rows are bound by their host, where each replayed launch is most of a
# linear's host time: where the table's entry would run after the operand kernel (two launches),
# they take the one-row entry's tiles quantizing their rows in the GEMM (one launch; M rounded
# up to a power of 2 rows, ``eager_quantizing_tiles``), for a little more GPU time. H200, 8
# Llama-8B-shaped layers called eagerly, ms per step, two launches -> one (bf16 activations,
# bench_eager_decode_rules.py): 2 tokens 3.293 -> 2.595, 4 tokens 2.584 -> 2.072, 8 3.689 ->
# 2.967, 16 3.095 -> 2.513 (bf16 2.994, 2.361, 3.219, 2.809); the same steps' GPU time 1.083 ->
# 1.017, 1.098 -> 1.129, 1.134 -> 1.291, 1.123 -> 1.216. Graphs keep the table's entries.
EAGER_QUANTIZING_MAX_ROWS = 16
WIDE_TILES = {tile.block_m: tile for tile in (TALL_TILE, SQUARE_TILE)}  # by activation rows
WIDE_TILE_BUCKETS = (128, 256, 512)  # the largest M of the entries they may replace
# A wide tile takes over where its programs fill 70% of the SMs in one wave: a wave of 96
# programs on 132 SMs beats the next tile's 1.5 waves or the entry (H200, bench_warp_specialized.py,
# bf16 / ours): 4096 x 12288 at M = 200 / 256 the tall tile 0.80x / 0.79x against the square's
# 0.62x / 0.62x, at M = 100 / 128 the square tile 1.02x / 1.00x against the entry's 0.91x / 0.95x;
# 4096 x 6144 at M = 300-512 the tall tile 0.69-0.73x against the square's 0.48-0.58x.
# In percent: the route reads it inside torch.cond branches, where dynamo (torch 2.11) makes a
# module's float a graph input that it then fails to lift into the branch; an int stays a constant.
WIDE_TILE_SM_FILL_PERCENT = 70


def split_for_one_program_per_sm(tile: GemmConfig, max_m: int) -> GemmConfig:
    """``tile`` with its K split sized for one program per SM over the row tiles of ``max_m``
    rows (``split_k_for``)."""
    return replace(tile, programs_per_sm=1, row_tiles_for_split=ceil_div(max_m, tile.block_m))


# The wide tiles' split forms at each bucket they may serve (the tall one above 128 rows).
SPLIT_SQUARE_TILES = {max_m: split_for_one_program_per_sm(SQUARE_TILE, max_m) for max_m in WIDE_TILE_BUCKETS}
SPLIT_TALL_TILES = {
    max_m: split_for_one_program_per_sm(TALL_TILE, max_m) for max_m in WIDE_TILE_BUCKETS if max_m > SQUARE_TILE.block_m
}
EPILOGUE_BLOCK = 1024


def gemm_bucket(M: int) -> int:
    """The index in ``GEMM_CONFIGS`` of the entry serving ``M`` rows. Under tracing with a
    symbolic ``M`` this would be a guard on it; ``backends.triton_route`` branches with a cond instead
    and hands the ops each branch's index."""
    for index, (max_m, _) in enumerate(GEMM_CONFIGS):
        if max_m is None or M <= max_m:
            return index
    raise AssertionError("GEMM_CONFIGS ends with a catch-all entry")


def gemm_config(M: int) -> Union[GemmConfig, CublasAfterDequantize]:
    return GEMM_CONFIGS[gemm_bucket(M)][1]


def table_config(
    M, bucket: Optional[int], N: int, K: int, device: torch.device
) -> Union[GemmConfig, CublasAfterDequantize]:
    """The tiles for an ``[N, K]`` weight on ``device``: those of the entry ``bucket`` names,
    else of the one serving ``M``, as ``operand_config`` gives them (a decode or wide tile in
    the entry's place, at reduction width ``K``)."""
    return operand_config(gemm_bucket(M) if bucket is None else bucket, N, K, device)


def triton_entries() -> list[tuple[int, GemmConfig]]:
    """``(largest M, tiles)`` of every Triton tile the table runs: its Triton entries, then
    ``DECODE_TILE_AT_ONE_ROW`` at one row and ``DECODE_TILE`` at its largest bucket, ``TALL_TILE``,
    ``SQUARE_TILE`` and their split forms at each bucket they may serve."""
    entries = [(max_m, config) for max_m, config in GEMM_CONFIGS if isinstance(config, GemmConfig)]
    tall = [(max_m, tile) for max_m, split in SPLIT_TALL_TILES.items() for tile in (TALL_TILE, split)]
    square = [(max_m, tile) for max_m in WIDE_TILE_BUCKETS for tile in (SQUARE_TILE, SPLIT_SQUARE_TILES[max_m])]
    decode = [(1, DECODE_TILE_AT_ONE_ROW), (max(DECODE_TILE_BUCKETS), DECODE_TILE)]
    return entries + decode + tall + square


def wide_tile(max_m: Optional[int], N: int, K: int, device: torch.device) -> Optional[GemmConfig]:
    """The tile that replaces the table entry serving up to ``max_m`` rows for an ``[N, K]``
    weight, if any: in a bucket of ``WIDE_TILE_BUCKETS`` on a CUDA device (the interpreter runs
    the table's entries), ``TALL_TILE`` where its programs at ``max_m`` rows fill
    ``WIDE_TILE_SM_FILL_PERCENT`` of the SMs (above 128 rows: at fewer the square tile's
    programs are as many, with fewer rows each); else, where they run warp-specialized (on a
    Hopper GPU, K a multiple of 32: ``config_for_width``), the first whose programs fill them
    of: the tall tile's split form (``SPLIT_TALL_TILES``, above 128 rows), ``SQUARE_TILE``, its
    split form (``SPLIT_SQUARE_TILES``). In ``PREFILL_TALL_TILE_BUCKET``, in cuBLAS's place,
    ``TALL_TILE`` only where it runs warp-specialized and its programs fill the SMs from the
    bucket's first row (513)."""
    if max_m not in (*WIDE_TILE_BUCKETS, PREFILL_TALL_TILE_BUCKET) or device.type != "cuda":
        return None
    slots = WIDE_TILE_SM_FILL_PERCENT * _multiprocessor_count(device) / 100
    warp_specialized = not K % MMA_GROUP and gemm_warp_specialized.available(device)
    if max_m == PREFILL_TALL_TILE_BUCKET:
        # Its programs counted at the bucket's first row, where they are fewest.
        first_row = max(WIDE_TILE_BUCKETS) + 1
        fills = ceil_div(first_row, TALL_TILE.block_m) * ceil_div(N, TALL_TILE.block_n) >= slots
        return TALL_TILE if warp_specialized and fills else None
    tall_programs = ceil_div(max_m, TALL_TILE.block_m) * ceil_div(N, TALL_TILE.block_n)
    if max_m in SPLIT_TALL_TILES and tall_programs >= slots:
        return TALL_TILE
    if not warp_specialized:
        return None
    square_programs = ceil_div(max_m, SQUARE_TILE.block_m) * ceil_div(N, SQUARE_TILE.block_n)
    tall_split = [(tall_programs, SPLIT_TALL_TILES[max_m])] if max_m in SPLIT_TALL_TILES else []
    for programs, tile in tall_split + [(square_programs, SQUARE_TILE), (square_programs, SPLIT_SQUARE_TILES[max_m])]:
        if programs * split_k_for(tile, N, K, device) >= slots:
            return tile
    return None


def decode_tile(
    max_m: Optional[int], N: int, K: int, device: torch.device, in_graph: bool = False
) -> Optional[GemmConfig]:
    """``DECODE_TILE`` (at one row ``decode_tile_for_one_row``'s form) where it replaces the
    table entry serving up to ``max_m`` rows (one of ``DECODE_TILE_BUCKETS``) for an ``[N, K]``
    weight: where it runs warp-specialized (in Triton
    the entries are faster), on whole K tiles (the kernel's TMA reads the block scales' rows, K /
    16 bytes, 16-byte aligned), and where the K split leaves each program
    ``DECODE_TILE_MIN_K_TILES`` of them or more; in a graph (``in_graph``, for a traced one, or
    eager calls while the current CUDA stream is captured into a graph) already from
    ``DECODE_TILE_MIN_K_TILES_IN_GRAPHS``, at one row then only where its programs fill
    ``DECODE_TILE_SM_FILL_AT_ONE_ROW_IN_GRAPHS`` of the SMs."""
    if max_m not in DECODE_TILE_BUCKETS or K % DECODE_TILE.block_k or not gemm_warp_specialized.available(device):
        return None
    split = split_k_for(DECODE_TILE, N, K, device)
    tile = decode_tile_for_one_row(split, K) if max_m == 1 else DECODE_TILE
    k_tiles = ceil_div(ceil_div(K, DECODE_TILE.block_k), split)
    if k_tiles >= DECODE_TILE_MIN_K_TILES:
        return tile
    if k_tiles < DECODE_TILE_MIN_K_TILES_IN_GRAPHS or not (in_graph or captured_into_a_graph(device)):
        return None
    if max_m == 1:
        programs = ceil_div(N, gemm_decode_warp_specialized.WEIGHT_ROWS_PER_PROGRAM) * split
        if programs < DECODE_TILE_SM_FILL_AT_ONE_ROW_IN_GRAPHS * _multiprocessor_count(device):
            return None
    return tile


def decode_tile_for_one_row(split: int, K: int) -> GemmConfig:
    """The decode tile for one row in ``split`` K splits of a ``K``-wide reduction: quantizing
    its row itself (``DECODE_TILE_AT_ONE_ROW``) where each program runs one split, else, where
    a program runs and sums 2 or 4 (``gemm_decode_warp_specialized.sums_in_program``), after the
    operand kernel: there the load warpgroup would quantize that many K tiles per stage. Whole
    linear from a CUDA graph on an H200, after the operand kernel -> quantizing, ms
    (bench_decode_one_row.py): one split per program 14336 x 4096 (K x N) 0.0224 -> 0.0217,
    28672 x 8192 0.0529 -> 0.0521, 8192 x 28672 0.0539 -> 0.0538, 4096 x 4096 0.0145 -> 0.0133;
    splits summed in the program 8192 x 8192 0.0226 -> 0.0256 (0.0230 with the splits summed
    across programs), 4096 x 14336 0.0212 -> 0.0224, 4096 x 12288 0.0202 -> 0.0216; a form in
    which each consumer quantizes its own split's tiles measures slower too (8192 x 8192 0.0224
    -> 0.0237, docs/notes/benchmark_history.md)."""
    return DECODE_TILE if gemm_decode_warp_specialized.sums_in_program(split, K, 1) else DECODE_TILE_AT_ONE_ROW


def is_decode_tile(config: Union[GemmConfig, CublasAfterDequantize]) -> bool:
    """Whether ``config`` is the decode tile, taking its operand or quantizing its one row."""
    return config in (DECODE_TILE, DECODE_TILE_AT_ONE_ROW)


def captured_into_a_graph(device: torch.device) -> bool:
    """Whether a launch on ``device`` here goes into a CUDA graph being captured rather than to
    the GPU. False while torch traces: the route then says itself that it builds a graph
    (``in_graph``), and the ops it traces choose by the eager rule, which ``decode_tile`` keeps
    within the graphs' rule."""
    return device.type == "cuda" and not traced() and torch.cuda.is_current_stream_capturing()


def eager_quantizing_tiles(M: int) -> GemmConfig:
    """The tiles an eager call of ``M`` rows (2 to ``EAGER_QUANTIZING_MAX_ROWS``) takes to quantize
    its activation in the GEMM: the one-row entry's, quantizing ``M`` rounded up to a power of 2."""
    if not 0 < M <= EAGER_QUANTIZING_MAX_ROWS:
        raise ValueError(
            f"nvfp4_static: a GEMM quantizes 1 to {EAGER_QUANTIZING_MAX_ROWS} activation rows itself, got M = {M}"
        )
    return replace(GEMM_CONFIGS[0][1], activation_rows=next_power_of_2(M))


def quantizes_eagerly(
    M: int, dtype: torch.dtype, config: Union[GemmConfig, CublasAfterDequantize], device: torch.device
) -> bool:
    """Whether a call of ``M`` rows of a ``dtype`` activation that the table serves with ``config``
    (``operand_config``'s) takes ``eager_quantizing_tiles(M)`` instead: eagerly (neither traced nor
    captured into a CUDA graph) at 2 to ``EAGER_QUANTIZING_MAX_ROWS`` rows of bf16 or fp16, where
    ``config`` is a Triton entry taking the operand kernel's output (not the decode tile, whose GPU
    time saving outweighs its host cost where eager calls take it). fp32 activations keep the two
    launches: with these tiles their rows quantized in the GEMM were not shown to equal the
    operand kernel's on a GPU."""
    return (
        1 < M <= EAGER_QUANTIZING_MAX_ROWS
        and dtype in (torch.bfloat16, torch.float16)
        and isinstance(config, GemmConfig)
        and not config.activation_rows
        and not config.warp_specialized
        and not traced()
        and not captured_into_a_graph(device)
    )


def operand_config(
    bucket: int, N: int, K: int, device: torch.device, in_graph: bool = False
) -> Union[GemmConfig, CublasAfterDequantize]:
    """The tiles ``bucket`` runs for an ``[N, K]`` weight on ``device``, for what their
    activation operand is (raw or quantized, dtype, MMA order): the decode tile's or a wide
    tile's where it replaces the entry, else the entry's; ``in_graph`` for a traced graph, which
    takes the decode tile on the graphs' rule (``decode_tile``)."""
    max_m, entry = GEMM_CONFIGS[bucket]
    return config_for_width(decode_tile(max_m, N, K, device, in_graph) or wide_tile(max_m, N, K, device) or entry, K)


def config_for_width(
    config: Union[GemmConfig, CublasAfterDequantize], K: int
) -> Union[GemmConfig, CublasAfterDequantize]:
    """``config`` at reduction width ``K``: without ``mma_order`` where ``K`` is not a multiple of
    32 (the MMA order permutes whole 32-element groups)."""
    if isinstance(config, GemmConfig) and config.mma_order and K % MMA_GROUP:
        return replace(config, mma_order=False, warp_specialized=False)
    return config


def operand_in_mma_order(config: Union[GemmConfig, CublasAfterDequantize]) -> bool:
    """Whether a GEMM with ``config`` (as ``config_for_width`` gives it) takes its activation
    operand in the MMA order (``gemm_activation_operand(..., mma_order=True)``)."""
    return isinstance(config, GemmConfig) and config.mma_order


def taking_operand(config: Union[GemmConfig, CublasAfterDequantize]) -> Union[GemmConfig, CublasAfterDequantize]:
    """``config`` for an activation already quantized into the GEMM operand."""
    return replace(config, activation_rows=0) if isinstance(config, GemmConfig) else config


@lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(config: GemmConfig, N: int, K: int, device: torch.device) -> int:
    """How many programs share each output tile's K range: the most splits whose programs over
    ``row_tiles_for_split`` row tiles stay within ``programs_per_sm`` per SM (``GemmConfig``),
    with at least 2 K tiles each and none without a K tile (the kernel relies on it); or, for an
    entry with ``fill_programs_per_sm``, the same rule's split for that many programs per SM
    where its grid fills more of its SM slots. Not a function of M, which a traced graph may
    hold only symbolically.

    At most, not at least: an SM given one program more than most of the others finishes last,
    and more programs than fit at once run in a second wave. On an H100 (132 SMs, 2 per SM) the
    14336 x 4096 weight in 64 column tiles runs 4 splits, 256 programs, where the fewest splits
    reaching 132 programs gave 3 (192 programs, 9-13% slower at M = 16-128;
    examples/benchmarks/RESULTS.md, "GEMM tile table"). Some weights fill two per SM poorly and
    three nearly fully: 4096 x 12288 at M = 1 in 96 column tiles, 2 splits (192 programs of 264
    slots) or 4 (384 of 396), 0.0264 against 0.0246 ms (H100)."""
    if config.programs_per_sm == 0:
        return 1
    sms = _multiprocessor_count(device)
    output_tiles = config.row_tiles_for_split * ceil_div(N, config.block_n)
    tiles_k = ceil_div(K, config.block_k)

    def split_within(per_sm: int) -> int:
        most = per_sm * sms // output_tiles
        tiles_per_split = ceil_div(tiles_k, max(1, min(most, tiles_k // 2)))
        return ceil_div(tiles_k, tiles_per_split)

    def slots_filled(split: int, per_sm: int) -> float:
        programs, slots = output_tiles * split, per_sm * sms
        return programs / (ceil_div(programs, slots) * slots)

    planned = split_within(config.programs_per_sm)
    if not config.fill_programs_per_sm:
        return planned
    fuller = split_within(config.fill_programs_per_sm)
    if slots_filled(fuller, config.fill_programs_per_sm) > slots_filled(planned, config.programs_per_sm):
        return fuller
    return planned


@lru_cache(maxsize=None)  # asked at every launch; the device's capability does not change
def use_ptx_dequant(device: torch.device) -> bool:
    """Whether the dequantize uses PTX's FP8 conversion on ``device``: ``cvt.rn.f16x2.e4m3x2``
    exists from sm_89; the interpreter (CPU tensors) runs plain Triton."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fuses_epilogue_into_cublas(
    config: Union[GemmConfig, CublasAfterDequantize],
    out_dtype: torch.dtype,
    output_scale: Optional[float],
    bias: Optional[torch.Tensor],
) -> bool:
    """Whether a GEMM with the table entry ``config`` runs as one cuBLAS call with ``alpha =
    output_scale`` and the bias: the large-M route, a host copy of the scale, a bf16/fp16 output
    and a bias of that dtype (cuBLAS adds the bias in the output's dtype; another dtype would be
    rounded first)."""
    return (
        isinstance(config, CublasAfterDequantize)
        and output_scale is not None
        and out_dtype in (torch.float16, torch.bfloat16)
        and (bias is None or bias.dtype == out_dtype)
    )


def activation_operand_dtype(
    config: Union[GemmConfig, CublasAfterDequantize],
    out_dtype: torch.dtype,
    output_scale: Optional[float],
    bias: Optional[torch.Tensor],
) -> torch.dtype:
    """The dtype ``gemm_activation_operand`` should write for a GEMM with the table entry
    ``config``: the output's where cuBLAS takes the whole epilogue, else fp16 (the Triton
    kernel's tensor-core operand)."""
    return out_dtype if fuses_epilogue_into_cublas(config, out_dtype, output_scale, bias) else torch.float16


def check_operands(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    operand_dtype: Optional[torch.dtype],
) -> None:
    """``operand_dtype`` None: ``a`` is the raw activation, which the GEMM quantizes itself."""
    if operand_dtype is None:
        check_dtype(a, "activation")
        if a.dim() != 2:
            raise ValueError(f"nvfp4_static: the NVFP4 GEMM takes the activation as [M, K], got {tuple(a.shape)}")
    elif a.dtype != operand_dtype or a.dim() != 2:
        raise ValueError(
            f"nvfp4_static: the NVFP4 GEMM takes the activation as {operand_dtype} [M, K] here (from "
            f"gemm_activation_operand, see activation_operand_dtype), got {a.dtype} {tuple(a.shape)}"
        )
    K = a.shape[1]
    N = weight_qdata.shape[0]
    if K % BLOCK_SIZE or tuple(weight_qdata.shape) != (N, K // 2) or tuple(weight_block_scales.shape) != (
        N,
        K // BLOCK_SIZE,
    ):
        raise ValueError(
            f"nvfp4_static: NVFP4 GEMM shapes do not match: activation {tuple(a.shape)}, weight qdata "
            f"{tuple(weight_qdata.shape)} (want [N, {K // 2}]), block scales "
            f"{tuple(weight_block_scales.shape)} (want [N, {K // BLOCK_SIZE}]); K must be a multiple of 16"
        )


def launch_weight_dequantize(
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    out: torch.Tensor,
    config: CublasAfterDequantize = CublasAfterDequantize(),
) -> None:
    """The packed weight into ``out``: fp16 or bf16 ``[N, K]``, ``q * s_b``, block-deinterleaved."""
    N, K = out.shape
    weight_qdata = weight_qdata.contiguous()
    weight_block_scales = weight_block_scales.contiguous().view(torch.uint8)
    KernelCall(
        _dequantize_weight_kernel,
        (ceil_div(N, config.block_n), ceil_div(K, config.block_k)),
        (weight_qdata, weight_block_scales, out, N, K),
        dict(
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, PTX=use_ptx_dequant(out.device),
            num_warps=config.num_warps,
        ),
    ).launch()


def cublas_with_fused_epilogue(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    output_scale: float,
    bias: Optional[torch.Tensor],
    config: CublasAfterDequantize = CublasAfterDequantize(),
) -> torch.Tensor:
    """``(a @ dequant(W)^T) * output_scale + bias`` in ``a``'s dtype, one cuBLAS call after the
    weight dequantization: the fp32 accumulator is scaled by ``alpha``, the bias added, and the
    sum rounded once, as the epilogue kernel does."""
    weight = torch.empty((weight_qdata.shape[0], a.shape[1]), dtype=a.dtype, device=a.device)
    launch_weight_dequantize(weight_qdata, weight_block_scales, weight, config)
    if bias is None:
        # beta = 0: cuBLAS neither reads nor needs the (broadcast) input.
        return torch.addmm(a.new_zeros(()), a, weight.t(), beta=0, alpha=output_scale)
    return torch.addmm(bias, a, weight.t(), alpha=output_scale)


def launch_nvfp4_gemm(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    config: Union[GemmConfig, CublasAfterDequantize, None] = None,
    raw_activation: bool = False,
    sum_splits_in_gemm: Optional[bool] = None,
    split_k: Optional[int] = None,
) -> None:
    """Run the GEMM into ``out [M, N]``, epilogue included. ``a`` is the fp16 operand
    from ``gemm_activation_operand``, or with ``raw_activation`` the activation itself (bf16,
    fp16 or fp32), which the kernel quantizes: then the config must have ``activation_rows > 0``,
    and without it ``activation_rows == 0`` (each would misread the other's ``a``); the operand
    is in the MMA order where ``operand_in_mma_order(config_for_width(config, K))``. ``config``
    defaults to the table's tiles for M (an operand taken as given where that entry quantizes).

    A split K's partial products are summed by the GEMM's last program per tile
    (``sum_splits_in_gemm``, by default on real tensors outside tracing: it needs the stream's
    ``tile_counts``, which a traced graph cannot hold) or else by ``_epilogue_kernel``, or under
    tracing by ``epilogue_as_ops``; all three sum in the same order, so they give the same output.
    ``split_k`` replaces ``split_k_for(config, ...)`` (the warp-specialized wide tiles' op is
    handed the split the table sized). The wide tiles' Gluon kernel writes a split's partial
    products and ``_epilogue_kernel`` sums them. A traced graph reaches the warp-specialized Gluon
    kernels, which Inductor cannot trace, through ops: the wide tiles' product
    (``warp_specialized_nvfp4_gemm``), the decode tile's partial products
    (``decode_gemm_partial_products``)."""
    K = 2 * weight_qdata.shape[1]
    if config is None:
        config = table_config(a.shape[0], None, weight_qdata.shape[0], K, a.device)
        config = config if raw_activation else taking_operand(config)
    else:
        config = config_for_width(config, K)
    quantize_rows = config.activation_rows if isinstance(config, GemmConfig) else 0
    if bool(quantize_rows) != raw_activation:
        raise ValueError(
            f"nvfp4_static: raw_activation={raw_activation} but {config} has activation_rows = "
            f"{quantize_rows}: a config quantizes the raw activation exactly when activation_rows > 0"
        )
    check_operands(a, weight_qdata, weight_block_scales, None if raw_activation else torch.float16)
    a = a if a.stride(1) == 1 else a.contiguous()
    M = a.shape[0]
    N = weight_qdata.shape[0]
    act_scale = act_per_tensor_scale.to(torch.float32).reshape(1)
    weight_scale = weight_per_tensor_scale.to(torch.float32).reshape(1)
    # The kernels take the weight's shape and the other row strides as compile-time constants
    # (the contiguous weight's are K / 2 and K / 16): a scale row must be known 16-byte aligned
    # to load in vectors and pipeline those loads (otherwise every iteration waits on global
    # loads), and a plain integer argument is only known so when Triton specialises it, which
    # Inductor does not do for a dynamic-shape graph (there, 6x slower at M = 16;
    # examples/benchmarks/RESULTS.md). One compile per layer shape.
    weight_qdata = weight_qdata.contiguous()
    weight_block_scales = weight_block_scales.contiguous().view(torch.uint8)
    eager = runs_eagerly(a)
    gluon = isinstance(config, GemmConfig) and config.warp_specialized and gemm_warp_specialized.available(a.device)
    if split_k is None:
        split_k = 1 if isinstance(config, CublasAfterDequantize) else split_k_for(config, N, K, a.device)
    elif isinstance(config, CublasAfterDequantize):
        raise ValueError(f"nvfp4_static: split_k = {split_k} for K = {K} with {config}: cuBLAS's route takes no split")
    elif not splits_hold_k_tiles(ceil_div(K, config.block_k), split_k):
        raise ValueError(
            f"nvfp4_static: split_k = {split_k} for K = {K} with {config}: the GEMM splits K = {K} "
            f"({ceil_div(K, config.block_k)} K tiles) into parts that each hold some of them, got split_k = {split_k}"
        )
    if gluon and not is_decode_tile(config):
        if not eager:
            product = torch.ops.nvfp4_static.warp_specialized_nvfp4_gemm(
                a, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, out.dtype, config.block_m, split_k
            )
            out.copy_(product)
            return
        if gemm_warp_specialized.takes(a, weight_qdata, out):
            partials = None if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
            gemm_warp_specialized.launch_warp_specialized_gemm(
                a, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, out, config.block_m, partials
            )
            if partials is not None:
                launch_epilogue(partials, act_scale, weight_scale, bias, out)
            return
    if isinstance(config, CublasAfterDequantize):
        weight = torch.empty((N, K), dtype=torch.float16, device=a.device)
        launch_weight_dequantize(weight_qdata, weight_block_scales, weight, config)
        partials = torch.mm(a, weight.t(), out_dtype=torch.float32)
    elif gluon and not eager and raw_activation:
        partials = torch.ops.nvfp4_static.decode_linear_partial_products(
            a, act_scale, weight_qdata, weight_block_scales, split_k
        )
    elif gluon and not eager:
        partials = torch.ops.nvfp4_static.decode_gemm_partial_products(a, weight_qdata, weight_block_scales, split_k)
    else:
        sum_splits = split_k > 1 and (eager if sum_splits_in_gemm is None else sum_splits_in_gemm)
        summed_in_program = (
            sum_splits
            and runs_the_decode_kernel(config, a, weight_qdata, weight_block_scales, out)
            and gemm_decode_warp_specialized.sums_in_program(split_k, K, M)
        )
        partials = (
            None if split_k == 1 or summed_in_program
            else torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
        )
        scales = (act_scale, weight_scale)
        # Eagerly the operand kernel, launched just before, lets the GEMM start early.
        overlap = eager and not raw_activation
        launch_tiles(
            a, weight_qdata, weight_block_scales, *scales, bias, out, partials, sum_splits, config, split_k, overlap
        )
        if split_k == 1 or sum_splits:
            return
    if not eager:
        out.copy_(epilogue_as_ops(partials.view(split_k, M, N), act_scale, weight_scale, bias))
        return
    launch_epilogue(partials.view(split_k, M, N), act_scale, weight_scale, bias, out)


def launch_epilogue(
    partials: torch.Tensor,
    act_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
) -> None:
    """``_epilogue_kernel``: the ``[split_k, M, N]`` fp32 partial products summed in split
    order, scaled, biased and stored into ``out``."""
    split_k, M, N = partials.shape
    KernelCall(
        _epilogue_kernel,
        (ceil_div(M * N, EPILOGUE_BLOCK),),
        (partials, act_scale, weight_scale, act_scale if bias is None else bias, out, M, N, out.stride(0), split_k),
        dict(BLOCK=EPILOGUE_BLOCK, HAS_BIAS=bias is not None),
    ).launch()


def runs_the_decode_kernel(
    config: GemmConfig, a: torch.Tensor, weight_qdata: torch.Tensor, scale_codes: torch.Tensor, out: torch.Tensor
) -> bool:
    """Whether ``launch_tiles`` runs ``config`` as ``gemm_decode_warp_specialized``'s kernel:
    the decode tile, where the GPU and the tensors suit that kernel."""
    return (
        is_decode_tile(config)
        and gemm_warp_specialized.available(a.device)
        and gemm_decode_warp_specialized.takes(a, weight_qdata, scale_codes, out, config.activation_rows > 0)
    )


def launch_tiles(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    scale_codes: torch.Tensor,
    act_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    partials: Optional[torch.Tensor],
    sum_splits: bool,
    config: GemmConfig,
    split_k: int,
    overlap_operand_kernel: bool = False,
) -> None:
    """Launch ``config``'s GEMM kernel in ``split_k`` K splits: without ``partials`` (one split,
    or splits the decode kernel sums in its programs, ``gemm_decode_warp_specialized.sums_in_program``)
    it writes ``out``, epilogue included; with ``partials`` (``[split_k, M, N]`` fp32) each
    split's partial products, and with ``sum_splits`` the last program of each output tile sums
    them into ``out``, counting arrivals in the stream's ``tile_counts``. The decode tile runs
    ``gemm_decode_warp_specialized``'s kernel where the GPU and the tensors suit it
    (``runs_the_decode_kernel``), every other case the Triton kernel; with
    ``overlap_operand_kernel`` the decode kernel is launched to start streaming its weight while
    the operand kernel launched just before it still runs (that kernel lets it start early where
    it was launched eagerly). ``a``, ``scale_codes`` and the scales as ``launch_nvfp4_gemm`` has
    prepared them."""
    M, K = a.shape[0], 2 * weight_qdata.shape[1]
    N = weight_qdata.shape[0]
    if runs_the_decode_kernel(config, a, weight_qdata, scale_codes, out):
        counts = (
            tile_counts(a.device, gemm_decode_warp_specialized.counters(N))
            if sum_splits and partials is not None
            else None
        )
        gemm_decode_warp_specialized.launch_decode_gemm(
            a, weight_qdata, scale_codes, act_scale, weight_scale, bias, out, partials, counts, split_k,
            overlap_operand_kernel, config.activation_rows > 0,
        )
        return
    tiles = ceil_div(M, config.rows_per_tile) * ceil_div(N, config.block_n)
    counts = tile_counts(a.device, tiles) if sum_splits else None
    unused = act_scale
    KernelCall(
        _nvfp4_gemm_kernel,
        (tiles, split_k),
        (
            a,
            weight_qdata,
            scale_codes,
            act_scale,
            weight_scale,
            unused if bias is None else bias,
            out,
            unused if partials is None else partials,
            unused if counts is None else counts,
            M,
            N,
            K,
            a.stride(0),
            out.stride(0),
            split_k,
        ),
        dict(
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            WRITE_PARTIALS=partials is not None,
            SUM_SPLITS=counts is not None,
            GROUP_N=config.group_n,
            HAS_BIAS=bias is not None,
            EVEN_K=K % config.block_k == 0,
            PTX=use_ptx_dequant(a.device),
            WEIGHT_AS_A=config.weight_as_mma_a,
            QUANTIZE_ROWS=config.activation_rows,
            MMA_ORDER=config.mma_order,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        ),
        workspace=() if counts is None else (counts,),
    ).launch()


def epilogue_as_ops(
    partials: torch.Tensor, act_scale: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``_epilogue_kernel``'s fp32 result as torch ops, for a traced graph: the splits summed in
    the kernel's order, then ``scaled_and_biased``. Inductor fuses these into the kernel that
    reads the output (a residual add, the SiLU product, a norm) instead of launching the epilogue
    kernel after every GEMM, a fixed cost per linear at decode."""
    total = partials[0]
    for split in range(1, partials.shape[0]):
        total = total + partials[split]
    total = total * (act_scale * weight_scale)
    return total if bias is None else total + bias.to(torch.float32)


_TILE_COUNTS: dict[tuple, torch.Tensor] = {}


def tile_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` int32 counters, all zero, for a GEMM that sums its K splits itself
    (it leaves them zero again). On CUDA one buffer per device and stream, kept: the GEMMs of a
    stream run one after another, so they can share it, and no launch waits on zeroing it.

    Under a CUDA graph capture, one buffer per capture instead, made (and so zeroed) in the
    graph: a graph replays on whatever stream is current, perhaps beside another graph, and a
    buffer first made while capturing another graph would be that graph's memory, zeroed only
    when that graph replays. The buffer of an earlier capture on the stream is let go; its
    graph holds it as any memory it allocated, zeroing it at each replay."""
    if device.type != "cuda":
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    capture = capture_id(device)
    key = (device.index, stream, capture)
    counts = _TILE_COUNTS.get(key)
    if counts is None or counts.numel() < tiles:
        if capture is not None:
            for earlier in [k for k in _TILE_COUNTS if k[:2] == key[:2] and k[2] not in (None, capture)]:
                del _TILE_COUNTS[earlier]
        counts = _TILE_COUNTS[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return counts


def quantizes_activation_in_gemm(config: Union[GemmConfig, CublasAfterDequantize]) -> bool:
    """Whether the table entry ``config`` takes the raw activation and quantizes it itself
    (``GemmConfig.activation_rows``): then the linear is ``quantizing_nvfp4_gemm``, one launch."""
    return isinstance(config, GemmConfig) and config.activation_rows > 0
