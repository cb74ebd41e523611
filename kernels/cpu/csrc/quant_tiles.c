/* GGUF-quantized weights regrouped into tiles of 16 rows, and the int8 linear over them, CPU:
 * y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ b), as baton_quant_linear (quant_linear.c) computes
 * it, with the same one error (x rounded to int8 per block of 32), from a layout that lets one
 * 512-bit vector hold sixteen weight rows.
 *
 * Why: in quant_linear.c's row layout a vector holds four rows' block (four lanes each), so every
 * (block, x row) pair costs two vpdpbusd and three or four float ops (convert, scale, FMA, Q4_1's
 * m) per four rows, plus the broadcasts of x. Here lane r of a vector is weight row r, each
 * vpdpbusd adds four of its products, and x's four bytes come in as the instruction's broadcast
 * memory operand: eight vpdpbusd complete sixteen rows' block, and the float work (convert,
 * scale, FMA) is paid once per sixteen rows instead of once per four.
 *
 * The tile of 16 rows g*16 .. g*16+15 and block b (row r of the tile is lane r), in the order
 * the kernel reads it; tiles of one group of rows follow each other along K, so a group's
 * bytes are 16 of the rows' bytes, and the tensor keeps its [rows, row_bytes] shape (rows
 * padded to a multiple of 16 with zero bytes: scale 0, outputs 0, never stored):
 *   Q4_0 (288 bytes): fp16 d[16]; 4 chunks of 64 bytes, lane r of chunk c = qs_r[4c .. 4c+3]
 *   Q4_1 (320 bytes): fp16 d[16], fp16 m[16]; the same 4 chunks
 *   Q8_0 (544 bytes): fp16 d[16]; 8 chunks of 64 bytes, lane r of chunk c = q_r[4c .. 4c+3]
 *                     with each byte's top bit flipped (q + 128, unsigned)
 * A Q4 chunk's low nibbles are elements 4c..4c+3 of the block, its high ones 16+4c..16+4c+3.
 * vpdpbusd multiplies unsigned (the weights: nibbles, or Q8_0's q + 128) by signed bytes (x), so
 * the integer dot of a (row, block) starts at a term of x's block sum sx that undoes the
 * offset: -8 sx (Q4_0), -128 sx (Q8_0); Q4_1 adds m * dx * sx in fp32 instead.
 *
 * Every output's sum is computed the same way whatever call, batch or thread it came in: lane r
 * adds its blocks in order, (dot * (d * dx)) then, for Q4_1, m * (dx * sx), by FMA.
 *
 * A group's tiles meet the x rows 16 at a time (a decode batch of 16 reads each tile once), and
 * the next group's tiles are asked for while one group is computed: in a decode step the
 * weights come from memory, each layer's once, and the hardware prefetcher alone left the
 * kernel waiting at the start of every group.
 *
 * The kernel needs AVX-512 VNNI (Ice Lake, Sapphire Rapids, Zen 4); other builds report no tile
 * rows (baton_quant_tile_rows() == 0) and the weights keep their row layout. Where the CPU has
 * AMX the wide kernel runs from AMX_MIN_ROWS rows on its int8 tiles (quant_tiles_amx.h), the
 * same bits. The regrouping and
 * the dequantize of a tiled weight (all rows, or some by index: an embedding's lookup) are
 * portable C, the dequantize bit-equal to gguf-py's (contraction off: (d * q) + m rounds twice).
 *
 * Threads: each call splits its work into `parts` ranges on torch's OpenMP team (libgomp
 * resolves to the copy torch loaded, as in quant_linear.c): the x rows to quantize, then the
 * groups of 16 weight rows, contiguous ranges, in one parallel region. */
#define _GNU_SOURCE /* syscall(), for AMX's permission */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "ggml_blocks.h"
#define TR 16 /* weight rows per tile */

/* x in two bytes a value (the "wide" kernel): per block of 32, d = amax / 127, the high byte
 * h = round(x / d) and the low byte l = round((x - h d) 256 / d), clamped to +-127, so x reads
 * as (256 h + l) d / 256, within d / 256 of it (the int8 kernel's: d / 2). The integer dot of
 * a (row, block) is 256 (w . h) + w . l, exact in int32; the float work after it is the int8
 * kernel's, with dx = d / 256 and sx the sum of 256 h + l. */
