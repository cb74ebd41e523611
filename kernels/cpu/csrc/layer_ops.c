/* The elementwise ops of a decoder layer, fused, CPU, over fp32 or bf16 rows: RMSNorm (after the
 * residual add), SiLU(gate) * up; rotate-half RoPE in bf16 (fp32's is rope.c, bit-equal to torch).
 *
 * torch runs each op as its own pass with a fresh output (and in bf16 widens to fp32, computes and
 * rounds back each time): in a bf16 prefill wave these passes cost a large share beside the
 * projections (docs/perf-log.md, "Elementwise ops in C"); a decode step of a small model pays
 * each op's dispatch instead (an fp32 RMSNorm is six ATen calls). Here each row is read once,
 * computed in fp32 in registers, and written once.
 *
 * Rounding: RMSNorm and the residual add round where transformers does (bf16: the sum to bf16, the
 * normalised row to bf16, then weight * it to bf16; fp32: x * r, then weight * it), so only the
 * fp32 sum of squares' order differs from torch's; SiLU * up rounds once at the end (bf16) or
 * computes e^-g to ~2 ulp (fp32): close to torch's values, not bit-equal to them. bf16 <-> fp32
 * by bit shifts, round to nearest even, NaN kept quiet: portable C that -march=native vectorises.
 * Each op is written once, for an element type that is a constant where it is inlined.
 *
 * Each call splits its rows into `parts` contiguous ranges on torch's OpenMP team (this library
 * links libgomp, which resolves to the copy torch has loaded: one runtime, one team, as in
 * paged_decode_attention.c); a row is computed the same way whichever thread takes it, and no
 * core of the step's budget waits while one thread computes them all. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

typedef union {
    uint32_t u;
    float f;
} bits32;

static inline float widen(uint16_t b)
{
    const bits32 v = {.u = (uint32_t)b << 16};
    return v.f;
}

static inline uint16_t narrow(float f)
{
    const bits32 v = {.f = f};
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    const uint32_t quiet = (v.u >> 16) | 0x40u; /* a NaN stays a NaN */
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

#define INLINE static inline __attribute__((always_inline))

/* Element i of fp32 (bf16 = 0) or bf16 (bf16 = 1) rows, as fp32; v stored as one. */
INLINE float ld(const void *p, int64_t i, int bf16)
{
    return bf16 ? widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st(void *p, int64_t i, float v, int bf16)
{
    if (bf16)
        ((uint16_t *)p)[i] = narrow(v);
    else
        ((float *)p)[i] = v;
}

/* v as the element type holds it. */
INLINE float rnd(float v, int bf16) { return bf16 ? widen(narrow(v)) : v; }

INLINE void norm_row(const void *restrict x, int64_t cols, const void *restrict w, float eps,
                     void *restrict out, int bf16)
{
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < cols; c++) {
        const float v = ld(x, c, bf16);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)cols + eps);
    for (int64_t c = 0; c < cols; c++)
        st(out, c, ld(w, c, bf16) * rnd(ld(x, c, bf16) * r, bf16), bf16);
}

/* h[r] += delta[r] (rounded to h's type, in place), then out[r] = w * rms_norm(h[r]). */
INLINE void add_norm_row(void *restrict h, const void *restrict delta, int64_t cols,
                         const void *restrict w, float eps, void *restrict out, int bf16)
{
    for (int64_t c = 0; c < cols; c++) st(h, c, ld(h, c, bf16) + ld(delta, c, bf16), bf16);
    norm_row(h, cols, w, eps, out, bf16);
}

/* The exported entry points, one per element type, each with its own parallel loop: the loop's
 * body is outlined for OpenMP before inlining, so an element type passed into a shared one would
 * stay a run-time branch in every element's load and store (and the loops scalar). */

/* out[r] = w * rms_norm(x[r]); rows of x are x_stride elements apart, out is contiguous. */
void baton_rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t x_stride,
                         const uint16_t *w, float eps, uint16_t *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, cols, w, eps, out + r * cols, 1);
}

void baton_rms_norm_f32(const float *x, int64_t rows, int64_t cols, int64_t x_stride,
                        const float *w, float eps, float *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, cols, w, eps, out + r * cols, 0);
}

/* h += delta (rounded to h's type, in place), then out = w * rms_norm(h); all contiguous. */
void baton_add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, int64_t rows, int64_t cols,
                             const uint16_t *w, float eps, uint16_t *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++)
        add_norm_row(h + r * cols, delta + r * cols, cols, w, eps, out + r * cols, 1);
}

