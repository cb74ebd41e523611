/* Linear layers over GGUF-quantized weights, CPU: y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ b).
 *
 * W stays in GGML's block bytes, row n = output feature n, blocks of 32 along K:
 *   Q8_0 (34 bytes): fp16 d, int8 q[32]                  w_j = d * q_j
 *   Q4_0 (18 bytes): fp16 d, uint8 qs[16]                 w_j = d * (nib_j - 8)
 *   Q4_1 (20 bytes): fp16 d, fp16 m, uint8 qs[16]         w_j = d * nib_j + m
 * where nib_j is qs[j] & 15 for j < 16 and qs[j - 16] >> 4 for j >= 16.
 *
 * baton_quant_linear does what llama.cpp's CPU backend does: each row of x is quantized once per
 * call, per block of 32, to int8 with an fp32 scale (dx = amax / 127, xq = round(x / dx), as
 * ggml's quantize_row_q8_0 but with the scale kept in fp32), then every (weight block, x block)
 * pair is an integer dot product, scaled by d * dx and summed in fp32:
 *   Q8_0: sum_b d_b dx_b (q . xq)_b
 *   Q4_0: sum_b d_b dx_b ((nib . xq)_b - 8 sx_b)          sx_b = sum of xq over block b
 *   Q4_1: sum_b d_b dx_b (nib . xq)_b + m_b dx_b sx_b
 * Its only error next to x . dequant(W) is the rounding of x to int8: at most dx_b / 2 per
 * element, so |y - ref| <= sum_b amax_b / 254 * sum_{j in b} |w_j| (+ fp32 rounding). A block
 * of x holding a NaN gets dx = NaN, so the row's outputs are NaN (as in x . W); an infinity
 * makes them NaN too (x . W: +-inf or NaN).
 *
 * Layout: a weight row's block occupies four 32-bit lanes of a vector; lane j sums elements
 * 4j..4j+3 of the block's first half and of its second half (Q4: the low nibbles, then the high
 * ones), against the x block's two halves broadcast to every row's lanes. So a 512-bit vector
 * is four weight rows' dot products with one x block, two vpdpbusd, and they are scaled and
 * summed with one cvt, one mul (d * dx) and one FMA per x row. The four lanes of a row are
 * added at the end, in a fixed order. Not chosen: two blocks of one row per vector (twice the
 * float work per block: slower from a few rows on); one row's four blocks per vector (no
 * inserts, one vpermt2b for four rows' worth: no faster at one row, slower at many). At one row
 * no single step of a block dominates: leaving out either vpermt2b saves little
 * (docs/perf-log.md, "Quantized linear kernels").
 *
 * Three builds, chosen at compile time (-march=native):
 *  - AVX-512 VNNI + BW + VBMI (Ice Lake, Sapphire Rapids, Zen 4): 4 weight rows x 8 x rows a
 *    tile. vpdpbusd multiplies unsigned by signed bytes: Q4 nibbles are the unsigned side as
 *    they are, and the -8 of Q4_0 starts the accumulator at -2 sx in each of a row's four
 *    lanes. For Q8_0 x is stored as xq + 128 (unsigned) and each weight block's -128 * lane
 *    sums start the accumulator, computed once per weight block, not per x row. Four rows'
 *    first 32 bytes of a block -> two vpermt2b: the nibble bytes, and the fp16 d (and m).
 *  - AVX2 (Zen 3): 2 weight rows x 8 x rows; maddubs + madd, or vpdpbusd's 256-bit form with
 *    AVX-VNNI / AVX-512 VL VNNI; Q8_0 without VNNI as |w| times x with w's sign (llama.cpp's
 *    mul_sum_i8_pairs).
 *  - Portable C otherwise, one output at a time.
 * Every output element's sum is computed the same way whatever tile it sat in (rows past N
 * repeat the last row and are not stored; x rows past M are not computed), so neither the batch
 * it came in nor how the rows split over threads changes a bit.
 *
 * baton_quant_dequantize writes dequant(W) as fp32, bit-equal to gguf-py's numpy dequantize (and
 * the torch reference of quant_formats.py): d * (nib - 8), d * q, and (d * nib) + m with two
 * roundings (no FMA: contraction off, -std=c11 plus -ffp-contract=off).
 *
 * Threads: each call splits its work into `parts` ranges on torch's OpenMP team (libgomp
 * resolves to the copy torch loaded, as in layer_ops.c): the x rows to quantize, then the tiles
 * of weight rows, contiguous ranges, in one parallel region. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "ggml_blocks.h"

/* ---------------------------------------------------------------------------------------------
 * Dequantize: one row of nb blocks to nb * 32 floats.
 */
