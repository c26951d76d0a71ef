"""kernels/gemm.py: the Triton NVFP4 GEMM equals an fp64 product of the same dequantized operands.

The reference is ``(A @ dequant(W)^T) * act_scale * weight_scale + bias`` in float64 with ``A``
the exact fp16 ``q * s_b`` operand, so the only differences left are the kernel's fp32 summation
order and the rounding of the output. On CPU the kernel runs under the Triton interpreter (in a
child process, see triton_interpreter); on a CUDA machine the checks run compiled, at real sizes.
"""

from dataclasses import replace
from typing import NamedTuple
from unittest import mock

import pytest
import torch
from conftest import (
    UNIT_ROUNDOFF,
    PassThrough,
    captured_twice_then_replayed_backwards,
    gpu_tolerance,
    linear_operands,
    relative_error,
    requires_cuda,
)
from triton_interpreter import run_interpreted

from nvfp4_static.kernels import gemm
from nvfp4_static.kernels.gemm import (
    DECODE_TILE,
    DECODE_TILE_AT_ONE_ROW,
    GEMM_CONFIGS,
    PREFILL_TALL_TILE_BUCKET,
    SPLIT_SQUARE_TILES,
    SPLIT_TALL_TILES,
    SQUARE_TILE,
    TALL_TILE,
    WIDE_TILE_BUCKETS,
    CublasAfterDequantize,
    GemmConfig,
    activation_operand_dtype,
    config_for_width,
    eager_quantizing_tiles,
    fuses_epilogue_into_cublas,
    gemm_bucket,
    gemm_config,
    launch_nvfp4_gemm,
    launch_weight_dequantize,
    operand_config,
    operand_in_mma_order,
    quantizes_activation_in_gemm,
    split_k_for,
    table_config,
    taking_operand,
    tile_counts,
    triton_entries,
)
from nvfp4_static.kernels.launch import ceil_div, recording_launches
from nvfp4_static.kernels.ops import deinterleave_blocks, gemm_activation_operand, nvfp4_gemm, quantizing_nvfp4_gemm
from nvfp4_static.numerics import dequantize_nvfp4

# Every Triton tile the table runs, and the smallest token count the table hands to cuBLAS
# (after dequantizing the weight).
TRITON_ENTRIES = triton_entries()
# Tiles that stand in for table entries, named apart from the entries they replace.
STAND_IN_TILE_NAMES = {
    TALL_TILE: "tall-tile",
    SQUARE_TILE: "square-tile",
    DECODE_TILE: "decode-tile",
    DECODE_TILE_AT_ONE_ROW: "decode-tile-at-one-row",
    **{tile: "split-square-tile" for tile in SPLIT_SQUARE_TILES.values()},
    **{tile: "split-tall-tile" for tile in SPLIT_TALL_TILES.values()},
}
FIRST_CUBLAS_ROWS = 1 + max(max_m for max_m, _ in TRITON_ENTRIES)

LAUNCHER = "nvfp4_static.kernels.gemm:launch_nvfp4_gemm"
DEQUANTIZE_LAUNCHER = "nvfp4_static.kernels.gemm:launch_weight_dequantize"
TRACED_LAUNCHER = "test_kernels_gemm:launch_as_traced"


def launch_as_traced(*args):
    """``launch_nvfp4_gemm(*args)`` as a traced graph runs it: under a dispatch mode (as
    functionalization and fake tensors are), where its epilogue is torch ops."""

    with PassThrough():
        launch_nvfp4_gemm(*args)


def raw_gemm_operands(M: int, N: int, K: int, seed: int, device: str = "cpu"):
    """Raw activation (with a block gain spread of 2^12, so block scales differ), packed weight,
    both global scales and a bias, in ``launch_nvfp4_gemm``'s order."""
    operands = linear_operands(M, N, K, seed, device, block_gains=True)
    return (
        operands.x,
        operands.weight_qdata,
        operands.weight_block_scales,
        operands.act_scale,
        operands.weight_scale,
        operands.bias,
    )


def gemm_operands(M: int, N: int, K: int, seed: int, device: str = "cpu", config=None):
    """Activation operand, packed weight, both global scales and a bias, as the backends pass them
    to a GEMM with ``config`` (the operand in the MMA order where that config at width K takes it)."""
    x, *rest = raw_gemm_operands(M, N, K, seed, device)
    mma_order = config is not None and operand_in_mma_order(config_for_width(config, K))
    return gemm_activation_operand(x, rest[2], mma_order=mma_order), *rest


