"""NVFP4 numerics in plain torch: the contract every backend (CPU, Triton, Blackwell) meets.

NVFP4 stores FP4 E2M1 codes in blocks of 16 along the last dim, one FP8 E4M3 scale per block,
and one FP32 scale per tensor. The per-tensor scale follows torchao's convention,
``per_tensor_scale = amax / (448 * 6)``, so that a block holding the tensor's amax gets the
largest FP8 scale, 448.

With a given per-tensor scale the arithmetic below is exactly torchao's ``nvfp4_quantize``
(fp32 math, reciprocal multiply, block scales clamped to FP8's smallest normal); packing and the
E2M1 cast are torchao's own helpers, so the two agree bit for bit.
"""

import math
from typing import Optional

import torch
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4
from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

__all__ = [
    "AMAX_ROUNDING",
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_NORMAL",
    "E4M3_DYNAMIC_RANGE",
    "e4m3_positive_values",
    "fp8_scale_candidates",
    "per_tensor_amax_to_scale",
    "scale_reciprocal_overflows",
    "pad_to_block_multiple",
    "non_finite_summary",
    "largest_at_most",
    "block_amax",
    "round_to_e2m1",
    "e2m1_values_by_code",
    "e4m3_values_by_code",
    "e2m1_byte_words",
    "e2m1_values_by_byte",
    "compute_block_scales",
    "pack_e2m1",
    "quantize_nvfp4",
    "quantize_nvfp4_unpacked",
    "dequantize_nvfp4",
    "times_block_scales",
    "fake_quantize_nvfp4",
    "unit_scale_factor",
]

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
# Ratio of the largest to the smallest normal FP8 E4M3 value: the span of block amaxes one
# per-tensor scale can hold without pushing block scales into subnormals.
E4M3_DYNAMIC_RANGE = E4M3_MAX / E4M3_MIN_NORMAL  # 28672

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The largest global scale convert makes: float32's largest amax over 6 x 448, with room for
# the division's rounding. A checkpoint's larger scale was not made by convert.
LARGEST_GLOBAL_SCALE = torch.finfo(torch.float32).max / (E2M1_MAX * E4M3_MAX) * (1 + 2.0**-20)

# How far a weight's max |w| may exceed the global amax it is quantized under: the float32
# rounding of a weight dequantized under that amax (GPTQ's), whose largest values reach it.
AMAX_ROUNDING = 2.0**-16


