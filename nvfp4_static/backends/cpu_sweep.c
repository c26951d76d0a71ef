/* The FP8 block-scale sweep on a CPU (references.fp8_scale_sweep), built with cpu_kernel.c.
 *
 * The torch reference runs 126 passes of whole-tensor ops over the weight, each writing
 * temporaries as large as a chunk of it. Here a tile of 16 rows of one 16-wide block column sits
 * in registers, one row per lane, and walks the candidates; every loop over the 16 lanes is one
 * vector operation where the compiler vectorizes it.
 *
 * It chooses exactly what the reference chooses: the same per-candidate factors (passed in), the
 * same quantize arithmetic, the same fixed tree of pairwise sums, and ties to the lowest
 * candidate. Built with -ffp-contract=off: a fused multiply-add would round once where torch
 * rounds twice. As in kernels/scale_sweep.py (the CUDA kernel), the plain sweep walks down from
 * the largest scale and stops once every lane is settled: a candidate that clips a block's
 * largest element by more than its best error so far is beaten by the best, and so is every
 * smaller one.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_float.h"

#define BLOCK 16
#define LANES 16
#define CANDIDATES 126

/* references._pairwise_sum of 16 terms in each lane (terms[j][lane]; overwritten): adjacent
 * pairs, then pairs of those. The terms before `first` are never read: the reference has zeros
 * there, and a pair whose left half is zeros sums to its right half (up to the sign of a zero,
 * which no comparison sees). */
static inline void pairwise_sums(float terms[BLOCK][LANES], int first, float *sums) {
    for (int level = 0; level < 4; level++)
        for (int i = 0; i < (BLOCK / 2) >> level; i++)
            for (int lane = 0; lane < LANES; lane++)
                terms[i][lane] = ((2 * i + 1) << level) <= first ? terms[2 * i + 1][lane]
                                                                 : terms[2 * i][lane] + terms[2 * i + 1][lane];
    memcpy(sums, terms[0], LANES * sizeof(float));
}

/* The 16 rows' steps |q| d at one candidate: q = e2m1(min(|w| * reciprocal, 6)). */
static inline void quantization_steps(float w_abs[BLOCK][LANES], float reciprocal, float dequant_scale,
                                      float steps[BLOCK][LANES]) {
    for (int j = 0; j < BLOCK; j++)
        for (int lane = 0; lane < LANES; lane++) {
            float scaled = w_abs[j][lane] * reciprocal;
            steps[j][lane] = round_to_e2m1_magnitude(scaled < 6.0f ? scaled : 6.0f) * dequant_scale;
        }
}

/* Each lane's plain error sum (|w| - |q| d)^2 (the error of -w is that of w). */
static void plain_errors(float w_abs[BLOCK][LANES], float reciprocal, float dequant_scale, float *errors) {
    float steps[BLOCK][LANES];
    quantization_steps(w_abs, reciprocal, dequant_scale, steps);
    for (int j = 0; j < BLOCK; j++)
        for (int lane = 0; lane < LANES; lane++) {
            float dw = w_abs[j][lane] - steps[j][lane];
            steps[j][lane] = dw * dw;
        }
    pairwise_sums(steps, 0, errors);
}

/* Each lane's weighted error dw^T U dw, U the block column's upper-triangular Hessian (zeros
 * below the diagonal, which the sums skip). */
static void hessian_errors(float w[BLOCK][LANES], float w_abs[BLOCK][LANES], const float *upper, float reciprocal,
                           float dequant_scale, float *errors) {
    float dw[BLOCK][LANES], weighted[BLOCK][LANES], products[BLOCK][LANES];
    quantization_steps(w_abs, reciprocal, dequant_scale, dw);
    for (int j = 0; j < BLOCK; j++)
        for (int lane = 0; lane < LANES; lane++) /* q d carries w's sign */
            dw[j][lane] = w[j][lane] - copysignf(dw[j][lane], w[j][lane]);
    for (int i = 0; i < BLOCK; i++) {
        for (int j = i; j < BLOCK; j++)
            for (int lane = 0; lane < LANES; lane++)
                products[j][lane] = upper[BLOCK * i + j] * dw[j][lane];
        pairwise_sums(products, i, weighted[i]);
        for (int lane = 0; lane < LANES; lane++)
            weighted[i][lane] = dw[i][lane] * weighted[i][lane];
    }
    pairwise_sums(weighted, 0, errors);
}

