"""Per-block Hessian accumulation ``H_b += sum_tokens x_b x_b^T`` as one Triton kernel.

Each program owns 128 bytes of every token row (4 blocks of bf16 / fp16, 2 of fp32), streams
all tokens through ``tl.dot`` into one fp32 Gram matrix of those columns, and adds its diagonal
16 x 16 blocks into the Hessian. The off-diagonal blocks are computed and dropped: the
multiplies are free next to the bytes read. bf16 / fp16 products are exact in fp32 and fp32
inputs use IEEE products, so the result equals ``references.block_hessian`` up to fp32
summation order. No atomics: every Hessian block has one owner, so the sums are deterministic.

``launch_block_hessian`` is the CUDA kernel of the custom op
``nvfp4_static::accumulate_block_hessian`` (``kernels.ops``).
"""

import torch
import triton
import triton.language as tl

from nvfp4_static.kernels.launch import ceil_div
from nvfp4_static.numerics import BLOCK_SIZE, check_dtype

# Tokens per step of a program's loop (tuned on an H100 with 4096 x 8192 bf16 tokens).
TOKENS_PER_STEP = 128
NUM_WARPS = 4
NUM_STAGES = 4


@triton.jit
def _block_hessian_kernel(
    x_ptr,
    n_tokens,
    n_cols,
    row_stride,
    hessian_ptr,
    BLOCKS: tl.constexpr,
    TOKENS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    first_block = tl.program_id(0) * BLOCKS
    cols = first_block * 16 + tl.arange(0, BLOCKS * 16)
    tokens = tl.arange(0, TOKENS)
    gram = tl.zeros([BLOCKS * 16, BLOCKS * 16], tl.float32)
    for start in range(0, n_tokens, TOKENS):
        rows = start + tokens
        mask = (rows < n_tokens)[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)
        gram = tl.dot(tl.trans(x), x, gram, input_precision=INPUT_PRECISION)
    i = tl.arange(0, BLOCKS * 16)
    block = first_block + i // 16
    keep = (i[:, None] // 16 == i[None, :] // 16) & (block < n_cols // 16)[:, None]
    offsets = block[:, None] * 256 + (i % 16)[:, None] * 16 + (i % 16)[None, :]
    accumulated = tl.load(hessian_ptr + offsets, mask=keep)
    tl.store(hessian_ptr + offsets, accumulated + gram, mask=keep)


def launch_block_hessian(x: torch.Tensor, hessian: torch.Tensor) -> None:
    """Add ``sum_tokens x_b x_b^T`` of ``x`` ``[..., K]`` into ``hessian`` ``[K/16, 16, 16]``."""
    check_dtype(x, "block_hessian input")
    k = x.shape[-1]
    if k % BLOCK_SIZE != 0 or hessian.shape != (k // BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE):
        raise ValueError(
            f"nvfp4_static.kernels.accumulate_block_hessian: input of shape {tuple(x.shape)} needs "
            f"a last dim that is a multiple of {BLOCK_SIZE} (pad_to_block_multiple) and a "
            f"[{k // BLOCK_SIZE}, 16, 16] Hessian, got {tuple(hessian.shape)}"
        )
    if hessian.dtype != torch.float32 or not hessian.is_contiguous():
        raise ValueError(
            "nvfp4_static.kernels.accumulate_block_hessian: the Hessian must be a contiguous "
            f"float32 tensor, got {hessian.dtype} with strides {hessian.stride()}"
        )
    x = x.reshape(-1, k)
    if x.shape[0] == 0 or k == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    blocks = 128 // (BLOCK_SIZE * x.element_size())
    _block_hessian_kernel[(ceil_div(k // BLOCK_SIZE, blocks),)](
        x,
        x.shape[0],
        k,
        x.stride(0),
        hessian,
        BLOCKS=blocks,
        TOKENS=TOKENS_PER_STEP,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
