"""GPTQ's per-block work (``references.gptq_block``) as one Triton kernel.

A program owns ``ROWS`` weight rows of one 16-column block, their 16 elements in registers.
For each FP8 candidate (all 126 at convert), from the smallest, it runs the block's 16 GPTQ steps (round
column ``j``, move its scaled error onto columns ``j+1..15`` through the block's row of ``U``)
and keeps, per row, the first candidate of least ``sum e_j^2``; then it runs the steps once more
with each row's winner and stores the E2M1 values, the errors and the choice. Everything is the
reference's arithmetic in the reference's order: FP contraction is off (an FMA would round
``w - q * d``, ``w_i - e * U_ji`` or ``loss + e * e`` once where torch rounds twice) and the
division by ``U_jj`` is IEEE's (``div_rn``; Triton's ``/`` is approximate on the GPU).

``launch_gptq_block`` is the CUDA kernel of the custom op ``nvfp4_static::gptq_block``
(``kernels.ops``); ``nvfp4_static.gptq`` calls it once per block, in column order.
"""

import torch
import triton
import triton.language as tl

from nvfp4_static import references
from nvfp4_static.kernels.launch import ceil_div
from nvfp4_static.kernels.act_quantize import round_to_e2m1_magnitude
from nvfp4_static.numerics import BLOCK_SIZE

# Rows per program and warps: one row per lane of one warp. Not tuned.
ROWS, NUM_WARPS = 32, 1


@triton.jit
def _block_steps(w, upper, reciprocal, dequant_scale):
    """The 16 GPTQ steps on the tuple ``w`` of 16 columns: ``(values, errors, loss)``."""
    values = ()
    errors = ()
    for j in tl.static_range(16):
        x = w[j] * reciprocal
        magnitude = round_to_e2m1_magnitude(tl.minimum(tl.abs(x), 6.0))
        # q carries x's sign, -0.0 included, as the reference's rounding: set the sign bit.
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        q = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        error = tl.div_rn(w[j] - q * dequant_scale, upper[17 * j])
        updated = ()
        for i in tl.static_range(16):
            if i > j:
                updated = updated + (w[i] - error * upper[16 * j + i],)
            else:
                updated = updated + (w[i],)
        w = updated
        values = values + (q,)
        errors = errors + (error,)
    loss = errors[0] * errors[0]
    for j in tl.static_range(1, 16):
        loss = loss + errors[j] * errors[j]
    return values, errors, loss


@triton.jit
def _gptq_block_kernel(
    block_ptr,
    n_rows,
    row_stride,
    upper_ptr,
    reciprocal_ptr,
    dequant_scale_ptr,
    values_ptr,
    errors_ptr,
    choices_ptr,
    NUM_CANDIDATES: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n_rows
    row_start = block_ptr + rows.to(tl.int64) * row_stride
    w = ()
    for j in tl.static_range(16):
        w = w + (tl.load(row_start + j, mask=in_range, other=0.0),)
    upper = ()
    for k in tl.static_range(256):
        if k % 16 >= k // 16:  # on or above the diagonal: the entries the steps read
            upper = upper + (tl.load(upper_ptr + k),)
        else:
            upper = upper + (0.0,)

    best_loss = tl.full([ROWS], float("inf"), tl.float32)
    best = tl.zeros([ROWS], tl.int32)
    for candidate in range(NUM_CANDIDATES):
        reciprocal = tl.load(reciprocal_ptr + candidate)
        dequant_scale = tl.load(dequant_scale_ptr + candidate)
        _, _, loss = _block_steps(w, upper, reciprocal, dequant_scale)
        better = loss < best_loss  # the first of equal losses stays; NaN never wins
        best_loss = tl.where(better, loss, best_loss)
        best = tl.where(better, candidate, best)

    reciprocal = tl.load(reciprocal_ptr + best)
    dequant_scale = tl.load(dequant_scale_ptr + best)
    values, errors, _ = _block_steps(w, upper, reciprocal, dequant_scale)
    out = rows.to(tl.int64) * 16
    for j in tl.static_range(16):
        tl.store(values_ptr + out + j, values[j], mask=in_range)
        tl.store(errors_ptr + out + j, errors[j], mask=in_range)
    tl.store(choices_ptr + rows, best.to(tl.int64), mask=in_range)


def launch_gptq_block(
    block: torch.Tensor, upper_block: torch.Tensor, reciprocals: torch.Tensor, dequant_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the kernel on ``block`` ``[N, 16]`` float32 (rows may be strided, columns
    contiguous); returns ``references.gptq_block``'s ``(values, errors, choices)``."""
    references.check_gptq_block_operands(block, upper_block, reciprocals, dequant_scales)
    n_rows = block.shape[0]
    block = block if block.stride(1) == 1 else block.contiguous()
    values = torch.empty(n_rows, BLOCK_SIZE, dtype=torch.float32, device=block.device)
    errors = torch.empty_like(values)
    choices = torch.empty(n_rows, dtype=torch.int64, device=block.device)
    if n_rows:
        _gptq_block_kernel[(ceil_div(n_rows, ROWS),)](
            block,
            n_rows,
            block.stride(0),
            upper_block.to(torch.float32).contiguous(),
            reciprocals.contiguous(),
            dequant_scales.contiguous(),
            values,
            errors,
            choices,
            NUM_CANDIDATES=reciprocals.numel(),
            ROWS=ROWS,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
        )
    return values, errors, choices
