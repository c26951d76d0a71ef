"""The NVFP4 GEMM's decode tile on Hopper (up to 16 activation rows), warp-specialized, in Gluon.

At decode the GEMM streams the packed weight once and its time is the weight's read. Each
program takes 256 weight rows over one part of K (the split fills the SMs, one program each; or,
below, its rows and parts four ways): one warpgroup loads, by TMA into a ring of shared-memory
stages, each 256-wide K tile's activation operand (8 rows up to 8 activation rows, else 16),
packed weight and FP8 block scales; each of four other warpgroups dequantizes its 64 weight rows
into the wgmma's register operand and multiplies (m64n8k16 or m64n16k16, ``W @ A^T``), as
``gemm.DECODE_TILE_IN_TRITON`` does per program. It takes each K tile in two halves, issuing the
first half's wgmmas before dequantizing the second, so that dequantization runs beside the MMAs.
With the scales in the stages no thread waits on a global load in the K loop, and four
warpgroups dequantizing at once keep bytes in flight to stream the weight: on an H200, 8192 x
8192 at one row, the whole linear (operand kernel and this GEMM) takes 0.0228 ms against the
read floor's 0.0179 (``examples/benchmarks/RESULTS.md``).

Eagerly the kernel is launched to start while the operand kernel before it still runs
(programmatic dependent launch; that kernel lets it start at once): the load warpgroup issues
the first K tile's weight and scales, then waits for the operand kernel's end, then loads the
operand, about 1 us less per linear.

At one row the kernel can quantize the activation itself (``QUANTIZES``, ``gemm.DECODE_TILE_AT_ONE_ROW``):
the load warpgroup reads each K tile of the row with plain loads (the next tile's while it
quantizes this one), quantizes it with ``act_quantize``'s arithmetic into the stage's operand
tile and arrives on the stage's barrier once its stores are fenced, so no operand kernel runs
first. The consumers then keep 104 registers, which leaves that warpgroup 64 (Triton gives it
what the kernel's 96 per thread leave over).

Where the K split is 2 or 4 (and divides the K tiles evenly; at one row, of at most 8 K tiles
each) one program runs every split of its weight rows: its consumers take 64 rows each in
``4 / split`` row groups, each consumer one split's K range, and the first consumer of a row
group sums its group's products in split order through shared memory, then applies the epilogue
(both global scales, the bias). No partial product leaves the SM and no program waits on
another's. Other splits run one split per program; the program that stores the last split of a
column tile sums the splits' partial products in split order and applies the epilogue, so one
launch gives the output. In a traced graph the kernel writes the partial products only, one
split per program, and the graph sums and scales them (``gemm.epilogue_as_ops``), in the kernel
that reads the output. The splits, their K ranges, the order of the K steps' MMAs and that of
the sums are ``gemm.DECODE_TILE_IN_TRITON``'s: the same output bit for bit. ``gemm`` runs this
kernel for ``gemm.DECODE_TILE`` on sm_90 where the tensors suit it (``takes``), and the Triton
tile elsewhere.
"""

from functools import lru_cache
from typing import Optional

import torch

from nvfp4_static.kernels import gemm_warp_specialized
from nvfp4_static.kernels.gemm_warp_specialized import HAS_GLUON_HOPPER
from nvfp4_static.kernels.launch import KernelCall, ceil_div, launch_prepared