typedef struct {
    xblock x; /* the high bytes; dx and aux of the whole values */
    int32_t lo[8]; /* the low bytes, as dwords */
} xblock2;

/* Block i of quantized x: xblocks, or xblock2s where wide. */
static inline const xblock *xb_at(const void *xp, int wide, int64_t i)
{
    const int64_t size = wide ? (int64_t)sizeof(xblock2) : (int64_t)sizeof(xblock);
    return (const xblock *)((const char *)xp + i * size);
}

/* The aux term of a block whose values sum to sx at scale dx (quant_row's rule). */
static inline void put_aux(xblock *o, float dx, int32_t sx, int64_t qtype)
{
    o->dx = dx;
    if (qtype == QT_Q4_1)
        o->aux.f = dx * (float)sx;
    else
        o->aux.i = (qtype == QT_Q8_0 ? -128 : -8) * sx;
}

/* Bytes before a tile's quants: d[16], and m[16] for Q4_1. */
static int64_t scale_bytes(int64_t qtype) { return qtype == QT_Q4_1 ? 4 * TR : 2 * TR; }

/* ---------------------------------------------------------------------------------------------
 * Layout: rows <-> tiles.
 */

/* Byte j of (row `lane`'s) block in the tile, as an offset into the tile: the inverse of the
 * layout above, one function for both directions. */
static int64_t tile_offset(int64_t qtype, int64_t lane, int64_t j)
{
    if (j < 2) return 2 * lane + j; /* d */
    if (qtype == QT_Q4_1 && j < 4) return 2 * TR + 2 * lane + (j - 2); /* m */
    const int64_t q = j - (qtype == QT_Q4_1 ? 4 : 2); /* the quant byte's index in the block */
    return scale_bytes(qtype) + (q / 4) * 4 * TR + 4 * lane + q % 4;
}

/* dst (ceil(n / 16) * 16 rows of row_bytes) = the tiles of src's n rows; pad rows zero. */
int baton_quant_tiles_pack(const uint8_t *src, int64_t qtype, int64_t n, int64_t k, uint8_t *dst)
{
    const int64_t bb = block_bytes(qtype), nb = row_blocks(qtype, k);
    if (nb == 0) return -1;
    const int64_t groups = (n + TR - 1) / TR, tile = TR * bb;
    memset(dst, 0, (size_t)(groups * tile * nb));
    for (int64_t r = 0; r < n; r++) {
        const int64_t g = r / TR, lane = r % TR;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + (r * nb + b) * bb;
            uint8_t *t = dst + (g * nb + b) * tile;
            for (int64_t j = 0; j < bb; j++) {
                const uint8_t flip = qtype == QT_Q8_0 && j >= 2 ? 0x80 : 0;
                t[tile_offset(qtype, lane, j)] = blk[j] ^ flip;
            }
        }
    }
    return 0;
}

/* dst (n rows of row_bytes) = rows ids[i] (i < n; ids NULL: rows 0 .. n-1) of the tiled src. */
int baton_quant_tiles_unpack(const uint8_t *src, int64_t qtype, int64_t k, const int64_t *ids,
                             int64_t n, uint8_t *dst)
{
    const int64_t bb = block_bytes(qtype), nb = row_blocks(qtype, k);
    if (nb == 0) return -1;
    const int64_t tile = TR * bb;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids ? ids[i] : i, g = r / TR, lane = r % TR;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *t = src + (g * nb + b) * tile;
            uint8_t *blk = dst + (i * nb + b) * bb;
            for (int64_t j = 0; j < bb; j++) {
                const uint8_t flip = qtype == QT_Q8_0 && j >= 2 ? 0x80 : 0;
                blk[j] = t[tile_offset(qtype, lane, j)] ^ flip;
            }
        }
    }
    return 0;
}

/* out[i, :] (k floats) = dequant(row ids[i]) of the tiled w (ids NULL: rows 0 .. n-1), with
 * gguf-py's arithmetic: d * (nib - 8), d * q, (d * nib) + m. */
