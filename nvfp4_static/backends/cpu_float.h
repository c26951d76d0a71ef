/* Float32 helpers the CPU kernels share (cpu_kernel.c, cpu_sweep.c, cpu_gptq.c, cpu_quantize.c): a
 * float's bits and back, the rounding onto the E2M1 grid, and a block's FP8 scale. */
#ifndef NVFP4_STATIC_CPU_FLOAT_H
#define NVFP4_STATIC_CPU_FLOAT_H

#include <stdint.h>
#include <string.h>

static inline float from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t to_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* 1.5 * 2^22: added to a value of [0, 2) and subtracted again, it rounds it to a multiple of 1/2,
 * ties to even; times 2 or 4, to a multiple of 1 or 2 in [2, 4) and [4, 8). */
#define E2M1_SNAP 6291456.0f

/* a in [0, 6] rounded onto the E2M1 grid, ties to even (numerics.round_to_e2m1 of |a|): the
 * snap constant scaled by a's binade (1 below 2) makes the grid step one ulp of the sum. */
static inline float round_to_e2m1_magnitude(float a) {
    float binade = from_bits(to_bits(a < 1.0f ? 1.0f : a) & 0x7F800000u);
    float snap = binade * E2M1_SNAP;
    return (a + snap) - snap;
}

/* The FP8 E4M3 value nearest to v in [2^-6, 448] (all normal there), ties to even: float32's
 * 23 mantissa bits rounded to 3. */
static inline float round_to_e4m3(float v) {
    uint32_t bits = to_bits(v);
    bits += 0x7FFFFu + ((bits >> 20) & 1u);
    return from_bits(bits & 0xFFF00000u);
}

/* A block's FP8 scale from its largest magnitude, as numerics.compute_block_scales computes it:
 * (amax / 6) / global_scale, clamped to [2^-6, 448], rounded to E4M3. */
static inline float block_scale_of(float amax, float global_scale) {
    float scale = (amax / 6.0f) / global_scale;
    if (scale < 0.015625f)
        scale = 0.015625f;
    if (scale > 448.0f)
        scale = 448.0f;
    return round_to_e4m3(scale);
}

#endif
