"""The default activation calibrator: the B_min-anchored NVFP4 global amax.

Max calibration puts the largest calibration block at FP8's top (448), so any larger activation
at inference clips. FP8 E4M3's normal range spans 448 / 2^-6 = 28672. Anchoring the smallest
representative blocks (B_min) at ``448 / rho`` above the subnormal edge spends the rest of that
window as headroom above what calibration saw.
"""

import math
from typing import Optional

import torch

from nvfp4_static.messages import warn
from nvfp4_static.numerics import BLOCK_SIZE, E4M3_DYNAMIC_RANGE
from nvfp4_static.observers.base import check_numbers
from nvfp4_static.observers.block_amax_histogram import BlockAmaxHistogramObserver

__all__ = ["DEFAULT_B_MAX_PERCENTILE", "NVFP4ActMaxCalibrator", "NVFP4BMinCalibrator"]

# Blocks this many times below B_max are ignored when locating B_min, so a tail of near-zero
# blocks (padding, dead channels) cannot drag the anchor down.
B_MIN_FLOOR_RATIO = 1e6

# B_max is read this high, not at ModelOpt's 99.99, so that a "massive activation" (one block in
# ~25,000, as LLMs carry on their first token) sets g_amax instead of clipping; a spike in 1e-7
# of samples still stays out. Measured over 43 SmolLM2 calibration draws: docs/design.md.
DEFAULT_B_MAX_PERCENTILE = 99.999


