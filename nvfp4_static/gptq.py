"""GPTQ for NVFP4 weights (Frantar et al., 2022): round the columns in order, under the layer's
input Hessian, and push each column's rounding error onto the columns not yet rounded.

A linear layer's output error over calibration inputs ``X`` is ``||X (W - Q)^T||^2 =
sum_rows dw H dw^T`` with ``H = X^T X``. Round-to-nearest ignores the off-diagonal of ``H``;
GPTQ rounds column ``j``, then changes the later columns so that ``X`` times them cancels as much
of column ``j``'s error as ``H`` allows. With ``U`` the upper Cholesky factor of ``H^-1``
(``H^-1 = U^T U``), the change is ``w[:, j+1:] -= e_j U[j, j+1:]`` with ``e_j = (w_j - q_j) /
U_jj``, and the output error it leaves is ``sum_j e_j^2`` (the OBS step).

NVFP4 specifics:
- the weight's global amax is fixed first (the tensor's per-tensor scale is ``amax / 2688``);
  later columns may grow past it and then saturate at +-6 times their block scale;
- each 16-column block's FP8 scale is fixed before its first column is rounded. It is chosen
  when GPTQ reaches the block, on the weights as the earlier blocks' errors left them: all 126
  FP8 values are tried, each by running the block's 16 GPTQ steps with it, and the one whose
  steps leave the least error ``sum e_j^2`` wins (ties: the smallest). That is the same search
  as the ``"mse"`` sweep (``references.fp8_scale_sweep``) with GPTQ's own error;
- a column is rounded with exactly the inference arithmetic (``numerics``: reciprocal multiply,
  E2M1 round to nearest, ties to even), so quantizing the returned weight again with the
  returned scales gives back the same codes.

The Hessian gets ``dampening * mean(diag H)`` added to its diagonal first (1%, as in the paper),
which keeps the Cholesky factorization defined for inputs that never vary. It is factorized
in float64; the column updates run in float32, in a fixed order, on the weight's device.
"""

from typing import NamedTuple, Optional

import torch

from nvfp4_static import kernels
from nvfp4_static.numerics import BLOCK_SIZE, E4M3_MIN_NORMAL, e4m3_positive_values, unit_scale_factor
from nvfp4_static.observers.nvfp4_mse import GlobalAmaxTooSmallError
from nvfp4_static.references import (
    sweep_candidate_factors,
    sweep_reciprocals_overflow,
    sweep_thread_policy,
)

__all__ = ["DEFAULT_DAMPENING", "GPTQResult", "damped_inverse_hessian_cholesky", "gptq_quantize_nvfp4"]

DEFAULT_DAMPENING = 0.01
# Columns whose errors are applied to the rest of the weight in one matrix product (the paper's
# lazy batch updates); inside the batch, each 16-column block updates the batch's later columns.
LAZY_BATCH_COLUMNS = 128


class GPTQResult(NamedTuple):
    """``values``: the E2M1 values ``q`` (float32 ``[N, K]``); ``block_scales_e4m3``: the FP8
    block scales ``[N, K/16]``. The weight is ``q * block_scale * per_tensor_scale``."""

    values: torch.Tensor
    block_scales_e4m3: torch.Tensor


def _describe(name: Optional[str]) -> str:
    return f"nvfp4_static: GPTQ of layer '{name}'" if name else "nvfp4_static: GPTQ"


def damped_inverse_hessian_cholesky(
    hessian: torch.Tensor, dampening: float = DEFAULT_DAMPENING, name: Optional[str] = None
) -> torch.Tensor:
    """Upper-triangular ``U`` (float32) with ``U^T U = (H + dampening * mean(diag H) I)^-1``.

    Computed in float64. A Hessian whose diagonal is all zero (inputs that were all zero) has no
    preference among roundings: it is taken as the identity, which makes GPTQ round to nearest.
    """
    what = _describe(name)
    if hessian.ndim != 2 or hessian.shape[0] != hessian.shape[1]:
        raise ValueError(f"{what}: the Hessian must be a square [K, K] matrix, got {tuple(hessian.shape)}")
    if not 0 < dampening < float("inf"):
        raise ValueError(f"{what}: dampening must be a finite value > 0, got {dampening}")
    h = hessian.detach().to(torch.float64)
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"{what}: the Hessian holds NaN or Inf values; recalibrate with finite inputs")
    diagonal = torch.diagonal(h)
    if bool((diagonal < 0).any()):
        raise ValueError(
            f"{what}: the Hessian has negative diagonal entries (first at column "
            f"{int(torch.nonzero(diagonal < 0)[0])}); a sum of x x^T cannot"
        )
    mean_diagonal = float(diagonal.mean())
    k = h.shape[0]
    identity = torch.eye(k, dtype=torch.float64, device=h.device)
    if mean_diagonal == 0:
        h = identity
    else:
        h = h + (dampening * mean_diagonal) * identity
    factor, info = torch.linalg.cholesky_ex(h)
    if int(info) != 0:
        raise ValueError(
            f"{what}: the damped Hessian is not positive definite (Cholesky failed at column "
            f"{int(info) - 1}); it must be symmetric, as sum x x^T is; a larger dampening "
            f"(now {dampening}) helps a nearly singular one"
        )
    inverse = torch.cholesky_inverse(factor)
    upper = torch.linalg.cholesky(inverse, upper=True)
    return upper.to(torch.float32)