def interleave_blocks(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``deinterleave_blocks``: back to K order."""
    return x.reshape(*x.shape[:-1], -1, 2, 8).transpose(-1, -2).reshape(x.shape)


def reference_gemm(operand, weight_qdata, weight_block_scales, act_scale, weight_scale, bias):
    """float64 product of the dequantized operands."""
    activation = interleave_blocks(operand.double())
    weight = dequantize_nvfp4(weight_qdata, weight_block_scales).double()
    out = (activation @ weight.t()) * (act_scale.double() * weight_scale.double())
    return out if bias is None else out + bias.double()


def test_interleave_undoes_deinterleave():
    x = torch.randn(3, 48)
    assert torch.equal(interleave_blocks(deinterleave_blocks(x)), x)


# Small tiles so that the interpreter sees several K tiles, a ragged last tile (K=48 with 32-wide
# tiles), M and N edges, and a split K (programs_per_sm large against the CPU's one "SM"). Each
# but row-tiles-split-k runs on three shapes (``interpreter_shapes``): K = 48, K = 16 (shorter
# than one tile), and K = 224 over two row tiles, the second holding one row (M = rows_per_tile
# + 1), where the split-K configs split K three ways, unevenly (3 + 3 + 1 tiles). The quantizing
# configs take the raw activation: one row per tile (M = 3: three tiles), two rows spread over
# the 16 MMA rows with a split K, one transposed, and one transposed in the MMA order with a
# split K. The MMA-order configs take the operand in that order, or quantize into it, where K is
# a multiple of 32 (224) and run without it elsewhere (48, 16): one transposed with a split K,
# one not.
INTERPRETER_CONFIGS = {
    "one-pass": GemmConfig(16, 16, 32, num_warps=4, num_stages=1),
    "split-k": GemmConfig(16, 32, 32, num_warps=4, num_stages=1, group_n=2, programs_per_sm=64),
    "weight-as-a": GemmConfig(16, 32, 32, num_warps=4, num_stages=1, group_n=2, weight_as_mma_a=True),
    "weight-as-a-split-k": GemmConfig(16, 16, 32, num_warps=4, num_stages=1, programs_per_sm=64, weight_as_mma_a=True),
    "quantizing-1-row": GemmConfig(16, 16, 32, num_warps=4, num_stages=1, activation_rows=1),
    "quantizing-2-rows-split-k": GemmConfig(16, 32, 32, num_warps=4, num_stages=1, programs_per_sm=64, activation_rows=2),
    "quantizing-weight-as-a": GemmConfig(16, 32, 32, num_warps=4, num_stages=1, weight_as_mma_a=True, activation_rows=4),
    "quantizing-mma-order-split-k": GemmConfig(
        16, 32, 32, num_warps=4, num_stages=1, programs_per_sm=64, weight_as_mma_a=True, mma_order=True, activation_rows=1
    ),
    "mma-order-weight-as-a-split-k": GemmConfig(
        16, 32, 32, num_warps=4, num_stages=1, programs_per_sm=64, weight_as_mma_a=True, mma_order=True
    ),
    "mma-order": GemmConfig(16, 16, 64, num_warps=4, num_stages=1, group_n=2, mma_order=True),
    "row-tiles-split-k": GemmConfig(
        16, 32, 64, num_warps=4, num_stages=1, programs_per_sm=64, weight_as_mma_a=True, mma_order=True, row_tiles_for_split=2
    ),
    # The table's own Triton tiles, named for the largest M each serves (the stand-ins by name,
    # once, though a wide tile serves two buckets).
    **{STAND_IN_TILE_NAMES.get(config, f"table-{max_m}"): config for max_m, config in TRITON_ENTRIES},
}
# A split K over several row tiles, as a mid-size bucket's wide tiles run it, on its own shapes:
# 3 row tiles with an 8-row edge, K = 224 in MMA order (3.5 tiles of 64, split 2 + 2: a ragged
# last tile); 3 row tiles with a 1-row edge, K = 336 (not a multiple of 32, so without the MMA
# order; 5.25 tiles, split 2 + 2 + 2). Both with a column edge.
ROW_TILE_SPLIT_SHAPES = [(40, 70, 224), (33, 24, 336)]
# The table's tiles: two K tiles, the second ragged (K = 288: 1.125 tiles of 256, 2.25 of 128),
# in the MMA order where the entry takes it; and K shorter than one tile.
TABLE_SHAPES = [(3, 70, 288), (2, 24, 16)]


def interpreter_shapes(config_name: str) -> list:
    if config_name == "row-tiles-split-k":
        return ROW_TILE_SPLIT_SHAPES
    if config_name.startswith(("table-", "tall-tile", "decode-tile", "split-square-tile", "split-tall-tile")):
        return TABLE_SHAPES
    return [(3, 40, 48), (INTERPRETER_CONFIGS[config_name].rows_per_tile + 1, 40, 224), (2, 24, 16)]


# The output dtype, which is the activation's: a quantizing config reads the raw activation in it.
# fp32: the only error is fp32 summation order at K <= 336, far below 1e-5; bf16 and fp16: one
# rounding to 8 or 11 significant bits, relative error about 2^-9 or 2^-12 on average.
OUT_DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 8e-3), "fp16": (torch.float16, 1e-3)}


class InterpretedCase(NamedTuple):
    name: str
    config_name: str
    shape: tuple
    seed: int
    dtype_name: str
    with_bias: bool

    @property
    def config(self) -> GemmConfig:
        return INTERPRETER_CONFIGS[self.config_name]

    @property
    def splits_k(self) -> bool:
        _, N, K = self.shape
        return split_k_for(self.config, N, K, torch.device("cpu")) > 1


def interpreted_cases() -> list:
    """Each config once on each of its shapes, in one output dtype, with or without a bias:
    along a config's shapes the dtype steps through OUT_DTYPES and the bias alternates, each
    config starting one step further on than the one before, so that each config runs with and
    without a bias and in two or three dtypes (what else the rotation must keep:
    test_interpreted_cases_take_every_dtype_and_bias_where_each_matters)."""
    dtype_names = list(OUT_DTYPES)
    cases = []
    for config_index, config_name in enumerate(INTERPRETER_CONFIGS):
        for shape_index, (M, N, K) in enumerate(interpreter_shapes(config_name)):
            step = config_index + shape_index
            dtype_name, with_bias = dtype_names[step % len(dtype_names)], step % 2 == 0
            name = f"{config_name}-{M}x{N}x{K}-{dtype_name}-{'bias' if with_bias else 'nobias'}"
            cases.append(InterpretedCase(name, config_name, (M, N, K), shape_index, dtype_name, with_bias))
    return cases


INTERPRETER_CASES = interpreted_cases()
SPLIT_K_CASES = [case for case in INTERPRETER_CASES if case.splits_k]
# Traced, the split sum compares with the epilogue kernel's in fp32 only (see the test).
EPILOGUE_OPS_CASES = [case for case in SPLIT_K_CASES if case.dtype_name == "fp32"]


def interpreted_launch(case: InterpretedCase):
    """The reference's operands (the operand in K order) and the launch: the raw activation in
    the case's dtype where the config quantizes it, else the operand in the order the config
    takes."""
    M, N, K = case.shape
    x, weight_qdata, weight_block_scales, act_scale, weight_scale, bias = raw_gemm_operands(M, N, K, seed=case.seed)
    x, bias = x.to(OUT_DTYPES[case.dtype_name][0]), bias if case.with_bias else None
    weights = (weight_qdata, weight_block_scales, act_scale, weight_scale)
    operands = (gemm_activation_operand(x, act_scale), *weights, bias)
    if case.config.activation_rows:
        a = x
    else:
        a = gemm_activation_operand(x, act_scale, mma_order=operand_in_mma_order(config_for_width(case.config, K)))
    out = torch.full((M, N), float("nan"), dtype=x.dtype)
    return operands, (a, *weights, bias, out, case.config, bool(case.config.activation_rows))


@pytest.fixture(scope="module")
def interpreted_results():
    references, launches = {}, {}
    for case in INTERPRETER_CASES:
        references[case.name], args = interpreted_launch(case)
        launches[case.name] = (LAUNCHER, args)
    for case in SPLIT_K_CASES:  # the split K summed by the epilogue kernel instead
        args = launches[case.name][1]
        args = (*args[:6], torch.full_like(args[6], float("nan")), case.config, bool(case.config.activation_rows), False)
        launches[f"{case.name}-epilogue-kernel"] = (LAUNCHER, args)
        if case in EPILOGUE_OPS_CASES:  # and as a traced graph sums it: the epilogue as torch ops
            summed_by_ops = torch.full_like(args[6], float("nan"))
            launches[f"{case.name}-epilogue-ops"] = (TRACED_LAUNCHER, (*args[:6], summed_by_ops, *args[7:]))
    weight_qdata, weight_block_scales = gemm_operands(*DEQUANTIZE_SHAPE, seed=5)[1:3]
    for dtype in DEQUANTIZE_DTYPES:
        dequantized = torch.full(DEQUANTIZE_SHAPE[1:], float("nan"), dtype=dtype)
        launches[f"dequantize-{dtype}"] = (
            DEQUANTIZE_LAUNCHER,
            (weight_qdata, weight_block_scales, dequantized, CublasAfterDequantize(16, 32)),
        )
    results = run_interpreted(launches)
    outputs = {name: (references[name], results[name].args[6]) for name in references}
    for case in SPLIT_K_CASES:
        outputs[f"{case.name}-epilogue-kernel"] = results[f"{case.name}-epilogue-kernel"].args[6]
    for case in EPILOGUE_OPS_CASES:
        outputs[f"{case.name}-epilogue-ops"] = results[f"{case.name}-epilogue-ops"].args[6]
    for dtype in DEQUANTIZE_DTYPES:
        outputs[f"dequantize-{dtype}"] = results[f"dequantize-{dtype}"].args[:3]
    return outputs


DEQUANTIZE_SHAPE = (1, 70, 48)  # (M, N, K): a ragged N and K for 16 x 32 tiles
DEQUANTIZE_DTYPES = (torch.float16, torch.bfloat16)


def assert_dequantized_like_reference(weight_qdata, weight_block_scales, dequantized):
    expected = deinterleave_blocks(dequantize_nvfp4(weight_qdata, weight_block_scales, output_dtype=dequantized.dtype))
    assert torch.equal(dequantized.cpu().view(torch.int16), expected.cpu().view(torch.int16))


@pytest.mark.parametrize("dtype", DEQUANTIZE_DTYPES, ids=["fp16", "bf16"])
def test_interpreted_weight_dequantize_matches_reference_bit_for_bit(interpreted_results, dtype):
    assert_dequantized_like_reference(*interpreted_results[f"dequantize-{dtype}"])


def test_interpreted_cases_take_every_dtype_and_bias_where_each_matters():
    """What the rotation in interpreted_cases must keep: each config with and without a bias
    and in two or more dtypes; the cases that split K in every dtype, with a bias in both tile
    orientations and without one; those the traced epilogue compares with and without a bias."""
    for config_name in INTERPRETER_CONFIGS:
        cases = [case for case in INTERPRETER_CASES if case.config_name == config_name]
        assert {case.with_bias for case in cases} == {True, False}, config_name
        assert len({case.dtype_name for case in cases}) >= 2, config_name
    assert {case.dtype_name for case in SPLIT_K_CASES} == set(OUT_DTYPES)
    assert {case.config.weight_as_mma_a for case in SPLIT_K_CASES if case.with_bias} == {True, False}
    assert {case.with_bias for case in SPLIT_K_CASES} == {case.with_bias for case in EPILOGUE_OPS_CASES} == {True, False}


@pytest.mark.parametrize("case", SPLIT_K_CASES, ids=lambda case: case.name)
def test_interpreted_split_k_summed_in_the_gemm_equals_the_epilogue_kernels_sum(interpreted_results, case):
    """The last program of each tile sums the splits in the epilogue kernel's order: the same
    output bit for bit."""
    in_gemm, apart = interpreted_results[case.name][1], interpreted_results[f"{case.name}-epilogue-kernel"]
    assert not apart.isnan().any()
    assert torch.equal(in_gemm, apart)


@pytest.mark.parametrize("case", EPILOGUE_OPS_CASES, ids=lambda case: case.name)
def test_interpreted_epilogue_as_ops_equals_the_epilogue_kernel(interpreted_results, case):
    """Traced, the split sum and the scales are torch ops (for Inductor to fuse into the
    output's reader); they sum and scale in the kernel's order: the same output bit for bit.
    fp32 outputs only: Triton's interpreter truncates fp32 to bf16 where a GPU (and torch)
    rounds to nearest even; test_gpu_compiled_fullgraph_one_graph_for_every_m compares bf16
    outputs on a GPU."""
    kernel, ops = interpreted_results[f"{case.name}-epilogue-kernel"], interpreted_results[f"{case.name}-epilogue-ops"]
    assert not ops.isnan().any()
    assert torch.equal(ops, kernel)


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda case: case.name)
def test_interpreted_gemm_matches_fp64_reference(interpreted_results, case):
    operands, out = interpreted_results[case.name]
    assert relative_error(out, reference_gemm(*operands)) <= OUT_DTYPES[case.dtype_name][1]


def test_op_rejects_cpu_tensors_with_a_pointer_to_the_cpu_backend():
    with pytest.raises(ValueError, match="cpu"):
        nvfp4_gemm(*gemm_operands(2, 16, 32, seed=0), torch.float32)


def test_row_tile_split_cases_split_k_over_several_row_tiles():
    """What the interpreted row-tiles-split-k cases are for: several row tiles, a split K, and
    the MMA order on one K and not on the other."""
    config = INTERPRETER_CONFIGS["row-tiles-split-k"]
    for M, N, K in ROW_TILE_SPLIT_SHAPES:
        assert ceil_div(M, config.rows_per_tile) == 3
        assert split_k_for(config, N, K, torch.device("cpu")) > 1
    assert [operand_in_mma_order(config_for_width(config, K)) for _, _, K in ROW_TILE_SPLIT_SHAPES] == [True, False]


def test_split_k_is_sized_for_the_planned_row_tiles():
    """One "SM" on CPU: at most 12 programs over 2 column tiles (N = 64) times the planned row
    tiles, capped at 2 K tiles per split (K = 1280: 40 tiles, at most 20 splits)."""
    cpu = torch.device("cpu")
    splits = [
        split_k_for(GemmConfig(16, 32, 32, 4, 1, programs_per_sm=12, row_tiles_for_split=rows), 64, 1280, cpu)
        for rows in (1, 2, 3, 12)
    ]
    assert splits == [6, 3, 2, 1]  # 12 // 2, 12 // 4, 12 // 6, and unsplit where 24 tiles exceed 12
    assert split_k_for(GemmConfig(16, 32, 32, 4, 1, programs_per_sm=64), 64, 1280, cpu) == 20  # the cap
    assert split_k_for(GemmConfig(16, 32, 32, 4, 1), 64, 1280, cpu) == 1


def test_split_k_keeps_the_grid_within_programs_per_sm():
    """The most splits that keep every table entry's grid within its programs per SM: on 132
    SMs at 2 per SM, the 8192 x 8192 weight in 64 column tiles of 128 splits 4 ways at M = 1
    (256 programs, not 5 ways: 320), 14336 x 4096 in 64 tiles of 64 4 ways at M = 16 (not 3),
    4096 x 14336 in 224 tiles not at all; the 129-256 entry plans two row tiles."""
    cuda = torch.device("cuda", 0)
    with mock.patch.object(gemm, "_multiprocessor_count", return_value=132):
        assert split_k_for(gemm_config(1), 8192, 8192, cuda) == 4
        assert split_k_for(gemm_config(16), 4096, 14336, cuda) == 4
        assert split_k_for(gemm_config(16), 14336, 4096, cuda) == 1
        assert split_k_for(gemm_config(256), 4096, 14336, cuda) == 2  # 2 x 64 tiles, 2 splits
        for max_m, config in TRITON_ENTRIES:
            for N, K in [(4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336), (96, 16)]:
                split = split_k_for(config, N, K, cuda)
                programs = split * config.row_tiles_for_split * ceil_div(N, config.block_n)
                per_sm = max(config.programs_per_sm, config.fill_programs_per_sm)
                assert split == 1 or programs <= per_sm * 132, (max_m, config, N, K, split)


def test_split_k_grows_to_fill_programs_per_sm_only_where_that_fills_more_slots():
    """On 132 SMs the M = 1 entry (128-column tiles, 2 per SM, filling up to 3): 4096 x 12288 in
    96 tiles splits 4 ways (384 of 396 slots) rather than 2 (192 of 264), 4096 x 6144 in 48
    tiles 8 ways rather than 4; 8192 x 8192 (256 of 264 at 2 per SM, 384 of 396 at 3) and
    4096 x 14336 (224 of 264, 336 of 396: equal fills) keep the planned split, as does an entry
    without fill_programs_per_sm."""
    cuda = torch.device("cuda", 0)
    entry = gemm_config(1)
    assert (entry.programs_per_sm, entry.fill_programs_per_sm, entry.block_n) == (2, 3, 128)
    with mock.patch.object(gemm, "_multiprocessor_count", return_value=132):
        assert split_k_for(entry, 12288, 4096, cuda) == 4
        assert split_k_for(entry, 6144, 4096, cuda) == 8
        assert split_k_for(entry, 8192, 8192, cuda) == 4
        assert split_k_for(entry, 14336, 4096, cuda) == 2
        assert split_k_for(replace(entry, fill_programs_per_sm=0), 12288, 4096, cuda) == 2


@pytest.mark.parametrize("programs_per_sm,fill", [(2, 2), (2, 1), (0, 3), (2, -1)])
def test_gemm_config_refuses_a_fill_that_does_not_exceed_programs_per_sm(programs_per_sm, fill):
    with pytest.raises(ValueError, match="fill_programs_per_sm"):
        GemmConfig(16, 64, 256, 4, 4, programs_per_sm=programs_per_sm, fill_programs_per_sm=fill)


def test_no_k_split_is_left_without_a_k_tile():
    """The kernel tells the compiler that each split has a K tile (so ptxas keeps the wgmmas
    asynchronous, test_gemm_hopper_code.py): 56 K tiles wanted in 9 splits of 7 would leave the
    ninth empty, so they run in 8; every split count starts its last split before the last tile."""
    cpu = torch.device("cpu")
    assert split_k_for(GemmConfig(16, 32, 256, 4, 1, programs_per_sm=9), 32, 56 * 256, cpu) == 8
    for tiles_k in range(1, 80):
        for programs in range(1, 40):
            split = split_k_for(GemmConfig(16, 32, 32, 4, 1, programs_per_sm=programs), 32, 32 * tiles_k, cpu)
            per_split = ceil_div(tiles_k, split)
            assert (split - 1) * per_split < tiles_k, (tiles_k, programs, split)
            assert split == 1 or per_split >= 2, (tiles_k, programs, split)


@pytest.mark.parametrize("rows,programs_per_sm", [(0, 1), (-1, 1), (2, 0)])
def test_gemm_config_refuses_row_tiles_for_split_that_size_no_split(rows, programs_per_sm):
    with pytest.raises(ValueError, match="row_tiles_for_split"):
        GemmConfig(16, 64, 256, 4, 3, programs_per_sm=programs_per_sm, row_tiles_for_split=rows)


def test_config_table_covers_every_m_in_rising_buckets():
    bounds = [max_m for max_m, _ in GEMM_CONFIGS]
    assert bounds[-1] is None
    assert bounds[:-1] == sorted(set(bounds[:-1])) and bounds[0] >= 1


@pytest.mark.parametrize("rows", [-1, 3, 32])
def test_gemm_config_refuses_activation_rows_that_do_not_tile_the_mma_rows(rows):
    with pytest.raises(ValueError, match="activation_rows"):
        GemmConfig(16, 64, 256, 4, 3, activation_rows=rows)


@pytest.mark.parametrize("block_k,rows", [(16, 0), (48, 0), (48, 1), (80, 4)])
def test_gemm_config_refuses_the_mma_order_on_partial_groups(block_k, rows):
    with pytest.raises(ValueError, match="mma_order .* multiple of 32; got " + str(block_k)):
        GemmConfig(16, 64, block_k, 4, 3, activation_rows=rows, mma_order=True)


def test_the_mma_order_runs_only_on_whole_32_element_groups():
    config = GemmConfig(64, 128, 128, 4, 3, mma_order=True)
    assert operand_in_mma_order(config_for_width(config, 4096))
    assert not operand_in_mma_order(config_for_width(config, 4112))
    assert config_for_width(config, 4112) == GemmConfig(64, 128, 128, 4, 3)


def test_wide_tiles_serve_mid_size_m_where_their_programs_fill_the_sms(monkeypatch):
    """At 132 SMs a wide tile needs 93 programs at its bucket's largest M. The tall tile (256
    rows), from 129 rows: 14336 columns (112 tiles of 128) and 12288 (96) from 129 rows, 8192
    (64 tiles) and 6144 (48) from 257 rows (two row tiles at M = 512), 4096 never. Where it does
    not fill them, from 129 rows the tall tile with its K split for one program per SM where that
    fills them: 8192 and 6144 columns at 129-256 rows (2 splits: 128 and 96 programs), 4096
    columns at 129-256 (4 splits of K = 14336) and 257-512 (2), 2048 at 257-512 (4); not 11264
    columns (88 tiles, unsplit). Else the square tile (128 rows): 14336, 12288 and 11264 columns
    at 65-256 rows; else the square tile with its K split: 8192 x 8192 at 65-128 rows (2 splits),
    4096 columns at 65-128 rows (4 splits of K = 14336); not 512 columns (4 tiles, 16 splits of K
    = 4096 at most: 64 programs), nor 11264 at 65-128 (88 tiles, unsplit). Only where the split
    and square tiles run warp-specialized (not at K = 4112: the Triton tall tile still runs
    there); not below 65 rows, not on the interpreter's CPU tensors. At 513-2048 rows the tall
    tile in cuBLAS's place where it runs warp-specialized and its programs at 513 rows fill the
    SMs (4096 columns: 96 programs; not 2048: 48, nor 1024); cuBLAS above 2048 rows."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gemm, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(gemm.gemm_warp_specialized, "available", lambda device: True)
    split_128 = SPLIT_SQUARE_TILES[128]
    tall_256, tall_512 = SPLIT_TALL_TILES[256], SPLIT_TALL_TILES[512]
    assert table_config(129, None, 14336, 4096, cuda) == TALL_TILE
    assert table_config(512, None, 14336, 4096, cuda) == TALL_TILE
    assert table_config(257, None, 8192, 8192, cuda) == TALL_TILE
    assert table_config(256, None, 12288, 4096, cuda) == TALL_TILE
    assert table_config(512, None, 6144, 4096, cuda) == TALL_TILE
    assert table_config(256, None, 8192, 8192, cuda) == tall_256
    assert table_config(129, None, 8192, 8192, cuda) == tall_256
    assert table_config(200, None, 6144, 4096, cuda) == tall_256
    assert table_config(256, None, 4096, 14336, cuda) == tall_256
    assert table_config(512, None, 4096, 14336, cuda) == tall_512
    assert table_config(257, None, 4096, 14336, cuda) == tall_512
    assert table_config(512, None, 2048, 8192, cuda) == tall_512
    assert table_config(128, None, 14336, 4096, cuda) == SQUARE_TILE
    assert table_config(65, None, 14336, 4096, cuda) == SQUARE_TILE
    assert table_config(128, None, 12288, 4096, cuda) == SQUARE_TILE
    assert table_config(256, None, 11264, 4096, cuda) == SQUARE_TILE
    assert table_config(128, None, 8192, 8192, cuda) == split_128
    assert table_config(100, None, 4096, 14336, cuda) == split_128
    assert [split_k_for(tile, N, K, cuda) for tile, N, K in [(split_128, 8192, 8192), (split_128, 4096, 14336),
                                                               (tall_256, 8192, 8192), (tall_256, 6144, 4096),
                                                               (tall_256, 4096, 14336), (tall_512, 4096, 14336),
                                                               (tall_512, 2048, 8192)]] == [2, 4, 2, 2, 4, 2, 4]
    assert table_config(128, None, 11264, 4096, cuda) == gemm_config(128)
    assert table_config(128, None, 512, 4096, cuda) == gemm_config(128)
    assert table_config(64, None, 14336, 4096, cuda) == gemm_config(64)
    assert table_config(513, None, 14336, 4096, cuda) == TALL_TILE
    assert table_config(2048, None, 4096, 4096, cuda) == TALL_TILE
    assert table_config(600, None, 1024, 4096, cuda) == gemm_config(600)
    assert table_config(2048, None, 2048, 4096, cuda) == gemm_config(2048)  # 48 programs at 513 rows
    assert table_config(1024, None, 14336, 4112, cuda) == gemm_config(1024)  # no Gluon kernel
    assert table_config(2049, None, 14336, 4096, cuda) == gemm_config(2049)
    assert isinstance(gemm_config(600), CublasAfterDequantize) and gemm_config(600) == gemm_config(2049)
    assert table_config(100, gemm_bucket(300), 14336, 4096, cuda) == TALL_TILE  # the bucket decides
    assert table_config(100, gemm_bucket(200), 8192, 8192, cuda) == tall_256
    assert table_config(300, None, 14336, 4112, cuda) == replace(TALL_TILE, mma_order=False, warp_specialized=False)
    for M, N, K in [(200, 8192, 4112), (200, 11264, 4112), (100, 8192, 8208), (128, 14336, 4100)]:
        assert table_config(M, None, N, K, cuda) == config_for_width(gemm_config(M), K)  # no Gluon kernel
    assert table_config(300, None, 14336, 4096, torch.device("cpu")) == gemm_config(300)
    monkeypatch.setattr(gemm, "_multiprocessor_count", lambda device: 64)
    assert table_config(256, None, 8192, 8192, cuda) == TALL_TILE  # 64 programs fill 64 SMs
    assert table_config(128, None, 8192, 8192, cuda) == SQUARE_TILE
    monkeypatch.setattr(gemm, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(gemm.gemm_warp_specialized, "available", lambda device: False)
    assert table_config(512, None, 14336, 4096, cuda) == TALL_TILE  # the Triton tall tile
    assert table_config(256, None, 8192, 8192, cuda) == gemm_config(256)
    assert table_config(512, None, 4096, 14336, cuda) == gemm_config(512)
    assert table_config(128, None, 14336, 4096, cuda) == gemm_config(128)
    assert table_config(128, None, 8192, 8192, cuda) == gemm_config(128)
    assert table_config(1024, None, 14336, 4096, cuda) == gemm_config(1024)  # cuBLAS, not the Triton tall tile


def test_split_wide_tiles_split_k_over_their_buckets_row_tiles_for_one_program_per_sm():
    """The square tile's split form at every wide bucket, the tall tile's above 128 rows (at
    fewer its programs would hold more rows than the bucket's), each sized over the bucket's
    row tiles: 128 rows per square tile, 256 per tall one."""
    assert sorted(SPLIT_SQUARE_TILES) == [128, 256, 512] and sorted(SPLIT_TALL_TILES) == [256, 512]
    for max_m, row_tiles in [(128, 1), (256, 2), (512, 4)]:
        assert SPLIT_SQUARE_TILES[max_m] == replace(SQUARE_TILE, programs_per_sm=1, row_tiles_for_split=row_tiles)
    for max_m, row_tiles in [(256, 1), (512, 2)]:
        assert SPLIT_TALL_TILES[max_m] == replace(TALL_TILE, programs_per_sm=1, row_tiles_for_split=row_tiles)


@pytest.mark.parametrize("K", [4096, 4112], ids=str)
@pytest.mark.parametrize("N", [14336, 1024], ids=str)
@pytest.mark.parametrize("max_m", [*WIDE_TILE_BUCKETS, PREFILL_TALL_TILE_BUCKET], ids=str)
def test_the_route_prepares_the_operand_of_the_tile_its_bucket_runs(max_m, N, K, monkeypatch):
    """The route prepares the operand from ``operand_config``; the op then runs ``table_config``'s
    tile for the bucket, which must read that operand: the same config. Where a wide tile
    replaces a Triton entry (128-512 rows) it reads the entry's operand (fp16, in the MMA order
    at K a multiple of 32); where the tall tile replaces cuBLAS (513-2048 rows) the operand is
    the tall tile's, not the bf16 one cuBLAS takes with its fused epilogue."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gemm, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(gemm.gemm_warp_specialized, "available", lambda device: True)
    bucket = gemm_bucket(max_m)
    config = operand_config(bucket, N, K, cuda)
    assert config == table_config(max_m, bucket, N, K, cuda)
    entry = config_for_width(gemm_config(max_m), K)
    assert not quantizes_activation_in_gemm(config)
    dtypes = [activation_operand_dtype(tile, torch.bfloat16, 1e-3, None) for tile in (config, entry)]
    if max_m in WIDE_TILE_BUCKETS:
        assert dtypes == [torch.float16] * 2
        assert operand_in_mma_order(config) == operand_in_mma_order(entry) == (K % 32 == 0)
    elif N == 14336 and K == 4096:
        assert config == TALL_TILE and dtypes == [torch.float16, torch.bfloat16] and operand_in_mma_order(config)
    else:
        assert config == entry and dtypes == [torch.bfloat16] * 2


def test_only_large_m_with_a_host_scale_and_a_matching_bias_fuses_the_epilogue_into_cublas():
    bf16_bias = torch.zeros(8, dtype=torch.bfloat16)
    prefill, decode = gemm_config(4096), gemm_config(16)
    assert fuses_epilogue_into_cublas(prefill, torch.bfloat16, 1e-3, bf16_bias)
    assert fuses_epilogue_into_cublas(prefill, torch.float16, 1e-3, None)
    assert not fuses_epilogue_into_cublas(decode, torch.bfloat16, 1e-3, None)  # the Triton kernel's tiles
    assert not fuses_epilogue_into_cublas(prefill, torch.bfloat16, None, None)  # scale only on device
    assert not fuses_epilogue_into_cublas(prefill, torch.float32, 1e-3, None)  # no fp32 operands
    assert not fuses_epilogue_into_cublas(prefill, torch.bfloat16, 1e-3, bf16_bias.float())
    assert activation_operand_dtype(prefill, torch.bfloat16, 1e-3, None) == torch.bfloat16
    assert activation_operand_dtype(decode, torch.bfloat16, 1e-3, None) == torch.float16


def test_gemm_bucket_is_the_first_table_entry_that_serves_m():
    for m in [1, 2, 4, 5, 16, 17, 33, 64, 65, 4096]:
        index = gemm_bucket(m)
        max_m = GEMM_CONFIGS[index][0]
        assert max_m is None or m <= max_m
        assert index == 0 or m > GEMM_CONFIGS[index - 1][0]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "M,N,K",
    [(1, 8192, 8192), (16, 8192, 8192), (29, 1024, 4096), (61, 4096, 14336), (100, 14336, 4096), (4096, 8192, 8192), (5, 96, 16)],
    ids=str,
)
def test_gpu_gemm_matches_fp64_reference(dtype, with_bias, M, N, K):
    """Through the table's choice for M: split-K decode, mid-size tiles, cuBLAS after dequantize;
    the operand in the order that choice takes (the reference reads the plain one)."""
    operands = list(gemm_operands(M, N, K, seed=M, device="cuda"))
    operands[-1] = operands[-1] if with_bias else None
    operand = gemm_operands(M, N, K, seed=M, device="cuda", config=gemm_config(M))[0]
    out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    launch_nvfp4_gemm(operand, *operands[1:], out)
    assert relative_error(out, reference_gemm(*operands)) <= gpu_tolerance(K, dtype)


@requires_cuda
@pytest.mark.parametrize("N,K", [(4096, 14336), (14336, 4096), (8192, 8192), (12288, 4096)], ids=str)
@pytest.mark.parametrize(
    "M,config", TRITON_ENTRIES, ids=str
)
def test_gpu_table_gemm_gives_the_same_output_every_launch(M, config, N, K):
    """The table's tiles keep wgmmas in flight while the next K tile's weight is dequantized and
    the next operand tiles load (test_gemm_hopper_code.py): 30 launches on a real shape, each
    bit for bit the first, which matches the fp64 reference. A buffer overwritten while an MMA
    still reads it would show as launches that differ (tune_gemm.WIDE_TILES names a tile that
    did). 12288 x 4096 runs the split grown to three programs per SM (``fill_programs_per_sm``)."""
    raw = bool(config.activation_rows)
    operands = list(gemm_operands(M, N, K, seed=M, device="cuda", config=config))
    if raw:
        operands[0] = raw_gemm_operands(M, N, K, seed=M, device="cuda")[0]
    outs = []
    for _ in range(30):
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch_nvfp4_gemm(*operands, out, config, raw)
        outs.append(out)
    plain = gemm_operands(M, N, K, seed=M, device="cuda")
    reference = reference_gemm(*plain)
    assert all(torch.equal(out, outs[0]) for out in outs[1:]), launches_apart(outs, reference)
    assert relative_error(outs[0], reference) <= gpu_tolerance(K, torch.bfloat16)


def launches_apart(outs: list, reference: torch.Tensor) -> str:
    """Which launches differ from the first and how: for a rare failure, what tells a race in
    the K loop (a few elements off) from the K splits' sum (whole tiles NaN or off)."""
    lines = []
    for index, out in enumerate(outs):
        apart = (out != outs[0]) & ~(out.isnan() & outs[0].isnan())
        if index == 0 or apart.any():
            rows, columns = apart.nonzero(as_tuple=True)
            span = f" (rows {rows.min()}-{rows.max()}, columns {columns.min()}-{columns.max()})" if rows.numel() else ""
            lines.append(
                f"launch {index}: {int(apart.sum())} elements apart{span}, {int(out.isnan().sum())} NaN, "
                f"relative error {relative_error(out.nan_to_num(), reference):.2e}"
            )
    counts = [int((c != 0).sum()) for c in gemm._TILE_COUNTS.values()]
    return "\n".join(lines + [f"non-zero tile counters per stream after the launches: {counts}"])


# Wide MMA-order tiles (the dequantized weight shared by up to 256 activation rows), split K or
# not; tune_gemm.WIDE_TILES are the candidates for the mid-size buckets.
WIDE_MMA_ORDER_CONFIGS = [
    GemmConfig(128, 128, 128, 8, 3, programs_per_sm=1, weight_as_mma_a=True, mma_order=True),
    GemmConfig(256, 128, 64, 8, 4, weight_as_mma_a=True, mma_order=True),
    GemmConfig(256, 64, 64, 4, 4, programs_per_sm=1, weight_as_mma_a=True, mma_order=True),
]


@requires_cuda
@pytest.mark.parametrize("config", WIDE_MMA_ORDER_CONFIGS, ids=str)
@pytest.mark.parametrize("M,N,K", [(100, 14336, 4096), (512, 4096, 14336), (333, 96, 16), (70, 200, 4112)], ids=str)
def test_gpu_wide_mma_order_tiles_match_fp64_reference(config, M, N, K):
    """Wide MMA-order tiles: row and column edges, a split K summed in the GEMM, and K not a
    multiple of 32 (the tiles then run on the block-deinterleaved operand): shorter than one tile,
    and ragged."""
    operands = gemm_operands(M, N, K, seed=M, device="cuda")
    operand = gemm_operands(M, N, K, seed=M, device="cuda", config=config)[0]
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch_nvfp4_gemm(operand, *operands[1:], out, config)
    assert relative_error(out, reference_gemm(*operands)) <= gpu_tolerance(K, torch.bfloat16)


@requires_cuda
@pytest.mark.parametrize("dtype", DEQUANTIZE_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("N,K", [(8192, 8192), (96, 16)], ids=str)
def test_gpu_weight_dequantize_matches_reference_bit_for_bit(N, K, dtype):
    _, weight_qdata, weight_block_scales, *_ = gemm_operands(1, N, K, seed=N, device="cuda")
    dequantized = torch.full((N, K), float("nan"), dtype=dtype, device="cuda")
    launch_weight_dequantize(weight_qdata, weight_block_scales, dequantized)
    assert_dequantized_like_reference(weight_qdata, weight_block_scales, dequantized)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "M,N,K", [(4096, 8192, 8192), (FIRST_CUBLAS_ROWS, 1024, 4096), (FIRST_CUBLAS_ROWS + 77, 96, 16)], ids=str
)
def test_gpu_cublas_fused_epilogue_matches_fp64_reference_and_the_triton_epilogue(dtype, with_bias, M, N, K):
    """The op with a host scale: cuBLAS applies it as alpha and adds the bias, one rounding; the
    result is within the same bound as the Triton epilogue's and close to it element for element.
    The weights are ones cuBLAS's route serves at these rows (a wider one at 513-2048 rows takes
    the tall tile on Hopper)."""
    operand, weight_qdata, weight_block_scales, act_scale, weight_scale, bias = gemm_operands(M, N, K, seed=M, device="cuda")
    bias = bias.to(dtype) if with_bias else None
    output_scale = float(act_scale * weight_scale)
    config = table_config(M, None, N, K, operand.device)
    assert fuses_epilogue_into_cublas(config, dtype, output_scale, bias)
    operand_in_dtype = operand.to(dtype)  # exact: q * s_b has at most 5 significant bits
    fused = nvfp4_gemm(operand_in_dtype, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, dtype, output_scale)
    unfused = nvfp4_gemm(operand, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, dtype)
    reference = reference_gemm(operand, weight_qdata, weight_block_scales, act_scale, weight_scale, bias)
    assert fused.dtype == dtype
    assert relative_error(fused, reference) <= gpu_tolerance(K, dtype)
    # Both round the same fp32 value, up to summation order: apart by about one output rounding.
    assert relative_error(fused, unfused.double()) <= 2 * UNIT_ROUNDOFF[dtype]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "M,N,K,rows,programs_per_sm",
    [
        (1, 8192, 8192, 1, 0),
        (1, 4096, 14336, 1, 1),
        (3, 14336, 4096, 4, 2),
        (5, 1024, 4096, 2, 1),
        (16, 8192, 8192, 16, 2),
        (1, 96, 16, 1, 0),
    ],
    ids=str,
)
@pytest.mark.parametrize("wide", [False, True], ids=["", "wide"])
def test_gpu_quantizing_gemm_equals_the_two_kernel_route_bit_for_bit(dtype, with_bias, M, N, K, rows, programs_per_sm, wide):
    """Quantizing the activation inside the GEMM (rows spread over the MMA tile, several row
    tiles at M = 5, split K or not, a K shorter than one tile; untransposed, or transposed in
    the MMA order) gives the operand kernel + GEMM's output exactly, with the same tiles: same
    operand values, same sums in the same order."""
    x, weight_qdata, weight_block_scales, act_scale, weight_scale, bias = raw_gemm_operands(M, N, K, seed=M, device="cuda")
    x = x.to(dtype)
    bias = bias if with_bias else None
    layout = dict(weight_as_mma_a=True, mma_order=True) if wide else {}
    config = GemmConfig(16, 64, 256, 4, 4, programs_per_sm=programs_per_sm, activation_rows=rows, **layout)
    fused = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    launch_nvfp4_gemm(x, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, fused, config, raw_activation=True)
    operand_config = replace(config_for_width(config, K), activation_rows=0)
    operand = gemm_activation_operand(x, act_scale, mma_order=operand_in_mma_order(operand_config))
    two_kernels = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    launch_nvfp4_gemm(operand, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, two_kernels, operand_config)
    assert torch.equal(fused, two_kernels)
    reference = reference_gemm(gemm_activation_operand(x, act_scale), weight_qdata, weight_block_scales, act_scale, weight_scale, bias)
    assert relative_error(fused, reference) <= gpu_tolerance(K, dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "M,N,K,rows", [(2, 1024, 4096, 2), (3, 4096, 4096, 4), (5, 96, 48, 8), (8, 8192, 8192, 8), (16, 4096, 14336, 16)],
    ids=str,
)
def test_gpu_eager_linear_of_2_to_16_rows_is_one_launch_quantizing_its_rows(M, N, K, rows, dtype):
    """Called eagerly at 2-16 rows of a bf16 or fp16 activation the route makes one launch, the
    one-row entry's tiles quantizing M rounded up to a power of 2 rows (a split K summed in it, a
    K shorter than one tile): the operand kernel + GEMM's output with those tiles bit for bit, and
    within the GEMM's tolerance of the fp64 product."""
    from nvfp4_static.backends.triton_route import static_nvfp4_linear

    x, weight_qdata, weight_block_scales, act_scale, weight_scale, bias = raw_gemm_operands(M, N, K, seed=M, device="cuda")
    x = x.to(dtype)
    with recording_launches() as launches:
        out = static_nvfp4_linear(x, weight_qdata, weight_block_scales, weight_scale, act_scale, bias)
    assert [call.meta["QUANTIZE_ROWS"] for call in launches] == [rows]
    operand = gemm_activation_operand(x, act_scale)
    two_kernels = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    config = taking_operand(eager_quantizing_tiles(M))
    launch_nvfp4_gemm(operand, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, two_kernels, config)
    assert torch.equal(out, two_kernels)
    reference = reference_gemm(operand, weight_qdata, weight_block_scales, act_scale, weight_scale, bias)
    assert relative_error(out, reference) <= gpu_tolerance(K, dtype)


@requires_cuda
@pytest.mark.parametrize("M,N,K", [(2, 1024, 4096), (16, 4096, 14336)], ids=str)
def test_gpu_eager_linear_of_fp32_rows_runs_the_operand_kernel_then_the_entry(M, N, K):
    """fp32 activations at 2-16 rows keep the operand kernel and the table's entry (two
    launches), whose output the entry given the operand gives bit for bit."""
    from nvfp4_static.backends.triton_route import static_nvfp4_linear

    x, weight_qdata, weight_block_scales, act_scale, weight_scale, bias = raw_gemm_operands(M, N, K, seed=M, device="cuda")
    with recording_launches() as launches:
        out = static_nvfp4_linear(x, weight_qdata, weight_block_scales, weight_scale, act_scale, bias)
    assert len(launches) == 2 and launches[1].meta["QUANTIZE_ROWS"] == 0
    config = gemm_config(M)
    operand = gemm_activation_operand(x, act_scale, mma_order=operand_in_mma_order(config_for_width(config, K)))
    entry = torch.full((M, N), float("nan"), dtype=torch.float32, device="cuda")
    launch_nvfp4_gemm(operand, weight_qdata, weight_block_scales, act_scale, weight_scale, bias, entry, config)
    assert torch.equal(out, entry)


@requires_cuda
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (1, 4096, 14336), (4, 4096, 4096), (16, 8192, 8192), (64, 4096, 4096)], ids=str)
def test_gpu_split_k_summed_in_the_gemm_equals_the_epilogue_kernels_sum(M, N, K, with_bias):
    """The table's split-K entries, summed by each tile's last program: the epilogue kernel's
    output bit for bit, on every one of 20 launches (a tile summed before all of its partials
    had landed would differ), with the stream's counters left zero for the next GEMM."""
    assert_split_k_summed_in_the_gemm_like_the_epilogue_kernel(M, N, K, with_bias, gemm_config(M), launches=20)


