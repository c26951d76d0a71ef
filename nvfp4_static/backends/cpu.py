"""The torch-ops route of the static NVFP4 linear: runs anywhere, defines the numerics.

A faithful emulation of an FP4 tensor-core GEMM: both operands are dequantized *without* their
global scales (``q * s_b`` is exact in bf16 and fp32), multiplied with fp32 accumulation, and the
product of the two global scales and the bias are applied afterwards.
"""

from typing import Optional

import torch

from nvfp4_static.numerics import dequantize_nvfp4, quantize_nvfp4_unpacked, times_block_scales


def static_nvfp4_linear(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    output_scale: Optional[float] = None,
) -> torch.Tensor:
    """``x [..., K] @ W^T + bias`` with ``x`` quantized to NVFP4 under its static global scale.

    Args:
        x: ``[..., K]`` activation (fp32 / bf16 / fp16), K a multiple of 16.
        weight_qdata: ``[N, K // 2]`` packed E2M1 codes; weight_block_scales: ``[N, K // 16]`` FP8.
        weight_per_tensor_scale, act_per_tensor_scale: float32 scalars (torchao convention).
        bias: optional ``[N]``.
        output_scale: ``act_per_tensor_scale * weight_per_tensor_scale`` as a Python float, when
            the caller has it; a route that hands the epilogue to cuBLAS needs it on the host
            (``backends.triton_route``). This route scales on the device and ignores it.

    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    # q * s_b of the activation, the same values its packed codes would decode to.
    act = times_block_scales(*quantize_nvfp4_unpacked(x, act_per_tensor_scale))
    weight = dequantize_nvfp4(weight_qdata, weight_block_scales)
    out = torch.matmul(act, weight.t()) * (act_per_tensor_scale * weight_per_tensor_scale)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def grouped_static_nvfp4_linear(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scales: torch.Tensor,
    act_per_tensor_scales: torch.Tensor,
) -> torch.Tensor:
    """The experts of a mixture-of-experts layer: ``static_nvfp4_linear`` of each expert's rows.

    ``x [R, K]`` is sorted by expert: rows ``expert_offsets[e]`` to ``expert_offsets[e + 1]`` go
    to expert ``e``, whose weight is ``weight_qdata[e]``, ``weight_block_scales[e]`` with global
    scales ``weight_per_tensor_scales[e]`` and ``act_per_tensor_scales[e]``. Returns ``[R, N]`` in
    ``x.dtype``; rows from ``expert_offsets[-1]`` on are left unwritten. The torch reference of
    the grouped Triton GEMM (``kernels.grouped_gemm``).
    """
    out = x.new_empty((x.shape[0], weight_qdata.shape[1]))
    bounds = expert_offsets.tolist()
    for expert, (first, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > first:
            out[first:end] = static_nvfp4_linear(
                x[first:end],
                weight_qdata[expert],
                weight_block_scales[expert],
                weight_per_tensor_scales[expert],
                act_per_tensor_scales[expert],
                None,
            )
    return out
