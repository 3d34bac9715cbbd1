/* A chunk's tokens grouped by expert, and each token's experts' outputs mixed back into one row: shared by
   quant.c (hm_qmoe_tokens, experts in blocks) and bf16.c (hm_moe_tokens_bf16, plain bf16 experts), so
   that both give the bits of experts/run/ffn.py's combine_token and combine_grouped the same way. A file
   that includes it may define MIX_TARGET (a function attribute: quant.c's AVX2) first. */

#ifndef HM_MIX_H
#define HM_MIX_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "rows.h"

#ifndef MIX_TARGET
#define MIX_TARGET
#endif

/* The R = T K (token, k) assignments of ids [R] (each in [0, E)) grouped by expert: first [E + 1] (zeroed
   by the caller) gets where each expert's rows start (first[j] .. first[j + 1] are expert j's), and slot
   [R] the row of assignment i, tokens in increasing order within each expert's rows. -2 with no memory. */
static inline int group_by_expert(const int64_t *ids, long R, long E, long *first, long *slot) {
    long *next = malloc(sizeof(long) * (size_t)(E > 0 ? E : 1));
    if (!next) return -2;
    for (long i = 0; i < R; i++) first[ids[i] + 1]++; /* counts, then where each expert's rows start */
    for (long j = 0; j < E; j++) first[j + 1] += first[j];
    memcpy(next, first, sizeof(long) * (size_t)E);
    for (long i = 0; i < R; i++) slot[i] = next[ids[i]]++;
    free(next);
    return 0;
}

typedef struct {
    const int64_t *ids;
    const float *w;
    long K, H;
    int x_bf16;
    const float *y;    /* [T * K, H]: the experts' outputs, expert by expert */
    const long *slot;  /* [T, K]: the row of y that holds token t's k-th expert's output */
    void *out;
    long T;
    atomic_long next;
} mix_call;

#define MIX_TOKENS 8  /* tokens per unit of the weighted sums */
#define MIX_COLS 256  /* columns summed at a time, in registers and L1 */

/* Token t's weighted sum (mix_call's): sum_j y_j * w_j over its experts in increasing id (y_j first
   rounded to bf16 for a bf16 token), each term in fp32, added from 0, rounded once to the token's type,
   MIX_COLS columns at a time: each column through the same float operations in the same order, whatever
   the vector width the compiler picks. */
MIX_TARGET static void mix_token(const mix_call *c, long t) {
    const long K = c->K, H = c->H;
    long order[64];
    for (long k = 0; k < K; k++) { /* insertion sort of k by the token's ids */
        long j = k;
        for (; j > 0 && c->ids[t * K + order[j - 1]] > c->ids[t * K + k]; j--) order[j] = order[j - 1];
        order[j] = k;
    }
    for (long h0 = 0; h0 < H; h0 += MIX_COLS) {
        const long n = min_l(MIX_COLS, H - h0);
        float acc[MIX_COLS];
        for (long h = 0; h < n; h++) acc[h] = 0.0f;
        for (long j = 0; j < K; j++) {
            const float *v = c->y + c->slot[t * K + order[j]] * H + h0, wj = c->w[t * K + order[j]];
            if (c->x_bf16)
                for (long h = 0; h < n; h++) acc[h] += round_bf16(v[h]) * wj;
            else
                for (long h = 0; h < n; h++) acc[h] += v[h] * wj;
        }
        if (c->x_bf16)
            for (long h = 0; h < n; h++) ((uint16_t *)c->out)[t * H + h0 + h] = bf16(acc[h]);
        else
            memcpy((float *)c->out + t * H + h0, acc, sizeof(float) * (size_t)n);
    }
}

static void mix_region(void *arg, int t, int T) {
    (void)t;
    (void)T;
    mix_call *c = arg;
    const long units = (c->T + MIX_TOKENS - 1) / MIX_TOKENS;
    for (long u; (u = next_unit(&c->next, units)) >= 0;)
        for (long m = u * MIX_TOKENS; m < min_l(u * MIX_TOKENS + MIX_TOKENS, c->T); m++) mix_token(c, m);
}

/* Every token's weighted sum of mix_call c (its next not yet set) on up to `threads` of the pool. */
static inline void mix_tokens(mix_call *c, int threads) {
    atomic_init(&c->next, 0);
    hm_parallel(mix_region, c, (int)min_l(threads, (c->T + MIX_TOKENS - 1) / MIX_TOKENS));
}

/* A calling thread's buffer of n bytes, kept at its largest for the thread's next call: a prefill chunk's
   experts' outputs (T K H floats, 33.5 MB at 512 tokens of Qwen3-30B-A3B's shape) lie above glibc's largest
   mmap threshold (32 MB), so a buffer freed and made again every layer came back as fresh pages, faulted
   in and zeroed by the kernel: ~2.5% of a 2-thread prefill. One per thread (a server runs prefill and
   decode on two) and per library that includes this. */
static __thread struct {
    void *p;
    size_t n;
} kept_buffer;

static void *kept_buffer_of(size_t n) {
    if (kept_buffer.n < n) {
        free(kept_buffer.p);
        kept_buffer.p = aligned_alloc(64, (n + 63) / 64 * 64);
        kept_buffer.n = kept_buffer.p ? n : 0;
    }
    return kept_buffer.p;
}

#endif
