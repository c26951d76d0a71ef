"""Plain-torch references for the calibration hot paths and the CPU kernel.

Each calibration function here is the definition a Triton kernel in ``nvfp4_static.kernels``
must match exactly, and the implementation used on CPU:

- ``block_amax_histogram``: per-16-block amaxes binned on a base-2 log scale;
- ``fp8_scale_sweep``: the 126-candidate FP8 block-scale search for a weight (plain or
  Hessian-weighted squared error);
- ``block_hessian``: ``sum_tokens x_b x_b^T`` per 16-wide input block;
- ``gptq_block``: GPTQ's scale search and rounding of one 16-column block (``nvfp4_static.gptq``
  runs it block by block).

``static_nvfp4_linear_in_block_order`` is the definition the CPU's C kernel
(``backends/cpu_kernel.c``) matches exactly.
"""

import contextlib
from typing import Iterator, Optional

import torch

from nvfp4_static.numerics import (
    BLOCK_SIZE,
    E2M1_MAX,
    block_amax,
    check_dtype,
    dequantize_nvfp4,
    e4m3_positive_values,
    per_tensor_amax_to_scale,
    quantize_nvfp4_unpacked,
    round_to_e2m1,
    scale_reciprocal_overflows,
    times_block_scales,
)

__all__ = [
    "histogram_bin_edges",
    "histogram_bin_centres",
    "block_amax_histogram",
    "sweep_candidate_factors",
    "upper_triangular_hessian",
    "fp8_scale_sweep",
    "block_hessian",
    "gptq_block",
    "static_nvfp4_linear_in_block_order",
]

# Weight elements per step of the reference sweep, by device: on a CPU the step's temporaries
# (16x the chunk with a Hessian) should stay near the caches, on a GPU each step costs ~25
# launches. 2^17 took 1-3x less time than 256-row steps on a 2-core CPU (K = 576 to 14336,
# plain and Hessian; examples/benchmarks/RESULTS.md).
SWEEP_ELEMENTS_PER_CHUNK = {"cpu": 1 << 17, "other": 1 << 21}


# Intra-op threads of the sweep on a CPU (None: the caller's ``torch.get_num_threads()``). Each
# of its ~25 ops per candidate and step is small, so with several OpenMP threads every op ends
# in a barrier, where on a busy machine a thread waits for a time slice. Measured on the shared
# 2-core AMD EPYC machine (examples/benchmarks/bench_cpu_sweep.py, RESULTS.md): with another
# 2-thread torch process running, 1536 x 576 Hessian-weighted took over 60 s with 2 threads and
# 7 s with 1, 2048 x 2048 plain over 60 s and 10 s; without it 1 thread was as fast or faster
# but for 1536 x 576 plain (0.6 against 0.4 s). Larger steps, to amortise the barrier, do not
# help: their temporaries leave the caches (at 1536 x 576, 2^19 and 2^21 elements per step took
# 3-19x the time of 2^17, with 1 or 2 threads).
SWEEP_CPU_THREADS: Optional[int] = 1


@contextlib.contextmanager
def sweep_thread_policy(device: torch.device) -> Iterator[None]:
    """Run the enclosed sweep with ``SWEEP_CPU_THREADS`` intra-op threads on a CPU, restoring
    the caller's count afterwards; nothing changes on other devices. The count is process-wide
    in torch, so torch work on another Python thread meanwhile runs with it too."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or SWEEP_CPU_THREADS is None or SWEEP_CPU_THREADS == threads:
        yield
        return
    torch.set_num_threads(SWEEP_CPU_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sweep_rows_per_chunk(k: int, device: torch.device) -> int:
    """Rows of a ``[N, k]`` weight that one step of the reference sweep processes."""
    budget = SWEEP_ELEMENTS_PER_CHUNK["cpu" if device.type == "cpu" else "other"]
    return max(1, budget // max(k, 1))


def histogram_bin_edges(num_bins: int, log2_min: float, log2_max: float) -> torch.Tensor:
    """The ``num_bins - 1`` inner bin edges, ``2 ** (log2_min + i * width)``, as float32.

    Binning compares against these float32 edges (no ``log2`` at collection time), so every
    backend puts a value in the same bin bit for bit.
    """
    width = (log2_max - log2_min) / num_bins
    exponents = log2_min + width * torch.arange(1, num_bins, dtype=torch.float64)
    return torch.exp2(exponents).to(torch.float32)


def histogram_bin_centres(num_bins: int, log2_min: float, log2_max: float) -> torch.Tensor:
    """Each bin's centre in log2 space, ``2 ** (log2_min + (i + 0.5) * width)``, float64."""
    width = (log2_max - log2_min) / num_bins
    return torch.exp2(log2_min + width * (torch.arange(num_bins, dtype=torch.float64) + 0.5))


