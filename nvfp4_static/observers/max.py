"""The max calibrator: the literal ``max |x|``, per tensor or per channel."""

from typing import Optional

import torch

from nvfp4_static.observers.base import MergeableObserver, channel_reduce_dims, check_axis

__all__ = ["MaxCalibrator"]


class MaxCalibrator(MergeableObserver):
    """``amax = max |x|`` over everything collected, per tensor or per channel along ``axis``.

    The per-channel amax keeps ``x``'s rank with size 1 on the reduced dims (``[N, 1]`` for
    ``axis=0`` of an ``[N, K]`` tensor), so it broadcasts against ``x`` as a per-row global scale.
    It is the literal max: 0 where everything collected was 0 (callers turning it into a scale
    must handle that). ``compute_amax()`` before any ``collect`` raises ``RuntimeError``.

    State (``state_dict()``): ``amax`` fp32 (max).

    Args:
        axis: None for one amax per tensor, or the channel dim to keep.
        name: layer name used in errors and warnings.
    """

    STATE_REDUCTIONS = {"amax": "max"}

    def __init__(self, axis: Optional[int] = None, *, name: Optional[str] = None):
        super().__init__(name)
        check_axis(self.describe(), axis)
        self.axis = axis

    def _merge_config(self) -> tuple:
        return (self.axis,)

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        x = self._check_input(x, scan_for_non_finite=False)
        if x.numel() == 0:  # no tokens: nothing to observe
            return
        dims = channel_reduce_dims(x, self.axis)
        amax = x.abs().amax(dim=dims, keepdim=self.axis is not None).to(torch.float32)
        self._raise_if_non_finite(x, amax)
        if self._state is None:
            self._state = {"amax": amax}
            return
        running = self._state["amax"]
        if amax.shape != running.shape:
            raise ValueError(
                f"{self.describe()}: per-channel amax shape changed from {tuple(running.shape)} "
                f"to {tuple(amax.shape)} (input shape {tuple(x.shape)}, axis={self.axis})"
            )
        torch.maximum(running, amax.to(running.device), out=running)

    def compute_amax(self) -> torch.Tensor:
        """The running max, float32: 0-d per tensor, or keep-dim shaped per channel."""
        amax = self._require_state("compute_amax()")["amax"]
        self._check_state_finite(amax)
        return amax.clone()
