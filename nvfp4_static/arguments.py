"""Checks of public functions' arguments that Python does not make: a flag passed as a string
(``overwrite="no"``) is truthy, and would silently do the opposite of what it says; a tensor
passed as the batches would be iterated row by row; a model given as ``torch.compile`` returned
it names every tensor ``_orig_mod.*`` and runs no hooks."""

from collections.abc import Sequence

import torch

__all__ = ["check_batches", "check_flags", "uncompiled"]


def check_flags(function: str, **flags) -> None:
    """Refuse any of ``flags`` (``name=value``) that is not True or False, naming ``function``."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"nvfp4_static: {function}: {name}={value!r} must be True or False")


def check_batches(function: str, batches) -> None:
    """Refuse ``batches`` that are not a sequence: a tensor would be taken row by row as
    batches, and a generator is consumed by the first pass over it."""
    if isinstance(batches, torch.Tensor) or not isinstance(batches, Sequence):
        raise TypeError(
            f"nvfp4_static: {function} takes a sequence of batches (a list), got a {type(batches).__name__}"
        )


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped, for a compiled model; else ``model``."""
    return model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
