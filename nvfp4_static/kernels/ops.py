"""The kernel ops: every ``torch.library`` registration, fake and torch fallback of the package.

The kernel files (``histogram``, ``scale_sweep``, ``block_hessian``, ``act_quantize``, ``gemm``,
``grouped_gemm``) hold Triton kernels and their launchers; this module turns those launchers into ops. The
calibrators, the backends and the tensor subclass call the ops (``nvfp4_static.kernels``
re-exports them), never a launcher.

Calibration ops, ``torch.library.custom_op``s: ``collect_block_amax_histogram``,
``fp8_scale_sweep``, ``accumulate_block_hessian`` and ``gptq_block`` (GPTQ at convert). Each
op's CUDA kernel is the launcher and its kernel on every other device the torch reference in
``nvfp4_static.references``; both give identical results. Being custom ops, a calibration
forward compiles with ``torch.compile(fullgraph=True)``; run eagerly on CUDA, the two collect
ops call their launchers directly, because the custom op's dispatch costs as much host time as
the launch itself and calibration runs them at every observed layer.

Inference ops, ``torch.library.triton_op``s while ``torch.compile`` traces and plain calls in
eager mode (``traced_op``): ``quantize_activation_nvfp4`` and ``gemm_activation_operand`` run the
torch reference on non-CUDA tensors (a ``triton_op`` body is traced for every device, so the
branch lives in the body); ``nvfp4_gemm`` and ``quantizing_nvfp4_gemm`` are CUDA only (the torch
route of the same product is ``backends.cpu``). Inside them, a traced graph reaches the Hopper
Gluon GEMMs, which Inductor cannot trace, through three CUDA-only ``custom_op``s it does not look
into: ``warp_specialized_nvfp4_gemm`` (the wide tiles), ``decode_gemm_partial_products`` (the
decode tile's K splits, which the graph sums) and ``decode_linear_partial_products`` (the same
from the activation itself: its quantize kernel and the decode tile launched as a pair that
overlaps, which the route traces at the decode tile's token counts).
``grouped_static_nvfp4_linear``, the experts of a mixture-of-experts layer, is a ``custom_op``
like the calibration ops: its torch fallback loops over the experts with data-dependent row
counts, which a traced body could not;
``grouped_static_nvfp4_linear_reference`` is that fallback as an op on every device.
``cpu_static_nvfp4_linear`` is the linear of CPU tensors as a traced graph holds it: its body calls
the CPU's C kernel (``backends/cpu_kernel.py``) where it is built and takes the call's rows, else
the torch ops.

``quantize_weight_nvfp4`` is a plain function, not an op: convert runs it eagerly, the activation
quantize kernel on a 2D CUDA weight, the CPU's C kernel on a CPU one, the torch reference on
every other.

Without the ``triton`` package (CPU-only installs: it comes with torch's CUDA wheels, not with
this package) every op keeps its name, schema and torch fallback, so the CPU workflow runs as
it does with Triton; the names this module takes from the kernel files are then functions that
raise ``ModuleNotFoundError`` naming the package, which is what a CUDA tensor reaches. The
inference ops are then plain ``custom_op``s, as ``triton_op`` logs a warning without Triton.
"""

import functools
import importlib
from typing import Callable, Optional

import torch
from torch.library import triton_op

from nvfp4_static import references
from nvfp4_static.backends import cpu_gptq, cpu_quantize, cpu_sweep
from nvfp4_static.kernels.launch import runs_eagerly
from nvfp4_static.numerics import BLOCK_SIZE, dequantize_nvfp4, quantize_nvfp4

try:
    importlib.import_module("triton")  # what the kernel files import
except ImportError:
    HAS_TRITON = False
else:
    HAS_TRITON = True


def require_triton(what: str) -> None:
    """Raise ``ModuleNotFoundError`` saying that ``what`` needs the missing ``triton`` package."""
    if not HAS_TRITON:
        raise ModuleNotFoundError(
            f"nvfp4_static: {what} runs Triton kernels, but the 'triton' package is not installed. "
            "CUDA builds of torch on Linux bring it (or: pip install triton); CPU tensors do not "
            "need it.",
            name="triton",
        )


def _without_triton(what: str):
    """Stand-in for a kernel file's function when Triton is missing: raises ``require_triton``'s error."""

    def missing(*args, **kwargs):
        require_triton(what)

    return missing


