/* AMX's tile registers on Linux: the process's permission and the tile configuration's layout,
 * shared by the kernels that use the tiles (dense_tiles.c, quant_tiles_amx.h,
 * quant_tiles_bf16.h, split_bf16.c), and the bf16 tile sums of the first two bf16 ones.
 * Include with _GNU_SOURCE defined (syscall()), where the build has AMX (__AMX_TILE__). */
#ifndef BATON_AMX_H
#define BATON_AMX_H
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use AMX's tile registers (Linux asks each process to request them;
 * each library asks once, the answer is the process's). */
static int amx_permitted(void)
{
    static int permitted = -1;
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* ldtilecfg's operand (palette 1): each tile's bytes a row and rows; unused tiles zero. */
struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

#if defined(__AMX_BF16__)
#include <immintrin.h>
/* bf16 weights in tiles of 16 rows as tdpbf16ps's B operand (dense_tiles.c's bf16 layout: the
 * pairs of k = 32c .. 32c+31 of the 16 rows are 16 rows of 64 bytes, pair p's row holding the
 * 16 weight rows' (k, k+1), contiguous: one tileloadd), against MB x rows of bf16 read in place
 * as the A operand (stride: x's row). */

/* This thread's tiles for MB x rows: C tmm0-3 (MB x 16 fp32), A tmm4 (MB x 32 bf16), B tmm5. */
static inline void amx_bf16_configure(int64_t mb)
{
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 6; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t == 5 ? 16 : (uint8_t)mb;
    }
    _tile_loadconfig(&cfg);
}

/* The sums of MB x rows (k bf16 each, contiguous) against T (1-4) consecutive tiles of 16 rows
 * from w, into acc [T][MB][16] (fp32): each its own accumulator tile. T is a constant where the
 * loop is small, a run-time value where a large `between` would otherwise be copied per T.
 * `between` (or NULL) is called with `ctx` and c after the products of each chunk c of 32 k:
 * work for the vector units while the tile unit sums (quant_tiles_bf16.h makes the next B tiles
 * there). */
#define AMX_BF16_STEP(T_, t_)                                                                  \
    if (T_ > t_) {                                                                             \
        _tile_loadd(5, w + t_ * 16 * k + c * 32 * 16, 64);                                     \
        _tile_dpbf16ps(t_, 4, 5);                                                              \
    }
#define AMX_BF16_STORE(T_, t_)                                                                 \
    if (T_ > t_) _tile_stored(t_, acc + t_ * 16 * 16, 64);
static inline __attribute__((always_inline)) void
amx_bf16_sums(const int T, const uint16_t *w, int64_t k, const uint16_t *x, float *acc,
              void (*between)(void *, int64_t), void *ctx)
{
    if (T > 0) _tile_zero(0);
    if (T > 1) _tile_zero(1);
    if (T > 2) _tile_zero(2);
    if (T > 3) _tile_zero(3);
    for (int64_t c = 0; c < k / 32; c++) {
        _tile_loadd(4, x + c * 32, k * 2);
        AMX_BF16_STEP(T, 0) AMX_BF16_STEP(T, 1) AMX_BF16_STEP(T, 2) AMX_BF16_STEP(T, 3)
        if (between) between(ctx, c);
    }
    AMX_BF16_STORE(T, 0) AMX_BF16_STORE(T, 1) AMX_BF16_STORE(T, 2) AMX_BF16_STORE(T, 3)
}
#endif
#endif
