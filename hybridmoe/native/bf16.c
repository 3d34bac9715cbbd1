/* Decode bf16 kernels for CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and later).

   Decode multiplies a few activation rows (one per sequence of the batch) by every weight, so its
   speed is the speed at which the weights stream from RAM. oneDNN's bf16 matrix-vector path reached
   about 16 GB/s on one core of the 2-core Zen 4 this was written on; a loop over four weight rows at
   a time with vdpbf16ps (32 bf16 products per instruction, accumulated in fp32) reached about 30 GB/s,
   close to what one core can read (docs/benchmarks.md, issue 2). For M rows the four weight rows are
   multiplied by up to four x rows at once (16 accumulators) and stay in L1 while the other x rows
   pass, so the weights stream once for the whole batch. Built at first use by
   hybridmoe/native/__init__.py. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* [sum a, sum b, sum c, sum d] of four 16-lane vectors. */
ALWAYS_INLINE __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVES(v) _mm256_add_ps(_mm512_castps512_ps256(v), \
                                _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1)))
    __m256 ab = _mm256_hadd_ps(HALVES(a), HALVES(b));  /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    __m256 cd = _mm256_hadd_ps(HALVES(c), HALVES(d));
#undef HALVES
    __m256 s = _mm256_hadd_ps(ab, cd);  /* a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567 */
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Y[m + r, o + j] = sum_i W[o + j, i] X[m + r, i] for r < R, j < c (c <= 4 weight rows left).
   Every x row is computed the same way whatever R is, so a row's result does not depend on the
   batch it came in. Missing weight rows (j >= c) re-read row o and are not stored. */
ALWAYS_INLINE void block(const uint16_t *W, long I, long o, long c, const uint16_t *X, long ldx, long m,
                         const int R, const int PF, float *Y, long ldy) {
    const uint16_t *w[4], *x[4];
    for (int j = 0; j < 4; j++) w[j] = W + (o + (j < c ? j : 0)) * I;
    for (int r = 0; r < R; r++) x[r] = X + (m + r) * ldx;
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    long i = 0;
    for (; i + 32 <= I; i += 32) {
        __m512bh wv[4];
        for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + i);
        if (PF)  /* the same columns two blocks on (prefetching past W's end is harmless) */
            for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(w[j] + 8 * I + i), _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x[r] + i);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
        }
    }
    if (i < I) {  /* the row's last I % 32 elements, zeros past the end */
        __mmask32 k = (__mmask32)((1ULL << (I - i)) - 1);
        __m512bh wv[4];
        for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(k, w[j] + i);
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(k, x[r] + i);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 s = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
        _mm_mask_storeu_ps(Y + (m + r) * ldy + o, (__mmask8)((1u << c) - 1), s);
    }
}

/* Y[m, o] = sum_i W[o, i] X[m, i] for m < M, o < O.  W: [O, I] bf16 row-major; X: [M, I] bf16 with
   rows ldx apart; Y: [M, O] fp32 with rows ldy apart. */
static void gemm(const uint16_t *W, const uint16_t *X, long ldx, float *Y, long ldy, long O, long I, long M) {
    for (long o = 0; o < O; o += 4) {
        long c = O - o < 4 ? O - o : 4, m = 0;
        if (M >= 4) {
            block(W, I, o, c, X, ldx, 0, 4, 1, Y, ldy);
            for (m = 4; m + 4 <= M; m += 4) block(W, I, o, c, X, ldx, m, 4, 0, Y, ldy);
        }
        switch (M - m) {
        case 3: block(W, I, o, c, X, ldx, m, 3, m == 0, Y, ldy); break;
        case 2: block(W, I, o, c, X, ldx, m, 2, m == 0, Y, ldy); break;
        case 1: block(W, I, o, c, X, ldx, m, 1, m == 0, Y, ldy); break;
        }
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

void hm_gemm_bf16(const uint16_t *W, const uint16_t *X, long ldx, float *Y, long ldy, long O, long I, long M) {
    gemm(W, X, ldx, Y, ldy, O, I, M);
}

/* M tokens through one SwiGLU expert: Y = down (silu(G) * U), [G U] = X gate_up^T.
   gate_up: [2I, H], down: [H, I], X: [M, H] bf16 with rows ldx apart; Y: [M, H] fp32 with rows ldy
   apart; scratch: M * 2I floats, h: M * I bf16. G and U stay fp32; silu(G) * U is rounded to bf16
   once, as the input of the down projection. */
void hm_expert_rows_bf16(const uint16_t *gate_up, const uint16_t *down, const uint16_t *X, long ldx, float *Y,
                         long ldy, long M, long H, long I, float *scratch, uint16_t *h) {
    gemm(gate_up, X, ldx, scratch, 2 * I, 2 * I, H, M);  /* [M, 2I] */
    for (long m = 0; m < M; m++) {
        const float *g = scratch + m * 2 * I, *u = g + I;
        for (long i = 0; i < I; i++) h[m * I + i] = to_bf16(g[i] / (1.0f + expf(-g[i])) * u[i]);
    }
    gemm(down, h, I, Y, ldy, H, I, M);  /* [M, H] */
}
