/* fp32 lanes in GCC's vector types, as the attention and elementwise kernels compute
 * (paged_decode_attention.c, paged_decode_int8.c, prefill_attention.c, layer_ops.c, argmax.c):
 * v16, sixteen lanes (AVX-512 where -march=native has it, pairs of AVX2 registers elsewhere),
 * and vn, the CPU's own width (sixteen or eight). Loads and stores through memcpy (no alignment
 * assumed), bf16 widened by its bit pattern (a bf16 is a float's top half), Cephes' e^x, and the
 * transpose-and-add of a tile's sums. Included by each source; the native build keys a library
 * on the headers its source includes (kernels/cpu/build.py). */
#ifndef BATON_VEC16_H
#define BATON_VEC16_H
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

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

/* The widest vector the CPU holds in one register: sixteen lanes with AVX-512, eight on AVX2.
 * Loops that keep many vectors live (a tile of a token per vector, sums across a group) are
 * written in it: a v16 on AVX2 is a pair of registers, and a tile of sixteen of them spilled
 * to the stack, most of the attention kernel's time on a Zen 3 (docs/perf-log.md, "Decode
 * attention on AVX2"). */
#if defined(__AVX512F__)
#define VN 16
#else
#define VN 8
#endif
typedef float vn __attribute__((vector_size(VN * 4)));
typedef int32_t vni __attribute__((vector_size(VN * 4)));
typedef uint32_t vnu __attribute__((vector_size(VN * 4)));
typedef uint16_t vnh __attribute__((vector_size(VN * 2)));

static inline vn loadn(const float *p)
{
    vn v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storen(float *p, vn v) { memcpy(p, &v, sizeof v); }

/* e^x over VN lanes for x the caller clamped to [-87.3, 88] (NaN passes): x = n ln2 + r, a
 * degree-6 polynomial in r (Cephes' expf, ~2 ulp), times 2^n built in the exponent bits. */
static inline vn expn_clamped(vn x)
{
    const vn t = x * 1.44269504088896341f + 0.5f;
    vni ni = __builtin_convertvector(t, vni); /* truncates: one more than floor where t < 0 */
    ni += (vni)(__builtin_convertvector(ni, vn) > t); /* a true lane is -1: floor(t) */
    const vn n = __builtin_convertvector(ni, vn);
    vn r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vn p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vn)((vnu)(ni + 127) << 23);
}

/* VN fp32 (bf16 = 0) or bf16 (bf16 = 1) elements from p, as fp32 (a bf16 widens exactly). */
static inline __attribute__((always_inline)) vn loadn_as(const void *p, int bf16)
{
    if (!bf16) return loadn(p);
    vnh h;
    memcpy(&h, p, sizeof h);
    const vnu w = __builtin_convertvector(h, vnu) << 16;
    vn v;
    memcpy(&v, &w, sizeof v);
    return v;
}

#ifdef VEC16_SHUFFLES
/* r[j] = sum of the lanes of a[j], j < VN: sum16, or its three levels for eight lanes. */
static inline vn sumn(vn a[VN])
{
#if VN == 16
    return sum16(a);
#else
    vn c[4], d[2];
    for (int i = 0; i < 4; i++)
        c[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        d[i] = SHUF(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + SHUF(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUF(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUF(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}
#endif

#endif
