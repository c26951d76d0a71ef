"""The NVFP4 GEMM's 256 x 128 and 128 x 128 tiles on Hopper, warp-specialized, in Gluon.

``gemm.TALL_TILE``'s product (256 activation rows by 128 weight rows, 128-wide K tiles in the MMA
order, ``W @ A^T`` with the dequantized weight as the wgmma's register operand; 144 or 192 rows
per program where that leaves the programs as many, ``tokens_per_program``), or
``gemm.SQUARE_TILE``'s (128 activation rows, 80 where that leaves the programs as many; for
weights whose 256-row tiles would leave SMs idle), by three
warpgroups with separate jobs: one loads each K tile's activation operand and packed weight by
TMA into a ring of shared-memory stages; each of the other two dequantizes its own 64 weight rows
into its wgmma operand, multiplies, and hands the stage back through an mbarrier. The Triton
kernel's two warpgroups meet at barriers in every K tile and dequantize at the same time, while
the tensor cores wait; here neither waits for the other, and one dequantizes while the other's
wgmmas run (M = 512 on 8192 x 8192: the tensor pipe active 74% of the Triton tile's cycles on an
H100, 89% of this kernel's on an H200; ``examples/benchmarks/RESULTS.md``).

With a K split for one program per SM (``gemm.SPLIT_TALL_TILES``, ``gemm.SPLIT_SQUARE_TILES``)
each program writes its split's fp32 partial products, which ``gemm._epilogue_kernel`` then
sums in split order, as it sums the Triton kernel's.

The arithmetic is the Triton tile's: the same dequantization (``e2m1_ptx``), the same wgmma
instructions in the same K order, so both give the same output bit for bit. Gluon
kernels do not run in Triton's interpreter and Inductor cannot trace them: ``gemm`` runs this one
for ``gemm.TALL_TILE``, ``gemm.SQUARE_TILE`` and their split forms on sm_90 (eager, or at run time inside
``warp_specialized_nvfp4_gemm``, the opaque op a traced graph calls) and the same tile in Triton
everywhere else.
"""

from functools import lru_cache
from typing import Optional

import torch

from nvfp4_static.kernels.launch import KernelCall, ceil_div, interpreting, launch_prepared, splits_hold_k_tiles

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON_HOPPER = hasattr(gl, "warp_specialize")
except ImportError:
    HAS_GLUON_HOPPER = False

TOKENS_PER_TILE = (256, 128)  # the activation rows of the tiles the kernel is built for
# Activation rows per program by the tile's rows, fewest first: a wgmma of 128 or 64 tokens and
# one of 16 or 64 (Gluon's tensors have power-of-2 shapes), or the whole tile's. Each program
# takes the fewest that hold its share of M, so the programs are as many as the tile's would be
# (``tokens_per_program``), with less wgmma work, the same output (each output element sums the
# same products in the same order). Rows past M cost their wgmma work all the same: at M = 129,
# 144 rows per program in place of 192 took 1-9% less time on four weights, at M = 65-80, 80
# rows in place of 128 took 1-16% less; 160 rows (128 + 32) and three wgmmas' (176, 208, 224
# rows) were no faster than 192 or 256 at any M measured (H200, 2026-12-03,
# examples/benchmarks/RESULTS.md).
PROGRAM_TOKENS = {256: (144, 192, 256), 128: (80, 128)}
WEIGHT_ROWS_PER_TILE = 128
BLOCK_K = 128
# Stages of operands by rows per program: as many as an H100 SM's shared memory holds (72, 56,
# 44, 40 or 28 KiB each), at most 5.
STAGES = {256: 3, 192: 4, 144: 5, 128: 5, 80: 5}
CONSUMER_REGISTERS = 232  # of the 256 a thread may have: the accumulator alone takes 128
ROWS_PER_CONSUMER = 64  # the wgmma's M


def available(device: torch.device) -> bool:
    """Whether this kernel can run on ``device``: a Hopper GPU (wgmma) with Gluon's Hopper API,
    outside Triton's interpreter."""
    return HAS_GLUON_HOPPER and device.type == "cuda" and not interpreting() and _is_hopper(device)


