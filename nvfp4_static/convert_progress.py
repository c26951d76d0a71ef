"""A progress bar over the layers ``step="convert"`` turns, for models with many layers.

Convert sweeps 126 FP8 candidates per weight block, seconds per layer on a CPU; ``quantize_``
visits the layers one handler call at a time and says nothing in between. Prepare registers each
observed layer here, so convert knows how many are left and can show a bar.
"""

import contextlib
import weakref
from typing import Optional

import torch
from tqdm.auto import tqdm

__all__ = ["ConvertProgress"]

# Fewer layers than this convert without a bar: a toy model should print nothing.
MIN_LAYERS_FOR_A_BAR = 8


class ConvertProgress:
    """Layers prepared but not yet converted, and the bar convert ticks as it turns them."""

    def __init__(self):
        self._pending: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._bar: Optional[tqdm] = None
        self._shown = True

    @contextlib.contextmanager
    def without_bar(self):
        """Converts inside show no bar (a caller's ``progress=False``)."""
        shown, self._shown = self._shown, False
        try:
            yield
        finally:
            self._shown = shown

    def prepared(self, module: torch.nn.Module) -> None:
        self._close()  # a new prepare starts a new count
        self._pending.add(module)

    def converting(self, module: torch.nn.Module, name: str) -> None:
        if self._bar is None and self._shown and len(self._pending) >= MIN_LAYERS_FOR_A_BAR:
            self._bar = tqdm(total=len(self._pending), desc="nvfp4_static convert", unit="layer")
        if self._bar is not None:
            self._bar.set_postfix_str(name)

    def converted(self, module: torch.nn.Module) -> None:
        self._pending.discard(module)
        if self._bar is not None:
            self._bar.update()
            if not self._pending:
                self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
