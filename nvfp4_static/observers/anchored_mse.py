"""The MSE search for a single calibration pass: its grid anchored at the first batch's amax.

``MseCalibrator`` needs the amax its multipliers scale before it sees data (ModelOpt runs a max
pass first). A ``quantize_`` flow has one pass, so this calibrator takes the first batch's
literal max as the anchor and searches ``anchor * m`` for m in ``[start, stop]``. With the
default ``stop = 4`` the grid reaches 4x the first batch's max, which covers later batches in
all but pathological orderings; ``stats`` records the anchor so that such a case is visible.
"""

from typing import Optional

import torch

from nvfp4_static.observers.base import Observer
from nvfp4_static.observers.mse import MseCalibrator

__all__ = ["FirstBatchMseCalibrator"]


class FirstBatchMseCalibrator(Observer):
    """``MseCalibrator`` whose ``amax`` is the first collected batch's ``max(|x|)``.

    Args: as ``MseCalibrator`` (less ``amax``), plus ``name`` for messages.
    """

    def __init__(
        self,
        step_size: float = 0.1,
        start_multiplier: float = 0.25,
        stop_multiplier: float = 4.0,
        *,
        name: Optional[str] = None,
    ):
        super().__init__(name)
        self.search_args = dict(
            step_size=step_size, start_multiplier=start_multiplier, stop_multiplier=stop_multiplier
        )
        self.search: Optional[MseCalibrator] = None
        self.stats: dict = {}

    def collect(self, x: torch.Tensor) -> None:
        if self.search is None:
            anchor = self._check_input(x, scan_for_non_finite=False).abs().amax().float()
            self.search = MseCalibrator(anchor, name=self.name, **self.search_args)
        self.search.collect(x)

    def compute_amax(self) -> torch.Tensor:
        if self.search is None:
            raise self._not_collected_error("compute_amax()")
        amax = self.search.compute_amax()
        anchor = float(self.search.initial_amax)
        self.stats = {"anchor_amax": anchor, "g_amax": float(amax)}
        return amax

    def reset(self) -> None:
        self.search = None
        self.stats = {}
