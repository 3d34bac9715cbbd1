#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
int permit(void) { unsigned long m = 0; if (syscall(SYS_arch_prctl, 0x1023, 18)) return 0; syscall(SYS_arch_prctl, 0x1022, &m); return (m >> 18) & 1; }
/* W tiled as stream_tiled.c; each KB read by vector loads in address order into a ring of RING KB, tile-loaded LAG KB behind. */
AMX void amx1(const uint16_t *W, const uint16_t *x, float *Y, long O, long I) {
    const long C = I / 32, G = O / 16, T = G * C;
    tile_config cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
    cfg.colsb[0] = 4, cfg.rows[0] = 16; cfg.colsb[4] = 64, cfg.rows[4] = 16; cfg.colsb[6] = 4, cfg.rows[6] = 16;
    _tile_loadconfig(&cfg);
    static char ring[RING * 1024] __attribute__((aligned(64)));
    float Ct[16] __attribute__((aligned(64)));
    const char *p = (const char *)W;
    for (long t = 0; t < T + LAG; t++) {
        if (t < T) {
            const char *a = p + t * 1024; char *r = ring + (t % RING) * 1024;
            for (int j = 0; j < 1024; j += 64) {
                _mm_prefetch(a + j + PF0, _MM_HINT_T0);
#if PF1
                _mm_prefetch(a + j + PF1, _MM_HINT_T1);
#endif
                _mm512_store_si512((void *)(r + j), _mm512_load_si512((const void *)(a + j)));
            }
        }
        long s = t - LAG;
        if (s >= 0) {
            long g = s / C, c = s % C;
            if (c == 0) _tile_zero(0);
            _tile_loadd(6, x + 32 * c, 4);
            _tile_loadd(4, ring + (s % RING) * 1024, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (c == C - 1) { _tile_stored(0, Ct, 4); memcpy(Y + 16 * g, Ct, 64); }
        }
    }
    _tile_release();
}
