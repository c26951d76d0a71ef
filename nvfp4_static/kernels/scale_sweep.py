"""The FP8 block-scale sweep (plain and Hessian-weighted) as one Triton kernel.

It chooses exactly what ``references.fp8_scale_sweep`` chooses: the same per-candidate factors
(``references.sweep_candidate_factors``), the same quantize arithmetic, the same pairwise sums,
and ties to the lowest candidate. FP contraction is off for this kernel: an FMA would round
``w - q * d`` or ``err + dw * dw`` once where torch rounds twice.

A program owns one 16-wide block column of ``ROWS`` weight rows, one or two blocks per lane,
their 16 elements in registers, and walks the 126 candidates from the largest scale down. The
plain error uses ``|w|`` (the error of ``-w`` is the same). Going down, a block is settled once the candidate
clips its largest element by more than its best error so far: every smaller scale clips that
element at least as much (the factors are monotone and rounding is monotone), and a pairwise
sum of squares is never below one of its squares, so no smaller candidate can win or tie. The
program stops when all its blocks are settled; the choice is unchanged, only the work shrinks.
The Hessian error ``dw^T U dw`` has no such bound and always sees all 126 candidates.

``launch_fp8_scale_sweep`` is the CUDA kernel of the custom op ``nvfp4_static::fp8_scale_sweep``
(``kernels.ops``), a ``custom_op`` rather than a ``triton_op`` so that ``torch.compile`` calls
this launcher as is, with contraction off, instead of recompiling the kernel with its own options.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from nvfp4_static import references
from nvfp4_static.kernels.act_quantize import round_to_e2m1_magnitude
from nvfp4_static.kernels.launch import ceil_div
from nvfp4_static.numerics import BLOCK_SIZE, e4m3_positive_values

NUM_CANDIDATES = e4m3_positive_values().numel()

# Rows per program and warps, tuned on an H100 with an 8192 x 8192 bf16 weight: one warp (the
# settle check is then one warp reduction); 64 rows per program (2 per lane) gained 4% for the
# Hessian sweep and lost 2% for the plain one on Gaussian weights.
PLAIN_ROWS, PLAIN_NUM_WARPS = 32, 1
HESSIAN_ROWS, HESSIAN_NUM_WARPS = 64, 1


@triton.jit
def _quantization_steps(w_abs, reciprocal, dequant_scale):
    """``|q| * d`` for each of the 16 ``|w|``, ``q = e2m1(clamp(w * reciprocal, -6, 6))``."""
    steps = ()
    for j in tl.static_range(16):
        q = round_to_e2m1_magnitude(tl.minimum(w_abs[j] * reciprocal, 6.0))
        steps = steps + (q * dequant_scale,)
    return steps


@triton.jit
def _pairwise_sum(terms, FIRST: tl.constexpr):
    """``references._pairwise_sum`` of a 16-tuple whose terms before ``FIRST`` are zero there.

    Those terms are skipped: a tree node whose left half is all zeros is its right half (equal
    up to the sign of a zero, which no comparison sees).
    """
    for level in tl.static_range(4):
        merged = ()
        for k in tl.static_range(8 >> level):
            if (2 * k + 1) << level <= FIRST:
                merged = merged + (terms[2 * k + 1],)
            else:
                merged = merged + (terms[2 * k] + terms[2 * k + 1],)
        terms = merged
    return terms[0]


@triton.jit
def _plain_block_error(w_abs, reciprocal, dequant_scale):
    steps = _quantization_steps(w_abs, reciprocal, dequant_scale)
    squares = ()
    for j in tl.static_range(16):
        dw = w_abs[j] - steps[j]
        squares = squares + (dw * dw,)
    return _pairwise_sum(squares, 0)


@triton.jit
def _hessian_block_error(w, upper_hessian, reciprocal, dequant_scale):
    w_abs = ()
    for j in tl.static_range(16):
        w_abs = w_abs + (tl.abs(w[j]),)
    steps = _quantization_steps(w_abs, reciprocal, dequant_scale)
    dw = ()
    for j in tl.static_range(16):
        # q * d carries w's sign in the reference: set the sign bit (steps are >= 0), exact.
        sign = w[j].to(tl.int32, bitcast=True) & -2147483648
        signed_step = (steps[j].to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        dw = dw + (w[j] - signed_step,)
    weighted = ()
    for i in tl.static_range(16):
        products = ()
        for j in tl.static_range(16):
            if j < i:
                products = products + (0.0,)
            else:
                products = products + (upper_hessian[16 * i + j] * dw[j],)
        weighted = weighted + (dw[i] * _pairwise_sum(products, i),)
    return _pairwise_sum(weighted, 0)


@triton.jit
def _fp8_scale_sweep_kernel(
    weight_ptr,
    n_rows,
    row_stride,
    reciprocal_ptr,
    dequant_scale_ptr,
    upper_hessian_ptr,
    codes_ptr,
    NUM_CANDIDATES: tl.constexpr,
    ROWS: tl.constexpr,
    HESSIAN: tl.constexpr,
):
    block = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n_rows
    row_start = weight_ptr + rows.to(tl.int64) * row_stride + block * 16
    w = ()
    for j in tl.static_range(16):
        w = w + (tl.load(row_start + j, mask=in_range, other=0.0).to(tl.float32),)
    if HESSIAN:
        upper_hessian = ()
        for i in tl.static_range(16):
            for j in tl.static_range(16):
                if j < i:
                    upper_hessian = upper_hessian + (0.0,)
                else:
                    entry = tl.load(upper_hessian_ptr + block * 256 + 16 * i + j)
                    upper_hessian = upper_hessian + (entry,)
    else:
        w_abs = ()
        for j in tl.static_range(16):
            w_abs = w_abs + (tl.abs(w[j]),)
        block_amax = w_abs[0]
        for j in tl.static_range(1, 16):
            block_amax = tl.maximum(block_amax, w_abs[j])

    best_error = tl.full([ROWS], float("inf"), tl.float32)
    best = tl.full([ROWS], -1, tl.int32)
    candidate = NUM_CANDIDATES - 1
    unsettled = ROWS
    while (candidate >= 0) & (unsettled > 0):
        reciprocal = tl.load(reciprocal_ptr + candidate)
        dequant_scale = tl.load(dequant_scale_ptr + candidate)
        if HESSIAN:
            error = _hessian_block_error(w, upper_hessian, reciprocal, dequant_scale)
        else:
            error = _plain_block_error(w_abs, reciprocal, dequant_scale)
        # Scanning down, "<=" keeps the lowest of equal errors; an error that is never finite
        # leaves -1, i.e. scale 0, as the reference's strict "<" from +inf does.
        better = (error <= best_error) & (error < float("inf"))
        best_error = tl.where(better, error, best_error)
        best = tl.where(better, candidate, best)
        if not HESSIAN:
            # The largest element's error at this scale (q = 6 when amax * reciprocal > 5).
            clip = block_amax - 6.0 * dequant_scale
            settled = (block_amax * reciprocal > 5.0) & (clip > 0.0) & (clip * clip > best_error)
            unsettled = tl.sum((~(settled | (block_amax == 0.0))).to(tl.int32))
        candidate -= 1
    if not HESSIAN:
        # Zeros quantize exactly at every scale: a tie, the lowest candidate wins.
        best = tl.where(block_amax == 0.0, 0, best)
    codes = (best + 1).to(tl.uint8)  # E4M3 code of candidate i is i + 1; -1 gives 0.0
    tl.store(codes_ptr + rows.to(tl.int64) * tl.num_programs(1) + block, codes, mask=in_range)


def launch_fp8_scale_sweep(
    weight: torch.Tensor, global_amax: torch.Tensor, hessian: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Run the sweep kernel on ``weight`` ``[N, K]``; returns ``[N, K // 16]`` float8_e4m3fn."""
    references.check_sweep_operands(weight, hessian)
    n_rows, k = weight.shape
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    reciprocals, dequant_scales = references.sweep_candidate_factors(global_amax, weight.device)
    if hessian is not None:
        upper_hessian = references.upper_triangular_hessian(hessian.to(weight.device)).contiguous()
        rows, num_warps = HESSIAN_ROWS, HESSIAN_NUM_WARPS
    else:
        upper_hessian = reciprocals  # not read
        rows, num_warps = PLAIN_ROWS, PLAIN_NUM_WARPS
    codes = torch.empty(n_rows, k // BLOCK_SIZE, dtype=torch.uint8, device=weight.device)
    if codes.numel():
        _fp8_scale_sweep_kernel[(ceil_div(n_rows, rows), k // BLOCK_SIZE)](
            weight,
            n_rows,
            weight.stride(0),
            reciprocals,
            dequant_scales,
            upper_hessian,
            codes,
            NUM_CANDIDATES=NUM_CANDIDATES,
            ROWS=rows,
            HESSIAN=hessian is not None,
            num_warps=num_warps,
            enable_fp_fusion=False,
        )
    return codes.view(torch.float8_e4m3fn)
