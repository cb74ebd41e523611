/* The elementwise ops of a bf16 decoder layer, fused, CPU: RMSNorm (after the residual add),
 * SiLU(gate) * up, rotate-half RoPE.
 *
 * torch runs each bf16 op as its own pass that widens to fp32, computes and rounds back, with a
 * fresh output each time: in a 16 x 128-token prefill wave of the qwen2-0.5b bench shape (one
 * thread, AMX Xeon) mul / silu / add / pow / copy took ~0.9 s of 2.9 s, next to 1.5 s of
 * projections. Here each row is read once, widened to fp32 in registers, and written once.
 *
 * Rounding: RMSNorm and the residual add round where transformers does (the sum to bf16, the
 * normalised row to bf16, then weight * it to bf16), so only the fp32 sum order differs;
 * SiLU * up and RoPE round once at the end instead of after every op (closer to the exact
 * value than torch's chain, not bit-equal to it). bf16 <-> fp32 by bit shifts, round to
 * nearest even, NaN kept quiet: portable C that -march=native vectorises.
 *
 * Each call splits its rows into `parts` contiguous ranges on torch's OpenMP team (this library
 * links libgomp, which resolves to the copy torch has loaded: one runtime, one team, as in
 * paged_decode_attention.c); a row is computed the same way whichever thread takes it. They ran
 * on the calling thread alone before, while the other core waited: in a 16 x 128-token bf16
 * prefill wave of the Qwen2-0.5B shape, SiLU * up alone took 9.4 ms a layer (2 threads asked). */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

static void norm_row(const uint16_t *restrict x, int64_t cols, const uint16_t *restrict w,
                     float eps, uint16_t *restrict out)
{
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < cols; c++) {
        const float v = widen(x[c]);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)cols + eps);
    for (int64_t c = 0; c < cols; c++)
        out[c] = narrow(widen(w[c]) * widen(narrow(widen(x[c]) * r)));
}

/* out[r] = w * rms_norm(x[r]); rows of x are x_stride apart, out is contiguous. */
void baton_rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t x_stride,
                         const uint16_t *w, float eps, uint16_t *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, cols, w, eps, out + r * cols);
}

/* h += delta (rounded to bf16, in place), then out = w * rms_norm(h); all contiguous. */
void baton_add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, int64_t rows, int64_t cols,
                             const uint16_t *w, float eps, uint16_t *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *restrict hr = h + r * cols;
        const uint16_t *restrict dr = delta + r * cols;
        for (int64_t c = 0; c < cols; c++) hr[c] = narrow(widen(hr[c]) + widen(dr[c]));
        norm_row(hr, cols, w, eps, out + r * cols);
    }
}

/* silu(g) * u over 16 lanes in GCC's vector types (the compiler does not vectorise the scalar
 * form). e^-g as Cephes' expf, to ~2 ulp of fp32: -g = n ln2 + r, a degree-6 polynomial in r,
 * times 2^n built in the exponent bits; libm's expf is a scalar call, ~10x slower here. The
 * argument is clamped to [-87.3, 88] (e^x below is taken as 2^-126; silu's bf16 value is the
 * same either way). A NaN lane stays NaN; silu(+inf) * u is inf * u, silu(-inf) -inf * u. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f widen16(const uint16_t *p)
{
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

static inline void narrow16(uint16_t *p, v16f f)
{
    const v16u u = (v16u)f;
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
    const v16u out = ((v16u)nan & ((u >> 16) | 0x40u)) | (~(v16u)nan & rounded);
    const v16h h = __builtin_convertvector(out, v16h);
    memcpy(p, &h, sizeof h);
}

static inline v16f silu_mul16(v16f g, v16f u)
{
    v16f x = -g;
    const v16f zero = {0}, lo = zero - 87.3f, hi = zero + 88.0f; /* NaN fails both tests */
    v16i m = x < lo;
    x = (v16f)(((v16i)lo & m) | ((v16i)x & ~m));
    m = x > hi;
    x = (v16f)(((v16i)hi & m) | ((v16i)x & ~m));
    const v16f t = x * 1.44269504088896341f + 0.5f;
    v16i ni = __builtin_convertvector(t, v16i); /* truncates: one less where t < 0 */
    ni += (v16i)(__builtin_convertvector(ni, v16f) > t); /* a true lane is -1 */
    const v16f n = __builtin_convertvector(ni, v16f);
    v16f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v16f e = p * (v16f)((v16u)(ni + 127) << 23);
    return g / (1.0f + e) * u;
}

/* out[r, :] = silu(gu[r, :inter]) * gu[r, inter:2*inter]; rows of gu are gu_stride apart. A row's
 * tail past its last 16 lanes goes through a zero-padded vector. */
void baton_silu_mul_bf16(const uint16_t *gu, int64_t rows, int64_t inter, int64_t gu_stride,
                         uint16_t *out, int64_t parts)
{
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * gu_stride, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t c = 0;
        for (; c + 16 <= inter; c += 16) narrow16(o + c, silu_mul16(widen16(g + c), widen16(u + c)));
        if (c < inter) {
            uint16_t gt[16] = {0}, ut[16] = {0}, ot[16];
            memcpy(gt, g + c, (size_t)(inter - c) * 2);
            memcpy(ut, u + c, (size_t)(inter - c) * 2);
            narrow16(ot, silu_mul16(widen16(gt), widen16(ut)));
            memcpy(o + c, ot, (size_t)(inter - c) * 2);
        }
    }
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