#if defined(__AVX512F__)
static void dequant_row(const uint8_t *w, int64_t qtype, int64_t nb, float *out)
{
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, out += QK) {
        if (qtype == QT_Q8_0) {
            const uint8_t *blk = w + b * 34;
            const __m512 d = _mm512_set1_ps(f16_to_f32(rd16(blk)));
            for (int h = 0; h < 2; h++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * h));
                const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(v, d));
            }
        } else {
            const int q41 = qtype == QT_Q4_1;
            const uint8_t *blk = w + b * (q41 ? 20 : 18);
            const __m512 d = _mm512_set1_ps(f16_to_f32(rd16(blk)));
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (q41 ? 4 : 2)));
            const __m128i nib[2] = {_mm_and_si128(qs, low),
                                    _mm_and_si128(_mm_srli_epi16(qs, 4), low)};
            for (int h = 0; h < 2; h++) {
                __m512i q = _mm512_cvtepu8_epi32(nib[h]);
                if (!q41) q = _mm512_sub_epi32(q, _mm512_set1_epi32(8));
                __m512 v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
                if (q41) v = _mm512_add_ps(v, _mm512_set1_ps(f16_to_f32(rd16(blk + 2))));
                _mm512_storeu_ps(out + 16 * h, v);
            }
        }
    }
}
#elif defined(__AVX2__)
static void dequant_row(const uint8_t *w, int64_t qtype, int64_t nb, float *out)
{
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, out += QK) {
        if (qtype == QT_Q8_0) {
            const uint8_t *blk = w + b * 34;
            const __m256 d = _mm256_set1_ps(f16_to_f32(rd16(blk)));
            for (int h = 0; h < 4; h++) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * h));
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(v, d));
            }
        } else {
            const int q41 = qtype == QT_Q4_1;
            const uint8_t *blk = w + b * (q41 ? 20 : 18);
            const __m256 d = _mm256_set1_ps(f16_to_f32(rd16(blk)));
            const __m256 m = _mm256_set1_ps(q41 ? f16_to_f32(rd16(blk + 2)) : 0.0f);
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (q41 ? 4 : 2)));
            const __m128i nib[2] = {_mm_and_si128(qs, low),
                                    _mm_and_si128(_mm_srli_epi16(qs, 4), low)};
            for (int h = 0; h < 4; h++) {
                const __m128i part = h & 1 ? _mm_srli_si128(nib[h >> 1], 8) : nib[h >> 1];
                __m256i q = _mm256_cvtepu8_epi32(part);
                if (!q41) q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
                __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
                if (q41) v = _mm256_add_ps(v, m);
                _mm256_storeu_ps(out + 8 * h, v);
            }
        }
    }
}
#else
static void dequant_row(const uint8_t *w, int64_t qtype, int64_t nb, float *out)
{
    for (int64_t b = 0; b < nb; b++, out += QK) {
        if (qtype == QT_Q8_0) {
            const uint8_t *blk = w + b * 34;
            const float d = f16_to_f32(rd16(blk));
            for (int j = 0; j < QK; j++) out[j] = (float)(int8_t)blk[2 + j] * d;
        } else {
            const int q41 = qtype == QT_Q4_1;
            const uint8_t *blk = w + b * (q41 ? 20 : 18);
            const uint8_t *qs = blk + (q41 ? 4 : 2);
            const float d = f16_to_f32(rd16(blk));
            const float m = q41 ? f16_to_f32(rd16(blk + 2)) : 0.0f;
            for (int j = 0; j < QK; j++) {
                const int nib = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
                if (q41) {
                    const float dq = d * (float)nib;
                    out[j] = dq + m;
                } else {
                    out[j] = d * (float)(nib - 8);
                }
            }
        }
    }
}
#endif

/* out[N, K] = dequant(w); 0, or -1 for a type it does not know. */
int baton_quant_dequantize(const uint8_t *w, int64_t qtype, int64_t n, int64_t k, float *out,
                           int64_t parts)
{
    const int64_t bb = block_bytes(qtype), nb = k / QK;
    if (bb == 0 || k % QK) return -1;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < n; r++) dequant_row(w + r * nb * bb, qtype, nb, out + r * k);
    return 0;
}
/* ---------------------------------------------------------------------------------------------
 * The int8 dot-product kernel.
 *
 * One x block (xblock, ggml_blocks.h) as the kernels read it (quant_row): the 32 int8 values in
 * order (Q8_0 with VNNI: + 128, as unsigned bytes), the scale, and a term of the block's sum sx:
 *   Q4_0: -2 * sx, int32: each of a weight row's four lanes starts there (-8 sx in all);
 *   Q4_1: dx * sx / 4, float: times m in each of the row's four lanes;
 *   the portable build: sx itself. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define QL_PATH "avx512-vnni"
#define NR 4 /* weight rows per tile: four rows x four lanes = one 512-bit vector */
#define MR 8 /* x rows per tile: eight accumulators */
#define X_UNSIGNED 1

/* vpermt2b tables over two 64-byte registers holding four rows' first 32 bytes of a block
 * (rows at bytes 0, 32, 64, 96): the nibble bytes of each row in its 16 bytes, and the fp16
 * d (low 32 bytes) and m (high 32 bytes) of row r in words 4r..4r+3. */
