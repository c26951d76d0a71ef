"""PTX that dequantizes four packed E2M1 bytes to fp16, for the GEMM kernels' inline assembly.

An E2M1 code (sign, e1, e0, m) moved into an FP8 E4M3 byte as (sign, 0, 0, e1, e0, m, 0, 0) is
the same number times 2^-6, subnormals included, and the hardware FP8 -> fp16 conversion
(``cvt.rn.f16x2.e4m3x2``, sm_89 on) does the rest; the caller multiplies the 2^6 back in with the
block scale. The input register holds four packed bytes b0..b3; output registers 0-1 hold the
low-nibble values of b0..b3, registers 2-3 the high-nibble ones. Within each byte, the low
nibble's bits 0-2 move up to bits 2-4 and its sign (bit 3) to bit 7; the high nibble's bits 4-6
move down to bits 2-4, its sign already at bit 7 (the masks drop what a shift carries in from
the next byte).
"""

# One line: torch.compile copies a kernel's globals into generated source, where a literal
# newline inside the string would not survive.
E2M1_BYTES_TO_FP16_PTX = " ".join(
    [
        "{ .reg .b32 r_lo, r_hi, r_sign; .reg .b16 l0, l1, h0, h1;",
        "shl.b32 r_lo, $4, 2; and.b32 r_lo, r_lo, 0x1C1C1C1C;",
        "shl.b32 r_sign, $4, 4; and.b32 r_sign, r_sign, 0x80808080; or.b32 r_lo, r_lo, r_sign;",
        "shr.u32 r_hi, $4, 2; and.b32 r_hi, r_hi, 0x1C1C1C1C;",
        "and.b32 r_sign, $4, 0x80808080; or.b32 r_hi, r_hi, r_sign;",
        "mov.b32 {l0, l1}, r_lo; mov.b32 {h0, h1}, r_hi;",
        "cvt.rn.f16x2.e4m3x2 $0, l0; cvt.rn.f16x2.e4m3x2 $1, l1;",
        "cvt.rn.f16x2.e4m3x2 $2, h0; cvt.rn.f16x2.e4m3x2 $3, h1; }",
    ]
)