/* One tile: block column `block` of rows first..first+rows-1 (rows <= LANES). */
static void sweep_tile(const void *weight, int weight_is_bf16, int64_t row_stride, int64_t first, int rows,
                       int64_t block, int64_t blocks, const float *reciprocals, const float *dequant_scales,
                       const float *upper, uint8_t *codes) {
    float w[BLOCK][LANES], w_abs[BLOCK][LANES], block_amax[LANES];
    for (int lane = 0; lane < LANES; lane++)
        block_amax[lane] = 0.0f;
    for (int j = 0; j < BLOCK; j++)
        for (int lane = 0; lane < LANES; lane++) {
            float value = 0.0f;
            if (lane < rows) {
                int64_t at = (first + lane) * row_stride + block * BLOCK + j;
                value = weight_is_bf16 ? from_bits((uint32_t)((const uint16_t *)weight)[at] << 16)
                                       : ((const float *)weight)[at];
            }
            w[j][lane] = value;
            w_abs[j][lane] = fabsf(value);
            if (w_abs[j][lane] > block_amax[lane])
                block_amax[lane] = w_abs[j][lane];
        }
    float best_error[LANES], errors[LANES];
    int best[LANES];
    for (int lane = 0; lane < LANES; lane++) {
        best_error[lane] = INFINITY;
        best[lane] = -1;
    }
    for (int candidate = CANDIDATES - 1; candidate >= 0; candidate--) {
        float reciprocal = reciprocals[candidate], dequant_scale = dequant_scales[candidate];
        if (upper)
            hessian_errors(w, w_abs, upper + block * BLOCK * BLOCK, reciprocal, dequant_scale, errors);
        else
            plain_errors(w_abs, reciprocal, dequant_scale, errors);
        int unsettled = 0;
        for (int lane = 0; lane < LANES; lane++) {
            /* scanning down, "<=" keeps the lowest of equal errors; an error never finite leaves
             * -1, scale 0, as the reference's strict "<" from +inf does */
            if (errors[lane] <= best_error[lane] && errors[lane] < INFINITY) {
                best_error[lane] = errors[lane];
                best[lane] = candidate;
            }
            /* the largest element's error at this scale (q = 6 once amax * reciprocal > 5) */
            float clip = block_amax[lane] - 6.0f * dequant_scale;
            int settled = block_amax[lane] * reciprocal > 5.0f && clip > 0.0f && clip * clip > best_error[lane];
            unsettled += lane < rows && block_amax[lane] != 0.0f && !settled;
        }
        if (!upper && unsettled == 0)
            break;
    }
    for (int lane = 0; lane < rows; lane++) {
        /* zeros quantize exactly at every scale: a tie, the lowest candidate wins */
        int chosen = !upper && block_amax[lane] == 0.0f ? 0 : best[lane];
        codes[(first + lane) * blocks + block] = (uint8_t)(chosen + 1); /* candidate i is E4M3 code i + 1 */
    }
}

/* codes[rows, k / 16]: the E4M3 code of each block's best candidate (0 where no error was
 * finite) for weight[rows, k] (float32, or bfloat16 where weight_is_bf16; rows row_stride
 * elements apart), the candidates' factors reciprocals[126] and dequant_scales[126]
 * (references.sweep_candidate_factors), and upper: NULL, or [k / 16][16][16] float32 upper-
 * triangular Hessians (references.upper_triangular_hessian) for the weighted error. */
void nvfp4_fp8_scale_sweep(const void *weight, int weight_is_bf16, int64_t rows, int64_t k, int64_t row_stride,
                           const float *reciprocals, const float *dequant_scales, const float *upper,
                           uint8_t *codes) {
    int64_t blocks = k / BLOCK;
    for (int64_t first = 0; first < rows; first += LANES) {
        int tile_rows = rows - first < LANES ? (int)(rows - first) : LANES;
        for (int64_t block = 0; block < blocks; block++)
            sweep_tile(weight, weight_is_bf16, row_stride, first, tile_rows, block, blocks, reciprocals,
                       dequant_scales, upper, codes);
    }
}
