/* Integer kernels on GGUF weight blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), as llama.cpp stores them.

   Y[m, n] = sum_k W[n, k] X[m, k]. The weights stay in their blocks; the activations are quantised once
   per row to int8 blocks of 32 (scale dx = max|x| / 127, per block), and every 32 weights of a row are
   unpacked to 32 small unsigned integers q (0..15, 0..31, 0..63, or 0..255 for Q8_0 after an offset),
   whose products with the activation bytes are summed exactly in 32-bit integers, four at a time:
   AVX512-VNNI's vpdpbusd does it in one instruction, AVX2 in two (vpmaddubsw, vpmaddwd). The weight's
   scale, offset and minimum are applied per block in fp32.

   Both paths give the same bits. Per block the integer lanes are exact and the same in both (lane k
   sums the products of bytes 4k..4k+3); then, per lane, the float operations are the same ones in the
   same order: even blocks accumulate into one 8-lane accumulator, odd blocks into another (AVX-512
   holds the two as the halves of one register), and a row's result is their sum reduced by one fixed
   tree. A row's result depends on nothing but the row (not on M, not on its neighbours).

   Per block b of a weight row (scalars decoded from the row's headers, row_scales below):
     value of element i = ws(b, i < 16 ? 0 : 1) * (q_i - offset) + wm(b)
   so that  sum_i value_i x_i = dx_b * (sum_lanes ws * (L - offset * S) + wm * sum_lanes S)
   with L the lane sums of q_i * xq_i and S the lane sums of xq_i (precomputed per activation block).

   The library is compiled without ISA flags; each path carries its own target attribute, and the
   caller picks the path from the CPU's flags (hybridmoe/native/quant.py). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* ggml type ids (gguf.GGMLQuantizationType) */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* ---- scalar helpers, shared by both paths -------------------------------------------------------- */

static float fp16(const uint8_t *p) {  /* IEEE half at p (little-endian) -> float */
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j from the 12 packed bytes. */
static void scale_min_k4(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Bytes per block of `fmt` and its elements, 0 for an unknown format. */
static long block_bytes(int fmt) {
    switch (fmt) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    }
    return 0;
}

static long block_elems(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K ? 256 : 32; }

static int offset_of(int fmt) { return fmt == Q8_0 ? 128 : fmt == Q4_0 ? 8 : fmt == Q6_K ? 32 : 0; }

/* Per 32-element block b of one weight row of nb blocks: ws[2b], ws[2b+1] (scales of its two halves)
   and wm[b] (the value added to every element). */
static void row_scales(int fmt, const uint8_t *row, long nb, float *ws, float *wm) {
    if (fmt == Q8_0 || fmt == Q4_0 || fmt == Q4_1) {
        long bb = block_bytes(fmt);
        for (long b = 0; b < nb; b++) {
            const uint8_t *p = row + b * bb;
            ws[2 * b] = ws[2 * b + 1] = fp16(p);
            wm[b] = fmt == Q4_1 ? fp16(p + 2) : 0.0f;
        }
        return;
    }
    long bb = block_bytes(fmt);
    for (long s = 0; s < nb / 8; s++) {  /* super-blocks of 256: 8 blocks of 32 */
        const uint8_t *p = row + s * bb;
        for (int j = 0; j < 8; j++) {
            long b = s * 8 + j;
            if (fmt == Q6_K) {
                float d = fp16(p + 208);
                const int8_t *sc = (const int8_t *)(p + 192);
                ws[2 * b] = d * sc[2 * j];
                ws[2 * b + 1] = d * sc[2 * j + 1];
                wm[b] = 0.0f;
            } else {  /* Q4_K, Q5_K */
                int sc, m;
                scale_min_k4(j, p + 4, &sc, &m);
                ws[2 * b] = ws[2 * b + 1] = fp16(p) * (float)sc;
                wm[b] = -(fp16(p + 2) * (float)m);
            }
        }
    }
}

/* y = sum of 8 lanes of a + 8 lanes of b, by one fixed tree. */
static float reduce(const float *a, const float *b) {
    float v[8], h[4];
    for (int i = 0; i < 8; i++) v[i] = a[i] + b[i];
    for (int i = 0; i < 4; i++) h[i] = v[i] + v[i + 4];
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* ---- activations ------------------------------------------------------------------------------------ */

/* M rows of K values (fp32, or bf16 when x_bf16) -> per row: qs int8[K]; per block of 32: dx, the lane
   sums S[8] of its bytes (four consecutive bytes each) and Sf[8] = S * dx. K is a multiple of 32. */
void hm_q8_rows(const void *x, long ldx, int x_bf16, long M, long K, int8_t *qs, float *dx,
                int32_t *S, float *Sf) {
    long nb = K / 32;
    float v[32];
    for (long m = 0; m < M; m++) {
        for (long b = 0; b < nb; b++) {
            long base = m * ldx + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) {
                if (x_bf16) {
                    uint32_t bits = (uint32_t)((const uint16_t *)x)[base + i] << 16;
                    memcpy(&v[i], &bits, 4);
                } else {
                    v[i] = ((const float *)x)[base + i];
                }
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = qs + m * K + b * 32;
            long blk = m * nb + b;
            for (int i = 0; i < 32; i++) q[i] = (int8_t)lrintf(v[i] * id);
            dx[blk] = d;
            for (int k = 0; k < 8; k++) {
                S[blk * 8 + k] = q[4 * k] + q[4 * k + 1] + q[4 * k + 2] + q[4 * k + 3];
                Sf[blk * 8 + k] = (float)S[blk * 8 + k] * d;
            }
        }
    }
}

/* The same for K-quant weights (super-blocks of 256): one scale per 256 values, and the sums of each
   16 consecutive values (bsum[16] per super-block, int16), which carry the weights' minimums and
   offsets. `paired` stores each super-block's eight blocks of 32 in the order 0 2 1 3 4 6 5 7: the order
   in which one 64-byte load of Q4_K/Q5_K nibbles unpacks (groups g, g+1 -> low nibbles of both, then
   high nibbles of both). K is a multiple of 256. */
void hm_q8k_rows(const void *x, long ldx, int x_bf16, long M, long K, int paired, int8_t *qs, float *dx,
                 int16_t *bsum) {
    static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    long ns = K / 256;
    float v[256];
    int8_t q[256];
    for (long m = 0; m < M; m++) {
        for (long s = 0; s < ns; s++) {
            long base = m * ldx + s * 256;
            float amax = 0.0f;
            for (int i = 0; i < 256; i++) {
                if (x_bf16) {
                    uint32_t b = (uint32_t)((const uint16_t *)x)[base + i] << 16;
                    memcpy(&v[i], &b, 4);
                } else {
                    v[i] = ((const float *)x)[base + i];
                }
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < 256; i++) q[i] = (int8_t)lrintf(v[i] * id);
            dx[m * ns + s] = amax / 127.0f;
            for (int t = 0; t < 16; t++) {
                int sum = 0;
                for (int i = 0; i < 16; i++) sum += q[16 * t + i];
                bsum[(m * ns + s) * 16 + t] = (int16_t)sum;
            }
            int8_t *out = qs + m * K + s * 256;
            for (int j = 0; j < 8; j++) memcpy(out + 32 * j, q + 32 * (paired ? order[j] : j), 32);
        }
    }
}

/* ---- unpacking: the 32 q bytes of block b of a row (u8; for Q8_0 the raw int8 bytes) ------------ */

AVX2 ALWAYS_INLINE __m256i nibbles(__m128i x) {  /* 16 bytes -> low nibbles, then high nibbles */
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0F));
}

