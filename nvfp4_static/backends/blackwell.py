"""The Blackwell (sm100+) route of the static NVFP4 linear: a real FP4 GEMM via ``torch._scaled_mm``.

The activation is quantized under its static global scale (``kernels.ops``), both
operands' FP8 block scales are rearranged into the blocked ("swizzled") layout cuBLAS reads
(torchao's ``to_blocked``), and cuBLAS multiplies the packed FP4 operands with fp32 accumulation.
It returns fp32 so that, as on every route, the product of the two global scales and then the
bias are applied to the fp32 result before the single rounding to the activation's dtype.

Untested on hardware: this project had no sm100 GPU. The tests check the operands against
torchao's layout helpers and the whole route on CPU with ``_scaled_mm`` emulated.
"""

from typing import Optional

import torch
from torchao.prototype.mx_formats.utils import to_blocked

from nvfp4_static.kernels.ops import quantize_activation_nvfp4


def scaled_mm_operands(
    act_qdata: torch.Tensor,
    act_block_scales: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, b, scale_a, scale_b)`` for ``torch._scaled_mm`` computing ``act @ weight^T``.

    ``a`` is ``[M, K/2]`` FP4x2 row-major, ``b`` the ``[K/2, N]`` column-major view of the
    ``[N, K/2]`` weight; the scales are flattened blocked layouts (rows padded to 128, scale
    columns to 4), as cuBLAS expects for 16-element NVFP4 blocks.
    """
    a = act_qdata.contiguous().view(torch.float4_e2m1fn_x2)
    b = weight_qdata.contiguous().view(torch.float4_e2m1fn_x2).t()
    scale_a = to_blocked(act_block_scales.view(torch.float8_e4m3fn))
    scale_b = to_blocked(weight_block_scales.view(torch.float8_e4m3fn))
    return a, b, scale_a, scale_b


def static_nvfp4_linear(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    output_scale: Optional[float] = None,
) -> torch.Tensor:
    """Same arguments and result as ``backends.cpu.static_nvfp4_linear`` (``output_scale``
    unused: the scales are applied to the fp32 result on the device)."""
    act_qdata, act_block_scales = quantize_activation_nvfp4(x.reshape(-1, x.shape[-1]), act_per_tensor_scale)
    a, b, scale_a, scale_b = scaled_mm_operands(act_qdata, act_block_scales, weight_qdata, weight_block_scales)
    out = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    out = out * (act_per_tensor_scale * weight_per_tensor_scale).to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight_qdata.shape[0])
