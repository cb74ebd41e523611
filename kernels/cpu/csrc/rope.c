/* Rotate-half RoPE in place over rows of heads, CPU, fp32.
 *
 * x[t, h, :] <- x * cos[t] + swap_halves(x) * sin[t]   (sin's first half already negated)
 *
 * The model's torch form (model.py apply_rope) makes a swapped copy with cat and three more
 * full-size temporaries (two products and their sum), each a pass over memory. Here each head row
 * is read once and written back. The products and
 * the sum are rounded one at a time, as torch's eager ops round them: this file is compiled with
 * -ffp-contract=off, so no multiply-add is fused and the results are torch's bit for bit. */
#include <stdint.h>
#include <string.h>

void baton_rope_f32(float *x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                    int64_t token_stride, const float *cos, const float *sin)
{
    const int64_t half = head_dim / 2;
    float row[512]; /* head_dim <= 512, checked by the caller */
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *xh = x + t * token_stride + h * head_dim;
            memcpy(row, xh, (size_t)head_dim * sizeof *row);
            for (int64_t d = 0; d < half; d++) {
                const float a = row[d] * c[d], b = row[d + half] * s[d];
                xh[d] = a + b;
            }
            for (int64_t d = half; d < head_dim; d++) {
                const float a = row[d] * c[d], b = row[d - half] * s[d];
                xh[d] = a + b;
            }
        }
    }
}
