/* fp32 / bf16 weights regrouped into tiles of 16 rows, and the linear over them, CPU:
 * y[M, N] = x[M, K] . W[N, K]^T (+ b), for a decode step's few rows.
 *
 * Why: at decode's row counts a linear reads its whole weight to do a few FLOPs a byte, so it
 * runs at the memory's pace or not at all. In this layout lane r of a vector is weight row r:
 * each k costs one vector load of sixteen rows' weights and one FMA per x row, with x[m, k] as
 * a broadcast, and no horizontal sums. Four tiles run at once against up to 3 x rows (more
 * independent FMA chains and memory streams); more rows meet two tiles in blocks of 12 (AVX2:
 * one tile, blocks of 6), the blocks after the first reading the tiles from L1 / L2. On AMX a
 * bf16 tile's 32 k are tdpbf16ps's B operand as they lie (amx_linear_bf16).
 *
 * Layouts (rows padded to a multiple of 16 with zeros; the tiles of rows g*16 .. g*16+15 are
 * the g-th 16 * K elements, so the tensor keeps N_padded * K elements):
 *   fp32: element (row g*16 + r, k) at g*16*K + k*16 + r
 *   bf16: element (row g*16 + r, k) at g*16*K + (k/2)*32 + r*2 + k%2 (K even): each 32-bit lane
 *         holds the row's pair (k, k+1), the operand layout of vdpbf16ps (and AMX's B tiles)
 *
 * Every output is summed the same way whatever call, batch or thread it came in: one FMA chain
 * along k (bf16: one vdpbf16ps chain along the pairs), bias added last, so a row's result does
 * not depend on the batch it is in. fp32 results equal F.linear's up to the sums' order; bf16's
 * products are exact in fp32 and summed in fp32 (vdpbf16ps, round to nearest even, denormals
 * flushed), then rounded once to bf16 after the bias, as oneDNN's bf16 linear does.
 *
 * Builds: fp32 on AVX-512F or AVX2+FMA, bf16 on AVX512_BF16 (and AMX where the CPU and the
 * kernel grant it); baton_dense_tiles_f32_isa() / _bf16_isa() say which (the wrapper keeps the
 * weight's other forms where this build has none).
 *
 * Threads: each call splits the groups of 16 rows into `parts` contiguous ranges on torch's
 * OpenMP team (libgomp resolves to the copy torch loaded, as in quant_linear.c). */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include "amx.h"
#endif

#define TR 16 /* weight rows per tile */
/* How far ahead (k steps, one 64-byte line each) a tile stream is asked for: the hardware
 * prefetcher alone left the kernel waiting on memory. */
#define PREFETCH 32

/* ---------------------------------------------------------------------------------------------
 * Layout: rows <-> tiles. Portable; elements are moved as 32-bit (fp32) or 16-bit (bf16) words.
 */

static int64_t f32_offset(int64_t r, int64_t j, int64_t k)
{
    return (r / TR) * TR * k + j * TR + r % TR;
}

static int64_t bf16_offset(int64_t r, int64_t j, int64_t k)
{
    return (r / TR) * TR * k + (j / 2) * 2 * TR + (r % TR) * 2 + j % 2;
}

/* dst (ceil(n / 16) * 16 * k elements) = the tiles of src [n, k]; pad rows zero. */
int baton_dense_tiles_pack(const void *src, int64_t bf16, int64_t n, int64_t k, void *dst)
{
    if (bf16 && k % 2) return -1;
    const int64_t padded = (n + TR - 1) / TR * TR;
    if (bf16) {
        const uint16_t *s = src;
        uint16_t *d = dst;
        memset(d, 0, (size_t)(padded * k) * sizeof *d);
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = 0; j < k; j++) d[bf16_offset(r, j, k)] = s[r * k + j];
    } else {
        const uint32_t *s = src;
        uint32_t *d = dst;
        memset(d, 0, (size_t)(padded * k) * sizeof *d);
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = 0; j < k; j++) d[f32_offset(r, j, k)] = s[r * k + j];
    }
    return 0;
}

