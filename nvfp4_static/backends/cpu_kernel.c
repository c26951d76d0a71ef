/* The static NVFP4 linear on a CPU, built by cpu_kernel.py at first use.
 *
 * Torch ops dequantize the weight into float32 and multiply it: at one token that writes and
 * reads back four bytes per weight where the packed weight holds half a byte. Here each
 * 16-weight block is decoded once, into integers, and multiplied against every row's block.
 *
 * The activation is quantized exactly as numerics.quantize_nvfp4_unpacked quantizes it (the same
 * float32 operations in the same order), into twice its E2M1 values, integers in [-12, 12], and
 * its FP8 block scales. A block's product, sum over 16 of (2 q_x)(2 q_w) times s_x s_w / 4, is
 * then exact in float32: the integer sum needs 12 bits, s_x s_w at most 8, and no step leaves
 * float32's normal range. So the only rounding of the product is the float32 sum of the blocks,
 * in K order, before both global scales and the bias are applied as backends/cpu.py applies them.
 *
 * With AVX2 (x86) one row goes four blocks per step through vector instructions, two features at
 * a time (rows_one_by_one), and more rows go
 * as the lanes of vectors (rows_in_lanes; VNNI's byte dot products where the CPU has them), any
 * number of rows. Elsewhere plain C does the same integer arithmetic, for up to 16
 * rows. Large calls split their outputs across threads.
 *
 * Built without -ffast-math and with -ffp-contract=off: every operation rounds as torch's does.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_float.h"

#define BLOCK 16

/* Twice the E2M1 value of each 4-bit code: the sign is the high bit. */
static const int8_t TWICE_E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* One block of 16 activations: twice their E2M1 values into q2, its FP8 block scale returned
 * (NaN where the block holds a NaN, which then reaches every output of its row, as in torch). */
static float quantize_block(const float *x, float global_scale, float one_over_global, int8_t *q2) {
    float amax = 0.0f;
    int has_nan = 0;
    for (int j = 0; j < BLOCK; j++) {
        float magnitude = fabsf(x[j]);
        if (magnitude != magnitude)
            has_nan = 1;
        else if (magnitude > amax)
            amax = magnitude;
    }
    if (has_nan) {
        memset(q2, 0, BLOCK);
        return NAN;
    }
    float scale = block_scale_of(amax, global_scale);
    float reciprocal = one_over_global / scale;
    for (int j = 0; j < BLOCK; j++) {
        float v = x[j] * reciprocal;
        if (v < -6.0f)
            v = -6.0f;
        if (v > 6.0f)
            v = 6.0f;
        float magnitude = fabsf(v);
        if (v != v) { /* a global scale of 0 or infinity makes NaN: 1.5 with its sign, as in torch */
            q2[j] = signbit(v) ? -3 : 3;
            continue;
        }
        /* The grid's spacing is 1/2 below 2, 1 below 4, 2 up to 6: scaled by its inverse, a
         * power of two, each stretch rounds to integers, ties to even. */
        if (magnitude < 2.0f)
            q2[j] = (int8_t)rintf(v * 2.0f);
        else if (magnitude < 4.0f)
            q2[j] = (int8_t)(2.0f * rintf(v));
        else
            q2[j] = (int8_t)(4.0f * rintf(v * 0.5f));
    }
    return scale;
}

/* Quantize rows x[rows, k] (float32, or bfloat16 when x_is_bf16) under their global scale
 * *act_scale: twice the E2M1 values into q2[rows, k], the block scales into scales[rows, k / 16]. */
void nvfp4_quantize_rows(const void *x, int x_is_bf16, int64_t rows, int64_t k, const float *act_scale,
                         int8_t *q2, float *scales) {
    float global_scale = *act_scale;
    float one_over_global = 1.0f / global_scale;
    float block[BLOCK];
    for (int64_t row = 0; row < rows; row++) {
        for (int64_t b = 0; b < k / BLOCK; b++) {
            int64_t first = row * k + b * BLOCK;
            if (x_is_bf16) {
                const uint16_t *bf16 = (const uint16_t *)x + first;
                for (int j = 0; j < BLOCK; j++)
                    block[j] = from_bits((uint32_t)bf16[j] << 16);
            } else {
                memcpy(block, (const float *)x + first, sizeof block);
            }
            scales[row * (k / BLOCK) + b] = quantize_block(block, global_scale, one_over_global, q2 + first);
        }
    }
}

