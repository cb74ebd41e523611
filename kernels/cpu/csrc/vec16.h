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

/* 2 VN bf16 elements from p as two fp32 vectors: the even-indexed elements and the odd ones.
 * Each 32-bit lane holds a pair, the even element in its low half: shifted up it is the even
 * element's fp32, masked it is the odd one's. Two operations for 2 VN elements, where widening
 * them in order takes a zero-extend across lanes per VN / 2 (and GCC splits those further): a
 * kernel that only sums products can take its operands in this order, with the other operand
 * permuted to match (pair_order). */
static inline __attribute__((always_inline)) void load_pairs(const void *p, vn *even, vn *odd)
{
    vnu w;
    memcpy(&w, p, sizeof w);
    const vnu e = w << 16, o = w & 0xffff0000u;
    memcpy(even, &e, sizeof e);
    memcpy(odd, &o, sizeof o);
}

/* dst[0, n) = src[0, n) in load_pairs' order, n a multiple of 2 VN: per 2 VN elements, the even
 * ones, then the odd ones. */
static inline void pair_order(const float *src, int64_t n, float *dst)
{
    for (int64_t c = 0; c < n; c += 2 * VN)
        for (int i = 0; i < VN; i++) {
            dst[c + i] = src[c + 2 * i];
            dst[c + VN + i] = src[c + 2 * i + 1];
        }
}

#ifdef VEC16_SHUFFLES
/* dst[0, 2 VN) = the elements load_pairs split into even and odd, back in order. */
static inline void store_pairs(float *dst, vn even, vn odd)
{
#if VN == 16
    storen(dst, SHUF(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
    storen(dst + VN, SHUF(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
#else
    storen(dst, SHUF(even, odd, 0, 8, 1, 9, 2, 10, 3, 11));
    storen(dst + VN, SHUF(even, odd, 4, 12, 5, 13, 6, 14, 7, 15));
#endif
}

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