int baton_quant_tiles_dequantize(const uint8_t *w, int64_t qtype, int64_t k, const int64_t *ids,
                                 int64_t n, float *out, int64_t parts)
{
    const int64_t bb = block_bytes(qtype), nb = row_blocks(qtype, k);
    if (nb == 0) return -1;
    const int64_t tile = TR * bb, sb = scale_bytes(qtype);
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids ? ids[i] : i, g = r / TR, lane = r % TR;
        float *o = out + i * k;
        for (int64_t b = 0; b < nb; b++, o += QK) {
            const uint8_t *t = w + (g * nb + b) * tile;
            const float d = f16_to_f32(rd16(t + 2 * lane));
            const uint8_t *q = t + sb + 4 * lane;
            if (qtype == QT_Q8_0) {
                for (int j = 0; j < QK; j++)
                    o[j] = (float)(int8_t)(q[(j / 4) * 4 * TR + j % 4] ^ 0x80) * d;
            } else if (qtype == QT_Q4_1) {
                const float m = f16_to_f32(rd16(t + 2 * TR + 2 * lane));
                for (int j = 0; j < 16; j++) {
                    const uint8_t byte = q[(j / 4) * 4 * TR + j % 4];
                    const float lo = d * (float)(byte & 15), hi = d * (float)(byte >> 4);
                    o[j] = lo + m;
                    o[j + 16] = hi + m;
                }
            } else {
                for (int j = 0; j < 16; j++) {
                    const uint8_t byte = q[(j / 4) * 4 * TR + j % 4];
                    o[j] = d * (float)((int)(byte & 15) - 8);
                    o[j + 16] = d * (float)((int)(byte >> 4) - 8);
                }
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The int8 kernel over tiles.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TILE_PATH "avx512-vnni"
#define TILE_ROWS TR
#define MR 16 /* x rows a pass over a group's tiles: a decode batch of 16 reads each tile once */

/* An x block's aux (xblock, ggml_blocks.h): the offset term, -8 sx or -128 sx (int32), as the
 * dot's start; Q4_1's dx * sx (float). Per block of 32: dx = amax / 127, xq = round(x / dx), as
 * quant_linear.c's quant_row. */
static void quant_row(const float *x, int64_t nb, int64_t qtype, xblock *out)
{
    quant_row_avx512(x, nb, qtype, 0, 1.0f, qtype == QT_Q8_0 ? -128 : -8, out);
}

/* x in two bytes a value (xblock2), for the wide kernel. */
static void quant_row_wide(const float *x, int64_t nb, int64_t qtype, xblock2 *out)
{
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    for (int64_t b = 0; b < nb; b++) {
        __m512 v[2];
        const float d = block_scale_avx512(x + b * QK, v), id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512 v0 = v[0], v1 = v[1];
        const __m512 dv = _mm512_set1_ps(d), idv = _mm512_set1_ps(id);
        const __m512 id256 = _mm512_set1_ps(id * 256.0f);
        __m512i h0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv));
        __m512i h1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
        h0 = _mm512_min_epi32(_mm512_max_epi32(h0, nlim), lim);
        h1 = _mm512_min_epi32(_mm512_max_epi32(h1, nlim), lim);
        const __m512 r0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(h0), dv, v0);
        const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(h1), dv, v1);
        __m512i l0 = _mm512_cvtps_epi32(_mm512_mul_ps(r0, id256));
        __m512i l1 = _mm512_cvtps_epi32(_mm512_mul_ps(r1, id256));
        l0 = _mm512_min_epi32(_mm512_max_epi32(l0, nlim), lim);
        l1 = _mm512_min_epi32(_mm512_max_epi32(l1, nlim), lim);
        const int32_t sx = 256 * _mm512_reduce_add_epi32(_mm512_add_epi32(h0, h1)) +
                           _mm512_reduce_add_epi32(_mm512_add_epi32(l0, l1));
        _mm256_storeu_si256((__m256i *)out[b].x.q,
                            _mm256_set_m128i(_mm512_cvtsepi32_epi8(h1), _mm512_cvtsepi32_epi8(h0)));
        _mm256_storeu_si256((__m256i *)out[b].lo,
                            _mm256_set_m128i(_mm512_cvtsepi32_epi8(l1), _mm512_cvtsepi32_epi8(l0)));
        put_aux(&out[b].x, d / 256.0f, sx, qtype);
    }
}

/* acc + w . (the dword at x, broadcast), with the broadcast as vpdpbusd's memory operand: GCC
 * loads it into a register first, one more instruction per dot. */
