/* Decode attention over Baton's int8 KV cache with a full-precision window, CPU, fp32 queries,
 * in two passes around a softmax (torch's), like paged_decode_attention.c.
 *
 * The int8 pool of one layer holds [num_blocks, block_size, num_kv_heads, D + 4] bytes per K/V:
 * each (token, KV head) row is D int8 values then its fp32 scale (kv_codec.py). The window's
 * full-precision copy lives in slots of the same pool (fp_window.py): slot s holds
 * `sub_block` tokens' rows of [num_kv_heads, D] floats at its start, so the window is a paged
 * fp32 cache of block size sub_block whose blocks are `slot_floats` floats apart.
 *
 * Row b reads positions [start8, end8) from int8 rows (block table `tables`, block_size) and
 * positions [startf, endf) of its window from the slots (table `fp_tables`, relative to the
 * window's first position). Its scores columns: the int8 part first, then the window's:
 *
 *   scores[b, hq, c] = scale * s_t * (q[b, hq] . k8_t)     c = t - start8        (int8 rows)
 *   scores[b, hq, n8 + c] = scale * q[b, hq] . kf_t         c = t - startf        (window)
 *   -inf past n8 + nf (the padding to `stride`)
 *   out[b, hq] = sum_t p * s_t * v8_t + sum_t p * vf_t
 *
 * s_t is the row's scale: the int8 values are exact in fp32, so the dot runs on them and the
 * scale multiplies the score (K) or the probability (V). Query head hq uses KV head hq / group.
 * The batch splits into up to `parts` row ranges on threads of our own (why not the caller's:
 * paged_decode_attention.c). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec16.h"

struct args {
    const float *in;     /* q (scores) or probs (values) */
    const int8_t *pool8; /* the layer's K or V int8 pool */
    const float *poolf;  /* the same pool's base, read as slots of floats */
    const int64_t *tables, *fp_tables;
    int64_t max_blocks, max_fp_blocks;
    const int64_t *bounds; /* [B][4]: start8, end8, startf, endf */
    int64_t num_heads, num_kv_heads, head_dim, block_size, sub_block, slot_floats;
    float scale;
    float *out;
    int64_t stride;
};

static inline const int8_t *row8(const struct args *a, const int64_t *table, int64_t t)
{
    const int64_t width = a->head_dim + 4;
    return a->pool8 + ((table[t / a->block_size] * a->block_size + t % a->block_size) *
                       a->num_kv_heads) * width;
}

static inline const float *rowf(const struct args *a, const int64_t *table, int64_t t)
{
    return a->poolf + table[t / a->sub_block] * a->slot_floats +
           (t % a->sub_block) * a->num_kv_heads * a->head_dim;
}

#ifdef VEC16_SHUFFLES
#define BATON_VECTOR_SCORES 1
/* VN tokens at a time (vec16.h: sixteen with AVX-512, eight on AVX2) for head sizes that are
 * multiples of VN, as paged_decode_attention.c does: each token's dot folded to a vector, then
 * one transpose-and-add tree for all VN sums (a horizontal reduction per token and head would be
 * most of this pass, and made it several times slower than the fp32 kernel's). */

/* VN int8 values as floats. GCC 12 widens an int8 vector type lane by lane (scalar sign
 * extensions and inserts: the pass ran at ~50 cycles a dot), so the x86 widening instructions
 * are named where the target has them. */
static inline vn loadn_i8(const int8_t *p)
{
    vn out;
#if VN == 16 && defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
    memcpy(&out, &f, sizeof out);
#elif VN == 8 && defined(__AVX2__)
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p)));
    memcpy(&out, &f, sizeof out);
#else
    typedef int8_t vni8 __attribute__((vector_size(VN)));
    vni8 v;
    memcpy(&v, p, sizeof v);
    out = __builtin_convertvector(__builtin_convertvector(v, vni), vn);
#endif
    return out;
}

/* Scores of positions [t0, t1) of one row into sb[.. + col0 ..]: int8 rows (scaled per row)
 * when `int8`, else the window's float rows. */