static const uint8_t IDX_Q4_0[64] __attribute__((aligned(64))) = {
    2,  3,  4,  5,  6,  7,  8,  9,  10,  11,  12,  13,  14,  15,  16,  17,
    34, 35, 36, 37, 38, 39, 40, 41, 42,  43,  44,  45,  46,  47,  48,  49,
    66, 67, 68, 69, 70, 71, 72, 73, 74,  75,  76,  77,  78,  79,  80,  81,
    98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113,
};
static const uint8_t IDX_Q4_1[64] __attribute__((aligned(64))) = {
    4,   5,   6,   7,   8,   9,   10,  11,  12,  13,  14,  15,  16,  17,  18,  19,
    36,  37,  38,  39,  40,  41,  42,  43,  44,  45,  46,  47,  48,  49,  50,  51,
    68,  69,  70,  71,  72,  73,  74,  75,  76,  77,  78,  79,  80,  81,  82,  83,
    100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115,
};
static const uint8_t IDX_DM[64] __attribute__((aligned(64))) = {
    0,  1,  0,  1,  0,  1,  0,  1,  32, 33, 32, 33, 32, 33, 32, 33,
    64, 65, 64, 65, 64, 65, 64, 65, 96, 97, 96, 97, 96, 97, 96, 97,
    2,  3,  2,  3,  2,  3,  2,  3,  34, 35, 34, 35, 34, 35, 34, 35,
    66, 67, 66, 67, 66, 67, 66, 67, 98, 99, 98, 99, 98, 99, 98, 99,
};

static void quant_row(const float *x, int64_t nb, int64_t qtype, xblock *out)
{
    quant_row_avx512(x, nb, qtype, qtype == QT_Q8_0, 0.25f, -2, out);
}

/* A tile's four weight rows, one block: their nibbles or bytes (lo: elements 0..15 of each
 * row, hi: 16..31; row r in bytes 16r..16r+15), d (and m) per lane, and for Q8_0 the -128 *
 * lane sums that undo x's + 128. `masked`: read no byte past the block (the matrix's last). */
typedef struct {
    __m512i lo, hi, corr;
    __m512 d, m;
} wblock;

INLINE wblock load_block(const int64_t qtype, const uint8_t *const wr[NR], int64_t at,
                         const int masked)
{
    wblock o;
    if (qtype == QT_Q8_0) {
        /* the 32 bytes after d: in bounds */
        __m256i y[NR];
        for (int r = 0; r < NR; r++) y[r] = _mm256_loadu_si256((const __m256i *)(wr[r] + at + 2));
        const __m512i z01 = _mm512_inserti64x4(_mm512_castsi256_si512(y[0]), y[1], 1);
        const __m512i z23 = _mm512_inserti64x4(_mm512_castsi256_si512(y[2]), y[3], 1);
        o.lo = _mm512_shuffle_i64x2(z01, z23, _MM_SHUFFLE(2, 0, 2, 0));
        o.hi = _mm512_shuffle_i64x2(z01, z23, _MM_SHUFFLE(3, 1, 3, 1));
        const __m512i k128 = _mm512_set1_epi8((char)0x80);
        const __m512i sums = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, o.lo), k128, o.hi);
        o.corr = _mm512_sub_epi32(_mm512_setzero_si512(), sums);
        const uint64_t dd = (uint64_t)rd16(wr[0] + at) | (uint64_t)rd16(wr[1] + at) << 16 |
                            (uint64_t)rd16(wr[2] + at) << 32 | (uint64_t)rd16(wr[3] + at) << 48;
        const __m128 d4 = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)dd));
        o.d = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
            _mm512_castps128_ps512(d4));
        o.m = _mm512_setzero_ps();
    } else {
        /* the block's first 32 bytes (d, m, nibbles and what follows) */
        const __mmask32 keep = (__mmask32)((1u << block_bytes(qtype)) - 1);
        __m256i y[NR];
        for (int r = 0; r < NR; r++)
            y[r] = masked ? _mm256_maskz_loadu_epi8(keep, wr[r] + at)
                          : _mm256_loadu_si256((const __m256i *)(wr[r] + at));
        const __m512i z01 = _mm512_inserti64x4(_mm512_castsi256_si512(y[0]), y[1], 1);
        const __m512i z23 = _mm512_inserti64x4(_mm512_castsi256_si512(y[2]), y[3], 1);
        const __m512i idx_q = _mm512_load_si512(qtype == QT_Q4_0 ? IDX_Q4_0 : IDX_Q4_1);
        const __m512i nib = _mm512_permutex2var_epi8(z01, idx_q, z23);
        const __m512i low = _mm512_set1_epi8(0x0f);
        o.lo = _mm512_and_si512(nib, low);
        o.hi = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low);
        const __m512i dm = _mm512_permutex2var_epi8(z01, _mm512_load_si512(IDX_DM), z23);
        o.d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
        o.m = qtype == QT_Q4_1 ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1))
                               : _mm512_setzero_ps();
        o.corr = _mm512_setzero_si512();
    }
    return o;
}

