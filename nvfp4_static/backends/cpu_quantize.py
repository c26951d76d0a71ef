"""A weight's NVFP4 quantize at convert on a CPU through the C kernel (``cpu_quantize.c``).

The torch reference (``numerics.quantize_nvfp4``) rounds through torchao's
``f32_to_f4_unpacked``, whose whole-tensor temporaries made it slower than the weight's scale
sweep on a CPU (``examples/benchmarks/RESULTS.md``). The kernel gives the same codes and block
scales bit for bit. The reference runs without the built library (no C compiler, or
``NVFP4_STATIC_CPU_KERNEL=0``), for a global scale that is not one finite positive number (an
all-zero weight's is 0), for operands the kernel would misread (their dtype, device or shape:
the reference raises or broadcasts as it does), and where the kernel met an element it cannot
code as the reference does (NaN or Inf in the weight, or scaled to NaN).
"""

from typing import Optional

import torch

from nvfp4_static import numerics
from nvfp4_static.backends import cpu_kernel
from nvfp4_static.numerics import BLOCK_SIZE

# Weight elements per kernel call (whole rows, at least one); the calls run on torch's threads
# (cpu_kernel.in_row_pieces). A piece takes about a millisecond: smaller ones would spend more
# on starting threads than they save.
ELEMENTS_PER_PIECE = 1 << 20


def quantize_nvfp4(
    weight: torch.Tensor, per_tensor_scale: torch.Tensor, block_scales_e4m3: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.quantize_nvfp4`` of a CPU ``weight [..., K]``: ``(qdata, block_scales_e4m3)``."""
    lib = cpu_kernel.library()
    if lib is None or not _kernel_reads(weight, per_tensor_scale, block_scales_e4m3):
        return numerics.quantize_nvfp4(weight, per_tensor_scale, block_scales_e4m3)
    k = weight.shape[-1]
    rows = weight.reshape(-1, k)
    if rows.dtype == torch.float16:
        rows = rows.to(torch.float32)  # exact
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    global_scale = per_tensor_scale.to(torch.float32).reshape(())
    n_rows = rows.shape[0]
    codes = torch.empty(n_rows, k // 2, dtype=torch.uint8, device="cpu")
    given = None if block_scales_e4m3 is None else block_scales_e4m3.to(torch.float32).reshape(n_rows, -1).contiguous()
    scale_codes = torch.empty(n_rows, k // BLOCK_SIZE, dtype=torch.uint8, device="cpu") if given is None else None
    not_coded = []

    def quantize(first: int, count: int) -> None:
        not_coded.append(lib.nvfp4_quantize_weight(
            rows[first].data_ptr(), rows.dtype == torch.bfloat16, count, k, rows.stride(0),
            global_scale.data_ptr(), None if given is None else given[first].data_ptr(),
            None if scale_codes is None else scale_codes[first].data_ptr(), codes[first].data_ptr(),
        ))

    cpu_kernel.in_row_pieces(n_rows, max(1, ELEMENTS_PER_PIECE // k), quantize)
    if any(not_coded):  # NaN or Inf met: the reference's codes for them depend on a NaN's bits
        return numerics.quantize_nvfp4(weight, per_tensor_scale, block_scales_e4m3)
    lead = weight.shape[:-1]
    if block_scales_e4m3 is None:
        block_scales_e4m3 = scale_codes.view(torch.float8_e4m3fn).reshape(*lead, k // BLOCK_SIZE)
    return codes.reshape(*lead, k // 2), block_scales_e4m3


def _kernel_reads(
    weight: torch.Tensor, per_tensor_scale: torch.Tensor, block_scales_e4m3: Optional[torch.Tensor]
) -> bool:
    """Whether the kernel takes this weight: a plain CPU tensor of a dtype it reads, a last dim of
    whole blocks, rows to quantize, one finite positive CPU global scale, and given block scales
    (if any) FP8 on the CPU, one per block."""
    if not (type(weight) is torch.Tensor and weight.is_cpu and weight.dim() >= 1 and weight.numel()):
        return False
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.shape[-1] % BLOCK_SIZE:
        return False
    if not (type(per_tensor_scale) is torch.Tensor and per_tensor_scale.is_cpu and per_tensor_scale.numel() == 1):
        return False
    if block_scales_e4m3 is not None and not (
        block_scales_e4m3.is_cpu and block_scales_e4m3.dtype == torch.float8_e4m3fn
        and tuple(block_scales_e4m3.shape) == (*weight.shape[:-1], weight.shape[-1] // BLOCK_SIZE)
    ):
        return False
    scale = float(per_tensor_scale)
    return 0.0 < scale < float("inf")
