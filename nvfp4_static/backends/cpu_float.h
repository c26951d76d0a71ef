/* Float32 helpers the CPU kernels share (cpu_kernel.c, cpu_sweep.c, cpu_gptq.c): a float's bits
 * and back, and the rounding onto the E2M1 grid that the sweep and GPTQ run. */
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

#endif
