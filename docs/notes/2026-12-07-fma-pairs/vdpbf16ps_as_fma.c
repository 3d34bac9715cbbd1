/* vdpbf16ps against two fma a pair of widened bf16 values (odd products first, then even), with MXCSR's
   FTZ and DAZ (./a.out 1) and without (./a.out 0): 64 chunks accumulated per trial, 20000 trials of four
   kinds of values (ordinary, any bits, tiny exponents, ~1e-19). gcc -O2 -march=native. */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
__attribute__((target("avx512f,avx512bf16,avx512bw")))
int main(int argc, char **argv) {
    int ftz = argc > 1 ? atoi(argv[1]) : 1;
    srand(1);
    long mism = 0, total = 0;
    unsigned csr = _mm_getcsr();
    for (int trial = 0; trial < 20000; trial++) {
        uint16_t a[32 * 64], b[32 * 64];
        int mode = trial % 4;
        for (int i = 0; i < 32 * 64; i++) {
            uint32_t r = (uint32_t)rand();
            uint16_t v;
            if (mode == 0) { float f = ((float)rand() / RAND_MAX - 0.5f) * 2; uint32_t u; memcpy(&u, &f, 4); v = u >> 16; }
            else if (mode == 1) v = (uint16_t)r;  /* any bits: denormals, inf, nan, huge */
            else if (mode == 2) { v = (uint16_t)(r & 0x807F) | (uint16_t)(((r >> 8) % 12) << 7); } /* tiny exps incl denormals */
            else { float f = ((float)rand() / RAND_MAX - 0.5f) * 1e-19f; uint32_t u; memcpy(&u, &f, 4); v = u >> 16; }
            a[i] = v; b[i] = (uint16_t)(rand()); if (mode == 0 || mode == 3) { float f = ((float)rand() / RAND_MAX - 0.5f) * (mode == 3 ? 1e-19f : 4); uint32_t u; memcpy(&u, &f, 4); b[i] = u >> 16; }
        }
        __m512 acc = _mm512_setzero_ps(), e = _mm512_setzero_ps();
        for (int k = 0; k < 64; k++) {
            __m512i va = _mm512_loadu_si512(a + 32 * k), vb = _mm512_loadu_si512(b + 32 * k);
            _mm_setcsr(csr);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)va, (__m512bh)vb);
            if (ftz) _mm_setcsr(csr | 0x8040);  /* FTZ | DAZ */
            const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000);
            __m512 ao = _mm512_castsi512_ps(_mm512_and_si512(va, hi)), bo = _mm512_castsi512_ps(_mm512_and_si512(vb, hi));
            __m512 ae = _mm512_castsi512_ps(_mm512_slli_epi32(va, 16)), be = _mm512_castsi512_ps(_mm512_slli_epi32(vb, 16));
            e = _mm512_fmadd_ps(ao, bo, e);
            e = _mm512_fmadd_ps(ae, be, e);
            _mm_setcsr(csr);
        }
        uint32_t x[16], y[16];
        _mm512_storeu_si512(x, _mm512_castps_si512(acc)); _mm512_storeu_si512(y, _mm512_castps_si512(e));
        for (int l = 0; l < 16; l++) {
            total++;
            int xn = (x[l] & 0x7f800000) == 0x7f800000 && (x[l] & 0x7fffff), yn = (y[l] & 0x7f800000) == 0x7f800000 && (y[l] & 0x7fffff);
            if (xn && yn) continue;
            if (x[l] != y[l]) { if (mism < 5) printf("mode %d lane %d: dp %08x fma %08x\n", mode, l, x[l], y[l]); mism++; }
        }
    }
    printf("ftz=%d mismatches %ld of %ld\n", ftz, mism, total);
    return 0;
}
