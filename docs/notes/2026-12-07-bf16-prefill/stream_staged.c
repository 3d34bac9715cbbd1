#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
int permit(void) { unsigned long m = 0; if (syscall(SYS_arch_prctl, 0x1023, 18)) return 0; syscall(SYS_arch_prctl, 0x1022, &m); return (m >> 18) & 1; }
/* Real product, M = 1, I % 32 == 0, O % 16 == 0. Each 16-row group is copied (sequential loads) into a
   staging slot while the group before is multiplied. TILED 0: the slot keeps W's layout (A with stride 2I);
   1: the slot is in tile order, line (r, c) at (c * 16 + r) * 64 (A with stride 64). */
AMX void amx1(const uint16_t *W, const uint16_t *x, float *Y, long O, long I) {
    const long C = I / 32, G = O / 16, region = 32 * I; /* bytes of a group */
    char *st = aligned_alloc(64, 2 * region);
    tile_config cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
    cfg.colsb[0] = 4, cfg.rows[0] = 16; cfg.colsb[4] = 64, cfg.rows[4] = 16; cfg.colsb[6] = 4, cfg.rows[6] = 16;
    _tile_loadconfig(&cfg);
    float Ct[16] __attribute__((aligned(64)));
    const char *src = (const char *)W;
#define COPY(dst, from, n0, n1) \
    for (long b = n0; b < n1; b += 64) { \
        _mm_prefetch(from + b + 512, _MM_HINT_T0); _mm_prefetch(from + b + 4096, _MM_HINT_T1); \
        __m512i v = _mm512_load_si512((const void *)(from + b)); \
        long at = TILED ? ((b % (2 * I)) / 64 * 16 + b / (2 * I)) * 64 : b; \
        _mm512_store_si512((void *)(dst + at), v); }
    COPY(st, src, 0, region);
    for (long g = 0; g < G; g++) {
        const char *A = st + (g % 2) * region; char *nx = st + ((g + 1) % 2) * region;
        const char *nsrc = src + (g + 1) * region; const int more = g + 1 < G;
        _tile_zero(0);
        for (long c = 0; c < C; c++) {
            if (more) COPY(nx, nsrc, c * 1024, (c + 1) * 1024);
            _tile_loadd(6, x + 32 * c, 4);
            if (TILED) _tile_loadd(4, A + c * 1024, 64); else _tile_loadd(4, A + 64 * c, 2 * I);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, Ct, 4);
        memcpy(Y + 16 * g, Ct, 64);
    }
    _tile_release();
    free(st);
}