if HAS_TRITON:
    from nvfp4_static.kernels.act_quantize import launch_activation_quantize
    from nvfp4_static.kernels.block_hessian import launch_block_hessian
    from nvfp4_static.kernels.expert_routing import MAX_ROUTED_PAIRS, launch_combine, launch_route
    from nvfp4_static.kernels.gemm import (
        DECODE_TILE,
        DECODE_TILE_AT_ONE_ROW,
        WIDE_TILES,
        check_operands,
        config_for_width,
        cublas_with_fused_epilogue,
        eager_quantizing_tiles,
        fuses_epilogue_into_cublas,
        launch_nvfp4_gemm,
        launch_tiles,
        quantizes_activation_in_gemm,
        table_config,
        taking_operand,
    )
    from nvfp4_static.kernels.gptq_block import launch_gptq_block
    from nvfp4_static.kernels.grouped_gemm import launch_grouped_nvfp4_gemm
    from nvfp4_static.kernels.histogram import launch_block_amax_histogram
    from nvfp4_static.kernels.scale_sweep import launch_fp8_scale_sweep
else:
    # Only CUDA tensors get here (every other device takes an op's torch fallback).
    launch_block_amax_histogram = _without_triton("collect_block_amax_histogram on a CUDA tensor")
    launch_fp8_scale_sweep = _without_triton("fp8_scale_sweep on a CUDA tensor")
    launch_block_hessian = _without_triton("accumulate_block_hessian on a CUDA tensor")
    launch_gptq_block = _without_triton("GPTQ (weight_scale='gptq') on a CUDA tensor")
    launch_activation_quantize = _without_triton("NVFP4 activation quantization on a CUDA tensor")
    launch_nvfp4_gemm = _without_triton("the NVFP4 GEMM on a CUDA tensor")
    check_operands = cublas_with_fused_epilogue = fuses_epilogue_into_cublas = launch_nvfp4_gemm
    table_config = taking_operand = config_for_width = launch_tiles = launch_nvfp4_gemm
    quantizes_activation_in_gemm = eager_quantizing_tiles = launch_nvfp4_gemm
    DECODE_TILE = DECODE_TILE_AT_ONE_ROW = None
    WIDE_TILES = {}
    launch_grouped_nvfp4_gemm = _without_triton("the grouped NVFP4 GEMM of experts on a CUDA tensor")
    launch_route = _without_triton("the experts' route kernel on a CUDA tensor")
    launch_combine = _without_triton("the experts' combine kernel on a CUDA tensor")
    MAX_ROUTED_PAIRS = 0


# --- When to skip an op's dispatch ---------------------------------------------------------------


