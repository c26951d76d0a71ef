"""The warp-specialized Hopper decode tile (``kernels.gemm_decode_warp_specialized``, Gluon).

Gluon kernels do not run in Triton's interpreter: on any machine the kernel is built for sm_90a
and its build checked, and the table's choice of it is checked with the GPU stood in; on a
Hopper GPU its output is compared with the Triton kernel's for the same tile
(``gemm.DECODE_TILE_IN_TRITON``, itself tested against the torch reference on the CPU through the
interpreter), bit for bit, and with a float64 reference.
"""

import contextlib
import re
from dataclasses import replace

import pytest
import torch
from conftest import PassThrough, gpu_tolerance, relative_error, requires_cuda
from test_kernels_gemm import gemm_operands, raw_gemm_operands, reference_gemm
from test_kernels_gemm_warp_specialized import (
    H100_SHARED_BYTES_PER_BLOCK,
    counting_launches,
    needs_gluon_hopper,
    requires_hopper,
)

from nvfp4_static.kernels import gemm, gemm_decode_warp_specialized, gemm_warp_specialized, ops
from nvfp4_static.kernels.act_quantize import launch_activation_quantize
from nvfp4_static.kernels.gemm import (
    DECODE_TILE,
    DECODE_TILE_AT_ONE_ROW,
    DECODE_TILE_IN_TRITON,
    CublasAfterDequantize,
    activation_operand_dtype,
    config_for_width,
    eager_quantizing_tiles,
    gemm_bucket,
    gemm_config,
    launch_nvfp4_gemm,
    operand_config,
    operand_in_mma_order,
    quantizes_activation_in_gemm,
    quantizes_eagerly,
    table_config,
)
from nvfp4_static.kernels.launch import KernelCall

decode = gemm_decode_warp_specialized
CUDA = torch.device("cuda", 0)