/* float32 to bfloat16, to nearest, ties to even; NaN to torch's NaN. */
static uint16_t to_bf16(float value) {
    uint32_t bits = to_bits(value);
    if (value != value)
        return 0x7FC0u;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* The integer sum over one block of (2 q_x)(2 q_w), the weight's block packed in 8 bytes. */
static int32_t block_sum(const int8_t *x, const uint8_t *packed) {
    int32_t sum = 0;
    for (int j = 0; j < BLOCK / 2; j++)
        sum += x[2 * j] * TWICE_E2M1[packed[j] & 0xF] + x[2 * j + 1] * TWICE_E2M1[packed[j] >> 4];
    return sum;
}

/* Rows the one-row-at-a-time product takes at once. */
#define ROWS_ONE_BY_ONE 16

#if defined(__AVX2__)
#include <immintrin.h>

/* Twice the E2M1 value of each code plus 12, in [0, 24]: the unsigned operand of a byte dot
 * product (VNNI's and maddubs take one unsigned and one signed), the sum then corrected by -12
 * times the other operand's sum. */
static const uint8_t TWICE_E2M1_PLUS_12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* VNNI's byte dot product on 256-bit vectors, where the CPU has it: each 32-bit lane of acc plus
 * the sum of four products of the unsigned bytes u and the signed bytes s. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAS_VNNI 1
#define dot_bytes _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define HAS_VNNI 1
#define dot_bytes _mm256_dpbusd_avx_epi32
#else
#define HAS_VNNI 0
#endif

/* Four weight blocks' 64 codes (32 packed bytes) looked up in table (16 bytes, by code, in both
 * 128-bit halves), a block per 128 bits in the order unpacking within 128-bit lanes gives:
 * blocks 0 and 2 into even, blocks 1 and 3 into odd. */
static inline void decode_four_blocks(const uint8_t *packed, __m256i table, __m256i *even, __m256i *odd) {
    __m256i bytes = _mm256_loadu_si256((const __m256i *)packed);
    __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i low = _mm256_and_si256(bytes, nibble);
    __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    *even = _mm256_shuffle_epi8(table, _mm256_unpacklo_epi8(low, high));
    *odd = _mm256_shuffle_epi8(table, _mm256_unpackhi_epi8(low, high));
}

/* A group of four blocks' products, the weight's decoded even and odd vectors (decode_four_blocks)
 * times one row's values x reordered to match: per 128 bits the partial sums b0 b0 b1 b1 | b2
 * b2 b3 b3. With VNNI the weight comes as 2 q_w + 12 and the sums before the row's corrections;
 * without, |w| times x with w's sign, in pairs (at most 2 * 144, no int16 saturation), then in
 * fours. */
static inline __m256i four_blocks_partial_sums(__m256i even, __m256i odd, const int8_t *x) {
    __m256i x_even = _mm256_loadu_si256((const __m256i *)x);
    __m256i x_odd = _mm256_loadu_si256((const __m256i *)(x + 2 * BLOCK));
#if HAS_VNNI
    __m256i zero = _mm256_setzero_si256();
    return _mm256_hadd_epi32(dot_bytes(zero, even, x_even), dot_bytes(zero, odd, x_odd));
#else
    __m256i ones = _mm256_set1_epi16(1);
    __m256i even_pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(even), _mm256_sign_epi8(x_even, even));
    __m256i odd_pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(odd), _mm256_sign_epi8(x_odd, odd));
    return _mm256_hadd_epi32(_mm256_madd_epi16(even_pairs, ones), _mm256_madd_epi16(odd_pairs, ones));
#endif
}

/* One row's values with each group of four blocks in decode_four_blocks' order (0, 2, 1, 3), the
 * blocks past the last whole group as they are: the one-row form reads a group's even and odd
 * blocks as one vector each. With VNNI also each group's corrections, -12 times each block's sum
 * of 2 q_x, as the form's block sums lie (blocks 0 1 0 1 2 3 2 3), 8 int32 per group. */
static void reorder_for_four_blocks(const int8_t *x, int64_t k, int8_t *reordered, int32_t *corrections) {
    static const int order[4] = {0, 2, 1, 3}, lanes[8] = {0, 1, 0, 1, 2, 3, 2, 3};
    int64_t b = 0;
    for (; b + 4 <= k / BLOCK; b += 4) {
        for (int i = 0; i < 4; i++)
            memcpy(reordered + (b + i) * BLOCK, x + (b + order[i]) * BLOCK, BLOCK);
#if HAS_VNNI
        for (int lane = 0; lane < 8; lane++) {
            int32_t sum = 0;
            for (int j = 0; j < BLOCK; j++)
                sum += x[(b + lanes[lane]) * BLOCK + j];
            corrections[b / 4 * 8 + lane] = -12 * sum;
        }
#else
        (void)corrections;
        (void)lanes;
#endif
    }
    memcpy(reordered + b * BLOCK, x + b * BLOCK, (size_t)(k - b * BLOCK));
}
#endif

