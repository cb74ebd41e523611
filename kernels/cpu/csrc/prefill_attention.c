/* Causal attention of fresh prompts (no cached prefix), CPU, fp32, head sizes that are multiples
 * of 16.
 *
 * SDPA's fused CPU kernel (flash_attention_for_cpu) runs a short prompt's small heads far below
 * the core's peak: its blocking is made for long sequences and large heads, and each call pays for
 * its own set-up. A prompt's K and V for one KV head are small (32 x 128 floats: 16 KB each), so
 * here each (sequence, KV head) copies them once into a transposed K tile and a contiguous V tile
 * that stay in L1/L2, and the head group's query rows are computed from them sixteen at a time
 * (register-blocked: see block(); docs/perf-log.md, "Prefill attention kernel"):
 *
 *   s[j] = scale * q_i . k_j                     i - W < j <= i (causal: a block of rows
 *                                                computes the tiles up to its last row, masks
 *                                                past each row; W a sliding window, 0 for none:
 *                                                tiles wholly before the block's first row's
 *                                                window are skipped, the rest masked per row)
 *   out_i = sum_j exp(s[j] - max s) v_j / sum_j exp(s[j] - max s)
 *
 * Rows of q, k, v and out are strided (q and k come out of the fused qkv projection as views);
 * query head hq uses KV head hq / group (transformers' repeat_kv order). The exp is Cephes'
 * single-precision polynomial on 16 lanes (within a few ulp of expf), so the numbers equal SDPA's
 * up to rounding, like the decode kernel's. Work items (sequence, KV head) split into up to
 * `parts` ranges on torch's OpenMP team (one runtime, as in paged_decode_attention.c).
 *
 * A bf16 model's rows (baton_prefill_attention_bf16): q, k, v and out bf16. K and V are widened
 * into their tiles as they are copied, each query head's rows of the sequence into an fp32
 * scratch, the probabilities rounded to bf16 before P V (their sum taken before: what SDPA's
 * bf16 kernel does for a prompt within its key block of 512, so a bf16 model's prompt agrees
 * with Hugging Face's), and each output row computed in fp32 is rounded once to bf16 (to
 * nearest even, as torch rounds). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec16.h"

typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16 splat(float x) /* not 0 + x: without -ffast-math that is a scalar add */
{
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

static inline v16 select16(v16i mask, v16 a, v16 b) /* mask lanes are 0 or -1 */
{
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
}

static inline float hmax16(v16 v)
{
    float a[16], m;
    memcpy(a, &v, sizeof a);
    m = a[0];
    for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m;
    return m;
}

static inline float hsum16(v16 v)
{
    float a[16], s = 0.f;
    memcpy(a, &v, sizeof a);
    for (int i = 0; i < 16; i++) s += a[i];
    return s;
}

/* exp(x) for the shifted scores x <= 0: x = n ln2 + r with n = round(x / ln2), a degree-6
 * polynomial in r, and 2^n put into the exponent bits. Below -80 the result is clamped to
 * exp(-80) ~ 1.8e-35, so every product stays a normal float (subnormals are slow); the callers
 * zero the masked weights after. */
static inline v16 exp16(v16 x)
{
    const v16 lo = splat(-80.0f), magic = splat(12582912.0f); /* 1.5 * 2^23: round to int */
    x = select16(x < lo, lo, x);
    const v16 t = x * splat(1.44269504088896341f) + magic;
    const v16 n = t - magic;
    const v16i ni = (v16i)t - (v16i)magic;
    const v16 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
    v16 y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * r * r + r + splat(1.0f);
    return y * (v16)((ni + 127) << 23);
}

struct call {
    const void *q, *k, *v;
    int64_t q_stride, k_stride, v_stride, out_stride; /* elements between consecutive tokens */
    const int64_t *seq_bounds;                        /* [num_seqs][2]: first, end */
    int64_t num_heads, num_kv_heads, head_dim, max_len;
    int64_t window; /* a sliding window; 0: none */
    float scale;
    void *out;
    int bf16; /* q, k, v and out bf16, else fp32 */
};

static inline float widen(const void *p, int64_t i, int bf16)
{
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Sixteen query rows r0.. r0 + nr - 1 (nr <= 16) of query head hq, as register-blocked tiles:
 * scores 16 rows x 16 keys at a time (each K load feeds 16 FMAs, 16 independent chains), then
 * each row's softmax, then out = P V eight (or fewer, by head size) rows at a time, each V row
 * loaded once for all of them. D is a constant in each specialisation, so the accumulators stay
 * in registers. kt: [D][n16] (K transposed), vt: [n16][D] (rows past the sequence 0), S:
 * [16][n16] scratch; q row r is at q + r * q_stride, out row r at out + r * out_stride. */
static inline __attribute__((always_inline)) void block(const float *restrict q, int64_t q_stride,
                                                        const float *restrict kt,
                                                        const float *restrict vt,
                                                        float *restrict S, int64_t n16,
                                                        int64_t r0, int64_t nr, int64_t W,
                                                        float scale, float *restrict out,
                                                        int64_t out_stride, const int64_t D,
                                                        const int round_p)
{
    const float *qr[16];
    for (int r = 0; r < 16; r++) qr[r] = q + (r0 + (r < nr ? r : 0)) * q_stride;
    const int64_t tiles = (r0 + nr - 1) / 16 + 1;
    const int64_t t_lo = W > 0 && r0 - W + 1 > 0 ? (r0 - W + 1) / 16 : 0; /* first row's window */
    for (int64_t t = t_lo; t < tiles; t++) {
        v16 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = (v16){0};
        const float *kc = kt + t * 16;
        for (int64_t d = 0; d < D; d++) {
            const v16 kd = load16(kc + d * n16);
            for (int r = 0; r < 16; r++) acc[r] += splat(qr[r][d]) * kd;
        }
        for (int r = 0; r < 16; r++) store16(S + r * n16 + t * 16, acc[r] * splat(scale));
    }
    float inv[16];
    for (int64_t r = 0; r < nr; r++) {
        float *sr = S + r * n16;
        const int64_t i = r0 + r, own = i / 16 + 1; /* columns lo..i, in tiles first..own-1 */
        const int64_t lo = W > 0 && i - W + 1 > 0 ? i - W + 1 : 0, first = lo / 16;
        for (int64_t l = first * 16; l < lo; l++) sr[l] = -3.0e38f; /* below any score */
        for (int64_t l = i + 1; l < own * 16; l++) sr[l] = -3.0e38f;
        v16 mx = splat(-3.0e38f);
        for (int64_t t = first; t < own; t++) {
            const v16 x = load16(sr + t * 16);
            mx = select16(x > mx, x, mx);
        }
        const v16 m = splat(hmax16(mx));
        v16 sum;
        for (int64_t t = first; t < own; t++)
            store16(sr + t * 16, exp16(load16(sr + t * 16) - m));
        /* Weight 0 outside lo..i, also in the block's other tiles (its PV below runs over all
         * of them); exp16 floored the masked scores at ~1e-35, so the sum is taken again
         * without them. */
        for (int64_t l = t_lo * 16; l < lo; l++) sr[l] = 0.f;
        for (int64_t l = i + 1; l < tiles * 16; l++) sr[l] = 0.f;
        sum = (v16){0};
        for (int64_t t = first; t < own; t++) sum += load16(sr + t * 16);
        inv[r] = 1.0f / hsum16(sum);
        if (round_p) /* to bf16, nearest even (no NaN here: finite scores, exp16 finite) */
            for (int64_t t = first; t < own; t++) {
                const v16u b = (v16u)load16(sr + t * 16);
                store16(sr + t * 16, (v16)((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u));
            }
    }
    enum { MAXV = 16 };
    const int64_t nv = D / 16, R = nv >= 8 ? 2 : 16 / nv > 8 ? 8 : 16 / nv;
    const int64_t cols = tiles * 16;
    for (int64_t h0 = 0; h0 < nr; h0 += R) {
        v16 o[8][MAXV];
        for (int64_t rr = 0; rr < R; rr++)
            for (int64_t x = 0; x < nv; x++) o[rr][x] = (v16){0};
        for (int64_t j = t_lo * 16; j < cols; j++) {
            const float *vj = vt + j * D;
            for (int64_t rr = 0; rr < R; rr++) {
                const v16 w = splat(S[(h0 + rr < 16 ? h0 + rr : 0) * n16 + j]);
                for (int64_t x = 0; x < nv; x++) o[rr][x] += w * load16(vj + 16 * x);
            }
        }
        for (int64_t rr = 0; rr < R && h0 + rr < nr; rr++) {
            float *orow = out + (r0 + h0 + rr) * out_stride;
            for (int64_t x = 0; x < nv; x++) store16(orow + 16 * x, o[rr][x] * splat(inv[h0 + rr]));
        }
    }
}

static void block_generic(const float *q, int64_t q_stride, const float *kt, const float *vt,
                          float *S, int64_t n16, int64_t r0, int64_t nr, int64_t W, float scale,
                          float *out, int64_t out_stride, int64_t D, int round_p)
{
    block(q, q_stride, kt, vt, S, n16, r0, nr, W, scale, out, out_stride, D, round_p);
}

/* Every query row of KV head h's query heads in one sequence; qo: bf16's scratch for a query
 * head's rows in (and out) in fp32, [max_len][D]. */
static void attend(const struct call *c, int64_t seq, int64_t h, float *kt, float *vt, float *S,
                   float *qo)
{
    const int64_t start = c->seq_bounds[2 * seq], n = c->seq_bounds[2 * seq + 1] - start;
    const int64_t D = c->head_dim, group = c->num_heads / c->num_kv_heads, n16 = (n + 15) & ~15;
    const int bf16 = c->bf16;
    const int64_t es = bf16 ? 2 : 4; /* bytes an element */
    const char *k = c->k, *v = c->v;
    for (int64_t j = 0; j < n; j++) {
        const char *kj = k + ((start + j) * c->k_stride + h * D) * es;
        const char *vj = v + ((start + j) * c->v_stride + h * D) * es;
        if (j + 4 < n) { /* rows are a projection's row apart: ask ahead for the next ones */
            __builtin_prefetch(kj + 4 * c->k_stride * es);
            __builtin_prefetch(vj + 4 * c->v_stride * es);
        }
        for (int64_t d = 0; d < D; d++) kt[d * n16 + j] = widen(kj, d, bf16);
        for (int64_t d = 0; d < D; d++) vt[j * D + d] = widen(vj, d, bf16);
    }
    for (int64_t d = 0; d < D; d++) /* the last tile's columns past n score 0, then drop out */
        for (int64_t j = n; j < n16; j++) kt[d * n16 + j] = 0.f;
    memset(vt + n * D, 0, (size_t)((n16 - n) * D) * sizeof *vt); /* weight 0 times 0, not NaN */
    for (int64_t g = 0; g < group; g++) {
        const int64_t hq = h * group + g;
        const float *q = (const float *)c->q + start * c->q_stride + hq * D;
        float *out = (float *)c->out + start * c->out_stride + hq * D;
        int64_t qs = c->q_stride, os = c->out_stride;
        if (bf16) { /* the head's rows widened; computed into the same rows, rounded after */
            const uint16_t *qb = (const uint16_t *)c->q + start * c->q_stride + hq * D;
            for (int64_t r = 0; r < n; r++)
                for (int64_t d = 0; d < D; d++) qo[r * D + d] = widen(qb + r * qs, d, 1);
            q = out = qo;
            qs = os = D;
        }
        for (int64_t r0 = 0; r0 < n; r0 += 16) {
            const int64_t nr = n - r0 < 16 ? n - r0 : 16;
            const int64_t W = c->window;
            switch (D) {
            case 32: block(q, qs, kt, vt, S, n16, r0, nr, W, c->scale, out, os, 32, bf16); break;
            case 64: block(q, qs, kt, vt, S, n16, r0, nr, W, c->scale, out, os, 64, bf16); break;
            case 128: block(q, qs, kt, vt, S, n16, r0, nr, W, c->scale, out, os, 128, bf16); break;
            default: block_generic(q, qs, kt, vt, S, n16, r0, nr, W, c->scale, out, os, D, bf16);
            }
        }
        if (bf16) {
            uint16_t *ob = (uint16_t *)c->out + start * c->out_stride + hq * D;
            for (int64_t r = 0; r < n; r++)
                for (int64_t d = 0; d < D; d++) ob[r * c->out_stride + d] = f32_to_bf16(qo[r * D + d]);
        }
    }
}

/* Work items [w0, w1) with a scratch buffer of their own: 0, or 1 if it could not be had. */
static int run_part(const struct call *c, int64_t w0, int64_t w1)
{
    const int64_t n16 = (c->max_len + 15) & ~15, D = c->head_dim;
    const int64_t qo = c->bf16 ? D * n16 : 0;
    float *buf = malloc(sizeof(float) * (size_t)(2 * D * n16 + 16 * n16 + qo));
    if (buf == NULL) return 1;
    for (int64_t w = w0; w < w1; w++)
        attend(c, w / c->num_kv_heads, w % c->num_kv_heads, buf, buf + D * n16, buf + 2 * D * n16,
               buf + 2 * D * n16 + 16 * n16);
    free(buf);
    return 0;
}

static int run(const struct call *c, int64_t num_seqs, int64_t parts)
{
    const int64_t work = num_seqs * c->num_kv_heads;
    if (parts > work) parts = work;
    if (parts < 1) parts = 1;
    /* The parts run on torch's OpenMP team (see paged_decode_attention.c's split_rows). */
    int failed = 0;
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(| : failed)
    for (int64_t i = 0; i < parts; i++) failed |= run_part(c, work * i / parts, work * (i + 1) / parts);
    return failed;
}

/* 0 on success; 1 if scratch memory could not be had (out is then incomplete). */
int baton_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                                const float *v, int64_t v_stride, const int64_t *seq_bounds,
                                int64_t num_seqs, int64_t max_len, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t window,
                                float scale, float *out, int64_t out_stride, int64_t parts)
{
    const struct call c = {q, k, v, q_stride, k_stride, v_stride, out_stride, seq_bounds,
                           num_heads, num_kv_heads, head_dim, max_len, window, scale, out, 0};
    return run(&c, num_seqs, parts);
}

/* The same over a bf16 model's rows (the file's comment): strides in elements. */
int baton_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                                 int64_t k_stride, const uint16_t *v, int64_t v_stride,
                                 const int64_t *seq_bounds, int64_t num_seqs, int64_t max_len,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t window, float scale, uint16_t *out, int64_t out_stride,
                                 int64_t parts)
{
    const struct call c = {q, k, v, q_stride, k_stride, v_stride, out_stride, seq_bounds,
                           num_heads, num_kv_heads, head_dim, max_len, window, scale, out, 1};
    return run(&c, num_seqs, parts);
}

/* Lanes of the vector registers this build has (vec16.h's VN). The 16 x 16 register tiles
 * above are written for AVX-512's thirty-two 16-lane registers: on AVX2 a tile's sums take all
 * sixteen registers twice over and its compares run lane by lane, and a prompt's forward ran
 * slower than with SDPA, so the engines keep SDPA there (kernels/cpu/prefill_attention.py). */
int64_t baton_prefill_attention_lanes(void) { return VN; }
