"""Calibration runs the model as the converted model will run: in eval mode (dropout off,
norms on their running statistics), whatever mode the caller left it in."""

import contextlib

import torch

__all__ = ["in_eval_mode"]


@contextlib.contextmanager
def in_eval_mode(model: torch.nn.Module):
    """``model`` in eval mode inside, each module's own mode given back after."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training
