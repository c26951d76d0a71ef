"""Error bounds shared by the GPU GEMM and backend tests."""

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def gpu_tolerance(K: int, dtype: torch.dtype) -> float:
    """Products of dequantized operands are exact; summing K of them in fp32 in any order errs by
    at most about K * 2^-24 relative; add one rounding of the output to ``dtype``, and allow 2x."""
    return 2 * (K * 2.0**-24 + UNIT_ROUNDOFF[dtype])