# Wide tiles with the split sized for several row tiles (GemmConfig.row_tiles_for_split), so
# that a weight with few column tiles fills the SMs at mid-size M; each splits K on both shapes
# at 132 SMs (asserted), over 2-8 row tiles with row edges at M = 129 and 300.
WIDE_ROW_TILE_SPLIT_CONFIGS = [
    GemmConfig(128, 128, 128, 8, 3, programs_per_sm=4, weight_as_mma_a=True, mma_order=True, row_tiles_for_split=2),
    GemmConfig(64, 128, 128, 4, 4, programs_per_sm=8, weight_as_mma_a=True, mma_order=True, row_tiles_for_split=4),
]


@requires_cuda
@pytest.mark.parametrize("config", WIDE_ROW_TILE_SPLIT_CONFIGS, ids=str)
@pytest.mark.parametrize("M", [129, 256, 300, 512])
@pytest.mark.parametrize("N,K", [(4096, 14336), (14336, 4096)], ids=str)
def test_gpu_split_k_over_several_row_tiles_matches_fp64_and_the_epilogue_kernels_sum(config, M, N, K):
    assert ceil_div(M, config.rows_per_tile) > 1
    assert_split_k_summed_in_the_gemm_like_the_epilogue_kernel(M, N, K, True, config, launches=5)


