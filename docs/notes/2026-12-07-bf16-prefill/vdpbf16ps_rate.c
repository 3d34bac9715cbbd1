#include <immintrin.h>
#include <stdio.h>
#include <time.h>
__attribute__((target("avx512bf16,avx512f"))) int main(void) {
    __m512 a[16]; for (int i = 0; i < 16; i++) a[i] = _mm512_set1_ps(0.f);
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3f80);
    struct timespec t0, t1; clock_gettime(CLOCK_MONOTONIC, &t0);
    long n = 200000000;
    for (long i = 0; i < n; i += 16) {
        for (int j = 0; j < 16; j++) { a[j] = _mm512_dpbf16_ps(a[j], x, y); __asm__ volatile("" : "+v"(a[j])); }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    float r = 0; for (int i = 0; i < 16; i++) r += _mm512_reduce_add_ps(a[i]);
    printf("%.2f G vdpbf16ps/s  %.1f GFLOP/s  (%g)\n", n / s / 1e9, 64 * n / s / 1e9, r);
    /* fma for comparison */
    __m512 b[16]; for (int i = 0; i < 16; i++) b[i] = _mm512_set1_ps(0.f);
    __m512 u = _mm512_set1_ps(1.0001f), v = _mm512_set1_ps(0.5f);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i += 16) for (int j = 0; j < 16; j++) { b[j] = _mm512_fmadd_ps(u, v, b[j]); __asm__ volatile("" : "+v"(b[j])); }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    r = 0; for (int i = 0; i < 16; i++) r += _mm512_reduce_add_ps(b[i]);
    printf("%.2f G fma/s (%g)\n", n / s / 1e9, r);
}