INLINE __m512i dpbusd_bcst(__m512i acc, __m512i w, const int32_t *x)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* One group's 16 rows (tiles from g, nb of them) times x rows xp[0, mr) (nb blocks apart) into
 * y[0, mr)[0, nvalid) (ldy apart), + bias[0, nvalid) if given; `next` (or NULL): the next
 * group's tiles, asked for into L1 while these are computed. qtype is a constant where this is
 * inlined. */
INLINE void group_rows(const int64_t qtype, const int wide, const int mr, const uint8_t *g,
                       int64_t nb, const void *xp, int nvalid, float *y, int64_t ldy,
                       const float *bias, const uint8_t *next)
{
    const int64_t tile = TR * block_bytes(qtype), sb = scale_bytes(qtype);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MR];
    for (int m = 0; m < mr; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *t = g + b * tile;
        if (next)
            for (int64_t line = 0; line < tile; line += 64)
                _mm_prefetch((const char *)(next + b * tile + line), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
        const __m512 mv = qtype == QT_Q4_1
                              ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 2 * TR)))
                              : _mm512_setzero_ps();
        __m512i wv[8];
        if (qtype == QT_Q8_0) {
            for (int c = 0; c < 8; c++) wv[c] = _mm512_loadu_si512(t + sb + 64 * c);
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(t + sb + 64 * c);
                wv[c] = _mm512_and_si512(v, low);
                wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        for (int m = 0; m < mr; m++) {
            const xblock *x = xb_at(xp, wide, m * nb + b);
            __m512i dot = qtype == QT_Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(x->aux.i);
            if (wide) { /* 256 (w . h) + w . l */
                __m512i hi = _mm512_setzero_si512();
                for (int c = 0; c < 8; c++) hi = dpbusd_bcst(hi, wv[c], x->q4 + c);
                dot = _mm512_add_epi32(dot, _mm512_slli_epi32(hi, 8));
                const int32_t *lo = ((const xblock2 *)x)->lo;
                for (int c = 0; c < 8; c++) dot = dpbusd_bcst(dot, wv[c], lo + c);
            } else {
                for (int c = 0; c < 8; c++) dot = dpbusd_bcst(dot, wv[c], x->q4 + c);
            }
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x->dx));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m]);
            if (qtype == QT_Q4_1) acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x->aux.f), acc[m]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << nvalid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int m = 0; m < mr; m++)
        _mm512_mask_storeu_ps(y + m * ldy, keep, _mm512_add_ps(acc[m], bv));
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include "amx.h"
#endif
#include "quant_tiles_amx.h"
#include "quant_tiles_bf16.h"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TILE_PATH "avx2"
#define TILE_ROWS TR
#define MR 16

static void quant_row(const float *x, int64_t nb, int64_t qtype, xblock *out)
{
    quant_row_avx2(x, nb, qtype, 0, 1.0f, -8, out);
}

/* The AVX-512 build's quant_row_wide, bit for bit. */
static void quant_row_wide(const float *x, int64_t nb, int64_t qtype, xblock2 *out)
{
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4];
        const float d = block_scale_avx2(x + b * QK, v), id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 dv = _mm256_set1_ps(d), idv = _mm256_set1_ps(id);
        const __m256 id256 = _mm256_set1_ps(id * 256.0f);
        __m256i h[4], l[4];
        for (int j = 0; j < 4; j++) {
            h[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], idv));
            h[j] = _mm256_min_epi32(_mm256_max_epi32(h[j], nlim), lim);
            const __m256 r = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(h[j]), dv, v[j]);
            l[j] = _mm256_cvtps_epi32(_mm256_mul_ps(r, id256));
            l[j] = _mm256_min_epi32(_mm256_max_epi32(l[j], nlim), lim);
        }
        _mm256_storeu_si256((__m256i *)out[b].x.q, block_bytes_avx2(h));
        _mm256_storeu_si256((__m256i *)out[b].lo, block_bytes_avx2(l));
        put_aux(&out[b].x, d / 256.0f, 256 * block_sum_avx2(h) + block_sum_avx2(l), qtype);
    }
}