@lru_cache(maxsize=None)
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def takes(a: torch.Tensor, weight_qdata: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether this call's tensors suit the kernel: TMA reads the operand and the packed weight
    from 16-byte aligned rows, and the output is written row by row."""
    return (
        a.dtype == torch.float16
        and a.is_contiguous()
        and weight_qdata.is_contiguous()
        and a.data_ptr() % 16 == 0
        and weight_qdata.data_ptr() % 16 == 0
        and a.shape[1] % 32 == 0
        and out.stride(1) == 1
    )


if HAS_GLUON_HOPPER:
    from nvfp4_static.kernels.e2m1_ptx import E2M1_BYTES_TO_FP16_PTX

    # Triton 3.6 names the TMA load async_copy_global_to_shared; later versions async_load.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # The barrier of a partition's threads: thread_barrier in Triton 3.6, barrier later.
    partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    ROWS = gl.constexpr(ROWS_PER_CONSUMER)
    PTX = gl.constexpr(E2M1_BYTES_TO_FP16_PTX)

    @gluon.constexpr_function
    def packed_layout(block_k):
        """A consumer's ``[64, block_k / 2]`` packed bytes. In each row, byte ``16g + 4t + 2c + i``
        sits with lane ``t`` (with the rows, as the wgmma's register operand places them), in
        register ``i + 2c``: each thread's four bytes are one 32-bit word, which the PTX turns
        into its operand values for both of the row's 16-wide K steps of the group."""
        registers = [[0, 1], [0, 2], [8, 0]]
        group = 16
        while group < block_k // 2:
            registers.append([0, group])
            group *= 2
        return gl.DistributedLinearLayout(
            reg_bases=registers,
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[ROWS_PER_CONSUMER, block_k // 2],
        )

    @gluon.constexpr_function
    def packed_by_block_layout(block_k):
        """``packed_layout`` seen as ``[64, block_k / 16, 8]``: (row, 16-element block, byte)."""
        registers = [[0, 0, 1], [0, 0, 2], [8, 0, 0]]
        block = 2
        while block < block_k // 16:
            registers.append([0, block, 0])
            block *= 2
        return gl.DistributedLinearLayout(
            reg_bases=registers,
            lane_bases=[[0, 0, 4], [0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]],
            block_bases=[],
            shape=[ROWS_PER_CONSUMER, block_k // 16, 8],
        )

    @gluon.constexpr_function
    def leading_tokens(block_m):
        """The tokens of a tile's first wgmma: all of them where ``block_m`` is a power of 2, else
        the largest power of 2 below it (192 tokens: a wgmma of 128, then one of 64, since
        Gluon's tensors have power-of-2 shapes; 144: 128, then 16)."""
        return 1 << (block_m.bit_length() - 1)

    @gluon.constexpr_function
    def rest_stages_shape(block_m, block_k, stages):
        """The shared memory of the tokens after ``leading_tokens`` in each stage; a tile without
        them still passes a buffer to its partitions, one unused 8-row swizzle atom."""
        rest = block_m - leading_tokens(block_m)
        return [stages, rest, block_k] if rest else [1, 8, block_k]

    @gluon.jit
    def _dequantize_in_mma_order(packed, scale_codes, BK: gl.constexpr, BY_BLOCK: gl.constexpr, OPERAND: gl.constexpr):
        """Packed codes and their FP8 block scales -> fp16 ``q * s_b`` in the MMA order
        (``gemm.dequantize_weight_tile_in_mma_order``), laid out as the wgmma's register operand
        without moving a value between threads (each conversion below is checked trivial)."""
        low, high = gl.inline_asm_elementwise(
            PTX, "=r,=r,=r,=r,r", [packed], dtype=(gl.float16, gl.float16), is_pure=True, pack=4
        )
        # Undo the 2^-6 of the FP8 trick on the scale: s_b * 64 <= 28672 stays exact in fp16.
        scales = gl.expand_dims(scale_codes.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 64.0, 2)
        by_block: gl.constexpr = [ROWS, BK // 16, 8]
        even = gl.convert_layout(gl.reshape(low, by_block), BY_BLOCK, assert_trivial=True) * scales
        odd = gl.convert_layout(gl.reshape(high, by_block), BY_BLOCK, assert_trivial=True) * scales
        groups: gl.constexpr = [ROWS, BK // 32, 4, 2, 2]  # (row, group, t, c, i)
        tile = gl.join(gl.reshape(even, groups), gl.reshape(odd, groups))  # (row, group, t, c, i, h)
        tile = gl.reshape(gl.permute(tile, (0, 1, 3, 5, 2, 4)), [ROWS, BK])  # K at 32g + 16c + 8h + 2t + i
        return gl.convert_layout(tile, OPERAND, assert_trivial=True)

    @gluon.jit
    def _load_partition(a_desc, a_rest_desc, w_desc, a_smem, a_rest_smem, w_smem, ready, empty, off_m, off_n, k_first,
                        k_tiles, BLOCK_M: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr):
        """Fill stage ``k % NUM_STAGES`` with the split's K tile ``k`` (from K tile ``k_first``)
        once both consumers handed it back."""
        LEAD: gl.constexpr = leading_tokens(BLOCK_M)
        REST: gl.constexpr = BLOCK_M - LEAD
        rest_bytes: gl.constexpr = a_rest_desc.block_type.nbytes if REST > 0 else 0
        stage_bytes: gl.constexpr = a_desc.block_type.nbytes + rest_bytes + 2 * w_desc.block_type.nbytes
        for k_tile in range(k_tiles):
            stage = k_tile % NUM_STAGES
            # A fresh barrier counts as having completed the phase before its first, so the
            # first pass over the stages does not wait.
            mbarrier.wait(empty.index(stage), ((k_tile // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, stage_bytes)
            k = (k_first + k_tile) * BK
            if REST > 0:
                tma_load(a_rest_desc, [off_m + LEAD, k], bar, a_rest_smem.index(stage))
            tma_load(a_desc, [off_m, k], bar, a_smem.index(stage))
            tma_load(w_desc, [off_n, k // 2], bar, w_smem.index(2 * stage))
            tma_load(w_desc, [off_n + ROWS, k // 2], bar, w_smem.index(2 * stage + 1))

    @gluon.jit
    def _multiply_partition(a_smem, a_rest_smem, w_smem, ready, empty, scales_ptr, act_scale_ptr, weight_scale_ptr,
                            bias_ptr, out_ptr, partials_ptr, M, N, K, stride_om, off_m, off_n, k_first, k_tiles, split,
                            HALF: gl.constexpr, BLOCK_M: gl.constexpr, BK: gl.constexpr,
                            NUM_STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, WRITE_PARTIALS: gl.constexpr):
        """One consumer warpgroup: weight rows ``off_n + 64 * HALF`` onwards, all BLOCK_M tokens,
        over the split's K tiles; then the epilogue (both global scales, the bias) on its part of
        the output tile, or with ``WRITE_PARTIALS`` its split's partial products."""
        LEAD: gl.constexpr = leading_tokens(BLOCK_M)
        REST: gl.constexpr = BLOCK_M - LEAD
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, LEAD, 16])
        OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        PACKED: gl.constexpr = packed_layout(BK)
        BY_BLOCK: gl.constexpr = packed_by_block_layout(BK)
        SCALES: gl.constexpr = gl.SliceLayout(2, BY_BLOCK)
        first_row = off_n + HALF * ROWS
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, SCALES))
        blocks = k_first * (BK // 16) + gl.arange(0, BK // 16, layout=gl.SliceLayout(0, SCALES))
        scale_ptrs = scales_ptr + rows.to(gl.int64)[:, None] * (K // 16) + blocks[None, :]
        in_rows = rows[:, None] < N
        acc = gl.zeros([ROWS, LEAD], gl.float32, layout=ACC)
        if REST > 0:
            ACC_REST: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, REST, 16]
            )
            OPERAND_REST: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_REST, k_width=2)
            acc_rest = gl.zeros([ROWS, REST], gl.float32, layout=ACC_REST)
        # The block scales come from global memory a K tile ahead of their use.
        codes = gl.load(scale_ptrs, mask=in_rows & (blocks[None, :] < K // 16), other=0)
        for k_tile in range(k_tiles):
            stage = k_tile % NUM_STAGES
            next_blocks = (k_tile + 1) * (BK // 16) + blocks[None, :]  # past the split's last: loaded, unused
            next_codes = gl.load(
                scale_ptrs + (k_tile + 1) * (BK // 16), mask=in_rows & (next_blocks < K // 16), other=0
            )
            mbarrier.wait(ready.index(stage), (k_tile // NUM_STAGES) & 1)
            packed = w_smem.index(2 * stage + HALF).load(PACKED)
            w = _dequantize_in_mma_order(packed, codes, BK, BY_BLOCK, OPERAND)
            acc = warpgroup_mma(w, a_smem.index(stage).permute((1, 0)), acc, is_async=True)
            # Waiting for the wgmmas here lets the other consumer's dequantization run beside them.
            if REST > 0:
                w_rest = gl.convert_layout(w, OPERAND_REST, assert_trivial=True)
                rest_tokens = a_rest_smem.index(stage).permute((1, 0))
                acc_rest = warpgroup_mma(w_rest, rest_tokens, acc_rest, is_async=True)
                acc, acc_rest = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_rest))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(stage), count=1)
            codes = next_codes
        _store_output_tile(acc, act_scale_ptr, weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, M, N, stride_om,
                           first_row, off_m, split, HAS_BIAS, WRITE_PARTIALS)
        if REST > 0:
            _store_output_tile(acc_rest, act_scale_ptr, weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, M, N,
                               stride_om, first_row, off_m + LEAD, split, HAS_BIAS, WRITE_PARTIALS)

    @gluon.jit
    def _store_output_tile(acc, act_scale_ptr, weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, M, N, stride_om,
                           first_row, first_token, split, HAS_BIAS: gl.constexpr, WRITE_PARTIALS: gl.constexpr):
        """A consumer's accumulated ``[64, tokens]`` product times both global scales, plus the
        bias, stored transposed into the output's rows ``first_token`` onwards; or with
        ``WRITE_PARTIALS`` stored as it is into split ``split`` of the ``[split_k, M, N]`` fp32
        partial products (the Triton kernel's layout of them)."""
        out_rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc.type.layout))
        tokens = first_token + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        mask = (out_rows[:, None] < N) & (tokens[None, :] < M)
        if WRITE_PARTIALS:
            at = (split * M + tokens.to(gl.int64))[None, :] * N + out_rows[:, None]
            gl.store(partials_ptr + at, acc, mask=mask)
            return
        acc = acc * (gl.load(act_scale_ptr) * gl.load(weight_scale_ptr))
        if HAS_BIAS:
            acc += gl.load(bias_ptr + out_rows, mask=out_rows < N, other=0.0).to(gl.float32)[:, None]
        gl.store(
            out_ptr + tokens.to(gl.int64)[None, :] * stride_om + out_rows[:, None],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    @gluon.jit
    def _warp_specialized_gemm_kernel(a_desc, a_rest_desc, w_desc, scales_ptr, act_scale_ptr, weight_scale_ptr,
                                      bias_ptr, out_ptr, partials_ptr, M, N, K, stride_om, split_k,
                                      BLOCK_M: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
                                      HAS_BIAS: gl.constexpr, WRITE_PARTIALS: gl.constexpr,
                                      REGISTERS: gl.constexpr):
        # Consecutive programs take the same weight rows, so each weight tile is read from L2 by
        # the programs after the first. The K splits, their ranges and the order of their sum
        # (by the caller) are the Triton kernel's.
        pid = gl.program_id(0)
        split = gl.program_id(1)
        tiles_m = gl.cdiv(M, BLOCK_M)
        off_m = (pid % tiles_m) * BLOCK_M
        off_n = (pid // tiles_m) * (2 * ROWS)
        tiles_k = gl.cdiv(K, BK)
        per_split = gl.cdiv(tiles_k, split_k)
        k_first = split * per_split
        k_tiles = gl.minimum(per_split, tiles_k - k_first)
        a_smem = gl.allocate_shared_memory(gl.float16, [NUM_STAGES, leading_tokens(BLOCK_M), BK], a_desc.layout)
        a_rest_smem = gl.allocate_shared_memory(
            gl.float16, rest_stages_shape(BLOCK_M, BK, NUM_STAGES), a_rest_desc.layout
        )
        w_smem = gl.allocate_shared_memory(gl.uint8, [2 * NUM_STAGES, ROWS, BK // 2], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(stage), count=1)
            mbarrier.init(empty.index(stage), count=2)  # both consumers hand each stage back
        gl.warp_specialize(
            [
                (_load_partition, (a_desc, a_rest_desc, w_desc, a_smem, a_rest_smem, w_smem, ready, empty, off_m, off_n,
                                   k_first, k_tiles, BLOCK_M, BK, NUM_STAGES)),
                (_multiply_partition, (a_smem, a_rest_smem, w_smem, ready, empty, scales_ptr, act_scale_ptr,
                                       weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, M, N, K, stride_om, off_m,
                                       off_n, k_first, k_tiles, split, 0, BLOCK_M, BK, NUM_STAGES, HAS_BIAS,
                                       WRITE_PARTIALS)),
                (_multiply_partition, (a_smem, a_rest_smem, w_smem, ready, empty, scales_ptr, act_scale_ptr,
                                       weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, M, N, K, stride_om, off_m,
                                       off_n, k_first, k_tiles, split, 1, BLOCK_M, BK, NUM_STAGES, HAS_BIAS,
                                       WRITE_PARTIALS)),
            ],
            [4, 4],
            [REGISTERS, REGISTERS],
        )


@lru_cache(maxsize=None)
def _shared_layout(rows: int, columns: int, dtype):
    """The shared-memory layout of a TMA box of Gluon's ``dtype``."""
    return gl.NVMMASharedLayout.get_default_for([rows, columns], dtype)


def _operand_descriptor(a: torch.Tensor, tokens: int) -> "TensorDescriptor":
    """TMA's view of the fp16 operand in boxes of ``tokens`` rows by a K tile."""
    M, K = a.shape
    return TensorDescriptor(a, [M, K], [K, 1], [tokens, BLOCK_K], _shared_layout(tokens, BLOCK_K, gl.float16))


def tokens_per_program(M: int, tokens_per_tile: int) -> int:
    """The activation rows each program takes for ``M`` rows in tiles of ``tokens_per_tile``: the
    fewest of ``PROGRAM_TOKENS`` that hold each program's share of ``M``."""
    share = ceil_div(M, ceil_div(M, tokens_per_tile))
    return next(tokens for tokens in PROGRAM_TOKENS[tokens_per_tile] if tokens >= share)


def kernel_arguments(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    scale_codes: torch.Tensor,
    act_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    tokens_per_tile: int,
    partials: Optional[torch.Tensor] = None,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, meta)`` of the kernel's launch for tiles of ``tokens_per_tile`` activation
    rows (the TMA descriptors built for these tensors). Without ``partials`` the kernel writes
    ``out``; with ``partials`` (``[split_k, M, N]`` fp32) it runs in ``split_k`` K splits and
    writes each split's partial products there, for the caller to sum."""
    if tokens_per_tile not in TOKENS_PER_TILE:
        raise ValueError(
            f"nvfp4_static: the warp-specialized GEMM has tiles of {TOKENS_PER_TILE} activation rows, "
            f"got {tokens_per_tile}"
        )
    M, K = a.shape
    N = weight_qdata.shape[0]
    split_k = 1 if partials is None else partials.shape[0]
    k_tiles = ceil_div(K, BLOCK_K)
    if partials is not None and (
        partials.shape[1:] != (M, N) or partials.dtype != torch.float32 or not splits_hold_k_tiles(k_tiles, split_k)
    ):
        raise ValueError(
            f"nvfp4_static: the warp-specialized GEMM's partial products for M = {M}, N = {N}, K = {K} are "
            f"[split_k, {M}, {N}] fp32, every split given some of the {k_tiles} K tiles, got {list(partials.shape)}"
        )
    tokens = tokens_per_program(M, tokens_per_tile)
    lead = leading_tokens(tokens)
    a_desc = _operand_descriptor(a, lead)
    a_rest_desc = _operand_descriptor(a, tokens - lead) if tokens > lead else a_desc
    w_layout = _shared_layout(ROWS_PER_CONSUMER, BLOCK_K // 2, gl.uint8)
    w_desc = TensorDescriptor(weight_qdata, [N, K // 2], [K // 2, 1], [ROWS_PER_CONSUMER, BLOCK_K // 2], w_layout)
    grid = (ceil_div(M, tokens) * ceil_div(N, WEIGHT_ROWS_PER_TILE), split_k, 1)
    unused = act_scale
    args = (a_desc, a_rest_desc, w_desc, scale_codes, act_scale, weight_scale, unused if bias is None else bias,
            out, unused if partials is None else partials, M, N, K, out.stride(0), split_k)
    meta = dict(BLOCK_M=tokens, BK=BLOCK_K, NUM_STAGES=STAGES[tokens], HAS_BIAS=bias is not None,
                WRITE_PARTIALS=partials is not None, REGISTERS=CONSUMER_REGISTERS, num_warps=4)
    return grid, args, meta


def launch_warp_specialized_gemm(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    scale_codes: torch.Tensor,
    act_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    tokens_per_tile: int,
    partials: Optional[torch.Tensor] = None,
) -> None:
    """``out [M, N] = (a @ dequant(W)^T) * act_scale * weight_scale + bias`` in tiles of
    ``tokens_per_tile`` activation rows, or with ``partials`` the partial products of its K
    splits only (``kernel_arguments``): ``a`` the fp16 operand in the MMA order, ``scale_codes``
    the block scales as bytes, both global scales fp32 ``[1]``; the caller has checked
    ``available`` and ``takes``."""
    grid, args, meta = kernel_arguments(
        a, weight_qdata, scale_codes, act_scale, weight_scale, bias, out, tokens_per_tile, partials
    )
    launch_prepared(KernelCall(_warp_specialized_gemm_kernel, grid, args, meta), a.device)
