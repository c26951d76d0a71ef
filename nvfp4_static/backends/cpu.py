"""The torch route of the static NVFP4 linear: runs anywhere, defines the numerics.

A faithful emulation of an FP4 tensor-core GEMM: both operands are dequantized *without* their
global scales (``q * s_b`` is exact in bf16 and fp32), multiplied with fp32 accumulation, and the
product of the two global scales and the bias are applied afterwards.

On a CPU the linear runs the CPU's own kernel where it is built (``backends/cpu_kernel.py``;
without AVX2, for calls of up to 16 rows): the same quantized operands, each 16-block's product exact and the
blocks summed in K order, so it differs from the torch ops only in the order of the float32 sum.
Traced on a CPU, the linear is one opaque op (``kernels.ops.cpu_static_nvfp4_linear``) that
decides the same way, so compiled and eager calls agree bit for bit.
"""

import contextlib
from functools import lru_cache
from typing import Optional

import torch

from nvfp4_static.backends import cpu_kernel
from nvfp4_static.inference_only import detached, records_gradients, refusing_gradients
from nvfp4_static.kernels.launch import runs_eagerly
from nvfp4_static.kernels.ops import cpu_static_nvfp4_linear
from nvfp4_static.numerics import (
    dequantize_nvfp4,
    e2m1_byte_words,
    e4m3_values_by_code,
    quantize_nvfp4_unpacked,
    times_block_scales,
)


def static_nvfp4_linear(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    output_scale: Optional[float] = None,
) -> torch.Tensor:
    """``x [..., K] @ W^T + bias`` with ``x`` quantized to NVFP4 under its static global scale.

    Args:
        x: ``[..., K]`` activation (fp32 / bf16 / fp16), K a multiple of 16.
        weight_qdata: ``[N, K // 2]`` packed E2M1 codes; weight_block_scales: ``[N, K // 16]`` FP8.
        weight_per_tensor_scale, act_per_tensor_scale: float32 scalars (torchao convention).
        bias: optional ``[N]``.
        output_scale: ``act_per_tensor_scale * weight_per_tensor_scale`` as a Python float, when
            the caller has it; a route that hands the epilogue to cuBLAS needs it on the host
            (``backends.triton_route``). This route scales on the device and ignores it.

    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    operands = (x, weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale, bias)
    if x.device.type != "cpu":
        return torch_static_nvfp4_linear(*operands)
    if runs_eagerly(x, weight_qdata):
        return static_nvfp4_linear_on_cpu(*operands)  # without the op's dispatch
    return cpu_static_nvfp4_linear(*operands)


def static_nvfp4_linear_on_cpu(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """The linear of real CPU tensors: the CPU kernel where it is built and takes this many
    rows, else the torch ops. The kernel's output records no autograd graph: for a call that
    records one (gradients on, an input or the bias that requires them; a model called outside
    ``torch.no_grad()``) it is tied back to those inputs by ``refusing_gradients``, so that a
    backward through it raises the converted layer's error."""
    operands = (x, weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale, bias)
    lib = cpu_kernel.library()
    if lib is not None and x.numel() <= lib.most_rows * x.shape[-1]:
        if not records_gradients(x, bias):
            return cpu_kernel.static_nvfp4_linear_rows(lib, *operands, decoding_tables()[1])
        out = cpu_kernel.static_nvfp4_linear_rows(lib, detached(x), *operands[1:5], detached(bias),
                                                  decoding_tables()[1])
        return refusing_gradients(out, x, bias)
    return torch_static_nvfp4_linear(*operands)