/* group_rows of the AVX-512 build in AVX2, bit for bit: a tile's sixteen rows as two halves of
 * eight (lane r of a 256-bit vector: row 8h + r), and each vpdpbusd as a vpmaddubsw into 16-bit
 * pairs, a Q4 block's eight added in 16 bits (each pair at most 2 * 15 * 127, eight of them
 * 30,480: no saturation), then one vpmaddwd to 32 bits: the same exact integer dot, then the
 * same float steps. Q8_0's (q + 128) * x pairs would overflow 16 bits, so its quants are made
 * signed again once per block and multiplied as llama.cpp's AVX2 code does, |q| times x with
 * q's sign (pairs at most 2 * 128 * 127), each chunk widened to 32 bits: q . x exactly, the
 * integer the AVX-512 kernel reaches from (q + 128) . x - 128 sx. */
INLINE void group_rows(const int64_t qtype, const int wide, const int mr, const uint8_t *g,
                       int64_t nb, const void *xp, int nvalid, float *y, int64_t ldy,
                       const float *bias, const uint8_t *next)
{
    const int64_t tile = TR * block_bytes(qtype), sb = scale_bytes(qtype);
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[MR][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *t = g + b * tile;
        if (next)
            for (int64_t line = 0; line < tile; line += 64)
                _mm_prefetch((const char *)(next + b * tile + line), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
            const __m256 mv =
                qtype == QT_Q4_1
                    ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 2 * TR + 16 * h)))
                    : _mm256_setzero_ps();
            if (qtype == QT_Q8_0) { /* the signed quants and their magnitudes, in L1 */
                __m256i wq[8], wa[8];
                for (int c = 0; c < 8; c++) {
                    wq[c] = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(t + sb + 64 * c + 32 * h)),
                        _mm256_set1_epi8((char)0x80));
                    wa[c] = _mm256_sign_epi8(wq[c], wq[c]); /* |q|; |-128| reads as 128 */
                }
                for (int m = 0; m < mr; m++) {
                    const xblock *x = xb_at(xp, wide, m * nb + b);
                    __m256i dot = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c++) {
                        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(x->q4[c]), wq[c]);
                        dot = _mm256_add_epi32(
                            dot, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[c], xs), ones));
                    }
                    if (wide) { /* 256 (q . h) + q . l */
                        const int32_t *lo = ((const xblock2 *)x)->lo;
                        dot = _mm256_slli_epi32(dot, 8);
                        for (int c = 0; c < 8; c++) {
                            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(lo[c]), wq[c]);
                            dot = _mm256_add_epi32(
                                dot, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[c], xs), ones));
                        }
                    }
                    const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->dx));
                    acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m][h]);
                }
                continue;
            }
            __m256i wv[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(t + sb + 64 * c + 32 * h));
                wv[c] = _mm256_and_si256(v, low);
                wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int m = 0; m < mr; m++) {
                const xblock *x = xb_at(xp, wide, m * nb + b);
                __m256i pairs = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(x->q4[0]));
                for (int c = 1; c < 8; c++)
                    pairs = _mm256_add_epi16(
                        pairs, _mm256_maddubs_epi16(wv[c], _mm256_set1_epi32(x->q4[c])));
                __m256i dot = _mm256_madd_epi16(pairs, ones);
                if (wide) { /* 256 (w . h) + w . l */
                    const int32_t *lo = ((const xblock2 *)x)->lo;
                    pairs = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(lo[0]));
                    for (int c = 1; c < 8; c++)
                        pairs = _mm256_add_epi16(
                            pairs, _mm256_maddubs_epi16(wv[c], _mm256_set1_epi32(lo[c])));
                    dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8),
                                           _mm256_madd_epi16(pairs, ones));
                }
                if (qtype == QT_Q4_0) dot = _mm256_add_epi32(_mm256_set1_epi32(x->aux.i), dot);
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->dx));
                acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m][h]);
                if (qtype == QT_Q4_1)
                    acc[m][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x->aux.f), acc[m][h]);
            }
        }
    }
    for (int m = 0; m < mr; m++) {
        float out[TR];
        for (int h = 0; h < 2; h++) {
            const __m256 bv = bias && nvalid == TR ? _mm256_loadu_ps(bias + 8 * h)
                                                   : _mm256_setzero_ps();
            _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(acc[m][h], bv));
        }
        if (bias && nvalid < TR) /* the last group: its bias is nvalid long */
            for (int r = 0; r < nvalid; r++) out[r] = acc[m][r / 8][r % 8] + bias[r];
        memcpy(y + m * ldy, out, (size_t)nvalid * sizeof *out);
    }
}
#endif

