"""Calibration runs the model as the converted model will run: in eval mode (dropout off,
norms on their running statistics), whatever mode the caller left it in."""

import contextlib

import torch

__all__ = ["in_eval_mode"]


@contextlib.contextmanager
def in_eval_mode(model: torch.nn.Module):
    """``model`` in eval mode inside, each module's own mode given back after, by name: a
    layer that prepare or convert put in another's place inside takes the mode of the
    module it replaced."""
    modes = {name: module.training for name, module in model.named_modules(remove_duplicate=False)}
    model.eval()
    try:
        yield
    finally:
        for name, module in model.named_modules(remove_duplicate=False):
            module.training = modes.get(name, module.training)