def torch_static_nvfp4_linear(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """``static_nvfp4_linear`` in torch ops, on any device: the numerics every route meets."""
    # q * s_b of the activation, the same values its packed codes would decode to.
    act = times_block_scales(*quantize_nvfp4_unpacked(x, act_per_tensor_scale))
    with _in_float32(x.device.type):
        out = _times_dequantized_weight(act, weight_qdata, weight_block_scales)
    out = out * (act_per_tensor_scale * weight_per_tensor_scale)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def _in_float32(device_type: str):
    """Autocast off for the product of the unscaled operands (each up to 6 x 448): autocast
    would run it in float16 (Inf past 65504) or bfloat16 (its rounding), not float32."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


# Eagerly on a CPU the weight is dequantized and multiplied this many weights at a time, so that
# each dequantized slice (2 MiB of float32) is still in cache when the product reads it, and
# the allocator reuses one slice's memory for the next instead of mapping fresh pages for a
# whole layer's: a 2048 x 8192 layer at one token took 17-26 ms, 35-123 dequantizing it whole
# (2 cores; examples/benchmarks/RESULTS.md, bench_cpu_linear.py).
_WEIGHT_SLICE_ELEMENTS = 1 << 19


def _times_dequantized_weight(act: torch.Tensor, weight_qdata: torch.Tensor, weight_block_scales: torch.Tensor):
    """``act [..., K] @ W^T`` in float32 for the weight's ``q * s_b`` ``W [N, K]``, by slices of
    output features on a CPU (which runs this on real tensors only: traced, the linear is an
    op), its codes and scales decoded by lookup in tables built once; each output is the same
    dot product either way. On another device the weight is dequantized whole."""
    if act.device.type != "cpu":
        return torch.matmul(act, dequantize_nvfp4(weight_qdata, weight_block_scales).t())
    N, K = weight_qdata.shape[0], 2 * weight_qdata.shape[1]
    rows = max(1, _WEIGHT_SLICE_ELEMENTS // K)
    byte_words, scale_values = decoding_tables()

    def dequantized(part: slice) -> torch.Tensor:
        return dequantize_nvfp4(
            weight_qdata[part], weight_block_scales[part], byte_words=byte_words, scale_values=scale_values
        )

    if rows >= N:
        return torch.matmul(act, dequantized(slice(None)).t())
    out = act.new_empty((*act.shape[:-1], N), dtype=torch.float32)
    for first in range(0, N, rows):
        part = slice(first, first + rows)
        out[..., part] = torch.matmul(act, dequantized(part).t())
    return out


@lru_cache(maxsize=None)
def decoding_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU's lookup tables for dequantizing (``e2m1_byte_words``, ``e4m3_values_by_code``),
    built once, as ordinary tensors even when first asked for under inference mode."""
    with torch.inference_mode(False):
        device = torch.device("cpu")
        return e2m1_byte_words(device), e4m3_values_by_code(device)


def grouped_static_nvfp4_linear(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scales: torch.Tensor,
    act_per_tensor_scales: torch.Tensor,
) -> torch.Tensor:
    """The experts of a mixture-of-experts layer: ``static_nvfp4_linear`` of each expert's rows.

    ``x [R, K]`` is sorted by expert: rows ``expert_offsets[e]`` to ``expert_offsets[e + 1]`` go
    to expert ``e``, whose weight is ``weight_qdata[e]``, ``weight_block_scales[e]`` with global
    scales ``weight_per_tensor_scales[e]`` and ``act_per_tensor_scales[e]``. Returns ``[R, N]`` in
    ``x.dtype``; rows from ``expert_offsets[-1]`` on are left unwritten. The reference of the
    grouped Triton GEMM (``kernels.grouped_gemm``) on every device; on a CPU each expert's call of
    the kernel skips the per-call checks and conversions the experts share (one check serves all).
    """
    out = x.new_empty((x.shape[0], weight_qdata.shape[1]))
    bounds = expert_offsets.tolist()
    experts = [(expert, first, end) for expert, (first, end) in enumerate(zip(bounds[:-1], bounds[1:])) if end > first]
    weights = (weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales)
    lib = _kernel_for_experts(x, *weights, most_rows=max((end - first for _, first, end in experts), default=0))
    if lib is not None:
        x_rows = x.contiguous()
        k, n = x.shape[-1], weight_qdata.shape[1]
        for expert, first, end in experts:
            cpu_kernel.call_kernel(
                lib, x_rows[first:end], end - first, k, n, _expert_addresses(expert, *weights), None, out[first:end]
            )
        return out
    for expert, first, end in experts:
        out[first:end] = static_nvfp4_linear(
            x[first:end],
            weight_qdata[expert],
            weight_block_scales[expert],
            weight_per_tensor_scales[expert],
            act_per_tensor_scales[expert],
            None,
        )
    return out


def _kernel_for_experts(
    x, weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales, most_rows: int
) -> Optional[cpu_kernel.Kernel]:
    """The CPU kernel, where every expert's call would take it on the stacked tensors as they are
    (then one check of the operands serves all the experts, and each expert's call reads its slice
    of them by address), else None: each expert takes ``static_nvfp4_linear``."""
    weights = (weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales)
    if not (
        x.device.type == "cpu"
        and runs_eagerly(x)
        and not records_gradients(x)
        and x.dtype in (torch.bfloat16, torch.float32)
        and weight_qdata.dim() == 3
        and cpu_kernel.reads_as_they_are(*weights)
        and weight_per_tensor_scales.shape == act_per_tensor_scales.shape == weight_qdata.shape[:1]
    ):
        return None
    lib = cpu_kernel.library()
    if lib is None or most_rows > lib.most_rows or x.dim() != 2:
        return None
    try:
        cpu_kernel.check_operands(
            x, weight_qdata[0], weight_block_scales[0], weight_per_tensor_scales[0], act_per_tensor_scales[0], None
        )
    except ValueError as refused:
        raise ValueError(
            f"{refused} (the shapes of one expert of {weight_qdata.shape[0]}, stacked as packed weights "
            f"{tuple(weight_qdata.shape)} and block scales {tuple(weight_block_scales.shape)})"
        ) from None
    return lib


def _expert_addresses(
    expert: int, weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales
) -> cpu_kernel.WeightAddresses:
    """Expert ``expert``'s operands within the stacked, contiguous tensors (one-byte codes,
    float32 global scales)."""
    return cpu_kernel.WeightAddresses(
        act_per_tensor_scales.data_ptr() + 4 * expert,
        weight_qdata.data_ptr() + expert * weight_qdata.stride(0),
        weight_block_scales.data_ptr() + expert * weight_block_scales.stride(0),
        decoding_tables()[1].data_ptr(),
        weight_per_tensor_scales.data_ptr() + 4 * expert,
    )