/* dst [n, k] = rows ids[i] (ids NULL: rows 0 .. n-1) of the tiled src: an embedding's lookup. */
int baton_dense_tiles_rows(const void *src, int64_t bf16, int64_t k, const int64_t *ids,
                           int64_t n, void *dst)
{
    if (bf16 && k % 2) return -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids ? ids[i] : i;
        if (bf16) {
            const uint16_t *s = src;
            uint16_t *d = dst;
            for (int64_t j = 0; j < k; j++) d[i * k + j] = s[bf16_offset(r, j, k)];
        } else {
            const uint32_t *s = src;
            uint32_t *d = dst;
            for (int64_t j = 0; j < k; j++) d[i * k + j] = s[f32_offset(r, j, k)];
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The kernels. x [m, k] row-major; bf16's 32-bit word j of a row is the pair (2j, 2j + 1).
 */
#if defined(__AVX512F__)
#define F32_ISA "avx512"
#define VW 16
#define MAX_ROWS 16 /* the accumulator arrays' bound */
/* Few rows (up to 3) meet four tiles at once; more meet two tiles in blocks of 12 rows: 24
 * accumulators, and per k two weight loads and 12 broadcasts for 24 FMAs (one tile against 16
 * rows would load 17 times for 16 FMAs, bound by the load ports at half the FMA rate). */
#define FEW_ROWS 3
#define FEW_TILES 4
#define MANY_TILES 2
#define BLOCK_ROWS 12
/* k in chunks as on AVX2 (below), for the same reason: a 16-row step's second block of 12 finds
 * the chunk in L1 (docs/perf-log.md, "Dense tiles' k chunks on AVX-512"). */
#define K_CHUNK 64
#define CHUNK_ROWS 32
typedef __m512 vec;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(s) _mm512_set1_ps(s)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VZERO() _mm512_setzero_ps()
#elif defined(__AVX2__) && defined(__FMA__)
#define F32_ISA "avx2"
#define VW 8
#define MAX_ROWS 6
/* Up to 2 rows meet two tiles (8 accumulators); more meet one tile in blocks of 6 rows: 12
 * accumulators, 2 weight vectors and a broadcast of 16 registers. */
#define FEW_ROWS 2
#define FEW_TILES 2
#define MANY_TILES 1
#define BLOCK_ROWS 6
/* More rows than a block, up to CHUNK_ROWS: k in chunks of K_CHUNK steps (4 KiB of a tile), each
 * read from memory by the first block, which asks for it PREFETCH steps ahead, and found in L1
 * by the others, which ask for the next chunk meanwhile (docs/perf-log.md, "Decode on AVX2").
 * More rows crowd L1 with a chunk's x. */
#define K_CHUNK 64
#define CHUNK_ROWS 32
typedef __m256 vec;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(s) _mm256_set1_ps(s)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VZERO() _mm256_setzero_ps()
#endif

#ifdef VW
#define VT (TR / VW) /* vectors per tile row */

/* The first `cols` columns of a 16-column result (the last group's padding is not stored). */
static inline void store_cols(void *y, const void *out, int64_t cols, size_t elem)
{
    if (cols > 0) memcpy(y, out, (size_t)(cols < TR ? cols : TR) * elem);
}

/* MB x rows against the T tiles from column col0 (cols: the columns left from col0), over k
 * steps [j0, j1) of K. The sums start at zero (j0 == 0) or at part's (MB x T*16 floats, the
 * earlier steps' sums), and end in part (j1 < K) or, bias added, in y. Constant T and MB after
 * inlining: the accumulators live in registers. */
static inline __attribute__((always_inline)) void
f32_block(const int T, const int MB, const float *w, int64_t k, int64_t j0, int64_t j1,
          const float *x, float *part, float *y, int64_t ldy, const float *bias, int64_t col0,
          int64_t cols, int64_t ahead)
{
    vec acc[4][VT][MAX_ROWS];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 2
        for (int v = 0; v < VT; v++)
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++)
                acc[t][v][m] = j0 == 0 ? VZERO() : VLOAD(part + (m * T + t) * TR + v * VW);
    const int64_t tile = TR * k;
    for (int64_t j = j0; j < j1; j++) {
        vec wv[4][VT];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
#pragma GCC unroll 2
            for (int v = 0; v < VT; v++) wv[t][v] = VLOAD(w + t * tile + j * TR + v * VW);
            _mm_prefetch((const char *)(w + t * tile + (j + ahead) * TR), _MM_HINT_T0);
        }
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++) {
            const vec xb = VSET1(x[m * k + j]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                for (int v = 0; v < VT; v++) acc[t][v][m] = VFMA(wv[t][v], xb, acc[t][v][m]);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            if (j1 < k) {
#pragma GCC unroll 2
                for (int v = 0; v < VT; v++)
                    VSTORE(part + (m * T + t) * TR + v * VW, acc[t][v][m]);
                continue;
            }
            float out[TR];
#pragma GCC unroll 2
            for (int v = 0; v < VT; v++) {
                vec a = acc[t][v][m];
                if (bias) a = VADD(a, VLOAD(bias + col0 + t * TR + v * VW));
                VSTORE(out + v * VW, a);
            }
            store_cols(y + m * ldy + col0 + t * TR, out, cols - t * TR, sizeof(float));
        }
}
#endif

#if defined(__AVX512BF16__)
#define BF16_ISA "avx512-bf16"

/* bf16 -> fp32 of 16 values. */
static inline __m512 bf16_to_f32(const uint16_t *b)
{
    const __m256i h = _mm256_loadu_si256((const __m256i *)b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* As f32_block, a tile holding two k per lane. The bias (bf16, padded by the caller's copy) is
 * added in fp32 before the one rounding to bf16. */
static inline __attribute__((always_inline)) void
bf16_block(const int T, const int MB, const uint16_t *w, int64_t k, const uint32_t *x,
           uint16_t *y, int64_t ldy, const uint16_t *bias, int64_t col0, int64_t cols)
{
    __m512 acc[4][MAX_ROWS];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++) acc[t][m] = _mm512_setzero_ps();
    const int64_t tile = TR * k;
    for (int64_t j = 0; j < k / 2; j++) {
        __m512bh wv[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            wv[t] = (__m512bh)_mm512_loadu_si512((const void *)(w + t * tile + j * 2 * TR));
            _mm_prefetch((const char *)(w + t * tile + (j + PREFETCH) * 2 * TR), _MM_HINT_T0);
        }
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[m * (k / 2) + j]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) acc[t][m] = _mm512_dpbf16_ps(acc[t][m], wv[t], xb);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            __m512 a = acc[t][m];
            if (bias) a = _mm512_add_ps(a, bf16_to_f32(bias + col0 + t * TR));
            uint16_t out[TR];
            _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(a));
            store_cols(y + m * ldy + col0 + t * TR, out, cols - t * TR, sizeof(uint16_t));
        }
}
#endif



/* ---------------------------------------------------------------------------------------------
 * The driver: each part's groups, in runs of T tiles, against the x rows in blocks.
 *
 * Few x rows take T tiles at once (more FMA chains, more memory streams); more take one tile
 * against blocks of MAX_ROWS, the blocks after the first reading the tile from cache.
 */

/* One call's switch over (T, rows), each case inlining its own block. `KERNEL(T, MB)` names the
 * block call with everything but T and MB bound. */
#define CASE(K_, T_, MB_) case MB_: K_(T_, MB_); break;
#define ROWS_1_6(K_, T_) CASE(K_, T_, 1) CASE(K_, T_, 2) CASE(K_, T_, 3) CASE(K_, T_, 4)        \
    CASE(K_, T_, 5) CASE(K_, T_, 6)
#if BLOCK_ROWS == 12
#define ROWS_BLOCK(K_, T_) ROWS_1_6(K_, T_) CASE(K_, T_, 7) CASE(K_, T_, 8) CASE(K_, T_, 9)       \
    CASE(K_, T_, 10) CASE(K_, T_, 11) CASE(K_, T_, 12)
#else
#define ROWS_BLOCK(K_, T_) ROWS_1_6(K_, T_)
#endif
#define DISPATCH(K_, t, rows)                                                                  \
    do {                                                                                       \
        if (t == 4) { switch (rows) { CASE(K_, 4, 1) CASE(K_, 4, 2) CASE(K_, 4, 3) default: break; } } \
        else if (t == 2) { switch (rows) { ROWS_BLOCK(K_, 2) default: break; } }               \
        else { switch (rows) { ROWS_BLOCK(K_, 1) default: break; } }                           \
    } while (0)

/* Rows of partial sums a part's stack holds: a chunked call's, and never fewer than a block's
 * (the compiler's bounds check sees a block's reads even where k is one chunk). */
#define SCRATCH_ROWS (CHUNK_ROWS > MAX_ROWS ? CHUNK_ROWS : MAX_ROWS)

/* The loops of a call: the parts' group ranges on the OpenMP team, runs of t tiles, steps of k
 * in chunks of `chunk`, blocks of x rows; BLOCK(t, rows, g, m0, j0, j1, part) runs one, part
 * the block's partial sums in the part's scratch on its stack (m x 4 x 16 floats; NULL where
 * one chunk covers k). A chunk of a run is read from memory once, by the first block; the
 * others find it in L1. */
#define DRIVE(groups, m, k, T, block, chunk, parts, BLOCK)                                     \
    _Pragma("omp parallel for num_threads(parts) schedule(static) if (parts > 1)")            \
    for (int64_t p = 0; p < parts; p++) {                                                      \
        const int64_t g1 = groups * (p + 1) / parts;                                           \
        float scratch[SCRATCH_ROWS * 4 * TR]; /* a chunked call's rows: CHUNK_ROWS at most */ \
        const int64_t step = chunk < k && m <= CHUNK_ROWS ? chunk : k;                         \
        const int64_t nblocks = (m + block - 1) / block; /* of rows as even as they split */   \
        for (int64_t g = groups * p / parts; g < g1;) {                                        \
            int t = T;                                                                         \
            while (t > g1 - g) t /= 2;                                                         \
            for (int64_t j0 = 0; j0 < k; j0 += step) {                                         \
                const int64_t j1 = k - j0 < step ? k : j0 + step;                              \
                for (int64_t i = 0, m0 = 0; i < nblocks; i++) {                                \
                    const int64_t rows = m * (i + 1) / nblocks - m0;                           \
                    float *part = step < k ? scratch + m0 * 4 * TR : NULL;                     \
                    BLOCK(t, rows, g, m0, j0, j1, part);                                       \
                    m0 += rows;                                                                \
                }                                                                              \
            }                                                                                  \
            g += t;                                                                            \
        }                                                                                      \
    }

/* y [m, n] = x [m, k] . W^T (+ bias) over the tiled fp32 w (x's rows contiguous; bias padded
 * to a multiple of 16: the wrapper's copy). -1 where this build has no fp32 kernel. */
int baton_dense_tiles_linear_f32(const float *x, int64_t m, int64_t n, int64_t k, const float *w,
                                 const float *bias, float *y, int64_t parts)
{
#ifdef VW
    const int64_t groups = (n + TR - 1) / TR;
    const int T = m <= FEW_ROWS ? FEW_TILES : MANY_TILES;
    const int64_t block = m <= FEW_ROWS ? m : BLOCK_ROWS;
    const int64_t chunk = K_CHUNK && m > block && m <= CHUNK_ROWS ? K_CHUNK : k;
#define F32_RUN(T_, MB_)                                                                       \
    f32_block(T_, MB_, w + g * TR * k, k, j0, j1, x + m0 * k, part, y + m0 * n, n, bias,       \
              g * TR, n - g * TR, m0 == 0 || chunk == k ? PREFETCH : chunk)
#define F32_BLOCK(t, rows, g, m0, j0, j1, part) DISPATCH(F32_RUN, t, rows)
    DRIVE(groups, m, k, T, block, chunk, parts, F32_BLOCK)
    return 0;
#else
    (void)x; (void)m; (void)n; (void)k; (void)w; (void)bias; (void)y; (void)parts;
    return -1;
#endif
}

#if defined(HAVE_AMX)
/* baton_dense_tiles_linear_bf16 on AMX (k a multiple of 32): runs of up to four tiles, each
 * against the x rows in blocks of 16, so a run is read from memory once and its later blocks
 * find it in L2 (a prompt's recompute has hundreds of rows). */
static void amx_linear_bf16(const uint16_t *x, int64_t m, int64_t n, int64_t k,
                            const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t parts)
{
    const int64_t groups = (n + TR - 1) / TR;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t p = 0; p < parts; p++) {
        const int64_t g1 = groups * (p + 1) / parts;
        float acc[4 * TR * TR];
        int64_t configured = 0;
        for (int64_t g = groups * p / parts; g < g1; g += 4) {
            const int t = g1 - g < 4 ? (int)(g1 - g) : 4;
            const uint16_t *wg = w + g * TR * k;
            for (int64_t m0 = 0; m0 < m; m0 += TR) {
                const int64_t rows = m - m0 < TR ? m - m0 : TR;
                if (rows != configured) amx_bf16_configure(configured = rows);
                const uint16_t *xm = x + m0 * k;
                switch (t) {
                case 4: amx_bf16_sums(4, wg, k, xm, acc, NULL, NULL); break;
                case 3: amx_bf16_sums(3, wg, k, xm, acc, NULL, NULL); break;
                case 2: amx_bf16_sums(2, wg, k, xm, acc, NULL, NULL); break;
                default: amx_bf16_sums(1, wg, k, xm, acc, NULL, NULL); break;
                }
                for (int tt = 0; tt < t; tt++) {
                    const int64_t col0 = (g + tt) * TR;
                    for (int64_t i = 0; i < rows; i++) {
                        __m512 a = _mm512_loadu_ps(acc + tt * TR * TR + i * TR);
                        if (bias) a = _mm512_add_ps(a, bf16_to_f32(bias + col0));
                        uint16_t out[TR];
                        _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(a));
                        store_cols(y + (m0 + i) * n + col0, out, n - col0, sizeof(uint16_t));
                    }
                }
            }
        }
        if (configured) _tile_release();
    }
}
#endif