def gptq_quantize_nvfp4(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    global_amax: torch.Tensor,
    *,
    dampening: float = DEFAULT_DAMPENING,
    name: Optional[str] = None,
) -> GPTQResult:
    """Quantize ``weight`` ``[N, K]`` to NVFP4 by GPTQ under ``hessian`` ``[K, K]``.

    Args:
        weight: float weight, K a multiple of 16 (any supported dtype; computed in float32).
        hessian: ``sum_tokens x x^T`` of the layer's inputs (any positive scaling).
        global_amax: the weight's global amax: the per-tensor scale is ``amax / 2688``. At 0
            (an all-zero weight) every value is 0 and every block scale 2^-6, as the sweep
            gives; below about 4e-33 it raises ``GlobalAmaxTooSmallError`` (see
            ``NVFP4MSECalibrator``).
        dampening: fraction of the mean diagonal added to the diagonal.
        name: layer name for errors.

    Returns:
        ``GPTQResult(values, block_scales_e4m3)``.
    """
    what = _describe(name)
    if weight.ndim != 2 or weight.shape[1] % BLOCK_SIZE:
        raise ValueError(
            f"{what}: expects a [N, K] weight with K a multiple of {BLOCK_SIZE}, got {tuple(weight.shape)}"
        )
    n_rows, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(
            f"{what}: Hessian of shape {tuple(hessian.shape)} does not match a weight of shape "
            f"{tuple(weight.shape)}; expected ({k}, {k})"
        )
    w = weight.detach().to(torch.float32).clone()
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: the weight holds NaN or Inf values")
    global_amax = torch.as_tensor(global_amax, dtype=torch.float32).reshape(())
    if not bool(torch.isfinite(global_amax)) or global_amax < 0:
        raise ValueError(f"{what}: the weight global amax must be finite and >= 0, got {float(global_amax)}")
    if global_amax == 0:
        scales = torch.full((n_rows, k // BLOCK_SIZE), E4M3_MIN_NORMAL, device=w.device)
        return GPTQResult(torch.zeros_like(w), scales.to(torch.float8_e4m3fn))
    if sweep_reciprocals_overflow(global_amax):
        raise GlobalAmaxTooSmallError(
            f"{what}: weight global amax {float(global_amax):.3g} is too small: the smallest FP8 "
            f"block scale's reciprocal overflows float32 (below about 4e-33)"
        )
    factor = unit_scale_factor(float(global_amax))  # the same values and scales, no float32 under/overflow
    if factor != 1.0:
        w.mul_(factor)
        global_amax = global_amax * factor
    reciprocals, dequant_scales = sweep_candidate_factors(global_amax, w.device)
    upper = damped_inverse_hessian_cholesky(hessian.to(w.device), dampening, name)
    # Thousands of small ops, as in the sweep: on a CPU one intra-op thread is many times faster.
    with sweep_thread_policy(w.device):
        values, choices = _round_columns_in_order(w, upper, reciprocals, dequant_scales)
    scales = e4m3_positive_values().to(w.device)[choices]
    return GPTQResult(values, scales.to(torch.float8_e4m3fn))


def _round_columns_in_order(
    w: torch.Tensor, upper: torch.Tensor, reciprocals: torch.Tensor, dequant_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's column loop over ``w`` (a float32 copy of the weight, updated in place): the E2M1
    values ``[N, K]`` and each block's FP8 candidate index ``[N, K/16]``."""
    n_rows, k = w.shape
    values = torch.empty_like(w)
    choices = torch.empty(n_rows, k // BLOCK_SIZE, dtype=torch.int64, device=w.device)
    for batch_start in range(0, k, LAZY_BATCH_COLUMNS):
        batch_end = min(batch_start + LAZY_BATCH_COLUMNS, k)
        batch_errors = torch.empty(n_rows, batch_end - batch_start, dtype=torch.float32, device=w.device)
        for start in range(batch_start, batch_end, BLOCK_SIZE):
            end = start + BLOCK_SIZE
            values[:, start:end], errors, choices[:, start // BLOCK_SIZE] = kernels.gptq_block(
                w[:, start:end], upper[start:end, start:end], reciprocals, dequant_scales
            )
            batch_errors[:, start - batch_start : end - batch_start] = errors
            w[:, end:batch_end] -= errors @ upper[start:end, end:batch_end]
        w[:, batch_end:] -= batch_errors @ upper[batch_start:batch_end, batch_end:]
    return values, choices