#ifdef TILE_PATH
/* Each weight type compiled on its own; the x rows a run-time loop: sixteen rows' accumulators
 * do not fit the registers beside the weights, and in L1 they cost nothing (each is read and
 * written once a block). */
#define GROUP_FN(NAME, QT, WIDE)                                                                 \
    static void NAME(const uint8_t *g, int64_t nb, const void *xp, int mr, int nvalid, float *y,  \
                     int64_t ldy, const float *bias, const uint8_t *next)                         \
    {                                                                                            \
        group_rows(QT, WIDE, mr, g, nb, xp, nvalid, y, ldy, bias, next);                         \
    }
GROUP_FN(group_q4_0, QT_Q4_0, 0)
GROUP_FN(group_q4_1, QT_Q4_1, 0)
GROUP_FN(group_q8_0, QT_Q8_0, 0)
GROUP_FN(group_q4_0_wide, QT_Q4_0, 1)
GROUP_FN(group_q4_1_wide, QT_Q4_1, 1)
GROUP_FN(group_q8_0_wide, QT_Q8_0, 1)
typedef void (*group_fn)(const uint8_t *, int64_t, const void *, int, int, float *, int64_t,
                         const float *, const uint8_t *);

/* y[m, n] (contiguous) = x[m, k] (rows ldx apart) . dequant(w)^T + bias (or NULL), w the tiles
 * of n rows, x in one byte a value or two (wide); x and y fp32, or bf16 both where `io16` (a bf16
 * model's rows: the bits of widening x, the fp32 call and rounding y as torch does, in the
 * call's own threads). 0; -1 for an unknown type or k not a multiple of 32; -2 if the quantized
 * x (or io16's fp32 rows) cannot be allocated. */
static int tiles_linear(const int wide, const int amx, const int64_t bf16_rows, const int io16,
                        const uint8_t *w, int64_t qtype, int64_t n, int64_t k, const void *x,
                        int64_t m, int64_t ldx, const float *bias, void *y, int64_t parts)
{
    const int64_t bb = block_bytes(qtype), nb = row_blocks(qtype, k);
    if (nb == 0) return -1;
    if (m == 0 || n == 0) return 0;
#ifdef HAVE_AMX_BF16
    if (m >= bf16_rows && amx_permitted())
        return amx_bf16_tiles_linear(io16, w, qtype, n, k, x, m, ldx, bias, y, parts);
#else
    (void)bf16_rows;
#endif
#ifdef HAVE_AMX_INT8
    /* the int8 kernel gains nothing there: its float work per block, not its dots, sets its pace */
    if (wide && amx && !io16 && m >= AMX_MIN_ROWS && amx_permitted())
        return amx_tiles_linear_wide(w, qtype, n, k, x, m, ldx, bias, y, parts);
#endif
    const group_fn fn = qtype == QT_Q4_0   ? (wide ? group_q4_0_wide : group_q4_0)
                        : qtype == QT_Q4_1 ? (wide ? group_q4_1_wide : group_q4_1)
                                           : (wide ? group_q8_0_wide : group_q8_0);
    const int64_t xsize = wide ? (int64_t)sizeof(xblock2) : (int64_t)sizeof(xblock);
    /* io16: each row widened into fp32 (k floats) before its quantize, y computed into fp32
     * rows and rounded once every group is done */
    const int64_t xq_bytes = (m * nb * xsize + 63) / 64 * 64, f32s = io16 ? m * (k + n) : 0;
    char *xp = malloc((size_t)xq_bytes + (size_t)f32s * sizeof(float));
    if (xp == NULL) return -2;
    float *xf = (float *)(xp + xq_bytes), *yf = io16 ? xf + m * k : (float *)y;
    const int64_t groups = (n + TR - 1) / TR, group_bytes = TR * nb * bb;
#pragma omp parallel num_threads(parts) if (parts > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            const float *xr = (const float *)x + r * ldx;
            if (io16) {
                const uint16_t *xs = (const uint16_t *)x + r * ldx;
                for (int64_t j = 0; j < k; j++) xf[r * k + j] = bf16_to_f32(xs[j]);
                xr = xf + r * k;
            }
            if (wide)
                quant_row_wide(xr, nb, qtype, (xblock2 *)(xp + r * nb * xsize));
            else
                quant_row(xr, nb, qtype, (xblock *)(xp + r * nb * xsize));
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * TR;
            const int nvalid = (int)(n - n0 < TR ? n - n0 : TR);
            for (int64_t m0 = 0; m0 < m; m0 += MR) {
                const int mr = (int)(m - m0 < MR ? m - m0 : MR);
                const uint8_t *next =
                    m0 == 0 && g + 1 < groups ? w + (g + 1) * group_bytes : NULL;
                fn(w + g * group_bytes, nb, xp + m0 * nb * xsize, mr, nvalid, yf + m0 * n + n0,
                   n, bias ? bias + n0 : NULL, next);
            }
        }
        if (io16) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = 0; j < n; j++)
                    ((uint16_t *)y)[r * n + j] = f32_to_bf16(yf[r * n + j]);
        }
    }
    free(xp);
    return 0;
}

