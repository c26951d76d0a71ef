"""A tensor's sha256, whole or over an even sample of its elements: what tells whether two
processes, or two runs, hold the same weights and statistics without hashing them whole
(hashing every weight of an 8B model would cost more than calibrating a layer)."""

import hashlib

import torch

__all__ = ["SAMPLED_ELEMENTS", "tensor_digest"]

# Elements hashed by a sampled digest, spread evenly over the tensor.
SAMPLED_ELEMENTS = 4096


def tensor_digest(tensor: torch.Tensor, limit: int = 0) -> str:
    """sha256 of the tensor's bytes (of ``limit`` evenly strided elements when given), the
    same whatever device the tensor is on."""
    flat = tensor.detach().reshape(-1)
    if limit and flat.numel() > limit:
        flat = flat[:: flat.numel() // limit][:limit]
    data = flat.to("cpu").contiguous().view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()