AVX2 ALWAYS_INLINE __m256i bits(__m256i x, int shift, int mask) {  /* (x >> shift) & mask, per byte */
    return _mm256_and_si256(_mm256_srli_epi16(x, shift), _mm256_set1_epi8((char)mask));
}

AVX2 ALWAYS_INLINE __m256i unpack(int fmt, const uint8_t *row, long b) {
    switch (fmt) {
    case Q8_0: return _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2));
    case Q4_0: return nibbles(_mm_loadu_si128((const __m128i *)(row + b * 18 + 2)));
    case Q4_1: return nibbles(_mm_loadu_si128((const __m128i *)(row + b * 20 + 4)));
    case Q4_K: {  /* block 2g: low nibbles of group g's 32 bytes, 2g+1: high nibbles */
        __m256i x = _mm256_loadu_si256((const __m256i *)(row + (b / 8) * 144 + 16 + ((b % 8) / 2) * 32));
        return bits(x, (b & 1) * 4, 0x0F);
    }
    case Q5_K: {  /* the same four bits, plus bit j of qh as the fifth */
        const uint8_t *p = row + (b / 8) * 176;
        int j = (int)(b % 8);
        __m256i x = _mm256_loadu_si256((const __m256i *)(p + 48 + (j / 2) * 32));
        __m256i h = _mm256_loadu_si256((const __m256i *)(p + 16));
        return _mm256_or_si256(bits(x, (j & 1) * 4, 0x0F), _mm256_slli_epi16(bits(h, j, 1), 4));
    }
    default: {  /* Q6_K: block 4h + r of half h: ql's low or high nibbles and two bits of qh */
        const uint8_t *p = row + (b / 8) * 210;
        int j = (int)(b % 8), h = j / 4, r = j % 4;
        __m256i l = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (r & 1)));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
        return _mm256_or_si256(bits(l, (r / 2) * 4, 0x0F), _mm256_slli_epi16(bits(hb, 2 * r, 3), 4));
    }
    }
}

/* ---- AVX2: one block (32 weights) per step -------------------------------------------------------- */

/* Exact lane sums L (8 x int32, lane k: bytes 4k..4k+3) of (w - offset) * x for block b. */
AVX2 ALWAYS_INLINE __m256i lanes_avx2(int fmt, __m256i q, __m256i x, const int32_t *S, int shift) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (fmt == Q8_0)  /* signed weights: |w| times x with w's sign, so that u8 x s8 pairs fit int16 */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), ones);
    __m256i L = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones);
    if (shift >= 0) L = _mm256_sub_epi32(L, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)S), shift));
    return L;
}

