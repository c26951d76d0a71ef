/* The static NVFP4 linear for a few rows on a CPU, built by cpu_kernel.py at first use.
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
 * With AVX2 (x86) four blocks go per step through vector instructions; elsewhere plain C does the
 * same integer arithmetic. Large calls split their outputs across threads.
 *
 * Built without -ffast-math and with -ffp-contract=off: every operation rounds as torch's does.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 16

/* Twice the E2M1 value of each 4-bit code: the sign is the high bit. */
static const int8_t TWICE_E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static float from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static uint32_t to_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* The FP8 E4M3 value nearest to v in [2^-6, 448] (all normal there), ties to even: float32's
 * 23 mantissa bits rounded to 3. */
static float round_to_e4m3(float v) {
    uint32_t bits = to_bits(v);
    bits += 0x7FFFFu + ((bits >> 20) & 1u);
    return from_bits(bits & 0xFFF00000u);
}

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
    float scale = (amax / 6.0f) / global_scale;
    if (scale < 0.015625f)
        scale = 0.015625f;
    if (scale > 448.0f)
        scale = 448.0f;
    scale = round_to_e4m3(scale);
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

/* Rows the product takes at once (cpu_kernel.MOST_ROWS). */
#define NVFP4_MOST_ROWS 16

int nvfp4_most_rows(void) { return NVFP4_MOST_ROWS; }

/* The integer sum over one block of (2 q_x)(2 q_w), the weight's block packed in 8 bytes. */
static int32_t block_sum(const int8_t *x, const uint8_t *packed) {
    int32_t sum = 0;
    for (int j = 0; j < BLOCK / 2; j++)
        sum += x[2 * j] * TWICE_E2M1[packed[j] & 0xF] + x[2 * j + 1] * TWICE_E2M1[packed[j] >> 4];
    return sum;
}

#if defined(__AVX2__)
#include <immintrin.h>

/* Two weight blocks' 32 codes (16 packed bytes) as twice their E2M1 values, int8, in K order:
 * the first block in the low 128 bits. */
static inline __m256i decode_two_blocks(const uint8_t *packed, __m256i table) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)packed);
    __m128i nibble = _mm_set1_epi8(0x0F);
    __m128i low = _mm_and_si128(bytes, nibble);
    __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    __m256i codes = _mm256_set_m128i(_mm_unpackhi_epi8(low, high), _mm_unpacklo_epi8(low, high));
    return _mm256_shuffle_epi8(table, codes);
}

/* Two blocks' products x * w as four int32 partial sums each (a block per 128 bits): |w| times
 * x with w's sign, in pairs (at most 2 * 144, no int16 saturation), then in fours. */
static inline __m256i two_blocks_partial_sums(__m256i w, __m256i w_magnitude, const int8_t *x) {
    __m256i a = _mm256_loadu_si256((const __m256i *)x);
    __m256i pairs = _mm256_maddubs_epi16(w_magnitude, _mm256_sign_epi8(a, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* The four blocks' integer sums, in K order, from the partial sums of blocks 0-1 and 2-3. */
static inline __m128i four_block_sums(__m256i first_two, __m256i last_two) {
    __m256i pairs = _mm256_hadd_epi32(first_two, last_two); /* per 128 bits: b0 b0 b2 b2 | b1 b1 b3 b3 */
    __m256i sums = _mm256_hadd_epi32(pairs, pairs);         /* b0 b2 b0 b2 | b1 b3 b1 b3 */
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
}
#endif

/* Outputs first..end-1 of every row: out[rows, n] = (the sum over blocks, in K order, of each
 * block's exact product) * (*act_scale * *weight_scale) + bias, for rows <= NVFP4_MOST_ROWS.
 * weight[n, k / 2]: packed E2M1 codes, element 2i in the low nibble; weight_scales[n, k / 16]:
 * FP8 E4M3 codes, decoded by scale_values[256]; bias: NULL or [n], bfloat16 where bias_is_bf16,
 * else float32; out bfloat16 where out_is_bf16, else float32. */
static void rows_times_weight(const int8_t *restrict q2, const float *restrict scales, int64_t rows,
                              int64_t k, const uint8_t *restrict weight,
                              const uint8_t *restrict weight_scales, const float *restrict scale_values,
                              int64_t n, int64_t first, int64_t end, const float *act_scale,
                              const float *weight_scale_global, const void *bias, int bias_is_bf16,
                              void *out, int out_is_bf16) {
    int64_t blocks = k / BLOCK;
    float output_scale = *act_scale * *weight_scale_global;
    float sums[NVFP4_MOST_ROWS];
    for (int64_t feature = first; feature < end; feature++) {
        const uint8_t *packed = weight + feature * (k / 2);
        const uint8_t *codes = weight_scales + feature * blocks;
        for (int64_t row = 0; row < rows; row++)
            sums[row] = 0.0f;
        int64_t b = 0;
#if defined(__AVX2__)
        __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)TWICE_E2M1));
        for (; b + 4 <= blocks; b += 4) {
            __m256i w[2], w_magnitude[2];
            for (int i = 0; i < 2; i++) {
                w[i] = decode_two_blocks(packed + (b + 2 * i) * (BLOCK / 2), table);
                w_magnitude[i] = _mm256_abs_epi8(w[i]);
            }
            __m128 weight_scale = _mm_set_ps(scale_values[codes[b + 3]], scale_values[codes[b + 2]],
                                             scale_values[codes[b + 1]], scale_values[codes[b]]);
            for (int64_t row = 0; row < rows; row++) {
                const int8_t *x = q2 + row * k + b * BLOCK;
                __m128i sum = four_block_sums(two_blocks_partial_sums(w[0], w_magnitude[0], x),
                                              two_blocks_partial_sums(w[1], w_magnitude[1], x + 2 * BLOCK));
                __m128 scale = _mm_mul_ps(_mm_loadu_ps(scales + row * blocks + b), weight_scale);
                float products[4];
                _mm_storeu_ps(products, _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(sum), scale), _mm_set1_ps(0.25f)));
                for (int i = 0; i < 4; i++)
                    sums[row] += products[i];
            }
        }
