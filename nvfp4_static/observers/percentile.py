"""A plain percentile calibrator: the global amax is one percentile of the per-block amaxes."""

from typing import Optional

import torch

from nvfp4_static.observers.base import check_numbers
from nvfp4_static.observers.block_amax_histogram import BlockAmaxHistogramObserver

__all__ = ["PercentileCalibrator"]


class PercentileCalibrator(BlockAmaxHistogramObserver):
    """``amax = percentile(block amaxes, percentile)``, read from the log2 block-amax histogram.

    The percentile is taken over per-block (16-wide) amaxes rather than elements: that is the
    statistic an NVFP4 global scale acts on, and it shares the B_min calibrator's histogram.
    Values are read at bin centres (within half a bin, about 5% at the default 512 bins over
    2^-40..2^40); ``percentile=100`` is the literal max.

    ``compute_amax()`` before any ``collect`` raises ``RuntimeError``. If every collected block
    was zero it warns and returns ``ALL_ZERO_FALLBACK_AMAX`` (1.0).

    Args:
        percentile: in (0, 100].
        num_bins, log2_min, log2_max: the histogram (see ``BlockAmaxHistogramObserver``).
        name: layer name used in errors and warnings.
    """

    def __init__(
        self,
        percentile: float = 99.99,
        *,
        num_bins: int = 512,
        log2_min: float = -40.0,
        log2_max: float = 40.0,
        name: Optional[str] = None,
    ):
        super().__init__(num_bins=num_bins, log2_min=log2_min, log2_max=log2_max, name=name)
        check_numbers(self.describe(), percentile=percentile)
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"{self.describe()}: percentile must be in (0, 100], got {percentile}")
        self.target_percentile = float(percentile)

    def compute_amax(self) -> torch.Tensor:
        """The percentile block amax, a float32 0-d tensor on the state's device."""
        host = self._host_state("compute_amax()")
        self._check_state_finite(host.literal_max)
        if float(host.literal_max) == 0.0:
            amax = self._all_zero_fallback()
        else:
            amax = self._percentile_of(host, self.target_percentile)
        return self._amax_tensor(amax, self._state["literal_max"].device)
