"""Converted layers compute no gradients: a backward through one raises an error that says so.

Eagerly a layer's output passes through ``InferenceOnly``, whose backward raises. A compiled
layer cannot do the same: AOTAutograd traces the backward while it compiles the forward, so a
backward that raises, or a kernel op without an autograd formula in the gradient's path (the
FP4 and FP8 ops have none), fails the forward's compile, and a model called without
``torch.no_grad()`` (its embedding's weight requires gradients) would not run at all. Traced, a
layer whose inputs require gradients therefore runs its ops on detached inputs
(``detached``) and ties its output back to them through ``refusing_gradients``, whose backward is
an opaque op that raises only when it runs.
"""

from typing import Optional

import torch

__all__ = ["InferenceOnly", "MESSAGE", "detached", "records_gradients", "refusing_gradients"]

MESSAGE = (
    "nvfp4_static: converted NVFP4 layers are inference-only and have no gradients; run them "
    "under torch.no_grad() or torch.inference_mode(), and train the float model"
)


class InferenceOnly(torch.autograd.Function):
    """Passes the output through; its backward names the problem instead of failing deep in
    the FP8 and FP4 ops, which have no gradients."""

    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(MESSAGE)


@torch.library.custom_op("nvfp4_static::refuse_gradient", mutates_args=())
def refuse_gradient(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient of ``like``, which a converted layer does not have: raises ``MESSAGE``."""
    raise RuntimeError(MESSAGE)


@refuse_gradient.register_fake
def _refuse_gradient_fake(grad, like):
    return torch.empty_like(like)


class _RefusedGradients(torch.autograd.Function):
    """The output, tied to the inputs that require gradients; a backward through it raises when
    it runs (``refuse_gradient``), not when it is traced."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*inputs)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (None, *(refuse_gradient(grad, like) for like in ctx.saved_tensors))


def records_gradients(*inputs: Optional[torch.Tensor]) -> bool:
    """Whether a call on ``inputs`` records an autograd graph."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def detached(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach()


def refusing_gradients(out: torch.Tensor, *inputs: Optional[torch.Tensor]) -> torch.Tensor:
    """``out``, computed from the detached ``inputs``, tied back to those that require gradients."""
    wanting = [t for t in inputs if t is not None and t.requires_grad]
    return _RefusedGradients.apply(out, *wanting) if wanting else out
