/* AMX's tile registers on Linux: the process's permission and the tile configuration's layout,
 * shared by the kernels that use the tiles (dense_tiles.c, quant_tiles_amx.h, split_bf16.c).
 * Include with _GNU_SOURCE defined (syscall()), where the build has AMX (__AMX_TILE__). */
#ifndef BATON_AMX_H
#define BATON_AMX_H
#include <stdint.h>
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
#endif
