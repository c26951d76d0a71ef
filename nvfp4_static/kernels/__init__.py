"""Triton kernels for calibration and inference, and the ops that run them on every device.

- ``ops``: the ``torch.library`` ops, their fakes and the torch fallbacks; the ops below.
- ``histogram``, ``scale_sweep``, ``block_hessian``: the calibration kernels and launchers;
  ``gptq_block``: GPTQ's per-block scale search and rounding (``weight_scale="gptq"``).
- ``act_quantize``, ``gemm``, ``grouped_gemm``: the inference kernels and launchers (``gemm`` also
  holds the tile table, ``GEMM_CONFIGS``; ``grouped_gemm`` runs the experts of an MoE layer).
- ``launch``: what the launchers share (tracing a launch, grid arithmetic).

Each op runs a Triton kernel on CUDA tensors and the plain-torch reference in
``nvfp4_static.references`` / ``nvfp4_static.numerics`` otherwise (the GEMM ops are CUDA only);
the calibrators, the backends and the tensor subclass call these ops, never a kernel directly.
Without the ``triton`` package the ops exist all the same; on CUDA tensors they raise an error
that names it.
"""

from nvfp4_static.kernels.ops import (
    accumulate_block_hessian,
    collect_block_amax_histogram,
    fp8_scale_sweep,
    gemm_activation_operand,
    gptq_block,
    grouped_static_nvfp4_linear,
    nvfp4_gemm,
    quantize_activation_nvfp4,
    quantize_weight_nvfp4,
    quantizing_nvfp4_gemm,
)

__all__ = [
    "collect_block_amax_histogram",
    "fp8_scale_sweep",
    "accumulate_block_hessian",
    "gptq_block",
    "quantize_activation_nvfp4",
    "quantize_weight_nvfp4",
    "gemm_activation_operand",
    "nvfp4_gemm",
    "quantizing_nvfp4_gemm",
    "grouped_static_nvfp4_linear",
]