#define NEVER INT64_MAX /* tiles_linear's bf16_rows: the int8 kernel at every row count */

/* x rounded to int8 per block (the decode step's kernel). */
int baton_quant_tiles_linear(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                             const float *x, int64_t m, int64_t ldx, const float *bias, float *y,
                             int64_t parts)
{
    return tiles_linear(0, 0, NEVER, 0, w, qtype, n, k, x, m, ldx, bias, y, parts);
}

/* x in two bytes a value (xblock2): within 1/256 of the int8 kernel's rounding, at about twice
 * its integer work; from AMX_MIN_ROWS rows on AMX's tiles where the CPU grants them (the same
 * result). */
int baton_quant_tiles_linear_wide(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                  const float *x, int64_t m, int64_t ldx, const float *bias,
                                  float *y, int64_t parts)
{
    return tiles_linear(1, 1, NEVER, 0, w, qtype, n, k, x, m, ldx, bias, y, parts);
}

/* In a bf16 model's arithmetic on AMX's bf16 tiles (quant_tiles_bf16.h) at every row count; -3
 * where the build or the CPU has no AMX. */
int baton_quant_tiles_linear_bf16(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                  const float *x, int64_t m, int64_t ldx, const float *bias,
                                  float *y, int64_t parts)
{
#ifdef HAVE_AMX_BF16
    if (amx_permitted()) {
        if (row_blocks(qtype, k) == 0) return -1;
        if (m == 0 || n == 0) return 0;
        return amx_bf16_tiles_linear(0, w, qtype, n, k, x, m, ldx, bias, y, parts);
    }
#endif
    (void)w, (void)qtype, (void)n, (void)k, (void)x, (void)m, (void)ldx, (void)bias, (void)y;
    (void)parts;
    return -3;
}

/* Rows from which the decode step's kernels below take AMX's bf16 tiles (tiles_linear checks
 * that the CPU grants them); NEVER where the build has none. */
#ifdef HAVE_AMX_BF16
#define AMX_BF16_ROWS BF16_MIN_ROWS
#else
#define AMX_BF16_ROWS NEVER
#endif

/* The decode step's kernel where the CPU has AMX: the int8 kernel below BF16_MIN_ROWS rows, a
 * bf16 model's arithmetic on the bf16 tiles from it (the int8 kernel's alone elsewhere). */
int baton_quant_tiles_linear_amx_bf16(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                      const float *x, int64_t m, int64_t ldx, const float *bias,
                                      float *y, int64_t parts)
{
    return tiles_linear(0, 0, AMX_BF16_ROWS, 0, w, qtype, n, k, x, m, ldx, bias, y, parts);
}

/* The decode step's kernels for a bf16 model's rows: x [m, k] (rows ldx apart) and y [m, n]
 * bf16, bias fp32 (or NULL); the bits of widening x, the fp32 entry and rounding y as torch
 * does (the bf16 tiles: but for a denormal y, flushed to zero), with the conversions in the
 * call's threads (shared/runtime/decode_program.py). baton_quant_tiles_linear's: */
