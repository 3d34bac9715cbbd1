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
#include <stdlib.h>
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

/* ---- Decode attention: one query token per sequence over its paged bf16 K/V history. ----

   torch's SDPA spends ~200 us per (layer, sequence) on the demo model's decode at 1100 positions
   (9/3 heads of 64), while the 845 KB of K and V it reads take ~40 us at memory speed. Here K and V
   are read once, straight from the pools through the block table (no gather), in two passes: the
   scores of every query head (fp32, q.k with vdpbf16ps), a softmax with the maximum subtracted,
   then sum_l p_l v_l in fp32. Query head h uses KV head h / (heads / kv_heads), as transformers'
   repeat_kv. */

/* r[j] = the sum of a[j]'s 16 lanes. Each level adds the even and the odd lanes of two vectors:
   [A B] (8 partial sums each) becomes [A A' B B'] (4 each), and so on. */
ALWAYS_INLINE __m512 reduce16(__m512 a[16]) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int n = 16; n > 1; n /= 2)
        for (int j = 0; j < n / 2; j++)
            a[j] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * j], even, a[2 * j + 1]),
                                 _mm512_permutex2var_ps(a[2 * j], odd, a[2 * j + 1]));
    return a[0];
}

/* exp(x) in fp32 for the softmax's x <= 0: x = n ln2 + r, e^r by Cephes' expf polynomial
   (relative error ~2e-7), times 2^n by vscalefps (0 far below). */
ALWAYS_INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

ALWAYS_INLINE __mmask32 mask32(long n) { return n >= 32 ? (__mmask32)~0u : (__mmask32)((1ULL << n) - 1); }
ALWAYS_INLINE __mmask16 mask16(long n) { return n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0; }

/* Asks for the rows of positions l0..l1-1 (row_bytes each, every KV head) ahead of their use. The
   rows are scattered by the block table and read a KV head (128 bytes) at a time, a pattern the
   hardware prefetchers miss: 1100 positions from RAM, 9/3 heads of 64, took ~167 us without this and
   ~85-135 us with it (consecutive / shuffled blocks; 16, 64 or 128 positions ahead did no better). */
#define AHEAD 32  /* positions */
ALWAYS_INLINE void prefetch_rows(const uint16_t *base, long ld, const long *slots, long l0, long l1, long row_bytes) {
    for (long l = l0; l < l1; l++) {
        const char *row = (const char *)(base + slots[l] * ld);
        for (long b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
}

/* The scores q.k_j of one query head against 16 key rows k[j] (d elements each). */
ALWAYS_INLINE __m512 scores16(const uint16_t *q, const uint16_t *const k[16], long d) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (long i = 0; i < d; i += 32) {
        __mmask32 m = mask32(d - i);
        __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + i);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[j] + i));
    }
    return reduce16(acc);
}

/* O[r][c0 + i] += sum_{l0 <= l < l1} P[r][l] V[slot l][c0 + i] for R heads (rows of O dv apart, of P
   ldp apart) and i < 64 (masked at dv), the accumulators in registers across positions. */
ALWAYS_INLINE void weigh_values(float *O, long dv, long c0, const float *P, long ldp, const uint16_t *V,
                                long ldv, const long *slots, long l0, long l1, const int R) {
    __mmask16 m[4];
    __m512 acc[4][4];
    for (int t = 0; t < 4; t++) m[t] = mask16(dv - c0 - 16 * t);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++) acc[r][t] = _mm512_maskz_loadu_ps(m[t], O + r * dv + c0 + 16 * t);
    for (long l = l0; l < l1; l++) {
        const uint16_t *v = V + slots[l] * ldv + c0;
        __m512 vv[4];
        for (int t = 0; t < 4; t++)  /* bf16 -> fp32: the 16 bits on top of a zero half */
            vv[t] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m[t], v + 16 * t)), 16));
        for (int r = 0; r < R; r++) {
            __m512 p = _mm512_set1_ps(P[r * ldp + l]);
            for (int t = 0; t < 4; t++) acc[r][t] = _mm512_fmadd_ps(p, vv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++) _mm512_mask_storeu_ps(O + r * dv + c0 + 16 * t, m[t], acc[r][t]);
}

/* One sequence: q [heads, d] bf16 -> out [heads, dv] (fp32, or bf16 if out_bf16) over its L
   positions at slots[0..L). S: heads x roundup(L, 16) floats, O: heads x dv floats of scratch. */
