"""The per-input-block Hessian that weights the weight-scale sweep."""

from typing import Optional

import torch

from nvfp4_static import kernels
from nvfp4_static.numerics import BLOCK_SIZE, pad_to_block_multiple
from nvfp4_static.observers.base import MergeableObserver, check_whole_number

__all__ = ["BlockHessianAccumulator"]


class BlockHessianAccumulator(MergeableObserver):
    """``H_b = sum_tokens x_b x_b^T`` for each 16-wide block ``b`` of a linear layer's input.

    A weight block only ever multiplies its own 16 inputs, so the output error it causes is
    ``dw_b^T H_b dw_b`` summed over tokens: the sweep needs these 16x16 blocks, not the full
    ``K x K`` Hessian. ``in_features`` not a multiple of 16 is zero-padded (the padded rows
    and columns stay 0). The sum is unnormalised; ``num_tokens`` says how many rows it holds.

    State (``state_dict()``): ``hessian`` fp32 ``[ceil(K/16), 16, 16]`` and ``num_tokens`` int64
    0-d, both summed. ``hessian`` / ``num_tokens`` before any ``collect`` raise ``RuntimeError``.

    Args:
        in_features: K, the layer's input width.
        name: layer name used in errors.
    """

    STATE_REDUCTIONS = {"hessian": "sum", "num_tokens": "sum"}
    OVERFLOWING_STATISTIC = "the Hessian (a sum of the activations' squares)"
    SIGNED_STATE = frozenset({"hessian"})  # off-diagonal entries

    def __init__(self, in_features: int, *, name: Optional[str] = None):
        super().__init__(name)
        self.in_features = check_whole_number(self.describe(), "in_features", in_features, 1)

    def _merge_config(self) -> tuple:
        return (self.in_features,)

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"hessian": tuple(self._zero_hessian(torch.device("meta")).shape), "num_tokens": ()}

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Add ``x_b^T x_b`` of ``x`` ``[..., in_features]`` (every leading index is a token)."""
        x = self._check_input(x, scan_for_non_finite=False)
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.describe()}: input of shape {tuple(x.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        if self._state is None:
            self._state = {
                "hessian": self._zero_hessian(x.device),
                "num_tokens": torch.zeros((), dtype=torch.int64, device=x.device),
            }

        def update():
            self._add_to_hessian(x, self._state["hessian"])
            self._state["num_tokens"] += x.numel() // self.in_features

        # NaN/Inf in x (or squares that overflow) reach the Hessian's diagonal, and a finite
        # diagonal bounds every other entry (|H_ij| <= sqrt(H_ii H_jj)): the diagonal's max is
        # a one-number test, and a batch that fails it is refused whole.
        self._update_refusing_non_finite(
            x, update, lambda: self._state["hessian"].diagonal(dim1=-2, dim2=-1).amax()
        )

    def _zero_hessian(self, device: torch.device) -> torch.Tensor:
        n_blocks = -(-self.in_features // BLOCK_SIZE)
        return torch.zeros(n_blocks, BLOCK_SIZE, BLOCK_SIZE, dtype=torch.float32, device=device)

    def _add_to_hessian(self, x: torch.Tensor, hessian: torch.Tensor) -> None:
        kernels.accumulate_block_hessian(pad_to_block_multiple(x, BLOCK_SIZE), hessian)

    @property
    def hessian(self) -> torch.Tensor:
        """The accumulated ``[ceil(K/16), 16, 16]`` fp32 Hessian (the live tensor, not a copy)."""
        hessian = self._require_state("hessian")["hessian"]
        self._check_state_finite(hessian)
        return hessian

    @property
    def num_tokens(self) -> int:
        return int(self._require_state("num_tokens")["num_tokens"])
