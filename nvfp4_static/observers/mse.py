"""The MSE calibrator: search a multiplier of a given amax for the least quantization error.

The "oracle" among the activation calibrators: it measures the error of every candidate amax on
the calibration data itself, at the cost of one fake-quantization pass per candidate per batch.
"""

import math
from collections.abc import Callable
from typing import Optional

import torch

from nvfp4_static.numerics import (
    BLOCK_SIZE,
    fake_quantize_nvfp4,
    pad_to_block_multiple,
    per_tensor_amax_to_scale,
)
from nvfp4_static.observers.base import MergeableObserver, channel_reduce_dims, check_axis, check_numbers

__all__ = ["MseCalibrator", "check_search_grid", "nvfp4_fake_quantize_with_amax", "squared_error"]


def nvfp4_fake_quantize_with_amax(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quantization of ``x`` under the global scale ``amax / (448 * 6)``.

    Block scales are max-based, as at inference. ``amax`` may be per tensor or broadcast per
    row (e.g. ``[N, 1]``). The last dim is zero-padded to a multiple of 16 and cut back, which
    cannot change the result. Where ``amax`` is 0 the result is 0: a zero global scale leaves
    nothing representable.
    """
    per_tensor_scale = per_tensor_amax_to_scale(amax)
    positive = per_tensor_scale > 0
    padded = pad_to_block_multiple(x, BLOCK_SIZE)
    xq = fake_quantize_nvfp4(padded, torch.where(positive, per_tensor_scale, 1.0))
    return torch.where(positive, xq[..., : x.shape[-1]], 0.0)


def squared_error(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """Elementwise ``(x - xq) ** 2``; summed, the calibrator's default loss."""
    return (x - xq) ** 2


# The most multipliers a search grid may hold: each costs a fake quantization of the batch.
MAX_SEARCH_STEPS = 1000


def check_search_grid(who: str, step_size: float, start_multiplier: float, stop_multiplier: float) -> None:
    """Refuse a search grid that is empty, runs backwards, or has more than ``MAX_SEARCH_STEPS``
    multipliers; ``who`` starts the message."""
    check_numbers(who, step_size=step_size, start_multiplier=start_multiplier, stop_multiplier=stop_multiplier)
    if not (0.0 < start_multiplier <= stop_multiplier < math.inf and 0.0 < step_size < math.inf):
        raise ValueError(
            f"{who}: need 0 < start_multiplier <= stop_multiplier and step_size > 0, all finite; "
            f"got start={start_multiplier}, stop={stop_multiplier}, step={step_size}"
        )
    if search_steps(step_size, start_multiplier, stop_multiplier) > MAX_SEARCH_STEPS:
        raise ValueError(
            f"{who}: the search grid from {start_multiplier} to {stop_multiplier} in steps of "
            f"{step_size} has {search_steps(step_size, start_multiplier, stop_multiplier)} "
            f"multipliers, more than {MAX_SEARCH_STEPS}; use a larger step_size"
        )


def search_steps(step_size: float, start_multiplier: float, stop_multiplier: float) -> int:
    """How many multipliers the grid holds, both ends included."""
    # round(): (1.0 - 0.5) / 0.1 is 5.000000000000001 in floats, which must not add a step.
    return math.ceil(round((stop_multiplier - start_multiplier) / step_size, 9)) + 1


def check_search_amax(who: str, amax: torch.Tensor, stop_multiplier: float) -> None:
    """Refuse an amax to search around that is negative, NaN or Inf, or whose largest multiple
    overflows float32: every candidate's loss would be NaN, and the error would then blame the
    activations."""
    largest = amax * stop_multiplier
    bad = ~torch.isfinite(largest) | (amax < 0)
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"{who}: amax must be finite and >= 0, with amax * stop_multiplier ({stop_multiplier}) "
            f"finite in float32; {int(bad.sum())} of its {amax.numel()} values are not (first "
            f"{float(amax[first])!r} at index {first})"
        )


