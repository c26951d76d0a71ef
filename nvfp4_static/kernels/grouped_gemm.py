"""The grouped static NVFP4 GEMM of a mixture-of-experts layer, in Triton.

A layer's routed rows arrive sorted by expert: rows ``expert_offsets[e]`` to
``expert_offsets[e + 1]`` of ``x [R, K]`` go to expert ``e``, whose weight is ``[N, K]`` of a
stacked ``[E, N, K]`` NVFP4 weight with its own weight and activation global scales. For each
expert's rows this computes exactly what ``backends.cpu.static_nvfp4_linear`` computes for that
expert alone: the rows are quantized under the expert's static activation scale, multiplied by the
expert's dequantized weight with fp32 accumulation, and scaled by the product of the two global
scales (no bias: transformers' experts have none).

Each program computes one ``BLOCK_M x BLOCK_N`` output tile of one expert. An expert's rows fill
``ceil(rows / BLOCK_M)`` tiles; ``tile_offsets [E + 1]`` (the running sum of those counts, made
on the device, so no host sync and no shape that depends on the routing) maps a program's tile
index to its expert: the number of experts whose tiles end at or before it. The grid is sized
for the most tiles any routing of ``R`` rows can need; programs past the last tile return at once.
The activation is quantized in the K loop with ``act_quantize``'s arithmetic and the weight
dequantized in registers as ``kernels.gemm`` does, both as fp16 ``q * s_b`` (exact), split into
the even-K and odd-K halves that the packed weight's two nibbles give.

The op ``grouped_static_nvfp4_linear`` (``kernels.ops``) calls ``launch_grouped_nvfp4_gemm`` on
CUDA tensors; its torch reference runs ``backends.cpu.static_nvfp4_linear`` expert by expert.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nvfp4_static.kernels.act_quantize import quantize_to_operand_halves
from nvfp4_static.kernels.gemm import _use_ptx_dequant, dequantize_weight_tile
from nvfp4_static.kernels.launch import ceil_div, next_power_of_2, traceable
from nvfp4_static.numerics import BLOCK_SIZE, check_dtype


@triton.jit
def _grouped_nvfp4_gemm_kernel(
    x_ptr,
    expert_offsets_ptr,
    tile_offsets_ptr,
    w_ptr,
    w_scales_ptr,
    weight_scales_ptr,
    act_scales_ptr,
    out_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    stride_xm: tl.constexpr,
    stride_om: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PTX: tl.constexpr,
):
    tile_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    experts = tl.arange(0, EXPERTS_POW2)
    tile_ends = tl.load(tile_offsets_ptr + 1 + experts, mask=experts < NUM_EXPERTS, other=2**30)
    expert = tl.sum((tile_ends <= tile_m).to(tl.int32), axis=0)
    if expert >= NUM_EXPERTS:  # past the last tile of this routing
        return
    first_tile = tl.load(tile_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    offs_m = tl.load(expert_offsets_ptr + expert) + (tile_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = offs_m < row_end
    rows_m = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = offs_n.to(tl.int64)
    expert_w = w_ptr + expert.to(tl.int64) * (N * (K // 2))
    expert_w_scales = w_scales_ptr + expert.to(tl.int64) * (N * (K // 16))
    act_scale = tl.load(act_scales_ptr + expert)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
        # Whole 16-blocks load or are masked, so a masked tail quantizes to zeros.
        x = tl.load(
            x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :],
            mask=valid_m[:, None] & (EVEN_K or offs_k[None, :] < K),
            other=0.0,
        )
        a_even, a_odd = quantize_to_operand_halves(x, act_scale, BLOCK_M, BLOCK_K)
        offs_kb = k_tile * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        offs_ks = k_tile * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        packed = tl.load(
            expert_w + rows_n[:, None] * (K // 2) + offs_kb[None, :],
            mask=(offs_n[:, None] < N) & (EVEN_K or offs_kb[None, :] < K // 2),
            other=0,
        )
        scale_codes = tl.load(
            expert_w_scales + rows_n[:, None] * (K // 16) + offs_ks[None, :],
            mask=(offs_n[:, None] < N) & (EVEN_K or offs_ks[None, :] < K // 16),
            other=0,
        )
        w_even, w_odd = dequantize_weight_tile(packed, scale_codes, BLOCK_N, BLOCK_K, PTX)
        acc = tl.dot(a_even.to(tl.float16), tl.trans(w_even), acc)
        acc = tl.dot(a_odd.to(tl.float16), tl.trans(w_odd), acc)

    acc = acc * (act_scale * tl.load(weight_scales_ptr + expert))
    tl.store(
        out_ptr + rows_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid_m[:, None] & (offs_n[None, :] < N),
    )


@dataclass(frozen=True)
class GroupedGemmConfig:
    """One tile shape: ``block_m`` rows of one expert by ``block_n`` outputs, ``block_k`` deep."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# By rows per expert on average (R / E): decode-sized groups waste little of a 16-row tile, larger
# ones reuse each weight tile over 64 rows. Untuned starting points, not measured choices:
# examples/benchmarks/bench_moe.py measures them against a bf16 grouped matmul.
GROUPED_GEMM_CONFIGS = (
    (16, GroupedGemmConfig(16, 64, 128, num_warps=4, num_stages=3)),
    (None, GroupedGemmConfig(64, 128, 64, num_warps=4, num_stages=3)),
)


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
) -> None:
    """Refuse operands whose shapes do not describe ``E`` experts of ``[N, K]`` weights."""
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
    if K % BLOCK_SIZE or wrong:
        raise ValueError(
            f"nvfp4_static: grouped NVFP4 GEMM operands do not fit together (x [R, K] with K a "
            f"multiple of {BLOCK_SIZE}, E experts of [N, K] weights): {', '.join(wrong) or f'K = {K}'}"
        )


def launch_grouped_nvfp4_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scales: torch.Tensor,
    act_per_tensor_scales: torch.Tensor,
    out: torch.Tensor,
    config: GroupedGemmConfig = None,
) -> None:
    """Write each expert's rows of ``out [R, N]`` (rows from ``expert_offsets[-1]`` on are not
    written). ``config`` defaults to the table's entry for ``R`` rows over ``E`` experts."""
    check_grouped_operands(
        x, expert_offsets, weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales
    )
    R, K = x.shape
    E, N = weight_qdata.shape[:2]
    if R == 0:
        return
    config = config or grouped_gemm_config(R, E)
    x = x if x.stride(1) == 1 else x.contiguous()
    expert_offsets = expert_offsets.to(torch.int32)
    tiles = ceil_div(expert_offsets[1:] - expert_offsets[:-1], config.block_m)
    tile_offsets = torch.cat((tiles.new_zeros(1), tiles.cumsum(0).to(torch.int32)))
    # Every expert with rows wastes less than one tile, and every tile holds at least one row.
    max_tiles = min(R, ceil_div(R, config.block_m) + E)
    traceable(_grouped_nvfp4_gemm_kernel)[(max_tiles, ceil_div(N, config.block_n))](
        x,
        expert_offsets,
        tile_offsets,
        weight_qdata.contiguous(),
        weight_block_scales.contiguous().view(torch.uint8),
        weight_per_tensor_scales.to(torch.float32).contiguous(),
        act_per_tensor_scales.to(torch.float32).contiguous(),
        out,
        N,
        K,
        x.stride(0),
        out.stride(0),
        NUM_EXPERTS=E,
        EXPERTS_POW2=next_power_of_2(E),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=K % config.block_k == 0,
        PTX=_use_ptx_dequant(x.device),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