def e4m3_positive_values() -> torch.Tensor:
    """The 126 positive finite FP8 E4M3 (fn) values in increasing order, as float32.

    Codes 0x01..0x7E; 0x7F is NaN. The first seven are subnormal.
    """
    codes = torch.arange(1, 127, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def fp8_scale_candidates() -> torch.Tensor:
    """The weight-scale sweep candidates: each FP8 value / 448, i.e. block amax / global amax."""
    return e4m3_positive_values() / E4M3_MAX


def e2m1_values_by_code(device: torch.device) -> torch.Tensor:
    """The float32 value of each 4-bit E2M1 code (bit 3 is the sign; code 8 is -0.0).

    Decoding packed codes by lookup in this table takes a third of the time of decoding their
    bit fields. Built on ``device`` from ``arange`` (no host-to-device copy), so it is safe
    inside CUDA-graph capture and under ``torch.compile``.
    """
    magnitude_code = torch.arange(8, device=device)
    exponent, mantissa = magnitude_code >> 1, magnitude_code & 1
    normal = torch.exp2((exponent - 1).float()) * (1.0 + 0.5 * mantissa)
    magnitudes = torch.where(exponent == 0, 0.5 * mantissa, normal)
    return torch.cat((magnitudes, -magnitudes))


def e4m3_values_by_code(device: torch.device) -> torch.Tensor:
    """The float32 value of each FP8 E4M3 (fn) code, indexed by the code's byte (0x7F and 0xFF
    are NaN). On a CPU, looking block scales up in this table takes about a third of the time of
    torch's conversion of the FP8 tensor (0.066 against 0.19 ms for 32768 scales on 2 cores)."""
    return torch.arange(256, device=device).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_byte_words(device: torch.device) -> torch.Tensor:
    """For each of the 256 values of a packed byte, its two E2M1 values (the low nibble's
    first) as bfloat16, which holds every E2M1 value exactly, stored together as one int32 word.
    Built on ``device`` from ``e2m1_values_by_code``'s table."""
    values = e2m1_values_by_code(device)
    byte = torch.arange(256, device=device)
    pairs = torch.stack((values[byte & 0xF], values[byte >> 4]), dim=-1).to(torch.bfloat16)
    return pairs.view(torch.int32).reshape(256)


def e2m1_values_by_byte(qdata: torch.Tensor, byte_words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The E2M1 values of packed codes ``qdata [..., K // 2]`` (uint8, the low nibble first),
    ``[..., K]`` in bfloat16, looked up a byte at a time in ``byte_words`` (by default
    ``e2m1_byte_words``, built anew; a caller decoding many pieces builds it once).

    One 4-byte word gathered per byte writes 8 bytes per byte (its index, its values), where
    splitting the nibbles and gathering each from ``e2m1_values_by_code`` writes 20.
    """
    if byte_words is None:
        byte_words = e2m1_byte_words(qdata.device)
    decoded = byte_words.index_select(0, qdata.reshape(-1).to(torch.int32)).view(torch.bfloat16)
    return decoded.reshape(*qdata.shape[:-1], 2 * qdata.shape[-1])


def check_dtype(x: torch.Tensor, what: str = "input") -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"nvfp4_static: {what} has dtype {x.dtype}; supported dtypes are "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )


def largest_at_most(limit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest ``dtype`` value at most each of ``limit``'s: for values ``x`` of ``dtype``,
    ``x > largest_at_most(limit, dtype)`` exactly where ``x > limit``, which a comparison with
    ``limit`` rounded to the nearest ``dtype`` value is not (rounded up, it misses the values
    between)."""
    rounded = limit.to(dtype)
    below = torch.nextafter(rounded, torch.full_like(rounded, -torch.inf))
    return torch.where(rounded.to(limit.dtype) > limit, below, rounded)


def non_finite_summary(x: torch.Tensor) -> str:
    """``"N NaN and M Inf values (first at index (i, j))"`` for an ``x`` that holds some."""
    first = tuple(torch.nonzero(~torch.isfinite(x))[0].tolist())
    return f"{int(torch.isnan(x).sum())} NaN and {int(torch.isinf(x).sum())} Inf values (first at index {first})"


def pad_to_block_multiple(x: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Zero-pad the last dim up to a multiple of ``block_size``.

    Used for statistics only: padding with zeros cannot change any block's amax.
    """
    remainder = x.shape[-1] % block_size
    if remainder == 0:
        return x
    return torch.nn.functional.pad(x, (0, block_size - remainder))


def block_amax(x: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Per-block absolute max along the last dim, in float32, shape ``(..., ceil(K / 16))``."""
    x = pad_to_block_multiple(x, block_size)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    return blocks.abs().amax(dim=-1).to(torch.float32)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values already clamped to [-6, 6] onto the E2M1 grid, ties to even.

    Equals torchao's ``f4_unpacked_to_f32(f32_to_f4_unpacked(x))`` (tested exhaustively around
    every midpoint) but stays in float arithmetic, which the sweep and the kernels need. The
    grid's spacing is 1/2 below 2, 1 in [2, 4) and 2 from 4: scaling by its inverse (a power of
    two, so exact) turns each stretch into ``torch.round``'s integer ties-to-even, which sends
    0.25, 1.25, 2.5 and 5 down and 0.75, 1.75 and 3.5 up, as E2M1's even codes want. Four passes
    over the data instead of a chain of comparisons (the CPU weight sweep runs this 126 times
    per weight). The sign rides along, -0.0 included. NaN becomes 1.5 with NaN's sign, as
    torchao's cast does on x86 (on CUDA it gives 2.0: the NaN's bits decide); a quantize makes
    NaN only under a global scale that ``scale_reciprocal_overflows``, which the tensor refuses.
    """
    magnitude = x.abs()
    steps_per_unit = torch.where(magnitude < 2.0, 2.0, torch.where(magnitude < 4.0, 1.0, 0.5))
    q = torch.round(x * steps_per_unit) / steps_per_unit
    # q already carries x's sign; this only gives it back to the NaN made 1.5.
    return torch.copysign(torch.nan_to_num(q, nan=1.5, posinf=math.inf, neginf=-math.inf), x)


def unit_scale_factor(magnitude: float, slack: int = 32) -> float:
    """A power of two that takes ``magnitude`` (a weight's global amax) into [0.5, 1), or 1.0
    where it lies within ``2^slack`` of that range. The weight searches (the FP8 sweep, GPTQ) sum
    squared errors in float32, which underflow below a max |w| of about 1e-19 and overflow above
    about 1e18; the weight and its global amax scaled by this factor give every candidate the
    same error times one power of two, so the same choice, exactly, with no under- or overflow."""
    exponent = math.frexp(magnitude)[1]
    return 1.0 if abs(exponent) <= slack else math.ldexp(1.0, -exponent)


def scale_reciprocal_overflows(per_tensor_scale: torch.Tensor, block_scale: float = E4M3_MIN_NORMAL) -> bool:
    """Whether torchao's ``(1 / per_tensor_scale) / block_scale`` is infinite in float32.

    With the smallest block scale a quantize uses (2^-6 after the clamp; a sweep candidate can
    be 2^-9), an infinite reciprocal turns a zero element into ``0 * inf = NaN``, which
    torchao's cast maps to a code that depends on the device's NaN (1.5 on x86, 2.0 on CUDA),
    so no two backends could agree. It happens for a global amax below about 5e-34 (4e-33 in the
    sweep). Answered on the host: float32 division is correctly rounded on every device.
    """
    per_tensor_scale = torch.as_tensor(per_tensor_scale, dtype=torch.float32).cpu()
    return not bool(torch.isfinite((1.0 / per_tensor_scale) / block_scale).all())


def is_usable_act_per_tensor_scale(per_tensor_scale: torch.Tensor) -> bool:
    """Whether a static activation per-tensor scale can quantize: finite, positive and large
    enough that its block-scale reciprocals stay finite (``scale_reciprocal_overflows``).
    Convert refuses a calibrated amax that fails this, and a checkpoint holding one."""
    per_tensor_scale = torch.as_tensor(per_tensor_scale, dtype=torch.float32).cpu()
    positive = bool(torch.isfinite(per_tensor_scale).all()) and bool((per_tensor_scale > 0).all())
    return positive and not scale_reciprocal_overflows(per_tensor_scale)


def compute_block_scales(
    x: torch.Tensor, per_tensor_scale: torch.Tensor, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Max-based FP8 E4M3 block scales under a given per-tensor scale, as torchao computes them.

    ``s_b = fp8(clamp(block_amax / 6 / per_tensor_scale, 2^-6, 448))``. The lower clamp keeps
    block scales out of FP8 subnormals (an all-zero block gets 2^-6), exactly as torchao does.

    Both divisions are correctly rounded on every device, as the kernels' are: torch on CUDA
    divides a tensor by a Python number (or a CPU scalar tensor) as a multiply by its
    reciprocal, which misses the quotient by one bit in about a third of float32 values, and in
    about one block of a few million that bit moves the block's FP8 scale by a step. So the
    divisors are tensors on the amaxes' device. (torchao's own quantize divides by the Python
    number: on CUDA its scales can differ from these in such a block.)
    """
    amax = block_amax(x, block_size)
    six = torch.full((), E2M1_MAX, dtype=torch.float32, device=amax.device)
    scaled = (amax / six) / per_tensor_scale.to(device=amax.device)
    return scaled.clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)


def _scaled_blocks(
    x: torch.Tensor, per_tensor_scale: torch.Tensor, block_scales_e4m3: torch.Tensor
) -> torch.Tensor:
    """``x / (s_b * per_tensor_scale)`` as torchao computes it, clamped to [-6, 6], float32."""
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], -1, BLOCK_SIZE)
    reciprocal = (1.0 / per_tensor_scale) / block_scales_e4m3.to(torch.float32)
    scaled = blocks * reciprocal.unsqueeze(-1)
    return scaled.clamp(-E2M1_MAX, E2M1_MAX).reshape(x.shape)


