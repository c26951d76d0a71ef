"""What every observer shares: a name for messages, input checks, and mergeable tensor state.

An observer watches tensors during calibration (``collect``) and keeps bounded statistics. The
mergeable ones keep those statistics as a dict of tensors, each combined across batches and
processes by a sum or a max, so ``merge`` and a later ``torch.distributed`` all-reduce are the
same operation: reduce every entry of ``state_dict()`` by ``STATE_REDUCTIONS[key]``.
"""

import abc
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Optional

import torch

from nvfp4_static.deferred_read import DeferredRead
from nvfp4_static.numerics import check_dtype, non_finite_summary

__all__ = ["Observer", "MergeableObserver", "channel_reduce_dims"]

_REDUCE = {"sum": torch.add, "max": torch.maximum}


def check_numbers(who: str, **values) -> None:
    """Refuse arguments that are not real numbers (a string, a bool, a tensor), ``who`` starting
    the message: comparing one raises a bare TypeError, and a bool reads as 0 or 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{who}: {name}={value!r} must be a number")


def check_whole_number(who: str, name: str, value, lowest: int, highest: Optional[int] = None) -> int:
    """``value`` as an int, refusing what is not a whole number (a bool, a string, 2.5) or lies
    outside ``[lowest, highest]``; ``who`` starts the message."""
    whole = isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer()
    if not (whole and lowest <= value and (highest is None or value <= highest)):
        bounds = f">= {lowest}" if highest is None else f"from {lowest} to {highest}"
        raise ValueError(f"{who}: {name} must be an integer {bounds}, got {value!r}")
    return int(value)


def check_axis(who: str, axis) -> None:
    """Refuse an ``axis`` that is neither None nor an integer (a bool reads as 1)."""
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, numbers.Integral)):
        raise TypeError(f"{who}: axis={axis!r} must be None or an integer")


def channel_reduce_dims(x: torch.Tensor, axis: Optional[int]) -> tuple[int, ...]:
    """The dims a per-channel statistic reduces over: all of them, or all but ``axis``."""
    if axis is None:
        return tuple(range(x.ndim))
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor of shape {tuple(x.shape)}")
    return tuple(d for d in range(x.ndim) if d != axis % x.ndim)


class Observer(abc.ABC):
    """Base of the calibrators and the Hessian accumulator.

    Args:
        name: optional label (e.g. the layer's qualified name) included in errors and warnings.
    """

    # What a statistic of finite inputs that overflows float32 is, for the error that says so.
    OVERFLOWING_STATISTIC = "a statistic of it"

    def __init__(self, name: Optional[str] = None):
        self.name = name

    def describe(self) -> str:
        """``ClassName('name')``, or just the class name: how messages refer to this observer."""
        cls = type(self).__name__
        return f"{cls}({self.name!r})" if self.name else cls

    @abc.abstractmethod
    def collect(self, x: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def reset(self) -> None: ...

    def settle(self, refused: Optional[bool] = None) -> None:
        """Raise now for an earlier batch this observer refused but has not reported yet (a
        test still on the GPU, see ``MergeableObserver``); nothing to do for most observers.
        ``refused``, when given, is what ``has_refused_pending_batch()`` just answered, so that
        the test is not read twice."""

    def has_refused_pending_batch(self) -> bool:
        """Whether ``settle()`` would raise (waits for that batch's test only)."""
        return False

    def discard_pending_batch(self) -> None:
        """Take back the last batch if its test is still pending, whatever the result: for an
        observer whose neighbour on the same layer refused that batch."""

    def _check_input(self, x: torch.Tensor, scan_for_non_finite: bool = True) -> torch.Tensor:
        """Reject unsupported dtypes (and, if asked, non-finite values); return ``x`` detached.

        A NaN or Inf would poison every statistic after it (a max, a histogram, a loss sum), so
        it is refused with a count and the first position, where it is still traceable to the
        batch that produced it. Observers on the calibration hot path skip this full scan and
        call ``_raise_if_non_finite`` on a small statistic they compute anyway instead.
        """
        check_dtype(x, f"{self.describe()} input of shape {tuple(x.shape)}")
        if x.dim() == 0:
            raise ValueError(f"{self.describe()}: takes a tensor with a last (feature) dim; got a 0-d tensor")
        x = x.detach()
        if scan_for_non_finite and not torch.compiler.is_compiling():
            self._raise_if_non_finite(x, x)
        return x

    def _raise_if_non_finite(self, x: torch.Tensor, summary: torch.Tensor) -> None:
        """Raise if ``summary`` (a statistic of ``x`` that NaN/Inf in ``x`` poisons) is not finite.

        One host sync on a small tensor instead of a scan of ``x``. While compiling, checks are
        deferred to ``_check_state_finite`` at ``compute_amax`` time (a data-dependent raise
        would break the graph).
        """
        if torch.compiler.is_compiling() or bool(torch.isfinite(summary).all()):
            return
        if bool(torch.isfinite(x).all()):
            raise ValueError(
                f"{self.describe()}: collected tensor of shape {tuple(x.shape)} ({x.dtype}) is "
                f"finite, but {self.OVERFLOWING_STATISTIC} overflowed float32 (largest magnitude "
                f"{float(x.abs().max()):.3g}); activations this large cannot be calibrated, so "
                "check the layers feeding this one"
            )
        raise ValueError(
            f"{self.describe()}: collected tensor of shape {tuple(x.shape)} ({x.dtype}) holds "
            f"{non_finite_summary(x)}; calibration needs finite activations, so check the layers "
            "feeding this one"
        )

    def _check_state_finite(self, statistic: torch.Tensor) -> None:
        """The deferred check for compiled calibration, where ``collect`` cannot raise."""
        if not bool(torch.isfinite(statistic).all()):
            raise ValueError(
                f"{self.describe()}: NaN or Inf values were collected (in a compiled forward, "
                "where they cannot be reported as they arrive); run a batch eagerly to locate "
                "them, then reset() and recalibrate"
            )

    def _not_collected_error(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"{self.describe()}: {what} called before any collect(); run calibration data "
            "through the model (or load_state_dict) first"
        )


class MergeableObserver(Observer):
    """An observer whose whole state is a dict of tensors combined by sum or max.

    Subclasses set ``STATE_REDUCTIONS`` (state key -> ``"sum"`` or ``"max"``), create their
    state on the first ``collect`` (on the input's device) and keep it in ``self._state``.
    ``state_dict()`` before any collect raises: the state's shape may depend on the data,
    so every process must collect at least one batch before an all-reduce.
    """

    STATE_REDUCTIONS: Mapping[str, str] = {}
    # State entries that may hold negative values (every other one counts or takes maxima of
    # magnitudes, so a negative value there is not a statistic of any data).
    SIGNED_STATE: frozenset[str] = frozenset()

    def __init__(self, name: Optional[str] = None):
        super().__init__(name)
        self._state: Optional[dict[str, torch.Tensor]] = None
        # The state as it was before the last batch (same keys; refilled in place each batch).
        self._state_before_batch: Optional[dict[str, torch.Tensor]] = None
        # The finite test of the last batch on CUDA, in flight with that batch's (dtype, shape).
        self._health = DeferredRead()

    def __getstate__(self) -> dict:
        """For copies and pickles: settle the batch in flight; then neither the saved state
        (needed only while a test is in flight) nor what the test reports through
        (``DeferredRead`` copies start empty) go along."""
        self.settle()
        return {**self.__dict__, "_state_before_batch": None}

    def reset(self) -> None:
        self._state = None
        self._state_before_batch = None
        self._health.clear()

    def _update_refusing_non_finite(
        self, x: torch.Tensor, update: Callable[[], None], health: Callable[[], torch.Tensor]
    ) -> None:
        """Run ``update()`` (which adds ``x`` to the state in place), then refuse the batch,
        restoring the state from before it, if ``health()`` (a 0-d statistic of the new state
        that NaN/Inf poisons) is not finite.

        On CUDA the test does not wait for the GPU: ``health()`` travels to pinned host memory
        behind an event and is read by ``settle()``, at the next collect or whenever the state
        is next used, which then raises for that batch. Waiting at every collect would stall the
        GPU at every observed layer (1.5x-13x calibration overhead on 56-112-linear models,
        examples/benchmarks/RESULTS.md). On other devices the test raises at once. While
        compiling, the check is left to ``_check_state_finite``.
        """
        if torch.compiler.is_compiling():
            update()
            return
        self.settle()
        self._save_state_before_batch()
        update()
        value = health()
        if value.device.type != "cuda":
            try:
                self._raise_if_non_finite(x, value)
            except ValueError:
                self._restore_state_before_batch()
                raise
            return
        self._health.send(value, (x.dtype, tuple(x.shape)))

    def _save_state_before_batch(self) -> None:
        """Copy the state into ``_state_before_batch``, in place after the first batch: the
        host cost of this copy is paid at every observed layer, so no allocation. (Whatever
        replaces the state, ``load_state_dict``, ``reset`` or a restore, drops the saved copy,
        so a kept one always matches the state's shapes and device.)"""
        if self._state_before_batch is None:
            self._state_before_batch = {key: value.clone() for key, value in self._state.items()}
            return
        torch._foreach_copy_(list(self._state_before_batch.values()), list(self._state.values()))

    def _restore_state_before_batch(self) -> None:
        """Put the state back as it was before the last batch (the saved copy is used up)."""
        self._state, self._state_before_batch = self._state_before_batch, None
        self._health.clear()

    def has_refused_pending_batch(self) -> bool:
        if self._health.note is None or torch.compiler.is_compiling():
            return False
        return not math.isfinite(self._health.read())  # long arrived: later work is queued behind it

    def discard_pending_batch(self) -> None:
        if self._health.note is not None:
            self._restore_state_before_batch()

    def settle(self, refused: Optional[bool] = None) -> None:
        if self._health.note is None or torch.compiler.is_compiling():
            return
        if refused is None:
            refused = self.has_refused_pending_batch()
        dtype, shape = self._health.note
        self._health.clear()
        if refused:
            self._restore_state_before_batch()
            raise ValueError(
                f"{self.describe()}: the batch collected before this call ({dtype} tensor of "
                f"shape {shape}) held NaN or Inf values, or values for which "
                f"{self.OVERFLOWING_STATISTIC} overflowed float32; it was left out of the "
                "statistics. Calibration needs finite activations: check the layers feeding this one"
            )

    def _merge_config(self) -> tuple:
        """Settings that must agree for two states to be combined (e.g. the histogram bins)."""
        return ()

    def _require_state(self, what: str) -> dict[str, torch.Tensor]:
        self.settle()
        if self._state is None:
            raise self._not_collected_error(what)
        return self._state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the state tensors; reduce each by ``STATE_REDUCTIONS[key]`` to combine."""
        state = self._require_state("state_dict()")
        return {key: value.clone() for key, value in state.items()}

    def _state_shapes(self) -> Optional[dict[str, tuple[int, ...]]]:
        """Each state entry's shape where the settings fix it before any data; None where the
        first batch does (a per-channel statistic)."""
        return None

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], values_checked: bool = False) -> None:
        """Replace the state with copies of ``state_dict`` (e.g. after an all-reduce).
        ``values_checked``: the caller has refused NaN, Inf and negative values itself (reading
        each state's check here makes the host wait for the device once per state)."""
        if set(state_dict) != set(self.STATE_REDUCTIONS):
            raise ValueError(
                f"{self.describe()}: state_dict keys {sorted(state_dict)} do not match the "
                f"expected {sorted(self.STATE_REDUCTIONS)}"
            )
        for key, value in state_dict.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{self.describe()}: state '{key}' is a {type(value).__name__}, not a tensor")
        shapes = self._state_shapes() if self._state is None else {k: v.shape for k, v in self._state.items()}
        for key, shape in (shapes or {}).items():
            if tuple(state_dict[key].shape) != tuple(shape):
                raise ValueError(
                    f"{self.describe()}: state '{key}' has shape {tuple(state_dict[key].shape)}, "
                    f"expected {tuple(shape)} (observers of different data or settings?)"
                )
        if not values_checked:
            self._check_state_values(state_dict)
        self._health.clear()  # whatever it was about is replaced
        self._state_before_batch = None
        self._state = {key: value.detach().clone() for key, value in state_dict.items()}

    def _check_state_values(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Refuse NaN or Inf anywhere and negative values outside ``SIGNED_STATE``: a statistic
        no data could give, which would otherwise surface later as an amax read from garbage or
        an IndexError in the histogram."""
        for key, value in state_dict.items():
            signed = key in self.SIGNED_STATE
            if not bool(torch.isfinite(value).all()):
                problem = non_finite_summary(value)
            elif not signed and bool((value < 0).any()):
                problem = f"{int((value < 0).sum())} negative values"
            else:
                continue
            raise ValueError(
                f"{self.describe()}: state '{key}' of shape {tuple(value.shape)} holds {problem}; "
                f"an observer's state holds finite{'' if signed else ', non-negative'} statistics"
            )

    def merge(self, other: "MergeableObserver") -> None:
        """Fold ``other``'s statistics into this one, as if this observer had seen its batches."""
        if type(other) is not type(self) or other._merge_config() != self._merge_config():
            raise ValueError(
                f"{self.describe()}: cannot merge {other.describe()}; both must be the same "
                f"class with the same settings ({self._merge_config()} vs {other._merge_config()})"
            )
        self.settle()
        other.settle()
        if other._state is None:
            return
        if self._state is None:
            self.load_state_dict(other._state)
            return
        shapes = {key: (tuple(value.shape), tuple(other._state[key].shape)) for key, value in self._state.items()}
        if any(ours != theirs for ours, theirs in shapes.values()):
            raise ValueError(
                f"{self.describe()}: cannot merge {other.describe()}: their statistics have other shapes "
                f"({', '.join(f'{key} {ours} vs {theirs}' for key, (ours, theirs) in shapes.items())}); "
                f"per-channel observers must have seen as many channels"
            )
        combined = {
            key: _REDUCE[self.STATE_REDUCTIONS[key]](value, other._state[key].to(value.device))
            for key, value in self._state.items()
        }
        self.load_state_dict(combined)
