"""Calibration and inference ops, dispatched by device.

Each op runs a Triton kernel on CUDA tensors and the plain-torch reference in
``nvfp4_static.references`` / ``nvfp4_static.numerics`` otherwise; both give identical results.
The calibration ops are ``torch.library`` custom ops, so a calibration forward compiles with
``torch.compile(fullgraph=True)``; run eagerly on CUDA, the collect ops call their launchers
directly, because the custom op's dispatch costs as much host time as the launch itself and
calibration runs them at every observed layer. The calibrators and the tensor subclass call
these, never a kernel directly.
"""

from typing import Optional

import torch

from nvfp4_static.kernels import block_hessian, histogram, scale_sweep
from nvfp4_static.kernels.launch import runs_eagerly

__all__ = ["collect_block_amax_histogram", "fp8_scale_sweep", "accumulate_block_hessian"]


def collect_block_amax_histogram(
    x: torch.Tensor, counts: torch.Tensor, amax: torch.Tensor, bin_edges: torch.Tensor
) -> None:
    """Add ``x``'s per-block-amax histogram into ``counts`` (int64) and max into ``amax``, in place."""
    if _launches_eagerly(x, counts):
        histogram.launch_block_amax_histogram(x, counts, amax, bin_edges)
    else:
        histogram.collect_block_amax_histogram(x, counts, amax, bin_edges)


def fp8_scale_sweep(
    weight: torch.Tensor, global_amax: torch.Tensor, hessian: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Best FP8 block scale per 16-element block of ``weight``; see ``references.fp8_scale_sweep``."""
    return scale_sweep.fp8_scale_sweep(weight, global_amax, hessian)


def accumulate_block_hessian(x: torch.Tensor, hessian: torch.Tensor) -> None:
    """Add ``sum_tokens x_b x_b^T`` per 16-wide block of ``x`` into ``hessian`` [K/16, 16, 16], in place."""
    if _launches_eagerly(x, hessian):
        block_hessian.launch_block_hessian(x, hessian)
    else:
        block_hessian.accumulate_block_hessian(x, hessian)


def _launches_eagerly(x: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether to skip the custom op: real CUDA tensors outside of tracing (the op's CUDA
    kernel is this launcher; its other devices' kernel is the reference)."""
    return x.is_cuda and runs_eagerly(x, state)
