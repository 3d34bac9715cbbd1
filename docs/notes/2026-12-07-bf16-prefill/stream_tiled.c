#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
int permit(void) { unsigned long m = 0; if (syscall(SYS_arch_prctl, 0x1023, 18)) return 0; syscall(SYS_arch_prctl, 0x1022, &m); return (m >> 18) & 1; }
/* W tiled: group g of 16 rows, chunk c of 32 columns -> 1 KB at (g*C + c)*1024, row r at +64r.
   One row x: y[16g + r] = sum_c tdp. PF: 0 none, 1 T0 per line 1 KB ahead, 2 T0 2 KB + T1 8 KB ahead,
   3 T0 4KB ahead. */
AMX void amx1(const uint16_t *W, const uint16_t *x, float *Y, long O, long I) {
    const long C = I / 32, G = O / 16;
    tile_config cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
    cfg.colsb[0] = 4, cfg.rows[0] = 16; cfg.colsb[4] = 64, cfg.rows[4] = 16; cfg.colsb[6] = 4, cfg.rows[6] = 16;
    _tile_loadconfig(&cfg);
    float Ct[16] __attribute__((aligned(64)));
    const char *p = (const char *)W;
    for (long g = 0; g < G; g++) {
        _tile_zero(0);
        for (long c = 0; c < C; c++) {
            const char *a = p + (g * C + c) * 1024;
#if PF == 1
            for (int j = 0; j < 1024; j += 64) _mm_prefetch(a + 1024 + j, _MM_HINT_T0);
#elif PF == 2
            for (int j = 0; j < 1024; j += 64) { _mm_prefetch(a + 2048 + j, _MM_HINT_T0); _mm_prefetch(a + 8192 + j, _MM_HINT_T1); }
#elif PF == 3
            for (int j = 0; j < 1024; j += 64) _mm_prefetch(a + 4096 + j, _MM_HINT_T0);
#endif
            _tile_loadd(6, x + 32 * c, 4);
            _tile_loadd(4, a, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, Ct, 4);
        memcpy(Y + 16 * g, Ct, 64);
    }
    _tile_release();
}
