"""GPTQ's per-block scale search and rounding on a CPU through the C kernel (``cpu_gptq.c``).

The torch reference (``references.gptq_block``) runs the 16 GPTQ steps of all 126 candidates as
ops over ``[126, rows, 16]`` temporaries, once per 16-column block: on a CPU most of GPTQ's time
(``examples/benchmarks/RESULTS.md``). The kernel gives the same values, errors and choices bit
for bit. Without the built library (no C compiler, or ``NVFP4_STATIC_CPU_KERNEL=0``) the
reference runs.
"""

import torch

from nvfp4_static import references
from nvfp4_static.backends import cpu_kernel
from nvfp4_static.numerics import BLOCK_SIZE

# Weight rows per kernel call; the calls run on torch's threads (cpu_kernel.in_row_pieces).
ROWS_PER_PIECE = 64


def gptq_block(
    block: torch.Tensor, upper_block: torch.Tensor, reciprocals: torch.Tensor, dequant_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``references.gptq_block`` of a CPU ``block [N, 16]``: ``(values, errors, choices)``."""
    lib = cpu_kernel.library()
    if lib is None:
        return references.gptq_block(block, upper_block, reciprocals, dequant_scales)
    references.check_gptq_block_operands(block, upper_block, reciprocals, dequant_scales)
    n_rows = block.shape[0]
    block = block if block.stride(1) == 1 else block.contiguous()
    upper = upper_block.to(torch.float32).contiguous()
    reciprocals = reciprocals.to(torch.float32).contiguous()
    dequant_scales = dequant_scales.to(torch.float32).contiguous()
    values = torch.empty(n_rows, BLOCK_SIZE, dtype=torch.float32, device="cpu")
    errors = torch.empty_like(values)
    choices = torch.empty(n_rows, dtype=torch.int64, device="cpu")

    def search(first: int, rows: int) -> None:
        lib.nvfp4_gptq_block(
            block[first].data_ptr(), rows, block.stride(0), upper.data_ptr(), reciprocals.data_ptr(),
            dequant_scales.data_ptr(), reciprocals.numel(), values[first].data_ptr(), errors[first].data_ptr(),
            choices[first:].data_ptr(),
        )

    cpu_kernel.in_row_pieces(n_rows, ROWS_PER_PIECE, search)
    return values, errors, choices