def kernel_call_tensors(M: int, N: int, K: int) -> tuple:
    """CPU stand-ins for a decode-tile launch of ``M`` rows on an ``[N, K]`` weight: the fp16
    operand, the packed weight, its scale codes, a global scale and a bf16 output."""
    a = torch.zeros(M, K, dtype=torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    codes = torch.zeros(N, K // 16, dtype=torch.uint8)
    return a, qdata, codes, torch.ones(1), torch.empty(M, N, dtype=torch.bfloat16)


def decode_tile_for(M: int, one_row=DECODE_TILE_AT_ONE_ROW):
    """The decode tile the table runs for ``M`` rows: at one row ``one_row``."""
    return one_row if M == 1 else DECODE_TILE


def test_only_the_kernels_own_tile_may_ask_for_it():
    for other in (
        replace(DECODE_TILE_IN_TRITON, block_m=32),
        replace(DECODE_TILE_IN_TRITON, block_n=128),
        replace(DECODE_TILE_IN_TRITON, block_k=128),
        replace(DECODE_TILE_IN_TRITON, num_warps=8),
        replace(DECODE_TILE_IN_TRITON, programs_per_sm=2),
        replace(DECODE_TILE_IN_TRITON, mma_order=False),
        replace(DECODE_TILE_IN_TRITON, weight_as_mma_a=False),
        replace(DECODE_TILE_IN_TRITON, activation_rows=2),
        replace(DECODE_TILE_IN_TRITON, activation_rows=16),
        replace(DECODE_TILE_IN_TRITON, activation_rows=1, block_n=128),
        replace(DECODE_TILE_IN_TRITON, fill_programs_per_sm=8),
    ):
        with pytest.raises(ValueError, match="warp_specialized runs gemm_warp_specialized's kernel"):
            replace(other, warp_specialized=True)
    assert replace(DECODE_TILE_IN_TRITON, warp_specialized=True) == DECODE_TILE
    # The kernel also quantizes one activation row itself.
    assert replace(DECODE_TILE_IN_TRITON, activation_rows=1, warp_specialized=True) == DECODE_TILE_AT_ONE_ROW
    # Each program of the kernel holds four of the Triton tile's: its split is theirs at four per SM.
    assert (DECODE_TILE.block_m, DECODE_TILE.block_k) == (decode.TOKENS, decode.BLOCK_K)
    assert DECODE_TILE.programs_per_sm * DECODE_TILE.block_n == decode.WEIGHT_ROWS_PER_PROGRAM


def test_a_width_without_the_mma_order_runs_the_triton_tile():
    assert config_for_width(DECODE_TILE, 8192).warp_specialized
    assert config_for_width(DECODE_TILE, 8208) == replace(DECODE_TILE, mma_order=False, warp_specialized=False)


def test_takes_only_what_tma_can_read():
    """At most 16 rows; the operand fp16, contiguous, 16-byte aligned; K a multiple of 256 (the
    block scales' rows 16-byte aligned); the weight and its scales contiguous and aligned; the
    output's rows contiguous."""
    M, N, K = 16, 64, 512
    a = torch.zeros(M, K, dtype=torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    scales = torch.zeros(N, K // 16, dtype=torch.float8_e4m3fn)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    assert decode.takes(a, qdata, scales, out)
    assert decode.takes(a[:1], qdata, scales, out[:1])
    unaligned = torch.zeros(M * K + 4, dtype=torch.float16)[4:].view(M, K)
    unaligned_weight = torch.zeros(N * K // 2 + 8, dtype=torch.uint8)[8:].view(N, K // 2)
    unaligned_scales = torch.zeros(N * K // 16 + 8, dtype=torch.float8_e4m3fn)[8:].view(N, K // 16)
    narrow = torch.zeros(M, K + 256, dtype=torch.float16)
    K_off = 544  # a multiple of 32, not of 256: the scales' rows are 34 bytes
    for refused in (
        (torch.zeros(17, K, dtype=torch.float16), qdata, scales, torch.empty(17, N, dtype=torch.bfloat16)),
        (a.bfloat16(), qdata, scales, out),
        (a.float(), qdata, scales, out),
        (torch.zeros(K, M, dtype=torch.float16).t(), qdata, scales, out),
        (unaligned, qdata, scales, out),
        (narrow[:, 256:], qdata, scales, out),
        (
            torch.zeros(M, K_off, dtype=torch.float16),
            torch.zeros(N, K_off // 2, dtype=torch.uint8),
            torch.zeros(N, K_off // 16, dtype=torch.float8_e4m3fn),
            out,
        ),
        (a, torch.zeros(K // 2, N, dtype=torch.uint8).t(), scales, out),
        (a, unaligned_weight, scales, out),
        (a, qdata, torch.zeros(K // 16, N, dtype=torch.float8_e4m3fn).t(), out),
        (a, qdata, unaligned_scales, out),
        (a, qdata, scales, torch.empty(N, M, dtype=torch.bfloat16).t()),
    ):
        assert not decode.takes(*refused)


@pytest.mark.parametrize(
    "split,K,quantizes",
    [(1, 8192, True), (8, 4096, True), (3, 8192, True), (4, 28672, True), (4, 8192, False), (2, 4096, False),
     (2, 4608, True)],
    ids=str,
)
def test_at_one_row_the_decode_tile_quantizes_where_each_program_runs_one_split(split, K, quantizes):
    """Where a program sums 2 or 4 splits of at most 8 K tiles at one row (``sums_in_program``; 2
    of 9 it does not) its load warpgroup would quantize that many K tiles per stage: the decode
    tile then takes the operand kernel's operand; else it quantizes its row itself."""
    expected = DECODE_TILE_AT_ONE_ROW if quantizes else DECODE_TILE
    assert gemm.decode_tile_for_one_row(split, K) == expected
    assert decode.sums_in_program(split, K, 1) != quantizes


def test_takes_one_contiguous_row_of_a_bf16_or_fp16_activation_to_quantize():
    """Quantizing, the kernel reads the activation's one row with plain loads: bf16 or fp16 (fp32
    keeps the operand kernel's route, not shown equal on a GPU), contiguous along K; never more
    rows, and never the fp16 operand's form in its place."""
    N, K = 64, 512
    _, qdata, scales, _, out = kernel_call_tensors(1, N, K)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.zeros(1, K, dtype=dtype)
        assert decode.takes(x, qdata, scales, out, quantizes=True)
        assert decode.takes(torch.zeros(1, K + 8, dtype=dtype)[:, 8:], qdata, scales, out, quantizes=True)
    refused = [
        torch.zeros(1, K, dtype=torch.float32),
        torch.zeros(2, K, dtype=torch.bfloat16),
        torch.zeros(16, K, dtype=torch.bfloat16),
        torch.zeros(1, 2 * K, dtype=torch.bfloat16)[:, ::2],
        torch.zeros(1, K, dtype=torch.int32),
    ]
    for x in refused:
        assert not decode.takes(x, qdata, scales, out[: x.shape[0]], quantizes=True), (x.dtype, x.shape, x.stride())
    assert not decode.takes(torch.zeros(1, K, dtype=torch.bfloat16), qdata, scales, out)


@needs_gluon_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_arguments_hand_the_quantizing_kernel_the_activation_itself(dtype):
    """The activation's row goes to the kernel as it is (no descriptor: the load warpgroup reads
    it with plain loads), the 8-row operand tile in the same shared layout as TMA's."""
    N, K = 64, 512
    _, qdata, codes, scale, out = kernel_call_tensors(1, N, K)
    x = torch.zeros(1, K, dtype=dtype)
    _, args, meta = decode.kernel_arguments(x, qdata, codes, scale, scale, None, out, None, None, 1, False, True)
    assert args[0] is x and meta["QUANTIZES"] and meta["TOKENS"] == decode.FEWER_TOKENS
    operand = torch.zeros(1, K, dtype=torch.float16)
    _, operand_args, operand_meta = decode.kernel_arguments(operand, qdata, codes, scale, scale, None, out, None, None, 1)
    assert not operand_meta["QUANTIZES"] and operand_args[0].base is operand
    assert meta["OPERAND_LAYOUT"] == operand_meta["OPERAND_LAYOUT"] == operand_args[0].layout


@needs_gluon_hopper
@pytest.mark.parametrize("M", [2, 4, 16])
def test_kernel_arguments_refuse_to_quantize_more_than_one_row(M):
    N, K = 64, 512
    _, qdata, codes, scale, out = kernel_call_tensors(M, N, K)
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"or one row of the activation that it quantizes itself; got {M} rows to quantize"):
        decode.kernel_arguments(x, qdata, codes, scale, scale, None, out, None, None, 1, False, True)


def test_counters_one_per_multiplying_thread_of_each_column_tile():
    assert decode.counters(256) == 4 * 128
    assert decode.counters(257) == 2 * 4 * 128
    assert decode.counters(8192) == 32 * 4 * 128


def stand_in_hopper(monkeypatch, capturing: bool = False) -> None:
    """The table's view of a CUDA device stood in on the CPU: 132 SMs, the Gluon kernels
    available, and the current stream captured into a CUDA graph or not."""
    monkeypatch.setattr(gemm, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(gemm.gemm_warp_specialized, "available", lambda device: device.type == "cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)


def test_eagerly_the_decode_tile_serves_up_to_16_rows_where_each_split_has_16_k_tiles(monkeypatch):
    """At 132 SMs (four 64-row programs each), weights as (N, K): (28672, 8192) runs K unsplit
    (32 K tiles of 256 each), (8192, 28672) in 4 splits (28), (28672, 4096) unsplit (16): the
    decode tile at 1-16 rows eagerly (at one row quantizing its row itself: each program runs one
    split). Not (28672, 3840) (15 K tiles), (8192, 8192) (4 splits of
    8), (14336, 4096) (2 of 8), (4096, 14336) (8 of 7), (4096, 4096) (8 of 2), not where K is no
    whole number of K tiles, not from 17 rows, not off Hopper, not on the interpreter's CPU
    tensors."""
    stand_in_hopper(monkeypatch)
    assert gemm.split_k_for(DECODE_TILE, 28672, 8192, CUDA) == 1
    assert gemm.split_k_for(DECODE_TILE, 8192, 28672, CUDA) == 4
    assert gemm.split_k_for(DECODE_TILE, 28672, 4096, CUDA) == 1
    assert gemm.split_k_for(DECODE_TILE, 8192, 8192, CUDA) == 4
    assert gemm.split_k_for(DECODE_TILE, 4096, 14336, CUDA) == 8
    for N, K in ((28672, 8192), (8192, 28672), (28672, 4096)):
        for M in (1, 2, 4, 5, 16):
            assert table_config(M, None, N, K, CUDA) == decode_tile_for(M), (N, K, M)
        assert table_config(17, None, N, K, CUDA) == gemm_config(17)
    for N, K in ((28672, 3840), (8192, 8192), (14336, 4096), (4096, 14336), (4096, 4096)):
        for M in (1, 4, 16):
            assert table_config(M, None, N, K, CUDA) == gemm_config(M), (N, K, M)
    assert table_config(16, None, 28672, 8192, torch.device("cpu")) == gemm_config(16)
    assert table_config(1, gemm_bucket(16), 28672, 8192, CUDA) == DECODE_TILE  # the bucket decides
    assert table_config(16, None, 28672, 8448 + 32, CUDA) == config_for_width(gemm_config(16), 8480)  # not whole K tiles
    monkeypatch.setattr(gemm.gemm_warp_specialized, "available", lambda device: False)
    assert table_config(16, None, 28672, 8192, CUDA) == gemm_config(16)


def test_eager_calls_of_2_to_16_rows_quantize_in_the_gemm_where_an_entry_would_take_the_operand(monkeypatch):
    """Eagerly, where the table's entry would run after the operand kernel (2-16 rows of a bf16 or
    fp16 activation, the decode tile not taken), a call quantizes its rows in the GEMM with the
    one-row entry's tiles, M rounded up to a power of 2 rows: one launch. Not at one row (its
    entry quantizes already), not from 17 rows, not for fp32 activations, not where eager calls
    take the decode tile ((28672, 8192): 32 K tiles), not while traced nor while captured into a
    CUDA graph (there GPU time decides)."""
    stand_in_hopper(monkeypatch)
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

    def quantizes(M, N, K, dtype=bf16):
        return quantizes_eagerly(M, dtype, operand_config(gemm_bucket(M), N, K, CUDA), CUDA)

    for M, rows in ((2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16)):
        assert eager_quantizing_tiles(M) == replace(gemm_config(1), activation_rows=rows), M
        for N, K in ((4096, 4096), (8192, 8192), (4096, 14336), (12288, 4096), (1024, 2048), (96, 48)):
            assert quantizes(M, N, K) and quantizes(M, N, K, fp16), (M, N, K)
            assert not quantizes(M, N, K, fp32), (M, N, K)
    assert not quantizes(1, 4096, 4096)
    for M in (17, 32, 600):
        assert not quantizes(M, 4096, 4096), M
    assert not quantizes_eagerly(16, bf16, CublasAfterDequantize(), CUDA)
    for M in (2, 16):
        assert operand_config(gemm_bucket(M), 28672, 8192, CUDA) == DECODE_TILE and not quantizes(M, 28672, 8192)
        with PassThrough():
            assert not quantizes_eagerly(M, bf16, gemm_config(M), CUDA)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for M in (2, 4, 16):
        assert not quantizes_eagerly(M, bf16, gemm_config(M), CUDA)


@pytest.mark.parametrize("M", [0, 17, 64, -1])
def test_the_gemm_quantizes_1_to_16_rows_itself_and_refuses_more(M):
    with pytest.raises(ValueError, match=f"1 to 16 activation rows itself, got M = {M}"):
        eager_quantizing_tiles(M)


@pytest.mark.parametrize("graph", ["traced", "captured"])
def test_in_a_graph_the_decode_tile_serves_from_6_k_tiles_at_one_row_on_most_sms(graph, monkeypatch):
    """In a traced graph, or while eager calls are captured into a CUDA graph, the decode tile
    serves 2-16 rows where each split has 6 K tiles or more: (N, K) = (8192, 8192) in 4 splits
    of 8 K tiles (128 programs), (14336, 4096) in 2 of 8 (112), (4096, 14336) in 8 of 7 (128),
    (12288, 4096) in 2 of 8 (96); not (4096, 4096) (8 of 2) nor (5120, 5120) (5 of 4). At one row
    its programs must also fill 80% of the SMs (132 here, one program each), which leaves
    (12288, 4096) on the entry, unless each split has the eager rule's 16 K tiles: (22016, 4096)
    unsplit (86 programs). At one row the decode tile quantizes its row itself where each program
    runs one split ((4096, 14336), (22016, 4096)), and takes the operand kernel's operand where a
    program sums its 2 or 4 splits ((8192, 8192), (14336, 4096)). Off Hopper neither takes it."""
    stand_in_hopper(monkeypatch, capturing=graph == "captured")

    def tiles(M, N, K):
        in_graph = graph == "traced"
        operand = operand_config(gemm_bucket(M), N, K, CUDA, in_graph=in_graph)
        return operand if in_graph else table_config(M, None, N, K, CUDA)

    assert gemm.split_k_for(DECODE_TILE, 12288, 4096, CUDA) == 2
    for N, K, one_row in ((8192, 8192, DECODE_TILE), (14336, 4096, DECODE_TILE), (4096, 14336, DECODE_TILE_AT_ONE_ROW)):
        for M in (1, 4, 16):
            assert tiles(M, N, K) == decode_tile_for(M, one_row), (N, K, M)
    for M in (4, 16):
        assert tiles(M, 12288, 4096) == DECODE_TILE
    assert tiles(1, 12288, 4096) == gemm_config(1)
    assert gemm.split_k_for(DECODE_TILE, 22016, 4096, CUDA) == 1
    assert tiles(1, 22016, 4096) == DECODE_TILE_AT_ONE_ROW
    for N, K in ((4096, 4096), (5120, 5120)):
        for M in (1, 4, 16):
            assert tiles(M, N, K) == gemm_config(M), (N, K, M)
    assert tiles(17, 8192, 8192) == gemm_config(17)
    monkeypatch.setattr(gemm.gemm_warp_specialized, "available", lambda device: False)
    assert tiles(16, 8192, 8192) == gemm_config(16)


def test_a_capture_check_is_made_only_where_the_decode_tile_could_run(monkeypatch):
    """The capture query costs host time on every eager call through the table: it is asked only
    where the decode tile could serve (a decode bucket, whole K tiles, Hopper), never while
    torch traces, and never for a CPU tensor."""
    asked = []
    stand_in_hopper(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(1) or False)
    table_config(17, None, 8192, 8192, CUDA)
    table_config(16, None, 8192, 8192, torch.device("cpu"))
    table_config(16, None, 8192, 8208, CUDA)
    with PassThrough():  # traced: the route says itself that it builds a graph
        assert table_config(16, None, 8192, 8192, CUDA) == gemm_config(16)
    assert asked == []
    table_config(16, None, 8192, 8192, CUDA)
    assert asked == [1]


def test_where_a_traced_route_keeps_the_entry_the_ops_it_traces_keep_it_too(monkeypatch):
    """Traced, the route chooses by the graphs' rule (``in_graph``) and hands an entry's operand
    to the GEMM ops, whose traced bodies choose by the eager rule: wherever the first keeps the
    entry, so must the second, or the op would get another tile's operand. Over weights on both
    sides of the K-tile and SM-fill thresholds, (22016, 4096) among them (16 K tiles unsplit,
    86 programs of 132: the fill condition alone would keep the entry at one row)."""
    stand_in_hopper(monkeypatch)
    shapes = [(22016, 4096), (12288, 4096), (8192, 8192), (28672, 4096), (28672, 3840), (4096, 4096), (5120, 5120)]
    entries_kept = 0
    for N, K in shapes:
        for max_m in gemm.DECODE_TILE_BUCKETS:
            bucket = gemm_bucket(max_m)
            with PassThrough():
                traced_route = operand_config(bucket, N, K, CUDA, in_graph=True)
                traced_op = table_config(max_m, bucket, N, K, CUDA)
            if not gemm.is_decode_tile(traced_route):
                assert traced_op == traced_route, (N, K, max_m)
                entries_kept += 1
    assert entries_kept >= len(gemm.DECODE_TILE_BUCKETS)  # (4096, 4096) keeps the entry in every bucket


@pytest.mark.parametrize("N", [8192, 28672], ids=str)
@pytest.mark.parametrize("K", [8192, 8224], ids=str)
@pytest.mark.parametrize("max_m", gemm.DECODE_TILE_BUCKETS, ids=str)
@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "captured"])
def test_operand_config_names_the_decode_tiles_operand_where_it_runs(capturing, max_m, K, N, monkeypatch):
    """The route prepares the operand from ``operand_config``: where the table runs the decode
    tile, the operand is the decode tile's (quantized by the operand kernel, fp16, MMA order; at
    one row of 28672 x 8192, one split per program, the raw activation, which it quantizes
    itself, as the M = 1 entry does), even where the entry it replaces takes another (the M = 1
    entry takes the raw activation where the decode tile on 8192 x 8192 sums its 4 splits in the
    program after the operand kernel; the M <= 4 entry's operand is not in the MMA order); eager
    calls captured into a CUDA graph alike, on the graphs' rule (8192 x 8192 too, at one row as
    well)."""
    stand_in_hopper(monkeypatch, capturing)
    bucket = gemm_bucket(max_m)
    for device in (CUDA, torch.device("cpu")):
        operand = operand_config(bucket, N, K, device)
        tile = table_config(max_m, None, N, K, device)
        assert quantizes_activation_in_gemm(operand) == quantizes_activation_in_gemm(tile)
        assert operand_in_mma_order(operand) == operand_in_mma_order(tile)
        for scale in (None, 1e-3):
            assert activation_operand_dtype(operand, torch.bfloat16, scale, None) == activation_operand_dtype(
                tile, torch.bfloat16, scale, None
            )
    runs_it = K == 8192 and (N == 28672 or capturing)
    one_row = DECODE_TILE_AT_ONE_ROW if N == 28672 else DECODE_TILE
    assert (operand_config(bucket, N, K, CUDA) == decode_tile_for(max_m, one_row)) == runs_it
    quantizes = max_m == 1 and (not runs_it or one_row == DECODE_TILE_AT_ONE_ROW)
    assert quantizes_activation_in_gemm(operand_config(bucket, N, K, CUDA)) == quantizes
    assert operand_in_mma_order(operand_config(gemm_bucket(4), 28672, 8192, CUDA))
    assert not operand_in_mma_order(operand_config(gemm_bucket(4), 28672, 8192, torch.device("cpu")))


@needs_gluon_hopper
@pytest.mark.parametrize(
    "split_k,sums",
    [(1, False), (4, True), (4, False), (1, None), (4, "in program"), (2, "in program")],
    ids=["one-split", "sums", "products", "products-1", "in-program-4", "in-program-2"],
)
@pytest.mark.parametrize("M,quantizes", [(16, False), (1, False), (1, True)], ids=["16-rows", "1-row", "1-row-quantizing"])
def test_sm90a_build_keeps_five_warpgroups_without_spills(split_k, sums, M, quantizes, tmp_path):
    """ptxas builds the kernel for sm_90a with a loading and four multiplying warpgroups
    (setmaxnreg to the consumers' registers, fewer where the load warpgroup quantizes), the weight as the register operand of m64n16k16
    wgmmas (m64n8k16 for one row, one shape per build), nothing spilled, its stages (and,
    summing splits in one program, the buffers its consumers sum through) within one SM's shared
    memory; summing a split K across programs, the counters are taken with acquire-release atomics; writing the partial products only (``sums``
    False, or None for one split) or summing in one program it takes no counters. Each form
    stores to the output or to the partial products, not both. Quantizing its one row, the load
    warpgroup loads no operand by TMA: it quantizes the row (correctly rounded divisions, as
    ``act_quantize``) and fences its shared-memory stores before the wgmmas read them; summing
    across programs Triton 3.6's ptxas then spills one 4-byte value of the kernel's prologue
    (stored before the warpgroups part, loaded once by a multiplying one before its K loop)."""
    from test_gemm_hopper_code import build_for_sm90
    from triton.experimental.gluon._runtime import GluonASTSource

    N, K = 4096, 4096
    tokens = 16 if M == 16 else 8
    a, qdata, codes, scale, out = kernel_call_tensors(M, N, K)
    a = a.to(torch.bfloat16) if quantizes else a
    bias = torch.zeros(N, dtype=torch.bfloat16)
    in_program = sums == "in program"
    partials = None if (sums is False and split_k == 1) or in_program else torch.zeros(split_k, M, N)
    counts = torch.zeros(decode.counters(N), dtype=torch.int32) if sums is True else None
    _, args, meta = decode.kernel_arguments(
        a, qdata, codes, scale, scale, bias, out, partials, counts, split_k, not quantizes, quantizes
    )
    assert meta["launch_pdl"] != quantizes
    assert meta["SPLITS_HERE"] == (split_k if in_program else 1)
    kernel = decode._decode_gemm_kernel
    values = dict(zip(kernel.arg_names, args), **{k: v for k, v in meta.items() if k in kernel.arg_names})
    options = {k: v for k, v in meta.items() if k not in kernel.arg_names}
    build = build_for_sm90(kernel, values, options, tmp_path, GluonASTSource)
    ptx, report = build.ptx, build.report
    assert build.num_warps == 20
    registers = decode.QUANTIZING_CONSUMER_REGISTERS if quantizes else decode.CONSUMER_REGISTERS
    assert meta["REGISTERS"] == registers and f"setmaxnreg.inc.sync.aligned.u32 \t{registers};" in ptx
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tokens}k16\.f32\.f16\.f16 \{{[^}}]*\}}, \{{%r", ptx)
    assert len(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))) == 1
    assert "ld.local" not in ptx and "st.local" not in ptx
    spilled = re.search(r" (\d+) bytes spill stores", report)
    assert spilled is None or int(spilled.group(1)) in ((0, 4) if quantizes and sums is True else (0,)), report
    assert ("atom.global.gpu.acq_rel.add" in ptx) == (sums is True)
    # The output is bf16 (16-bit stores), the partial products fp32.
    assert bool(re.search(r"st\.global(\.[a-z0-9]+)*\.b16", ptx)) == (partials is None or sums is True)
    assert bool(re.search(r"st\.global(\.[a-z0-9]+)*\.(b32|f32)", ptx)) == (partials is not None)
    # Launched to overlap the operand kernel: the loading warpgroup waits for that kernel after
    # the first stage's weight and scale loads (one of each per consumer), before the operand's
    # (one per split the program runs), which follow the wait or sit in the block it jumps to.
    # Quantizing, it reads the activation after the wait, before any stage's loads.
    splits_here = meta["SPLITS_HERE"]
    wait = ptx.index("griddepcontrol.wait")
    if quantizes:
        assert "cp.async.bulk.tensor" not in ptx[:wait] and "ld.global" not in ptx[:wait]
    else:
        assert ptx[ptx.rindex("mbarrier.try_wait", 0, wait) : wait].count("cp.async.bulk.tensor") == 2 * decode.CONSUMERS
        assert tma_loads_after_the_wait(ptx) == splits_here
    assert ("div.rn.f32" in ptx) == ("fence.proxy.async" in ptx) == quantizes
    stage_bytes = splits_here * tokens * decode.BLOCK_K * 2 + decode.WEIGHT_ROWS_PER_PROGRAM * (
        decode.BLOCK_K // 2 + decode.BLOCK_K // 16
    )
    summing_bytes = (decode.CONSUMERS - decode.CONSUMERS // splits_here) * 64 * tokens * 4
    assert decode.STAGES * stage_bytes + summing_bytes <= build.shared_bytes <= H100_SHARED_BYTES_PER_BLOCK


def tma_loads_after_the_wait(ptx: str) -> int:
    """The TMA loads issued after ``griddepcontrol.wait`` up to the next branch or barrier wait,
    following an unconditional branch right after it."""
    code = re.sub(r"//[^\n]*", "", ptx)
    rest = code[code.index("griddepcontrol.wait") :].split("\n", 1)[1]
    jump = re.match(r"\s*bra(?:\.uni)?\s+(\$L__\w+);", rest)
    if jump:
        rest = code[code.index(jump.group(1) + ":") :]
    return rest[: re.search(r"\bbra\b|mbarrier\.try_wait", rest).start()].count("cp.async.bulk.tensor")


@needs_gluon_hopper
@pytest.mark.parametrize("M", [17, 32, 256])
def test_kernel_arguments_refuse_more_than_16_rows(M):
    N, K = 64, 256
    a, qdata, _, scale, out = kernel_call_tensors(M, N, K)
    with pytest.raises(ValueError, match=rf"at most 16 rows of its operand, .* got {M} rows$"):
        decode.kernel_arguments(a, qdata, qdata, scale, scale, None, out, out, scale, 1)


@pytest.mark.parametrize(
    "split_k,K,M", [(3, 2304, 4), (5, 2560, 4), (8, 2048, 4), (2, 2304, 4), (4, 2560, 4), (2, 4608, 1), (4, 9216, 1)],
    ids=str,
)
def test_kernel_arguments_refuse_splits_without_a_buffer_for_their_products(split_k, K, M):
    """Without a buffer the kernel sums only 2 or 4 splits of as many K tiles each, in one
    program, and at one row only splits of up to 8 K tiles (2304 = 9 K tiles, 2560 = 10, 4608 =
    18, 9216 = 36)."""
    N = 64
    a, qdata, _, scale, out = kernel_call_tensors(M, N, K)
    assert not decode.sums_in_program(split_k, K, M)
    with pytest.raises(ValueError, match=rf"in {split_k} K splits of K = {K} at M = {M} needs a buffer for their"):
        decode.kernel_arguments(a, qdata, qdata, scale, scale, None, out, None, None, split_k)


def test_up_to_8_rows_take_an_8_column_mma():
    assert [decode.tokens_for(M) for M in range(1, 17)] == [8] * 8 + [16] * 8


@needs_gluon_hopper
@pytest.mark.parametrize("M,tokens", [(1, 8), (5, 8), (8, 8), (9, 16), (16, 16)], ids=str)
@pytest.mark.parametrize("split_k", [1, 4], ids=str)
def test_kernel_arguments_size_the_operand_tile_and_the_mma_for_the_rows(M, tokens, split_k):
    """The operand's TMA tile has as many rows as the wgmma has columns: 8 for up to 8 rows, 16
    above (the rows past M read as zeros)."""
    N, K = 512, 2048
    a, qdata, codes, scale, out = kernel_call_tensors(M, N, K)
    _, args, meta = decode.kernel_arguments(a, qdata, codes, scale, scale, None, out, None, None, split_k)
    assert meta["TOKENS"] == tokens
    assert list(args[0].block_shape) == [tokens, decode.BLOCK_K]
    assert list(args[0].shape) == [M, K]


def test_one_row_sums_in_the_program_only_splits_of_up_to_8_k_tiles():
    """At one row 4 splits of 28 K tiles (28672 x 8192) are summed across programs, which was
    faster there; from two rows in the program. Splits of 8 K tiles or fewer are summed in the
    program at every M."""
    assert not decode.sums_in_program(4, 28672, 1)
    assert decode.sums_in_program(4, 28672, 2) and decode.sums_in_program(4, 28672, 16)
    assert not decode.sums_in_program(2, 4352, 1)  # 17 K tiles: uneven at any M
    assert not decode.sums_in_program(2, 4608, 1) and decode.sums_in_program(2, 4608, 2)  # 9 each
    for M in (1, 4, 16):
        assert decode.sums_in_program(4, 8192, M) and decode.sums_in_program(2, 4096, M)
        assert decode.sums_in_program(4, 4096, M)  # 4 each


@needs_gluon_hopper
@pytest.mark.parametrize("split_k,K,programs", [(2, 2048, 8), (4, 2048, 16), (4, 4096, 16), (2, 2560, 8)], ids=str)
def test_splits_summed_in_program_take_one_program_per_row_group(split_k, K, programs):
    """2 or 4 splits of as many K tiles each, without a buffer: one program per 256 / split
    weight rows runs all of them (its consumers in 4 / split row groups), on a grid of one split;
    with a buffer, one program per split."""
    M, N = 4, 1024
    a, qdata, codes, scale, out = kernel_call_tensors(M, N, K)
    assert decode.sums_in_program(split_k, K, M)
    grid, _, meta = decode.kernel_arguments(a, qdata, codes, scale, scale, None, out, None, None, split_k)
    assert grid == (programs, 1, 1) and meta["SPLITS_HERE"] == split_k
    assert not meta["WRITE_PARTIALS"] and not meta["SUM_SPLITS"]
    partials = torch.zeros(split_k, M, N)
    grid, _, meta = decode.kernel_arguments(a, qdata, codes, scale, scale, None, out, partials, None, split_k)
    assert grid == (N // decode.WEIGHT_ROWS_PER_PROGRAM, split_k, 1) and meta["SPLITS_HERE"] == 1


def test_the_partial_products_op_refuses_cpu_tensors_and_its_fake_gives_the_shape():
    M, N, K = 5, 64, 256
    op = torch.ops.nvfp4_static.decode_gemm_partial_products.default
    a = torch.zeros(M, K, dtype=torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    codes = torch.zeros(N, K // 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="decode_gemm_partial_products runs on CUDA tensors, got cpu"):
        op(a, qdata, codes, 2)
    for split_k in (1, 3):
        fake = op(a.to("meta"), qdata.to("meta"), codes.to("meta"), split_k)
        assert fake.shape == (split_k, M, N) and fake.dtype == torch.float32
    linear = torch.ops.nvfp4_static.decode_linear_partial_products.default
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="decode_linear_partial_products runs on CUDA tensors, got cpu"):
        linear(x, torch.ones(1), qdata, codes, 2)
    fake = linear(x.to("meta"), torch.ones(1, device="meta"), qdata.to("meta"), codes.to("meta"), 3)
    assert fake.shape == (3, M, N) and fake.dtype == torch.float32


class DecodeLaunchesStoodIn:
    """The operand kernel's and the decode tile's launches on the CPU, recorded in order: the
    first writes 1 into the operand, the second split s's products as s + 1."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(gemm_warp_specialized, "available", lambda device: True)
        monkeypatch.setattr(decode, "takes", lambda a, qdata, scales, out, quantizes=False: True)
        monkeypatch.setattr(decode, "launch_decode_gemm", self.gemm)
        monkeypatch.setattr(ops, "launch_activation_quantize", self.quantize)
        monkeypatch.setattr(ops, "_require_cuda", lambda a, name: None)

    def quantize(self, x, per_tensor_scale, qdata, block_scales, operand, mma_order=False):
        self.calls.append(("quantize", x, per_tensor_scale, operand, mma_order))
        operand.fill_(1.0)

    def gemm(self, a, qdata, codes, act_scale, weight_scale, bias, out, partials, counts, split_k, overlap,
             quantizes=False):
        self.calls.append(("gemm", a.clone(), counts, split_k, overlap, quantizes, act_scale))
        for split in range(split_k):
            partials[split].fill_(split + 1.0)


def test_the_linear_op_quantizes_then_starts_the_decode_tile_overlapping_that_kernel(monkeypatch):
    """``decode_linear_partial_products``: the operand kernel writes the decode tile's operand
    (fp16, MMA order) from the activation itself, then the decode tile, launched to overlap it,
    reads that operand and writes the splits' products, with no counters."""
    launches = DecodeLaunchesStoodIn(monkeypatch)
    M, N, K = 3, 64, 1024
    x = torch.randn(M, K, dtype=torch.bfloat16)
    scale = torch.full((1,), 0.5)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    codes = torch.zeros(N, K // 16, dtype=torch.uint8)
    partials = torch.ops.nvfp4_static.decode_linear_partial_products(x, scale, qdata, codes, 4)
    (kind, x_given, scale_given, operand, mma_order), gemm_call = launches.calls
    gemm_kind, gemm_operand, counts, split_k, overlap, quantizes, _ = gemm_call
    assert (kind, gemm_kind) == ("quantize", "gemm")
    assert x_given is x and scale_given is scale and mma_order
    assert operand.dtype == torch.float16 and operand.shape == (M, K)
    assert torch.equal(gemm_operand, torch.ones(M, K, dtype=torch.float16))
    assert (counts, split_k, overlap, quantizes) == (None, 4, True, False)
    assert torch.equal(partials, torch.arange(1.0, 5.0)[:, None, None].expand(4, M, N))


@pytest.mark.parametrize(
    "rows,K,x_dtype,qdata_dtype,split_k,message",
    [
        (17, 1024, torch.bfloat16, torch.uint8, 1, r"at most 16 rows in 1 to 4 K splits \(K = 1024\), got 17 rows"),
        (4, 1024, torch.bfloat16, torch.uint8, 0, r"got 4 rows and split_k = 0"),
        (4, 1024, torch.bfloat16, torch.uint8, 5, r"got 4 rows and split_k = 5"),
        (4, 1024, torch.bfloat16, torch.int8, 1, r"decode_linear_partial_products takes the packed weight .* got torch.int8"),
        (4, 512, torch.bfloat16, torch.uint8, 1, r"shapes do not match: activation \(4, 512\)"),
        (4, 1024, torch.int32, torch.uint8, 1, r"the tensor to quantize"),
    ],
    ids=["rows", "no-split", "too-many-splits", "qdata-dtype", "k-mismatch", "int-activation"],
)
def test_the_linear_op_refuses_before_launching_anything(rows, K, x_dtype, qdata_dtype, split_k, message, monkeypatch):
    """Refused arguments, the weight's or the activation's (which the operand kernel's own
    launcher checks), stop the op before any kernel is launched (launches recorded, not run)."""
    launches = DecodeLaunchesStoodIn(monkeypatch)
    monkeypatch.setattr(ops, "launch_activation_quantize", launch_activation_quantize)
    monkeypatch.setattr(KernelCall, "launch", lambda call: launches.calls.append(call))
    N, weight_K = 64, 1024
    x = torch.ones(rows, K).to(x_dtype)
    qdata = torch.zeros(N, weight_K // 2).to(qdata_dtype)
    codes = torch.zeros(N, weight_K // 16, dtype=torch.uint8)
    with pytest.raises((ValueError, TypeError), match=message):
        torch.ops.nvfp4_static.decode_linear_partial_products(x, torch.ones(1), qdata, codes, split_k)
    assert launches.calls == []


@pytest.mark.parametrize("M,split_k", [(17, 1), (64, 2), (4, 0), (4, -1), (4, 5), (1, 64)])
def test_the_partial_products_op_refuses_more_than_16_rows_or_splits_without_k_tiles(M, split_k, monkeypatch):
    monkeypatch.setattr(ops, "_require_cuda", lambda a, name: None)
    N, K = 64, 1024  # 4 K tiles
    a = torch.zeros(M, K, dtype=torch.float16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    codes = torch.zeros(N, K // 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"at most 16 rows in 1 to 4 K splits \(K = 1024\), got {M} rows and split_k = {split_k}"):
        torch.ops.nvfp4_static.decode_gemm_partial_products(a, qdata, codes, split_k)


@pytest.mark.parametrize(
    "operand,qdata,codes,message",
    [
        ((4, 256, torch.bfloat16), (64, 128, torch.uint8), (64, 16, torch.uint8), r"as torch.float16 \[M, K\] here"),
        ((4, 256, torch.float32), (64, 128, torch.uint8), (64, 16, torch.uint8), r"as torch.float16 \[M, K\] here"),
        ((4, 512, torch.float16), (64, 128, torch.uint8), (64, 16, torch.uint8), r"shapes do not match: activation \(4, 512\)"),
        ((4, 256, torch.float16), (64, 128, torch.uint8), (64, 8, torch.uint8), r"block scales \(64, 8\) \(want \[N, 16\]\)"),
        ((4, 256, torch.float16), (64, 128, torch.int8), (64, 16, torch.uint8), r"as uint8, got torch.int8 and torch.uint8"),
        ((4, 256, torch.float16), (64, 128, torch.uint8), (64, 16, torch.float8_e4m3fn), r"got torch.uint8 and torch.float8_e4m3fn"),
    ],
    ids=["bf16-operand", "fp32-operand", "k-mismatch", "scales-shape", "qdata-dtype", "scales-as-fp8"],
)
def test_the_partial_products_op_refuses_operands_it_would_misread(operand, qdata, codes, message, monkeypatch):
    monkeypatch.setattr(ops, "_require_cuda", lambda a, name: None)
    tensors = [torch.zeros(rows, cols).to(dtype) for rows, cols, dtype in (operand, qdata, codes)]
    with pytest.raises(ValueError, match=message):
        torch.ops.nvfp4_static.decode_gemm_partial_products(*tensors, 1)


@pytest.mark.parametrize("modes", [0, 1, 2], ids=["eager", "one-mode", "two-modes"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "M,K,summed_in_program",
    [(4, 1024, True), (4, 1280, False), (1, 9216, False), (4, 9216, True)],
    ids=["even", "uneven", "one-row-long", "long"],
)
def test_launch_reaches_the_kernel_once_eagerly_or_through_the_op(M, K, summed_in_program, modes, with_bias, monkeypatch):
    """The decode tile's launch reaches the kernel's launcher exactly once, with the split the
    Triton tile would run: eagerly so that the kernel sums the splits into the output, in their
    programs where they hold as many K tiles each (no buffer, no counters; at one row only up to
    8 K tiles each, and no buffer is allocated), else with a buffer and the stream's counters;
    under dispatch modes (as in tracing) through the partial-products op with no counters (a CUDA graph capturing it keeps no buffer), and the splits' sum, both
    global scales and the bias come from torch ops after it. Only the eager launch overlaps the
    operand kernel (which releases it early only when launched eagerly). Stood in on the CPU: the
    launcher (which writes split s's products as s + 1, or the output as 7), availability, the
    op's device check and the stream's counters are patched."""
    calls = []

    def launcher(a, qdata, codes, act_scale, weight_scale, bias, out, partials, counts, split_k, overlap,
                 quantizes=False):
        assert not quantizes
        calls.append((None if partials is None else tuple(partials.shape), counts, split_k, overlap))
        if partials is not None and counts is None:
            for split in range(split_k):
                partials[split].fill_(split + 1.0)
        else:
            out.fill_(7.0)

    stream_counts = torch.zeros(decode.counters(64), dtype=torch.int32)
    monkeypatch.setattr(gemm_warp_specialized, "available", lambda device: True)
    monkeypatch.setattr(decode, "takes", lambda a, qdata, scales, out, quantizes=False: True)
    monkeypatch.setattr(decode, "launch_decode_gemm", launcher)
    monkeypatch.setattr(gemm, "tile_counts", lambda device, tiles: stream_counts)
    monkeypatch.setattr(ops, "_require_cuda", lambda a, name: None)
    N = 64
    operand, qdata, scales, act_scale, weight_scale, bias = gemm_operands(M, N, K, seed=1, config=DECODE_TILE)
    bias = bias if with_bias else None
    split = gemm.split_k_for(DECODE_TILE, N, K, operand.device)
    # CPU: one "SM", four programs on it, at most half the K tiles per split: 4 tiles in 2 + 2,
    # 5 in 3 + 2, 36 in 4 x 9.
    assert split == (4 if K == 9216 else 2)
    assert decode.sums_in_program(split, K, M) == summed_in_program
    out = torch.zeros(M, N, dtype=torch.float32)
    allocated, empty = [], torch.empty

    def recording_empty(*size, **kwargs):
        allocated.append(tuple(size[0]) if len(size) == 1 else size)
        return empty(*size, **kwargs)

    with contextlib.ExitStack() as stack:
        for _ in range(modes):
            stack.enter_context(PassThrough())
        monkeypatch.setattr(torch, "empty", recording_empty)
        launch_nvfp4_gemm(operand, qdata, scales, act_scale, weight_scale, bias, out, DECODE_TILE)
        monkeypatch.setattr(torch, "empty", empty)
    in_program = modes == 0 and summed_in_program
    shape = None if in_program else (split, M, N)
    assert ((split, M, N) in allocated) == (not in_program)  # no buffer where the programs sum
    assert [(shape, split_k, overlap) for shape, _, split_k, overlap in calls] == [(shape, split, modes == 0)]
    if modes == 0:
        assert calls[0][1] is (None if in_program else stream_counts)
        assert torch.equal(out, torch.full_like(out, 7.0))
        return
    assert calls[0][1] is None
    expected = torch.full((M, N), float(sum(range(1, split + 1)))) * (act_scale.float() * weight_scale.float())
    expected = expected if bias is None else expected + bias.float()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_one_row_reaches_the_kernel_once_quantizing_it_with_no_operand_kernel(traced, monkeypatch):
    """At one row the decode tile takes the activation itself: eagerly one launch of the kernel,
    handed the row and the activation's scale, quantizing and summing its 4 splits in the
    program, not launched to overlap a kernel before it (none writes its operand); under a
    dispatch mode (as in tracing) one launch through the linear op, quantizing, writing the
    splits' products, which torch ops sum, scale and bias. No operand kernel either way. Stood in
    on the CPU: the launcher writes split s's products as s + 1, or the output as 7."""
    calls = []

    def launcher(a, qdata, codes, act_scale, weight_scale, bias, out, partials, counts, split_k, overlap,
                 quantizes=False):
        calls.append((a, act_scale, partials is None, counts, split_k, overlap, quantizes))
        if partials is None:
            out.fill_(7.0)
        else:
            for split in range(split_k):
                partials[split].fill_(split + 1.0)

    def no_operand_kernel(*args, **kwargs):
        raise AssertionError("the operand kernel ran")

    monkeypatch.setattr(gemm_warp_specialized, "available", lambda device: True)
    monkeypatch.setattr(decode, "takes", lambda a, qdata, scales, out, quantizes=False: True)
    monkeypatch.setattr(decode, "launch_decode_gemm", launcher)
    monkeypatch.setattr(ops, "launch_activation_quantize", no_operand_kernel)
    monkeypatch.setattr(ops, "_require_cuda", lambda a, name: None)
    M, N, K = 1, 64, 2048
    x, qdata, scales, act_scale, weight_scale, bias = raw_gemm_operands(M, N, K, seed=1)
    x = x.to(torch.bfloat16)
    split = gemm.split_k_for(DECODE_TILE, N, K, x.device)
    assert split == 4 and decode.sums_in_program(split, K, M)
    out = torch.zeros(M, N, dtype=torch.float32)
    with PassThrough() if traced else contextlib.nullcontext():
        launch_nvfp4_gemm(x, qdata, scales, act_scale, weight_scale, bias, out, DECODE_TILE_AT_ONE_ROW, True)
    ((a, scale_given, no_partials, counts, split_k, overlap, quantizes),) = calls
    assert torch.equal(a, x) and torch.equal(scale_given, act_scale.float().reshape(1))
    assert (counts, split_k, overlap, quantizes, no_partials) == (None, split, False, True, not traced)
    if not traced:
        assert torch.equal(out, torch.full_like(out, 7.0))
        return
    expected = torch.full((M, N), 1.0 + 2.0 + 3.0 + 4.0) * (act_scale.float() * weight_scale.float()) + bias.float()
    assert torch.equal(out, expected)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "M,N,K",
    [
        (16, 8192, 8192), (1, 14336, 4096), (3, 4096, 14336), (16, 320, 1024), (7, 96, 512), (16, 28672, 4096),
        (8, 8192, 8192), (9, 4096, 14336),
    ],
    ids=str,
)
def test_gpu_decode_tile_equals_the_triton_tile_bit_for_bit(dtype, with_bias, M, N, K, monkeypatch):
    """Splits of 1 to 8, one row and a few (the 8-column MMA up to 8 rows, the 16-column one from
    9), weights of fewer rows than one program's (so some consumers' rows lie outside the
    weight) and with a partial last program: the same output as the Triton kernel of the same
    tile, bit for bit, within the fp64 reference's bound."""
    operand, *weight = gemm_operands(M, N, K, seed=M, device="cuda", config=DECODE_TILE)
    weight[-1] = weight[-1] if with_bias else None
    launches = counting_launches(monkeypatch, DECODE_TILE)
    ours = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    launch_nvfp4_gemm(operand, *weight, ours, DECODE_TILE)
    assert launches.count == 1
    triton_tile = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    launch_nvfp4_gemm(operand, *weight, triton_tile, DECODE_TILE_IN_TRITON)
    assert launches.count == 1
    assert torch.equal(ours, triton_tile)
    plain = gemm_operands(M, N, K, seed=M, device="cuda")[0]
    assert relative_error(ours, reference_gemm(plain, *weight)) <= gpu_tolerance(K, dtype)


@requires_cuda
@requires_hopper
def test_gpu_thirty_launches_give_one_output_and_leave_the_counters_zero():
    """The program that sums a column tile's splits is whichever stores the last one: whatever
    the order, the sum is in split order, so every launch gives the same output; the counters
    are zero after each launch (the next one relies on it). 8 splits: summed across programs."""
    M, N, K = 16, 4096, 14336
    operand, *weight = gemm_operands(M, N, K, seed=2, device="cuda", config=DECODE_TILE)
    split = gemm.split_k_for(DECODE_TILE, N, K, operand.device)
    assert split > 1 and not decode.sums_in_program(split, K, M)
    outs = []
    for _ in range(30):
        outs.append(torch.empty((M, N), dtype=torch.bfloat16, device="cuda"))
        launch_nvfp4_gemm(operand, *weight, outs[-1], DECODE_TILE)
    assert all(torch.equal(out, outs[0]) for out in outs)
    counts = gemm.tile_counts(operand.device, decode.counters(N))
    assert not counts.any()


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("M,N,K", [(16, 8192, 8192), (3, 4096, 14336), (1, 320, 1024), (16, 28672, 4096)], ids=str)
def test_gpu_partial_products_op_equals_the_triton_tiles_products_bit_for_bit(M, N, K):
    """What a traced graph sums: the op's partial products, from the Gluon kernel, are the Triton
    tile's in the same split, bit for bit (and their sum is the product, within the fp64
    reference's bound)."""
    operand, qdata, scales, act_scale, weight_scale, _ = gemm_operands(M, N, K, seed=M, device="cuda", config=DECODE_TILE)
    codes = scales.view(torch.uint8)
    split = gemm.split_k_for(DECODE_TILE, N, K, operand.device)
    ours = torch.ops.nvfp4_static.decode_gemm_partial_products(operand, qdata, codes, split)
    assert ours.shape == (split, M, N)
    triton_tile = torch.full_like(ours, float("nan"))
    gemm.launch_tiles(
        operand, qdata, codes, act_scale, weight_scale, None, triton_tile[0], triton_tile, False,
        DECODE_TILE_IN_TRITON, split,
    )
    assert torch.equal(ours, triton_tile)
    product = ours.sum(0) * (act_scale * weight_scale)
    plain = gemm_operands(M, N, K, seed=M, device="cuda")[0]
    assert relative_error(product, reference_gemm(plain, qdata, scales, act_scale, weight_scale, None)) <= gpu_tolerance(
        K, torch.float32
    )


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_traced_route_hands_the_decode_tile_the_activation_itself(with_bias, monkeypatch):
    """Traced (here under a dispatch mode), the route's decode-tile bucket runs the quantize
    kernel and the decode tile as one op (``decode_linear_partial_products``), never the
    operand op before it, and sums the splits' products, scales and biases them as the traced
    ``nvfp4_gemm`` does, in the activation's dtype and leading shape. Stood in on the CPU as
    above: the operand is 1, split s's products s + 1."""
    from nvfp4_static.backends import triton_route

    launches = DecodeLaunchesStoodIn(monkeypatch)
    monkeypatch.setattr(triton_route, "operand_config", lambda bucket, N, K, device, in_graph: DECODE_TILE)

    def no_operand_op(*args, **kwargs):
        raise AssertionError("the operand op ran before the decode tile's linear op")

    monkeypatch.setattr(triton_route, "gemm_activation_operand", no_operand_op)
    N, K = 64, 1024
    x = torch.randn(2, 3, K, dtype=torch.bfloat16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    block_scales = torch.zeros(N, K // 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    weight_scale, act_scale = torch.tensor(0.25), torch.tensor(3.0)
    bias = torch.randn(N, dtype=torch.bfloat16) if with_bias else None
    with PassThrough():
        out = triton_route._linear_in_bucket(
            gemm_bucket(6), None, x, (qdata, block_scales, weight_scale, act_scale), bias
        )
    split = gemm.split_k_for(config_for_width(DECODE_TILE, K), N, K, x.device)
    assert split == 2
    assert [call[0] for call in launches.calls] == ["quantize", "gemm"]
    assert launches.calls[0][1].shape == (6, K) and launches.calls[1][3:6] == (split, True, False)
    expected = torch.full((6, N), 1.0 + 2.0) * (act_scale * weight_scale)
    expected = expected if bias is None else expected + bias.float()
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, N)
    assert torch.equal(out, expected.to(torch.bfloat16).reshape(2, 3, N))


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_the_route_at_one_row_takes_the_decode_tile_only_in_a_traced_graph(traced, monkeypatch):
    """The one-row bucket of an 8192 x 8192 weight (4 splits of 8 K tiles): traced (a dispatch
    mode standing in), the decode tile quantizing the row itself, one kernel with no operand
    kernel before it, handed the activation and its scale, then the splits' sum and scales as
    torch ops; eagerly the entry that quantizes its row itself. Stood in on the CPU as above
    (split s's products s + 1; 132 SMs)."""
    from nvfp4_static.backends import triton_route

    launches = DecodeLaunchesStoodIn(monkeypatch)
    monkeypatch.setattr(gemm, "_multiprocessor_count", lambda device: 132)
    entry_calls = []
    monkeypatch.setattr(
        triton_route, "quantizing_nvfp4_gemm", lambda x, *args: entry_calls.append(x) or x.new_zeros(x.shape[0], N)
    )
    N = K = 8192
    x = torch.randn(1, K, dtype=torch.bfloat16)
    qdata = torch.zeros(N, K // 2, dtype=torch.uint8)
    block_scales = torch.zeros(N, K // 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    weight_scale, act_scale = torch.tensor(0.25), torch.tensor(3.0)
    with PassThrough() if traced else contextlib.nullcontext():
        out = triton_route._linear_in_bucket(gemm_bucket(1), None, x, (qdata, block_scales, weight_scale, act_scale), None)
    if not traced:
        assert launches.calls == [] and len(entry_calls) == 1
        return
    assert entry_calls == []
    ((kind, a, counts, split_k, overlap, quantizes, scale_given),) = launches.calls
    assert kind == "gemm" and torch.equal(a, x) and (counts, split_k, overlap, quantizes) == (None, 4, False, True)
    assert torch.equal(scale_given, act_scale.reshape(1))
    expected = torch.full((1, N), 1.0 + 2.0 + 3.0 + 4.0) * (act_scale * weight_scale)
    assert torch.equal(out, expected.to(torch.bfloat16))


@requires_cuda
@requires_hopper
def test_gpu_compiled_linear_at_one_row_runs_the_decode_tile_eager_the_entry(monkeypatch):
    """One row on 8192 x 8192: the compiled linear launches the decode tile (through its op,
    quantizing the row itself), the eager one does not (the entry); both within the fp64
    reference's bound."""
    from nvfp4_static.backends.triton_route import static_nvfp4_linear

    M, N, K = 1, 8192, 8192
    assert operand_config(gemm_bucket(1), N, K, CUDA, in_graph=True) == DECODE_TILE
    x, qdata, scales, act_scale, weight_scale, bias = raw_gemm_operands(M, N, K, seed=3, device="cuda")
    x = x.to(torch.bfloat16)
    plain = ops.gemm_activation_operand(x, act_scale)
    reference = reference_gemm(plain, qdata, scales, act_scale, weight_scale, bias)
    launches = counting_launches(monkeypatch, DECODE_TILE)

    def linear(x):
        return static_nvfp4_linear(x, qdata, scales, weight_scale, act_scale, bias)

    eager = linear(x)
    assert launches.count == 0
    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True)(x)
    assert launches.count == 1
    for out in (eager, compiled):
        assert relative_error(out, reference) <= gpu_tolerance(K, torch.bfloat16)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "M,N,K", [(16, 8192, 8192), (3, 4096, 14336), (1, 320, 1024), (1, 8192, 8192), (1, 4096, 14336)], ids=str
)
def test_gpu_linear_op_equals_the_operand_then_the_products_op_bit_for_bit(dtype, M, N, K):
    """The traced pair as one op, the decode tile started while the quantize kernel runs (at one
    row the decode tile quantizing the row itself, bf16 in the Gluon kernel, fp32 in its Triton
    twin): the same products as the operand op followed by the products op (launched one after
    the other), in 30 calls."""
    x = torch.randn(M, K, device="cuda", generator=torch.Generator("cuda").manual_seed(M)).to(dtype)
    act_scale = (x.abs().amax().float() / 2688).reshape(1)
    _, qdata, scales, *_ = gemm_operands(M, N, K, seed=M, device="cuda", config=DECODE_TILE)
    codes = scales.view(torch.uint8)
    split = gemm.split_k_for(DECODE_TILE, N, K, x.device)
    operand = ops.gemm_activation_operand(x, act_scale, torch.float16, True)
    apart = torch.ops.nvfp4_static.decode_gemm_partial_products(operand, qdata, codes, split)
    for _ in range(30):
        together = torch.ops.nvfp4_static.decode_linear_partial_products(x, act_scale, qdata, codes, split)
        assert torch.equal(together, apart)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "N,K", [(8192, 8192), (14336, 4096), (4096, 14336), (8192, 28672), (28672, 4096), (320, 1024), (96, 512)], ids=str
)
def test_gpu_decode_tile_quantizing_its_row_equals_it_after_the_operand_kernel_bit_for_bit(
    dtype, with_bias, N, K, monkeypatch
):
    """One row quantized by the decode tile's load warpgroup gives, bit for bit, the decode
    tile's output on the operand kernel's operand and its Triton twin's quantizing the row: K
    splits summed in the program (8192 x 8192: 4, 14336 x 4096: 2), across programs (4096 x
    14336: 8; 8192 x 28672: 4 of 28 K tiles), none (28672 x 4096), weights of fewer rows than a
    program's; within the fp64 reference's bound. The Gluon kernel is launched once, quantizing."""
    x, qdata, scales, act_scale, weight_scale, bias = raw_gemm_operands(1, N, K, seed=K, device="cuda")
    x = x.to(dtype)
    weight = (qdata, scales, act_scale, weight_scale, bias if with_bias else None)
    quantizing = []
    launch = decode.launch_decode_gemm
    monkeypatch.setattr(decode, "launch_decode_gemm", lambda *args: quantizing.append(args[-1]) or launch(*args))

    def output(a, config, raw_activation):
        out = torch.full((1, N), float("nan"), dtype=dtype, device="cuda")
        launch_nvfp4_gemm(a, *weight, out, config, raw_activation=raw_activation)
        return out

    ours = output(x, DECODE_TILE_AT_ONE_ROW, True)
    assert quantizing == [True]
    operand = ops.gemm_activation_operand(x, act_scale, torch.float16, True)
    assert torch.equal(ours, output(operand, DECODE_TILE, False))
    assert torch.equal(ours, output(x, replace(DECODE_TILE_IN_TRITON, activation_rows=1), True))
    assert quantizing == [True, False]
    plain = ops.gemm_activation_operand(x, act_scale)
    assert relative_error(ours, reference_gemm(plain, *weight)) <= gpu_tolerance(K, dtype)
