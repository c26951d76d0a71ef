"""A GPU value read on the host at a later call, without making the host wait for it now.

Checks of data on the GPU (non-finite activations during calibration, expert indices out of
range at inference) would stall the host at every layer if their result were read at once. The
value instead travels to pinned host memory behind an event, and the layer reads it at its
next call, when the GPU is long past it (that call's work was queued behind it).
"""

from typing import Any

import torch

__all__ = ["DeferredRead"]


class DeferredRead:
    """One 0-d CUDA value at a time on its way to the host: ``send`` queues its copy with a note
    on what it is about, ``read`` waits for the copy and returns the value, ``clear`` forgets it.

    ``note`` is the note of the value in flight, None while none is. The pinned memory and the
    event are made at the first send and reused. A copy of the holder (``deepcopy``, pickling)
    starts with nothing in flight: events do not pickle, and the value belongs to the original.
    """

    def __init__(self):
        self._host = None
        self._event = None
        self._device = None
        self.note: Any = None

    def __deepcopy__(self, memo) -> "DeferredRead":
        return type(self)()

    def __reduce__(self):
        return (type(self), ())

    def send(self, value: torch.Tensor, note: Any) -> None:
        """Queue the copy of ``value`` (one element on a CUDA device), behind the work queued
        on that device's current stream, to the host."""
        if self._host is None or self._host.dtype != value.dtype or self._device != value.device:
            self._host = torch.empty((), dtype=value.dtype, pin_memory=True)
            self._event, self._device = torch.cuda.Event(), value.device
        self._host.copy_(value.reshape(()), non_blocking=True)
        self._event.record(torch.cuda.current_stream(value.device))
        self.note = note

    def read(self):
        """The value in flight as a Python number, once its copy has arrived."""
        self._event.synchronize()
        return self._host.item()

    def clear(self) -> None:
        self.note = None
