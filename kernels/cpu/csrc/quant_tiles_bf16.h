/* The tiled linear of quant_tiles.c in a bf16 model's arithmetic on AMX's bf16 tiles: each weight
 * dequantized as gguf-py does (fp32: d * q, (d * q) + m, d * (q - 8)) and rounded once to bf16,
 * x rounded to bf16, the products summed in fp32 by tdpbf16ps (denormals flushed), bias added
 * last: F.linear over the bf16 model of the dequantized weights, up to the order of the sums.
 *
 * Why: the int8 kernel pays float work per (weight row, x row, block): a block's scales are per
 * x row and weight row, so no unit can sum more than one block before it. At a decode batch of
 * 64 that work, not the weights' bytes, set the step's pace on a Sapphire Rapids. Here the
 * float work is per weight, once a call whatever the rows: a group's blocks are dequantized into
 * B tiles in this thread's scratch, and the x rows meet them 16 at a time, the tile unit summing
 * the whole of k (docs/perf-log.md, "Packed decode on AMX's bf16 tiles").
 *
 * Included by quant_tiles.c inside its AVX-512 VNNI build, after amx.h. The B tile of block b is
 * dense_tiles.c's bf16 layout: pair row p holds the 16 weight rows' (k, k+1) for k = 32b + 2p,
 * and a Q tile's chunks give them as they lie: chunk c's lane r holds row r's quant bytes
 * 4c .. 4c+3, so its bytes 0-1 are pair 2c, bytes 2-3 pair 2c+1 (Q8_0); a Q4 byte's low nibble
 * is element j, its high one j + 16 (pairs 2c, 2c+1 from the low nibbles, 8 + 2c, 9 + 2c from
 * the high ones). Each pair row is two fp32 vectors (the even k of the 16 rows, the odd k),
 * rounded together (vcvtne2ps2bf16) and interleaved into (even, odd) dwords (vpermw). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <omp.h>
#define HAVE_AMX_BF16 1
#define BF16_RUN 4 /* groups whose B tiles are made before the x rows meet them (tmm0-3) */
/* Rows from which the decode step's call (baton_quant_tiles_linear_amx_bf16) takes these tiles:
 * the weight's dequantize, once a call, costs about what the int8 kernel spends on 24-32 rows
 * (docs/perf-log.md, "Packed decode on AMX's bf16 tiles"). */
#define BF16_MIN_ROWS 32

/* The (even, odd) pair of the 16 rows as pair row `p` of the B tile at out. */
INLINE void put_pair(uint16_t *out, int p, __m512 even, __m512 odd)
{
    /* word 2r <- word r (even's row r), word 2r + 1 <- word 16 + r (odd's) */
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    _mm512_store_si512(out + p * 32, _mm512_permutexvar_epi16(order, both));
}

/* One Q tile (16 rows' block) as the block's B tile, 512 bf16 at out (64-byte aligned). qtype is
 * a constant where this is inlined. */
INLINE void dequant_tile_bf16(const int64_t qtype, const uint8_t *t, uint16_t *out)
{
    const int64_t sb = scale_bytes(qtype);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
    if (qtype == QT_Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int c = 0; c < 8; c++) { /* signed again, then each byte sign-extended */
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(t + sb + 64 * c), flip);
            __m512 w[4];
            for (int j = 0; j < 4; j++) {
                const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24);
                w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
            }
            put_pair(out, 2 * c, w[0], w[1]);
            put_pair(out, 2 * c + 1, w[2], w[3]);
        }
        return;
    }
    const __m512 mv = qtype == QT_Q4_1
                          ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 2 * TR)))
                          : _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(t + sb + 64 * c);
        for (int h = 0; h < 2; h++) { /* the low nibbles, then the high ones */
            __m512 w[4];
            for (int j = 0; j < 4; j++) {
                __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 4 * h), low);
                if (qtype == QT_Q4_0) q = _mm512_sub_epi32(q, eight);
                w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
                if (qtype == QT_Q4_1) w[j] = _mm512_add_ps(w[j], mv);
            }
            put_pair(out, 8 * h + 2 * c, w[0], w[1]);
            put_pair(out, 8 * h + 2 * c + 1, w[2], w[3]);
        }
    }
}

