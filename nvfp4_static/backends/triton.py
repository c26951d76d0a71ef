"""The Triton route of the static NVFP4 linear: CUDA GPUs without FP4 tensor cores (Hopper, Ampere).

Two steps: the activation is quantized under its static global scale and written as the GEMM
operand ``q * s_b`` (``kernels.act_quantize``), then the GEMM reads the packed weight,
dequantizes it and applies both global scales and the bias in its epilogue (``kernels.gemm``;
at large M cuBLAS does the product, with the epilogue fused where ``output_scale`` is known).
At the smallest decode sizes the GEMM quantizes the activation itself: one launch.
Numerically this is ``backends.cpu`` up to the order of fp32 sums.
Non-CUDA tensors take the ``cpu`` route.
"""

from typing import Optional

import torch

from nvfp4_static.backends import cpu
from nvfp4_static.kernels.act_quantize import gemm_activation_operand
from nvfp4_static.kernels.gemm import (
    activation_operand_dtype,
    nvfp4_gemm,
    quantizes_activation_in_gemm,
    quantizing_nvfp4_gemm,
)


def static_nvfp4_linear(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    output_scale: Optional[float] = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T + bias`` with ``x`` quantized to NVFP4 under its static global scale;
    same arguments and result as ``backends.cpu.static_nvfp4_linear``."""
    if x.device.type != "cuda":
        return cpu.static_nvfp4_linear(
            x, weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale, bias
        )
    if quantizes_activation_in_gemm(x.shape[0]):
        return quantizing_nvfp4_gemm(
            x, weight_qdata, weight_block_scales, act_per_tensor_scale, weight_per_tensor_scale, bias
        )
    operand_dtype = activation_operand_dtype(x.shape[0], x.dtype, output_scale, bias)
    operand = gemm_activation_operand(x, act_per_tensor_scale, operand_dtype)
    return nvfp4_gemm(
        operand,
        weight_qdata,
        weight_block_scales,
        act_per_tensor_scale,
        weight_per_tensor_scale,
        bias,
        x.dtype,
        output_scale,
    )
