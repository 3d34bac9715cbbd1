#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
int permit(void) { unsigned long m = 0; if (syscall(SYS_arch_prctl, 0x1023, 18)) return 0; syscall(SYS_arch_prctl, 0x1022, &m); return (m >> 18) & 1; }
/* MODE 0: sequential vector loads only. 1: + a tdp per KB on L1 tiles (no dependency). 2: loads stored to a
   staging ring of 16 KB, tileloadd from the ring 1 KB behind, tdp. */
AMX float amx1(const uint16_t *W, const uint16_t *x, float *Y, long O, long I) {
    const long bytes = 2 * O * I;
    const char *p = (const char *)W;
    tile_config cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
    cfg.colsb[0] = 4, cfg.rows[0] = 16; cfg.colsb[4] = 64, cfg.rows[4] = 16; cfg.colsb[6] = 4, cfg.rows[6] = 16;
    _tile_loadconfig(&cfg);
    static char ring[16384] __attribute__((aligned(64)));
    __m512i acc = _mm512_setzero_si512();
    _tile_zero(0);
    _tile_loadd(6, x, 4);
    _tile_loadd(4, ring, 64);
    for (long b = 0; b < bytes; b += 1024) {
        for (long j = 0; j < 1024; j += 64) {
            _mm_prefetch(p + b + j + 512, _MM_HINT_T0);
            _mm_prefetch(p + b + j + 4096, _MM_HINT_T1);
            __m512i v = _mm512_load_si512((const void *)(p + b + j));
#if MODE == 2
            _mm512_store_si512((void *)(ring + ((b + j) & 16383)), v);
#else
            acc = _mm512_xor_si512(acc, v);
#endif
        }
#if MODE >= 1
#if MODE == 2
        if (b >= 4096) _tile_loadd(4, ring + ((b - 4096) & 16383), 64);
#endif
        _tile_dpbf16ps(0, 4, 6);
#endif
    }
    float Ct[16] __attribute__((aligned(64)));
    _tile_stored(0, Ct, 4);
    _tile_release();
    memcpy(Y, Ct, 64);
    return (float)_mm512_reduce_add_epi32(acc);
}
