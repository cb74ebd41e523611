/* GGML's quantized blocks as both quantized-linear kernels read them (quant_linear.c, the row
 * layout; quant_tiles.c, the tiled one): type ids (gguf's GGMLQuantizationType), block sizes,
 * the fp16 scale read exactly, and x quantized per block for their int8 dot products. Included
 * by each source; the native build keys a library on the headers its source includes
 * (kernels/cpu/build.py). */
#ifndef BATON_GGML_BLOCKS_H
#define BATON_GGML_BLOCKS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32
#define QT_Q4_0 2
#define QT_Q4_1 3
#define QT_Q8_0 8
#define INLINE static inline __attribute__((always_inline))

static int64_t block_bytes(int64_t qtype)
{
    return qtype == QT_Q8_0 ? 34 : qtype == QT_Q4_0 ? 18 : qtype == QT_Q4_1 ? 20 : 0;
}

/* Blocks in a row of k values of qtype; 0 for an unknown type or k not a nonzero multiple of 32
 * (what the entry points refuse). */
static inline int64_t row_blocks(int64_t qtype, int64_t k)
{
    return block_bytes(qtype) != 0 && k % QK == 0 && k != 0 ? k / QK : 0;
}

static inline uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half -> float, exact (subnormals, inf, NaN payloads included). */
static inline float f16_to_f32(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            uint32_t shift = 0;
            while (!(man & 0x400u)) {
                man <<= 1;
                shift++;
            }
            bits = sign | ((113u - shift) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* One block of x as the int8 kernels read it: its 32 int8 values in order (q; as dwords, q4, one
 * per vpdpbusd), the scale dx, and a term of the block's sum sx, aux (each kernel says which). */
typedef struct {
    union {
        int8_t q[32];
        int32_t q4[8];
    };
    float dx;
    union {
        int32_t i;
        float f;
    } aux;
} xblock;

#if defined(__AVX2__) || defined(__AVX512F__)
/* A block of x quantized: its 32 int8 values q (stored + 128 as unsigned bytes where `offset`),
 * its scale d and the sum of q, sx, as the kernels read them: aux = d * sx * fmul for Q4_1,
 * imul * sx for the other types. */
INLINE void put_xblock(xblock *o, __m256i q, float d, int32_t sx, int64_t qtype, int offset,
                       float fmul, int32_t imul)
{
    if (offset) q = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
    _mm256_storeu_si256((__m256i *)o->q, q);
    o->dx = d;
    if (qtype == QT_Q4_1)
        o->aux.f = d * (float)sx * fmul;
    else
        o->aux.i = imul * sx;
}
#endif

#if defined(__AVX512F__)
/* A block's 32 values into v[0], v[1], and its scale amax / 127 (NaN where a value is NaN). */
INLINE float block_scale_avx512(const float *xb, __m512 v[2])
{
    v[0] = _mm512_loadu_ps(xb), v[1] = _mm512_loadu_ps(xb + 16);
    const float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const int nan = (_mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                     _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q)) != 0;
    return nan ? NAN : amax / 127.0f;
}

/* Row x's nb blocks of 32 quantized as llama.cpp's CPU backend does it (ggml's quantize_row_q8_0
 * with the scale kept in fp32): dx = amax / 127 (NaN where the block holds a NaN), xq = round(x /
 * dx) saturated to int8, stored + 128 as unsigned bytes where `offset`; aux = dx * sx * fmul for
 * Q4_1, imul * sx for the other types. */
INLINE void quant_row_avx512(const float *x, int64_t nb, int64_t qtype, const int offset,
                             const float fmul, const int32_t imul, xblock *out)
{
    for (int64_t b = 0; b < nb; b++) {
        __m512 v[2];
        const float d = block_scale_avx512(x + b * QK, v);
        const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], id));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], id));
        const int32_t sx = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        put_xblock(out + b, _mm256_set_m128i(_mm512_cvtsepi32_epi8(i1), _mm512_cvtsepi32_epi8(i0)),
                   d, sx, qtype, offset, fmul, imul);
    }
}
#endif

#if defined(__AVX2__)
/* A block's 32 values into v, and its scale amax / 127 (NaN where a value is NaN). */
INLINE float block_scale_avx2(const float *xb, __m256 v[4])
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 mx = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 unord = _mm256_or_ps(_mm256_cmp_ps(v[0], v[1], _CMP_UNORD_Q),
                                      _mm256_cmp_ps(v[2], v[3], _CMP_UNORD_Q));
    return _mm256_movemask_ps(unord) ? NAN : _mm_cvtss_f32(m4) / 127.0f;
}

/* The sum of the 32 int32 values of v. */
INLINE int32_t block_sum_avx2(const __m256i v[4])
{
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s4);
}

/* The 32 int32 values of v as int8 bytes in order, saturated. */
INLINE __m256i block_bytes_avx2(const __m256i v[4])
{
    /* packs interleave the 128-bit lanes; the permute puts the bytes back in order */
    const __m256i i01 = _mm256_packs_epi32(v[0], v[1]), i23 = _mm256_packs_epi32(v[2], v[3]);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i01, i23),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* quant_row_avx512's values (bit for bit) in AVX2. */
INLINE void quant_row_avx2(const float *x, int64_t nb, int64_t qtype, const int offset,
                           const float fmul, const int32_t imul, xblock *out)
{
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4];
        const float d = block_scale_avx2(x + b * QK, v);
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
        put_xblock(out + b, block_bytes_avx2(i), d, block_sum_avx2(i), qtype, offset, fmul,
                   imul);
    }
}
#endif

#endif
