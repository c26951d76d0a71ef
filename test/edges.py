"""Numerical edges that several tests probe."""

import torch

from nvfp4_static.numerics import E4M3_MIN_NORMAL, scale_reciprocal_overflows


def smallest_accepted_per_tensor_scale() -> torch.Tensor:
    """The smallest float32 per-tensor scale whose reciprocal divided by FP8's smallest normal
    (2^-6, the clamped scale of a zero block) is still finite: the edge below which the tensor
    refuses a global scale. Found by stepping up from the real-number bound."""
    scale = torch.tensor(1 / E4M3_MIN_NORMAL / torch.finfo(torch.float32).max)
    while scale_reciprocal_overflows(scale):
        scale = torch.nextafter(scale, torch.tensor(1.0))
    return scale
