"""The MSE search for a single calibration pass: its grid anchored at the data's own amax.

``MseCalibrator`` needs the amax its multipliers scale before it sees data (ModelOpt runs a max
pass first). A ``quantize_`` flow has one pass, so this calibrator anchors the grid at the first
accepted batch's literal max and searches ``anchor * m`` for m in ``[start, stop]``. A later
batch whose max lies above the grid's top would leave the right answer outside the grid, so the
search then restarts anchored at that batch, with a warning; ``stats`` records the anchor and
the restarts.
"""

from typing import Optional

import torch

from nvfp4_static.messages import warn
from nvfp4_static.observers.base import Observer
from nvfp4_static.observers.mse import MseCalibrator, check_search_grid

__all__ = ["FirstBatchMseCalibrator"]


class FirstBatchMseCalibrator(Observer):
    """``MseCalibrator`` whose ``amax`` is the first accepted batch's ``max(|x|)``.

    A refused batch (NaN/Inf) sets no anchor. When a batch's max exceeds ``anchor *
    stop_multiplier``, the search restarts anchored at that max, dropping the batches before
    it (whose maxima were all below the new grid's top, so they would mostly have favoured it).

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
        check_search_grid(self.describe(), step_size, start_multiplier, stop_multiplier)
        self.search: Optional[MseCalibrator] = None
        self.restarts = 0
        self.stats: dict = {}

    def collect(self, x: torch.Tensor) -> None:
        x = self._check_input(x, scan_for_non_finite=False)
        if x.numel() == 0:
            return
        batch_max = x.abs().amax().float()
        self._raise_if_non_finite(x, batch_max)  # a NaN/Inf batch never becomes the anchor
        top = None if self.search is None else self.search.initial_amax * self.search.multipliers[-1]
        if top is not None and not bool(batch_max > top.to(batch_max.device)):
            self.search.collect(x)
            return
        search = MseCalibrator(batch_max, name=self.name, **self.search_args)
        search.collect(x)
        if top is not None:
            self.restarts += 1
            warn(
                f"{self.describe()}: a batch's max {float(batch_max):.4g} lies above the MSE "
                f"search grid's top {float(top):.4g} (the first batch's max times "
                f"{self.search_args['stop_multiplier']}); the search restarts anchored at it and "
                f"the earlier batches are dropped. Put a representative batch first, or use "
                f"act_calibration='b_min', which does not depend on batch order"
            )
        self.search = search

    def compute_amax(self) -> torch.Tensor:
        if self.search is None:
            raise self._not_collected_error("compute_amax()")
        amax = self.search.compute_amax()
        anchor = float(self.search.initial_amax)
        self.stats = {"anchor_amax": anchor, "restarts": self.restarts, "g_amax": float(amax)}
        return amax

    def reset(self) -> None:
        self.search = None
        self.restarts = 0
        self.stats = {}