static inline __attribute__((always_inline)) void
scores_vec(const struct args *a, const float *q, const int64_t *table, int64_t t0, int64_t t1,
           const int int8, float *sb, int64_t col0, const int64_t D)
{
    const int64_t H = a->num_heads, group = H / a->num_kv_heads, W = D + 4;
    const void *rows[VN];
    float scales[VN];
    for (int64_t t = t0; t < t1; t += VN) {
        const int64_t n = t1 - t < VN ? t1 - t : VN;
        for (int64_t j = 0; j < VN; j++) { /* rows past the range repeat the first */
            const int64_t tj = t + (j < n ? j : 0);
            if (int8) {
                const int8_t *r = row8(a, table, tj);
                rows[j] = r;
                scales[j] = 0.f;
                (void)W;
            } else {
                rows[j] = rowf(a, table, tj);
                scales[j] = 1.f;
            }
        }
        for (int64_t hq = 0; hq < H; hq++) {
            const float *qh = q + hq * D;
            const int64_t kh = hq / group;
            vn acc[VN];
            for (int j = 0; j < VN; j++) {
                vn x = (vn){0};
                if (int8) {
                    const int8_t *k = (const int8_t *)rows[j] + kh * W;
                    for (int64_t c = 0; c < D; c += VN) x += loadn(qh + c) * loadn_i8(k + c);
                    memcpy(&scales[j], k + D, sizeof(float));
                } else {
                    const float *k = (const float *)rows[j] + kh * D;
                    for (int64_t c = 0; c < D; c += VN) x += loadn(qh + c) * loadn(k + c);
                }
                acc[j] = x;
            }
            const vn r = sumn(acc) * loadn(scales) * a->scale;
            float out[VN];
            storen(out, r);
            memcpy(sb + hq * a->stride + col0 + (t - t0), out, (size_t)n * sizeof *out);
        }
    }
}
#endif

static void scores_rows(const struct args *a, int64_t b0, int64_t b1)
{
    const int64_t H = a->num_heads, D = a->head_dim, group = H / a->num_kv_heads, W = D + 4;
    for (int64_t b = b0; b < b1; b++) {
        const float *q = a->in + b * H * D;
        float *sb = a->out + b * H * a->stride;
        const int64_t *bd = a->bounds + 4 * b, n8 = bd[1] - bd[0], nf = bd[3] - bd[2];
        const int64_t *table = a->tables + b * a->max_blocks;
        const int64_t *fp_table = a->fp_tables + b * a->max_fp_blocks;
#ifdef BATON_VECTOR_SCORES
        if (D % VN == 0) {
            switch (D) { /* each head size its own unrolled loops */
            case 32:
                scores_vec(a, q, table, bd[0], bd[1], 1, sb, 0, 32);
                scores_vec(a, q, fp_table, bd[2], bd[3], 0, sb, n8, 32);
                break;
            case 64:
                scores_vec(a, q, table, bd[0], bd[1], 1, sb, 0, 64);
                scores_vec(a, q, fp_table, bd[2], bd[3], 0, sb, n8, 64);
                break;
            case 128:
                scores_vec(a, q, table, bd[0], bd[1], 1, sb, 0, 128);
                scores_vec(a, q, fp_table, bd[2], bd[3], 0, sb, n8, 128);
                break;
            default:
                scores_vec(a, q, table, bd[0], bd[1], 1, sb, 0, D);
                scores_vec(a, q, fp_table, bd[2], bd[3], 0, sb, n8, D);
            }
            for (int64_t hq = 0; hq < H; hq++)
                for (int64_t c = n8 + nf; c < a->stride; c++) sb[hq * a->stride + c] = -INFINITY;
            continue;
        }
#endif
        for (int64_t t = bd[0]; t < bd[1]; t++) {
            const int8_t *r = row8(a, table, t);
            for (int64_t hq = 0; hq < H; hq++) {
                const int8_t *k = r + hq / group * W;
                const float *qh = q + hq * D;
                float s, acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; d++) acc += qh[d] * (float)k[d];
                memcpy(&s, k + D, sizeof s);
                sb[hq * a->stride + t - bd[0]] = acc * s * a->scale;
            }
        }
        for (int64_t t = bd[2]; t < bd[3]; t++) {
            const float *r = rowf(a, fp_table, t);
            for (int64_t hq = 0; hq < H; hq++) {
                const float *k = r + hq / group * D, *qh = q + hq * D;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; d++) acc += qh[d] * k[d];
                sb[hq * a->stride + n8 + t - bd[2]] = acc * a->scale;
            }
        }
        for (int64_t hq = 0; hq < H; hq++)
            for (int64_t c = n8 + nf; c < a->stride; c++) sb[hq * a->stride + c] = -INFINITY;
    }
}

