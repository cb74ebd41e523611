/* bf16 <-> fp32 one value at a time, as torch converts: widening is exact; narrowing rounds to
 * nearest, ties to even, and a NaN becomes the quiet NaN 0x7fc0 (c10::BFloat16's
 * round_to_nearest_even). What a kernel's bf16 rows take and give where its arithmetic is fp32
 * (decode_program.c, quant_tiles.c, prefill_attention.c); GCC vectorises loops of them at -O3. */
#ifndef BATON_BF16_H
#define BATON_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b)
{
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#endif
