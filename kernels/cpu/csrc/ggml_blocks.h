/* GGML's quantized blocks as both quantized-linear kernels read them (quant_linear.c, the row
 * layout; quant_tiles.c, the tiled one): type ids (gguf's GGMLQuantizationType), block sizes,
 * and the fp16 scale read exactly. Included by each source; the native build keys a library on
 * the headers its source includes (kernels/cpu/build.py). */
#ifndef BATON_GGML_BLOCKS_H
#define BATON_GGML_BLOCKS_H
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

#endif