/* acc[m] += the block's dot products with x rows xb[m * nb], m < mr. */
INLINE void dot_block(const int64_t qtype, const int mr, const wblock *w, const xblock *xb,
                      int64_t nb, __m512 acc[MR], __m512 accm[MR])
{
    for (int m = 0; m < mr; m++) {
        const xblock *x = xb + m * nb;
        const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x->q));
        const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x->q + 16)));
        __m512i dot;
        if (qtype == QT_Q8_0) {
            dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(w->corr, xlo, w->lo), xhi, w->hi);
        } else {
            const __m512i start =
                qtype == QT_Q4_0 ? _mm512_set1_epi32(x->aux.i) : _mm512_setzero_si512();
            dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, w->lo, xlo), w->hi, xhi);
        }
        const __m512 scale = _mm512_mul_ps(w->d, _mm512_set1_ps(x->dx));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m]);
        if (qtype == QT_Q4_1) accm[m] = _mm512_fmadd_ps(w->m, _mm512_set1_ps(x->aux.f), accm[m]);
    }
}

/* Each row's four lanes summed, (l0 + l2) + (l1 + l3), the rows' sums in order. */
INLINE __m128 row_sums(__m512 acc)
{
    const __m512 t = _mm512_add_ps(acc, _mm512_permute_ps(acc, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, u));
}

/* One tile (tile_fn, below), x rows xp[0, mr) nb blocks apart; the matrix's last block is read
 * masked. qtype and mr are constants where this is inlined. */
INLINE void tile(const int64_t qtype, const int mr, const uint8_t *w, int64_t row_bytes,
                 int nvalid, int last, const xblock *xp, int64_t nb, float *y, int64_t ldy,
                 const float *bias, int64_t ldx)
{
    (void)ldx; /* x rows are nb blocks apart */
    const int64_t bb = block_bytes(qtype);
    const uint8_t *wr[NR];
    for (int r = 0; r < NR; r++) wr[r] = w + (r < nvalid ? r : nvalid - 1) * row_bytes;
    /* Q4_1's m terms in accumulators of their own: one FMA chain each */
    __m512 acc[MR], accm[MR];
    for (int m = 0; m < mr; m++) acc[m] = accm[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb - 1; b++) {
        const wblock blk = load_block(qtype, wr, b * bb, 0);
        dot_block(qtype, mr, &blk, xp + b, nb, acc, accm);
    }
    const wblock blk = last ? load_block(qtype, wr, (nb - 1) * bb, 1)
                            : load_block(qtype, wr, (nb - 1) * bb, 0);
    dot_block(qtype, mr, &blk, xp + nb - 1, nb, acc, accm);
    const __mmask8 store = (__mmask8)((1u << nvalid) - 1);
    const __m128 b = bias ? _mm_maskz_loadu_ps(store, bias) : _mm_setzero_ps();
    for (int m = 0; m < mr; m++) {
        const __m512 sum = qtype == QT_Q4_1 ? _mm512_add_ps(acc[m], accm[m]) : acc[m];
        _mm_mask_storeu_ps(y + m * ldy, store, _mm_add_ps(row_sums(sum), b));
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NR 2 /* weight rows per tile: two rows x four lanes = one 256-bit vector */
#define MR 8
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define QL_PATH "avx2-vnni"
#define X_UNSIGNED 1
#if defined(__AVXVNNI__)
#define DPBUSD _mm256_dpbusd_avx_epi32
#else
#define DPBUSD _mm256_dpbusd_epi32
#endif
#else
#define QL_PATH "avx2"
#define X_UNSIGNED 0
#endif

static void quant_row(const float *x, int64_t nb, int64_t qtype, xblock *out)
{
    quant_row_avx2(x, nb, qtype, X_UNSIGNED && qtype == QT_Q8_0, 0.25f, -2, out);
}

/* Sum of the four byte products a_j * b_j (a unsigned, b signed) in each 32-bit lane, + acc.
 * Without VNNI through 16-bit pairs: two products of |values| <= 15 * 127 or 128 * 127, never
 * saturating. */
INLINE __m256i dot4(__m256i acc, __m256i a, __m256i b)
{
#if X_UNSIGNED
    return DPBUSD(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b),
                                                   _mm256_set1_epi16(1)));
#endif
}

typedef struct {
    __m256i lo, hi, corr;
    __m256 d, m;
} wblock;

INLINE __m256i load2(const uint8_t *a, const uint8_t *b)
{
    return _mm256_loadu2_m128i((const __m128i *)b, (const __m128i *)a);
}

INLINE wblock load_block(const int64_t qtype, const uint8_t *const wr[NR], int64_t at,
                         const int masked)
{
    (void)masked; /* every load here is inside the block */
    wblock o;
    const int q41 = qtype == QT_Q4_1;
    uint32_t dd = (uint32_t)rd16(wr[0] + at) | (uint32_t)rd16(wr[1] + at) << 16;
    uint32_t mm = q41 ? (uint32_t)rd16(wr[0] + at + 2) | (uint32_t)rd16(wr[1] + at + 2) << 16 : 0;
    const __m256 dm = _mm256_castps128_ps256(
        _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128((int)dd), _mm_cvtsi32_si128((int)mm))));
    o.d = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    o.m = q41 ? _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3))
              : _mm256_setzero_ps();
    o.corr = _mm256_setzero_si256();
    if (qtype == QT_Q8_0) {
        o.lo = load2(wr[0] + at + 2, wr[1] + at + 2);
        o.hi = load2(wr[0] + at + 18, wr[1] + at + 18);
#if X_UNSIGNED
        const __m256i k128 = _mm256_set1_epi8((char)0x80);
        o.corr = _mm256_sub_epi32(_mm256_setzero_si256(),
                                  dot4(dot4(_mm256_setzero_si256(), k128, o.lo), k128, o.hi));
#endif
    } else {
        const int s0 = q41 ? 4 : 2;
        const __m256i nib = load2(wr[0] + at + s0, wr[1] + at + s0);
        const __m256i low = _mm256_set1_epi8(0x0f);
        o.lo = _mm256_and_si256(nib, low);
        o.hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
    }
    return o;
}