def assert_split_k_summed_in_the_gemm_like_the_epilogue_kernel(M, N, K, with_bias, config, launches):
    """``config`` splits K on this GPU; the GEMM summing its splits gives the epilogue kernel's
    output bit for bit on each of ``launches`` launches, that output matches the fp64 reference,
    and the stream's counters are left zero."""
    x, weight_qdata, weight_block_scales, act_scale, weight_scale, bias = raw_gemm_operands(M, N, K, seed=M, device="cuda")
    x, bias = x.bfloat16(), bias if with_bias else None
    assert split_k_for(config, N, K, x.device) > 1
    raw = quantizes_activation_in_gemm(config)
    mma_order = operand_in_mma_order(config_for_width(config, K))
    a = x if raw else gemm_activation_operand(x, act_scale, mma_order=mma_order)
    operands = (a, weight_qdata, weight_block_scales, act_scale, weight_scale, bias)
    apart = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch_nvfp4_gemm(*operands, apart, config, raw, False)
    reference = reference_gemm(gemm_activation_operand(x, act_scale), *operands[1:])
    assert relative_error(apart, reference) <= gpu_tolerance(K, torch.bfloat16)
    for launch in range(launches):
        in_gemm = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch_nvfp4_gemm(*operands, in_gemm, config, raw, True)
        assert torch.equal(in_gemm, apart), launch
    assert not tile_counts(x.device, 1).any()


