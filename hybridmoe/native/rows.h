/* Row arithmetic shared by rows.c (RMSNorm and rotary, one call each) and bf16.c (the fused decode
   attention), so that both give the same bits: bf16 <-> fp32, and RMSNorm and the rotary embedding
   of one row as torch computes them on bf16 tensors. Both libraries are built with
   -ffp-contract=off: these floats are exactly as written (an FMA would round differently). */

#ifndef HM_ROWS_H
#define HM_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN. */
static inline uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f32 of the bf16 rounding of f: what a bf16 tensor holds after a torch op computed f. */
static inline float round_bf16(float f) { return f32(bf16(f)); }

/* y = w * bf16(x / sqrt(mean(x^2) + eps)) for one row of n: the mean of squares in fp32 (summed in 16
   lanes, an order of its own: the mean may differ from torch's in its last bit), the scaled row
   rounded to bf16, then the product with the bf16 weight rounded again (layers/norm.py). */
static inline void rmsnorm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, long n, float eps) {
    float lane[16] = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lane[j] += f32(x[i + j]) * f32(x[i + j]);
    for (int j = 0; i < n; i++, j++) lane[j] += f32(x[i]) * f32(x[i]);
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += lane[j];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = bf16(f32(w[i]) * round_bf16(f32(x[i]) * inv));
}

/* y = x * cos + rotate_half(x) * sin for one head of d, as layers/rotary.py's apply_rotary computes it
   on bf16 tensors: cos and sin (fp32) rounded to bf16, each product rounded to bf16, then their sum.
   rotate_half(x) = [-x2, x1] with x1, x2 the halves of x (Llama's layout). */
static inline void rotary_head(const uint16_t *x, const float *c, const float *s, uint16_t *y, long d) {
    const long half = d / 2;
    for (long i = 0; i < half; i++) {
        const float x1 = f32(x[i]), x2 = f32(x[i + half]);
        y[i] = bf16(round_bf16(x1 * round_bf16(c[i])) + round_bf16(-x2 * round_bf16(s[i])));
        y[i + half] = bf16(round_bf16(x2 * round_bf16(c[i + half])) + round_bf16(x1 * round_bf16(s[i + half])));
    }
}

/* A router's choice for one token, layers/moe.py's softmax_topk: p = softmax(l) over E logits, the
   K largest in descending order (of equal logits the lower index first, so the choice does not
   depend on how a scan is split), and their weights: p, or with renorm p over the sum of the K. The
   largest logit is subtracted, exp and the sums are in double, and each weight is rounded once to
   fp32 at the end: the same bits on every CPU (libm's exp) and whatever the rows beside it, within
   an fp32 ulp of the exact values (torch's fp32 softmax may differ from them in its last bits). l is
   bf16 (is_bf16 != 0) or fp32. 0, or -1 for a logit that is not finite (the caller's torch path
   says what that means). */
static inline int route_row(const void *l, int is_bf16, long E, long K, int renorm, int64_t *ids, float *w) {
    double e[E];
    double top = -INFINITY;
    for (long i = 0; i < E; i++) {
        e[i] = is_bf16 ? f32(((const uint16_t *)l)[i]) : ((const float *)l)[i];
        if (!isfinite(e[i])) return -1;
        if (e[i] > top) top = e[i];
    }
    double sum = 0.0;
    for (long i = 0; i < E; i++) sum += (e[i] = exp(e[i] - top));
    double kept = 0.0, pick[K];
    for (long j = 0; j < K; j++) {
        long best = -1;
        for (long i = 0; i < E; i++)
            if (e[i] >= 0.0 && (best < 0 || e[i] > e[best])) best = i;  /* taken: -1 */
        ids[j] = best;
        pick[j] = e[best] / sum;
        kept += pick[j];
        e[best] = -1.0;
    }
    for (long j = 0; j < K; j++) w[j] = (float)(renorm ? pick[j] / kept : pick[j]);
    return 0;
}

#endif