AVX2 static void dot_row_avx2(int fmt, const uint8_t *row, long nb, const float *ws, const float *wm,
                              const int8_t *qs, long K, const float *dx, const int32_t *S, const float *Sf,
                              long m0, int R, float *Y, long ldy, long n) {
    const int off = offset_of(fmt), shift = off ? __builtin_ctz(off) : -1;
    const int has_min = fmt == Q4_1 || fmt == Q4_K || fmt == Q5_K;
    __m256 acc[8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        __m256i q = unpack(fmt, row, b);
        __m256 w = _mm256_set_m128(_mm_set1_ps(ws[2 * b + 1]), _mm_set1_ps(ws[2 * b]));
        __m256 wmin = _mm256_set1_ps(wm[b]);
        for (int r = 0; r < R; r++) {
            long m = m0 + r, blk = m * nb + b;
            __m256i x = _mm256_loadu_si256((const __m256i *)(qs + m * K + b * 32));
            __m256i L = lanes_avx2(fmt, q, x, S + blk * 8, shift);
            __m256 *a = &acc[r][b & 1];
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(L), _mm256_mul_ps(w, _mm256_set1_ps(dx[blk])), *a);
            if (has_min) *a = _mm256_fmadd_ps(_mm256_loadu_ps(Sf + blk * 8), wmin, *a);
        }
    }
    float even[8], odd[8];
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(even, acc[r][0]);
        _mm256_storeu_ps(odd, acc[r][1]);
        Y[(m0 + r) * ldy + n] = reduce(even, odd);
    }
}

/* ---- AVX-512 VNNI: two blocks (64 weights) per register: even block low, odd block high -------- */

AVX512 static void dot_row_512(int fmt, const uint8_t *row, long nb, const float *ws, const float *wm,
                               const int8_t *qs, long K, const float *dx, const int32_t *S, const float *Sf,
                               long m0, int R, float *Y, long ldy, long n) {
    const int off = offset_of(fmt), shift = off ? __builtin_ctz(off) : -1;
    const int has_min = fmt == Q4_1 || fmt == Q4_K || fmt == Q5_K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    long b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(unpack(fmt, row, b)), unpack(fmt, row, b + 1), 1);
        if (fmt == Q8_0) q = _mm512_xor_si512(q, flip);  /* int8 w -> u8 w + 128, so offset 128 */
        __m512 w = _mm512_insertf32x8(
            _mm512_castps256_ps512(_mm256_set_m128(_mm_set1_ps(ws[2 * b + 1]), _mm_set1_ps(ws[2 * b]))),
            _mm256_set_m128(_mm_set1_ps(ws[2 * b + 3]), _mm_set1_ps(ws[2 * b + 2])), 1);
        __m512 wmin = _mm512_insertf32x8(_mm512_set1_ps(wm[b]), _mm256_set1_ps(wm[b + 1]), 1);
        for (int r = 0; r < R; r++) {
            long m = m0 + r, blk = m * nb + b;
            __m512i x = _mm512_loadu_si512((const void *)(qs + m * K + b * 32));
            __m512i L = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x);
            if (shift >= 0) L = _mm512_sub_epi32(L, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(S + blk * 8)), shift));
            __m512 d = _mm512_insertf32x8(_mm512_set1_ps(dx[blk]), _mm256_set1_ps(dx[blk + 1]), 1);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(L), _mm512_mul_ps(w, d), acc[r]);
            if (has_min) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(Sf + blk * 8), wmin, acc[r]);
        }
    }
    float lanes[16];
    for (int r = 0; r < R; r++) {
        long m = m0 + r;
        _mm512_storeu_ps(lanes, acc[r]);
        if (b < nb) {  /* an odd last block goes to the even lanes, as in the AVX2 path */
            long blk = m * nb + b;
            __m256i x = _mm256_loadu_si256((const __m256i *)(qs + m * K + b * 32));
            __m256i L = lanes_avx2(fmt, unpack(fmt, row, b), x, S + blk * 8, shift);
            __m256 w = _mm256_set_m128(_mm_set1_ps(ws[2 * b + 1]), _mm_set1_ps(ws[2 * b]));
            __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(L), _mm256_mul_ps(w, _mm256_set1_ps(dx[blk])),
                                       _mm256_loadu_ps(lanes));
            if (has_min) a = _mm256_fmadd_ps(_mm256_loadu_ps(Sf + blk * 8), _mm256_set1_ps(wm[b]), a);
            _mm256_storeu_ps(lanes, a);
        }
        Y[m * ldy + n] = reduce(lanes, lanes + 8);
    }
}

/* ---- K-quants: integer sub-block scales, one float multiply per super-block ---------------------- */

