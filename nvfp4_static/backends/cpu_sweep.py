"""The FP8 block-scale sweep on a CPU through the C kernel (``cpu_sweep.c``).

The torch reference (``references.fp8_scale_sweep``) runs 126 passes of whole-tensor ops over
the weight; on a CPU they were most of a convert's time (``examples/benchmarks/RESULTS.md``).
The kernel chooses the same scales bit for bit. Without the built library (no C compiler, or
``NVFP4_STATIC_CPU_KERNEL=0``) the reference runs.
"""

from typing import Optional

import torch

from nvfp4_static import references
from nvfp4_static.backends import cpu_kernel
from nvfp4_static.numerics import BLOCK_SIZE

# Weight rows per kernel call; the calls run on torch's threads (cpu_kernel.in_row_pieces).
ROWS_PER_PIECE = 64


def fp8_scale_sweep(
    weight: torch.Tensor, global_amax: torch.Tensor, hessian: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``references.fp8_scale_sweep`` of a CPU ``weight [N, K]``: ``[N, K // 16]`` float8_e4m3fn."""
    lib = cpu_kernel.library()
    if lib is None:
        return references.fp8_scale_sweep(weight, global_amax, hessian)
    references.check_sweep_operands(weight, hessian)
    n_rows, k = weight.shape
    reciprocals, dequant_scales = references.sweep_candidate_factors(global_amax, weight.device)
    if weight.dtype not in (torch.float32, torch.bfloat16):
        weight = weight.to(torch.float32)  # float16: exact
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    upper = None if hessian is None else references.upper_triangular_hessian(hessian).contiguous()
    codes = torch.empty(n_rows, k // BLOCK_SIZE, dtype=torch.uint8, device="cpu")

    def sweep(first: int, rows: int) -> None:
        lib.nvfp4_fp8_scale_sweep(
            weight[first].data_ptr(), weight.dtype == torch.bfloat16, rows, k, weight.stride(0),
            reciprocals.data_ptr(), dequant_scales.data_ptr(), None if upper is None else upper.data_ptr(),
            codes[first].data_ptr(),
        )

    cpu_kernel.in_row_pieces(n_rows, ROWS_PER_PIECE, sweep)
    return codes.view(torch.float8_e4m3fn)
