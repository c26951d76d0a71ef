"""The log2 histogram of per-block amaxes that the histogram calibrators read percentiles from.

An NVFP4 global scale acts on block amaxes (each 16-wide block's scale is its amax over the
global scale), so that is the distribution worth keeping. A base-2 log-spaced histogram holds it
in bounded memory (``num_bins`` int64 counts) and merges by addition, across batches and processes.
"""

import math
from typing import NamedTuple, Optional

import torch

from nvfp4_static import kernels
from nvfp4_static.messages import warn
from nvfp4_static.observers.base import MergeableObserver, check_numbers, check_whole_number
from nvfp4_static.references import histogram_bin_centres, histogram_bin_edges

__all__ = ["BlockAmaxHistogramObserver", "ALL_ZERO_FALLBACK_AMAX"]

# The widest bin, in octaves: a percentile is read at a bin's centre, at most half a bin off.
MAX_BIN_OCTAVES = 0.5
# The most bins: each layer holds a histogram (int64 counts) per calibrator.
MAX_BINS = 1 << 16

# Global amax returned when every collected block was zero: nothing constrains it, and any
# positive value quantizes zeros exactly while keeping downstream scales finite.
ALL_ZERO_FALLBACK_AMAX = 1.0

# The bins' float32 inner edges (per device) and float64 centres, keyed by (what, num_bins,
# log2_min, log2_max, device) and shared read-only by every observer with those settings: a
# model has hundreds of observed layers, and a copy each would cost prepare tensor work per
# layer and, on a GPU, each layer's first collect a host-to-device copy (a stream sync).
_SHARED_BINS: dict[tuple, torch.Tensor] = {}


def _shared_bins(what: str, settings: tuple, device: torch.device) -> torch.Tensor:
    """``"edges"`` or ``"centres"`` of the histogram ``settings`` on ``device`` (never modify)."""
    key = (what, *settings, device)
    if key not in _SHARED_BINS:
        if device.type != "cpu":
            _SHARED_BINS[key] = _shared_bins(what, settings, torch.device("cpu")).to(device)
        elif what == "edges":
            _SHARED_BINS[key] = histogram_bin_edges(*settings)
        else:
            _SHARED_BINS[key] = histogram_bin_centres(*settings)
    return _SHARED_BINS[key]


class HostHistogram(NamedTuple):
    """A histogram observer's state on the host: ``counts`` float64 (exact below 2^53) and
    ``literal_max`` float32, 0-d, both CPU tensors."""

    counts: torch.Tensor
    literal_max: torch.Tensor