INLINE void dot_block(const int64_t qtype, const int mr, const wblock *w, const xblock *xb,
                      int64_t nb, __m256 acc[MR])
{
    for (int m = 0; m < mr; m++) {
        const xblock *x = xb + m * nb;
        const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)x->q));
        const __m256i xhi =
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x->q + 16)));
        __m256i dot;
        if (qtype == QT_Q8_0) {
#if X_UNSIGNED
            dot = dot4(dot4(w->corr, xlo, w->lo), xhi, w->hi);
#else
            /* |w| times x with w's sign (|-128| reads as 128 unsigned) */
            dot = dot4(dot4(_mm256_setzero_si256(), _mm256_sign_epi8(w->lo, w->lo),
                            _mm256_sign_epi8(xlo, w->lo)),
                       _mm256_sign_epi8(w->hi, w->hi), _mm256_sign_epi8(xhi, w->hi));
#endif
        } else {
            const __m256i start =
                qtype == QT_Q4_0 ? _mm256_set1_epi32(x->aux.i) : _mm256_setzero_si256();
#if X_UNSIGNED
            dot = dot4(dot4(start, w->lo, xlo), w->hi, xhi);
#else
            /* both halves in 16 bits first: 4 products of <= 15 * 127 fit */
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w->lo, xlo),
                                                   _mm256_maddubs_epi16(w->hi, xhi));
            dot = _mm256_add_epi32(start, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
        }
        const __m256 scale = _mm256_mul_ps(w->d, _mm256_set1_ps(x->dx));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
        if (qtype == QT_Q4_1) acc[m] = _mm256_fmadd_ps(w->m, _mm256_set1_ps(x->aux.f), acc[m]);
    }
}

/* The two rows' four lanes summed, (l0 + l2) + (l1 + l3). */
INLINE void row_sums(__m256 acc, float out[2])
{
    const __m256 t = _mm256_add_ps(acc, _mm256_permute_ps(acc, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m256 u = _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
    out[0] = _mm256_cvtss_f32(u);
    out[1] = _mm_cvtss_f32(_mm256_extractf128_ps(u, 1));
}

INLINE void tile(const int64_t qtype, const int mr, const uint8_t *w, int64_t row_bytes,
                 int nvalid, int last, const xblock *xp, int64_t nb, float *y, int64_t ldy,
                 const float *bias, int64_t ldx)
{
    (void)ldx; /* x rows are nb blocks apart */
    (void)last;
    const int64_t bb = block_bytes(qtype);
    const uint8_t *wr[NR];
    for (int r = 0; r < NR; r++) wr[r] = w + (r < nvalid ? r : nvalid - 1) * row_bytes;
    __m256 acc[MR];
    for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const wblock blk = load_block(qtype, wr, b * bb, 0);
        dot_block(qtype, mr, &blk, xp + b, nb, acc);
    }
    for (int m = 0; m < mr; m++) {
        float s[2];
        row_sums(acc[m], s);
        for (int r = 0; r < nvalid; r++) y[m * ldy + r] = bias ? s[r] + bias[r] : s[r];
    }
}

#else
#define QL_PATH "portable"
#define NR 1
#define MR 1

static void quant_row(const float *x, int64_t nb, int64_t qtype, xblock *out)
{
    (void)qtype;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        int nan = 0;
        for (int j = 0; j < QK; j++) {
            const float a = xb[j] < 0 ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
            nan |= xb[j] != xb[j];
        }
        const float d = nan ? NAN : amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sx = 0;
        for (int j = 0; j < QK; j++) {
            const float v = xb[j] * id;
            const int q = (int)(v < 0 ? v - 0.5f : v + 0.5f);
            out[b].q[j] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
            sx += out[b].q[j];
        }
        out[b].dx = d;
        out[b].aux.i = sx;
    }
}