int baton_quant_tiles_linear_io16(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                  const uint16_t *x, int64_t m, int64_t ldx, const float *bias,
                                  uint16_t *y, int64_t parts)
{
    return tiles_linear(0, 0, NEVER, 1, w, qtype, n, k, x, m, ldx, bias, y, parts);
}

/* and baton_quant_tiles_linear_amx_bf16's. */
int baton_quant_tiles_linear_amx_bf16_io16(const uint8_t *w, int64_t qtype, int64_t n,
                                           int64_t k, const uint16_t *x, int64_t m, int64_t ldx,
                                           const float *bias, uint16_t *y, int64_t parts)
{
    return tiles_linear(0, 0, AMX_BF16_ROWS, 1, w, qtype, n, k, x, m, ldx, bias, y, parts);
}

/* baton_quant_tiles_linear_wide on vpdpbusd whatever the CPU (what AMX's is checked against). */
int baton_quant_tiles_linear_wide_vnni(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                       const float *x, int64_t m, int64_t ldx, const float *bias,
                                       float *y, int64_t parts)
{
    return tiles_linear(1, 0, NEVER, 0, w, qtype, n, k, x, m, ldx, bias, y, parts);
}
#else
#define TILE_PATH "none"
#define TILE_ROWS 0

int baton_quant_tiles_linear(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                             const float *x, int64_t m, int64_t ldx, const float *bias, float *y,
                             int64_t parts)
{
    (void)w, (void)qtype, (void)n, (void)k, (void)x, (void)m, (void)ldx, (void)bias, (void)y;
    (void)parts;
    return -3;
}

int baton_quant_tiles_linear_wide(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                  const float *x, int64_t m, int64_t ldx, const float *bias,
                                  float *y, int64_t parts)
{
    return baton_quant_tiles_linear(w, qtype, n, k, x, m, ldx, bias, y, parts);
}

int baton_quant_tiles_linear_wide_vnni(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                       const float *x, int64_t m, int64_t ldx, const float *bias,
                                       float *y, int64_t parts)
{
    return baton_quant_tiles_linear(w, qtype, n, k, x, m, ldx, bias, y, parts);
}

int baton_quant_tiles_linear_bf16(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                  const float *x, int64_t m, int64_t ldx, const float *bias,
                                  float *y, int64_t parts)
{
    return baton_quant_tiles_linear(w, qtype, n, k, x, m, ldx, bias, y, parts); /* -3 */
}

int baton_quant_tiles_linear_amx_bf16(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                      const float *x, int64_t m, int64_t ldx, const float *bias,
                                      float *y, int64_t parts)
{
    return baton_quant_tiles_linear(w, qtype, n, k, x, m, ldx, bias, y, parts);
}

int baton_quant_tiles_linear_io16(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                  const uint16_t *x, int64_t m, int64_t ldx, const float *bias,
                                  uint16_t *y, int64_t parts)
{
    (void)w, (void)qtype, (void)n, (void)k, (void)x, (void)m, (void)ldx, (void)bias, (void)y;
    (void)parts;
    return -3;
}

int baton_quant_tiles_linear_amx_bf16_io16(const uint8_t *w, int64_t qtype, int64_t n,
                                           int64_t k, const uint16_t *x, int64_t m, int64_t ldx,
                                           const float *bias, uint16_t *y, int64_t parts)
{
    return baton_quant_tiles_linear_io16(w, qtype, n, k, x, m, ldx, bias, y, parts); /* -3 */
}
#endif

/* Which unit the wide kernel runs on from AMX_MIN_ROWS rows: "amx-int8" or the tiles' path. */
const char *baton_quant_tiles_wide_path(void)
{
#ifdef HAVE_AMX_INT8
    if (amx_permitted()) return "amx-int8";
#endif
    return TILE_PATH;
}

/* From how many rows baton_quant_tiles_linear_amx_bf16 takes AMX's bf16 tiles; 0: never (no
 * AMX here). */
int64_t baton_quant_tiles_bf16_rows(void)
{
#ifdef HAVE_AMX_BF16
    if (amx_permitted()) return BF16_MIN_ROWS;
#endif
    return 0;
}

/* Rows a tile holds where this build has the kernel; 0: weights keep their row layout. */
int64_t baton_quant_tile_rows(void) { return TILE_ROWS; }

const char *baton_quant_tiles_path(void) { return TILE_PATH; }