static void attend_one(const uint16_t *q, const uint16_t *K, long ldk, const uint16_t *V, long ldv,
                       const long *slots, long L, long heads, long kv_heads, long d, long dv, float scale,
                       void *out, int out_bf16, float *S, float *O) {
    const long G = heads / kv_heads, ldp = (L + 15) & ~15L;
    /* scores, 16 positions at a time; the block's key rows stay in L1 for every head */
    prefetch_rows(K, ldk, slots, 0, L < AHEAD ? L : AHEAD, kv_heads * d * 2);
    for (long l0 = 0; l0 < L; l0 += 16) {
        const uint16_t *k[16];
        prefetch_rows(K, ldk, slots, l0 + AHEAD, l0 + AHEAD + 16 < L ? l0 + AHEAD + 16 : L, kv_heads * d * 2);
        for (long g = 0; g < kv_heads; g++) {
            for (int j = 0; j < 16; j++)  /* past L: position L - 1 again, its scores unused */
                k[j] = K + slots[l0 + j < L ? l0 + j : L - 1] * ldk + g * d;
            for (long h = g * G; h < (g + 1) * G; h++)
                _mm512_storeu_ps(S + h * ldp + l0, _mm512_mul_ps(scores16(q + h * d, k, d), _mm512_set1_ps(scale)));
        }
    }
    /* softmax numerators exp(s - max) in place; 1 / sum kept per head */
    float inv[heads];
    for (long h = 0; h < heads; h++) {
        float *s = S + h * ldp;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (long l = 0; l < L; l += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, mask16(L - l), s + l));
        __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (long l = 0; l < L; l += 16) {
            __mmask16 m = mask16(L - l);
            __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + l), top)));
            _mm512_storeu_ps(s + l, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[h] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* sum_l p_l v_l: 16 positions at a time, for up to 4 heads of a group and 64 columns at once */
    memset(O, 0, sizeof(float) * heads * dv);
    prefetch_rows(V, ldv, slots, 0, L < AHEAD ? L : AHEAD, kv_heads * dv * 2);
    for (long l0 = 0; l0 < L; l0 += 16) {
        long l1 = l0 + 16 < L ? l0 + 16 : L;
        prefetch_rows(V, ldv, slots, l0 + AHEAD, l0 + AHEAD + 16 < L ? l0 + AHEAD + 16 : L, kv_heads * dv * 2);
        for (long g = 0; g < kv_heads; g++)
            for (long h = g * G; h < (g + 1) * G; h += 4)
                for (long c0 = 0; c0 < dv; c0 += 64) {
                    float *o = O + h * dv;
                    const float *p = S + h * ldp;
                    const uint16_t *v = V + g * dv;
                    switch ((g + 1) * G - h < 4 ? (g + 1) * G - h : 4) {
                    case 4: weigh_values(o, dv, c0, p, ldp, v, ldv, slots, l0, l1, 4); break;
                    case 3: weigh_values(o, dv, c0, p, ldp, v, ldv, slots, l0, l1, 3); break;
                    case 2: weigh_values(o, dv, c0, p, ldp, v, ldv, slots, l0, l1, 2); break;
                    default: weigh_values(o, dv, c0, p, ldp, v, ldv, slots, l0, l1, 1); break;
                    }
                }
    }
    for (long h = 0; h < heads; h++)
        for (long c = 0; c < dv; c += 16) {
            __mmask16 m = mask16(dv - c);
            __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, O + h * dv + c), _mm512_set1_ps(inv[h]));
            if (out_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)out + h * dv + c, m, (__m256i)_mm512_cvtneps_pbh(y));
            else
                _mm512_mask_storeu_ps((float *)out + h * dv + c, m, y);
        }
}

/* Decode attention for n sequences, one query token each. Sequence s: its query row is
   Q + rows[s] * ldq ([heads, d] bf16), its output row out + rows[s] * ldo ([heads, dv], fp32 or bf16);
   it attends to positions 0..lengths[s]-1, position l at pool slot table[l / block_size] * block_size
   + l % block_size with table = tables + table_starts[s]. K: [slots, kv_heads, d] bf16 with slot
   rows ldk apart, V: [slots, kv_heads, dv] with rows ldv apart. Returns 0, or -1 if out of memory. */
int hm_decode_attention_bf16(const uint16_t *Q, long ldq, const uint16_t *K, long ldk, const uint16_t *V,
                             long ldv, const int32_t *tables, const int32_t *table_starts, const int32_t *lengths,
                             const int32_t *rows, long n, long block_size, long heads, long kv_heads, long d,
                             long dv, float scale, void *out, long ldo, int out_bf16) {
    long most = 1;
    for (long s = 0; s < n; s++) most = lengths[s] > most ? lengths[s] : most;
    long *slots = malloc(sizeof(long) * most);
    float *S = malloc(sizeof(float) * heads * ((most + 15) & ~15L)), *O = malloc(sizeof(float) * heads * dv);
    if (!slots || !S || !O) {
        free(slots), free(S), free(O);
        return -1;
    }
    for (long s = 0; s < n; s++) {
        const int32_t *table = tables + table_starts[s];
        long L = lengths[s];
        for (long l = 0, b = 0; l < L; b++)  /* no division per position */
            for (long i = 0; i < block_size && l < L; i++) slots[l++] = (long)table[b] * block_size + i;
        void *o = out_bf16 ? (void *)((uint16_t *)out + rows[s] * ldo) : (void *)((float *)out + rows[s] * ldo);
        attend_one(Q + rows[s] * ldq, K, ldk, V, ldv, slots, L, heads, kv_heads, d, dv, scale, o, out_bf16, S, O);
    }
    free(slots), free(S), free(O);
    return 0;
}