TOKENS = 16  # the most activation rows: the wgmma's N
# The wgmma's N for up to this many rows: half the MMA work and half the operand's shared
# memory; on an H200 the linear at 1-4 rows took 0-6% less time so on five 8B-sized weights
# (examples/benchmarks/RESULTS.md).
FEWER_TOKENS = 8
BLOCK_K = 256
CONSUMERS = 4  # multiplying warpgroups per program, 64 weight rows each
WEIGHT_ROWS_PER_PROGRAM = CONSUMERS * gemm_warp_specialized.ROWS_PER_CONSUMER  # one split per program
# Each stage holds 32 KiB of packed weight, 4 of block scales and 8 of operand (4 in 8 rows) per
# K range in it (44 KiB with one split per program, 68 with 4 in it: with its 12 KiB for the
# sums, 218 of an SM's 227).
STAGES = 3
SPLITS_IN_ONE_PROGRAM = (2, 4)
# At one row only splits of up to this many K tiles are summed in the program: on an H200 the
# linear at one row took 1-7% less time so on weights of 4 and 8 K tiles per split, and 7% more
# on 28672 x 8192 (4 splits of 28), where 16 rows still took 4% less (examples/benchmarks/RESULTS.md).
MOST_K_TILES_SUMMED_IN_PROGRAM_AT_ONE_ROW = 8
CONSUMER_REGISTERS = 112
# Quantizing, the load warpgroup needs more than the 32 registers per thread the consumers' 112
# leave it (Triton sizes it from the kernel's 96): at 104 it gets 64.
QUANTIZING_CONSUMER_REGISTERS = 104
# Parts of a K tile each consumer dequantizes and multiplies in turn, the MMAs of one running
# while the next is dequantized (the MMAs' order, hence the output, unchanged); with the 8-column
# MMA the two forms together took 2-7% off the linear at 1-4 rows; alone, at 16 rows, between 2%
# off and 1% more.
MMA_CHUNKS = 2
THREADS_PER_CONSUMER = 128
# The activations the kernel quantizes itself (one row, ``QUANTIZES``): fp32 ones take the operand
# kernel, this form's output not having been shown equal to it on a GPU for them.
QUANTIZED_DTYPES = (torch.bfloat16, torch.float16)


def takes(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    out: torch.Tensor,
    quantizes: bool = False,
) -> bool:
    """Whether this call's tensors suit the kernel: at most 16 rows of the fp16 operand, or
    (``quantizes``) one contiguous row of the activation itself; TMA reads the operand, the
    packed weight and the block scales from 16-byte aligned rows (the scales' rows are K / 16
    bytes: K a multiple of 256)."""
    if quantizes:
        operand_suits = a.shape[0] == 1 and a.dtype in QUANTIZED_DTYPES and a.stride(1) == 1
    else:
        operand_suits = (
            a.shape[0] <= TOKENS and a.dtype == torch.float16 and a.is_contiguous() and a.data_ptr() % 16 == 0
        )
    return (
        operand_suits
        and weight_qdata.is_contiguous()
        and weight_block_scales.is_contiguous()
        and weight_qdata.data_ptr() % 16 == 0
        and weight_block_scales.data_ptr() % 16 == 0
        and a.shape[1] % BLOCK_K == 0
        and out.stride(1) == 1
    )


def tokens_for(M: int) -> int:
    """The wgmma's N (the operand tile's rows) for ``M`` activation rows."""
    return FEWER_TOKENS if M <= FEWER_TOKENS else TOKENS


def sums_in_program(split_k: int, K: int, M: int) -> bool:
    """Whether the kernel runs ``split_k`` K splits of a ``K``-wide reduction for ``M`` rows in
    one program per row group and sums them there: 2 or 4 splits, of as many K tiles each, at one
    row of at most ``MOST_K_TILES_SUMMED_IN_PROGRAM_AT_ONE_ROW``."""
    k_tiles = ceil_div(K, BLOCK_K)
    if split_k not in SPLITS_IN_ONE_PROGRAM or k_tiles % split_k:
        return False
    return M > 1 or k_tiles // split_k <= MOST_K_TILES_SUMMED_IN_PROGRAM_AT_ONE_ROW


def counters(N: int) -> int:
    """The int32 counters a launch for ``N`` weight rows uses: one per multiplying thread of each
    column tile."""
    return ceil_div(N, WEIGHT_ROWS_PER_PROGRAM) * CONSUMERS * THREADS_PER_CONSUMER


