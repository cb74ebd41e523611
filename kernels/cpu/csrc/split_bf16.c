/* A linear in fp32 on AMX's bf16 tiles, each operand split into two bf16s, CPU:
 * y[M, N] = x[M, K] . W[N, K]^T (+ b), near fp32's precision, where the CPU has AMX: the
 * prefill engine's packed weights (docs/engine.md, "GGUF files and packed quantized weights").
 * On a Sapphire Rapids 1.2-1.3x SGEMM's pace and ~1.8x that of x in two bytes a value on vpdpbusd
 * (docs/perf-log.md, "Packed prefill on AMX"): its tile products run at a fifth of the unit's
 * rate, a tile load and the products that wait on it serialising (the tiles are not renamed).
 *
 * Why: AMX multiplies bf16 pairs into fp32 sums at ~10x the rate of fp32 FMA, but one bf16 holds
 * 8 bits of a value. Split every value v into hi = bf16(v) and lo = bf16(v - hi) (each rounded
 * to nearest even): hi + lo holds v to ~2^-17 of it. Then
 *     x . w = xh . wh + xh . wl + xl . wh   (+ xl . wl, ~2^-18 of it, dropped)
 * three tile products, all summed into one fp32 accumulator by tdpbf16ps. The error of a sum is
 * ~4e-6 of the outputs' norm, below that of x in two bytes a value (quant_tiles.c's wide
 * kernel, ~4e-5) and far below bf16's (~3e-3); fp32 SGEMM's summation order alone gives ~3e-7.
 *
 * Layouts:
 *   W split (baton_split_bf16_pack): per group of 16 rows g, per chunk of 32 k c, a hi tile then
 *   a lo tile, each 16 rows (k pairs p) of 64 bytes (16 weight rows, a bf16 pair each): the
 *   element (row g*16 + r, k = 32c + 2p + j) at ((g * nc + c) * 2 + lo) * 512 + p * 32 + r * 2 + j,
 *   rows padded to a multiple of 16 with zeros: tdpbf16ps's B operand as it lies.
 *   x split (inside a call): hi and lo rows of K bf16s, the A operand (16 rows, 32 k a tile).
 *
 * Tiles: C tmm0-3 (2 x tiles x 2 groups, 16 x 16 fp32 each), A tmm4 and tmm5 (the two x
 * tiles' hi, then lo), B tmm6 and tmm7 (the two groups' hi, lo, hi). A chunk: 4 A loads, 6 B
 * loads, 12 tdpbf16ps.
 *
 * Threads: a call splits x's rows on torch's OpenMP team, then each thread takes a
 * contiguous range of the pairs of groups, and runs it against x in chunks of XCHUNK rows (a
 * chunk's split rows stay in L2 while the range's groups pass over them).
 *
 * Builds: AMX-BF16 with AVX512-BF16 (Sapphire Rapids and later); elsewhere every entry returns
 * -1 and baton_split_bf16_available() 0. */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#define HAVE_SPLIT 1
#include "amx.h"
#endif

#define TR 16      /* rows of a tile */
#define KC 32      /* k of a chunk: a tile row's 64 bytes of bf16 */
#define XCHUNK 256 /* x rows a pass over a thread's groups */

#ifdef HAVE_SPLIT
static void configure(void)
{
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = TR;
    _tile_loadconfig(&cfg);
}

/* 32 floats into their hi and lo bf16s, in order. */
static inline void split32(const float *v, __m512i *hi, __m512i *lo)
{
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
    /* hi back to fp32: a bf16 is the top half of its fp32 */
    const __m512i hb = (__m512i)h;
    const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                          _mm512_castsi512_si256(hb)), 16));
    const __m512 hb2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                           _mm512_extracti64x4_epi64(hb, 1)), 16));
    *hi = hb;
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb2), _mm512_sub_ps(a, ha));
}

/* rows [r0, r1) of x (ldx apart) split into xh, xl ([rows][k]); rows from m on zero. */
static void split_rows(const float *x, int64_t m, int64_t ldx, int64_t k, int64_t r0, int64_t r1,
                       uint16_t *xh, uint16_t *xl)
{
    for (int64_t r = r0; r < r1; r++)
        for (int64_t j = 0; j < k; j += KC) {
            __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
            if (r < m) split32(x + r * ldx + j, &h, &l);
            _mm512_storeu_si512(xh + r * k + j, h);
            _mm512_storeu_si512(xl + r * k + j, l);
        }
}
#endif

/* out = W's split tiles (the layout above) from fp32 rows w [n][k] (k a multiple of 32), over
 * `parts` threads. 0; -1 where this build has no split kernel or k is not a multiple of 32. */
int baton_split_bf16_pack(const float *w, int64_t n, int64_t k, uint16_t *out, int64_t parts)
{
#ifdef HAVE_SPLIT
    if (k % KC) return -1;
    const int64_t groups = (n + TR - 1) / TR, nc = k / KC;
    /* lane r of a tile row gathers row r's pair: 16 dwords apart in the [row][pair] buffer */
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(TR));
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t gc = 0; gc < groups * nc; gc++) {
        const int64_t g = gc / nc, c = gc % nc;
        uint32_t hs[TR][TR], ls[TR][TR]; /* [row][pair] */
        for (int r = 0; r < TR; r++) {
            __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
            if (g * TR + r < n) split32(w + (g * TR + r) * k + c * KC, &h, &l);
            _mm512_storeu_si512(hs[r], h);
            _mm512_storeu_si512(ls[r], l);
        }
        uint32_t *dst = (uint32_t *)(out + gc * 2 * 512);
        for (int p = 0; p < TR; p++) { /* tile row p: pair p of the 16 rows */
            _mm512_storeu_si512(dst + p * TR, _mm512_i32gather_epi32(rows, &hs[0][p], 4));
            _mm512_storeu_si512(dst + 256 + p * TR, _mm512_i32gather_epi32(rows, &ls[0][p], 4));
        }
    }
    return 0;
