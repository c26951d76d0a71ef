/* GPTQ's per-block work on a CPU (references.gptq_block), built with cpu_kernel.c.
 *
 * The torch reference runs the block's 16 GPTQ steps on all 126 candidates at once, as ops over
 * [126, rows, 16] temporaries. Here 16 rows sit in registers, one row per vector lane, and run
 * the steps candidate by candidate (every loop over the 16 lanes is one vector operation where
 * the compiler vectorizes it), keeping each row's first candidate of least sum e_j^2; then the
 * steps run once more with each row's winner. The arithmetic is the reference's in its order:
 * built with -ffp-contract=off (an FMA would round w - q d, w_i - e U_ji or loss + e e once where
 * torch rounds twice), and C's division is IEEE's.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_float.h"

#define BLOCK 16
#define LANES 16

/* The 16 GPTQ steps of each lane's row w[j][lane] (not changed) under the lane's own factors:
 * step j rounds column j as it stands and moves its error e_j = (w_j - q_j d) / U_jj onto the
 * later columns, w_i -= e_j U_ji. Writes the E2M1 values and errors where asked, and each
 * lane's loss sum e_j^2, added in order j = 0..15. */
static void block_steps(float w[BLOCK][LANES], const float *upper, const float *reciprocal,
                        const float *dequant_scale, float values[BLOCK][LANES], float errors[BLOCK][LANES],
                        float *loss) {
    float columns[BLOCK][LANES], error[BLOCK][LANES];
    for (int j = 0; j < BLOCK; j++)
        for (int lane = 0; lane < LANES; lane++)
            columns[j][lane] = w[j][lane];
    for (int j = 0; j < BLOCK; j++) {
        for (int lane = 0; lane < LANES; lane++) {
            float x = columns[j][lane] * reciprocal[lane];
            float magnitude = fabsf(x);
            /* q carries x's sign, -0.0 included, and NaN rounds to 1.5, as the reference's
             * rounding does */
            magnitude = magnitude != magnitude ? 1.5f : round_to_e2m1_magnitude(magnitude < 6.0f ? magnitude : 6.0f);
            float q = copysignf(magnitude, x);
            error[j][lane] = (columns[j][lane] - q * dequant_scale[lane]) / upper[BLOCK * j + j];
            if (values)
                values[j][lane] = q;
        }
        for (int i = j + 1; i < BLOCK; i++)
            for (int lane = 0; lane < LANES; lane++)
                columns[i][lane] = columns[i][lane] - error[j][lane] * upper[BLOCK * j + i];
    }
    for (int lane = 0; lane < LANES; lane++)
        loss[lane] = error[0][lane] * error[0][lane];
    for (int j = 1; j < BLOCK; j++)
        for (int lane = 0; lane < LANES; lane++)
            loss[lane] = loss[lane] + error[j][lane] * error[j][lane];
    if (errors)
        for (int j = 0; j < BLOCK; j++)
            for (int lane = 0; lane < LANES; lane++)
                errors[j][lane] = error[j][lane];
}

/* block[rows, 16] (float32, rows row_stride apart): each row's candidate of least loss among the
 * `candidates` factors (reciprocals, dequant_scales), ties and NaN losses to the first, into
 * choices[rows]; then that candidate's E2M1 values and errors into values[rows, 16] and
 * errors[rows, 16]. upper[16, 16]: the block's diagonal block of U (entries below the diagonal
 * are not read). */
void nvfp4_gptq_block(const float *block, int64_t rows, int64_t row_stride, const float *upper,
                      const float *reciprocals, const float *dequant_scales, int64_t candidates, float *values,
                      float *errors, int64_t *choices) {
    for (int64_t first = 0; first < rows; first += LANES) {
        int tile_rows = rows - first < LANES ? (int)(rows - first) : LANES;
        float w[BLOCK][LANES], reciprocal[LANES], dequant_scale[LANES], loss[LANES], best_loss[LANES];
        int64_t best[LANES];
        for (int j = 0; j < BLOCK; j++)
            for (int lane = 0; lane < LANES; lane++)
                w[j][lane] = lane < tile_rows ? block[(first + lane) * row_stride + j] : 0.0f;
        for (int lane = 0; lane < LANES; lane++) {
            best_loss[lane] = INFINITY;
            best[lane] = 0;
        }
        for (int64_t candidate = 0; candidate < candidates; candidate++) {
            for (int lane = 0; lane < LANES; lane++) {
                reciprocal[lane] = reciprocals[candidate];
                dequant_scale[lane] = dequant_scales[candidate];
            }
            block_steps(w, upper, reciprocal, dequant_scale, NULL, NULL, loss);
            for (int lane = 0; lane < LANES; lane++)
                if (loss[lane] < best_loss[lane]) { /* the first of equal losses stays; NaN never wins */
                    best_loss[lane] = loss[lane];
                    best[lane] = candidate;
                }
        }
        float tile_values[BLOCK][LANES], tile_errors[BLOCK][LANES];
        for (int lane = 0; lane < LANES; lane++) {
            reciprocal[lane] = reciprocals[best[lane]];
            dequant_scale[lane] = dequant_scales[best[lane]];
        }
        block_steps(w, upper, reciprocal, dequant_scale, tile_values, tile_errors, loss);
        for (int lane = 0; lane < tile_rows; lane++) {
            for (int j = 0; j < BLOCK; j++) {
                values[(first + lane) * BLOCK + j] = tile_values[j][lane];
                errors[(first + lane) * BLOCK + j] = tile_errors[j][lane];
            }
            choices[first + lane] = best[lane];
        }
    }
}