/* One output feature's value for each row: sums[row] * output_scale + bias, stored. */
static void store_outputs(const float *sums, int64_t rows, int64_t first_row, int64_t n, int64_t feature,
                          float output_scale, const void *bias, int bias_is_bf16, void *out, int out_is_bf16) {
    float bias_value = 0.0f;
    if (bias)
        bias_value = bias_is_bf16 ? from_bits((uint32_t)((const uint16_t *)bias)[feature] << 16)
                                  : ((const float *)bias)[feature];
    for (int64_t row = 0; row < rows; row++) {
        float value = sums[row] * output_scale;
        if (bias)
            value = value + bias_value;
        int64_t at = (first_row + row) * n + feature;
        if (out_is_bf16)
            ((uint16_t *)out)[at] = to_bf16(value);
        else
            ((float *)out)[at] = value;
    }
}

/* What every output feature's product reads: the quantized rows, the packed weight and its
 * scales, the global scales and the bias (see nvfp4_rows_times_weight). */
struct operands {
    const int8_t *q2;
    const float *scales;
    int64_t rows, k;
    const uint8_t *weight, *weight_scales;
    const float *scale_values;
    int64_t n;
    float output_scale;
    const void *bias;
    int bias_is_bf16;
    void *out;
    int out_is_bf16;
};

/* Outputs first..end-1 of every row (at most ROWS_ONE_BY_ONE), each row's block sums in turn.
 * With AVX2 two features go together, four blocks per step, their 8 block sums reduced and scaled
 * in one vector; the rows' values come reordered by reorder_for_four_blocks, with their
 * corrections where VNNI multiplies. */
static void rows_one_by_one(const struct operands *o, const int8_t *reordered, const int32_t *corrections,
                            int64_t first, int64_t end) {
    int64_t k = o->k, blocks = k / BLOCK;
    float sums[2][ROWS_ONE_BY_ONE];
    for (int64_t feature = first; feature < end; feature += 2) {
        /* a last odd feature goes as both of a pair, its second results dropped */
        int64_t features[2] = {feature, feature + 1 < end ? feature + 1 : feature};
        const uint8_t *packed[2], *codes[2];
        for (int f = 0; f < 2; f++) {
            packed[f] = o->weight + features[f] * (k / 2);
            codes[f] = o->weight_scales + features[f] * blocks;
            for (int64_t row = 0; row < o->rows; row++)
                sums[f][row] = 0.0f;
        }
        int64_t b = 0;
#if defined(__AVX2__)
        const void *codes_table = HAS_VNNI ? (const void *)TWICE_E2M1_PLUS_12 : (const void *)TWICE_E2M1;
        __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)codes_table));
        /* the x scales of blocks 0-3 spread as the block sums lie: b0 b1 b0 b1 | b2 b3 b2 b3 */
        __m256i spread = _mm256_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3);
        for (; b + 4 <= blocks; b += 4) {
            __m256i even[2], odd[2];
            for (int f = 0; f < 2; f++)
                decode_four_blocks(packed[f] + b * (BLOCK / 2), table, &even[f], &odd[f]);
            const float *values = o->scale_values;
            __m256 weight_scale = _mm256_setr_ps(
                values[codes[0][b]], values[codes[0][b + 1]], values[codes[1][b]], values[codes[1][b + 1]],
                values[codes[0][b + 2]], values[codes[0][b + 3]], values[codes[1][b + 2]], values[codes[1][b + 3]]);
            for (int64_t row = 0; row < o->rows; row++) {
                const int8_t *x = reordered + row * k + b * BLOCK;
                /* f0 b0, f0 b1, f1 b0, f1 b1 | f0 b2, f0 b3, f1 b2, f1 b3 */
                __m256i block_sums = _mm256_hadd_epi32(four_blocks_partial_sums(even[0], odd[0], x),
                                                       four_blocks_partial_sums(even[1], odd[1], x));
#if HAS_VNNI
                block_sums = _mm256_add_epi32(
                    block_sums, _mm256_loadu_si256((const __m256i *)(corrections + (row * (k / 64) + b / 4) * 8)));
#else
                (void)corrections;
#endif
                __m256 x_scale = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_loadu_ps(o->scales + row * blocks + b)), spread);
                float products[8];
                _mm256_storeu_ps(products, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(block_sums),
                                                                       _mm256_mul_ps(x_scale, weight_scale)),
                                                         _mm256_set1_ps(0.25f)));
                for (int f = 0; f < 2; f++) {
                    sums[f][row] += products[2 * f];
                    sums[f][row] += products[2 * f + 1];
                    sums[f][row] += products[2 * f + 4];
                    sums[f][row] += products[2 * f + 5];
                }
            }
        }
