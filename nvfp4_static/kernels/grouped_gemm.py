"""The grouped static NVFP4 GEMM of a mixture-of-experts layer, in Triton.

A layer's routed rows arrive sorted by expert: rows ``expert_offsets[e]`` to
``expert_offsets[e + 1]`` of ``x [R, K]`` go to expert ``e``, whose weight is ``[N, K]`` of a
stacked ``[E, N, K]`` NVFP4 weight with its own weight and activation global scales. For each
expert's rows this computes exactly what ``backends.cpu.static_nvfp4_linear`` computes for that
expert alone: the rows are quantized under the expert's static activation scale, multiplied by the
expert's dequantized weight with fp32 accumulation, and scaled by the product of the two global
scales (no bias: transformers' experts have none).

Two kernels. The first quantizes every routed row once, under its expert's activation scale,
into packed E2M1 codes and FP8 block scales (``act_quantize``'s arithmetic, bit for bit
``numerics.quantize_nvfp4``); it can read its rows through an index (``source_rows``), so the
gather of each token's hidden state to its experts' rows costs no pass of its own. The second
is the grouped GEMM on those packed rows: both operands are dequantized in registers to fp16
``q * s_b`` (exact) as ``kernels.gemm`` does for its weight, split into the even-K and odd-K
halves that a byte's two nibbles give, and multiplied on the tensor cores.

Each GEMM program computes one ``BLOCK_M x BLOCK_N`` output tile of one expert; the ``N`` tiles
of one row tile are neighbours in launch order, so they share its activation rows in L2. An
expert's rows fill ``ceil(rows / BLOCK_M)`` row tiles; each program finds its expert from the
running sum of those counts, which it computes from ``expert_offsets`` itself (no host work, no
shape that depends on the routing). The grid is sized for the most row tiles any routing of ``R``
rows can need; programs past the last tile return at once. Each row of the quantize kernel finds
its expert the same way.

The op ``grouped_static_nvfp4_linear`` (``kernels.ops``) calls ``launch_grouped_nvfp4_gemm`` on
CUDA tensors; its torch reference runs ``backends.cpu.static_nvfp4_linear`` expert by expert.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from nvfp4_static.kernels.act_quantize import nvfp4_block_scale, pack_e2m1, round_to_e2m1
from nvfp4_static.kernels.gemm import accumulate_halves, dequantize_weight_tile, use_ptx_dequant
from nvfp4_static.kernels.launch import KernelCall, ceil_div, launch_prepared, next_power_of_2
from nvfp4_static.numerics import BLOCK_SIZE, check_dtype


@triton.jit
def _expert_of(
    index, expert_offsets_ptr, ROWS_PER_TILE: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr
):
    """The expert owning row tile ``index`` (tiles of ``ROWS_PER_TILE`` rows, each expert's rows
    starting a new one), ``NUM_EXPERTS`` past the last; with that expert's first tile and its
    rows' range ``[start, end)``."""
    experts = tl.arange(0, EXPERTS_POW2)
    in_range = experts < NUM_EXPERTS
    starts = tl.load(expert_offsets_ptr + experts, mask=in_range, other=0)
    ends = tl.load(expert_offsets_ptr + experts + 1, mask=in_range, other=0)
    tiles = (ends - starts + ROWS_PER_TILE - 1) // ROWS_PER_TILE
    tile_ends = tl.cumsum(tiles, axis=0)
    expert = tl.sum((tile_ends <= index).to(tl.int32), axis=0)
    mine = experts == expert
    first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), axis=0)
    return expert, first_tile, tl.sum(tl.where(mine, starts, 0), axis=0), tl.sum(tl.where(mine, ends, 0), axis=0)