/* Q4_K/Q5_K's 12 scale bytes -> 8 scales (bytes 0..7) and 8 minimums (bytes 8..15), built in a register
   (not stored and reloaded: a 16-byte load of four 4-byte stores stalls on store forwarding). */
AVX2 ALWAYS_INLINE __m128i unpack_scales_k4(const uint8_t *p) {
    uint32_t u0, u1, u2;
    memcpy(&u0, p, 4);
    memcpy(&u1, p + 4, 4);
    memcpy(&u2, p + 8, 4);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    uint32_t s0 = u0 & k1, s1 = (u2 & k2) | (((u0 >> 6) & k3) << 4);
    uint32_t m0 = u1 & k1, m1 = ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4);
    return _mm_setr_epi32((int)s0, (int)s1, (int)m0, (int)m1);
}

/* Per super-block, both paths: the weight scale of each 16 values in the unpacked order, as words in
   two registers whose 128-bit lanes both hold 8 of them (lo: scales 0..7, hi: 8..15), so that one byte
   shuffle per lane picks any; mnw, 16 words that multiply the activation's bsum (natural order): the
   minimums, or the scales of the -32 offset; d and dm (y += d dx (scaled dot) + dm dx (mnw . bsum)). */
typedef struct {
    __m256i lo, hi, mnw;
    float d, dm;
} kscales;

AVX2 ALWAYS_INLINE kscales kscales_of(int fmt, const uint8_t *p) {
    kscales k;
    if (fmt == Q6_K) {
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
        k.lo = _mm256_permute2x128_si256(w, w, 0x00);
        k.hi = _mm256_permute2x128_si256(w, w, 0x11);
        k.mnw = w;
        k.d = _cvtsh_ss(*(const uint16_t *)(p + 208));
        k.dm = -32.0f * k.d;
        return k;
    }
    __m128i v = unpack_scales_k4(p + 4);  /* 8 scales, then 8 minimums */
    /* 16 words: each block's scale twice (its two 16-value halves), blocks in unpacked order 0 2 1 3 4 6 5 7 */
    __m256i w = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 0, 2, 2, 1, 1, 3, 3, 4, 4, 6, 6, 5, 5, 7, 7)));
    k.lo = _mm256_permute2x128_si256(w, w, 0x00);
    k.hi = _mm256_permute2x128_si256(w, w, 0x11);
    k.mnw = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
    __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)p));  /* d, dmin */
    k.d = _mm_cvtss_f32(dd);
    k.dm = -_mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 1));
    return k;
}

/* Shuffle masks: lane l of the result repeats word w_l of its own lane's 8 (w_0 for the low lane). */
#define WORD_MASK(w0, w1)                                                                                 \
    _mm256_setr_epi8(2 * (w0), 2 * (w0) + 1, 2 * (w0), 2 * (w0) + 1, 2 * (w0), 2 * (w0) + 1, 2 * (w0),   \
                     2 * (w0) + 1, 2 * (w0), 2 * (w0) + 1, 2 * (w0), 2 * (w0) + 1, 2 * (w0), 2 * (w0) + 1, \
                     2 * (w0), 2 * (w0) + 1, 2 * (w1), 2 * (w1) + 1, 2 * (w1), 2 * (w1) + 1, 2 * (w1),     \
                     2 * (w1) + 1, 2 * (w1), 2 * (w1) + 1, 2 * (w1), 2 * (w1) + 1, 2 * (w1), 2 * (w1) + 1, \
                     2 * (w1), 2 * (w1) + 1, 2 * (w1), 2 * (w1) + 1)

/* Words [scale 2i x 8 | scale 2i+1 x 8]: the scales of unpacked block i's two halves. */
AVX2 ALWAYS_INLINE __m256i half_scales(const kscales *k, int i) {
    __m256i src = i < 4 ? k->lo : k->hi;
    switch (i & 3) {
    case 0: return _mm256_shuffle_epi8(src, WORD_MASK(0, 1));
    case 1: return _mm256_shuffle_epi8(src, WORD_MASK(2, 3));
    case 2: return _mm256_shuffle_epi8(src, WORD_MASK(4, 5));
    default: return _mm256_shuffle_epi8(src, WORD_MASK(6, 7));
    }
}

/* The 4 x 64 unpacked q bytes of super-block p (Q4_K, Q5_K: block order 0 2 1 3 4 6 5 7; Q6_K: natural),
   as 32-byte halves: half[2i] | half[2i+1] is one 64-byte register's worth. */