class NVFP4BMinCalibrator(BlockAmaxHistogramObserver):
    """Activation global amax from the per-block amax histogram::

        B_max  = percentile(block amaxes, b_max_percentile)      # 100 = literal max
        B_min  = percentile(block amaxes >= B_max / 1e6, b_min_percentile)
        g_amax = max(rho * B_min, margin * B_max)

    Percentiles are read at bin centres; all-zero blocks are not counted. ``compute_amax()``
    fills ``stats`` (Python floats): ``literal_max``, ``b_min_percentile_value`` and
    ``b_max_percentile_value`` (the raw readings), ``b_min`` and ``b_max`` (the values used),
    ``b_max_over_b_min``, ``g_amax``, and ``set_by``: ``"rho*B_min"``, ``"margin*B_max"``,
    or ``"all-zero fallback"``. It warns once when ``B_max / B_min > 28672``: no global scale
    holds both ends, and ``g_amax`` then protects the largest blocks.

    ``compute_amax()`` before any ``collect`` raises ``RuntimeError``. If every collected block
    was zero it warns and returns ``ALL_ZERO_FALLBACK_AMAX`` (1.0).

    Args:
        rho: window split; B_min's block scale lands at ``448 / rho``. In (0, 28672).
        b_min_percentile, b_max_percentile: in (0, 100].
        margin: floor multiplier, ``g_amax >= margin * B_max``; > 0.
        num_bins, log2_min, log2_max: the histogram (see ``BlockAmaxHistogramObserver``).
        name: layer name used in errors and warnings.
    """

    def __init__(
        self,
        *,
        rho: float = 16384.0,
        b_min_percentile: float = 1.0,
        b_max_percentile: float = DEFAULT_B_MAX_PERCENTILE,
        margin: float = 1.0,
        num_bins: int = 512,
        log2_min: float = -40.0,
        log2_max: float = 40.0,
        name: Optional[str] = None,
    ):
        super().__init__(num_bins=num_bins, log2_min=log2_min, log2_max=log2_max, name=name)
        percentiles = dict(b_min_percentile=b_min_percentile, b_max_percentile=b_max_percentile)
        check_numbers(self.describe(), rho=rho, margin=margin, **percentiles)
        if not 0.0 < rho < E4M3_DYNAMIC_RANGE:
            raise ValueError(
                f"{self.describe()}: rho must be in (0, {E4M3_DYNAMIC_RANGE:.0f}), got {rho}; "
                "larger rho leaves more headroom above B_max but less room below B_min before "
                "block scales turn subnormal"
            )
        percentiles = {"b_min_percentile": b_min_percentile, "b_max_percentile": b_max_percentile}
        for what, value in percentiles.items():
            if not 0.0 < value <= 100.0:
                raise ValueError(f"{self.describe()}: {what} must be in (0, 100], got {value}")
        if b_min_percentile > b_max_percentile:
            raise ValueError(
                f"{self.describe()}: b_min_percentile ({b_min_percentile}) must not exceed "
                f"b_max_percentile ({b_max_percentile})"
            )
        if log2_max - log2_min < math.log2(E4M3_DYNAMIC_RANGE):
            raise ValueError(
                f"{self.describe()}: the histogram's range 2^{log2_min:g}..2^{log2_max:g} is "
                f"narrower than FP8's dynamic range ({E4M3_DYNAMIC_RANGE:.0f}, 2^14.8), which the "
                f"recipe places B_min and B_max in; widen log2_min / log2_max"
            )
        if not 0.0 < margin < math.inf:
            raise ValueError(f"{self.describe()}: margin must be a finite value > 0, got {margin}")
        self.rho = float(rho)
        self.b_min_percentile = float(b_min_percentile)
        self.b_max_percentile = float(b_max_percentile)
        self.margin = float(margin)
        self.stats: Optional[dict] = None
        self._warned_dynamic_range = False

    def reset(self) -> None:
        super().reset()
        self.stats = None

    def compute_amax(self) -> torch.Tensor:
        """The activation global amax ``g_amax``, a float32 0-d tensor on the state's device."""
        host = self._host_state("compute_amax()")
        device = self._state["literal_max"].device
        self._check_state_finite(host.literal_max)
        literal_max = float(host.literal_max)
        if literal_max == 0.0:
            g_amax = self._all_zero_fallback()
            self.stats = {"literal_max": 0.0, "g_amax": g_amax, "set_by": "all-zero fallback"}
            return self._amax_tensor(g_amax, device)

        b_max = self._percentile_of(host, self.b_max_percentile)
        b_min = self._percentile_of(host, self.b_min_percentile, floor=b_max / B_MIN_FLOOR_RATIO)
        rho_term, margin_term = self.rho * b_min, self.margin * b_max
        g_amax = max(rho_term, margin_term)
        self.stats = {
            "literal_max": literal_max,
            "b_min_percentile_value": self._percentile_of(host, self.b_min_percentile),
            "b_max_percentile_value": b_max,
            "b_min": b_min,
            "b_max": b_max,
            "b_max_over_b_min": b_max / b_min,
            "g_amax": g_amax,
            "set_by": "rho*B_min" if rho_term >= margin_term else "margin*B_max",
        }
        if b_max / b_min > E4M3_DYNAMIC_RANGE and not self._warned_dynamic_range:
            self._warned_dynamic_range = True
            warn(
                f"{self.describe()}: block amaxes span B_max / B_min = {b_max / b_min:.0f}, more "
                f"than FP8 E4M3's normal range ({E4M3_DYNAMIC_RANGE:.0f}); no global scale keeps "
                f"the largest blocks from clipping and the smallest out of FP8 subnormals. Using "
                f"g_amax = {g_amax:.4g} ({self.stats['set_by']}). Consider outlier mitigation "
                "(e.g. SmoothQuant) or leaving this layer unquantized.",
            )
        return self._amax_tensor(g_amax, device)


class NVFP4ActMaxCalibrator(NVFP4BMinCalibrator):
    """``NVFP4BMinCalibrator`` under ModelOpt's calibrator signature, for code written against it.

    ModelOpt builds calibrators as ``cls(num_bits, axis, unsigned, **kwargs)``; those three and
    ``block_size`` are accepted here only to check that they describe NVFP4 activations
    (``num_bits=(2, 1)``, per-tensor ``axis=None``, signed, 16-wide blocks). The other keyword
    arguments are ``NVFP4BMinCalibrator``'s.
    """

    def __init__(self, num_bits=(2, 1), axis=None, unsigned=False, *, block_size=BLOCK_SIZE, **kwargs):
        if isinstance(num_bits, list):
            num_bits = tuple(num_bits)
        if num_bits != (2, 1) or axis is not None or unsigned or block_size != BLOCK_SIZE:
            name = kwargs.get("name")
            raise ValueError(
                f"{type(self).__name__}{f'({name!r})' if name else ''}: NVFP4 activations need "
                f"num_bits=(2, 1), axis=None, unsigned=False, block_size={BLOCK_SIZE}; got "
                f"num_bits={num_bits}, axis={axis}, unsigned={unsigned}, block_size={block_size}"
            )
        super().__init__(**kwargs)