/* The B tiles of a run of groups still to be made, made a slice at a time between the tile
 * products of the run before: the vector units dequantize while the tile unit sums. A run's
 * tiles lie one after another (a group's nb, then the next group's), as their B tiles do. */
typedef struct {
    const uint8_t *src; /* the run's first Q tile */
    uint16_t *dst;      /* its first B tile */
    int64_t total, done;
} bf16_cursor;

INLINE void dequant_upto(const int64_t qtype, bf16_cursor *cur, int64_t target)
{
    const int64_t tile = TR * block_bytes(qtype);
    for (; cur->done < target; cur->done++)
        dequant_tile_bf16(qtype, cur->src + cur->done * tile, cur->dst + cur->done * 512);
}

/* amx_bf16_sums' `between`: the next run's B tiles up to x block `block`'s chunk c, in even
 * slices over the run's chunks. */
typedef struct {
    bf16_cursor next;
    int64_t block, nb, steps; /* x block, chunks a block, chunks of the run (x blocks * nb) */
} bf16_between;

#define BETWEEN_FN(NAME, QT)                                                                   \
    static inline __attribute__((always_inline)) void NAME(void *ctx, int64_t c)              \
    {                                                                                          \
        bf16_between *b = ctx;                                                                 \
        dequant_upto(QT, &b->next, (b->block * b->nb + c + 1) * b->next.total / b->steps);     \
    }
BETWEEN_FN(between_q4_0, QT_Q4_0)
BETWEEN_FN(between_q4_1, QT_Q4_1)
BETWEEN_FN(between_q8_0, QT_Q8_0)

/* One part's groups [g0, g1) in runs of BF16_RUN: each run's B tiles (made during the run
 * before, the first run's up front) against the x rows 16 at a time, into y (+ bias; fp32, or
 * bf16 where y16). `runs`: the part's two scratch runs. qtype is a constant where this is
 * inlined. */
INLINE void bf16_part(const int64_t qtype, const uint8_t *w, int64_t n, int64_t k,
                      const uint16_t *xb, int64_t m, const float *bias, void *y, int y16,
                      int64_t g0, int64_t g1, uint16_t *runs[2])
{
    const int64_t nb = k / QK, group_bytes = TR * nb * block_bytes(qtype);
    const int64_t xblocks = (m + TR - 1) / TR;
    void (*between)(void *, int64_t) = qtype == QT_Q4_0   ? between_q4_0
                                       : qtype == QT_Q4_1 ? between_q4_1
                                                          : between_q8_0;
    float acc[BF16_RUN * TR * TR] __attribute__((aligned(64)));
    int64_t configured = 0;
    const int64_t t0 = g1 - g0 < BF16_RUN ? g1 - g0 : BF16_RUN;
    bf16_cursor first = {w + g0 * group_bytes, runs[0], t0 * nb, 0};
    dequant_upto(qtype, &first, first.total);
    for (int64_t g = g0, r = 0; g < g1; g += BF16_RUN, r++) {
        const int t = g1 - g < BF16_RUN ? (int)(g1 - g) : BF16_RUN;
        const uint16_t *B = runs[r & 1];
        const int64_t gn = g + BF16_RUN, tn = g1 - gn < BF16_RUN ? g1 - gn : BF16_RUN;
        bf16_between ctx = {{w + gn * group_bytes, runs[(r + 1) & 1], gn < g1 ? tn * nb : 0, 0},
                            0, nb, xblocks * nb};
        for (int64_t m0 = 0; ctx.block < xblocks; ctx.block++, m0 += TR) {
            const int64_t rows = m - m0 < TR ? m - m0 : TR;
            if (rows != configured) amx_bf16_configure(configured = rows);
            const uint16_t *xm = xb + m0 * k;
            /* t at run time: one copy of the loop with the dequantize inlined in it */
            amx_bf16_sums(t, B, k, xm, acc, between, &ctx);
            for (int tt = 0; tt < t; tt++) {
                const int64_t n0 = (g + tt) * TR;
                const int nvalid = (int)(n - n0 < TR ? n - n0 : TR);
                const __mmask16 keep = (__mmask16)((1u << nvalid) - 1);
                const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0)
                                       : _mm512_setzero_ps();
                for (int64_t j = 0; j < rows; j++) {
                    const __m512 a = _mm512_load_ps(acc + (tt * TR + j) * TR);
                    const __m512 out = _mm512_add_ps(a, bv);
                    const int64_t at = (m0 + j) * n + n0;
                    if (y16) /* rounded to nearest even, as torch rounds (denormals flushed) */
                        _mm256_mask_storeu_epi16((uint16_t *)y + at, keep,
                                                 (__m256i)_mm512_cvtneps_pbh(out));
                    else
                        _mm512_mask_storeu_ps((float *)y + at, keep, out);
                }
            }
        }
    }
    if (configured) _tile_release();
}

