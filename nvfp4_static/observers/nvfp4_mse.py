"""The weight calibrator: per-block FP8 scales chosen by an exhaustive MSE sweep."""

from typing import Optional

import torch

from nvfp4_static import kernels, references
from nvfp4_static.numerics import (
    AMAX_ROUNDING,
    BLOCK_SIZE,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    pad_to_block_multiple,
    per_tensor_amax_to_scale,
    unit_scale_factor,
)
from nvfp4_static.observers.base import Observer

__all__ = ["GlobalAmaxTooSmallError", "NVFP4MSECalibrator"]


class GlobalAmaxTooSmallError(ValueError):
    """The weight's global amax is so small that the sweep's candidate reciprocals overflow
    float32 (below about 4e-33): no candidate can be evaluated faithfully."""


class NVFP4MSECalibrator(Observer):
    """For each 16-element block of a weight, the FP8 E4M3 scale of least quantization error.

    ``collect(weight)`` tries all 126 positive FP8 values ``c`` as the block scale under the
    per-tensor scale ``global_amax / (448 * 6)`` (block amax ``global_amax * c / 448``) and keeps
    the one minimising ``sum (w - deq(q(w)))^2``, or ``dw^T H dw`` with the per-input-block
    Hessian ``H`` (``BlockHessianAccumulator``). Ties go to the smallest candidate. The search
    runs in ``nvfp4_static.kernels.fp8_scale_sweep``: a fused kernel on CUDA, the C kernel of
    ``backends.cpu_sweep`` on a CPU, neither allocating a per-candidate buffer the size of the
    weight.

    One weight per calibrator: a second ``collect`` without ``reset()`` raises. An all-zero
    weight (``global_amax == 0``) gets FP8's smallest normal, 2^-6, in every block; a global
    amax below about 4e-33 raises ``GlobalAmaxTooSmallError``. ``compute_amax()`` /
    ``block_scales_e4m3`` before ``collect`` raise ``RuntimeError``.

    The signature is ModelOpt's (``amax, global_amax, axis, quant_func, error_func``), so code
    written against ModelOpt's calibrator runs unchanged; ``axis``, ``quant_func`` and
    ``error_func`` are accepted only to refuse values this calibrator cannot honour.

    Args:
        amax: the weight's current per-block amax, ``[N, K/16]`` (any shape with that many
            elements); ``compute_amax()`` returns this shape.
        global_amax: float32 scalar, the weight's global amax (>= 0).
        axis: must be None; blocks run along the last dim.
        quant_func, error_func: must be None. The error is fixed (squared error, or
            ``dw^T H dw``) so that every device picks the same scales bit for bit.
        hessian: optional ``[K/16, 16, 16]`` float32 per-input-block Hessian.
        name: layer name used in errors.
    """

    def __init__(
        self,
        amax: torch.Tensor,
        global_amax: torch.Tensor,
        axis=None,
        quant_func=None,
        error_func=None,
        hessian: Optional[torch.Tensor] = None,
        *,
        name: Optional[str] = None,
    ):
        super().__init__(name)
        if axis is not None:
            raise ValueError(
                f"{self.describe()}: axis must be None (blocks run along the last dim), got {axis}"
            )
        if quant_func is not None or error_func is not None:
            raise NotImplementedError(
                f"{self.describe()}: custom quant_func / error_func are not supported; the sweep "
                "minimises squared error, or dw^T H dw when a hessian is given"
            )
        for what, value in (("amax", amax), ("hessian", hessian)):
            if not (isinstance(value, torch.Tensor) or (what == "hessian" and value is None)):
                raise TypeError(f"{self.describe()}: {what} must be a tensor, got {type(value).__name__}")
        global_amax = torch.as_tensor(global_amax).detach().to(torch.float32)
        # On the host once: each read of a GPU tensor waits for the device.
        host_amax = global_amax.cpu() if global_amax.numel() == 1 else None
        if host_amax is None or not bool(torch.isfinite(host_amax)) or host_amax < 0:
            raise ValueError(
                f"{self.describe()}: global_amax must be one finite value >= 0, got {global_amax}"
            )
        self.amax_shape = tuple(amax.shape)
        self.global_amax = global_amax.reshape(())
        self._host_global_amax = float(host_amax)
        self.hessian = hessian
        self._block_scales_e4m3: Optional[torch.Tensor] = None

    def reset(self) -> None:
        self._block_scales_e4m3 = None

    def _check_shapes(self, weight: torch.Tensor) -> None:
        n_rows, n_blocks = weight.shape[0], weight.shape[1] // BLOCK_SIZE
        if n_rows * n_blocks != torch.Size(self.amax_shape).numel():
            raise ValueError(
                f"{self.describe()}: weight of shape {tuple(weight.shape)} has {n_rows} x "
                f"{n_blocks} blocks, but amax has shape {self.amax_shape}"
            )
        expected = (n_blocks, BLOCK_SIZE, BLOCK_SIZE)
        if self.hessian is not None and tuple(self.hessian.shape) != expected:
            raise ValueError(
                f"{self.describe()}: hessian has shape {tuple(self.hessian.shape)}, expected "
                f"{expected} for a weight of shape {tuple(weight.shape)}"
            )

    @torch.no_grad()
    def collect(self, weight: torch.Tensor) -> None:
        """Run the sweep on ``weight`` ``[N, K]`` (K zero-padded to a multiple of 16)."""
        if self._block_scales_e4m3 is not None:
            raise RuntimeError(
                f"{self.describe()}: already calibrated one weight; call reset() before "
                "collecting another"
            )
        weight = self._check_input(weight, scan_for_non_finite=False)
        global_amax = self.global_amax.to(weight.device)
        # Whether the weight and the Hessian are finite, the per-tensor scale the sweep's
        # candidates divide, as the sweep computes it (on the weight's device), and the weight's
        # max |w|, read together.
        no_value = torch.zeros((), device=weight.device)
        hessian_finite = no_value + 1 if self.hessian is None else torch.isfinite(self.hessian).all()
        weight_max = weight.abs().amax().to(torch.float32) if weight.numel() else no_value
        finite, per_tensor_scale, hessian_finite, weight_max = torch.stack(
            [
                torch.isfinite(weight).all().to(torch.float32),
                per_tensor_amax_to_scale(global_amax),
                hessian_finite.to(device=weight.device, dtype=torch.float32),
                weight_max,
            ]
        ).cpu()
        if not finite:
            self._raise_if_non_finite(weight, weight)
        if not hessian_finite:
            raise ValueError(
                f"{self.describe()}: the Hessian holds NaN or Inf values; every block's error would be NaN"
            )
        if weight_max > self._host_global_amax * (1 + AMAX_ROUNDING):
            raise ValueError(
                f"{self.describe()}: global_amax {self._host_global_amax:.6g} is below the weight's max |w| "
                f"{float(weight_max):.6g}: every candidate would clip the largest blocks"
            )
        if weight.ndim != 2:
            raise ValueError(
                f"{self.describe()}: expects a 2-D [N, K] weight, got shape {tuple(weight.shape)}"
            )
        weight = pad_to_block_multiple(weight, BLOCK_SIZE)
        self._check_shapes(weight)
        too_small = references.sweep_reciprocals_overflow_at_scale(per_tensor_scale)
        if self._host_global_amax == 0:
            shape = (weight.shape[0], weight.shape[1] // BLOCK_SIZE)
            scales = torch.full(shape, E4M3_MIN_NORMAL, device=weight.device)
            self._block_scales_e4m3 = scales.to(torch.float8_e4m3fn)
        elif too_small:
            raise GlobalAmaxTooSmallError(
                f"{self.describe()}: weight global amax {float(global_amax):.3g} is too small for "
                f"the FP8 scale sweep: the smallest candidate's scale reciprocal overflows float32 "
                f"(below about 4e-33)"
            )
        else:
            factor = unit_scale_factor(self._host_global_amax)  # the same choice, no float32 under/overflow
            if factor != 1.0:
                weight, global_amax = weight * factor, global_amax * factor
            self._block_scales_e4m3 = kernels.fp8_scale_sweep(weight, global_amax, self.hessian)

    @property
    def block_scales_e4m3(self) -> torch.Tensor:
        """The chosen FP8 block scales, ``[N, K/16]`` float8_e4m3fn: what the weight stores."""
        if self._block_scales_e4m3 is None:
            raise self._not_collected_error("block_scales_e4m3")
        return self._block_scales_e4m3

    def compute_amax(self) -> torch.Tensor:
        """Per-block amax ``global_amax * c / 448``, float32, shaped like the given ``amax``.

        Under the per-tensor scale ``global_amax / (448 * 6)`` these amaxes give back exactly
        ``block_scales_e4m3``.
        """
        scales = self.block_scales_e4m3.to(torch.float32)
        amax = self.global_amax.to(scales.device) * scales / E4M3_MAX
        return amax.reshape(self.amax_shape)
