/* Row-wise argmax of fp32 rows (a decode step's logits), CPU.
 *
 * torch.max(dim=-1) tracks an index beside every compared value, one lane at a time: a visible
 * share of a small model's decode step at large batches. Here each row takes two passes: a
 * vector maximum (vec16.h's VN lanes: on AVX2 a 16-lane compare becomes scalar code), then a
 * scan for its first occurrence (the row is in L1/L2 by then). The answer is torch's exactly: the first index of the
 * maximum, and a NaN counts as larger than any number (the first NaN's index if the row has one).
 */
#include <stdint.h>
#include <string.h>

#include "vec16.h"

static int64_t argmax_row(const float *restrict p, int64_t n)
{
    int64_t j = 0;
    float best = p[0];
    int has_nan = 0;
    if (n >= VN) {
        vn m = loadn(p);
        vni nan = {0};
        for (j = 0; j + VN <= n; j += VN) {
            const vn x = loadn(p + j);
            const vni gt = x > m;
            m = (vn)(((vni)x & gt) | ((vni)m & ~gt));
            nan |= x != x;
        }
        float lanes[VN];
        int32_t nans[VN];
        memcpy(lanes, &m, sizeof lanes);
        memcpy(nans, &nan, sizeof nans);
        best = lanes[0];
        for (int l = 0; l < VN; l++) {
            best = lanes[l] > best ? lanes[l] : best;
            has_nan |= nans[l] != 0;
        }
    }
    for (; j < n; j++) { /* the tail past the last whole vector */
        best = p[j] > best ? p[j] : best;
        has_nan |= p[j] != p[j];
    }
    for (int64_t i = 0; i < n; i++)
        if (has_nan ? p[i] != p[i] : p[i] == best) return i;
    return 0; /* unreachable: best is one of the row's values */
}

void baton_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out)
{
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, cols);
}
