/* The wide (two-byte x) tiled linear of quant_tiles.c on AMX's int8 tiles: the same integers and
 * the same float steps, so the same result bit for bit, ~1.5x the pace of vpdpbusd at a
 * prompt's rows on a Sapphire Rapids (docs/perf-log.md, "Packed prefill on AMX"): the float work
 * per block, not the tiles, sets it.
 *
 * Included by quant_tiles.c inside its AVX-512 VNNI build, after amx.h (xblock2, quant_row_wide,
 * scale_bytes and the tile layout are quant_tiles.c's). Why it matches: a (row, block) integer
 * dot is exact in int32 whichever unit sums it, and the float work after it is group_rows' per
 * lane, in its order.
 *
 * The tiles (AMX's names: C += A . B, A signed bytes, B unsigned, tdpbsud):
 *   A: 16 x rows' high (or low) bytes of one block of 32: 16 rows of 32 bytes, read in place
 *      from a planar copy of the quantized x (the high bytes of all rows, then the low bytes).
 *   B: the 16 weight rows' block as 8 rows of 64 bytes, row c holding k = 4c .. 4c+3 of the 16
 *      rows, 4 bytes each: a Q8_0 tile's eight chunks as they lie; a Q4 tile's four chunks
 *      split into low nibbles (rows 0-3) and high ones (rows 4-7), once a group into a buffer
 *      the group's x rows all read.
 *   C: 16 x 16 int32, the high bytes' dots and the low bytes', per block; stored to L1 and
 *      combined there as group_rows combines them, 256 hi + lo. Blocks alternate between two
 *      pairs of C tiles, so a block's tile work does not wait on the last block's store.
 * A block's scale is per (weight row, x row, block), so the tiles cannot sum over more than one
 * block: 32 of the 64 bytes a tdpbsud could take, and float work per block. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <omp.h>
#define HAVE_AMX_INT8 1
#define AMX_MIN_ROWS 16 /* fewer x rows take vpdpbusd: a tile is 16 rows whatever it holds */
/* tmm0-3: C (16 x 16 int32); tmm4, tmm5: A, high and low bytes (16 x 32 bytes); tmm6: B (8 x 64) */
static void amx_wide_configure(void)
{
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) cfg.colsb[t] = 64, cfg.rows[t] = TR;
    cfg.colsb[4] = cfg.colsb[5] = QK, cfg.rows[4] = cfg.rows[5] = TR;
    cfg.colsb[6] = 64, cfg.rows[6] = QK / 4;
    _tile_loadconfig(&cfg);
}

/* The planar x of a wide call: rows padded to a multiple of 16 (zero bytes and scales). */
typedef struct {
    int8_t *hi, *lo; /* [mp][k] */
    float *dx;       /* [mp][nb] */
    int32_t *aux;    /* [mp][nb]: xblock's aux, as bits */
} amx_x;

/* One group's 16 weight rows (tiles from g, nb of them) times the 16 x rows from m0 of px, into
 * y rows m0 .. m0+mvalid, columns nvalid (ldy apart), + bias. B: the group's B tiles, 512 bytes
 * a block (b_stride apart). */
#define AMX_BLOCK(b_, c0_, c1_, buf_)                                                          \
    do {                                                                                       \
        _tile_zero(c0_);                                                                       \
        _tile_zero(c1_);                                                                       \
        _tile_loadd(4, px->hi + m0 * k + (b_) * QK, k);                                        \
        _tile_loadd(5, px->lo + m0 * k + (b_) * QK, k);                                        \
        _tile_loadd(6, B + (b_) * b_stride, 64);                                               \
        _tile_dpbsud(c0_, 4, 6);                                                               \
        _tile_dpbsud(c1_, 5, 6);                                                               \
        _tile_stored(c0_, (buf_), 64);                                                         \
        _tile_stored(c1_, (buf_) + TR * TR, 64);                                               \
    } while (0)

INLINE void amx_group_rows(const int64_t qtype, const uint8_t *g, const uint8_t *B,
                           int64_t b_stride, int64_t nb, int64_t k, const amx_x *px, int64_t m0,
                           int mvalid, int nvalid, float *y, int64_t ldy, const float *bias)
{
    const int64_t tile = TR * block_bytes(qtype);
    int32_t buf[2][2 * TR * TR] __attribute__((aligned(64)));
    __m512 acc[TR];
    for (int r = 0; r < TR; r++) acc[r] = _mm512_setzero_ps();
    AMX_BLOCK(0, 0, 1, buf[0]);
    for (int64_t b = 0; b < nb; b++) {
        if (b + 1 < nb) {
            if (b & 1) AMX_BLOCK(b + 1, 0, 1, buf[0]);
            else AMX_BLOCK(b + 1, 2, 3, buf[1]);
        }
        const int32_t *hi = buf[b & 1], *lo = hi + TR * TR;
        const uint8_t *t = g + b * tile;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
        const __m512 mv = qtype == QT_Q4_1
                              ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 2 * TR)))
                              : _mm512_setzero_ps();
        for (int r = 0; r < TR; r++) {
            const int64_t xi = (m0 + r) * nb + b;
            __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi + r * TR), 8),
                                           _mm512_load_si512(lo + r * TR));
            if (qtype != QT_Q4_1) dot = _mm512_add_epi32(dot, _mm512_set1_epi32(px->aux[xi]));
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(px->dx[xi]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
            if (qtype == QT_Q4_1) {
                float f;
                memcpy(&f, px->aux + xi, sizeof f);
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(f), acc[r]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << nvalid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mvalid; r++)
        _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_add_ps(acc[r], bv));
}