/* As baton_dense_tiles_linear_f32 over a tiled bf16 w (k even): x, bias and y bf16. On AMX (k
 * a multiple of 32) the tiles go through the tile registers. */
int baton_dense_tiles_linear_bf16(const uint16_t *x, int64_t m, int64_t n, int64_t k,
                                  const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                  int64_t parts)
{
#if defined(__AVX512BF16__)
    if (k % 2) return -1;
#if defined(HAVE_AMX)
    if (k % 32 == 0 && amx_permitted()) {
        amx_linear_bf16(x, m, n, k, w, bias, y, parts);
        return 0;
    }
#endif
    const int64_t groups = (n + TR - 1) / TR;
    /* AVX-512's rule: a bf16 tile is one vector a k pair, as an fp32 tile one a k */
    const int T = m <= FEW_ROWS ? FEW_TILES : MANY_TILES;
    const int64_t block = m <= FEW_ROWS ? m : BLOCK_ROWS;
#define BF16_RUN(T_, MB_)                                                                      \
    bf16_block(T_, MB_, w + g * TR * k, k, (const uint32_t *)(x + m0 * k), y + m0 * n, n, bias, \
               g * TR, n - g * TR)
#define BF16_BLOCK(t, rows, g, m0, j0, j1, part)                                              \
    do {                                                                                       \
        (void)j1, (void)part;                                                                  \
        DISPATCH(BF16_RUN, t, rows);                                                           \
    } while (0)
    DRIVE(groups, m, k, T, block, k, parts, BF16_BLOCK) /* one chunk: the whole k */
    return 0;
#else
    (void)x; (void)m; (void)n; (void)k; (void)w; (void)bias; (void)y; (void)parts;
    return -1;
#endif
}

/* Which kernels this build has: "avx512" / "avx2" / "" (fp32), "avx512-bf16" / "" (bf16). */
const char *baton_dense_tiles_f32_isa(void)
{
#ifdef VW
    return F32_ISA;
#else
    return "";
#endif
}

const char *baton_dense_tiles_bf16_isa(void)
{
#if defined(HAVE_AMX)
    return amx_permitted() ? "amx-bf16" : BF16_ISA;
#elif defined(__AVX512BF16__)
    return BF16_ISA;
#else
    return "";
#endif
}