@requires_cuda
def test_gpu_graphs_captured_on_one_stream_give_the_eager_output_whatever_the_kept_counters_hold():
    """Two CUDA graphs of a GEMM that sums its K splits itself, captured one after the other on
    one stream and replayed in the other order, after every counter buffer kept for a capture
    was filled with 7s (what a graph pool's memory may hold): each graph zeroes counters of its
    own, so each replay gives the eager output."""
    M, N, K = 128, 4096, 14336
    config = next(config for max_m, config in TRITON_ENTRIES if max_m == M and not config.warp_specialized)
    assert split_k_for(config, N, K, torch.device("cuda")) > 1
    operands = gemm_operands(M, N, K, seed=5, device="cuda", config=config)
    eager = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch_nvfp4_gemm(*operands, eager, config, False, True)
    reference = reference_gemm(*gemm_operands(M, N, K, seed=5, device="cuda"))
    assert relative_error(eager, reference) <= gpu_tolerance(K, torch.bfloat16)

    def call():
        out = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
        launch_nvfp4_gemm(*operands, out, config, False, True)
        return out

    outs, kept = captured_twice_then_replayed_backwards(call, torch.cuda.Stream())
    assert kept, "no counters were made for a capture"
    for out in outs:
        assert torch.equal(out, eager), launches_apart([eager, out], reference)


