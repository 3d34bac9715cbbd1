#include <immintrin.h>
#include <stdint.h>
/* Sums every 64-bit word of rows slots[l] * ld .. + bytes, l < L, of K then V; asks for the rows `ahead`
   rows on, either in bursts (every 16 rows, the 16 rows `ahead` on) or a row at a time (the row `ahead`
   on); hint 0 T0, 1 T1, 2 NTA; `work` dependent fmas a row stand for a kernel's arithmetic. */
double rd(const char *K, const char *V, long ld, const long *slots, long L, long bytes, int ahead, int hint,
          int work, int burst) {
    __m512i acc = _mm512_setzero_si512();
    __m512 f = _mm512_set1_ps(1.0f), g = _mm512_set1_ps(0.999f);
    for (int p = 0; p < 2; p++) {
        const char *X = p ? V : K;
        for (long l = 0; l < L; l++) {
            if (ahead && (!burst || l % 16 == 0))
                for (long m = l + ahead; m < l + ahead + (burst ? 16 : 1) && m < L; m++) {
                    const char *n = X + slots[m] * ld;
                    for (long b = 0; b < bytes; b += 64) {
                        if (hint == 0) _mm_prefetch(n + b, _MM_HINT_T0);
                        else if (hint == 1) _mm_prefetch(n + b, _MM_HINT_T1);
                        else _mm_prefetch(n + b, _MM_HINT_NTA);
                    }
                }
            const char *r = X + slots[l] * ld;
            for (long b = 0; b < bytes; b += 64) acc = _mm512_add_epi64(acc, _mm512_loadu_si512(r + b));
            for (int w = 0; w < work; w++) f = _mm512_fmadd_ps(f, g, g);
        }
    }
    return (double)_mm512_reduce_add_epi64(acc) + _mm512_reduce_add_ps(f);
}
