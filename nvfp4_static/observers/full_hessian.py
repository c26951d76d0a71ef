"""The layer's whole input Hessian, ``X^T X``, that GPTQ rounds the weight under."""

import torch

from nvfp4_static.numerics import BLOCK_SIZE
from nvfp4_static.observers.block_hessian import BlockHessianAccumulator

__all__ = ["FullHessianAccumulator", "block_diagonal"]


class FullHessianAccumulator(BlockHessianAccumulator):
    """``H = sum_tokens x x^T`` over a linear layer's inputs: fp32 ``[K, K]``, unnormalised.

    GPTQ (``weight_scale="gptq"``, ``nvfp4_static.gptq``) needs every entry: it moves each
    column's rounding error onto the other columns through ``H``'s off-diagonal. The state is
    ``K^2 * 4`` bytes per layer (64 MiB at K = 4096, 784 MiB at K = 14336), against
    ``K * 64`` bytes for ``BlockHessianAccumulator``; for a large model, calibrate layer by
    layer (``nvfp4_static.calibrate_layer_by_layer``) so that only one decoder layer's
    Hessians exist at a time. Everything else (state, merging, refusing NaN/Inf batches) is
    the block accumulator's; ``block_diagonal(hessian)`` gives its 16x16 blocks.
    """

    def _zero_hessian(self, device: torch.device) -> torch.Tensor:
        k = self.in_features
        return torch.zeros(k, k, dtype=torch.float32, device=device)

    def _add_to_hessian(self, x: torch.Tensor, hessian: torch.Tensor) -> None:
        tokens = x.reshape(-1, self.in_features).to(torch.float32)
        hessian.addmm_(tokens.T, tokens)

    @property
    def hessian(self) -> torch.Tensor:
        """The accumulated ``[K, K]`` fp32 Hessian (the live tensor, not a copy)."""
        return super().hessian


def block_diagonal(hessian: torch.Tensor) -> torch.Tensor:
    """The ``[K/16, 16, 16]`` diagonal blocks of a ``[K, K]`` Hessian (K a multiple of 16): the
    per-input-block Hessians that ``BlockHessianAccumulator`` sums, so a full Hessian also
    serves ``weight_scale="hessian_mse"``."""
    n_blocks = hessian.shape[0] // BLOCK_SIZE
    blocks = hessian.reshape(n_blocks, BLOCK_SIZE, n_blocks, BLOCK_SIZE)
    return blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()