INLINE void tile(const int64_t qtype, const int mr, const uint8_t *w, int64_t row_bytes,
                 int nvalid, int last, const xblock *xp, int64_t nb, float *y, int64_t ldy,
                 const float *bias, int64_t ldx)
{
    (void)ldx; /* x rows are nb blocks apart */
    const int64_t bb = block_bytes(qtype);
    (void)last;
    for (int m = 0; m < mr; m++) {
        for (int r = 0; r < nvalid; r++) {
            const uint8_t *wrow = w + r * row_bytes;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *pb = wrow + b * bb;
                const xblock *xb = xp + m * nb + b;
                int32_t dot = 0;
                if (qtype == QT_Q8_0) {
                    for (int j = 0; j < QK; j++) dot += (int8_t)pb[2 + j] * xb->q[j];
                } else {
                    const uint8_t *qs = pb + (qtype == QT_Q4_1 ? 4 : 2);
                    for (int j = 0; j < 16; j++)
                        dot += (qs[j] & 15) * xb->q[j] + (qs[j] >> 4) * xb->q[j + 16];
                    if (qtype == QT_Q4_0) dot -= 8 * xb->aux.i;
                }
                const float scale = f16_to_f32(rd16(pb)) * xb->dx;
                acc += scale * (float)dot;
                if (qtype == QT_Q4_1) {
                    const float msx = xb->dx * (float)xb->aux.i;
                    acc += f16_to_f32(rd16(pb + 2)) * msx;
                }
            }
            y[m * ldy + r] = bias ? acc + bias[r] : acc;
        }
    }
}
#endif

const char *baton_quant_path(void) { return QL_PATH; }

/* ---------------------------------------------------------------------------------------------
 * The fp32 kernel (baton_quant_linear_f32): x stays fp32; each weight block is dequantized in
 * registers, with the arithmetic of dequant_row (so the values are bit-equal to gguf-py's), and
 * multiplied into fp32 accumulators by FMA. The result is x . dequant(W)^T up to the order of
 * the fp32 sums: one accumulator vector per (x row, weight row), lane j summing elements
 * j, j + L, ... (L = 16 or 8 lanes), its lanes added at the end of K in a fixed order. As in
 * the int8 kernel, an output's sum does not depend on the tile it sat in.
 *  - AVX-512: 4 weight rows x 4 x rows a tile (16 accumulators, 8 weight vectors). A Q4 block
 *    is its 16 levels, d * (j - 8) or (d * j) + m for j = 0..15 (the same two roundings as
 *    the reference), computed once in one vector, then looked up by the nibbles (vpermps reads
 *    an index's low four bits: the low nibbles need no mask).
 *  - AVX2: 2 weight rows x 4 x rows, a block in two halves of 16.
 *  - Portable C otherwise, one output at a time (no FMA: a mul and an add).
 */
#if defined(__AVX512F__)
#define F_PATH "avx512"
#define FNR 4
#define FMR 4
typedef __m512 fvec;

INLINE fvec fzero(void) { return _mm512_setzero_ps(); }

INLINE float fsum(fvec v) { return _mm512_reduce_add_ps(v); }

/* The block at p, dequantized: elements 0..15 in *lo, 16..31 in *hi. */
INLINE void fdeq_block(const int64_t qtype, const uint8_t *p, __m512 *lo, __m512 *hi)
{
    const __m512 d = _mm512_set1_ps(f16_to_f32(rd16(p)));
    if (qtype == QT_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(p + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(p + 18));
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
    } else {
        const int q41 = qtype == QT_Q4_1;
        const __m512 levels = q41 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                   14, 15)
                                  : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3,
                                                   4, 5, 6, 7);
        __m512 t = _mm512_mul_ps(d, levels);
        if (q41) t = _mm512_add_ps(t, _mm512_set1_ps(f16_to_f32(rd16(p + 2))));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + (q41 ? 4 : 2))));
        *lo = _mm512_permutexvar_ps(q, t);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t);
    }
}

/* acc[m][r] += block b of weight rows wr[r] (bb bytes a block) times block b of x rows m < mr
 * (ldx apart). */
