"""What tells whether two processes, or two runs, hold the same model, data and settings: a
tensor's sha256, whole or over an even sample of its elements (hashing every weight of an 8B
model would cost more than calibrating a layer), and the first place two such records differ."""

import hashlib

import torch

__all__ = ["SAMPLED_ELEMENTS", "first_difference", "tensor_digest"]

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


def first_difference(saved, current, path: str = ""):
    """``(path, saved value, current value)`` of the first place two records (dicts and lists
    of plain values) differ; ``path`` like ``config.weight_scale`` or ``layers[3]``."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in list(saved) + [k for k in current if k not in saved]:
            if saved.get(key) != current.get(key):
                where = f"{path}.{key}" if path else key
                return first_difference(saved.get(key), current.get(key), where)
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        for i, (a, b) in enumerate(zip(saved, current)):
            if a != b:
                return first_difference(a, b, f"{path}[{i}]")
    return path, saved, current