def _check_quantizable(x: torch.Tensor) -> None:
    check_dtype(x)
    if x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"nvfp4_static: last dim {x.shape[-1]} of shape {tuple(x.shape)} is not a multiple of "
            f"the NVFP4 block size {BLOCK_SIZE}"
        )


def quantize_nvfp4(
    x: torch.Tensor,
    per_tensor_scale: torch.Tensor,
    block_scales_e4m3: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4 with a static per-tensor scale.

    Args:
        x: float32 / bfloat16 / float16 tensor whose last dim is a multiple of 16.
        per_tensor_scale: float32 scalar tensor, ``amax / (448 * 6)``.
        block_scales_e4m3: optional FP8 block scales of shape ``(..., K // 16)`` (e.g. from the
            MSE sweep); when None they are computed from block maxes (``compute_block_scales``).

    Returns:
        ``(qdata, block_scales_e4m3)``: packed E2M1 codes, uint8 of shape ``(..., K // 2)``
        (element ``2i`` in the low nibble), and the FP8 block scales.
    """
    _check_quantizable(x)
    per_tensor_scale = per_tensor_scale.to(torch.float32)
    if block_scales_e4m3 is None:
        block_scales_e4m3 = compute_block_scales(x, per_tensor_scale)
    scaled = _scaled_blocks(x, per_tensor_scale, block_scales_e4m3)
    return pack_e2m1(scaled), block_scales_e4m3


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Float32 ``values [..., K]`` in [-6, 6] rounded onto the E2M1 grid (to nearest, ties to
    even: torchao's ``f32_to_f4_unpacked``) and packed, uint8 ``[..., K // 2]`` (element ``2i``
    in the low nibble)."""
    return pack_uint4(f32_to_f4_unpacked(values.contiguous()))


def dequantize_nvfp4(
    qdata: torch.Tensor,
    block_scales_e4m3: torch.Tensor,
    per_tensor_scale: Optional[torch.Tensor] = None,
    output_dtype: torch.dtype = torch.float32,
    byte_words: Optional[torch.Tensor] = None,
    scale_values: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Inverse of ``quantize_nvfp4``: ``q * (per_tensor_scale * s_b)``, computed in float32.

    With ``per_tensor_scale=None`` the result is ``q * s_b``, which is exact in bfloat16; the
    faithful GEMM multiplies the global scales in afterwards. For a caller dequantizing many
    pieces, the lookup tables built once: ``byte_words`` (``e2m1_byte_words``) for the packed
    codes, and ``scale_values`` (``e4m3_values_by_code``) to decode the block scales by lookup
    rather than by conversion.
    """
    values = e2m1_values_by_byte(qdata, byte_words)
    if scale_values is None:
        scales = block_scales_e4m3.to(torch.float32)
    else:
        codes = block_scales_e4m3.view(torch.uint8)
        scales = scale_values.index_select(0, codes.reshape(-1).to(torch.int32)).reshape(codes.shape)
    if per_tensor_scale is not None:
        scales = per_tensor_scale.to(torch.float32) * scales
    return times_block_scales(values, scales).to(output_dtype)


def times_block_scales(values: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """``values [..., K]`` with each 16-block multiplied by its scale ``[..., K // 16]``, in
    float32: the one step every dequantization shares."""
    blocks = values.reshape(*block_scales.shape, BLOCK_SIZE) * block_scales.to(torch.float32).unsqueeze(-1)
    return blocks.reshape(values.shape)


def quantize_nvfp4_unpacked(
    x: torch.Tensor,
    per_tensor_scale: torch.Tensor,
    block_scales_e4m3: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_nvfp4`` without the packing: the E2M1 values ``q`` as float32 (shape of ``x``,
    the sign of -0.0 kept) and the FP8 block scales. Dequantizing the packed pair gives exactly
    these ``q``; skipping the codes saves most of the work where the values are used at once."""
    _check_quantizable(x)
    per_tensor_scale = per_tensor_scale.to(torch.float32)
    if block_scales_e4m3 is None:
        block_scales_e4m3 = compute_block_scales(x, per_tensor_scale)
    return round_to_e2m1(_scaled_blocks(x, per_tensor_scale, block_scales_e4m3)), block_scales_e4m3


def fake_quantize_nvfp4(
    x: torch.Tensor,
    per_tensor_scale: torch.Tensor,
    block_scales_e4m3: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Quantize then dequantize, in ``x``'s dtype, without packing (same values as the pair)."""
    q, block_scales_e4m3 = quantize_nvfp4_unpacked(x, per_tensor_scale, block_scales_e4m3)
    scales = per_tensor_scale.to(torch.float32) * block_scales_e4m3.to(torch.float32)
    return times_block_scales(q, scales).to(x.dtype)