def test_quantizing_op_names_the_cpu_backend_for_cpu_tensors():
    with pytest.raises(ValueError, match="cpu"):
        quantizing_nvfp4_gemm(*raw_gemm_operands(1, 16, 32, seed=0))


def test_launcher_refuses_a_config_that_would_misread_the_activation():
    """An fp16 operand under a quantizing config would be quantized again, a raw activation
    under an operand config multiplied unquantized: both wrong products, so both are refused."""
    x, *weights_and_bias = raw_gemm_operands(1, 16, 32, seed=0)
    out = torch.empty(1, 16)
    quantizing, operand_only = GemmConfig(16, 16, 32, 4, 1, activation_rows=1), GemmConfig(16, 16, 32, 4, 1)
    with pytest.raises(ValueError, match="raw_activation=False .* activation_rows = 1"):
        launch_nvfp4_gemm(x.half(), *weights_and_bias, out, quantizing)
    with pytest.raises(ValueError, match="raw_activation=True .* activation_rows = 0"):
        launch_nvfp4_gemm(x, *weights_and_bias, out, operand_only, raw_activation=True)


@pytest.mark.parametrize(
    "block_k,K,split_k",
    [(32, 96, 0), (32, 96, -2), (32, 96, 4), (64, 64, 2), (16, 96, 7), (None, 96, 2)],
    ids=str,
)
def test_launcher_refuses_a_k_split_that_leaves_a_split_without_k_tiles(block_k, K, split_k, monkeypatch):
    """A split handed to the launcher (as the wide tiles' op is handed one) must give every split
    some of the K tiles: not 0 or fewer, not 4 splits of 3 tiles (32-wide on K = 96), 2 of one
    (64-wide on K = 64) or 7 of 6 (16-wide); and cuBLAS's route (``block_k`` None) takes none.
    Nothing is launched."""
    monkeypatch.setattr(gemm, "launch_tiles", lambda *args: pytest.fail("launched"))
    monkeypatch.setattr(gemm, "launch_weight_dequantize", lambda *args: pytest.fail("launched"))
    config = CublasAfterDequantize() if block_k is None else GemmConfig(16, 16, block_k, 4, 1)
    operand, *weight = gemm_operands(3, 16, K, seed=0)
    out = torch.empty(3, 16)
    with pytest.raises(ValueError, match=rf"split_k = {split_k} for K = {K}"):
        launch_nvfp4_gemm(operand, *weight, out, config, split_k=split_k)