void baton_add_rms_norm_f32(float *h, const float *delta, int64_t rows, int64_t cols,
                            const float *w, float eps, float *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++)
        add_norm_row(h + r * cols, delta + r * cols, cols, w, eps, out + r * cols, 0);
}

/* VN fp32 lanes (vec16.h: the CPU's widest vector) to bf16 at p, rounded as narrow() rounds. */
static inline void narrown(uint16_t *p, vn f)
{
    const vnu u = (vnu)f;
    const vnu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vni nan = (vni)((u & 0x7fffffffu) > 0x7f800000u);
    const vnu out = ((vnu)nan & ((u >> 16) | 0x40u)) | (~(vnu)nan & rounded);
    const vnh h = __builtin_convertvector(out, vnh);
    memcpy(p, &h, sizeof h);
}

/* silu(g) * u over VN lanes in GCC's vector types (vec16.h; the compiler does not vectorise the
 * scalar form; VN, not sixteen: on AVX2 GCC splits a 16-lane compare or conversion into scalar
 * code). e^-g as Cephes' expf, to ~2 ulp of fp32 (expn_clamped); libm's expf is a scalar call,
 * far slower here. The argument is clamped to [-87.3, 88] (e^x below is taken as 2^-126, above
 * as e^88: silu moves by under 1e-36, its bf16 value not at all). A NaN lane stays NaN;
 * silu(+inf) * u is inf * u, silu(-inf) -inf * u. */
static inline vn silu_muln(vn g, vn u)
{
    vn x = -g;
    const vn zero = {0}, lo = zero - 87.3f, hi = zero + 88.0f; /* NaN fails both tests */
    vni m = x < lo;
    x = (vn)(((vni)lo & m) | ((vni)x & ~m));
    m = x > hi;
    x = (vn)(((vni)hi & m) | ((vni)x & ~m));
    const vn e = expn_clamped(x);
    return g / (1.0f + e) * u;
}

/* f stored as VN elements at p (loadn_as, vec16.h, reads them). */
INLINE void storen_as(void *p, vn f, int bf16)
{
    if (bf16)
        narrown(p, f);
    else
        memcpy(p, &f, sizeof f);
}

/* out = silu(g) * u for one row of inter elements. A tail past the last VN lanes goes through
 * a zero-padded vector. */
INLINE void silu_mul_row(const void *g, const void *u, int64_t inter, void *o, int bf16)
{
    const int64_t es = bf16 ? 2 : 4;
    int64_t c = 0;
    for (; c + VN <= inter; c += VN)
        storen_as((char *)o + c * es,
                  silu_muln(loadn_as((const char *)g + c * es, bf16),
                            loadn_as((const char *)u + c * es, bf16)),
                  bf16);
    if (c < inter) {
        float gt[VN] = {0}, ut[VN] = {0}, ot[VN];
        memcpy(gt, (const char *)g + c * es, (size_t)(inter - c) * es);
        memcpy(ut, (const char *)u + c * es, (size_t)(inter - c) * es);
        storen_as(ot, silu_muln(loadn_as(gt, bf16), loadn_as(ut, bf16)), bf16);
        memcpy((char *)o + c * es, ot, (size_t)(inter - c) * es);
    }
}

/* out[r, :] = silu(gu[r, :inter]) * gu[r, inter:2*inter]; rows of gu are gu_stride elements
 * apart, out is contiguous. */
void baton_silu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t inter, int64_t gu_stride,
                         uint16_t *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gu + r * gu_stride, gu + r * gu_stride + inter, inter, out + r * inter, 1);
}

void baton_silu_mul_f32(const float *gu, int64_t rows, int64_t inter, int64_t gu_stride,
                        float *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gu + r * gu_stride, gu + r * gu_stride + inter, inter, out + r * inter, 0);
}

/* x[t, h, :] <- x * cos[t] + swap_halves(x) * sin[t] in place (sin's first half negated, as
 * model.rope_tables makes it); heads contiguous in a row, rows token_stride apart. */
void baton_rope_bf16(uint16_t *x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                     int64_t token_stride, const uint16_t *cos, const uint16_t *sin,
                     int64_t parts)
{
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        float row[512]; /* head_dim <= 512, checked by the caller */
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *restrict xh = x + t * token_stride + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) row[d] = widen(xh[d]);
            for (int64_t d = 0; d < half; d++)
                xh[d] = narrow(row[d] * widen(c[d]) + row[d + half] * widen(s[d]));
            for (int64_t d = half; d < head_dim; d++)
                xh[d] = narrow(row[d] * widen(c[d]) + row[d - half] * widen(s[d]));
        }
    }
}