def block_amax_histogram(
    x: torch.Tensor, bin_edges: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram of the nonzero per-block amaxes of ``x`` and their max.

    Args:
        x: any float tensor; blocks run along the last dim, zero-padded to a multiple of 16.
        bin_edges: float32 inner edges from ``histogram_bin_edges``; a value ``v`` lands in bin
            ``#(edges <= v)``, so values beyond the range land in the first or last bin.

    Returns:
        ``(counts, amax)``: int64 counts of shape ``(len(bin_edges) + 1,)`` (zero blocks are not
        counted) and the float32 max block amax (0 for an all-zero tensor).
    """
    amaxes = block_amax(x).flatten()
    amax = amaxes.max() if amaxes.numel() else torch.zeros((), dtype=torch.float32)
    nonzero = amaxes[amaxes > 0]
    bins = torch.searchsorted(bin_edges.to(nonzero.device), nonzero, right=True)
    counts = torch.bincount(bins, minlength=bin_edges.numel() + 1)
    return counts.to(torch.int64), amax.to(torch.float32)


def sweep_candidate_factors(
    global_amax: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-candidate ``(reciprocal, dequant_scale)`` of the sweep, float32, shape ``(126,)``.

    ``reciprocal = (1 / per_tensor_scale) / s`` and ``dequant_scale = per_tensor_scale * s`` for
    each FP8 value ``s``: torchao's quantize arithmetic. Computed once, by torch on the weight's
    device, for the reference and the kernel alike, so both multiply by the same floats.
    """
    if sweep_reciprocals_overflow(global_amax):
        raise ValueError(
            f"nvfp4_static: fp8_scale_sweep: weight global amax {float(global_amax):.3g} is too "
            f"small: the smallest FP8 candidate's scale reciprocal overflows float32 (below about "
            f"4e-33 it does), so zeros would quantize to 0 * inf; such a weight is zero in effect"
        )
    per_tensor_scale = per_tensor_amax_to_scale(global_amax).to(device)
    candidates = e4m3_positive_values().to(device)
    return (1.0 / per_tensor_scale) / candidates, per_tensor_scale * candidates


def sweep_reciprocals_overflow(global_amax: torch.Tensor) -> bool:
    """Whether the sweep's smallest candidate (2^-9, the largest reciprocal) overflows under
    ``global_amax`` (see ``numerics.scale_reciprocal_overflows``)."""
    per_tensor_scale = per_tensor_amax_to_scale(torch.as_tensor(global_amax, dtype=torch.float32))
    return sweep_reciprocals_overflow_at_scale(per_tensor_scale)


def sweep_reciprocals_overflow_at_scale(per_tensor_scale: torch.Tensor) -> bool:
    """``sweep_reciprocals_overflow`` given the per-tensor scale instead of the global amax."""
    return scale_reciprocal_overflows(per_tensor_scale, float(e4m3_positive_values()[0]))


def upper_triangular_hessian(hessian: torch.Tensor) -> torch.Tensor:
    """``U`` with ``dw^T U dw == dw^T H dw``: ``U_ii = H_ii``, ``U_ij = H_ij + H_ji`` above, 0 below.

    The weighted sweep evaluates the quadratic form through ``U``: 136 products per block instead
    of 256, for any ``H``, symmetric or not.
    """
    hessian = hessian.to(torch.float32)
    folded = torch.triu(hessian + hessian.transpose(-1, -2), diagonal=1)
    return folded + torch.diag_embed(torch.diagonal(hessian, dim1=-2, dim2=-1))


def _pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) as a fixed tree: adjacent pairs, then pairs of those.

    Float addition is not associative; a sweep compares errors that may differ in the last bit, so
    the reference fixes the order and every backend (CPU, CUDA torch, the Triton kernel) adds in
    exactly this one.
    """
    while t.shape[-1] > 1:
        t = t[..., 0::2] + t[..., 1::2]
    return t.squeeze(-1)


def _block_errors(
    w_blocks: torch.Tensor,
    reciprocal: torch.Tensor,
    dequant_scale: torch.Tensor,
    upper_hessian: Optional[torch.Tensor],
) -> torch.Tensor:
    """Per-block error of quantizing ``w_blocks`` ``[R, B, 16]`` with one FP8 block scale.

    The quantize arithmetic is torchao's (reciprocal multiply), so the winner, baked into the
    weight, reproduces exactly the error that chose it. With a Hessian the error is
    ``sum_i dw_i * (sum_j U_ij dw_j)`` (``U`` from ``upper_triangular_hessian``, shared by every
    row's block b), each sum a ``_pairwise_sum``.
    """
    q = round_to_e2m1((w_blocks * reciprocal).clamp(-E2M1_MAX, E2M1_MAX))
    dw = w_blocks - q * dequant_scale
    if upper_hessian is None:
        return _pairwise_sum(dw * dw)
    weighted = _pairwise_sum(upper_hessian * dw.unsqueeze(-2))
    return _pairwise_sum(dw * weighted)


def check_sweep_operands(weight: torch.Tensor, hessian: Optional[torch.Tensor]) -> None:
    """Refuse a sweep's operands that the kernels would misread: a weight that is not 2-D
    ``[N, K]`` with K a multiple of 16 in a supported dtype, a Hessian not ``[K // 16, 16, 16]``."""
    check_dtype(weight, "fp8_scale_sweep weight")
    if weight.ndim != 2 or weight.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"nvfp4_static.kernels.fp8_scale_sweep: weight of shape {tuple(weight.shape)} must be "
            f"2-D [N, K] with K a multiple of {BLOCK_SIZE}; pad it with pad_to_block_multiple"
        )
    expected = (weight.shape[1] // BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE)
    if hessian is not None and tuple(hessian.shape) != expected:
        raise ValueError(
            f"nvfp4_static.kernels.fp8_scale_sweep: Hessian of shape {tuple(hessian.shape)} for a "
            f"weight of shape {tuple(weight.shape)}; it must be {list(expected)}, one 16 x 16 "
            f"matrix per input block"
        )


def fp8_scale_sweep(
    weight: torch.Tensor,
    global_amax: torch.Tensor,
    hessian: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pick, per 16-element block, the FP8 E4M3 scale of least quantization error.

    Tries all 126 positive FP8 values ``s`` as the block scale under the per-tensor scale
    ``global_amax / (448 * 6)`` (equivalently block amax ``= global_amax * s / 448``) and keeps
    the one minimising ``sum (w - deq(q(w)))^2``, or ``dw^T H dw`` with a Hessian. Ties go to
    the lowest candidate (strict ``<`` while scanning upwards); a block whose every error is
    infinite or NaN gets scale 0.

    Args:
        weight: ``[N, K]`` float tensor, K a multiple of 16.
        global_amax: float32 scalar, the weight's global amax (> 0).
        hessian: optional ``[K // 16, 16, 16]`` float32 per-input-block Hessian.

    Returns:
        ``[N, K // 16]`` float8_e4m3fn block scales.
    """
    n_rows, k = weight.shape
    n_blocks = k // BLOCK_SIZE
    reciprocals, dequant_scales = sweep_candidate_factors(global_amax, weight.device)
    candidates = e4m3_positive_values().to(weight.device)
    upper_hessian = None
    if hessian is not None:
        upper_hessian = upper_triangular_hessian(hessian.to(weight.device))
    best_scales = torch.empty(n_rows, n_blocks, dtype=torch.float32, device=weight.device)
    rows_per_chunk = sweep_rows_per_chunk(k, weight.device)
    with sweep_thread_policy(weight.device):
        for start in range(0, n_rows, rows_per_chunk):
            w_blocks = weight[start : start + rows_per_chunk].to(torch.float32)
            w_blocks = w_blocks.reshape(-1, n_blocks, BLOCK_SIZE)
            best_error = torch.full(w_blocks.shape[:2], float("inf"), device=weight.device)
            best = torch.zeros(w_blocks.shape[:2], device=weight.device)
            factors = zip(candidates, reciprocals, dequant_scales)
            for candidate, reciprocal, dequant_scale in factors:
                error = _block_errors(w_blocks, reciprocal, dequant_scale, upper_hessian)
                better = error < best_error
                best_error = torch.where(better, error, best_error)
                best = torch.where(better, candidate, best)
            best_scales[start : start + rows_per_chunk] = best
    return best_scales.to(torch.float8_e4m3fn)


def block_hessian(x: torch.Tensor) -> torch.Tensor:
    """``sum_tokens x_b x_b^T`` for each 16-wide input block ``b``: ``[K // 16, 16, 16]`` fp32.

    ``x`` is ``[..., K]`` with K a multiple of 16; every leading index counts as a token.
    """
    k = x.shape[-1]
    tokens = x.reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE).to(torch.float32)
    return torch.einsum("tbi,tbj->bij", tokens, tokens)


# Weight rows per step of ``gptq_block``'s scale search, by device: its temporaries are 126
# candidates x rows x 16 floats (8 MiB per temporary at 1024 rows). Each step runs ~300 small
# ops, so a GPU takes every row of an 8B-sized layer at once (115 MiB per temporary at 14336).
GPTQ_SEARCH_ROWS_PER_CHUNK = {"cpu": 1024, "other": 16384}


def _gptq_block_steps(
    block: torch.Tensor, upper_block: torch.Tensor, reciprocal: torch.Tensor, dequant_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's 16 steps over one block of columns ``[..., R, 16]`` (not changed), each row with
    its own ``reciprocal = (1 / p) / s`` and ``dequant_scale = p * s`` (``[..., R, 1]``).

    Step ``j`` rounds column ``j`` as it stands, ``q_j = e2m1(clamp(w_j * reciprocal, -6, 6))``,
    and moves its scaled error ``e_j = (w_j - q_j * dequant_scale) / U_jj`` onto the later
    columns, ``w_i -= e_j * U_ji``. Returns the E2M1 values and the errors ``e``.
    """
    block = block.clone()
    values = torch.empty_like(block)
    errors = torch.empty_like(block)
    for j in range(BLOCK_SIZE):
        column = block[..., j : j + 1]
        q = round_to_e2m1((column * reciprocal).clamp(-E2M1_MAX, E2M1_MAX))
        error = (column - q * dequant_scale) / upper_block[j, j]
        block[..., j + 1 :] -= error * upper_block[j, j + 1 :]
        values[..., j : j + 1] = q
        errors[..., j : j + 1] = error
    return values, errors


def check_gptq_block_operands(
    block: torch.Tensor, upper_block: torch.Tensor, reciprocals: torch.Tensor, dequant_scales: torch.Tensor
) -> None:
    """Refuse ``gptq_block`` operands that the kernels would misread: a block that is not
    float32 ``[N, 16]``, a ``U`` block not ``[16, 16]``, factors not two equal 1-D tensors."""
    problems = []
    if block.ndim != 2 or block.shape[1] != BLOCK_SIZE or block.dtype != torch.float32:
        problems.append(f"block must be float32 [N, {BLOCK_SIZE}], got {block.dtype} {tuple(block.shape)}")
    if tuple(upper_block.shape) != (BLOCK_SIZE, BLOCK_SIZE):
        problems.append(f"the U block must be [{BLOCK_SIZE}, {BLOCK_SIZE}], got {tuple(upper_block.shape)}")
    if reciprocals.ndim != 1 or reciprocals.shape != dequant_scales.shape:
        problems.append(
            f"the candidates' factors must be two 1-D tensors of one length, got "
            f"{tuple(reciprocals.shape)} and {tuple(dequant_scales.shape)}"
        )
    if problems:
        raise ValueError("nvfp4_static.kernels.gptq_block: " + "; ".join(problems))


def gptq_block(
    block: torch.Tensor, upper_block: torch.Tensor, reciprocals: torch.Tensor, dequant_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ on one 16-column block of a weight: choose each row's FP8 block scale, then round.

    Every candidate ``c`` (``reciprocals[c]``, ``dequant_scales[c]`` from
    ``sweep_candidate_factors``) runs the block's 16 GPTQ steps (``_gptq_block_steps``); each
    row keeps the one whose errors have the least ``sum_j e_j^2``, added in order ``j = 0..15``
    (ties: the lowest candidate; a NaN sum never wins).

    Args:
        block: float32 ``[N, 16]``, the block's columns as the earlier blocks' errors left them.
        upper_block: float32 ``[16, 16]``, the block's diagonal block of ``U`` (upper triangular,
            ``U^T U`` the damped inverse Hessian).
        reciprocals, dequant_scales: float32 ``[126]``.

    Returns:
        ``(values, errors, choices)``: E2M1 values ``[N, 16]``, errors ``e`` ``[N, 16]`` (their
        product with ``U``'s rows carries the block's error onto the later columns) and each
        row's candidate index ``[N]`` (int64).
    """
    n_candidates = reciprocals.numel()
    choices = torch.empty(block.shape[0], dtype=torch.int64, device=block.device)
    rows_per_chunk = GPTQ_SEARCH_ROWS_PER_CHUNK["cpu" if block.device.type == "cpu" else "other"]
    for start in range(0, block.shape[0], rows_per_chunk):
        trial = block[start : start + rows_per_chunk].unsqueeze(0).expand(n_candidates, -1, -1)
        _, errors = _gptq_block_steps(
            trial, upper_block, reciprocals.view(-1, 1, 1), dequant_scales.view(-1, 1, 1)
        )
        loss = errors[..., 0] * errors[..., 0]
        for j in range(1, BLOCK_SIZE):
            loss = loss + errors[..., j] * errors[..., j]
        loss = torch.nan_to_num(loss, nan=float("inf"))
        choices[start : start + rows_per_chunk] = loss.argmin(dim=0)  # the first of equal minima
    values, errors = _gptq_block_steps(
        block, upper_block, reciprocals[choices].unsqueeze(1), dequant_scales[choices].unsqueeze(1)
    )
    return values, errors, choices


def static_nvfp4_linear_in_block_order(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """``backends.cpu.static_nvfp4_linear`` with its float32 sum in a fixed order: each 16-block's
    product of the quantized activation and weight summed exactly (float64 holds every partial
    sum: at most 20 significant bits), then the blocks added one by one in K order in float32,
    then both global scales and the bias as the torch route applies them. ``x [..., K]``;
    returns ``[..., N]`` in ``x.dtype``. One float32 add per block and output: for small shapes."""
    k = x.shape[-1]
    n = weight_qdata.shape[0]
    activation = times_block_scales(*quantize_nvfp4_unpacked(x, act_per_tensor_scale))
    activation = activation.reshape(-1, 1, k // BLOCK_SIZE, BLOCK_SIZE)
    weight = dequantize_nvfp4(weight_qdata, weight_block_scales).reshape(1, n, k // BLOCK_SIZE, BLOCK_SIZE)
    blocks = (activation.double() * weight.double()).sum(-1).float()
    out = torch.zeros(blocks.shape[:2], dtype=torch.float32, device=x.device)
    for b in range(k // BLOCK_SIZE):
        out = out + blocks[..., b]
    out = out * (act_per_tensor_scale.to(torch.float32) * weight_per_tensor_scale.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