class MseCalibrator(MergeableObserver):
    """Picks ``amax * m`` minimising ``sum error_func(x, quant_func(x, amax * m))`` over batches.

    The multipliers are ``linspace(start_multiplier, stop_multiplier, n)`` with
    ``n = ceil((stop - start) / step_size) + 1``: both ends included, steps at most
    ``step_size``. Each ``collect`` adds one loss per multiplier (per channel with ``axis``),
    so memory stays bounded and activations are never kept. Ties go to the smallest multiplier.

    ``compute_amax()`` before any ``collect`` raises ``RuntimeError``. Where ``amax`` is 0 the
    result stays 0 (every multiple of 0 is 0).

    State (``state_dict()``): ``losses`` fp32 ``[n]`` or ``[n, channels]`` (sum).

    Args:
        amax: the amax to scale, e.g. from ``MaxCalibrator``: 0-d for per tensor, or one value
            per channel shaped to broadcast against ``x`` (``[N, 1]`` for ``axis=0``).
        axis: None, or the channel dim each amax applies to. NVFP4 blocks run along the last
            dim, so the default quant_func needs a different one.
        step_size, start_multiplier, stop_multiplier: the search grid; ``0 < start <= stop``.
        quant_func: ``quant_func(x, amax) -> xq`` in float32; default
            ``nvfp4_fake_quantize_with_amax``.
        error_func: ``error_func(x, xq)`` -> elementwise error; default ``squared_error``.
        name: layer name used in errors and warnings.
    """

    STATE_REDUCTIONS = {"losses": "sum"}
    OVERFLOWING_STATISTIC = "the search's loss sum"

    def __init__(
        self,
        amax: torch.Tensor,
        axis: Optional[int] = None,
        step_size: float = 0.1,
        start_multiplier: float = 0.25,
        stop_multiplier: float = 4.0,
        quant_func: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        error_func: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        *,
        name: Optional[str] = None,
    ):
        super().__init__(name)
        check_search_grid(self.describe(), step_size, start_multiplier, stop_multiplier)
        check_axis(self.describe(), axis)
        self.initial_amax = torch.as_tensor(amax).detach().to(torch.float32)
        check_search_amax(self.describe(), self.initial_amax, stop_multiplier)
        self.axis = axis
        self.quant_func = quant_func if quant_func is not None else nvfp4_fake_quantize_with_amax
        self.error_func = error_func if error_func is not None else squared_error
        num_steps = search_steps(step_size, start_multiplier, stop_multiplier)
        self.multipliers = torch.linspace(start_multiplier, stop_multiplier, num_steps)

    def _merge_config(self) -> tuple:
        return (
            self.axis,
            self.quant_func,
            self.error_func,
            tuple(self.multipliers.tolist()),
            tuple(self.initial_amax.flatten().tolist()),
        )

    def _check_layout(self, x: torch.Tensor) -> None:
        channels = 1 if self.axis is None else x.shape[self.axis]
        if self.initial_amax.numel() != channels:
            raise ValueError(
                f"{self.describe()}: amax has {self.initial_amax.numel()} values but input of "
                f"shape {tuple(x.shape)} has {channels} channel(s) along axis={self.axis}"
            )
        if (
            self.quant_func is nvfp4_fake_quantize_with_amax
            and self.axis is not None
            and self.axis % x.ndim == x.ndim - 1
        ):
            raise ValueError(
                f"{self.describe()}: axis={self.axis} is the last dim of shape {tuple(x.shape)}, "
                "along which NVFP4 blocks share one global scale; pass a per-row axis or your "
                "own quant_func"
            )

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Add, for every multiplier, the error of quantizing ``x`` with ``amax * m``."""
        x = self._check_input(x, scan_for_non_finite=False).to(torch.float32)
        if x.numel() == 0:  # no tokens: nothing to observe
            return
        dims = channel_reduce_dims(x, self.axis)
        self._check_layout(x)
        amax = self.initial_amax.to(x.device)
        losses = torch.stack(
            [
                self.error_func(x, self.quant_func(x, amax * m)).sum(dim=dims)
                for m in self.multipliers.tolist()
            ]
        )
        if self._state is not None:
            losses = self._state["losses"] + losses.to(self._state["losses"].device)
        self._raise_if_non_finite(x, losses)  # this batch's losses, or the sum with them
        self._state = {"losses": losses}

    def compute_amax(self) -> torch.Tensor:
        """``amax * m_best``, float32, shaped like the given ``amax``."""
        losses = self._require_state("compute_amax()")["losses"]
        self._check_state_finite(losses)
        best = self.multipliers.to(losses.device)[losses.argmin(dim=0)]
        return self.initial_amax.to(losses.device) * best.reshape(self.initial_amax.shape)