if HAS_GLUON_HOPPER:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

    from nvfp4_static.kernels.act_quantize import in_mma_order, quantize_to_operand_halves
    from nvfp4_static.kernels.gemm_warp_specialized import (
        ROWS,
        TensorDescriptor,
        _dequantize_in_mma_order,
        _store_output_tile,
        gl,
        gluon,
        mbarrier,
        packed_by_block_layout,
        packed_layout,
        partition_barrier,
        tma_load,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    @gluon.constexpr_function
    def sums_shape(consumers, splits_here, tokens):
        """The shared memory in which a program's consumers hand their products to their row
        group's first one (``splits_here`` > 1: one ``[64, tokens]`` fp32 buffer per other
        consumer), else an unused buffer of 8 rows."""
        if splits_here > 1:
            return [consumers - consumers // splits_here, gemm_warp_specialized.ROWS_PER_CONSUMER, tokens]
        return [1, 8, tokens]

    @gluon.jit
    def _wait_for_previous_kernel():
        """Wait until the kernel launched before this one has ended and its writes are visible
        (a no-op unless this kernel was launched to overlap it)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.constexpr_function
    def row_tiles_layout(splits):
        """The activation row's K tiles of ``splits`` splits, ``[splits, BLOCK_K]``: each thread
        holds two columns of every split, so a split's tile is taken out without moving data."""
        return gl.BlockedLayout([splits, 2], [1, 32], [1, 4], [1, 0])

    @gluon.jit
    def _row_tiles(x_ptr, k_first, per_split, i, BK: gl.constexpr, SPLITS_HERE: gl.constexpr):
        """K tile ``i`` of each split the program runs, of the activation's one row."""
        TILES: gl.constexpr = row_tiles_layout(SPLITS_HERE)
        splits = gl.arange(0, SPLITS_HERE, layout=gl.SliceLayout(1, TILES))[:, None]
        columns = gl.arange(0, BK, layout=gl.SliceLayout(0, TILES))[None, :]
        return gl.load(x_ptr + (k_first + splits * per_split + i) * BK + columns)

    @gluon.jit
    def _quantize_into_stage(tiles, act_scale_ptr, a_smem, stage, TOKENS: gl.constexpr, BK: gl.constexpr,
                             SPLITS_HERE: gl.constexpr):
        """Quantize each split's K tile of the activation's row (``tiles``, from ``_row_tiles``)
        into the stage's operand tile of that split (``[TOKENS, BK]``, fp16): its row 0 in the
        MMA order, as the operand kernel writes it (``act_quantize``'s arithmetic, so the same
        values bit for bit), zeros below. One split at a time, to keep few values live."""
        TILES: gl.constexpr = row_tiles_layout(SPLITS_HERE)
        ROW: gl.constexpr = row_tiles_layout(1)
        act_scale = gl.load(act_scale_ptr)
        # Bit patterns, so that taking one split's tile out by a sum of zeros keeps a -0.0.
        bits = tiles.to(gl.float32).to(gl.int32, bitcast=True)
        splits = gl.arange(0, SPLITS_HERE, layout=gl.SliceLayout(1, TILES))[:, None]
        tokens = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, ROW))[:, None]
        for split in gl.static_range(SPLITS_HERE):
            x = gl.sum(gl.where(splits == split, bits, 0), axis=0).to(gl.float32, bitcast=True)
            x = gl.convert_layout(x, gl.SliceLayout(0, ROW))[None, :]
            even, odd = quantize_to_operand_halves(x, act_scale, 1, BK)
            row = gl.convert_layout(in_mma_order(even, odd, 1, BK), ROW)
            a_smem.index(stage * SPLITS_HERE + split).store(gl.where(tokens == 0, row, 0.0).to(gl.float16))

    @gluon.jit
    def _load_weight_tiles(w_desc, s_desc, w_smem, s_smem, bar, stage, i, off_n, k_first, per_split,
                           BK: gl.constexpr, CONSUMERS: gl.constexpr, SPLITS_HERE: gl.constexpr):
        """K tile ``i``'s packed weight rows and block scales of every consumer into ``stage``
        (consumer ``c`` takes row group ``c // SPLITS_HERE`` over split ``c % SPLITS_HERE``)."""
        for c in gl.static_range(CONSUMERS):
            k = (k_first + (c % SPLITS_HERE) * per_split + i) * BK
            rows = off_n + (c // SPLITS_HERE) * ROWS
            tma_load(w_desc, [rows, k // 2], bar, w_smem.index(stage * CONSUMERS + c))
            tma_load(s_desc, [rows, k // 16], bar, s_smem.index(stage * CONSUMERS + c))

    @gluon.jit
    def _load_partition(a_source, w_desc, s_desc, act_scale_ptr, a_smem, w_smem, s_smem, ready, empty, off_n,
                        k_first, per_split, k_tiles, TOKENS: gl.constexpr, BK: gl.constexpr,
                        NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr, SPLITS_HERE: gl.constexpr,
                        QUANTIZES: gl.constexpr):
        """Fill stage ``i % NUM_STAGES`` with K tile ``i`` of each split the program runs once every
        consumer handed it back: each consumer's packed weight rows and block scales, then each
        split's operand tile. The operand is loaded by TMA (``a_source`` its descriptor), or with
        ``QUANTIZES`` quantized here from the activation's one row (``a_source`` its pointer; the
        next K tile's row loaded while this one is quantized), the stage then ready once the
        loads have landed and this partition has arrived. The weight does not depend on the
        kernel before this one (the operand kernel, which may let this one start while it runs),
        so the first tile's weight loads go out before waiting for that kernel, and its operand
        after."""
        weight_bytes: gl.constexpr = CONSUMERS * (w_desc.block_type.nbytes + s_desc.block_type.nbytes)
        if QUANTIZES:
            _wait_for_previous_kernel()
            tiles = _row_tiles(a_source, k_first, per_split, 0, BK, SPLITS_HERE)
            for i in range(k_tiles):
                stage = i % NUM_STAGES
                # A fresh barrier counts as having completed the phase before its first.
                mbarrier.wait(empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, weight_bytes)
                _load_weight_tiles(w_desc, s_desc, w_smem, s_smem, bar, stage, i, off_n, k_first, per_split, BK,
                                   CONSUMERS, SPLITS_HERE)
                this_tile = tiles
                tiles = _row_tiles(a_source, k_first, per_split, gl.minimum(i + 1, k_tiles - 1), BK, SPLITS_HERE)
                _quantize_into_stage(this_tile, act_scale_ptr, a_smem, stage, TOKENS, BK, SPLITS_HERE)
                # Every thread's operand stores are seen by the wgmmas (the async proxy) before
                # the partition's one arrival.
                fence_async_shared()
                partition_barrier()
                mbarrier.arrive(bar, count=1)
        else:
            for i in range(k_tiles):
                stage = i % NUM_STAGES
                mbarrier.wait(empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, weight_bytes + SPLITS_HERE * TOKENS * BK * 2)
                _load_weight_tiles(w_desc, s_desc, w_smem, s_smem, bar, stage, i, off_n, k_first, per_split, BK,
                                   CONSUMERS, SPLITS_HERE)
                if i == 0:
                    _wait_for_previous_kernel()
                for split in gl.static_range(SPLITS_HERE):
                    tma_load(a_source, [0, (k_first + split * per_split + i) * BK], bar,
                             a_smem.index(stage * SPLITS_HERE + split))

    @gluon.jit
    def _multiply_partition(a_smem, w_smem, s_smem, sums_smem, ready, empty, summed, act_scale_ptr, weight_scale_ptr,
                            bias_ptr, out_ptr, partials_ptr, counts_ptr, M, N, stride_om, column, off_n, k_tiles,
                            split, split_k, PART: gl.constexpr, TOKENS: gl.constexpr, BK: gl.constexpr,
                            NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr, SPLITS_HERE: gl.constexpr,
                            WRITE_PARTIALS: gl.constexpr, SUM_SPLITS: gl.constexpr, HAS_BIAS: gl.constexpr,
                            MMA_CHUNKS: gl.constexpr):
        """One consumer warpgroup: the 64 weight rows of its row group (``PART // SPLITS_HERE``)
        over the K tiles of its split, each in ``MMA_CHUNKS`` parts (a part's wgmmas are issued
        before the next part is dequantized, and waited for at the tile's end); then its part of
        the output from this split alone, or its partial products (with ``SUM_SPLITS``, where
        this program stores the column tile's last split, the output from all of them). With the
        program's splits summed in it (``SPLITS_HERE`` > 1) the row group's first consumer waits
        for the others' products in shared memory and stores the output."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TOKENS, 16]
        )
        OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CK: gl.constexpr = BK // MMA_CHUNKS
        PACKED: gl.constexpr = packed_layout(CK)
        BY_BLOCK: gl.constexpr = packed_by_block_layout(CK)
        SCALES: gl.constexpr = gl.SliceLayout(2, BY_BLOCK)
        ROW_GROUP: gl.constexpr = PART // SPLITS_HERE
        SPLIT_HERE: gl.constexpr = PART % SPLITS_HERE
        acc = gl.zeros([ROWS, TOKENS], gl.float32, layout=ACC)
        for i in range(k_tiles):
            stage = i % NUM_STAGES
            mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
            for c in gl.static_range(MMA_CHUNKS):
                packed = w_smem.index(stage * CONSUMERS + PART).slice(c * CK // 2, CK // 2, dim=1).load(PACKED)
                codes = s_smem.index(stage * CONSUMERS + PART).slice(c * CK // 16, CK // 16, dim=1).load(SCALES)
                w = _dequantize_in_mma_order(packed, codes, CK, BY_BLOCK, OPERAND)
                operand = a_smem.index(stage * SPLITS_HERE + SPLIT_HERE).slice(c * CK, CK, dim=1).permute((1, 0))
                acc = warpgroup_mma(w, operand, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(stage), count=1)

        first_row = off_n + ROW_GROUP * ROWS
        if SPLITS_HERE > 1:
            # The row group's other consumers hand their products over in shared memory, each in
            # the accumulator's own layout, so every thread of the first one sums its own elements
            # in split order, as the splits' programs' products are summed.
            if SPLIT_HERE > 0:
                sums_smem.index(ROW_GROUP * (SPLITS_HERE - 1) + SPLIT_HERE - 1).store(acc)
                mbarrier.arrive(summed.index(ROW_GROUP), count=1)
            else:
                mbarrier.wait(summed.index(ROW_GROUP), 0)
                total = gl.zeros([ROWS, TOKENS], gl.float32, layout=ACC) + acc
                for other in gl.static_range(1, SPLITS_HERE):
                    total += sums_smem.index(ROW_GROUP * (SPLITS_HERE - 1) + other - 1).load(ACC)
                _store_output_tile(total, act_scale_ptr, weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, M, N,
                                   stride_om, first_row, 0, 0, HAS_BIAS, False)
        else:
            # From here each thread holds half the tokens of one weight row, (row, half, token)
            # with token TOKENS / 2 * half + t: the same elements in every split's program, so
            # the thread storing a split's partial products and the one summing them in the last
            # split's program are ordered by one counter of their own (release, then acquire),
            # with no barrier.
            BY_ROW: gl.constexpr = gl.BlockedLayout([1, 1, TOKENS // 2], [16, 2, 1], [4, 1, 1], [2, 1, 0])
            ROW_HALVES: gl.constexpr = gl.SliceLayout(2, BY_ROW)
            total = gl.convert_layout(gl.reshape(acc, [ROWS, 2, TOKENS // 2]), BY_ROW)
            row_in_tile = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ROW_HALVES))[:, None]
            half = gl.arange(0, 2, layout=gl.SliceLayout(0, ROW_HALVES))[None, :]
            within = gl.arange(0, TOKENS // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, BY_ROW)))[None, None, :]
            rows = gl.expand_dims(first_row + row_in_tile, 2)
            tokens = gl.expand_dims(half, 2) * (TOKENS // 2) + within
            mask = (rows < N) & (tokens < M)
            EPILOGUE: gl.constexpr = SUM_SPLITS or not WRITE_PARTIALS
            if EPILOGUE:
                # Loaded before the splits are summed, so these loads wait alongside the counter's.
                output_scale = gl.load(act_scale_ptr) * gl.load(weight_scale_ptr)
                if HAS_BIAS:
                    bias = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
            if WRITE_PARTIALS:
                at = tokens * N + rows  # in a split's [M, N] partial products
                gl.store(partials_ptr + split * M * N + at, total, mask=mask)
                if SUM_SPLITS:
                    counter_ptrs = counts_ptr + (column * CONSUMERS + PART) * (ROWS * 2) + row_in_tile * 2 + half
                    one = gl.full([ROWS, 2], 1, gl.int32, ROW_HALVES)
                    arrived = gl.atomic_add(counter_ptrs, one, sem="acq_rel", scope="gpu")
                    last = arrived == split_k - 1
                    mask = mask & gl.expand_dims(last, 2)
                    total = gl.zeros([ROWS, 2, TOKENS // 2], gl.float32, layout=BY_ROW)
                    for s in range(split_k):
                        total += gl.load(partials_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
                    # Left zero for the next launch.
                    gl.store(counter_ptrs, gl.zeros_like(arrived), mask=last)
            if EPILOGUE:
                total = total * output_scale
                if HAS_BIAS:
                    total += bias
                gl.store(out_ptr + tokens.to(gl.int64) * stride_om + rows, total.to(out_ptr.dtype.element_ty),
                         mask=mask)

    @gluon.jit
    def _decode_gemm_kernel(a_source, w_desc, s_desc, act_scale_ptr, weight_scale_ptr, bias_ptr, out_ptr,
                            partials_ptr, counts_ptr, M, N, K, stride_om, split_k,
                            TOKENS: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
                            CONSUMERS: gl.constexpr, SPLITS_HERE: gl.constexpr, WRITE_PARTIALS: gl.constexpr,
                            SUM_SPLITS: gl.constexpr, HAS_BIAS: gl.constexpr, REGISTERS: gl.constexpr,
                            MMA_CHUNKS: gl.constexpr, QUANTIZES: gl.constexpr, OPERAND_LAYOUT: gl.constexpr):
        ROW_GROUPS: gl.constexpr = CONSUMERS // SPLITS_HERE
        column = gl.program_id(0)
        split = gl.program_id(1) * SPLITS_HERE  # the program's first
        off_n = column * (ROW_GROUPS * ROWS)
        tiles_k = gl.cdiv(K, BK)
        per_split = gl.cdiv(tiles_k, split_k)
        k_first = split * per_split
        k_tiles = gl.minimum(per_split, tiles_k - k_first)  # every split's, where a program runs several
        a_smem = gl.allocate_shared_memory(gl.float16, [NUM_STAGES * SPLITS_HERE, TOKENS, BK], OPERAND_LAYOUT)
        w_smem = gl.allocate_shared_memory(gl.uint8, [CONSUMERS * NUM_STAGES, ROWS, BK // 2], w_desc.layout)
        s_smem = gl.allocate_shared_memory(gl.uint8, [CONSUMERS * NUM_STAGES, ROWS, BK // 16], s_desc.layout)
        SUMS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        sums_smem = gl.allocate_shared_memory(gl.float32, sums_shape(CONSUMERS, SPLITS_HERE, TOKENS), SUMS)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        summed = gl.allocate_shared_memory(gl.int64, [ROW_GROUPS, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(NUM_STAGES):
            # Quantizing, the load partition arrives once more, with the operand stored.
            mbarrier.init(ready.index(stage), count=2 if QUANTIZES else 1)
            mbarrier.init(empty.index(stage), count=CONSUMERS)
        if SPLITS_HERE > 1:
            for group in gl.static_range(ROW_GROUPS):
                mbarrier.init(summed.index(group), count=SPLITS_HERE - 1)
        gl.warp_specialize(
            [
                (_load_partition, (a_source, w_desc, s_desc, act_scale_ptr, a_smem, w_smem, s_smem, ready, empty,
                                   off_n, k_first, per_split, k_tiles, TOKENS, BK, NUM_STAGES, CONSUMERS,
                                   SPLITS_HERE, QUANTIZES)),
                (_multiply_partition, (a_smem, w_smem, s_smem, sums_smem, ready, empty, summed, act_scale_ptr,
                                       weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, counts_ptr, M, N, stride_om,
                                       column, off_n, k_tiles, split, split_k, 0, TOKENS, BK, NUM_STAGES,
                                       CONSUMERS, SPLITS_HERE, WRITE_PARTIALS, SUM_SPLITS, HAS_BIAS, MMA_CHUNKS)),
                (_multiply_partition, (a_smem, w_smem, s_smem, sums_smem, ready, empty, summed, act_scale_ptr,
                                       weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, counts_ptr, M, N, stride_om,
                                       column, off_n, k_tiles, split, split_k, 1, TOKENS, BK, NUM_STAGES,
                                       CONSUMERS, SPLITS_HERE, WRITE_PARTIALS, SUM_SPLITS, HAS_BIAS, MMA_CHUNKS)),
                (_multiply_partition, (a_smem, w_smem, s_smem, sums_smem, ready, empty, summed, act_scale_ptr,
                                       weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, counts_ptr, M, N, stride_om,
                                       column, off_n, k_tiles, split, split_k, 2, TOKENS, BK, NUM_STAGES,
                                       CONSUMERS, SPLITS_HERE, WRITE_PARTIALS, SUM_SPLITS, HAS_BIAS, MMA_CHUNKS)),
                (_multiply_partition, (a_smem, w_smem, s_smem, sums_smem, ready, empty, summed, act_scale_ptr,
                                       weight_scale_ptr, bias_ptr, out_ptr, partials_ptr, counts_ptr, M, N, stride_om,
                                       column, off_n, k_tiles, split, split_k, 3, TOKENS, BK, NUM_STAGES,
                                       CONSUMERS, SPLITS_HERE, WRITE_PARTIALS, SUM_SPLITS, HAS_BIAS, MMA_CHUNKS)),
            ],
            [4, 4, 4, 4],
            [REGISTERS, REGISTERS, REGISTERS, REGISTERS],
        )


def kernel_arguments(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    scale_codes: torch.Tensor,
    act_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    partials: Optional[torch.Tensor],
    counts: Optional[torch.Tensor],
    split_k: int,
    overlap: bool = False,
    quantizes: bool = False,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, meta)`` of the kernel's launch in ``split_k`` K splits (the TMA
    descriptors built for these tensors). ``a`` is the fp16 operand, or with ``quantizes`` the
    activation's one row, which the kernel quantizes itself. Without ``partials`` the kernel
    writes ``out``: from one split, or from splits it sums in their programs
    (``sums_in_program``); with ``partials`` (``[split_k, M, N]`` fp32) it writes each split's
    partial products there, and with ``counts`` too (``counters(N)`` int32, zero) the last
    split's program sums them into ``out``. With ``overlap`` the kernel is launched to start
    while the operand kernel before it runs (programmatic dependent launch), its weight loads
    overlapping that kernel."""
    M, K = a.shape
    N = weight_qdata.shape[0]
    if M > (1 if quantizes else TOKENS):
        raise ValueError(
            f"nvfp4_static: the warp-specialized decode GEMM takes at most {TOKENS} rows of its operand, or one "
            f"row of the activation that it quantizes itself; got {M} rows{' to quantize' if quantizes else ''}"
        )
    if partials is None and split_k > 1 and not sums_in_program(split_k, K, M):
        raise ValueError(
            f"nvfp4_static: the decode GEMM in {split_k} K splits of K = {K} at M = {M} needs a buffer for their "
            f"partial products (one program sums {' or '.join(map(str, SPLITS_IN_ONE_PROGRAM))} splits of as many "
            f"K tiles each, at one row of at most {MOST_K_TILES_SUMMED_IN_PROGRAM_AT_ONE_ROW})"
        )
    splits_here = split_k if partials is None else 1
    tokens = tokens_for(M)
    a_layout, w_layout, s_layout = _shared_layouts(tokens)
    rows = gemm_warp_specialized.ROWS_PER_CONSUMER
    a_source = a if quantizes else TensorDescriptor(a, [M, K], [K, 1], [tokens, BLOCK_K], a_layout)
    w_desc = TensorDescriptor(weight_qdata, [N, K // 2], [K // 2, 1], [rows, BLOCK_K // 2], w_layout)
    s_desc = TensorDescriptor(scale_codes, [N, K // 16], [K // 16, 1], [rows, BLOCK_K // 16], s_layout)
    grid = (ceil_div(N * splits_here, WEIGHT_ROWS_PER_PROGRAM), split_k // splits_here, 1)
    unused = act_scale
    args = (a_source, w_desc, s_desc, act_scale, weight_scale, unused if bias is None else bias, out,
            unused if partials is None else partials, unused if counts is None else counts, M, N, K, out.stride(0),
            split_k)
    meta = dict(TOKENS=tokens, BK=BLOCK_K, NUM_STAGES=STAGES, CONSUMERS=CONSUMERS, SPLITS_HERE=splits_here,
                WRITE_PARTIALS=partials is not None,
                SUM_SPLITS=partials is not None and counts is not None, HAS_BIAS=bias is not None,
                REGISTERS=QUANTIZING_CONSUMER_REGISTERS if quantizes else CONSUMER_REGISTERS, MMA_CHUNKS=MMA_CHUNKS,
                QUANTIZES=quantizes, OPERAND_LAYOUT=a_layout,
                num_warps=4, launch_pdl=overlap)
    return grid, args, meta


@lru_cache(maxsize=None)
def _shared_layouts(tokens: int):
    """The TMA tiles' shared-memory layouts for an operand tile of ``tokens`` rows: the
    operand's, the packed weight's, the scales'. Built once each: building them is most of a
    launch's argument preparation."""
    rows = gemm_warp_specialized.ROWS_PER_CONSUMER
    return (
        gl.NVMMASharedLayout.get_default_for([tokens, BLOCK_K], gl.float16),
        gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K // 2], gl.uint8),
        gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K // 16], gl.uint8),
    )


def launch_decode_gemm(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    scale_codes: torch.Tensor,
    act_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    partials: Optional[torch.Tensor],
    counts: Optional[torch.Tensor],
    split_k: int,
    overlap: bool,
    quantizes: bool = False,
) -> None:
    """``out [M, N] = (a @ dequant(W)^T) * act_scale * weight_scale + bias``, or the partial
    products of its ``split_k`` K splits only: ``a`` the fp16 operand in the MMA order (or with
    ``quantizes`` the activation's one row), ``scale_codes`` the block scales as bytes, both
    global scales fp32 ``[1]``; ``partials``, ``counts`` and ``overlap`` as ``kernel_arguments``
    takes them. The caller has checked ``gemm_warp_specialized.available`` and ``takes``."""
    grid, args, meta = kernel_arguments(
        a, weight_qdata, scale_codes, act_scale, weight_scale, bias, out, partials, counts, split_k, overlap,
        quantizes,
    )
    workspace = () if counts is None else (counts,)
    launch_prepared(KernelCall(_decode_gemm_kernel, grid, args, meta, workspace), a.device)
