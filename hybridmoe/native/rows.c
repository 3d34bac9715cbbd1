/* The small per-row operations of a decode step, one call each instead of a dozen torch calls:
   RMSNorm and the rotary embedding, bf16 in and out, rounded where torch rounds. A decode step of a
   narrow model spends more on calling torch (a few microseconds a call, ~400 calls a layer) than on
   these operations' arithmetic, so they are plain C with no ISA flags: one build for every x86-64
   CPU, its floats exactly as written (rows.h). Each function is also built for AVX-512 and AVX2
   (target_clones: the loader picks the widest the CPU runs), with the same float operations per
   element in wider vectors, so the same bits: a 512-token prefill's norms and rotary ran on one
   thread for ~46 ms, 1.8-1.9x faster so (docs/notes/2026-12-06-prefill-two-threads.md). */

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

#include "rows.h"

/* Y[r] = rmsnorm_row(X[r]) for rows r < R of n elements (rows.h, layers/norm.py's RMSNorm). */
CLONES void hm_rmsnorm_bf16(const uint16_t *X, long ldx, const uint16_t *W, uint16_t *Y, long ldy, long R, long n,
                     float eps) {
    for (long r = 0; r < R; r++) rmsnorm_row(X + r * ldx, W, Y + r * ldy, n, eps);
}

/* Y[t, h] = rotary_head(X[t, h], cos[t], sin[t]) for T rows of H heads of d elements (rows.h,
   layers/rotary.py's apply_rotary). cos and sin are [T, d] fp32, rows ldc apart; X's heads are ldh
   apart and its rows ldt apart; Y is [T, H, d] contiguous. */
CLONES void hm_rotary_bf16(const uint16_t *X, long ldt, long ldh, long T, long H, long d, const float *C,
                    const float *S, long ldc, uint16_t *Y) {
    for (long t = 0; t < T; t++)
        for (long h = 0; h < H; h++) rotary_head(X + t * ldt + h * ldh, C + t * ldc, S + t * ldc, Y + (t * H + h) * d, d);
}

/* The router's choice for T tokens, rows of E logits ld apart (bf16 or fp32): ids [T, K], weights
   [T, K] (rows.h route_row). 0, or -1 where a row has a logit that is not finite. */
CLONES int hm_softmax_topk(const void *L, int is_bf16, long ld, long T, long E, long K, int renorm, int64_t *ids,
                           float *w) {
    const long size = is_bf16 ? 2 : 4;
    for (long t = 0; t < T; t++)
        if (route_row((const char *)L + t * ld * size, is_bf16, E, K, renorm, ids + t * K, w + t * K)) return -1;
    return 0;
}