#else
        (void)reordered;
        (void)corrections;
#endif
        for (; b < blocks; b++) {
            for (int f = 0; f < 2; f++) {
                float weight_scale = o->scale_values[codes[f][b]];
                for (int64_t row = 0; row < o->rows; row++) {
                    int32_t sum = block_sum(o->q2 + row * k + b * BLOCK, packed[f] + b * (BLOCK / 2));
                    sums[f][row] += (float)sum * (o->scales[row * blocks + b] * weight_scale) * 0.25f;
                }
            }
        }
        for (int f = 0; f < 2 && (f == 0 || features[1] != features[0]); f++)
            store_outputs(sums[f], o->rows, 0, o->n, features[f], o->output_scale, o->bias, o->bias_is_bf16, o->out,
                          o->out_is_bf16);
    }
}

#if defined(__AVX2__)
/* Rows as vector lanes, for calls of LANES_FROM_ROWS rows or more: each 32-bit lane holds one
 * row, so one instruction multiplies four of a weight block's values, broadcast to every lane, by
 * four of each of 8 or 16 rows' values, and each lane adds its rows' block products in K order,
 * as the one-row-at-a-time form does. The rows go in chunks of 16: two 8-lane vectors, or one of
 * 16 lanes with AVX-512 (a chunk of at most 8 rows takes one 8-lane vector); the weight's values
 * go as unsigned bytes, 2 q_w + 12 in [0, 24], and each lane starts a block from -12 times its
 * row's sum of 2 q_x, so that the sum comes out as that of (2 q_x)(2 q_w). */
#define LANE_ROWS 16
/* Calls of fewer rows go one row at a time, faster there: two rows are faster in the lanes only
 * with VNNI and AVX-512's registers (examples/benchmarks/RESULTS.md). */
#if defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LANES_FROM_ROWS 2
#else
#define LANES_FROM_ROWS 3
#endif

/* The quantized rows rearranged for the lanes, per chunk of LANE_ROWS rows and per block: the
 * 16 values as four groups of four bytes per row, the offsets -12 * sum(2 q_x), the block
 * scales / 4 (rows past the last are zeros). */
struct lanes {
    int8_t *x;        /* [chunks][blocks][4][LANE_ROWS][4] */
    int32_t *offsets; /* [chunks][blocks][LANE_ROWS] */
    float *scales;    /* [chunks][blocks][LANE_ROWS] */
};

static void free_lanes(struct lanes *l) {
    free(l->x);
    free(l->offsets);
    free(l->scales);
}

static int lay_out_in_lanes(const int8_t *q2, const float *scales, int64_t rows, int64_t k, struct lanes *l) {
    int64_t blocks = k / BLOCK, chunks = (rows + LANE_ROWS - 1) / LANE_ROWS;
    l->x = calloc((size_t)(chunks * blocks), 4 * LANE_ROWS * 4);
    l->offsets = calloc((size_t)(chunks * blocks), LANE_ROWS * sizeof(int32_t));
    l->scales = calloc((size_t)(chunks * blocks), LANE_ROWS * sizeof(float));
    if (!l->x || !l->offsets || !l->scales)
        return 0; /* the caller frees what was allocated (free_lanes) */
    for (int64_t row = 0; row < rows; row++) {
        int64_t chunk = row / LANE_ROWS, lane = row % LANE_ROWS;
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *values = q2 + row * k + b * BLOCK;
            int64_t at = (chunk * blocks + b) * LANE_ROWS + lane;
            int32_t sum = 0;
            for (int j = 0; j < BLOCK; j++)
                sum += values[j];
            for (int group = 0; group < 4; group++)
                memcpy(l->x + (at - lane) * 4 * 4 + (group * LANE_ROWS + lane) * 4, values + 4 * group, 4);
            l->offsets[at] = -12 * sum;
            l->scales[at] = 0.25f * scales[row * blocks + b];
        }
    }
    return 1;
}

/* One feature's k packed codes as 2 q_w + 12, one byte each, into w. */
static void decode_feature(const uint8_t *packed, int64_t k, uint8_t *w) {
    __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)TWICE_E2M1_PLUS_12));
    int64_t i = 0;
    for (; i + 4 * BLOCK <= k; i += 4 * BLOCK) {
        __m256i even, odd; /* blocks 0 and 2, 1 and 3 */
        decode_four_blocks(packed + i / 2, table, &even, &odd);
        _mm256_storeu_si256((__m256i *)(w + i), _mm256_permute2x128_si256(even, odd, 0x20));
        _mm256_storeu_si256((__m256i *)(w + i + 2 * BLOCK), _mm256_permute2x128_si256(even, odd, 0x31));
    }
    for (; i < k; i += 2) {
        w[i] = TWICE_E2M1_PLUS_12[packed[i / 2] & 0xF];
        w[i + 1] = TWICE_E2M1_PLUS_12[packed[i / 2] >> 4];
    }
}

