/* A float32's bits and back, shared by the CPU kernels (cpu_kernel.c, cpu_sweep.c). */
#ifndef NVFP4_STATIC_CPU_BITS_H
#define NVFP4_STATIC_CPU_BITS_H

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

#endif