INLINE void fblock(const int64_t qtype, const int mr, const uint8_t *const wr[FNR], int64_t bb,
                   const float *x, int64_t ldx, int64_t b, fvec acc[FMR][FNR])
{
    __m512 lo[FNR], hi[FNR];
    for (int r = 0; r < FNR; r++) fdeq_block(qtype, wr[r] + b * bb, &lo[r], &hi[r]);
    for (int m = 0; m < mr; m++) {
        const float *xb = x + m * ldx + b * QK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        for (int r = 0; r < FNR; r++)
            acc[m][r] = _mm512_fmadd_ps(hi[r], x1, _mm512_fmadd_ps(lo[r], x0, acc[m][r]));
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define F_PATH "avx2"
#define FNR 2
#define FMR 4
typedef __m256 fvec;

INLINE fvec fzero(void) { return _mm256_setzero_ps(); }

INLINE float fsum(fvec v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Half h of the block at p (elements 16h..16h+15), dequantized as dequant_row does. */
INLINE void fdeq_half(const int64_t qtype, const uint8_t *p, int h, __m256 out[2])
{
    const __m256 d = _mm256_set1_ps(f16_to_f32(rd16(p)));
    if (qtype == QT_Q8_0) {
        for (int i = 0; i < 2; i++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(p + 2 + 16 * h + 8 * i));
            out[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
        }
    } else {
        const int q41 = qtype == QT_Q4_1;
        const __m128i qs = _mm_loadu_si128((const __m128i *)(p + (q41 ? 4 : 2)));
        const __m128i low = _mm_set1_epi8(0x0f);
        const __m128i nib = h ? _mm_and_si128(_mm_srli_epi16(qs, 4), low) : _mm_and_si128(qs, low);
        for (int i = 0; i < 2; i++) {
            __m256i q = _mm256_cvtepu8_epi32(i ? _mm_srli_si128(nib, 8) : nib);
            if (!q41) q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
            __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
            if (q41) v = _mm256_add_ps(v, _mm256_set1_ps(f16_to_f32(rd16(p + 2))));
            out[i] = v;
        }
    }
}

/* As the AVX-512 fblock, the block in two halves of 16. */
INLINE void fblock(const int64_t qtype, const int mr, const uint8_t *const wr[FNR], int64_t bb,
                   const float *x, int64_t ldx, int64_t b, fvec acc[FMR][FNR])
{
    for (int h = 0; h < 2; h++) {
        __m256 wv[FNR][2];
        for (int r = 0; r < FNR; r++) fdeq_half(qtype, wr[r] + b * bb, h, wv[r]);
        for (int m = 0; m < mr; m++) {
            const float *xb = x + m * ldx + b * QK + 16 * h;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            for (int r = 0; r < FNR; r++)
                acc[m][r] =
                    _mm256_fmadd_ps(wv[r][1], x1, _mm256_fmadd_ps(wv[r][0], x0, acc[m][r]));
        }
    }
}

#else
#define F_PATH "portable"
#define FNR 1
#define FMR 1

INLINE void ftile(const int64_t qtype, const int mr, const uint8_t *w, int64_t row_bytes,
                  int nvalid, int last, const float *x, int64_t nb, float *y, int64_t ldy,
                  const float *bias, int64_t ldx)
{
    const int64_t bb = block_bytes(qtype);
    (void)row_bytes;
    (void)nvalid;
    (void)last;
    float wb[QK];
    for (int m = 0; m < mr; m++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            dequant_row(w + b * bb, qtype, 1, wb);
            const float *xb = x + m * ldx + b * QK;
            for (int j = 0; j < QK; j++) acc += wb[j] * xb[j];
        }
        y[m * ldy] = bias ? acc + bias[0] : acc;
    }
}
#endif

#if FNR > 1
/* One tile (tile_fn, below) of the SIMD builds: their block step (fblock) over K, then each
 * accumulator's lanes added. qtype and mr are constants where this is inlined. */
INLINE void ftile(const int64_t qtype, const int mr, const uint8_t *w, int64_t row_bytes,
                  int nvalid, int last, const float *x, int64_t nb, float *y, int64_t ldy,
                  const float *bias, int64_t ldx)
{
    (void)last;
    const int64_t bb = block_bytes(qtype);
    const uint8_t *wr[FNR];
    for (int r = 0; r < FNR; r++) wr[r] = w + (r < nvalid ? r : nvalid - 1) * row_bytes;
    fvec acc[FMR][FNR];
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < FNR; r++) acc[m][r] = fzero();
    for (int64_t b = 0; b < nb; b++) fblock(qtype, mr, wr, bb, x, ldx, b, acc);
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nvalid; r++) {
            const float s = fsum(acc[m][r]);
            y[m * ldy + r] = bias ? s + bias[r] : s;
        }
}
#endif

const char *baton_quant_f32_path(void) { return F_PATH; }

/* ---------------------------------------------------------------------------------------------
 * The calls of both kernels.
 *
 * A tile: weight rows w[0, nvalid) (row_bytes apart; past nvalid the last one again, not stored)
 * times x rows x[0, mr) (the int8 kernel's xblocks, rows nb apart; the fp32 kernel's floats, rows
 * ldx apart) into y[0, mr)[0, nvalid) (ldy apart), + bias[0, nvalid) if given; `last`: the tile
 * holds the matrix's last row. Each (kernel, type, x rows) is compiled on its own, the loops over
 * rows unrolled, and a call picks one by its type and x rows: fns[type_index(qtype)][mr - 1]. */
typedef void (*tile_fn)(const uint8_t *w, int64_t row_bytes, int nvalid, int last, const void *x,
                        int64_t nb, float *y, int64_t ldy, const float *bias, int64_t ldx);

#define TILE_FN(KERNEL, NAME, QT, M)                                                             \
    static void NAME##_##M(const uint8_t *w, int64_t row_bytes, int nvalid, int last,           \
                           const void *x, int64_t nb, float *y, int64_t ldy, const float *bias,  \
                           int64_t ldx)                                                          \
    {                                                                                            \
        KERNEL(QT, M, w, row_bytes, nvalid, last, x, nb, y, ldy, bias, ldx);                     \
    }
#define TILE_FNS_1(K, NAME, QT) TILE_FN(K, NAME, QT, 1)
#define TILE_FNS_4(K, NAME, QT)                                                                  \
    TILE_FNS_1(K, NAME, QT) TILE_FN(K, NAME, QT, 2) TILE_FN(K, NAME, QT, 3) TILE_FN(K, NAME, QT, 4)
