"""Quantize a 2D tensor to NVFP4 under a static global scale, in one read, in Triton.

Per 16-element block: amax -> FP8 E4M3 block scale -> E2M1 codes, with exactly the arithmetic of
``numerics.quantize_nvfp4`` (fp32, correctly rounded divisions, reciprocal multiply, ties to
even), so that the two agree bit for bit. At inference it quantizes activations and writes
either form the backends need:

- packed codes + FP8 scales (the operands of a real FP4 GEMM; the op
  ``ops.quantize_activation_nvfp4``);
- ``q * s_b`` in fp16 (or bf16), *without* the global scale, each 16-block stored as its 8
  even-index elements then its 8 odd ones (the op ``ops.gemm_activation_operand``). Every such
  product is exact in fp16 and bf16 (at most 5 significant bits, magnitudes in [2^-7, 2688]);
  this is the A operand of the faithful GEMM (``kernels.gemm``), whose Triton kernel reads even
  and odd elements as two contiguous halves because they sit in the low and high nibbles of the
  packed weight. With ``mma_order`` each 32-element group (K a multiple of 32) is stored in the
  order a wide GEMM tile dequantizes the weight into its MMA operand (``gemm.GemmConfig.mma_order``):
  element ``8t + 4c + 2i + h`` at position ``16c + 8h + 2t + i``.

At convert it quantizes weights (``ops.quantize_weight_nvfp4``), also under block scales given
to it (the weight sweep's, FP8 subnormals included): it then reads each block's scale instead of
computing it and writes only the packed codes.

``launch_activation_quantize`` is the launcher, which the ops call on CUDA tensors and the tests
run on CPU under ``TRITON_INTERPRET=1``; ``quantize_to_operand_halves`` is the same arithmetic
for a GEMM that quantizes its activation itself.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from nvfp4_static.kernels.launch import KernelCall, ceil_div, overlaps_kernels, runs_eagerly
from nvfp4_static.numerics import BLOCK_SIZE, E2M1_MAX, E4M3_MAX, E4M3_MIN_NORMAL, check_dtype

_E2M1_MAX = tl.constexpr(E2M1_MAX)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_E4M3_MIN_NORMAL = tl.constexpr(E4M3_MIN_NORMAL)

# Tile of one program: rows x columns of the activation, and its warps. Memory-bound at large M;
# one row per program keeps a decode batch of one row spread over K / 1024 programs. Chosen by a
# sweep on an H200 (rows 1-16, columns 256-2048, 2-8 warps; K = 4096 / 8192 / 14336, M = 1 to
# 4096; examples/benchmarks/RESULTS.md): 1 x 1024 with 2 warps was best or within 2% at M >= 512
# (19-20% faster than 1 x 512 with 4 warps at M = 4096); below that every tile takes
# the same ~5 us.
BLOCK_ROWS = 1
BLOCK_COLS = 1024
NUM_WARPS = 2
# Elements per group of the operand's MMA order (two 16-blocks).
MMA_GROUP = 2 * BLOCK_SIZE


@triton.jit
def round_to_e4m3(v):
    """Round fp32 values in [2^-6, 448] to FP8 E4M3, ties to even; returns (value, code byte).

    Bit arithmetic rather than a float8 cast, so that the rounding is the same (and equal to
    torch's) on every GPU generation and in the interpreter: keep the top 3 mantissa bits,
    round to nearest even, and re-bias the exponent from 127 to 7.
    """
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    code = (bits >> 20) - ((127 - 7) << 3)
    return bits.to(tl.float32, bitcast=True), code.to(tl.uint8)


@triton.jit
def e4m3_value(code):
    """fp32 values of FP8 E4M3 code bytes (any but the NaN codes 0x7F and 0xFF), subnormals
    (0x01-0x07: multiples of 2^-9) included; the inverse of ``round_to_e4m3``'s bit arithmetic."""
    code = code.to(tl.int32)
    magnitude = code & 0x7F
    normal = ((magnitude << 20) + ((127 - 7) << 23)).to(tl.float32, bitcast=True)
    value = tl.where(magnitude < 8, magnitude.to(tl.float32) * 0.001953125, normal)
    return tl.where(code >= 0x80, value * -1.0, value)


@triton.jit
def nvfp4_block_scale(block_amax, per_tensor_scale):
    """Each block's FP8 scale (fp32 value, code byte) under the global scale, and the reciprocal
    that maps the block onto the E2M1 range, as ``numerics.quantize_nvfp4`` computes them."""
    scale = tl.math.div_rn(tl.math.div_rn(block_amax, _E2M1_MAX), per_tensor_scale)
    scale = tl.minimum(tl.maximum(scale, _E4M3_MIN_NORMAL), _E4M3_MAX)
    scale, scale_code = round_to_e4m3(scale)
    return scale, scale_code, block_reciprocal(scale, per_tensor_scale)


@triton.jit
def block_reciprocal(scale, per_tensor_scale):
    """``(1 / per_tensor_scale) / scale``, both divisions correctly rounded, as
    ``numerics.quantize_nvfp4`` maps a block onto the E2M1 range."""
    return tl.math.div_rn(tl.math.div_rn(1.0, per_tensor_scale), scale)


# 1.5 * 2**22: times a power of two 2**e, a float whose ulp is 2**(e - 1).
_E2M1_SNAP = tl.constexpr(6291456.0)


@triton.jit
def round_to_e2m1_magnitude(a):
    """``numerics.round_to_e2m1`` of ``a`` in [0, 6], as its fp32 value.

    ``a`` is rounded onto the E2M1 grid (step 0.5 below 2, 1 below 4, then 2) by adding and
    subtracting ``1.5 * 2**22 * binade(max(a, 1))``, a float whose ulp is that step: round to
    nearest, ties to even, as the reference's thresholds. Both FMAs are an exact product plus
    one rounding, i.e. a plain add.
    """
    one_or_more = tl.maximum(a, 1.0).to(tl.int32, bitcast=True)
    binade = (one_or_more & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.fma(binade, -_E2M1_SNAP, tl.fma(binade, _E2M1_SNAP, a))


@triton.jit
def round_to_e2m1(scaled):
    """(magnitude code 0..7, sign) of values already multiplied by their block's reciprocal."""
    scaled = tl.minimum(tl.maximum(scaled, -_E2M1_MAX), _E2M1_MAX)
    q = round_to_e2m1_magnitude(tl.abs(scaled))
    # From 1 up, code 2 * (exponent + 1) + the top mantissa bit, i.e. the bits from 22 up less
    # 252; below, 0 and 0.5 are codes 0 and 1.
    code = tl.where(q >= 1.0, (q.to(tl.int32, bitcast=True) >> 22) - 252, (q * 2.0).to(tl.int32))
    # torchao keeps the sign bit of the scaled value, so -0.0 becomes code 0x8.
    return code, scaled.to(tl.int32, bitcast=True) < 0


@triton.jit
def round_to_e2m1_value(scaled):
    """The value of the code ``round_to_e2m1`` picks, as fp32 with the sign of ``scaled`` (-0.0
    kept), without the code: what the GEMM operand needs."""
    scaled = tl.minimum(tl.maximum(scaled, -_E2M1_MAX), _E2M1_MAX)
    q = round_to_e2m1_magnitude(tl.abs(scaled))
    sign = scaled.to(tl.uint32, bitcast=True) & 0x80000000
    return (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def pack_e2m1(magnitude, negative, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[ROWS, BLOCK_K]`` E2M1 (magnitude code, sign) pairs as packed bytes ``[ROWS, BLOCK_K / 2]``,
    element ``2i`` in the low nibble, as ``numerics.quantize_nvfp4`` packs them."""
    codes = tl.reshape(magnitude + negative.to(tl.int32) * 8, (ROWS, BLOCK_K // 2, 2))
    even, odd = tl.split(codes)
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def quantize_to_operand_halves(x, per_tensor_scale, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``q * s_b`` (fp32) of a raw activation tile ``[ROWS, BLOCK_K]`` (whole 16-blocks), as its
    even-K and its odd-K elements, ``[ROWS, BLOCK_K / 2]`` each: the GEMM operand's two halves,
    for a GEMM that quantizes its activation itself. Bit for bit the kernel below's values."""
    even, odd = tl.split(tl.reshape(x.to(tl.float32), (ROWS, BLOCK_K // 16, 8, 2)))
    block_amax = tl.maximum(tl.max(tl.abs(even), axis=2), tl.max(tl.abs(odd), axis=2))
    scale, scale_code, reciprocal = nvfp4_block_scale(block_amax, per_tensor_scale)
    even = round_to_e2m1_value(even * reciprocal[:, :, None]) * scale[:, :, None]
    odd = round_to_e2m1_value(odd * reciprocal[:, :, None]) * scale[:, :, None]
    return tl.reshape(even, (ROWS, BLOCK_K // 2)), tl.reshape(odd, (ROWS, BLOCK_K // 2))


@triton.jit
def in_mma_order(even, odd, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile's even-K and odd-K elements (``[ROWS, BLOCK_K / 2]`` each) as one ``[ROWS,
    BLOCK_K]`` tile in the MMA order (``gemm.dequantize_weight_tile_in_mma_order``'s)."""
    shape: tl.constexpr = (ROWS, BLOCK_K // 32, 4, 2, 2)  # (t, c, i)
    tile = tl.join(tl.reshape(even, shape), tl.reshape(odd, shape))
    return tl.reshape(tl.permute(tile, (0, 1, 3, 5, 2, 4)), (ROWS, BLOCK_K))


@triton.jit
def _activation_quantize_kernel(
    x_ptr,
    per_tensor_scale_ptr,
    qdata_ptr,
    scales_ptr,
    operand_ptr,
    M,
    K: tl.constexpr,
    stride_xm: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WRITE_PACKED: tl.constexpr,
    SCALES_GIVEN: tl.constexpr,
    MMA_ORDER: tl.constexpr,
    RELEASE_DEPENDENTS: tl.constexpr,
):
    if RELEASE_DEPENDENTS:
        # A kernel launched after this one to overlap it (the decode GEMM) may start now: it
        # streams its weight meanwhile and waits for this kernel's end before reading its output.
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    GROUPS: tl.constexpr = BLOCK_K // 16
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    # K is a multiple of 16, so a 16-block is either wholly inside the tensor or wholly masked.
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    blocks = tl.reshape(x.to(tl.float32), (BLOCK_M, GROUPS, 16))

    per_tensor_scale = tl.load(per_tensor_scale_ptr)
    group_cols = pid_k * GROUPS + tl.arange(0, GROUPS)
    scales_mask = (rows[:, None] < M) & (group_cols[None, :] < K // 16)
    scales_offsets = rows[:, None] * (K // 16) + group_cols[None, :]
    if SCALES_GIVEN:
        scale = e4m3_value(tl.load(scales_ptr + scales_offsets, mask=scales_mask, other=0))
        reciprocal = block_reciprocal(scale, per_tensor_scale)
    else:
        scale, scale_code, reciprocal = nvfp4_block_scale(tl.max(tl.abs(blocks), axis=2), per_tensor_scale)

    if WRITE_PACKED:
        magnitude, negative = round_to_e2m1(blocks * reciprocal[:, :, None])
        packed = pack_e2m1(magnitude, negative, BLOCK_M, BLOCK_K)
        half_cols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        tl.store(
            qdata_ptr + rows[:, None] * (K // 2) + half_cols[None, :],
            packed,
            mask=(rows[:, None] < M) & (half_cols[None, :] < K // 2),
        )
        if not SCALES_GIVEN:
            tl.store(scales_ptr + scales_offsets, scale_code, mask=scales_mask)
    else:
        q = round_to_e2m1_value(blocks * reciprocal[:, :, None]) * scale[:, :, None]
        if MMA_ORDER:
            # (t, c, i, h) of each 32-group to (c, h, t, i)
            ordered = tl.permute(tl.reshape(q, (BLOCK_M, GROUPS // 2, 4, 2, 2, 2)), (0, 1, 3, 5, 2, 4))
        else:
            ordered = tl.permute(tl.reshape(q, (BLOCK_M, GROUPS, 8, 2)), (0, 1, 3, 2))
        tl.store(
            operand_ptr + rows[:, None] * K + cols[None, :],
            tl.reshape(ordered, (BLOCK_M, BLOCK_K)).to(operand_ptr.dtype.element_ty),
            mask=mask,
        )


def _check_input(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> None:
    check_dtype(x, "the tensor to quantize")
    if x.dim() != 2 or x.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"nvfp4_static: the NVFP4 quantize kernel takes [M, K] with K a multiple of "
            f"{BLOCK_SIZE}; got shape {tuple(x.shape)} (flatten leading dims first)"
        )
    if per_tensor_scale.numel() != 1:
        raise ValueError(
            f"nvfp4_static: the quantize kernel's per_tensor_scale must be a scalar, got shape "
            f"{tuple(per_tensor_scale.shape)}"
        )


def launch_activation_quantize(
    x: torch.Tensor,
    per_tensor_scale: torch.Tensor,
    qdata: Optional[torch.Tensor],
    block_scales: Optional[torch.Tensor],
    gemm_operand: Optional[torch.Tensor],
    scales_given: bool = False,
    mma_order: bool = False,
) -> None:
    """Run the kernel into preallocated outputs: pass ``qdata`` + ``block_scales`` (packed form)
    or ``gemm_operand`` (fp16 or bf16 ``q * s_b``, block-deinterleaved, or with ``mma_order`` in
    the MMA order of 32-element groups), the other as None.

    With ``scales_given`` (packed form only), ``block_scales`` (FP8 ``[M, K/16]``) is an input:
    the kernel quantizes under those scales and writes only ``qdata``."""
    _check_input(x, per_tensor_scale)
    if scales_given and gemm_operand is not None:
        raise ValueError("nvfp4_static: given block scales apply to the packed form (qdata), not to the GEMM operand")
    if mma_order and (gemm_operand is None or x.shape[1] % MMA_GROUP):
        raise ValueError(
            f"nvfp4_static: the MMA order is a GEMM operand's, of whole {MMA_GROUP}-element groups; got "
            f"{'the packed form' if gemm_operand is None else f'K = {x.shape[1]}'}"
        )
    # K and the row stride reach the kernel as compile-time constants, known 16-byte aligned
    # even in a dynamic-shape graph (see kernels.gemm.launch_nvfp4_gemm).
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    write_packed = gemm_operand is None
    if scales_given:
        block_scales = block_scales.contiguous()
    grid = (ceil_div(M, BLOCK_ROWS), ceil_div(K, BLOCK_COLS))
    KernelCall(
        _activation_quantize_kernel,
        grid,
        (
            x,
            per_tensor_scale.to(torch.float32).reshape(1),
            qdata if write_packed else x,
            block_scales.view(torch.uint8) if write_packed else x,
            x if write_packed else gemm_operand,
            M,
            K,
            x.stride(0),
        ),
        dict(
            BLOCK_M=BLOCK_ROWS,
            BLOCK_K=BLOCK_COLS,
            WRITE_PACKED=write_packed,
            SCALES_GIVEN=scales_given,
            MMA_ORDER=mma_order,
            # Eager launches only: the instruction is inline assembly, which the mutation analysis
            # of a traced Triton kernel cannot read (it would take every input as written).
            RELEASE_DEPENDENTS=overlaps_kernels(x.device) and runs_eagerly(x),
            num_warps=NUM_WARPS,
        ),
    ).launch()