/* A Q4 group's B tiles (nb blocks, 512 bytes each) from its tiles' chunks. */
static void amx_unpack_q4(const uint8_t *g, int64_t qtype, int64_t nb, uint8_t *B)
{
    const int64_t tile = TR * block_bytes(qtype), sb = scale_bytes(qtype);
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(g + b * tile + sb + 64 * c);
            _mm512_store_si512(B + b * 512 + 64 * c, _mm512_and_si512(v, low));
            _mm512_store_si512(B + b * 512 + 64 * (c + 4),
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
}

#define AMX_GROUP_FN(NAME, QT)                                                                 \
    static void NAME(const uint8_t *g, const uint8_t *B, int64_t b_stride, int64_t nb,         \
                     int64_t k, const amx_x *px, int64_t m0, int mvalid, int nvalid, float *y,  \
                     int64_t ldy, const float *bias)                                           \
    {                                                                                          \
        amx_group_rows(QT, g, B, b_stride, nb, k, px, m0, mvalid, nvalid, y, ldy, bias);       \
    }
AMX_GROUP_FN(amx_group_q4_0, QT_Q4_0)
AMX_GROUP_FN(amx_group_q4_1, QT_Q4_1)
AMX_GROUP_FN(amx_group_q8_0, QT_Q8_0)

/* tiles_linear's wide call on AMX: 0, or -2 if the planar x cannot be allocated. */
static int amx_tiles_linear_wide(const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                                 const float *x, int64_t m, int64_t ldx, const float *bias,
                                 float *y, int64_t parts)
{
    const int64_t nb = k / QK, mp = (m + TR - 1) / TR * TR;
    const int64_t groups = (n + TR - 1) / TR, group_bytes = TR * nb * block_bytes(qtype);
    amx_x px;
    /* each thread's Q4 B tiles (512 bytes a block), then the planar x */
    const int64_t b_bytes = nb * 512;
    const int64_t bytes = parts * b_bytes + 2 * mp * k + 8 * mp * nb;
    char *mem = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
    if (mem == NULL) return -2;
    px.hi = (int8_t *)(mem + parts * b_bytes), px.lo = px.hi + mp * k;
    px.dx = (float *)(px.lo + mp * k), px.aux = (int32_t *)(px.dx + mp * nb);
    const int q8 = qtype == QT_Q8_0;
    void (*fn)(const uint8_t *, const uint8_t *, int64_t, int64_t, int64_t, const amx_x *,
               int64_t, int, int, float *, int64_t, const float *) =
        qtype == QT_Q4_0 ? amx_group_q4_0 : qtype == QT_Q4_1 ? amx_group_q4_1 : amx_group_q8_0;
#pragma omp parallel num_threads(parts) if (parts > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < mp; r++) {
            xblock2 xb[nb];
            if (r < m)
                quant_row_wide(x + r * ldx, nb, qtype, xb);
            else
                memset(xb, 0, sizeof xb);
            for (int64_t b = 0; b < nb; b++) {
                memcpy(px.hi + r * k + b * QK, xb[b].x.q, QK);
                memcpy(px.lo + r * k + b * QK, xb[b].lo, QK);
                px.dx[r * nb + b] = xb[b].x.dx;
                memcpy(px.aux + r * nb + b, &xb[b].x.aux, sizeof(int32_t));
            }
        }
        uint8_t *B = (uint8_t *)mem + omp_get_thread_num() * b_bytes;
        amx_wide_configure();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wg = w + g * group_bytes;
            const int64_t n0 = g * TR;
            const int nvalid = (int)(n - n0 < TR ? n - n0 : TR);
            if (!q8) amx_unpack_q4(wg, qtype, nb, B);
            /* Q8_0's chunks are B tiles as they lie: a block's eight, 64 bytes apart */
            const uint8_t *Bg = q8 ? wg + scale_bytes(qtype) : B;
            const int64_t b_stride = q8 ? TR * block_bytes(qtype) : 512;
            for (int64_t m0 = 0; m0 < m; m0 += TR)
                fn(wg, Bg, b_stride, nb, k, &px, m0, (int)(m - m0 < TR ? m - m0 : TR), nvalid,
                   y + m0 * n + n0, n, bias ? bias + n0 : NULL);
        }
        _tile_release();
    }
    free(mem);
    return 0;
}
#endif
