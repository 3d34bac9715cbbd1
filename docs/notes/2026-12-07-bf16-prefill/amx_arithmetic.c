#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
int permit(void) { unsigned long m = 0; if (syscall(SYS_arch_prctl, 0x1023, 18)) return 0; syscall(SYS_arch_prctl, 0x1022, &m); return (m >> 18) & 1; }

/* X [M, I] -> Xp per token group g of 16: [C chunks][16 kk][16 tokens][2], zero padded. */
static void pack(const uint16_t *X, long ldx, long M, long I, uint16_t *Xp) {
    long C = (I + 31) / 32, G = (M + 15) / 16;
    memset(Xp, 0, G * C * 1024);
    for (long m = 0; m < M; m++) {
        uint16_t *g = Xp + (m / 16) * C * 512;
        for (long i = 0; i < I; i++) g[(i / 32) * 512 + ((i % 32) / 2) * 32 + (m % 16) * 2 + (i & 1)] = X[m * ldx + i];
    }
}
#ifndef PF
#define PF 1
#endif
/* Y[m, o] = sum_i W[o, i] X[m, i]. I % 32 == 0, O % 16 == 0 for the prototype. */
AMX void amx_gemm(const uint16_t *W, const uint16_t *X, long ldx, float *Y, long ldy, long O, long I, long M) {
    long C = I / 32, G = (M + 15) / 16, T = M < 16 ? M : 16;
    uint16_t *Xp = aligned_alloc(64, G * C * 1024 + 64);
    pack(X, ldx, M, I, Xp);
    tile_config cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.colsb[t] = 4 * T, cfg.rows[t] = 16; /* C: 16 outputs x T tokens */
    for (int t = 4; t < 6; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;    /* A: 16 outputs x 32 k */
    for (int t = 6; t < 8; t++) cfg.colsb[t] = 4 * T, cfg.rows[t] = 16; /* B: 16 pairs x T tokens */
    _tile_loadconfig(&cfg);
    float Ct[16 * 16] __attribute__((aligned(64)));
    const long sa = 2 * I;
    for (long o = 0; o < O; o += 32) {
        const int two = o + 32 <= O;
        const uint16_t *W0 = W + o * I, *W1 = W0 + 16 * I;
        for (long g = 0; g < G; g += 1) {
            const uint16_t *B = Xp + g * C * 512;
            _tile_zero(0); _tile_zero(1);
            for (long c = 0; c < C; c++) {
#if PF == 1
                if (g == 0) {
                    const char *nx = (const char *)(W0 + 32 * I) + c * 2048;
                    for (int j = 0; j < 2048; j += 64) _mm_prefetch(nx + j, _MM_HINT_T0);
                }
#elif PF == 2
                if (g == 0) {
                    const char *nx = (const char *)(W0 + 32 * I) + c * 2048;
                    for (int j = 0; j < 2048; j += 64) { _mm_prefetch(nx + j, _MM_HINT_T0); _mm_prefetch(nx + 32 * 2 * I + j, _MM_HINT_T1); }
                }
#elif PF == 4
                if (g == 0) {
                    long cc = c + DIST; const uint16_t *base = cc < C ? W0 : W0 + 32 * I; if (cc >= C) cc -= C;
                    for (int j = 0; j < 32; j++) _mm_prefetch((const char *)(base + j * I + 32 * cc), _MM_HINT_T0);
                }
#elif PF == 5
                if (g == 0) {
                    long cc = c + DIST; const uint16_t *base = cc < C ? W0 : W0 + 32 * I; if (cc >= C) cc -= C;
                    for (int j = 0; j < 32; j++) _mm_prefetch((const char *)(base + j * I + 32 * cc), _MM_HINT_T0);
                    cc = c + FAR; base = W0; while (cc >= C) cc -= C, base += 32 * I;
                    for (int j = 0; j < 32; j++) _mm_prefetch((const char *)(base + j * I + 32 * cc), _MM_HINT_T1);
                }
#elif PF == 3
                if (g == 0) {
                    const char *nx = (const char *)(W0 + 64 * I) + c * 2048;
                    for (int j = 0; j < 2048; j += 64) { _mm_prefetch(nx + j, _MM_HINT_T0); }
                }
#endif
                _tile_loadd(6, B + c * 512, 64);
                _tile_loadd(4, W0 + 32 * c, sa);
                _tile_dpbf16ps(0, 4, 6);
                if (two) { _tile_loadd(5, W1 + 32 * c, sa); _tile_dpbf16ps(1, 5, 6); }
            }
            for (int h = 0; h < (two ? 2 : 1); h++) {
                if (h == 0) _tile_stored(0, Ct, 4 * T); else _tile_stored(1, Ct, 4 * T);
                long tn = M - g * 16 < 16 ? M - g * 16 : 16;
                for (long t = 0; t < tn; t++)
                    for (int r = 0; r < 16; r++) Y[(g * 16 + t) * ldy + o + 16 * h + r] = Ct[r * T + t];
            }
        }
        if (!two) o -= 16;
    }
    _tile_release();
    free(Xp);
}

/* candidates for AMX's per-element arithmetic: one output row w . x over I (I even) */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
float emu(const uint16_t *w, const uint16_t *x, long I, int mode) {
    if (mode == 0) { /* vdpbf16ps lane 0 */
        __m512 acc = _mm512_setzero_ps();
        for (long i = 0; i < I; i += 2) {
            uint32_t a, b; memcpy(&a, w + i, 4); memcpy(&b, x + i, 4);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(a), (__m512bh)_mm512_set1_epi32(b));
        }
        return _mm512_cvtss_f32(acc);
    }
    float acc = 0;
    for (long i = 0; i < I; i += 2) {
        uint32_t a0 = (uint32_t)w[i] << 16, a1 = (uint32_t)w[i+1] << 16, b0 = (uint32_t)x[i] << 16, b1 = (uint32_t)x[i+1] << 16;
        float fa0, fa1, fb0, fb1; memcpy(&fa0, &a0, 4); memcpy(&fa1, &a1, 4); memcpy(&fb0, &b0, 4); memcpy(&fb1, &b1, 4);
        if (mode == 1) { acc = acc + fa0 * fb0; acc = acc + fa1 * fb1; }
        else if (mode == 2) { acc = acc + fa1 * fb1; acc = acc + fa0 * fb0; }
        else if (mode == 3) { acc = acc + (fa0 * fb0 + fa1 * fb1); }
        else if (mode == 4) { acc = (float)((double)acc + (double)(fa0 * fb0) + (double)(fa1 * fb1)); }
    }
    return acc;
}
static float bf(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
/* per group of n pairs: exact sum (long double / double) of the 2n products, then acc = fl(acc + s) (mode 0)
   or acc = fl(acc + fl(s)) (mode 1) */
float emu2(const uint16_t *w, const uint16_t *x, long I, int n, int mode) {
    float acc = 0;
    for (long i = 0; i < I; i += 2 * n) {
        double s = 0;
        for (long j = i; j < i + 2 * n && j < I; j++) s += (double)bf(w[j]) * (double)bf(x[j]);
        if (mode == 0) acc = (float)((double)acc + s); else acc = acc + (float)s;
    }
    return acc;
}
