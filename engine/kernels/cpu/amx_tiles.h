/* The tile configuration every AMX kernel here runs under (amx.c, prefill_amx.c). */
#ifndef LORAPLEX_CPU_AMX_TILES_H
#define LORAPLEX_CPU_AMX_TILES_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* All eight tiles 16 rows of 64 bytes; once per thread before its first tile instruction
 * (Linux must have granted the process the tile data state: amx.c amx_available). */
static inline void load_tile_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif
#endif
