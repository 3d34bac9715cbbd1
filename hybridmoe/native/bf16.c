/* Single-token bf16 kernels for CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and later).

   Decode multiplies one activation row by every weight, so its speed is the speed at which the
   weights stream from RAM. oneDNN's bf16 matrix-vector path reached about 16 GB/s on one core of
   the 2-core Zen 4 this was written on; this loop, four weight rows at a time with vdpbf16ps
   (32 bf16 products per instruction, accumulated in fp32), reached about 30 GB/s, close to what one
   core can read (docs/benchmarks.md, issue 2). Built at first use by hybridmoe/native/__init__.py. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Elements i..i+31 of a bf16 row, zeros past `n`. */
static inline __m512bh load32(const uint16_t *p, long i, long n) {
    if (i + 32 <= n) return (__m512bh)_mm512_loadu_si512(p + i);
    __mmask32 m = (__mmask32)((1ULL << (n - i)) - 1);
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p + i);
}

/* y[o] = sum_i W[o, i] x[i] for o < O.  W: [O, I] bf16 row-major, x: [I] bf16, y: [O] fp32. */
static void gemv(const uint16_t *W, const uint16_t *x, float *y, long O, long I) {
    long o = 0;
    for (; o + 4 <= O; o += 4) {
        const uint16_t *w0 = W + o * I, *w1 = w0 + I, *w2 = w1 + I, *w3 = w2 + I;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long i = 0; i < I; i += 32) {
            __m512bh xv = load32(x, i, I);
            a0 = _mm512_dpbf16_ps(a0, load32(w0, i, I), xv);
            a1 = _mm512_dpbf16_ps(a1, load32(w1, i, I), xv);
            a2 = _mm512_dpbf16_ps(a2, load32(w2, i, I), xv);
            a3 = _mm512_dpbf16_ps(a3, load32(w3, i, I), xv);
        }
        y[o] = _mm512_reduce_add_ps(a0);
        y[o + 1] = _mm512_reduce_add_ps(a1);
        y[o + 2] = _mm512_reduce_add_ps(a2);
        y[o + 3] = _mm512_reduce_add_ps(a3);
    }
    for (; o < O; o++) {
        __m512 a = _mm512_setzero_ps();
        for (long i = 0; i < I; i += 32) a = _mm512_dpbf16_ps(a, load32(W + o * I, i, I), load32(x, i, I));
        y[o] = _mm512_reduce_add_ps(a);
    }
}

/* fp32 -> bf16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void hm_gemv_bf16(const uint16_t *W, const uint16_t *x, float *y, long O, long I) { gemv(W, x, y, O, I); }

/* One token through one SwiGLU expert: y = down (silu(g) * u), [g; u] = gate_up x.
   gate_up: [2I, H], down: [H, I], x: [H] bf16; y: [H] fp32; scratch: 2I floats, h: I bf16.
   g and u stay fp32; silu(g) * u is rounded to bf16 once, as the input of the down projection. */
void hm_expert_bf16(const uint16_t *gate_up, const uint16_t *down, const uint16_t *x, float *y,
                    long H, long I, float *scratch, uint16_t *h) {
    gemv(gate_up, x, scratch, 2 * I, H);
    for (long i = 0; i < I; i++) {
        float g = scratch[i], u = scratch[I + i];
        h[i] = to_bf16(g / (1.0f + expf(-g)) * u);
    }
    gemv(down, h, y, H, I);
}