AVX2 ALWAYS_INLINE void unpack_k(int fmt, const uint8_t *p, __m256i half[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (fmt == Q6_K) {
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
            for (int r = 0; r < 4; r++) {
                __m256i l = (r & 1) ? l1 : l0;
                __m256i lo = r < 2 ? _mm256_and_si256(l, m4) : bits(l, 4, 0x0F);
                half[4 * h + r] = _mm256_or_si256(lo, _mm256_slli_epi16(bits(qh, 2 * r, 3), 4));
            }
        }
        return;
    }
    const uint8_t *qs = p + (fmt == Q4_K ? 16 : 48);
    __m256i qh = fmt == Q5_K ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) {  /* group g: blocks 2g (low nibbles) and 2g+1 (high) */
        __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
        __m256i lo = _mm256_and_si256(x, m4), hi = bits(x, 4, 0x0F);
        if (fmt == Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(bits(qh, 2 * g, 1), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(bits(qh, 2 * g + 1, 1), 4));
        }
        half[(g / 2) * 4 + (g & 1)] = lo;  /* groups g, g+1 -> [lo g | lo g+1], [hi g | hi g+1] */
        half[(g / 2) * 4 + 2 + (g & 1)] = hi;
    }
}

/* y = reduce(acc_A, acc_B) + reduce(acc_C, 0): the fixed order both paths share. */
static float k_result(const float *a, const float *b, const float *c) {
    static const float zero[8];
    return reduce(a, b) + reduce(c, zero);
}

AVX2 ALWAYS_INLINE void dot_k_avx2_t(const int fmt, const int R, const uint8_t *row, long ns, const int8_t *qs,
                                     long K, const float *dx, const int16_t *bsum, long m0, float *Y, long ldy,
                                     long n) {
    const long bb = block_bytes(fmt);
    __m256 acc[8][3];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_ps();
    for (long s = 0; s < ns; s++) {
        const uint8_t *p = row + s * bb;
        __m256i q[8], sc[8];
        unpack_k(fmt, p, q);
        kscales k = kscales_of(fmt, p);
        for (int i = 0; i < 8; i++) sc[i] = half_scales(&k, i);
        for (int r = 0; r < R; r++) {
            long m = m0 + r, sb = m * ns + s;
            const int8_t *x = qs + m * K + s * 256;
            __m256i A = _mm256_setzero_si256(), B = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {  /* halves 0,1 of register i/2: A takes even, B odd */
                __m256i p16 = _mm256_maddubs_epi16(q[i], _mm256_loadu_si256((const __m256i *)(x + 32 * i)));
                __m256i p32 = _mm256_madd_epi16(sc[i], p16);
                if (i & 1) B = _mm256_add_epi32(B, p32); else A = _mm256_add_epi32(A, p32);
            }
            __m256i corr = _mm256_madd_epi16(k.mnw, _mm256_loadu_si256((const __m256i *)(bsum + sb * 16)));
            __m256 ddx = _mm256_set1_ps(k.d * dx[sb]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A), ddx, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(B), ddx, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(k.dm * dx[sb]), acc[r][2]);
        }
    }
    float a[8], b[8], c[8];
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(a, acc[r][0]);
        _mm256_storeu_ps(b, acc[r][1]);
        _mm256_storeu_ps(c, acc[r][2]);
        Y[(m0 + r) * ldy + n] = k_result(a, b, c);
    }
}

AVX512 ALWAYS_INLINE void dot_k_512_t(const int fmt, const int R, const uint8_t *row, long ns, const int8_t *qs,
                                      long K, const float *dx, const int16_t *bsum, long m0, float *Y, long ldy,
                                      long n) {
    const long bb = block_bytes(fmt);
    __m512 acc[8];
    __m256 accm[8];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    for (long s = 0; s < ns; s++) {
        const uint8_t *p = row + s * bb;
        __m256i half[8];
        unpack_k(fmt, p, half);
        kscales k = kscales_of(fmt, p);
        __m512i q[4], sc[4];
        for (int i = 0; i < 4; i++) {
            q[i] = _mm512_inserti64x4(_mm512_castsi256_si512(half[2 * i]), half[2 * i + 1], 1);
            sc[i] = _mm512_inserti64x4(_mm512_castsi256_si512(half_scales(&k, 2 * i)), half_scales(&k, 2 * i + 1), 1);
        }
        for (int r = 0; r < R; r++) {
            long m = m0 + r, sb = m * ns + s;
            const int8_t *x = qs + m * K + s * 256;
            __m512i A = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                __m512i p16 = _mm512_maddubs_epi16(q[i], _mm512_loadu_si512((const void *)(x + 64 * i)));
                A = _mm512_add_epi32(A, _mm512_madd_epi16(sc[i], p16));
            }
            __m256i corr = _mm256_madd_epi16(k.mnw, _mm256_loadu_si256((const __m256i *)(bsum + sb * 16)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), _mm512_set1_ps(k.d * dx[sb]), acc[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(k.dm * dx[sb]), accm[r]);
        }
    }
    float lanes[16], c[8];
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(lanes, acc[r]);
        _mm256_storeu_ps(c, accm[r]);
        Y[(m0 + r) * ldy + n] = k_result(lanes, lanes + 8, c);
    }
}