class BlockAmaxHistogramObserver(MergeableObserver):
    """Histogram of the nonzero per-block (16-wide, last dim) amaxes, plus their literal max.

    Bins are equal-width in ``log2`` over ``[log2_min, log2_max]``; values outside land in the
    first or last bin. All-zero blocks are not counted. A last dim that is not a multiple of 16
    is zero-padded, which cannot change any block's amax.

    State (``state_dict()``): ``counts`` int64 ``[num_bins]`` (sum) and ``literal_max`` fp32
    0-d (max), allocated on the first collected tensor's device.

    Args:
        num_bins: number of histogram bins.
        log2_min, log2_max: log2 range the bins cover.
        name: label used in errors and warnings (e.g. the layer name).
    """

    STATE_REDUCTIONS = {"counts": "sum", "literal_max": "max"}

    def __init__(
        self,
        *,
        num_bins: int = 512,
        log2_min: float = -40.0,
        log2_max: float = 40.0,
        name: Optional[str] = None,
    ):
        super().__init__(name)
        num_bins = check_whole_number(self.describe(), "num_bins", num_bins, 2, MAX_BINS)
        check_numbers(self.describe(), log2_min=log2_min, log2_max=log2_max)
        if not (math.isfinite(log2_min) and math.isfinite(log2_max) and log2_min < log2_max):
            raise ValueError(
                f"{self.describe()}: need finite log2_min < log2_max; got log2_min={log2_min}, "
                f"log2_max={log2_max}"
            )
        if (log2_max - log2_min) / num_bins > MAX_BIN_OCTAVES:
            raise ValueError(
                f"{self.describe()}: {num_bins} bins over 2^{log2_min:g}..2^{log2_max:g} are "
                f"{(log2_max - log2_min) / num_bins:.3g} octaves wide; a percentile read from them "
                f"could be off by more than 2^{MAX_BIN_OCTAVES / 2:g}. Use at least "
                f"{math.ceil((log2_max - log2_min) / MAX_BIN_OCTAVES)} bins, or a narrower range"
            )
        self.num_bins = num_bins
        self.log2_min = float(log2_min)
        self.log2_max = float(log2_max)
        self._bins = (self.num_bins, self.log2_min, self.log2_max)
        self._bin_edges = _shared_bins("edges", self._bins, torch.device("cpu"))
        self._bin_centres = _shared_bins("centres", self._bins, torch.device("cpu"))

    def _merge_config(self) -> tuple:
        return (self.num_bins, self.log2_min, self.log2_max)

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"counts": (self.num_bins,), "literal_max": ()}

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Add the per-block amaxes of ``x`` to the histogram."""
        x = self._check_input(x, scan_for_non_finite=False)
        if self._state is None:
            self._state = {
                "counts": torch.zeros(self.num_bins, dtype=torch.int64, device=x.device),
                "literal_max": torch.zeros((), dtype=torch.float32, device=x.device),
            }
        if self._bin_edges.device != x.device:
            self._bin_edges = _shared_bins("edges", self._bins, x.device)

        def update():
            kernels.collect_block_amax_histogram(
                x, self._state["counts"], self._state["literal_max"], self._bin_edges
            )

        # A NaN or Inf in x makes the running max NaN or Inf: the batch is then refused whole.
        self._update_refusing_non_finite(x, update, lambda: self._state["literal_max"])

    @property
    def literal_max(self) -> float:
        """The largest block amax collected, i.e. ``max |x|`` over everything seen."""
        literal_max = self._require_state("literal_max")["literal_max"].cpu()
        self._check_state_finite(literal_max)
        return float(literal_max)

    def _host_state(self, what: str) -> HostHistogram:
        """The state on the host, read in one copy (each read of a GPU tensor waits for the
        device); ``what`` names the caller in the error raised before any collect."""
        state = self._require_state(what)
        both = torch.cat([state["counts"].to(torch.float64),
                          state["literal_max"].to(torch.float64).reshape(1)]).cpu()
        return HostHistogram(both[:-1], both[-1].to(torch.float32))

    def bin_index(self, value: float) -> int:
        """The bin a block amax of ``value`` is counted in (same float32 edges as collection)."""
        edges = _shared_bins("edges", self._bins, torch.device("cpu"))
        return int(torch.searchsorted(edges, edges.new_tensor([value]), right=True)[0])

    def percentile(self, percentile: float, floor: Optional[float] = None) -> float:
        """The block amax at ``percentile`` of the counted blocks, read at its bin centre.

        The value is the ``ceil(percentile / 100 * n)``-th smallest counted block amax (at least
        the first), so it is one of the two order statistics ``torch.quantile`` interpolates
        between. ``percentile == 100`` returns the literal max exactly.

        Args:
            percentile: in (0, 100].
            floor: if given, blocks in bins below the one holding ``floor`` are ignored.

        Returns:
            The value as a Python float; 0.0 if no block is counted.
        """
        check_numbers(self.describe(), percentile=percentile)
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"{self.describe()}: percentile must be in (0, 100], got {percentile}")
        return self._percentile_of(self._host_state("percentile()"), percentile, floor)

    def _percentile_of(self, host: HostHistogram, percentile: float, floor: Optional[float] = None) -> float:
        """``percentile(percentile, floor)`` of the state read by ``_host_state``: a caller
        reading several percentiles reads the state once."""
        if percentile >= 100.0:
            return float(host.literal_max)
        counts = host.counts
        if floor is not None:
            counts = counts.clone()
            counts[: self.bin_index(floor)] = 0
        cdf = counts.cumsum(0)
        total = float(cdf[-1])
        if total == 0:
            return 0.0
        # percentile * total is exact for integer totals below 2**53, so a rank that is a whole
        # number (1% of 10000 blocks) is not pushed into the next bin by rounding.
        rank = max(percentile * total / 100.0, 1.0)
        index = int(torch.searchsorted(cdf, cdf.new_tensor([rank]))[0])
        return self._reading_of_bin(index, float(host.literal_max))

    @staticmethod
    def _amax_tensor(value: float, device: torch.device) -> torch.Tensor:
        """``value`` as a float32 0-d tensor on ``device``. The copy does not wait for the
        device (a plain copy to a GPU waits for all the work queued there): convert makes one
        per layer."""
        return torch.tensor(value, dtype=torch.float32).to(device, non_blocking=True)

    def _reading_of_bin(self, index: int, literal_max: float) -> float:
        """The bin's centre, except in the two edge bins, which also hold every value beyond
        the histogram's range: there the centre can be far from the data. A reading from the
        top bin when the literal max lies above the range is the literal max (the only value
        known there, and one that clips nothing); one from the bottom bin is at most the
        literal max. Both warn, naming the range to widen; so does any other reading from the
        bottom bin (its data may lie anywhere below the range)."""
        centre = float(self._bin_centres[index])
        if index == self.num_bins - 1 and literal_max > 2.0**self.log2_max:
            self._warn_out_of_range("above", 2.0**self.log2_max, literal_max, "log2_max")
            return literal_max
        if index == 0 and literal_max < centre:
            self._warn_out_of_range("below", 2.0**self.log2_min, literal_max, "log2_min")
            return literal_max
        if index == 0:
            warn(
                f"{self.describe()}: the percentile lies in the histogram's bottom bin, which also "
                f"holds every block amax below its range (edge {2.0**self.log2_min:.3g}); it is read "
                f"as that bin's centre {centre:.3g}, which may be far above the data there. Widen "
                f"the range (log2_min) for a percentile reading"
            )
        return centre

    def _warn_out_of_range(self, side: str, edge: float, literal_max: float, knob: str) -> None:
        warn(
            f"{self.describe()}: block amaxes lie {side} the histogram's range (edge {edge:.3g}, "
            f"literal max {literal_max:.3g}), where its bins cannot place them; the percentile "
            f"is read as the literal max. Widen the range ({knob}) for a percentile reading"
        )

    def _all_zero_fallback(self) -> float:
        warn(
            f"{self.describe()}: every collected block was all-zero, so the block-amax "
            f"distribution is empty; using the fallback global amax {ALL_ZERO_FALLBACK_AMAX}",
        )
        return ALL_ZERO_FALLBACK_AMAX