#endif
        for (; b < blocks; b++) {
            float weight_scale = scale_values[codes[b]];
            for (int64_t row = 0; row < rows; row++) {
                int32_t sum = block_sum(q2 + row * k + b * BLOCK, packed + b * (BLOCK / 2));
                sums[row] += (float)sum * (scales[row * blocks + b] * weight_scale) * 0.25f;
            }
        }
        float bias_value = 0.0f;
        if (bias)
            bias_value = bias_is_bf16 ? from_bits((uint32_t)((const uint16_t *)bias)[feature] << 16)
                              : ((const float *)bias)[feature];
        for (int64_t row = 0; row < rows; row++) {
            float value = sums[row] * output_scale;
            if (bias)
                value = value + bias_value;
            if (out_is_bf16)
                ((uint16_t *)out)[row * n + feature] = to_bf16(value);
            else
                ((float *)out)[row * n + feature] = value;
        }
    }
}

/* rows_times_weight's arguments for one thread's outputs. */
struct part {
    const int8_t *q2;
    const float *scales;
    int64_t rows, k;
    const uint8_t *weight, *weight_scales;
    const float *scale_values;
    int64_t n, first, end;
    const float *act_scale, *weight_scale_global;
    const void *bias;
    int bias_is_bf16;
    void *out;
    int out_is_bf16;
};

static void *run_part(void *argument) {
    const struct part *p = argument;
    rows_times_weight(p->q2, p->scales, p->rows, p->k, p->weight, p->weight_scales, p->scale_values, p->n,
                      p->first, p->end, p->act_scale, p->weight_scale_global, p->bias, p->bias_is_bf16,
                      p->out, p->out_is_bf16);
    return NULL;
}

#define MOST_THREADS 256

/* rows_times_weight of all n outputs, split into `threads` ranges of outputs: the calling thread
 * runs the first, a thread of its own each other (one that cannot be started runs here). */
void nvfp4_rows_times_weight(const int8_t *q2, const float *scales, int64_t rows, int64_t k,
                             const uint8_t *weight, const uint8_t *weight_scales,
                             const float *scale_values, int64_t n, const float *act_scale,
                             const float *weight_scale_global, const void *bias, int bias_is_bf16,
                             void *out, int out_is_bf16, int threads) {
    struct part parts[MOST_THREADS];
    pthread_t ids[MOST_THREADS];
    int started[MOST_THREADS];
    if (threads < 1)
        threads = 1;
    if (threads > MOST_THREADS)
        threads = MOST_THREADS;
    if (threads > n)
        threads = (int)n;
    for (int t = 0; t < threads; t++) {
        struct part p = {q2, scales, rows, k, weight, weight_scales, scale_values, n, n * t / threads,
                         n * (t + 1) / threads, act_scale, weight_scale_global, bias, bias_is_bf16, out,
                         out_is_bf16};
        parts[t] = p;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, run_part, &parts[t]) == 0;
    run_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_part(&parts[t]);
    }
}