def _launches_eagerly(x: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether a collect op skips its custom op: real CUDA tensors outside of tracing (the op's
    CUDA kernel is the launcher; its other devices' kernel is the reference)."""
    return x.is_cuda and runs_eagerly(x, state)


def traced_op(name: str):
    """Register the decorated function as the ``torch.library.triton_op`` ``name``, and return
    a function that calls that op while ``torch.compile`` / ``torch.export`` trace and the body
    itself otherwise.

    In eager mode the custom op's dispatch is pure host overhead (skipping it took an eager
    decode linear from 0.12 to 0.075 ms on an H100 host, where the GPU needs 0.03;
    examples/benchmarks/RESULTS.md); the op exists for tracing, where it keeps the kernels
    visible to Inductor. The op stays reachable as ``torch.ops.nvfp4_static.<name>`` and as the
    returned function's ``op``.
    """

    def register(body):
        if HAS_TRITON:
            op = triton_op(f"nvfp4_static::{name}", mutates_args=())(body)
        else:
            # What triton_op registers, less its Triton tracing (without Triton it logs a
            # warning per op): the same schema, the body as the kernel and as the fake.
            op = torch.library.custom_op(f"nvfp4_static::{name}", body, mutates_args=())
            op.register_fake(body)

        @functools.wraps(body)
        def call(*args, **kwargs):
            if not runs_eagerly(*args):
                return op(*args, **kwargs)
            return body(*args, **kwargs)  # real tensors: the body, without the op's dispatch

        call.op = op
        return call

    return register


# --- Calibration ops -----------------------------------------------------------------------------


@torch.library.custom_op(
    "nvfp4_static::collect_block_amax_histogram", mutates_args=("counts", "amax")
)
def _collect_block_amax_histogram_op(
    x: torch.Tensor, counts: torch.Tensor, amax: torch.Tensor, bin_edges: torch.Tensor
) -> None:
    batch_counts, batch_amax = references.block_amax_histogram(x, bin_edges)
    counts.add_(batch_counts.to(counts.device))
    torch.maximum(amax, batch_amax.to(amax.device), out=amax)


@_collect_block_amax_histogram_op.register_kernel("cuda")
def _collect_block_amax_histogram_cuda(x, counts, amax, bin_edges):
    launch_block_amax_histogram(x, counts, amax, bin_edges)


@_collect_block_amax_histogram_op.register_fake
def _collect_block_amax_histogram_fake(x, counts, amax, bin_edges):
    return None


def collect_block_amax_histogram(
    x: torch.Tensor, counts: torch.Tensor, amax: torch.Tensor, bin_edges: torch.Tensor
) -> None:
    """Add ``x``'s per-block-amax histogram into ``counts`` (int64) and max into ``amax``, in place."""
    if _launches_eagerly(x, counts):
        launch_block_amax_histogram(x, counts, amax, bin_edges)
    else:
        _collect_block_amax_histogram_op(x, counts, amax, bin_edges)


@torch.library.custom_op("nvfp4_static::fp8_scale_sweep", mutates_args=())
def _fp8_scale_sweep_op(
    weight: torch.Tensor, global_amax: torch.Tensor, hessian: Optional[torch.Tensor] = None
) -> torch.Tensor:
    return references.fp8_scale_sweep(weight, global_amax, hessian)


@_fp8_scale_sweep_op.register_kernel("cuda")
def _fp8_scale_sweep_cuda(weight, global_amax, hessian=None):
    return launch_fp8_scale_sweep(weight, global_amax, hessian)


@_fp8_scale_sweep_op.register_kernel("cpu")
def _fp8_scale_sweep_cpu(weight, global_amax, hessian=None):
    return cpu_sweep.fp8_scale_sweep(weight, global_amax, hessian)


@_fp8_scale_sweep_op.register_fake
def _fp8_scale_sweep_fake(weight, global_amax, hessian=None):
    shape = (weight.shape[0], weight.shape[1] // BLOCK_SIZE)
    return weight.new_empty(shape, dtype=torch.float8_e4m3fn)


def fp8_scale_sweep(
    weight: torch.Tensor, global_amax: torch.Tensor, hessian: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Best FP8 block scale per 16-element block of ``weight``; see ``references.fp8_scale_sweep``."""
    return _fp8_scale_sweep_op(weight, global_amax, hessian)


@torch.library.custom_op("nvfp4_static::gptq_block", mutates_args=())
def _gptq_block_op(
    block: torch.Tensor, upper_block: torch.Tensor, reciprocals: torch.Tensor, dequant_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return references.gptq_block(block, upper_block, reciprocals, dequant_scales)


@_gptq_block_op.register_kernel("cuda")
def _gptq_block_cuda(block, upper_block, reciprocals, dequant_scales):
    return launch_gptq_block(block, upper_block, reciprocals, dequant_scales)


@_gptq_block_op.register_kernel("cpu")
def _gptq_block_cpu(block, upper_block, reciprocals, dequant_scales):
    return cpu_gptq.gptq_block(block, upper_block, reciprocals, dequant_scales)


@_gptq_block_op.register_fake
def _gptq_block_fake(block, upper_block, reciprocals, dequant_scales):
    values = block.new_empty(block.shape, dtype=torch.float32)
    return values, torch.empty_like(values), block.new_empty(block.shape[0], dtype=torch.int64)


def gptq_block(
    block: torch.Tensor, upper_block: torch.Tensor, reciprocals: torch.Tensor, dequant_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's scale search and rounding of one 16-column block; see ``references.gptq_block``."""
    return _gptq_block_op(block, upper_block, reciprocals, dequant_scales)


@torch.library.custom_op("nvfp4_static::accumulate_block_hessian", mutates_args=("hessian",))
def _accumulate_block_hessian_op(x: torch.Tensor, hessian: torch.Tensor) -> None:
    hessian.add_(references.block_hessian(x).to(hessian.device))


@_accumulate_block_hessian_op.register_kernel("cuda")
def _accumulate_block_hessian_cuda(x, hessian):
    launch_block_hessian(x, hessian)


@_accumulate_block_hessian_op.register_fake
def _accumulate_block_hessian_fake(x, hessian):
    return None


def accumulate_block_hessian(x: torch.Tensor, hessian: torch.Tensor) -> None:
    """Add ``sum_tokens x_b x_b^T`` per 16-wide block of ``x`` into ``hessian`` [K/16, 16, 16], in place."""
    if _launches_eagerly(x, hessian):
        launch_block_hessian(x, hessian)
    else:
        _accumulate_block_hessian_op(x, hessian)


# --- Inference ops -------------------------------------------------------------------------------


@traced_op("quantize_activation_nvfp4")
def quantize_activation_nvfp4(
    x: torch.Tensor, per_tensor_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.quantize_nvfp4(x, per_tensor_scale)`` for a 2D ``x``, in one Triton kernel.

    Returns ``(qdata uint8 [M, K/2], block_scales float8_e4m3fn [M, K/16])``.
    """
    if x.device.type != "cuda":
        return quantize_nvfp4(x, per_tensor_scale)
    M, K = x.shape
    qdata = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    block_scales = torch.empty((M, K // 16), dtype=torch.float8_e4m3fn, device=x.device)
    launch_activation_quantize(x, per_tensor_scale, qdata, block_scales, None)
    return qdata, block_scales


def quantize_weight_nvfp4(
    weight: torch.Tensor, per_tensor_scale: torch.Tensor, block_scales: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.quantize_nvfp4(weight, per_tensor_scale, block_scales)`` bit for bit, for convert.

    A 2D CUDA weight runs the activation quantize kernel (under ``block_scales`` when given,
    FP8 ``[N, K/16]``, e.g. the weight sweep's; else computing them from block maxes): one read
    of the weight and no temporaries, where the torch reference makes several float32 and int32
    copies of it. A CPU weight runs the CPU's C kernel (``backends.cpu_quantize``), which takes
    the reference where it cannot. Every other weight (other ranks, no Triton, under tracing)
    takes the reference.
    """
    if block_scales is not None:
        _check_given_block_scales(weight, block_scales)
    eager = runs_eagerly(weight, per_tensor_scale, block_scales)
    if eager and weight.is_cpu:
        return cpu_quantize.quantize_nvfp4(weight, per_tensor_scale, block_scales)
    if not (HAS_TRITON and weight.is_cuda and weight.dim() == 2 and eager):
        return quantize_nvfp4(weight, per_tensor_scale, block_scales)
    M, K = weight.shape
    per_tensor_scale = per_tensor_scale.to(device=weight.device, dtype=torch.float32)
    qdata = torch.empty((M, K // 2), dtype=torch.uint8, device=weight.device)
    if block_scales is None:
        scales = torch.empty((M, K // 16), dtype=torch.float8_e4m3fn, device=weight.device)
        launch_activation_quantize(weight, per_tensor_scale, qdata, scales, None)
        return qdata, scales
    launch_activation_quantize(weight, per_tensor_scale, qdata, block_scales, None, scales_given=True)
    return qdata, block_scales


def _check_given_block_scales(weight: torch.Tensor, block_scales: torch.Tensor) -> None:
    expected_shape = (*weight.shape[:-1], weight.shape[-1] // BLOCK_SIZE)
    if block_scales.dtype != torch.float8_e4m3fn or tuple(block_scales.shape) != expected_shape:
        raise ValueError(
            f"nvfp4_static: block scales for a weight of shape {tuple(weight.shape)} must be "
            f"float8_e4m3fn of shape {expected_shape}; got {block_scales.dtype} of shape "
            f"{tuple(block_scales.shape)}"
        )
    if block_scales.device != weight.device:
        raise ValueError(
            f"nvfp4_static: block scales on {block_scales.device} for a weight on {weight.device}"
        )


def deinterleave_blocks(x: torch.Tensor) -> torch.Tensor:
    """Reorder each 16-block of the last dim as its 8 even-index elements, then its 8 odd ones."""
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK_SIZE // 2, 2)
    return blocks.transpose(-1, -2).reshape(x.shape)


def in_mma_order(x: torch.Tensor) -> torch.Tensor:
    """Reorder each 32-element group of the last dim (a multiple of 32) into the MMA order of
    ``gemm.GemmConfig.mma_order``: element ``8t + 4c + 2i + h`` to position ``16c + 8h + 2t + i``."""
    groups = x.reshape(*x.shape[:-1], -1, 4, 2, 2, 2)  # (t, c, i, h)
    return groups.permute(*range(x.dim() - 1), -5, -3, -1, -4, -2).reshape(x.shape)


@traced_op("gemm_activation_operand")
def gemm_activation_operand(
    x: torch.Tensor,
    per_tensor_scale: torch.Tensor,
    operand_dtype: torch.dtype = torch.float16,
    mma_order: bool = False,
) -> torch.Tensor:
    """``q * s_b`` of ``x`` quantized under ``per_tensor_scale``, ``[M, K]`` in ``operand_dtype``
    (fp16 or bf16: exact in both), block-deinterleaved, or with ``mma_order`` (K a multiple of
    32) in the MMA order of a ``gemm.GemmConfig.mma_order`` GEMM."""
    if operand_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"nvfp4_static: the GEMM operand is fp16 or bf16, not {operand_dtype}")
    if x.device.type != "cuda":
        if mma_order and x.shape[-1] % (2 * BLOCK_SIZE):
            raise ValueError(f"nvfp4_static: the MMA order takes whole 32-element groups, got K = {x.shape[-1]}")
        qdata, block_scales = quantize_nvfp4(x, per_tensor_scale)
        values = dequantize_nvfp4(qdata, block_scales, output_dtype=operand_dtype)
        return in_mma_order(values) if mma_order else deinterleave_blocks(values)
    operand = torch.empty(x.shape, dtype=operand_dtype, device=x.device)
    launch_activation_quantize(x, per_tensor_scale, None, None, operand, mma_order=mma_order)
    return operand


@traced_op("nvfp4_gemm")
def nvfp4_gemm(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    output_scale: Optional[float] = None,
    bucket: Optional[int] = None,
) -> torch.Tensor:
    """``(a @ dequant(W)^T) * act_scale * weight_scale + bias`` as ``[M, N]`` in ``out_dtype``.

    ``a`` is ``q * s_b`` (no global scale) in ``activation_operand_dtype(config, out_dtype,
    output_scale, bias)``, in the MMA order where ``gemm.operand_in_mma_order(config)``, for the
    ``config`` of ``gemm.operand_config(bucket, K)`` asked in the same state (a call while its
    stream is captured into a CUDA graph takes the graphs' tiles, so its operand is prepared
    within the same capture); ``output_scale``, when given, is
    ``act_scale * weight_scale`` (fp32) as a Python float. ``bucket`` is the index of the
    ``GEMM_CONFIGS`` entry to run, by default the one serving M. CUDA only: the torch route of
    the same product is ``backends.cpu``.
    """
    _require_cuda(a, "nvfp4_gemm")
    config = table_config(a.shape[0], bucket, weight_qdata.shape[0], 2 * weight_qdata.shape[1], a.device)
    if fuses_epilogue_into_cublas(config, out_dtype, output_scale, bias):
        check_operands(a, weight_qdata, weight_block_scales, out_dtype)
        return cublas_with_fused_epilogue(a, weight_qdata, weight_block_scales, output_scale, bias)
    out = torch.empty((a.shape[0], weight_qdata.shape[0]), dtype=out_dtype, device=a.device)
    launch_nvfp4_gemm(
        a,
        weight_qdata,
        weight_block_scales,
        act_per_tensor_scale,
        weight_per_tensor_scale,
        bias,
        out,
        taking_operand(config),
    )
    return out


@traced_op("quantizing_nvfp4_gemm")
def quantizing_nvfp4_gemm(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    bucket: Optional[int] = None,
) -> torch.Tensor:
    """The static NVFP4 linear of a raw activation ``x [M, K]`` (bf16, fp16 or fp32) in the GEMM
    itself: quantized under ``act_per_tensor_scale`` in the kernel's K loop (the same values as
    ``gemm_activation_operand``), then as ``nvfp4_gemm``; ``[M, N]`` in ``x``'s dtype. CUDA only.
    The tiles are the table entry's (``bucket``, by default the one serving M) where it
    ``gemm.quantizes_activation_in_gemm``, else ``gemm.eager_quantizing_tiles(M)`` (M at most
    ``gemm.EAGER_QUANTIZING_MAX_ROWS``)."""
    _require_cuda(x, "quantizing_nvfp4_gemm")
    config = table_config(x.shape[0], bucket, weight_qdata.shape[0], 2 * weight_qdata.shape[1], x.device)
    if not quantizes_activation_in_gemm(config):
        config = eager_quantizing_tiles(x.shape[0])
    out = torch.empty((x.shape[0], weight_qdata.shape[0]), dtype=x.dtype, device=x.device)
    launch_nvfp4_gemm(
        x, weight_qdata, weight_block_scales, act_per_tensor_scale, weight_per_tensor_scale, bias, out, config,
        raw_activation=True,
    )
    return out


@torch.library.custom_op("nvfp4_static::warp_specialized_nvfp4_gemm", mutates_args=())
def warp_specialized_nvfp4_gemm(
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    tokens_per_tile: int,
    split_k: int = 1,
) -> torch.Tensor:
    """``nvfp4_gemm`` with the wide warp-specialized tile of ``tokens_per_tile`` activation rows
    (``gemm.TALL_TILE``: 256, ``gemm.SQUARE_TILE``: 128; ``a`` its fp16 operand in the MMA
    order) in ``split_k`` K splits, as an op Inductor does not look into: a traced graph reaches
    the Gluon kernel (``gemm_warp_specialized``, which tracing cannot see) through it. At run time
    the launcher runs that kernel where the GPU and the tensors suit it and the same tile in
    Triton otherwise; the two give the same output. The launcher refuses a split that leaves a
    part without K tiles."""
    _require_cuda(a, "warp_specialized_nvfp4_gemm")
    require_triton("the NVFP4 GEMM on a CUDA tensor")
    if tokens_per_tile not in WIDE_TILES:
        raise ValueError(
            f"nvfp4_static: warp_specialized_nvfp4_gemm has tiles of {sorted(WIDE_TILES)} activation rows, "
            f"got tokens_per_tile = {tokens_per_tile}"
        )
    out = torch.empty((a.shape[0], weight_qdata.shape[0]), dtype=out_dtype, device=a.device)
    scales = (act_per_tensor_scale, weight_per_tensor_scale)
    tile = WIDE_TILES[tokens_per_tile]
    launch_nvfp4_gemm(a, weight_qdata, weight_block_scales, *scales, bias, out, tile, split_k=split_k)
    return out


@warp_specialized_nvfp4_gemm.register_fake
def _warp_specialized_nvfp4_gemm_fake(
    a,
    weight_qdata,
    weight_block_scales,
    act_per_tensor_scale,
    weight_per_tensor_scale,
    bias,
    out_dtype,
    tokens_per_tile,
    split_k=1,
):
    return a.new_empty((a.shape[0], weight_qdata.shape[0]), dtype=out_dtype)


@torch.library.custom_op("nvfp4_static::decode_gemm_partial_products", mutates_args=())
def decode_gemm_partial_products(
    a: torch.Tensor, weight_qdata: torch.Tensor, scale_codes: torch.Tensor, split_k: int
) -> torch.Tensor:
    """The fp32 partial products ``[split_k, M, N]`` of ``a @ dequant(W)^T`` over ``split_k``
    equal K ranges, with the decode tile (``gemm.DECODE_TILE``: ``a`` its fp16 operand in the
    MMA order, at most 16 rows; ``scale_codes`` the block scales as bytes), as an op Inductor
    does not look into: a traced graph reaches the Gluon kernel (``gemm_decode_warp_specialized``)
    through it, then sums and scales the products in torch ops (``gemm.epilogue_as_ops``), which
    Inductor fuses into the kernel reading the output. No counters, so a CUDA graph that
    captures it keeps no buffer between calls. At run time the launcher runs the Gluon kernel
    where the GPU and the tensors suit it and the same tile in Triton otherwise; the two give
    the same products."""
    _require_cuda(a, "decode_gemm_partial_products")
    return _decode_partial_products("decode_gemm_partial_products", a, weight_qdata, scale_codes, split_k)


def _decode_partial_products(
    op: str,
    a: torch.Tensor,
    weight_qdata: torch.Tensor,
    scale_codes: torch.Tensor,
    split_k: int,
    write_operand: Optional[Callable[[], None]] = None,
    act_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The decode ops' products of the operand ``a``, the arguments checked first (errors name
    ``op``). ``write_operand``, if given, launches the kernel that writes ``a``; the decode tile
    then starts while that kernel runs. With ``act_scale``, ``a`` is the activation's one row,
    which the decode tile quantizes under it (``gemm.DECODE_TILE_AT_ONE_ROW``)."""
    require_triton("the NVFP4 GEMM on a CUDA tensor")
    if weight_qdata.dtype != torch.uint8 or scale_codes.dtype != torch.uint8:
        raise ValueError(
            f"nvfp4_static: {op} takes the packed weight and its block scales' codes as "
            f"uint8, got {weight_qdata.dtype} and {scale_codes.dtype}"
        )
    check_operands(a, weight_qdata, scale_codes, torch.float16 if act_scale is None else None)
    M, N, K = a.shape[0], weight_qdata.shape[0], a.shape[1]
    k_tiles = -(-K // DECODE_TILE.block_k)
    if M > DECODE_TILE.block_m or not 1 <= split_k <= k_tiles:
        raise ValueError(
            f"nvfp4_static: {op} takes at most {DECODE_TILE.block_m} rows in 1 to {k_tiles} "
            f"K splits (K = {K}), got {M} rows and split_k = {split_k}"
        )
    if write_operand is not None:
        write_operand()
    partials = torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
    # Only the partial products are written: the weight's scale, bias and output are never read,
    # and the partials buffer stands in for them (and for the activation's scale, but where the
    # kernel quantizes).
    unused = partials
    config = config_for_width(DECODE_TILE if act_scale is None else DECODE_TILE_AT_ONE_ROW, K)
    overlap = write_operand is not None
    launch_tiles(
        a if a.stride(1) == 1 else a.contiguous(), weight_qdata, scale_codes,
        unused if act_scale is None else act_scale.to(torch.float32).reshape(1), unused, None, partials[0], partials,
        False, config, split_k, overlap,
    )
    return partials


@decode_gemm_partial_products.register_fake
def _decode_gemm_partial_products_fake(a, weight_qdata, scale_codes, split_k):
    return a.new_empty((split_k, a.shape[0], weight_qdata.shape[0]), dtype=torch.float32)


@torch.library.custom_op("nvfp4_static::decode_linear_partial_products", mutates_args=())
def decode_linear_partial_products(
    x: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    weight_qdata: torch.Tensor,
    scale_codes: torch.Tensor,
    split_k: int,
) -> torch.Tensor:
    """``decode_gemm_partial_products`` of the activation ``x`` itself (``[M, K]``, bf16, fp16
    or fp32): quantized under ``act_per_tensor_scale`` into the decode tile's operand (as
    ``gemm_activation_operand(x, scale, torch.float16, mma_order=True)``), then the decode tile
    started while that kernel runs, as an eager linear launches the pair. A traced graph takes
    the two as one op, so that no other kernel runs between them: the operand kernel lets the
    kernel after it start early, and only the decode tile waits for it before reading. One row
    the decode tile quantizes itself (``gemm.DECODE_TILE_AT_ONE_ROW``): one kernel, the same
    products."""
    _require_cuda(x, "decode_linear_partial_products")
    op = "decode_linear_partial_products"
    if x.dim() == 2 and x.shape[0] == 1:
        return _decode_partial_products(op, x, weight_qdata, scale_codes, split_k, act_scale=act_per_tensor_scale)
    operand = torch.empty(x.shape, dtype=torch.float16, device=x.device)

    def write_operand():
        launch_activation_quantize(x, act_per_tensor_scale, None, None, operand, mma_order=True)

    return _decode_partial_products(op, operand, weight_qdata, scale_codes, split_k, write_operand)


@decode_linear_partial_products.register_fake
def _decode_linear_partial_products_fake(x, act_per_tensor_scale, weight_qdata, scale_codes, split_k):
    return x.new_empty((split_k, x.shape[0], weight_qdata.shape[0]), dtype=torch.float32)


def _grouped_static_nvfp4_linear_torch(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scales: torch.Tensor,
    act_per_tensor_scales: torch.Tensor,
    source_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    # Imported here: nvfp4_static.backends imports this module.
    from nvfp4_static.backends.cpu import grouped_static_nvfp4_linear

    return grouped_static_nvfp4_linear(
        x if source_rows is None else x[source_rows],
        expert_offsets,
        weight_qdata,
        weight_block_scales,
        weight_per_tensor_scales,
        act_per_tensor_scales,
    )


_grouped_static_nvfp4_linear_op = torch.library.custom_op(
    "nvfp4_static::grouped_static_nvfp4_linear", mutates_args=()
)(_grouped_static_nvfp4_linear_torch)
# The torch route on every device, CUDA included: the experts' backend "cpu". An op of its own
# (no CUDA kernel registered), so that it is as opaque to the compiler as the one above.
grouped_static_nvfp4_linear_reference = torch.library.custom_op(
    "nvfp4_static::grouped_static_nvfp4_linear_reference", mutates_args=()
)(_grouped_static_nvfp4_linear_torch)


@_grouped_static_nvfp4_linear_op.register_kernel("cuda")
def _grouped_static_nvfp4_linear_cuda(
    x, expert_offsets, weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales,
    source_rows=None,
):
    rows = x.shape[0] if source_rows is None else source_rows.shape[0]
    out = torch.empty((rows, weight_qdata.shape[1]), dtype=x.dtype, device=x.device)
    launch_grouped_nvfp4_gemm(
        x, expert_offsets, weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales, out,
        source_rows=source_rows,
    )
    return out


@grouped_static_nvfp4_linear_reference.register_fake
@_grouped_static_nvfp4_linear_op.register_fake
def _grouped_static_nvfp4_linear_fake(
    x, expert_offsets, weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales,
    source_rows=None,
):
    rows = x.shape[0] if source_rows is None else source_rows.shape[0]
    return x.new_empty((rows, weight_qdata.shape[1]))


def grouped_static_nvfp4_linear(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scales: torch.Tensor,
    act_per_tensor_scales: torch.Tensor,
    source_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Each expert's static NVFP4 linear on its rows: ``x [R, K]`` sorted by expert, rows
    ``expert_offsets[e]`` to ``expert_offsets[e + 1]`` (int ``[E + 1]``) times expert ``e``'s
    ``[N, K]`` weight (``weight_qdata [E, N, K/2]``, ``weight_block_scales [E, N, K/16]``, global
    scales ``[E]``), quantized under ``act_per_tensor_scales[e]``; ``[R, N]`` in ``x``'s dtype,
    rows from ``expert_offsets[-1]`` on unwritten. With ``source_rows [R]``, row ``r`` is
    ``x[source_rows[r]]`` (the gather happens inside the CUDA kernel). CUDA: the Triton
    kernels of ``kernels.grouped_gemm``; elsewhere ``backends.cpu.grouped_static_nvfp4_linear``.
    An opaque custom op, so that a compiled graph does not depend on how many rows each expert
    gets."""
    operands = (
        x, expert_offsets, weight_qdata, weight_block_scales, weight_per_tensor_scales, act_per_tensor_scales,
        source_rows,
    )
    if x.is_cuda and runs_eagerly(*operands):
        # Skip the op's dispatch, as the collect ops do.
        return _grouped_static_nvfp4_linear_cuda(*operands)
    return _grouped_static_nvfp4_linear_op(*operands)



# --- The experts' routing ops --------------------------------------------------------------------
# A traced experts forward on CUDA reaches the routing kernels (``kernels.expert_routing``)
# through these two opaque ops; eager calls launch the kernels directly (``experts.routing``).
# Their default kernels, and the CUDA ones past the kernels' limits, are the torch ops.


@torch.library.custom_op("nvfp4_static::route_experts", mutates_args=())
def route_experts(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing of ``top_k_index [T, k]`` to ``num_experts`` experts: ``pair_of_row``,
    ``row_of_pair``, ``token_of_row`` (int64 ``[T * k]``) and ``starts`` (int64 ``[E + 2]``),
    as ``experts.routing.routing_of`` reads them."""
    # Imported here: nvfp4_static.experts.routing imports this module.
    from nvfp4_static.experts.routing import routing_by_torch_ops

    return routing_by_torch_ops(top_k_index, num_experts)


@route_experts.register_kernel("cuda")
def _route_experts_cuda(top_k_index, num_experts):
    if top_k_index.numel() > MAX_ROUTED_PAIRS:
        from nvfp4_static.experts.routing import routing_by_torch_ops

        return routing_by_torch_ops(top_k_index, num_experts)
    parts = _empty_routing(top_k_index, num_experts)
    launch_route(top_k_index, num_experts, *parts)
    return parts


@route_experts.register_fake
def _empty_routing(top_k_index, num_experts):
    """``route_experts``'s four outputs, new and unfilled."""
    pairs = top_k_index.numel()
    return (
        *(top_k_index.new_empty(pairs, dtype=torch.int64) for _ in range(3)),
        top_k_index.new_empty(num_experts + 2, dtype=torch.int64),
    )


def _combine_experts_torch(
    expert_rows: torch.Tensor,
    row_of_pair: torch.Tensor,
    routed_end: torch.Tensor,
    top_k_weights: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    from nvfp4_static.experts.routing import combine_by_torch_ops

    return combine_by_torch_ops(expert_rows, row_of_pair, routed_end, top_k_weights, dtype)


_combine_experts_op = torch.library.custom_op("nvfp4_static::combine_experts", mutates_args=())(_combine_experts_torch)


@_combine_experts_op.register_kernel("cuda")
def _combine_experts_cuda(expert_rows, row_of_pair, routed_end, top_k_weights, dtype):
    expert_rows = expert_rows if expert_rows.stride(-1) == 1 else expert_rows.contiguous()
    out = torch.empty(top_k_weights.shape[0], expert_rows.shape[-1], dtype=dtype, device=expert_rows.device)
    launch_combine(expert_rows, row_of_pair, routed_end, top_k_weights, out)
    return out


@_combine_experts_op.register_fake
def _combine_experts_fake(expert_rows, row_of_pair, routed_end, top_k_weights, dtype):
    return expert_rows.new_empty((top_k_weights.shape[0], expert_rows.shape[-1]), dtype=dtype)


def combine_experts(
    expert_rows: torch.Tensor,
    row_of_pair: torch.Tensor,
    routed_end: torch.Tensor,
    top_k_weights: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Each token's weighted sum of its expert rows (``experts.routing.combine``), ``[T, H]`` in
    ``dtype``: the combine kernel on CUDA, launched directly by an eager call (without the op's
    dispatch, as the grouped GEMM's), through the op while traced; elsewhere the torch ops."""
    operands = (expert_rows, row_of_pair, routed_end, top_k_weights)
    if expert_rows.is_cuda and runs_eagerly(*operands):
        return _combine_experts_cuda(*operands, dtype)
    return _combine_experts_op(*operands, dtype)


def _require_cuda(a: torch.Tensor, op_name: str) -> None:
    if a.device.type != "cuda":
        raise ValueError(f"nvfp4_static: {op_name} runs on CUDA tensors, got {a.device}; use the 'cpu' backend")


def _cpu_static_nvfp4_linear_body(
    x: torch.Tensor,
    weight_qdata: torch.Tensor,
    weight_block_scales: torch.Tensor,
    weight_per_tensor_scale: torch.Tensor,
    act_per_tensor_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    # Imported here: nvfp4_static.backends imports this module.
    from nvfp4_static.backends.cpu import static_nvfp4_linear_on_cpu

    return static_nvfp4_linear_on_cpu(
        x, weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale, bias
    )


# The static NVFP4 linear on a CPU as a traced graph calls it: the CPU kernel or the torch ops,
# chosen inside the op when it runs, so that one graph serves every row count and its calls
# equal the eager ones. A custom op rather than a traced_op: its body calls the C kernel, which
# fake tensors cannot run.
cpu_static_nvfp4_linear = torch.library.custom_op(
    "nvfp4_static::cpu_static_nvfp4_linear", mutates_args=()
)(_cpu_static_nvfp4_linear_body)


@cpu_static_nvfp4_linear.register_fake
def _cpu_static_nvfp4_linear_fake(
    x, weight_qdata, weight_block_scales, weight_per_tensor_scale, act_per_tensor_scale, bias
):
    return x.new_empty((*x.shape[:-1], weight_qdata.shape[0]))