/* One function per (path, format), the row count R a constant in each case of its switch. */
#define R_CASES(T, F)                                                                                    \
    switch (R) {                                                                                         \
    case 1: T(F, 1, row, ns, qs, K, dx, bsum, m0, Y, ldy, n); break;                                     \
    case 2: T(F, 2, row, ns, qs, K, dx, bsum, m0, Y, ldy, n); break;                                     \
    case 3: T(F, 3, row, ns, qs, K, dx, bsum, m0, Y, ldy, n); break;                                     \
    case 4: T(F, 4, row, ns, qs, K, dx, bsum, m0, Y, ldy, n); break;                                     \
    case 5: T(F, 5, row, ns, qs, K, dx, bsum, m0, Y, ldy, n); break;                                     \
    case 6: T(F, 6, row, ns, qs, K, dx, bsum, m0, Y, ldy, n); break;                                     \
    case 7: T(F, 7, row, ns, qs, K, dx, bsum, m0, Y, ldy, n); break;                                     \
    default: T(F, 8, row, ns, qs, K, dx, bsum, m0, Y, ldy, n); break;                                    \
    }
#define K_PATHS(F)                                                                                       \
    AVX2 static void dot_k_avx2_##F(const uint8_t *row, long ns, const int8_t *qs, long K, const float *dx, \
                                    const int16_t *bsum, long m0, int R, float *Y, long ldy, long n) {   \
        R_CASES(dot_k_avx2_t, F)                                                                         \
    }                                                                                                    \
    AVX512 static void dot_k_512_##F(const uint8_t *row, long ns, const int8_t *qs, long K, const float *dx, \
                                     const int16_t *bsum, long m0, int R, float *Y, long ldy, long n) {  \
        R_CASES(dot_k_512_t, F)                                                                          \
    }
K_PATHS(Q4_K)
K_PATHS(Q5_K)
K_PATHS(Q6_K)

typedef void (*dot_k_fn)(const uint8_t *, long, const int8_t *, long, const float *, const int16_t *, long, int,
                         float *, long, long);

/* Y[m, n] = sum_k W[n, k] X[m, k] for K-quant weights and activations from hm_q8k_rows (paired for
   Q4_K and Q5_K, natural for Q6_K). */
int hm_qgemm_k(int fmt, const uint8_t *W, long ldw, long N, long K, const int8_t *qs, const float *dx,
               const int16_t *bsum, long M, float *Y, long ldy, int isa) {
    dot_k_fn dot;
    switch (fmt) {
    case Q4_K: dot = isa == 2 ? dot_k_512_Q4_K : dot_k_avx2_Q4_K; break;
    case Q5_K: dot = isa == 2 ? dot_k_512_Q5_K : dot_k_avx2_Q5_K; break;
    case Q6_K: dot = isa == 2 ? dot_k_512_Q6_K : dot_k_avx2_Q6_K; break;
    default: return -1;
    }
    if (K % 256) return -1;
    long ns = K / 256;
    for (long n = 0; n < N; n++)
        for (long m = 0; m < M; m += 8)
            dot(W + n * ldw, ns, qs, K, dx, bsum, m, (int)(M - m < 8 ? M - m : 8), Y, ldy, n);
    return 0;
}

/* ---- entry points ---------------------------------------------------------------------------------- */

/* Which path: 2 = AVX-512 VNNI, 1 = AVX2 (the caller checks the CPU has it). */
typedef void (*dot_fn)(int, const uint8_t *, long, const float *, const float *, const int8_t *, long,
                       const float *, const int32_t *, const float *, long, int, float *, long, long);

/* Y[m, n] for n < N, m < M: weight rows of `fmt` (ldw bytes apart), activations from hm_q8_rows.
   Returns 0, or -1 for an unknown format or a K that is not a multiple of its block. */
int hm_qgemm(int fmt, const uint8_t *W, long ldw, long N, long K, const int8_t *qs, const float *dx,
             const int32_t *S, const float *Sf, long M, float *Y, long ldy, int isa) {
    if (!block_bytes(fmt) || K % block_elems(fmt)) return -1;
    long nb = K / 32;
    float *ws = malloc(sizeof(float) * 3 * nb);
    if (!ws) return -2;
    float *wm = ws + 2 * nb;
    dot_fn dot = isa == 2 ? dot_row_512 : dot_row_avx2;
    for (long n = 0; n < N; n++) {
        const uint8_t *row = W + n * ldw;
        row_scales(fmt, row, nb, ws, wm);
        for (long m = 0; m < M; m += 8)
            dot(fmt, row, nb, ws, wm, qs, K, dx, S, Sf, m, (int)(M - m < 8 ? M - m : 8), Y, ldy, n);
    }
    free(ws);
    return 0;
}

/* ---- one call from Python: activations quantised for the weight's format, then the product -------- */

typedef struct {
    int8_t *qs;
    float *dx, *Sf;
    int32_t *S;
    int16_t *bsum;
    void *mem;
} acts;

static int is_k(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K; }