#define TILE_FNS_8(K, NAME, QT)                                                                  \
    TILE_FNS_4(K, NAME, QT) TILE_FN(K, NAME, QT, 5) TILE_FN(K, NAME, QT, 6)                      \
    TILE_FN(K, NAME, QT, 7) TILE_FN(K, NAME, QT, 8)
#define TILE_PTRS_1(NAME) NAME##_1
#define TILE_PTRS_4(NAME) TILE_PTRS_1(NAME), NAME##_2, NAME##_3, NAME##_4
#define TILE_PTRS_8(NAME) TILE_PTRS_4(NAME), NAME##_5, NAME##_6, NAME##_7, NAME##_8
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
/* KERNEL's tiles of the three types for 1 .. ROWS x rows, and TABLE[type][x rows - 1] of them. */
#define KERNEL_TILES(KERNEL, TABLE, ROWS)                                                        \
    CAT(TILE_FNS_, ROWS)(KERNEL, KERNEL##_q4_0, QT_Q4_0)                                         \
    CAT(TILE_FNS_, ROWS)(KERNEL, KERNEL##_q4_1, QT_Q4_1)                                         \
    CAT(TILE_FNS_, ROWS)(KERNEL, KERNEL##_q8_0, QT_Q8_0)                                         \
    static const tile_fn TABLE[3][ROWS] = {{CAT(TILE_PTRS_, ROWS)(KERNEL##_q4_0)},               \
                                           {CAT(TILE_PTRS_, ROWS)(KERNEL##_q4_1)},               \
                                           {CAT(TILE_PTRS_, ROWS)(KERNEL##_q8_0)}};

KERNEL_TILES(tile, int8_tiles, MR)
KERNEL_TILES(ftile, f32_tiles, FMR)

static int type_index(int64_t qtype) { return qtype == QT_Q4_0 ? 0 : qtype == QT_Q4_1 ? 1 : 2; }

/* y[m, n] (contiguous) = x[m, k] (rows ldx floats apart) . dequant(w[n, k])^T + bias (or NULL)
 * through `fns` (tiles of nr weight rows and up to max_mr x rows), the tiles split into `parts`
 * contiguous ranges. `xp` (the int8 kernel): x quantized into it first, in the same parallel
 * region, and the tiles read it; NULL (the fp32 kernel): they read x. */
static void run_tiles(const tile_fn *fns, int nr, int max_mr, const uint8_t *w, int64_t qtype,
                      int64_t n, int64_t nb, const float *x, int64_t m, int64_t ldx,
                      xblock *xp, const float *bias, float *y, int64_t parts)
{
    const int64_t row_bytes = nb * block_bytes(qtype), tiles = (n + nr - 1) / nr;
#pragma omp parallel num_threads(parts) if (parts > 1)
    {
        if (xp != NULL) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) quant_row(x + r * ldx, nb, qtype, xp + r * nb);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * nr;
            const int nvalid = (int)(n - n0 < nr ? n - n0 : nr);
            for (int64_t m0 = 0; m0 < m; m0 += max_mr) {
                const int mr = (int)(m - m0 < max_mr ? m - m0 : max_mr);
                const void *xm = xp != NULL ? (const void *)(xp + m0 * nb) : x + m0 * ldx;
                fns[mr - 1](w + n0 * row_bytes, row_bytes, nvalid, n0 + nvalid == n, xm, nb,
                            y + m0 * n + n0, n, bias ? bias + n0 : NULL, ldx);
            }
        }
    }
}

/* y[m, n] (contiguous) = x[m, k] (rows ldx floats apart) . dequant(w[n, k])^T + bias (or NULL).
 * 0, -1 for an unknown type or k not a multiple of 32, -2 if the scratch cannot be allocated. */
int baton_quant_linear(const uint8_t *w, int64_t qtype, int64_t n, int64_t k, const float *x,
                       int64_t m, int64_t ldx, const float *bias, float *y, int64_t parts)
{
    const int64_t nb = row_blocks(qtype, k);
    if (nb == 0) return -1;
    if (m == 0 || n == 0) return 0;
    xblock *xp = malloc((size_t)(m * nb) * sizeof(xblock));
    if (xp == NULL) return -2;
    run_tiles(int8_tiles[type_index(qtype)], NR, MR, w, qtype, n, nb, x, m, ldx, xp, bias, y,
              parts);
    free(xp);
    return 0;
}

/* As baton_quant_linear, x kept in fp32: y = x . dequant(w)^T + bias up to the fp32 sums'
 * order. 0, or -1 for an unknown type or k not a multiple of 32. */
int baton_quant_linear_f32(const uint8_t *w, int64_t qtype, int64_t n, int64_t k, const float *x,
                           int64_t m, int64_t ldx, const float *bias, float *y, int64_t parts)
{
    const int64_t nb = row_blocks(qtype, k);
    if (nb == 0) return -1;
    if (m == 0 || n == 0) return 0;
    run_tiles(f32_tiles[type_index(qtype)], FNR, FMR, w, qtype, n, nb, x, m, ldx, NULL, bias, y,
              parts);
    return 0;
}
