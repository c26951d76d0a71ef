"""Calibration observers: plain objects with ``collect(x)`` / ``compute_amax()`` / ``reset()``.

Activation global amax: ``NVFP4BMinCalibrator`` (the B_min-anchored default;
``NVFP4ActMaxCalibrator`` is the same under ModelOpt's signature),
``MaxCalibrator``, ``PercentileCalibrator``, ``MseCalibrator``. Weight block scales:
``NVFP4MSECalibrator``, optionally weighted by a ``BlockHessianAccumulator``; GPTQ reads a
``FullHessianAccumulator``. The mergeable ones
combine across batches and processes through ``merge`` / ``state_dict`` (see ``base``).
"""

from nvfp4_static.observers.base import MergeableObserver, Observer
from nvfp4_static.observers.block_amax_histogram import (
    ALL_ZERO_FALLBACK_AMAX,
    BlockAmaxHistogramObserver,
)
from nvfp4_static.observers.block_hessian import BlockHessianAccumulator
from nvfp4_static.observers.full_hessian import FullHessianAccumulator
from nvfp4_static.observers.max import MaxCalibrator
from nvfp4_static.observers.mse import MseCalibrator, nvfp4_fake_quantize_with_amax, squared_error
from nvfp4_static.observers.b_min import NVFP4ActMaxCalibrator, NVFP4BMinCalibrator
from nvfp4_static.observers.nvfp4_mse import NVFP4MSECalibrator
from nvfp4_static.observers.percentile import PercentileCalibrator

__all__ = [
    "ALL_ZERO_FALLBACK_AMAX",
    "BlockAmaxHistogramObserver",
    "BlockHessianAccumulator",
    "FullHessianAccumulator",
    "MaxCalibrator",
    "MergeableObserver",
    "MseCalibrator",
    "NVFP4ActMaxCalibrator",
    "NVFP4BMinCalibrator",
    "NVFP4MSECalibrator",
    "Observer",
    "PercentileCalibrator",
    "nvfp4_fake_quantize_with_amax",
    "squared_error",
]