/* Quantise M rows of x (K values each) as `fmt`'s kernel reads them; 0, or -2 without memory. */
static int acts_of(acts *a, int fmt, const void *x, long ldx, int x_bf16, long M, long K) {
    long nb = K / 32, ns = K / 256;
    size_t q = (size_t)(M * K), per = is_k(fmt) ? (size_t)(M * ns) * (4 + 32) : (size_t)(M * nb) * (4 + 64);
    a->mem = malloc(q + per + 64);
    if (!a->mem) return -2;
    char *p = a->mem;
    a->qs = (int8_t *)p;
    p += (q + 63) & ~(size_t)63;
    if (is_k(fmt)) {
        a->dx = (float *)p;
        a->bsum = (int16_t *)(p + 4 * M * ns);
        hm_q8k_rows(x, ldx, x_bf16, M, K, fmt != Q6_K, a->qs, a->dx, a->bsum);
    } else {
        a->dx = (float *)p;
        a->S = (int32_t *)(p + 4 * M * nb);
        a->Sf = (float *)(p + 4 * M * nb + 32 * M * nb);
        hm_q8_rows(x, ldx, x_bf16, M, K, a->qs, a->dx, a->S, a->Sf);
    }
    return 0;
}

static int gemm_acts(int fmt, const uint8_t *W, long ldw, long N, long K, const acts *a, long M, float *Y,
                     long ldy, int isa) {
    if (is_k(fmt)) return hm_qgemm_k(fmt, W, ldw, N, K, a->qs, a->dx, a->bsum, M, Y, ldy, isa);
    return hm_qgemm(fmt, W, ldw, N, K, a->qs, a->dx, a->S, a->Sf, M, Y, ldy, isa);
}

/* Y [M, N] fp32 = X [M, K] (fp32, or bf16 when x_bf16) times W [N, K]^T in `fmt` blocks. */
int hm_qlinear(int fmt, const uint8_t *W, long ldw, long N, long K, const void *x, long ldx, int x_bf16,
               long M, float *Y, long ldy, int isa) {
    if (!block_bytes(fmt) || K % block_elems(fmt)) return -1;
    acts a;
    if (acts_of(&a, fmt, x, ldx, x_bf16, M, K)) return -2;
    int status = gemm_acts(fmt, W, ldw, N, K, &a, M, Y, ldy, isa);
    free(a.mem);
    return status;
}

/* M tokens through one SwiGLU expert: gate_up [2I, H] (rows 0..I-1 gate, I..2I-1 up) in fmt_gu, down
   [H, I] in fmt_d. Y [M, H] fp32 = down (silu(gate x) * up x); the product h is quantised once. */
int hm_qexpert(int fmt_gu, const uint8_t *gate_up, long ldgu, int fmt_d, const uint8_t *down, long ldd, long H,
               long I, const void *x, long ldx, int x_bf16, long M, float *Y, long ldy, int isa) {
    float *gu = malloc(sizeof(float) * (size_t)(M * 2 * I));
    if (!gu) return -2;
    int status = hm_qlinear(fmt_gu, gate_up, ldgu, 2 * I, H, x, ldx, x_bf16, M, gu, 2 * I, isa);
    for (long m = 0; status == 0 && m < M; m++) {
        float *g = gu + m * 2 * I, *u = g + I;
        for (long i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];  /* h in the gate's place */
    }
    if (status == 0) status = hm_qlinear(fmt_d, down, ldd, H, I, gu, 2 * I, 0, M, Y, ldy, isa);
    free(gu);
    return status;
}

/* ---- quantisers: rows of fp32 values to blocks (for --quant at load and for writing GGUF files) ---- */

AVX2 static void put_fp16(uint8_t *p, float f) {
    uint16_t h = (uint16_t)_cvtss_sh(f, 0);  /* round to nearest even */
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

AVX2 static float nearest_fp16(float f) { return _cvtsh_ss(_cvtss_sh(f, 0)); }

AVX2 static void quantize_q8_0(const float *x, uint8_t *out, long nb) {
    for (long b = 0; b < nb; b++, x += 32, out += 34) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;  /* as llama.cpp: id before fp16 */
        put_fp16(out, d);
        for (int i = 0; i < 32; i++) out[2 + i] = (uint8_t)(int8_t)roundf(x[i] * id);
    }
}

AVX2 static void quantize_q4_0(const float *x, uint8_t *out, long nb) {
    for (long b = 0; b < nb; b++, x += 32, out += 18) {
        float amax = 0.0f, vmax = 0.0f;  /* the signed value of largest magnitude maps to -8 */
        for (int i = 0; i < 32; i++)
            if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); vmax = x[i]; }
        float d = vmax / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;  /* as llama.cpp's reference */
        put_fp16(out, d);
        for (int i = 0; i < 16; i++) {
            int lo = (int)(int8_t)(x[i] * id + 8.5f), hi = (int)(int8_t)(x[i + 16] * id + 8.5f);
            out[2 + i] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
        }
    }
}

/* Q4_K: per block of 32, scale (max - min) / 15 and minimum (at most 0); the 8 scales and minimums to
   6 bits against the super-block's d and dmin. A plain rounding fit: llama.cpp's searches for a better
   one (its files decode the same way). */