#else
    (void)w, (void)n, (void)k, (void)out, (void)parts;
    return -1;
#endif
}

#ifdef HAVE_SPLIT
/* C tile t into y rows (ldy apart), mvalid x nvalid of it. */
static inline void store_tile(int t, float *y, int64_t ldy, int mvalid, int nvalid,
                              const float *bias)
{
    float buf[TR * TR] __attribute__((aligned(64)));
    switch (t) {
    case 0: _tile_stored(0, buf, 64); break;
    case 1: _tile_stored(1, buf, 64); break;
    case 2: _tile_stored(2, buf, 64); break;
    default: _tile_stored(3, buf, 64); break;
    }
    const __mmask16 keep = (__mmask16)((1u << nvalid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mvalid; r++)
        _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_add_ps(_mm512_load_ps(buf + r * TR), bv));
}

/* Two x tiles (rows from xh / xl, k apart) against groups g0 and g0 + 1 (their split tiles w0,
 * w1; w1 = w0 where there is one, its sums never stored), into C tmm0-3: tmm0 / tmm1 the first
 * x tile against g0 / g1, tmm2 / tmm3 the second's. A chunk: xh . wh, xh . wl, xl . wh. */
static inline void tile_sums(const uint16_t *xh, const uint16_t *xl, int64_t k, const uint16_t *w0,
                             const uint16_t *w1)
{
    const int64_t nc = k / KC, ld = k * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < nc; c++) {
        const uint16_t *a = xh + c * KC, *al = xl + c * KC;
        const uint16_t *b0 = w0 + c * 1024, *b1 = w1 + c * 1024;
        _tile_loadd(4, a, ld);
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b1, 64);
        _tile_loadd(5, a + TR * k, ld);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(6, b0 + 512, 64); /* wl */
        _tile_loadd(7, b1 + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, al, ld); /* xl . wh */
        _tile_loadd(6, b0, 64);
        _tile_loadd(5, al + TR * k, ld);
        _tile_loadd(7, b1, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}
#endif

/* y [m, n] (contiguous) = x [m, k] (rows ldx floats apart) . W^T + bias (or NULL), W in its split
 * tiles (baton_split_bf16_pack). 0; -1 where this build has no split kernel or k is not a
 * multiple of 32; -2 if the split x cannot be allocated. */
int baton_split_bf16_linear(const float *x, int64_t m, int64_t ldx, int64_t k, const uint16_t *ws,
                            int64_t n, const float *bias, float *y, int64_t parts)
{
#ifdef HAVE_SPLIT
    if (k % KC || !amx_permitted()) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t mp = (m + 2 * TR - 1) / (2 * TR) * (2 * TR); /* x tiles go in pairs */
    const int64_t groups = (n + TR - 1) / TR, pairs = (groups + 1) / 2;
    const int64_t group_elems = k / KC * 1024; /* a group's split tiles, bf16s */
    uint16_t *xs = aligned_alloc(64, (size_t)(2 * mp * k * 2));
    if (xs == NULL) return -2;
    uint16_t *xh = xs, *xl = xs + mp * k;
#pragma omp parallel num_threads(parts) if (parts > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < mp; r += TR) split_rows(x, m, ldx, k, r, r + TR, xh, xl);
        configure();
        const int nt = parts > 1 ? omp_get_num_threads() : 1;
        const int me = parts > 1 ? omp_get_thread_num() : 0;
        const int64_t p0 = pairs * me / nt, p1 = pairs * (me + 1) / nt;
        for (int64_t x0 = 0; x0 < mp; x0 += XCHUNK) {
            const int64_t x1 = mp - x0 < XCHUNK ? mp : x0 + XCHUNK;
            for (int64_t p = p0; p < p1; p++) {
                const int64_t g0 = 2 * p, n0 = g0 * TR;
                const int two = g0 + 1 < groups;
                const uint16_t *w0 = ws + g0 * group_elems, *w1 = two ? w0 + group_elems : w0;
                const int nv0 = (int)(n - n0 < TR ? n - n0 : TR);
                const int nv1 = two ? (int)(n - n0 - TR < TR ? n - n0 - TR : TR) : 0;
                for (int64_t m0 = x0; m0 < x1 && m0 < m; m0 += 2 * TR) {
                    tile_sums(xh + m0 * k, xl + m0 * k, k, w0, w1);
                    for (int i = 0; i < 2; i++) {
                        const int64_t r0 = m0 + i * TR;
                        if (r0 >= m) break;
                        const int mv = (int)(m - r0 < TR ? m - r0 : TR);
                        store_tile(2 * i, y + r0 * n + n0, n, mv, nv0, bias ? bias + n0 : NULL);
                        if (two)
                            store_tile(2 * i + 1, y + r0 * n + n0 + TR, n, mv, nv1,
                                       bias ? bias + n0 + TR : NULL);
                    }
                }
            }
        }
        _tile_release();
    }
    free(xs);
    return 0;
#else
    (void)x, (void)m, (void)ldx, (void)k, (void)ws, (void)n, (void)bias, (void)y, (void)parts;
    return -1;
#endif
}

/* 1 where this build and process run the split kernel (AMX granted), else 0. */
int baton_split_bf16_available(void)
{
#ifdef HAVE_SPLIT
    return amx_permitted();
#else
    return 0;
#endif
}