/* The lane vectors, 8 lanes of 32 bits (AVX2) and, where the CPU has AVX-512 with VNNI, 16: the
 * operations chunk_sums needs, suffixed by the lane count. add_four_products adds to each lane
 * of acc the sum of four products of the unsigned bytes u and the signed bytes s. */
typedef __m256i ints_8;
typedef __m256 floats_8;
#define load_ints_8(p) _mm256_loadu_si256((const __m256i *)(p))
#define load_floats_8(p) _mm256_loadu_ps(p)
#define broadcast_ints_8 _mm256_set1_epi32
#define broadcast_floats_8 _mm256_set1_ps
#define to_floats_8 _mm256_cvtepi32_ps
#define mul_8 _mm256_mul_ps
#define add_8 _mm256_add_ps
#define zeros_8 _mm256_setzero_ps
#define store_8 _mm256_storeu_ps
static inline ints_8 add_four_products_8(ints_8 acc, ints_8 u, ints_8 s) {
#if HAS_VNNI
    return dot_bytes(acc, u, s);
#else
    /* pairs of products at most 2 * 24 * 12 in magnitude: no int16 saturation */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define HAS_16_LANES 1
typedef __m512i ints_16;
typedef __m512 floats_16;
#define load_ints_16(p) _mm512_loadu_si512((const void *)(p))
#define load_floats_16(p) _mm512_loadu_ps(p)
#define broadcast_ints_16 _mm512_set1_epi32
#define broadcast_floats_16 _mm512_set1_ps
#define to_floats_16 _mm512_cvtepi32_ps
#define mul_16 _mm512_mul_ps
#define add_16 _mm512_add_ps
#define zeros_16 _mm512_setzero_ps
#define store_16 _mm512_storeu_ps
#define add_four_products_16 _mm512_dpbusd_epi32
#else
#define HAS_16_LANES 0
#endif

/* Features multiplied together in the lanes, as many as the vector registers hold (16, or 32
 * with AVX-512): each row vector read serves all of them. */
#if defined(__AVX512VL__)
#define LANE_FEATURES 8
#else
#define LANE_FEATURES 4
#endif

/* chunk_sums_W: one chunk's sums for `features` features (w[f] their decoded values,
 * weight_scales[f] their block scales) into sums[f][0..15], through `vectors` W-lane vectors
 * per chunk (W = 8: 1 or 2; W = 16: 1); features and vectors are constants where inlined, at most
 * LANE_FEATURES / vectors features. One body for both widths. */
#define DEFINE_CHUNK_SUMS(W)                                                                                  \
    static inline __attribute__((always_inline)) void chunk_sums_##W(                                       \
        const struct lanes *l, int64_t chunk, int64_t blocks, uint8_t *const *w, float *const *weight_scales, \
        int features, int vectors, float sums[][LANE_ROWS]) {                                               \
        const int8_t *x = l->x + chunk * blocks * 4 * LANE_ROWS * 4;                                        \
        const int32_t *offsets = l->offsets + chunk * blocks * LANE_ROWS;                                   \
        const float *scales = l->scales + chunk * blocks * LANE_ROWS;                                       \
        floats_##W acc[LANE_FEATURES][2];                                                                   \
        for (int f = 0; f < features; f++)                                                                  \
            for (int v = 0; v < vectors; v++)                                                               \
                acc[f][v] = zeros_##W();                                                                    \
        for (int64_t b = 0; b < blocks; b++) {                                                              \
            ints_##W dot[LANE_FEATURES][2];                                                                 \
            for (int v = 0; v < vectors; v++) {                                                             \
                ints_##W offset = load_ints_##W(offsets + b * LANE_ROWS + W * v);                           \
                for (int f = 0; f < features; f++)                                                          \
                    dot[f][v] = offset;                                                                     \
            }                                                                                               \
            for (int group = 0; group < 4; group++) {                                                       \
                for (int v = 0; v < vectors; v++) {                                                         \
                    ints_##W values = load_ints_##W(x + (b * 4 + group) * LANE_ROWS * 4 + 4 * W * v);        \
                    for (int f = 0; f < features; f++) {                                                    \
                        int32_t four;                                                                       \
                        memcpy(&four, w[f] + b * BLOCK + 4 * group, 4);                                     \
                        dot[f][v] = add_four_products_##W(dot[f][v], broadcast_ints_##W(four), values);     \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
            for (int v = 0; v < vectors; v++) {                                                             \
                floats_##W scale = load_floats_##W(scales + b * LANE_ROWS + W * v);                         \
                for (int f = 0; f < features; f++) {                                                        \
                    floats_##W product = mul_##W(to_floats_##W(dot[f][v]), scale);                          \
                    acc[f][v] = add_##W(acc[f][v], mul_##W(product, broadcast_floats_##W(weight_scales[f][b]))); \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int f = 0; f < features; f++)                                                                  \
            for (int v = 0; v < vectors; v++)                                                               \
                store_##W(sums[f] + W * v, acc[f][v]);                                                      \
    }
DEFINE_CHUNK_SUMS(8)
#if HAS_16_LANES
DEFINE_CHUNK_SUMS(16)
#endif

/* One chunk of `rows` rows for features f0.. of the group (at most LANE_FEATURES): each set of
 * them the widest form takes. */
static void chunk_sums(const struct lanes *l, int64_t chunk, int64_t rows, int64_t blocks, uint8_t *const *w,
                       float *const *weight_scales, int features, float sums[][LANE_ROWS]) {
    for (int f = 0; f < features;) {
        if (rows <= 8 && features - f == LANE_FEATURES) {
            chunk_sums_8(l, chunk, blocks, w + f, weight_scales + f, LANE_FEATURES, 1, sums + f);
            f += LANE_FEATURES;
        } else if (rows <= 8) {
            chunk_sums_8(l, chunk, blocks, w + f, weight_scales + f, 1, 1, sums + f);
            f += 1;
#if HAS_16_LANES
        } else if (features - f == LANE_FEATURES) {
            chunk_sums_16(l, chunk, blocks, w + f, weight_scales + f, LANE_FEATURES, 1, sums + f);
            f += LANE_FEATURES;
        } else {
            chunk_sums_16(l, chunk, blocks, w + f, weight_scales + f, 1, 1, sums + f);
            f += 1;
#else
        } else if (features - f >= LANE_FEATURES / 2) {
            chunk_sums_8(l, chunk, blocks, w + f, weight_scales + f, LANE_FEATURES / 2, 2, sums + f);
            f += LANE_FEATURES / 2;
        } else {
            chunk_sums_8(l, chunk, blocks, w + f, weight_scales + f, 1, 2, sums + f);
            f += 1;
#endif
        }
    }
}

/* Outputs first..end-1 of every row through the lanes; scratch holds LANE_FEATURES times k
 * bytes and k / 16 floats. */
static void rows_in_lanes(const struct operands *o, const struct lanes *l, int64_t first, int64_t end,
                          uint8_t *scratch) {
    int64_t k = o->k, blocks = k / BLOCK;
    uint8_t *w[LANE_FEATURES];
    float *weight_scales[LANE_FEATURES];
    for (int f = 0; f < LANE_FEATURES; f++) {
        weight_scales[f] = (float *)(scratch + f * (k + blocks * (int64_t)sizeof(float)));
        w[f] = (uint8_t *)(weight_scales[f] + blocks);
    }
    float sums[LANE_FEATURES][LANE_ROWS];
    for (int64_t feature = first; feature < end; feature += LANE_FEATURES) {
        int features = end - feature < LANE_FEATURES ? (int)(end - feature) : LANE_FEATURES;
        for (int f = 0; f < features; f++) {
            decode_feature(o->weight + (feature + f) * (k / 2), k, w[f]);
            const uint8_t *codes = o->weight_scales + (feature + f) * blocks;
            for (int64_t b = 0; b < blocks; b++)
                weight_scales[f][b] = o->scale_values[codes[b]];
        }
        for (int64_t first_row = 0; first_row < o->rows; first_row += LANE_ROWS) {
            int64_t rows = o->rows - first_row < LANE_ROWS ? o->rows - first_row : LANE_ROWS;
            chunk_sums(l, first_row / LANE_ROWS, rows, blocks, w, weight_scales, features, sums);
            for (int f = 0; f < features; f++)
                store_outputs(sums[f], rows, first_row, o->n, feature + f, o->output_scale, o->bias, o->bias_is_bf16,
                              o->out, o->out_is_bf16);
        }
    }
}
#endif

/* Rows any call takes: with the lanes, every row count; else ROWS_ONE_BY_ONE (cpu_kernel.py
 * reads it). */
int nvfp4_most_rows(void) {
#if defined(__AVX2__)
    return INT32_MAX;
#else
    return ROWS_ONE_BY_ONE;
#endif
}

/* One thread's outputs. */
struct part {
    const struct operands *o;
    const void *lanes;       /* struct lanes, or NULL: one row at a time */
    const int8_t *reordered;     /* one row at a time with AVX2: the rows by reorder_for_four_blocks */
    const int32_t *corrections;  /* and their corrections, with VNNI */
    uint8_t *scratch;
    int64_t first, end;
};

static void *run_part(void *argument) {
    const struct part *p = argument;
#if defined(__AVX2__)
    if (p->lanes) {
        rows_in_lanes(p->o, p->lanes, p->first, p->end, p->scratch);
        return NULL;
    }
#endif
    rows_one_by_one(p->o, p->reordered, p->corrections, p->first, p->end);
    return NULL;
}

#define MOST_THREADS 256

/* The worker threads that run the other parts of a split call: started at the first call that
 * needs them and kept, waiting on a condition variable, for the process (starting a thread costs
 * tens of microseconds, per call a large share of a small one). One call at a time hands them
 * parts; a call that finds them busy (another thread's call) runs its parts itself. A child made
 * by fork() has none of its parent's workers and starts its own. */
static pthread_mutex_t pool_turn = PTHREAD_MUTEX_INITIALIZER;    /* held by the call using the pool */
static pthread_mutex_t pool_state = PTHREAD_MUTEX_INITIALIZER;   /* guards the fields below */
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER;      /* a new round of parts */
static pthread_cond_t pool_finished = PTHREAD_COND_INITIALIZER;  /* the round's last part done */
static int pool_workers;        /* started workers: worker i runs part i of a round, i = 1.. */
static unsigned long pool_round; /* counts the rounds handed out */
static struct part *pool_parts;
static int pool_parts_count;    /* parts in this round, the caller's part 0 included */
static int pool_unfinished;     /* the workers' parts of this round not yet done */
static pthread_once_t pool_fork_handler = PTHREAD_ONCE_INIT;

static void *pool_worker(void *argument) {
    int index = (int)(intptr_t)argument;
    pthread_mutex_lock(&pool_state);
    /* started while the caller set up its round, which is pool_round by now: run it first */
    unsigned long seen = pool_round - 1;
    for (;;) {
        while (pool_round == seen)
            pthread_cond_wait(&pool_work, &pool_state);
        seen = pool_round;
        if (index < pool_parts_count) {
            struct part *part = &pool_parts[index];
            pthread_mutex_unlock(&pool_state);
            run_part(part);
            pthread_mutex_lock(&pool_state);
            if (--pool_unfinished == 0)
                pthread_cond_signal(&pool_finished);
        }
    }
    return NULL;
}

/* In a child made by fork(): no workers, and the locks as new. */
static void forget_pool(void) {
    pthread_mutex_t unlocked = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t condition = PTHREAD_COND_INITIALIZER;
    pool_turn = unlocked;
    pool_state = unlocked;
    pool_work = condition;
    pool_finished = condition;
    pool_workers = 0;
    pool_round = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_pool); }

/* Runs parts[0..count-1]: part 0 here, the others on the pool's workers (here those no worker
 * can take: the pool busy with another call, or a worker that could not be started). */
static void run_parts(struct part *parts, int count) {
    int helpers = 0;
    int have_turn = count > 1 && pthread_mutex_trylock(&pool_turn) == 0;
    if (have_turn) {
        pthread_once(&pool_fork_handler, register_fork_handler);
        pthread_mutex_lock(&pool_state);
        while (pool_workers < count - 1) {
            pthread_t id;
            if (pthread_create(&id, NULL, pool_worker, (void *)(intptr_t)(pool_workers + 1)) != 0)
                break;
            pthread_detach(id);
            pool_workers++;
        }
        helpers = pool_workers < count - 1 ? pool_workers : count - 1;
        pool_parts = parts;
        pool_parts_count = helpers + 1;
        pool_unfinished = helpers;
        pool_round++;
        pthread_cond_broadcast(&pool_work);
        pthread_mutex_unlock(&pool_state);
    }
    run_part(&parts[0]);
    for (int t = helpers + 1; t < count; t++)
        run_part(&parts[t]);
    if (have_turn) {
        pthread_mutex_lock(&pool_state);
        while (pool_unfinished > 0)
            pthread_cond_wait(&pool_finished, &pool_state);
        pthread_mutex_unlock(&pool_state);
        pthread_mutex_unlock(&pool_turn);
    }
}

/* A call's threads, up to most_threads: one below twice products_per_thread of its work, else one
 * per eighth of that, its work counted in row-weight products of the one-row-at-a-time form,
 * where each 8 rows in the lanes cost about as much as 2 one at a time. Waking a worker costs
 * microseconds: worth it on many cores for large calls, not for small ones where two threads
 * share two cores (examples/benchmarks/RESULTS.md). */
static int threads_for(int64_t rows, int64_t k, int64_t n, int most_threads, int64_t products_per_thread) {
    int64_t rows_of_work = rows;
#if defined(__AVX2__)
    if (rows >= LANES_FROM_ROWS)
        rows_of_work = 2 * ((rows + 7) / 8);
#endif
    int64_t work = rows_of_work * k * n;
    int64_t threads = work < 2 * products_per_thread ? 1 : work * 8 / products_per_thread;
    if (threads > most_threads)
        threads = most_threads;
    if (threads > MOST_THREADS)
        threads = MOST_THREADS;
    if (threads > n)
        threads = n;
    return threads < 1 ? 1 : (int)threads;
}

/* out[rows, n] = (the sum over blocks, in K order, of each block's exact product) * (*act_scale *
 * *weight_scale_global) + bias, for rows <= nvfp4_most_rows(): the rows x[rows, k] (float32, or
 * bfloat16 where x_is_bf16) quantized by nvfp4_quantize_rows; weight[n, k / 2]: packed E2M1
 * codes, element 2i in the low nibble; weight_scales[n, k / 16]: FP8 E4M3 codes, decoded by
 * scale_values[256]; bias: NULL or [n], bfloat16 where bias_is_bf16, else float32; out bfloat16
 * where out_is_bf16, else float32. The outputs split into threads_for's ranges, run by the
 * calling thread and the pool's workers (run_parts).
 * Returns 0; -1 where memory ran out, -2 for more rows than nvfp4_most_rows() (then out is not
 * written). */
int nvfp4_linear(const void *x, int x_is_bf16, int64_t rows, int64_t k, const float *act_scale,
                 const uint8_t *weight, const uint8_t *weight_scales, const float *scale_values, int64_t n,
                 const float *weight_scale_global, const void *bias, int bias_is_bf16, void *out, int out_is_bf16,
                 int most_threads, int64_t products_per_thread) {
    if (rows > nvfp4_most_rows())
        return -2;
    if (rows == 0 || n == 0)
        return 0;
    int status = -1;
    int threads = threads_for(rows, k, n, most_threads, products_per_thread);
    int8_t *q2 = malloc((size_t)(rows * k));
    float *scales = malloc((size_t)(rows * (k / BLOCK)) * sizeof(float));
    uint8_t *scratch = NULL;
    int64_t scratch_bytes = 0;
    int8_t *reordered = NULL;
    int32_t *corrections = NULL;
#if defined(__AVX2__)
    struct lanes lanes = {NULL, NULL, NULL};
    int in_lanes = rows >= LANES_FROM_ROWS;
#endif
    if (!q2 || !scales)
        goto done;
    nvfp4_quantize_rows(x, x_is_bf16, rows, k, act_scale, q2, scales);
#if defined(__AVX2__)
    if (in_lanes) {
        scratch_bytes = LANE_FEATURES * (k + (k / BLOCK) * (int64_t)sizeof(float));
        scratch = malloc((size_t)(threads * scratch_bytes));
        if (!scratch || !lay_out_in_lanes(q2, scales, rows, k, &lanes))
            goto done;
    } else {
        /* the rows, then (with VNNI) their corrections: 8 int32 per 64 values */
        int64_t correction_count = HAS_VNNI ? rows * (k / 64) * 8 : 0;
        reordered = malloc((size_t)(rows * k + correction_count * (int64_t)sizeof(int32_t)));
        if (!reordered)
            goto done;
        corrections = (int32_t *)(reordered + rows * k);
        for (int64_t row = 0; row < rows; row++)
            reorder_for_four_blocks(q2 + row * k, k, reordered + row * k, corrections + row * (k / 64) * 8);
    }
#endif
    struct operands o = {q2, scales, rows, k, weight, weight_scales, scale_values, n,
                         *act_scale * *weight_scale_global, bias, bias_is_bf16, out, out_is_bf16};
    struct part parts[MOST_THREADS];
    for (int t = 0; t < threads; t++) {
        struct part p = {&o, NULL, reordered, corrections, scratch ? scratch + t * scratch_bytes : NULL,
                         n * t / threads, n * (t + 1) / threads};
#if defined(__AVX2__)
        if (in_lanes)
            p.lanes = &lanes;
#endif
        parts[t] = p;
    }
    run_parts(parts, threads);
    status = 0;
done:
#if defined(__AVX2__)
    free_lanes(&lanes);
#endif
    free(scratch);
    free(reordered);
    free(q2);
    free(scales);
    return status;
}