@triton.jit
def _routed_rows_quantize_kernel(
    x_ptr,
    source_rows_ptr,
    expert_offsets_ptr,
    act_scales_ptr,
    qdata_ptr,
    scales_ptr,
    K: tl.constexpr,
    stride_xm: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    expert, _, _, _ = _expert_of(row, expert_offsets_ptr, 1, NUM_EXPERTS, EXPERTS_POW2)
    if expert >= NUM_EXPERTS:  # a row routed nowhere
        return
    source = tl.load(source_rows_ptr + row).to(tl.int64) if GATHER else row.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    # K is a multiple of 16, so a 16-block is either wholly inside the row or wholly masked.
    x = tl.load(x_ptr + source * stride_xm + cols[None, :], mask=cols[None, :] < K, other=0.0)
    blocks = tl.reshape(x.to(tl.float32), (1, BLOCK_K // 16, 16))
    _, scale_code, reciprocal = nvfp4_block_scale(tl.max(tl.abs(blocks), axis=2), tl.load(act_scales_ptr + expert))
    magnitude, negative = round_to_e2m1(blocks * reciprocal[:, :, None])
    half_cols = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(
        qdata_ptr + row * (K // 2) + half_cols[None, :],
        pack_e2m1(magnitude, negative, 1, BLOCK_K),
        mask=half_cols[None, :] < K // 2,
    )
    group_cols = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    tl.store(scales_ptr + row * (K // 16) + group_cols[None, :], scale_code, mask=group_cols[None, :] < K // 16)


@triton.jit
def _load_packed_tile(
    qdata_ptr, scales_ptr, rows, valid_rows, k_tile, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr
):
    """Rows ``rows`` of a packed ``[*, K]`` NVFP4 operand, K tile ``k_tile``: codes
    ``[rows, BLOCK_K / 2]`` and FP8 scale bytes ``[rows, BLOCK_K / 16]``, zeros where masked."""
    offs_kb = k_tile * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    offs_ks = k_tile * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    packed = tl.load(
        qdata_ptr + rows[:, None] * (K // 2) + offs_kb[None, :],
        mask=valid_rows[:, None] & ((offs_kb[None, :] < K // 2) | EVEN_K),
        other=0,
    )
    scale_codes = tl.load(
        scales_ptr + rows[:, None] * (K // 16) + offs_ks[None, :],
        mask=valid_rows[:, None] & ((offs_ks[None, :] < K // 16) | EVEN_K),
        other=0,
    )
    return packed, scale_codes


@triton.jit
def _grouped_nvfp4_gemm_kernel(
    a_ptr,
    a_scales_ptr,
    expert_offsets_ptr,
    w_ptr,
    w_scales_ptr,
    weight_scales_ptr,
    act_scales_ptr,
    out_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    stride_om: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PTX: tl.constexpr,
    WEIGHT_AS_A: tl.constexpr,
):
    TILES_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    tile_m = tl.program_id(0) // TILES_N
    pid_n = tl.program_id(0) % TILES_N
    expert, first_tile, row_start, row_end = _expert_of(tile_m, expert_offsets_ptr, BLOCK_M, NUM_EXPERTS, EXPERTS_POW2)
    if expert >= NUM_EXPERTS:  # past the last tile of this routing
        return
    offs_m = row_start + (tile_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = offs_m < row_end
    rows_m = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < N
    rows_n = expert.to(tl.int64) * N + offs_n  # rows of the stacked [E * N, K] weight

    # WEIGHT_AS_A computes the transposed tile, W @ A^T, so that a tile of few rows still fills
    # the MMA's M side with weight rows (as kernels.gemm does).
    if WEIGHT_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        packed, scale_codes = _load_packed_tile(a_ptr, a_scales_ptr, rows_m, valid_m, k_tile, K, BLOCK_K, EVEN_K)
        a_even, a_odd = dequantize_weight_tile(packed, scale_codes, BLOCK_M, BLOCK_K, PTX)
        packed, scale_codes = _load_packed_tile(w_ptr, w_scales_ptr, rows_n, valid_n, k_tile, K, BLOCK_K, EVEN_K)
        w_even, w_odd = dequantize_weight_tile(packed, scale_codes, BLOCK_N, BLOCK_K, PTX)
        acc = accumulate_halves(acc, a_even, a_odd, w_even, w_odd, WEIGHT_AS_A)

    acc = acc * (tl.load(act_scales_ptr + expert) * tl.load(weight_scales_ptr + expert))
    if WEIGHT_AS_A:
        out_offsets = rows_m[None, :] * stride_om + offs_n[:, None]
        out_mask = valid_m[None, :] & valid_n[:, None]
    else:
        out_offsets = rows_m[:, None] * stride_om + offs_n[None, :]
        out_mask = valid_m[:, None] & valid_n[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class GroupedGemmConfig:
    """One tile shape: ``block_m`` rows of one expert by ``block_n`` outputs, ``block_k`` deep;
    ``weight_as_mma_a`` computes each tile transposed (``W @ A^T``)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    weight_as_mma_a: bool = False


# By routed rows per expert on average (R / E): the tiles examples/benchmarks/tune_grouped_gemm.py
# found best on an H100 for bench_moe.py's layer at 1-128, 1024 and 4096 tokens (figures in
# examples/benchmarks/RESULTS.md); the bounds between those sizes are not measured. The rows stay
# packed codes: an fp16 operand would skip their dequantization per N tile but move 4x the bytes.
GROUPED_GEMM_CONFIGS = (
    (16, GroupedGemmConfig(16, 64, 256, 4, 4)),
    (128, GroupedGemmConfig(64, 128, 128, 4, 3)),
    (None, GroupedGemmConfig(128, 128, 64, 4, 4)),
)
# Activation columns one program of the quantize kernel covers (one row per program), and its
# warps: act_quantize's tile, chosen there by a sweep on an H200.
QUANTIZE_BLOCK_K = 1024
QUANTIZE_NUM_WARPS = 2


def grouped_gemm_config(rows: int, num_experts: int) -> GroupedGemmConfig:
    """The table's entry for ``rows`` routed rows over ``num_experts`` experts."""
    for max_rows_per_expert, config in GROUPED_GEMM_CONFIGS:
        if max_rows_per_expert is None or rows <= max_rows_per_expert * num_experts:
            return config
    raise AssertionError("GROUPED_GEMM_CONFIGS ends with a catch-all entry")


def check_grouped_operands(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scales: torch.Tensor,
    act_per_tensor_scales: torch.Tensor,
    source_rows: Optional[torch.Tensor] = None,
) -> None:
    """Refuse operands whose shapes do not describe ``E`` experts of ``[N, K]`` weights, or a
    ``source_rows`` that is not a 1-D integer index."""
    check_dtype(x, "grouped GEMM activation")
    E, N = weight_qdata.shape[:2]
    K = x.shape[-1] if x.dim() == 2 else -1
    expected = {
        "x": (x, (x.shape[0], K)),
        "expert_offsets": (expert_offsets, (E + 1,)),
        "weight_qdata": (weight_qdata, (E, N, K // 2)),
        "weight_block_scales": (weight_block_scales, (E, N, K // BLOCK_SIZE)),
        "weight_per_tensor_scales": (weight_per_tensor_scales, (E,)),
        "act_per_tensor_scales": (act_per_tensor_scales, (E,)),
    }
    wrong = [
        f"{name} {tuple(t.shape)} (want {want})"
        for name, (t, want) in expected.items()
        if tuple(t.shape) != want
    ]
    if source_rows is not None and (source_rows.dim() != 1 or source_rows.dtype.is_floating_point):
        wrong.append(f"source_rows {tuple(source_rows.shape)} {source_rows.dtype} (want 1-D integers)")
    if K % BLOCK_SIZE or wrong:
        raise ValueError(
            f"nvfp4_static: grouped NVFP4 GEMM operands do not fit together (x [R, K] with K a "
            f"multiple of {BLOCK_SIZE}, E experts of [N, K] weights): {', '.join(wrong) or f'K = {K}'}"
        )


def launch_routed_rows_quantize(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    act_per_tensor_scales: torch.Tensor,
    qdata: torch.Tensor,
    block_scales: torch.Tensor,
    source_rows: Optional[torch.Tensor] = None,
) -> None:
    """Quantize row ``r`` of ``x`` (row ``source_rows[r]`` where given) under the activation
    scale of the expert owning row ``r`` into ``qdata [R, K/2]`` and ``block_scales [R, K/16]``
    (float8_e4m3fn or uint8); rows from ``expert_offsets[-1]`` on are not written."""
    x = x if x.stride(1) == 1 else x.contiguous()
    R, K = qdata.shape[0], x.shape[1]
    E = act_per_tensor_scales.shape[0]
    if R == 0:
        return
    call = KernelCall(
        _routed_rows_quantize_kernel,
        (R, ceil_div(K, QUANTIZE_BLOCK_K)),
        (
            x,
            x if source_rows is None else source_rows,
            expert_offsets,
            act_per_tensor_scales.to(torch.float32),
            qdata,
            block_scales.view(torch.uint8),
            K,
            x.stride(0),
        ),
        dict(
            NUM_EXPERTS=E,
            EXPERTS_POW2=next_power_of_2(E),
            BLOCK_K=min(QUANTIZE_BLOCK_K, next_power_of_2(K)),
            GATHER=source_rows is not None,
            num_warps=QUANTIZE_NUM_WARPS,
        ),
    )
    launch_prepared(call, x.device)


def launch_grouped_nvfp4_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scales: torch.Tensor,
    act_per_tensor_scales: torch.Tensor,
    out: torch.Tensor,
    config: Optional[GroupedGemmConfig] = None,
    source_rows: Optional[torch.Tensor] = None,
) -> None:
    """Write each expert's rows of ``out [R, N]`` (rows from ``expert_offsets[-1]`` on are not
    written): quantize the routed rows once, then the grouped GEMM on the packed rows. Row ``r``
    is ``x[source_rows[r]]`` where ``source_rows`` is given, else ``x[r]``. ``config`` defaults
    to the table's entry for ``R`` rows over ``E`` experts."""
    check_grouped_operands(
        x, expert_offsets, weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales,
        source_rows,
    )
    R, K = out.shape[0], x.shape[1]
    E, N = weight_qdata.shape[:2]
    if R == 0:
        return
    config = config or grouped_gemm_config(R, E)
    qdata = torch.empty((R, K // 2), dtype=torch.uint8, device=x.device)
    block_scales = torch.empty((R, K // BLOCK_SIZE), dtype=torch.uint8, device=x.device)
    launch_routed_rows_quantize(x, expert_offsets, act_per_tensor_scales, qdata, block_scales, source_rows)
    # Every expert with rows wastes less than one tile, and every tile holds at least one row.
    max_tiles = min(R, ceil_div(R, config.block_m) + E)
    call = KernelCall(
        _grouped_nvfp4_gemm_kernel,
        (max_tiles * ceil_div(N, config.block_n),),
        (
            qdata,
            block_scales,
            expert_offsets,
            weight_qdata.contiguous(),
            weight_block_scales.contiguous().view(torch.uint8),
            weight_per_tensor_scales.to(torch.float32),
            act_per_tensor_scales.to(torch.float32),
            out,
            N,
            K,
            out.stride(0),
        ),
        dict(
            NUM_EXPERTS=E,
            EXPERTS_POW2=next_power_of_2(E),
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            EVEN_K=K % config.block_k == 0,
            PTX=use_ptx_dequant(x.device),
            WEIGHT_AS_A=config.weight_as_mma_a,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        ),
    )
    launch_prepared(call, x.device)