AVX2 static void quantize_q4_k(const float *x, uint8_t *out, long ns) {
    for (long s = 0; s < ns; s++, x += 256, out += 144) {
        float scale[8], mn[8], smax = 0.0f, mmax = 0.0f;
        for (int j = 0; j < 8; j++) {
            float lo = 0.0f, hi = -INFINITY;
            for (int i = 0; i < 32; i++) {
                lo = fminf(lo, x[32 * j + i]);
                hi = fmaxf(hi, x[32 * j + i]);
            }
            scale[j] = (hi - lo) / 15.0f;
            mn[j] = -lo;
            smax = fmaxf(smax, scale[j]);
            mmax = fmaxf(mmax, mn[j]);
        }
        float d = nearest_fp16(smax / 63.0f), dmin = nearest_fp16(mmax / 63.0f);
        int sc[8], m[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = d > 0.0f ? (int)fminf(63.0f, rintf(scale[j] / d)) : 0;
            m[j] = dmin > 0.0f ? (int)fminf(63.0f, rintf(mn[j] / dmin)) : 0;
        }
        put_fp16(out, d);
        put_fp16(out + 2, dmin);
        uint8_t *p = out + 4;
        for (int j = 0; j < 4; j++) {
            p[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
            p[j + 4] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
            p[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4);
        }
        uint8_t q[256];
        for (int j = 0; j < 8; j++) {
            float ds = d * (float)sc[j], dm = dmin * (float)m[j], id = ds > 0.0f ? 1.0f / ds : 0.0f;
            for (int i = 0; i < 32; i++)
                q[32 * j + i] = (uint8_t)fminf(15.0f, fmaxf(0.0f, rintf((x[32 * j + i] + dm) * id)));
        }
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) out[16 + 32 * g + l] = (uint8_t)(q[64 * g + l] | q[64 * g + 32 + l] << 4);
    }
}

/* Q6_K: per 16 values a scale max|x| / 32 (q - 32 in -32..31), the 16 scales to int8 against d. */
AVX2 static void quantize_q6_k(const float *x, uint8_t *out, long ns) {
    for (long s = 0; s < ns; s++, x += 256, out += 210) {
        float scale[16], smax = 0.0f, vmax = 0.0f;
        for (int t = 0; t < 16; t++) {
            float amax = 0.0f, v = 0.0f;
            for (int i = 0; i < 16; i++)
                if (fabsf(x[16 * t + i]) > amax) { amax = fabsf(x[16 * t + i]); v = x[16 * t + i]; }
            scale[t] = v / -32.0f;  /* the value of largest magnitude maps to -32 */
            if (fabsf(scale[t]) > smax) { smax = fabsf(scale[t]); vmax = scale[t]; }
        }
        float d = nearest_fp16(vmax / -127.0f), id = d != 0.0f ? 1.0f / d : 0.0f;
        int8_t sc[16];
        for (int t = 0; t < 16; t++) sc[t] = (int8_t)fminf(127.0f, fmaxf(-127.0f, rintf(scale[t] * id)));
        uint8_t q[256];
        for (int t = 0; t < 16; t++) {
            float ds = d * (float)sc[t], inv = ds != 0.0f ? 1.0f / ds : 0.0f;
            for (int i = 0; i < 16; i++)
                q[16 * t + i] = (uint8_t)fminf(63.0f, fmaxf(0.0f, rintf(x[16 * t + i] * inv) + 32.0f));
        }
        uint8_t *ql = out, *qh = out + 128;
        memset(qh, 0, 64);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *v = q + 128 * h;
                ql[64 * h + l] = (uint8_t)((v[l] & 0xF) | (v[l + 64] & 0xF) << 4);
                ql[64 * h + 32 + l] = (uint8_t)((v[l + 32] & 0xF) | (v[l + 96] & 0xF) << 4);
                qh[32 * h + l] = (uint8_t)((v[l] >> 4) | (v[l + 32] >> 4) << 2 | (v[l + 64] >> 4) << 4 | (v[l + 96] >> 4) << 6);
            }
        memcpy(out + 192, sc, 16);
        put_fp16(out + 208, d);
    }
}

/* N rows of K fp32 values -> N rows of `fmt` blocks (row stride: K / block_elems * block_bytes).
   Returns 0, or -1 for a format without a quantiser or a K not a multiple of its block. */
AVX2 int hm_quantize(int fmt, const float *x, long N, long K, uint8_t *out) {
    if (!block_bytes(fmt) || K % block_elems(fmt)) return -1;
    long per_row = K / block_elems(fmt), row_bytes = per_row * block_bytes(fmt);
    for (long n = 0; n < N; n++) {
        const float *r = x + n * K;
        uint8_t *o = out + n * row_bytes;
        switch (fmt) {
        case Q8_0: quantize_q8_0(r, o, per_row); break;
        case Q4_0: quantize_q4_0(r, o, per_row); break;
        case Q4_K: quantize_q4_k(r, o, per_row); break;
        case Q6_K: quantize_q6_k(r, o, per_row); break;
        default: return -1;
        }
    }
    return 0;
}
