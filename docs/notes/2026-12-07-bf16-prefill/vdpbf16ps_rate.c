/* Issue rates on one core, in TSC cycles (2.6 GHz here) per instruction, 12 (or 4) independent
   accumulators in registers, no loads: gcc -O2 vdpbf16ps_rate.c && ./a.out */
#include <stdio.h>
#include <x86intrin.h>
#define N 100000000L
#define TWELVE(op)                                                                                         \
    __asm__ volatile(op " %%zmm20, %%zmm21, %%zmm0\n" op " %%zmm20, %%zmm21, %%zmm1\n" op                  \
                        " %%zmm20, %%zmm21, %%zmm2\n" op " %%zmm20, %%zmm21, %%zmm3\n" op                  \
                        " %%zmm20, %%zmm21, %%zmm4\n" op " %%zmm20, %%zmm21, %%zmm5\n" op                  \
                        " %%zmm20, %%zmm21, %%zmm6\n" op " %%zmm20, %%zmm21, %%zmm7\n" op                  \
                        " %%zmm20, %%zmm21, %%zmm8\n" op " %%zmm20, %%zmm21, %%zmm9\n" op                  \
                        " %%zmm20, %%zmm21, %%zmm10\n" op " %%zmm20, %%zmm21, %%zmm11\n" ::                \
                            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",    \
                              "xmm9", "xmm10", "xmm11")
int main(void) {
    unsigned long long t0 = __rdtsc();
    for (long i = 0; i < N; i += 12) TWELVE("vdpbf16ps");
    unsigned long long t1 = __rdtsc();
    double c = (double)(t1 - t0) / N;
    printf("vdpbf16ps zmm: %.3f TSC cycles each, %.2f G/s, %.0f GFLOP/s\n", c, 2.6 / c, 2.6 / c * 64);
    t0 = __rdtsc();
    for (long i = 0; i < N; i += 12) TWELVE("vfmadd231ps");
    t1 = __rdtsc();
    c = (double)(t1 - t0) / N;
    printf("vfmadd231ps zmm: %.3f TSC cycles each, %.2f G/s\n", c, 2.6 / c);
    return 0;
}