#define BF16_PART_FN(NAME, QT)                                                                 \
    static void NAME(const uint8_t *w, int64_t n, int64_t k, const uint16_t *xb, int64_t m,    \
                     const float *bias, void *y, int y16, int64_t g0, int64_t g1,              \
                     uint16_t *runs[2])                                                         \
    {                                                                                          \
        bf16_part(QT, w, n, k, xb, m, bias, y, y16, g0, g1, runs);                             \
    }
BF16_PART_FN(bf16_part_q4_0, QT_Q4_0)
BF16_PART_FN(bf16_part_q4_1, QT_Q4_1)
BF16_PART_FN(bf16_part_q8_0, QT_Q8_0)

/* tiles_linear on AMX's bf16 tiles, x and y fp32, or bf16 both where `io16` (a bf16 model's
 * rows: x is then used as it is, y rounded in place of torch's rounding of the fp32 result): 0,
 * or -2 if the bf16 x or the scratch cannot be allocated. */
static int amx_bf16_tiles_linear(const int io16, const uint8_t *w, int64_t qtype, int64_t n,
                                 int64_t k, const void *x, int64_t m, int64_t ldx,
                                 const float *bias, void *y, int64_t parts)
{
    const int64_t groups = (n + TR - 1) / TR;
    const int64_t x_elems = (m * k + 31) / 32 * 32, run_elems = BF16_RUN * TR * k;
    uint16_t *mem = aligned_alloc(64, (size_t)(x_elems + 2 * parts * run_elems) * sizeof *mem);
    if (mem == NULL) return -2;
    uint16_t *xb = mem;
    void (*part)(const uint8_t *, int64_t, int64_t, const uint16_t *, int64_t, const float *,
                 void *, int, int64_t, int64_t, uint16_t *[2]) =
        qtype == QT_Q4_0 ? bf16_part_q4_0 : qtype == QT_Q4_1 ? bf16_part_q4_1 : bf16_part_q8_0;
#pragma omp parallel num_threads(parts) if (parts > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            if (io16) {
                memcpy(xb + r * k, (const uint16_t *)x + r * ldx, (size_t)k * sizeof *xb);
                continue;
            }
            const float *xr = (const float *)x + r * ldx;
            for (int64_t j = 0; j < k; j += 32) {
                const __m512 lo = _mm512_loadu_ps(xr + j), hi = _mm512_loadu_ps(xr + j + 16);
                _mm512_storeu_si512(xb + r * k + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
        const int p = omp_get_thread_num(), np = omp_get_num_threads();
        uint16_t *runs[2] = {mem + x_elems + 2 * p * run_elems,
                             mem + x_elems + (2 * p + 1) * run_elems};
        const int64_t g0 = groups * p / np, g1 = groups * (p + 1) / np;
        if (g0 < g1) part(w, n, k, xb, m, bias, y, io16, g0, g1, runs);
    }
    free(mem);
    return 0;
}
#endif
