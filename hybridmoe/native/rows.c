/* The small per-row operations of a decode step, one call each instead of a dozen torch calls:
   RMSNorm and the rotary embedding, bf16 in and out, rounded where torch rounds. A decode step of a
   narrow model spends more on calling torch (a few microseconds a call, ~400 calls a layer) than on
   these operations' arithmetic, so they are plain C with no ISA flags: one build for every x86-64
   CPU, its floats exactly as written (no contraction into FMAs, which would round differently). */

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

/* Y[r] = W * bf16(X[r] / sqrt(mean(X[r]^2) + eps)) for rows r < R of n elements, as layers/norm.py's
   RMSNorm computes it in torch: the mean of squares in fp32 (summed in 16 lanes, an order of its
   own: the mean may differ from torch's in its last bit), the scaled row rounded to bf16, then the
   product with the bf16 weight rounded again. */
void hm_rmsnorm_bf16(const uint16_t *X, long ldx, const uint16_t *W, uint16_t *Y, long ldy, long R, long n,
                     float eps) {
    for (long r = 0; r < R; r++) {
        const uint16_t *x = X + r * ldx;
        uint16_t *y = Y + r * ldy;
        float lane[16] = {0};
        long i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) lane[j] += f32(x[i + j]) * f32(x[i + j]);
        for (int j = 0; i < n; i++, j++) lane[j] += f32(x[i]) * f32(x[i]);
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += lane[j];
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (i = 0; i < n; i++) y[i] = bf16(f32(W[i]) * round_bf16(f32(x[i]) * inv));
    }
}

/* Y[t, h] = X[t, h] * cos[t] + rotate_half(X[t, h]) * sin[t] for T rows of H heads of d elements,
   as layers/rotary.py's apply_rotary computes it on bf16 tensors: cos and sin ([T, d] fp32, rows
   ldc apart) rounded to bf16, each product rounded to bf16, then their sum. X's heads are ldh
   apart and its rows ldt apart; Y is [T, H, d] contiguous. rotate_half(x) = [-x2, x1] with x1, x2
   the halves of x (Llama's layout). */
void hm_rotary_bf16(const uint16_t *X, long ldt, long ldh, long T, long H, long d, const float *C,
                    const float *S, long ldc, uint16_t *Y) {
    const long half = d / 2;
    for (long t = 0; t < T; t++) {
        const float *c = C + t * ldc, *s = S + t * ldc;
        for (long h = 0; h < H; h++) {
            const uint16_t *x = X + t * ldt + h * ldh;
            uint16_t *y = Y + (t * H + h) * d;
            for (long i = 0; i < half; i++) {
                const float x1 = f32(x[i]), x2 = f32(x[i + half]);
                y[i] = bf16(round_bf16(x1 * round_bf16(c[i])) + round_bf16(-x2 * round_bf16(s[i])));
                y[i + half] = bf16(round_bf16(x2 * round_bf16(c[i + half])) +
                                   round_bf16(x1 * round_bf16(s[i + half])));
            }
        }
    }
}
