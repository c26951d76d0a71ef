"""Warnings attributed to the user's line of code rather than to torchao's or ours.

``quantize_`` reaches our handlers through a recursion as deep as the model's nesting, so no
fixed ``stacklevel`` lands on the caller; ``warn`` walks out of torch, torchao and this package
instead.
"""

import os
import sys
import warnings

import torch
import torchao

__all__ = ["warn"]

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (torch, torchao, sys.modules[__package__])
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` pointing at the first frame outside the libraries."""
    frame, stacklevel = sys._getframe(1), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _LIBRARY_DIRS
    ):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(message, category, stacklevel=stacklevel)