static inline __attribute__((always_inline)) void values_d(const struct args *a, int64_t b0,
                                                            int64_t b1, const int64_t D)
{
    const int64_t H = a->num_heads, group = H / a->num_kv_heads, W = D + 4;
    float acc[D];
    for (int64_t b = b0; b < b1; b++) {
        const int64_t *bd = a->bounds + 4 * b, n8 = bd[1] - bd[0];
        const int64_t *table = a->tables + b * a->max_blocks;
        const int64_t *fp_table = a->fp_tables + b * a->max_fp_blocks;
        for (int64_t hq = 0; hq < H; hq++) {
            const float *p = a->in + (b * H + hq) * a->stride;
#ifdef BATON_VECTOR_SCORES
            if (D % VN == 0 && D <= 16 * VN) { /* widened VN lanes at a time, as the scores */
                vn va[16];
                for (int64_t x = 0; x < D / VN; x++) va[x] = (vn){0};
                for (int64_t t = bd[0]; t < bd[1]; t++) {
                    const int8_t *v = row8(a, table, t) + hq / group * W;
                    float s;
                    memcpy(&s, v + D, sizeof s);
                    const float w = p[t - bd[0]] * s;
                    for (int64_t x = 0; x < D / VN; x++) va[x] += w * loadn_i8(v + VN * x);
                }
                for (int64_t t = bd[2]; t < bd[3]; t++) {
                    const float *v = rowf(a, fp_table, t) + hq / group * D, w = p[n8 + t - bd[2]];
                    for (int64_t x = 0; x < D / VN; x++) va[x] += w * loadn(v + VN * x);
                }
                memcpy(a->out + (b * H + hq) * D, va, (size_t)D * sizeof(float));
                continue;
            }
#endif
            memset(acc, 0, sizeof acc);
            for (int64_t t = bd[0]; t < bd[1]; t++) {
                const int8_t *v = row8(a, table, t) + hq / group * W;
                float s;
                memcpy(&s, v + D, sizeof s);
                const float w = p[t - bd[0]] * s;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[d] += w * (float)v[d];
            }
            for (int64_t t = bd[2]; t < bd[3]; t++) {
                const float *v = rowf(a, fp_table, t) + hq / group * D, w = p[n8 + t - bd[2]];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[d] += w * v[d];
            }
            memcpy(a->out + (b * H + hq) * D, acc, sizeof acc);
        }
    }
}

static void values_rows(const struct args *a, int64_t b0, int64_t b1)
{
    switch (a->head_dim) {
    case 32: values_d(a, b0, b1, 32); break;
    case 64: values_d(a, b0, b1, 64); break;
    case 128: values_d(a, b0, b1, 128); break;
    default: values_d(a, b0, b1, a->head_dim);
    }
}

typedef void (*rows_fn)(const struct args *, int64_t, int64_t);

/* The parts run on torch's OpenMP team (see paged_decode_attention.c's split_rows). */
static void split_rows(rows_fn fn, const struct args *a, int64_t batch, int64_t parts)
{
    if (parts > batch) parts = batch;
    if (parts <= 1) {
        fn(a, 0, batch);
        return;
    }
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int64_t i = 0; i < parts; i++) fn(a, batch * i / parts, batch * (i + 1) / parts);
}

/* `pool` is one layer's K (scores) or V (values) pool; `in` q [B, H, D] or probs [B, H, stride];
 * `out` scores [B, H, stride] or out [B, H, D]. */
void baton_paged_decode_int8(int64_t values, const float *in, const int8_t *pool,
                             const int64_t *tables, int64_t max_blocks, const int64_t *fp_tables,
                             int64_t max_fp_blocks, const int64_t *bounds, int64_t batch,
                             int64_t parts, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t sub_block,
                             float scale, float *out, int64_t stride)
{
    const int64_t slot_floats = block_size * num_kv_heads * (head_dim + 4) / 4;
    const struct args a = {in, pool, (const float *)(const void *)pool, tables, fp_tables,
                           max_blocks, max_fp_blocks, bounds, num_heads, num_kv_heads, head_dim,
                           block_size, sub_block, slot_floats, scale, out, stride};
    split_rows(values ? values_rows : scores_rows, &a, batch, parts);
}

/* Quantise and store new tokens' K or V rows: x [num_tokens][num_kv_heads][head_dim] floats
 * (tokens `x_stride` floats apart: views of a fused projection) into packed rows at `slots` of
 * `pool`. The rule and its rounding are kv_codec.py's (kernels/triton/int8_kv.py's torch reference):
 * amax = max |x|, q = floor(x * (127 / amax) + 0.5) clamped to +-127, scale = amax / 127, each
 * product and sum rounded on its own (ISO C: no contraction into FMAs), so the bytes are
 * torch's. */
void baton_store_int8(const float *x, int64_t x_stride, int64_t num_tokens, int64_t num_kv_heads,
                      int64_t head_dim, const int64_t *slots, int8_t *pool)
{
    const int64_t width = head_dim + 4;
    for (int64_t i = 0; i < num_tokens; i++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const float *row = x + i * x_stride + h * head_dim;
            int8_t *out = pool + (slots[i] * num_kv_heads + h) * width;
            float amax = 0.f;
            for (int64_t d = 0; d < head_dim; d++) {
                const float m = fabsf(row[d]);
                amax = m > amax ? m : amax;
            }
            const float inv = amax > 0.f ? 127.0f / amax : 0.f, scale = amax / 127.0f;
            for (int64_t d = 0; d < head_dim; d++) {
                const float prod = row[d] * inv;
                float q = floorf(prod + 0.5f);
                q = q < -127.f ? -127.f : q > 127.f ? 127.f : q;
                out[d] = (int8_t)q;
            }
            memcpy(out + head_dim, &scale, sizeof scale);
        }
    }
}
