/* A weight's NVFP4 quantize on a CPU (numerics.quantize_nvfp4), built with cpu_kernel.c.
 *
 * The torch reference rounds through torchao's f32_to_f4_unpacked, a chain of whole-tensor
 * comparisons and selects each writing a temporary as large as the weight: at convert it took
 * longer than the weight's scale sweep. Here each 16-block is scaled, rounded, coded and packed
 * in one pass, with the reference's float32 operations in its order, so the codes and block
 * scales are the reference's bit for bit. Built with -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_float.h"

#define BLOCK 16

/* The 4-bit E2M1 code of v, a scaled element clamped to [-6, 6] (not NaN): the magnitude rounded
 * onto the grid (ties to even) as an index 0-7, the sign (of -0.0 too) as bit 3. Branch-free, so
 * that a loop over a block vectorizes. */
static inline uint8_t e2m1_code(float v) {
    uint32_t sign = (to_bits(v) >> 31) << 3;
    float q = round_to_e2m1_magnitude(fabsf(v));
    float index = q < 2.0f ? q * 2.0f : (q < 4.0f ? q + 2.0f : q * 0.5f + 4.0f);
    return (uint8_t)(sign | (uint32_t)index);
}

/* The FP8 E4M3 code of a scale already on its grid and normal (block_scale_of's values). */
static inline uint8_t e4m3_code(float scale) {
    uint32_t bits = to_bits(scale);
    return (uint8_t)(((((bits >> 23) & 0xFFu) - 120u) << 3) | ((bits >> 20) & 7u));
}

/* Quantize rows w[rows, k] (row stride `stride` elements; float32, or bfloat16 when w_is_bf16)
 * under the global scale *per_tensor_scale into packed codes[rows, k / 2] (element 2i in the low
 * nibble). With given_scales (float32 [rows, k / 16]) the blocks take those scales; else each
 * block's scale comes from its largest magnitude and its E4M3 code goes to scale_codes[rows, k / 16].
 * Returns how many elements were not finite or scaled to NaN (0 times an infinite reciprocal, or a
 * NaN block scale given); the caller runs the reference where any were: torchao's code for a NaN
 * depends on its bits, which this does not reproduce. */
int64_t nvfp4_quantize_weight(const void *w, int w_is_bf16, int64_t rows, int64_t k, int64_t stride,
                              const float *per_tensor_scale, const float *given_scales, uint8_t *scale_codes,
                              uint8_t *codes) {
    float global_scale = *per_tensor_scale;
    float one_over_global = 1.0f / global_scale;
    int64_t not_coded = 0;
    float block[BLOCK];
    for (int64_t row = 0; row < rows; row++) {
        for (int64_t b = 0; b < k / BLOCK; b++) {
            int64_t first = row * stride + b * BLOCK;
            if (w_is_bf16) {
                const uint16_t *bf16 = (const uint16_t *)w + first;
                for (int j = 0; j < BLOCK; j++)
                    block[j] = from_bits((uint32_t)bf16[j] << 16);
            } else {
                memcpy(block, (const float *)w + first, sizeof block);
            }
            float scale;
            if (given_scales != NULL) {
                scale = given_scales[row * (k / BLOCK) + b];
            } else {
                float amax = 0.0f;
                for (int j = 0; j < BLOCK; j++) {
                    float magnitude = fabsf(block[j]);
                    amax = magnitude > amax ? magnitude : amax;
                }
                scale = block_scale_of(amax, global_scale);
                scale_codes[row * (k / BLOCK) + b] = e4m3_code(scale);
            }
            float reciprocal = one_over_global / scale;
            uint8_t code[BLOCK];
            int32_t block_not_coded = 0;
            for (int j = 0; j < BLOCK; j++) {
                float v = block[j] * reciprocal;
                /* counted: an element that is not finite (x - x is NaN for Inf and NaN) or a
                 * product that is NaN (0 times an infinite reciprocal) */
                block_not_coded += (block[j] - block[j] != 0.0f) | (v != v);
                v = v < -6.0f ? -6.0f : (v > 6.0f ? 6.0f : v);
                code[j] = e2m1_code(v == v ? v : 0.0f);
            }
            not_coded += block_not_coded;
            uint8_t *packed = codes + row * (k / 2) + b * (BLOCK / 2);
            for (int j = 0; j < BLOCK / 2; j++)
                packed[j] = (uint8_t)(code[2 * j] | (code[2 * j + 1] << 4));
        }
    }
    return not_coded;
}
