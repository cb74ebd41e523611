/* Sixteen fp32 lanes in GCC's vector types, as the attention and elementwise kernels compute
 * (paged_decode_attention.c, paged_decode_int8.c, prefill_attention.c, layer_ops.c): AVX-512
 * where -march=native has it, pairs of AVX2 registers elsewhere. Loads and stores through
 * memcpy (no alignment assumed), bf16 widened by its bit pattern (a bf16 is a float's top
 * half), Cephes' e^x, and the transpose-and-add of sixteen vectors' sums. Included by each
 * source; the native build keys a library on the headers its source includes
 * (kernels/cpu/build.py). */
#ifndef BATON_VEC16_H
#define BATON_VEC16_H
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* Sixteen bf16 values from p, as fp32 (exact). */
static inline v16 widen16(const uint16_t *p)
{
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u w = __builtin_convertvector(h, v16u) << 16;
    v16 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

/* Sixteen fp32 (bf16 = 0) or bf16 (bf16 = 1) elements from p, as fp32: a constant bf16 where
 * this is inlined leaves no branch. */
static inline __attribute__((always_inline)) v16 load16_as(const void *p, int bf16)
{
    if (!bf16) return load16(p);
    return widen16(p);
}

/* e^x over 16 lanes for x the caller clamped to [-87.3, 88] (NaN passes): x = n ln2 + r, a
 * degree-6 polynomial in r (Cephes' expf, ~2 ulp), times 2^n built in the exponent bits. */
static inline v16 exp16_clamped(v16 x)
{
    const v16 t = x * 1.44269504088896341f + 0.5f;
    v16i ni = __builtin_convertvector(t, v16i); /* truncates: one more than floor where t < 0 */
    ni += (v16i)(__builtin_convertvector(ni, v16) > t); /* a true lane is -1: floor(t) */
    const v16 n = __builtin_convertvector(ni, v16);
    v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v16)((v16u)(ni + 127) << 23);
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
/* __builtin_shufflevector: GCC 12 on. */
#define VEC16_SHUFFLES 1
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

/* r[j] = sum of the lanes of a[j], j < 16: four levels of transpose-and-add (30 shuffles and
 * 15 adds for 16 sums) instead of one horizontal reduction per vector (~8 ops each). */
static inline v16 sum16(v16 a[16])
{
    v16 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUF(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                    30, 31);
    for (int i = 0; i < 4; i++)
        d[i] = SHUF(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUF(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                    31);
    for (int i = 0; i < 2; i++)
        e[i] = SHUF(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUF(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                    31);
    return SHUF(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUF(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

#endif
