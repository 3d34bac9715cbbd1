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
#ifdef AVX2_512
#include "avx2_512.h" /* the AVX-512 operations below on AVX2 and FMA */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mix.h"
#include "pool.h"
#include "rows.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define FTZ_DAZ 0x8040u
#define RC_BITS 0x6000u /* MXCSR's rounding control, cleared: to nearest even, as vdpbf16ps rounds */
/* MXCSR set for the fma pairs (DAZ, FTZ, to nearest even); returns what it was, to be set back. */
static inline unsigned pairs_mode(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr((csr & ~RC_BITS) | FTZ_DAZ);
    return csr;
}

/* ---- The two AVX512-BF16 instructions the kernels use, or their definitions in AVX512F ----

   Built for a CPU with AVX512-BF16 (Intel's Cooper Lake, Sapphire Rapids and later, AMD's Zen 4), the
   kernels use vdpbf16ps and vcvtneps2bf16. Built with -DEMULATE_BF16 (native/bf16.py: AVX-512 CPUs without
   it, Intel's Skylake-SP, Cascade Lake and Ice Lake), each is written out as Intel's manual defines it, so
   that both builds give the same bits (tests/test_bf16_isa.py compares them on every kind of value):
   - dpbf16(acc, a, b): acc plus the odd bf16 products, then plus the even ones, each product exact in fp32
     and rounded once (an fma of the values widened, which is exact), subnormal inputs and results taken as
     zero, rounding to nearest even: vdpbf16ps reads no MXCSR, the fma pairs need pairs_mode set, which the
     loops around them set and restore (DP_BEGIN, DP_END; nothing in the native build), so that the floats
     around those loops keep the caller's mode in both builds;
   - cvtne(x): fp32 to bf16 rounded to nearest even, NaN made quiet, zero and subnormal values to a zero of
     their sign. */
#ifdef EMULATE_BF16
#define EMULATED 1
typedef __m512i bh512;
#define BH(x) (x) /* a vector's bits as bh512: they are one already */
ALWAYS_INLINE __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}
ALWAYS_INLINE __m256i cvtne(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7f800000)),
                              _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(0x00800000)),
                              _mm512_and_si512(hi, _mm512_set1_epi32(0x8000)));
    return _mm512_cvtepi32_epi16(r);
}
#define DP_BEGIN const unsigned dp_csr_ = pairs_mode();
#define DP_END _mm_setcsr(dp_csr_);
#else
#define EMULATED 0
typedef __m512bh bh512;
#define BH(x) ((bh512)(x))
#define dpbf16(acc, a, b) _mm512_dpbf16_ps(acc, a, b)
#define cvtne(x) ((__m256i)_mm512_cvtneps_pbh(x))
#define DP_BEGIN
#define DP_END
#endif

/* exp(x) in fp32 for x <= 104 (the softmax's x <= 0, silu_mul_row's -g): x = n ln2 + r, e^r by Cephes'
   expf polynomial (relative error ~2e-7), times 2^n by vscalefps (0 far below, inf far above). */
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

/* h[0..n) = bf16(silu(g) u) for the fp32 rows g, u of an expert's gate and up: silu(g) = g / (1 + e^-g)
   with exp512, 16 at a time and the row's tail masked, so that each element takes the same
   arithmetic wherever it lies (the demo's prefill spent ~0.15 ms an expert of 256 tokens in libm's
   expf, one element at a time); rounded to nearest even as bf16() rounds, NaN staying NaN. */
ALWAYS_INLINE void silu_mul_row(const float *g, const float *u, uint16_t *h, long n) {
    for (long i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + i), uv = _mm512_maskz_loadu_ps(k, u + i);
        /* e^-g, -g at most 104 (e^104 is past fp32's largest: vscalefps gives inf, and silu -0) */
        const __m512 mg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(104.0f));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(mg)));
        const __m512i y = _mm512_castps_si512(_mm512_mul_ps(s, uv)), hi = _mm512_srli_epi32(y, 16);
        const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(y, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        const __m512i mag = _mm512_and_si512(y, _mm512_set1_epi32(0x7fffffff));
        const __mmask16 nan = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16(h + i, k, _mm512_cvtepi32_epi16(r));
    }
}

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

/* Where a product's rows go when they leave as bf16 (F.linear's output): Y[m, o] = bf16(sum + bias[o]),
   the sum in fp32 plus the bf16 bias widened (exactly) to fp32, then rounded once, as torch's fp32
   product, `y += bias.float()` and `.to(torch.bfloat16)` do. */
typedef struct {
    uint16_t *Y;
    long ldy;
    const uint16_t *bias; /* [O] bf16, or NULL */
} out_bf16;

/* Four sums s (c of them real) leave as bf16(s + bias), rounded to nearest even as bf16() rounds (NaN
   stays NaN), in SIMD: a prefill's products are compute-bound, and a scalar loop here cost a third
   of their time. */
ALWAYS_INLINE void store_bf16(const out_bf16 *B, __m128 s, long m, long o, long c) {
    const __mmask8 k = (__mmask8)((1u << c) - 1);
    if (B->bias) { /* bf16 -> fp32 is the bits shifted up: exact */
        __m128i b = _mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(k, B->bias + o));
        s = _mm_add_ps(s, _mm_castsi128_ps(_mm_slli_epi32(b, 16)));
    }
    const __m128i u = _mm_castps_si128(s), hi = _mm_srli_epi32(u, 16);
    __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(_mm_and_si128(hi, _mm_set1_epi32(1)),
                                                              _mm_set1_epi32(0x7fff))), 16);
    const __mmask8 nan = _mm_cmpgt_epi32_mask(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    r = _mm_mask_mov_epi32(r, nan, _mm_or_si128(hi, _mm_set1_epi32(0x40)));
    _mm_mask_storeu_epi16(B->Y + m * B->ldy + o, k, _mm_cvtepi32_epi16(r));
}

/* out[0..n) = cvtne(x[0..n)): the rounding the attention's bf16 outputs take, for tests to hold each build's
   against the other and against Intel's definition on every kind of value. */
void hm_round_bf16(const float *x, long n, uint16_t *out) {
    for (long i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(out + i, m, cvtne(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

/* acc[r][j] += W[o + j, i..i+32) . X[m + r, i..i+32) for one chunk of 32 columns (k: the columns that
   exist, for the row's tail). */
#define CHUNK(J, LOAD_W, LOAD_X)                                                               \
    do {                                                                                       \
        bh512 wv = BH(LOAD_W);                                                                 \
        for (int r = 0; r < R; r++) acc[r][J] = dpbf16(acc[r][J], wv, BH(LOAD_X));             \
    } while (0)

/* acc[r][j] += W[o + j, i..i+32) . X[m + r, i..i+32) for every r < R and j < 4 as CHUNK gives it, with
   two fma a pair instead of one vdpbf16ps: vdpbf16ps adds the odd bf16 products, then the even ones,
   each exact in fp32 and rounded once (an fma of the widened values), inputs and results that are
   subnormal taken as zero (MXCSR's DAZ and FTZ, which the caller sets: pairs_mode). On this Intel core
   vdpbf16ps issues once in two cycles and zmm fma on two ports each cycle, so for several x rows, where
   the products and not the stream bound the time, 16 vdpbf16ps (32 cycles) become 32 fma and 16
   widenings (24). Tested bit for bit against vdpbf16ps on every kind of bf16 value (tests/test_native.py). */

/* Whether products of several rows take the fma pairs: on where hm_fma_pairs_check found them giving this
   CPU's vdpbf16ps bits (Intel's definition of it; another CPU's could differ) and they beat it (Intel's
   cores, not AMD's: native/bf16.py FMA_PAIRS_PAY sets it), else vdpbf16ps (CHUNK). */
static int fma_pairs;

/* vdpbf16ps against the fma pairs on vectors that tell them apart (ordinary values, tiny exponents that
   need DAZ and FTZ, arbitrary bits): 1 where every lane of every sum agrees (NaN with NaN). Sets the flag.
   Built without the instruction (EMULATE_BF16), the fma pairs are its definition: 1. */
#if EMULATED
int hm_fma_pairs_check(void) { return fma_pairs = 1; }
#else
__attribute__((target("avx512f,avx512bf16,avx512bw"))) int hm_fma_pairs_check(void) {
    uint32_t seed = 12345u;
    int same = 1;
    const unsigned csr = pairs_mode(); /* vdpbf16ps does not read MXCSR */
    for (int trial = 0; trial < 64 && same; trial++) {
        __m512 acc = _mm512_setzero_ps(), e = _mm512_setzero_ps();
        for (int k = 0; k < 64; k++) {
            uint16_t a[32], b[32];
            for (int i = 0; i < 32; i++) {
                seed = seed * 1664525u + 1013904223u;
                const uint32_t r = seed >> 8;
                const int kind = trial % 3;
                const uint16_t exp_a = kind == 1 ? (uint16_t)(r % 12) : (uint16_t)(110 + r % 34);
                const uint16_t exp_b = kind == 1 ? (uint16_t)(115 + (r >> 5) % 20) : (uint16_t)(110 + (r >> 5) % 34);
                a[i] = kind == 2 ? (uint16_t)r : (uint16_t)((r & 0x807F) | (exp_a << 7));
                b[i] = kind == 2 ? (uint16_t)(r >> 3) : (uint16_t)(((r >> 9) & 0x807F) | (exp_b << 7));
            }
            const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b), hi = _mm512_set1_epi32((int)0xFFFF0000);
            acc = _mm512_dpbf16_ps(acc, (bh512)va, (bh512)vb);
            e = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(va, hi)),
                                _mm512_castsi512_ps(_mm512_and_si512(vb, hi)), e);
            e = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(va, 16)),
                                _mm512_castsi512_ps(_mm512_slli_epi32(vb, 16)), e);
        }
        const __mmask16 nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q);
        const __mmask16 eq = _mm512_cmpeq_epi32_mask(_mm512_castps_si512(acc), _mm512_castps_si512(e));
        same = (__mmask16)(eq | nan) == (__mmask16)0xFFFF;
    }
    _mm_setcsr(csr);
    fma_pairs = same;
    return same;
}
#endif

/* The fma pairs on (1) where hm_fma_pairs_check passed, or off (0: vdpbf16ps for every row count). */
void hm_set_fma_pairs(int on) { fma_pairs = on; }

#define PAIRS(LOAD_W, LOAD_X)                                                                     \
    do {                                                                                          \
        const __m512i hi_ = _mm512_set1_epi32((int)0xFFFF0000);                                   \
        __m512 wo[4], we[4];                                                                      \
        for (int j = 0; j < 4; j++) {                                                             \
            const __m512i v_ = LOAD_W;                                                            \
            wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v_, hi_));                               \
            we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v_, 16));                               \
        }                                                                                         \
        for (int r = 0; r < R; r++) {                                                             \
            const __m512i v_ = LOAD_X;                                                            \
            const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(v_, hi_));                     \
            const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(v_, 16));                     \
            for (int j = 0; j < 4; j++)                                                           \
                acc[r][j] = _mm512_fmadd_ps(we[j], xe, _mm512_fmadd_ps(wo[j], xo, acc[r][j]));    \
        }                                                                                         \
    } while (0)

/* One chunk of several x rows: the fma pairs where they are on (pairs_mode set), else vdpbf16ps. */
#define SEVERAL(LOAD_W, LOAD_X)                                                                   \
    do {                                                                                          \
        if (fma_pairs)                                                                            \
            PAIRS(LOAD_W, LOAD_X);                                                                \
        else                                                                                      \
            for (int j = 0; j < 4; j++) CHUNK(j, LOAD_W, LOAD_X);                                 \
    } while (0)

/* How far ahead (bytes) a one-row product asks for its weights as non-temporal (prefetchnta): a decode
   step streams hundreds of MB of weights once each, and through the caches as plain loads they evicted
   everything else from L3, so the Python and torch steps between two kernels ran on cold caches (a
   router's softmax and top-k took ~170 us after a kernel against ~15 us warm, ~40 us with this). 256
   and 512 bytes ahead measured alike, 1 KB and more slower (docs/notes/2026-11-25-decode-two-threads.md).
   That was on AMD's Zen 4. On an Intel core (a Sapphire Rapids-class VM) the same prefetch held the product
   to 8.2 GB/s from RAM, and asking for the lines 512 bytes ahead into L1 and 4 KB ahead into L2 read 12.8
   (14.7 -> 23.3 GB/s at two threads; docs/notes/2026-12-06-one-token-streams.md), and so did AMD's Zen 5
   (an EPYC VM: 4096 x 576 from RAM 21 -> 30 GB/s, the demo's decode +35% at one thread;
   docs/notes/2026-12-07-bf16-emulated.md): the library is built for one or the other by the CPU's vendor
   and family (native/bf16.py, WEIGHTS_NTA). */
#define NTA_AHEAD 512
#define FAR_AHEAD 4096
#ifndef WEIGHTS_NTA
#define WEIGHTS_NTA 1
#endif
/* How the lines FAR_AHEAD are asked for where WEIGHTS_NTA is 0: into L2 (_MM_HINT_T1), or as non-temporal
   on AMD's Zen 5 (_MM_HINT_NTA: native/build.py, far_hint_flag). There the products read as fast (4096 x 2048
   from RAM, 1 thread, 36.2 -> 37.0 GB/s; 768 x 2048 35.3 -> 34.4) and the decode step's Python finds more
   of its lines in the caches: the demo's decode 8.25 -> 7.95 ms a token at one thread, 7.4 -> 6.5 at two
   (alternating; docs/notes/2026-12-07-attention-prefetch.md; quant.c FAR_HINT likewise). */
#ifndef FAR_HINT
#define FAR_HINT _MM_HINT_T1
#endif

/* Y[m + r, o + j] = sum_i W[o + j, i] X[m + r, i] for r < R, j < c (c <= 4 weight rows left).
   One x row (decode of one sequence: the weights stream from RAM and nothing else counts) reads the
   four weight rows one after the other, each whole: read side by side (four streams a row apart)
   they came from RAM at half the rate on Zen 4 (docs/notes/2026-11-24-gemv-streams.md). Several x
   rows (decode batches, prefill chunks of a few tokens per expert) read the four rows side by side,
   so each weight chunk loaded serves 4R products (the row-by-row order loads x R times as often,
   which made those products ~25% slower), and the first group of x rows asks for the next four
   rows' lines ahead in address order, which restores most of the streaming rate (the later groups
   find the rows in L1; asking again cost a prefill ~10%); on an Intel core (WEIGHTS_NTA 0) it also
   asks for the four rows after those into L2: a 2048x768 SwiGLU expert from RAM, one thread, 2 / 4 / 8
   rows read at 13.1 / 11.1 / 7.5 GB/s against 11.3 / 10.2 / 7.1 without (a Sapphire Rapids-class VM;
   from 8 rows the products are bound by vdpbf16ps, not the stream). Every accumulator sums the same chunks in the
   same order either way, so a row's result does not depend on the batch it came in. Missing weight
   rows (j >= c) re-read row o and are not stored. */
/* Rows m .. m+R-1, columns o .. o+c-1 of Y (or of B's bf16 rows) from their accumulators: each the sum of its
   16 lanes (hsum4's tree). */
ALWAYS_INLINE void store_rows(__m512 acc[4][4], const int R, long m, long o, long c, float *Y, long ldy,
                              const out_bf16 *B) {
    for (int r = 0; r < R; r++) {
        __m128 s = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
        if (B) {
            store_bf16(B, s, m + r, o, c);
            continue;
        }
        _mm_mask_storeu_ps(Y + (m + r) * ldy + o, (__mmask8)((1u << c) - 1), s);
    }
}

#ifdef AVX2_512
/* Several x rows of block() on AVX2 (rows r0 .. r0+n-1, n <= 2), one 256-bit half of every accumulator at a
   time: lane l of a 512-bit accumulator sums bf16 elements 2l and 2l+1 of every chunk, so half h holds the
   16 elements from 16 h of each chunk, and summing it over the chunks in their order gives the 512-bit
   loop's bits. Two rows and one half take 8 accumulators, the x rows' widened halves 4 and a weight's 2:
   AVX2's 16 registers, which 16 accumulators of two halves each (block()'s R = 4) overflowed: the AVX2
   build's products of several rows ran from the stack. `next`: the next block's lines to ask for, or NULL. */
ALWAYS_INLINE __m256i half_of(hm512i v, int h) { return h ? v.hi : v.lo; }
/* Half h of the accumulators of rows r0 .. r0+n-1 from their 256-bit sums a. */
ALWAYS_INLINE void put_half(__m512 acc[4][4], int r0, const int n, int h, __m256 a[2][4]) {
    for (int r = 0; r < n; r++)
        for (int j = 0; j < 4; j++) *(h ? &acc[r0 + r][j].hi : &acc[r0 + r][j].lo) = a[r][j];
}
ALWAYS_INLINE void rows_avx2(const uint16_t *const w[4], const uint16_t *const x[4], int r0, const int n, long I,
                             const char *next, __m512 acc[4][4]) {
    const long tail = I % 32, end = I - tail;
    const __mmask32 k = (__mmask32)((1ULL << tail) - 1);
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000);
    for (int h = 0; h < 2; h++) {
        __m256 a[2][4];
        for (int r = 0; r < 2; r++)
            for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
        for (long i = 0; i < I; i += 32) {
            if (next && h == 0)
                for (int b = 0; b < 256; b += 64) _mm_prefetch(next + 8 * i + b, _MM_HINT_T0);
            __m256 xo[2], xe[2];
            for (int r = 0; r < n; r++) {
                const __m256i v = i < end ? _mm256_loadu_si256((const __m256i *)(x[r0 + r] + i + 16 * h))
                                          : half_of(_mm512_maskz_loadu_epi16(k, x[r0 + r] + i), h);
                xo[r] = _mm256_castsi256_ps(_mm256_and_si256(v, top));
                xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            }
            for (int j = 0; j < 4; j++) {
                const __m256i v = i < end ? _mm256_loadu_si256((const __m256i *)(w[j] + i + 16 * h))
                                          : half_of(_mm512_maskz_loadu_epi16(k, w[j] + i), h);
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, top));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                for (int r = 0; r < n; r++) a[r][j] = _mm256_fmadd_ps(we, xe[r], _mm256_fmadd_ps(wo, xo[r], a[r][j]));
            }
        }
        put_half(acc, r0, n, h, a);
    }
}
#endif

ALWAYS_INLINE void block(const uint16_t *W, long I, long o, long c, const uint16_t *X, long ldx, long m,
                         const int R, const int PF, float *Y, long ldy, const out_bf16 *B) {
    const uint16_t *x[4], *w[4];
    for (int r = 0; r < R; r++) x[r] = X + (m + r) * ldx;
    for (int j = 0; j < 4; j++) w[j] = W + (o + (j < c ? j : 0)) * I;
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    const long tail = I % 32, end = I - tail;
    const __mmask32 k = (__mmask32)((1ULL << tail) - 1);
    if (R == 1) {
        DP_BEGIN
        for (int j = 0; j < 4; j++) {
            __m512 a = acc[0][j]; /* in a register: acc[0][j] with j unknown stayed in memory on AVX2 */
            for (long i = 0; i < end; i += 32) {
#if WEIGHTS_NTA
                _mm_prefetch((const char *)(w[j] + i) + NTA_AHEAD, _MM_HINT_NTA);
#else
                _mm_prefetch((const char *)(w[j] + i) + NTA_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)(w[j] + i) + FAR_AHEAD, FAR_HINT);
#endif
                a = dpbf16(a, BH(_mm512_loadu_si512(w[j] + i)), BH(_mm512_loadu_si512(x[0] + i)));
            }
            if (tail) a = dpbf16(a, BH(_mm512_maskz_loadu_epi16(k, w[j] + end)), BH(_mm512_maskz_loadu_epi16(k, x[0] + end)));
            acc[0][j] = a;
        }
        DP_END
    } else {
        const char *next = (const char *)(W + (o + 4) * I);  /* the next block's 8 I bytes, 256 a chunk */
#ifdef AVX2_512
        const unsigned csr = pairs_mode();
        for (int r0 = 0; r0 < R; r0 += 2) rows_avx2(w, x, r0, R - r0 < 2 ? R - r0 : 2, I, PF && !r0 ? next : NULL, acc);
        _mm_setcsr(csr);
#else
        const int mode = fma_pairs || EMULATED; /* the fma pairs, or the emulated vdpbf16ps of CHUNK */
        const unsigned csr = mode ? pairs_mode() : 0;
        for (long i = 0; i < end; i += 32) {
            if (PF)
                for (int b = 0; b < 256; b += 64) {
                    _mm_prefetch(next + 8 * i + b, _MM_HINT_T0);
#if !WEIGHTS_NTA /* Intel: the block after the next into L2 as well */
                    _mm_prefetch(next + 8 * I + 8 * i + b, _MM_HINT_T1);
#endif
                }
            SEVERAL(_mm512_loadu_si512(w[j] + i), _mm512_loadu_si512(x[r] + i));
        }
        if (tail) SEVERAL(_mm512_maskz_loadu_epi16(k, w[j] + end), _mm512_maskz_loadu_epi16(k, x[r] + end));
        if (mode) _mm_setcsr(csr);
#endif
    }
    store_rows(acc, R, m, o, c, Y, ldy, B);
}
#undef CHUNK
#undef PAIRS
#undef SEVERAL

/* Rows of bf16 widened for the fma pairs: each chunk of 32 values as 16 fp32 of its odd elements, then 16 of
   its even ones (a tail's missing values 0, as block()'s masked loads give them), L = 32 per chunk floats a
   row. The many-row products below read their operands ready, so that their loop is loads and fma alone. */
ALWAYS_INLINE void widen32(__m512i x, float *out) {
    _mm512_store_ps(out, _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000))));
    _mm512_store_ps(out + 16, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
}

ALWAYS_INLINE void widen_row(const uint16_t *v, long I, float *out) {
    const long tail = I % 32, end = I - tail;
    for (long i = 0; i < end; i += 32) widen32(_mm512_loadu_si512(v + i), out + i);
    if (tail) widen32(_mm512_maskz_loadu_epi16((__mmask32)((1ULL << tail) - 1), v + end), out + end);
}

/* block() for R x rows from widened rows: weight row j at w[j], x row r at x + r * L; PAIRS' arithmetic. On
   AVX2 a half of every accumulator and two x rows at a time, as rows_avx2 and for its reason: each lane sums
   the same chunks in the same order, the same bits. */
#ifdef AVX2_512
ALWAYS_INLINE void block_wide(const float *const w[4], const float *x, long L, long o, long c, long m, const int R,
                              float *Y, long ldy, const out_bf16 *B) {
    __m512 acc[4][4];
    const unsigned csr = pairs_mode();
    for (int h = 0; h < 2; h++)
        for (int r0 = 0; r0 < R; r0 += 2) {
            const int n = R - r0 < 2 ? R - r0 : 2;
            __m256 a[2][4];
            for (int r = 0; r < 2; r++)
                for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
            for (long q = 8 * h; q < L; q += 32) {
                __m256 xo[2], xe[2];
                for (int r = 0; r < n; r++)
                    xo[r] = _mm256_load_ps(x + (r0 + r) * L + q), xe[r] = _mm256_load_ps(x + (r0 + r) * L + q + 16);
                for (int j = 0; j < 4; j++) {
                    const __m256 wo = _mm256_load_ps(w[j] + q), we = _mm256_load_ps(w[j] + q + 16);
                    for (int r = 0; r < n; r++) a[r][j] = _mm256_fmadd_ps(we, xe[r], _mm256_fmadd_ps(wo, xo[r], a[r][j]));
                }
            }
            put_half(acc, r0, n, h, a);
        }
    _mm_setcsr(csr);
    store_rows(acc, R, m, o, c, Y, ldy, B);
}
#else
ALWAYS_INLINE void block_wide(const float *const w[4], const float *x, long L, long o, long c, long m, const int R,
                              float *Y, long ldy, const out_bf16 *B) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    const unsigned csr = pairs_mode();
    for (long q = 0; q < L; q += 32) {
        __m512 wo[4], we[4];
        for (int j = 0; j < 4; j++) wo[j] = _mm512_load_ps(w[j] + q), we[j] = _mm512_load_ps(w[j] + q + 16);
        for (int r = 0; r < R; r++) {
            const __m512 xo = _mm512_load_ps(x + r * L + q), xe = _mm512_load_ps(x + r * L + q + 16);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(we[j], xe, _mm512_fmadd_ps(wo[j], xo, acc[r][j]));
        }
    }
    _mm_setcsr(csr);
    store_rows(acc, R, m, o, c, Y, ldy, B);
}
#endif

/* This thread's scratch for widened rows, grown as asked and kept for the thread's life (the pool's threads
   and the engine's live as long as the process: (PANEL + 4) rows of the widest product, 1.1 MB at 4096
   columns); NULL if out of memory, and the product takes block() instead. */
static float *wide_scratch(size_t floats) {
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        free(buf);
        cap = 0;
        buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (!buf) return NULL;
        cap = floats;
    }
    return buf;
}

/* x rows a panel: many x rows (a prefill chunk's) go through every weight row a panel at a time, so that the
   panel's rows stay in L2 while the weights pass, instead of all the rows passing L2 again for every four
   weight rows (512 x 2048 x 768, one thread: 14.7 -> 12.8 ms; 64 and 128 alike, 32 slower). */
#define PANEL 64
/* From this many x rows a product reads its operands widened (widen_row: each x panel once, each four weight
   rows once a panel), so that its loop is loads and fma alone: one thread, 512 x 576 x 576 2.7 -> 2.4 ms,
   512 x 768 x 2048 13.3 -> 11.3 ms. Below, where the weights stream from RAM for a few rows (decode
   batches), widening them first slowed the stream (4 rows of 768 x 2048: 11.6 -> 8.7 GB/s), and block()
   widens in registers. */
#define WIDE_FROM 16
/* Whether many rows read their operands widened whether or not the fma pairs are on: on AVX2, where vdpbf16ps
   is their arithmetic anyway, block() widens each chunk for every row pair (rows_avx2) */
#ifdef AVX2_512
#define WIDE_ALWAYS 1
#else
#define WIDE_ALWAYS 0
#endif

/* Y[m, o] = sum_i W[o, i] X[m, i] for m < M, o < O.  W: [O, I] bf16 row-major; X: [M, I] bf16 with
   rows ldx apart; Y: [M, O] fp32 with rows ldy apart. Each output is one block()'s or block_wide()'s, the
   same bits: one x row's vdpbf16ps, several rows' fma pairs. */
static void gemm_to(const uint16_t *W, const uint16_t *X, long ldx, float *Y, long ldy, long O, long I, long M,
                    const out_bf16 *B) {
    const long L = (I + 31) / 32 * 32;
    float *xw = M >= WIDE_FROM && (fma_pairs || WIDE_ALWAYS) ? wide_scratch((size_t)((PANEL + 4) * L)) : NULL;
    for (long m0 = 0; m0 < M; m0 += PANEL) {
        const long M1 = M - m0 < PANEL ? M : m0 + PANEL;
        if (xw) { /* widened */
            float *ww = xw + PANEL * L;
            for (long m = m0; m < M1; m++) widen_row(X + m * ldx, I, xw + (m - m0) * L);
            for (long o = 0; o < O; o += 4) {
                const long c = O - o < 4 ? O - o : 4;
                const float *w[4];
                for (long j = 0; j < c; j++) widen_row(W + (o + j) * I, I, ww + j * L);
                for (int j = 0; j < 4; j++) w[j] = ww + (j < c ? j : 0) * L; /* missing rows: row o again */
                long m = m0;
                for (; m + 4 <= M1; m += 4) block_wide(w, xw + (m - m0) * L, L, o, c, m, 4, Y, ldy, B);
                switch (M1 - m) {
                case 3: block_wide(w, xw + (m - m0) * L, L, o, c, m, 3, Y, ldy, B); break;
                case 2: block_wide(w, xw + (m - m0) * L, L, o, c, m, 2, Y, ldy, B); break;
                case 1: block_wide(w, xw + (m - m0) * L, L, o, c, m, 1, Y, ldy, B); break;
                }
            }
            continue;
        }
        for (long o = 0; o < O; o += 4) {
            long c = O - o < 4 ? O - o : 4, m = m0;
            for (; m + 4 <= M1; m += 4) block(W, I, o, c, X, ldx, m, 4, m == m0, Y, ldy, B);
            switch (M1 - m) {
            case 3: block(W, I, o, c, X, ldx, m, 3, m == m0, Y, ldy, B); break;
            case 2: block(W, I, o, c, X, ldx, m, 2, m == m0, Y, ldy, B); break;
            case 1: block(W, I, o, c, X, ldx, m, 1, 0, Y, ldy, B); break;
            }
        }
    }
}

static void gemm(const uint16_t *W, const uint16_t *X, long ldx, float *Y, long ldy, long O, long I, long M) {
    gemm_to(W, X, ldx, Y, ldy, O, I, M, NULL);
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
    for (long m = 0; m < M; m++) silu_mul_row(scratch + m * 2 * I, scratch + (m * 2 + 1) * I, h + m * I, I);
    gemm(down, h, I, Y, ldy, H, I, M);  /* [M, H] */
}

/* ---- On the pool's threads: a product split by weight rows, a layer's experts in one call. ----

   Work is handed out in units of weight rows (about UNIT_BYTES of them) from atomic counters
   (pool.h); each output element is computed whole by one thread, by the same block() as above, so
   the results are those of one thread, bit for bit, whatever the thread count. */

#define UNIT_BYTES 65536

/* Rows of a [O, I] bf16 weight in a unit of `bytes`, a multiple of 4 (block()'s width). */
static long rows_in(long bytes, long I) {
    long rows = bytes / (2 * I) / 4 * 4;
    return rows > 4 ? rows : 4;
}

static long unit_rows(long I) { return rows_in(UNIT_BYTES, I); }

/* A product's unit of weight rows on `threads` threads: unit_rows, or for WIDE_FROM or more x rows, where every
   unit widens all its x rows again (gemm_to), about four units a thread (512 rows through 2048 x 4096 at two
   threads: 78 ms in units of unit_rows' 16 weight rows, 46 ms in these of 256; 50-56 before the fma pairs). */
static long product_rows(long O, long I, long M, int threads) {
    const long rows = unit_rows(I);
    if (M < WIDE_FROM || threads <= 1) return rows;
    const long share = (O + 4 * threads - 1) / (4 * threads);
    return share > rows ? (share + 3) / 4 * 4 : rows;
}

/* Rows of an expert's [O, I] bf16 matrix in one unit: EXPERT_UNIT_BYTES, four times a product's, so
   that two threads' streams through a layer's experts each run 256 KB before they meet (quant.c's
   UNIT_BYTES says why). Two threads, alternating with 64 KB units (the Intel Xeon VM): the 4-layer
   BF16 file's decode 47.0 -> 51.0 tok/s, the demo model's 74.7 -> 78.2; a layer's experts are still
   tens of units (a demo expert's gate/up 7). The products keep 64 KB: the demo's 576 x 576 would be
   under three 256 KB units, one of two threads idle a third of the time. */
#define EXPERT_UNIT_BYTES 262144
static long expert_rows(long I) { return rows_in(EXPERT_UNIT_BYTES, I); }

typedef struct {
    const uint16_t *W, *X;
    long ldx, ldy, O, I, M, rows;
    float *Y;
    const out_bf16 *B; /* bf16 output instead of Y, or NULL */
    atomic_long next;
} gemm_call;

/* Unit u of a product: its rows u * rows .. (u + 1) * rows - 1. */
static void gemm_unit(const gemm_call *c, long u) {
    long o = u * c->rows, n = min_l(c->rows, c->O - o);
    out_bf16 b, *B = NULL;
    if (c->B) {
        b = (out_bf16){c->B->Y + o, c->B->ldy, c->B->bias ? c->B->bias + o : NULL};
        B = &b;
    }
    gemm_to(c->W + o * c->I, c->X, c->ldx, c->Y ? c->Y + o : NULL, c->ldy, n, c->I, c->M, B);
}

static long gemm_units(const gemm_call *c) { return (c->O + c->rows - 1) / c->rows; }

static void gemm_region(void *arg, int t, int T) {
    (void)t;
    (void)T;
    gemm_call *c = arg;
    long units = gemm_units(c);
    for (long u; (u = next_unit(&c->next, units)) >= 0;) gemm_unit(c, u);
}

static void gemm_threads(gemm_call *c, int threads) {
    atomic_init(&c->next, 0);
    long units = (c->O + c->rows - 1) / c->rows;
    if (threads <= 1 || units <= 1)
        gemm_to(c->W, c->X, c->ldx, c->Y, c->ldy, c->O, c->I, c->M, c->B);
    else
        hm_parallel(gemm_region, c, (int)min_l(threads, units));
}

/* hm_gemm_bf16 on up to `threads` threads. */
void hm_gemm_bf16_mt(const uint16_t *W, const uint16_t *X, long ldx, float *Y, long ldy, long O, long I, long M,
                     int threads) {
    gemm_call c = {W, X, ldx, ldy, O, I, M, product_rows(O, I, M, threads), Y, NULL};
    gemm_threads(&c, threads);
}

/* F.linear of bf16 rows as torch computes it (fp32 sums, the bias added in fp32, one rounding):
   Y [M, O] bf16 with rows ldy apart, bias [O] bf16 or NULL; on up to `threads` threads, the same
   bits on any count. */
void hm_linear_bf16(const uint16_t *W, const uint16_t *X, long ldx, const uint16_t *bias, uint16_t *Y, long ldy,
                    long O, long I, long M, int threads) {
    out_bf16 b = {Y, ldy, bias};
    gemm_call c = {W, X, ldx, 0, O, I, M, product_rows(O, I, M, threads), NULL, &b};
    gemm_threads(&c, threads);
}

/* One expert's share of hm_experts_bf16; Python passes an int64 table [n, 8] of these fields. */
typedef struct {
    const uint16_t *gate_up, *down; /* [2I, H], [H, I] bf16 */
    const uint16_t *x;              /* [M, H] bf16, rows ldx apart */
    long ldx, M;
    float *y;                       /* [M, H] fp32, rows H apart */
    float *gu;                      /* scratch [M, 2I] fp32 */
    uint16_t *h;                    /* scratch [M, I] bf16 */
} bexpert_job;

typedef struct {
    const bexpert_job *e;
    long n, H, I, rows1, rows3, units1, units3;
    const gemm_call *also; /* a product whose units are taken beside the gate and up rows, or NULL */
    long also_units;
    atomic_long next[3], done[2];
} bexperts_call;

/* Three stages, each starting when every unit of the one before is done (stage_wait: a thread that
   has not joined holds none). */
static void bexperts_region(void *arg, int t, int T) {
    (void)t;
    (void)T;
    bexperts_call *c = arg;
    long H = c->H, I = c->I, u, total = c->n * c->units1 + c->also_units;
    while ((u = next_unit(&c->next[0], total)) >= 0) {  /* gate and up rows */
        if (u >= c->n * c->units1) {
            gemm_unit(c->also, u - c->n * c->units1);
        } else {
            const bexpert_job *e = &c->e[u / c->units1];
            long o = (u % c->units1) * c->rows1, n = min_l(c->rows1, 2 * I - o);
            gemm(e->gate_up + o * H, e->x, e->ldx, e->gu + o, 2 * I, n, H, e->M);
        }
        atomic_fetch_add(&c->done[0], 1);
    }
    stage_wait(&c->done[0], total);
    while ((u = next_unit(&c->next[1], c->n)) >= 0) {  /* h = silu(gate) * up, rounded to bf16 */
        const bexpert_job *e = &c->e[u];
        for (long m = 0; m < e->M; m++) silu_mul_row(e->gu + m * 2 * I, e->gu + (m * 2 + 1) * I, e->h + m * I, I);
        atomic_fetch_add(&c->done[1], 1);
    }
    stage_wait(&c->done[1], c->n);
    while ((u = next_unit(&c->next[2], c->n * c->units3)) >= 0) {  /* down rows */
        const bexpert_job *e = &c->e[u / c->units3];
        long o = (u % c->units3) * c->rows3, n = min_l(c->rows3, H - o);
        gemm(e->down + o * I, e->h, I, e->y + o, H, n, I, e->M);
    }
}

/* The n experts of e (a layer's) and the units of `also` (or NULL) in one region of up to `threads`
   threads: every gate and up row and every unit of `also`, then each expert's h, then every down row;
   each expert's y equals hm_expert_rows_bf16's, bit for bit. */
static void experts_with(const bexpert_job *e, long n, long H, long I, gemm_call *also, int threads) {
    bexperts_call c = {.e = e, .n = n, .H = H, .I = I, .rows1 = expert_rows(H), .rows3 = expert_rows(I), .also = also};
    c.units1 = (2 * I + c.rows1 - 1) / c.rows1;
    c.units3 = (H + c.rows3 - 1) / c.rows3;
    c.also_units = also ? gemm_units(also) : 0;
    for (int s = 0; s < 3; s++) atomic_init(&c.next[s], 0);
    for (int s = 0; s < 2; s++) atomic_init(&c.done[s], 0);
    hm_parallel(bexperts_region, &c, (int)min_l(threads, n * c.units1 + c.also_units));
}

void hm_experts_bf16(const bexpert_job *e, long n, long H, long I, int threads) {
    experts_with(e, n, H, I, NULL, threads);
}

/* out [H] bf16 = sum_j bf16(e[j].y) * w[j], each term in fp32, added from 0 in the order of e, rounded
   once. */
static void mix_bf16(const bexpert_job *e, long n, long H, const float *w, uint16_t *out) {
    for (long h = 0; h < H; h++) {
        float acc = 0.0f;
        for (long j = 0; j < n; j++) acc += f32(bf16(e[j].y[h])) * w[j];
        out[h] = bf16(acc);
    }
}

/* One token through its n experts (e, in increasing expert id, M = 1 each) and their weighted sum:
   out [H] bf16 = sum_j bf16(y_j) * w_j, each term in fp32, added from 0 in the order of e, rounded
   once; the bits of hm_experts_bf16's outputs rounded to bf16 and then combined as combine_token
   (experts/run/ffn.py) does with torch (the product and the sum two roundings: the library is
   built with -ffp-contract=off). */
void hm_experts_mix_bf16(const bexpert_job *e, long n, long H, long I, int threads, const float *w, uint16_t *out) {
    hm_experts_bf16(e, n, H, I, threads);
    mix_bf16(e, n, H, w, out);
}

/* A token's K routed experts (ids [K], int64, top-k order, distinct; weights w [K], fp32) as jobs in
   increasing id, from experts [E, 2] (each expert's gate_up and down pointers, the layer's table), with
   their weights in that order in ws and their scratch in y (K (H + 2I) floats) and h (K I bf16). */
static void token_jobs(const int64_t *experts, const int64_t *ids, const float *w, long K, const uint16_t *x, long H,
                       long I, float *y, uint16_t *h, bexpert_job *e, float *ws) {
    long order[64];
    for (long k = 0; k < K; k++) { /* insertion sort of k by ids[k] */
        long j = k;
        for (; j > 0 && ids[order[j - 1]] > ids[k]; j--) order[j] = order[j - 1];
        order[j] = k;
    }
    for (long j = 0; j < K; j++) {
        const int64_t *p = experts + 2 * ids[order[j]];
        e[j] = (bexpert_job){(const uint16_t *)p[0], (const uint16_t *)p[1], x, H, 1, y + j * H,
                             y + K * H + j * 2 * I, h + j * I};
        ws[j] = w[order[j]];
    }
}

/* One token's routed experts from the router's choice as it stands (token_jobs' arguments), mixed as
   hm_experts_mix_bf16 mixes them; the scratch is made here. Returns 0, -1 for K > 64, -2 no memory. */
int hm_moe_token_bf16(const int64_t *experts, const int64_t *ids, const float *w, long K, const uint16_t *x, long H,
                      long I, int threads, uint16_t *out) {
    if (K > 64) return -1;
    bexpert_job e[64];
    float ws[64], *y = malloc(sizeof(float) * K * (H + 2 * I));
    uint16_t *h = malloc(sizeof(uint16_t) * K * I);
    if (!y || !h) {
        free(y), free(h);
        return -2;
    }
    token_jobs(experts, ids, w, K, x, H, I, y, h, e, ws);
    hm_experts_mix_bf16(e, K, H, I, threads, ws, out);
    free(y), free(h);
    return 0;
}

/* ---- A prefill chunk's routed experts and their weighted sums in one call ----

   T tokens x [T, H] bf16 (rows contiguous) through their experts and the weighted sums, out [T, H] bf16:
   per token, sum_j bf16(y_j) * w_j over its K experts in increasing id, each term in fp32, added from 0,
   the sum rounded once: the bits of hm_experts_bf16 on each expert's tokens (its rows of x in increasing
   order, gathered) rounded to bf16 and then combined as combine_grouped (experts/run/ffn.py) combines
   them with torch (a product and a sum, two roundings: -ffp-contract=off). For the rows the bf16
   kernels take at every count, which is where each row is computed as if alone
   (hybridmoe/invariance.py): there, a prefill's grouping, gathers and sums in torch took ~0.1 s of the
   demo's 1.3 s at one thread, and index_add_ alone 0.2 s at two, woken onto OpenMP's threads beside
   this pool's. experts: [E, 2] as hm_moe_token_bf16's; ids [T, K] int64 and w [T, K] fp32 as the
   router gives them; also: a product whose units run in the experts' region beside their gate and up
   rows (a shared expert's down: hm_shared_moe_tokens_bf16), or NULL. Returns 0, -1 for an id outside
   [0, E) or K > 64, -2 no memory. */
static int moe_tokens_with(const int64_t *experts, long E, const int64_t *ids, const float *w, long T, long K,
                           const uint16_t *x, long H, long I, gemm_call *also, int threads, uint16_t *out) {
    if (K > 64 || K < 1 || T < 1) return -1;
    for (long i = 0; i < T * K; i++)
        if (ids[i] < 0 || ids[i] >= E) return -1;
    const long R = T * K; /* rows over all experts */
    long *first = calloc((size_t)(E + 1), sizeof(long)), *slot = malloc(sizeof(long) * (size_t)R);
    bexpert_job *e = malloc(sizeof(bexpert_job) * (size_t)(E < R ? E : R));
    /* y [R, H] fp32, gu [R, 2I] fp32, h [R, I] bf16, xg [R, H] bf16: the gathered rows */
    const size_t ny = (size_t)(R * H) * 4, ngu = (size_t)(R * 2 * I) * 4, nh = (size_t)(R * I) * 2;
    uint8_t *s = kept_buffer_of(ny + ngu + nh + (size_t)(R * H) * 2);
    int status = first && slot && e && s ? 0 : -2;
    if (!status) status = group_by_expert(ids, R, E, first, slot);
    if (!status) {
        float *y = (float *)s, *gu = (float *)(s + ny);
        uint16_t *h = (uint16_t *)(s + ny + ngu), *xg = (uint16_t *)(s + ny + ngu + nh);
        long n = 0;
        for (long j = 0; j < E; j++) {
            const long at = first[j], count = first[j + 1] - at;
            if (count)
                e[n++] = (bexpert_job){(const uint16_t *)experts[2 * j], (const uint16_t *)experts[2 * j + 1],
                                       xg + at * H, H, count, y + at * H, gu + at * 2 * I, h + at * I};
        }
        for (long i = 0; i < R; i++) memcpy(xg + slot[i] * H, x + (i / K) * H, sizeof(uint16_t) * (size_t)H);
        experts_with(e, n, H, I, also, threads);
        mix_call c = {ids, w, K, H, 1, y, slot, out, T};
        mix_tokens(&c, threads);
    }
    free(first);
    free(slot);
    free(e);
    return status;
}

/* moe_tokens_with, nothing beside. */
int hm_moe_tokens_bf16(const int64_t *experts, long E, const int64_t *ids, const float *w, long T, long K,
                       const uint16_t *x, long H, long I, int threads, uint16_t *out) {
    return moe_tokens_with(experts, E, ids, w, T, K, x, H, I, NULL, threads, out);
}

/* silu(g) and sigmoid(g) of a bf16 value as torch computes them on bf16 tensors: in fp32 with expf,
   rounded to bf16 (the vectorised and the scalar paths agree with this for every bf16 input; tested
   exhaustively in tests/test_native.py). */
static inline float silu_bf16(uint16_t g) {
    const float a = f32(g);
    return round_bf16(a / (1.0f + expf(-a)));
}

static inline float sigmoid_bf16(uint16_t g) { return round_bf16(1.0f / (1.0f + expf(-f32(g)))); }

/* The rest of a Qwen2-MoE block's decode token after its router (models/qwen2_moe.py), and the layer's
   residual sum: out [H] bf16 = resid + (routed + sigmoid(logit) * down(silu(gate) * up)), each op
   rounded to bf16 as torch rounds it on bf16 tensors. routed: the token's experts (token_jobs'
   arguments; x [H] their input) mixed as hm_moe_token_bf16 mixes them; gu [1 + 2S] bf16: the shared
   expert's gate logit, then its gate and up rows of x; down [H, S] bf16. The shared expert's down
   rows are shared out with the experts' gate and up rows in one region. Returns 0, -1 for K > 64, -2
   no memory. */
int hm_shared_moe_token_bf16(const int64_t *experts, const int64_t *ids, const float *w, long K, const uint16_t *x,
                             long H, long I, const uint16_t *gu, const uint16_t *down, long S,
                             const uint16_t *resid, int threads, uint16_t *out) {
    if (K > 64) return -1;
    bexpert_job e[64];
    float ws[64], *y = malloc(sizeof(float) * K * (H + 2 * I));
    uint16_t *h = malloc(sizeof(uint16_t) * (K * I + S + 2 * H)), *hs = h + K * I, *ys = hs + S, *routed = ys + H;
    if (!y || !h) {
        free(y), free(h);
        return -2;
    }
    const float s = sigmoid_bf16(gu[0]);
    gu++;
    for (long i = 0; i < S; i++) hs[i] = bf16(silu_bf16(gu[i]) * f32(gu[S + i]));  /* [S] */
    out_bf16 b = {ys, H, NULL};  /* [H]: down(hs), F.linear's rounding */
    gemm_call shared = {down, hs, S, 0, H, S, 1, unit_rows(S), NULL, &b};
    atomic_init(&shared.next, 0);
    token_jobs(experts, ids, w, K, x, H, I, y, h, e, ws);
    experts_with(e, K, H, I, &shared, threads);
    mix_bf16(e, K, H, ws, routed);
    for (long i = 0; i < H; i++)
        out[i] = bf16(f32(resid[i]) + round_bf16(f32(routed[i]) + round_bf16(s * f32(ys[i]))));
    free(y), free(h);
    return 0;
}

/* hm_shared_moe_token_bf16 for T tokens, each with its bits: x [T, H] the experts' input, ids and w [T, K] as
   the router gives them, gu: token t's shared gate logit, then its gate and up rows [2S], at gu + t * ldg;
   resid and out [T, H]. The routed experts as hm_moe_tokens_bf16 runs them (each expert read once for its
   tokens' rows, gathered) and the shared expert's down product over the T rows in the same region: a
   serving step's batch, where one token a call read every expert once per token. Returns 0, -1 for an
   id outside [0, E) or K > 64, -2 no memory. */
int hm_shared_moe_tokens_bf16(const int64_t *experts, long E, const int64_t *ids, const float *w, long T, long K,
                              const uint16_t *x, long H, long I, const uint16_t *gu, long ldg, const uint16_t *down,
                              long S, const uint16_t *resid, int threads, uint16_t *out) {
    uint16_t *hs = malloc(sizeof(uint16_t) * (size_t)(T * (S + 2 * H))), *ys = hs + T * S, *routed = ys + T * H;
    if (!hs) return -2;
    for (long t = 0; t < T; t++) {
        const uint16_t *g = gu + t * ldg + 1;
        for (long i = 0; i < S; i++) hs[t * S + i] = bf16(silu_bf16(g[i]) * f32(g[S + i])); /* [T, S] */
    }
    out_bf16 b = {ys, H, NULL}; /* [T, H]: down(hs), F.linear's rounding */
    gemm_call shared = {down, hs, S, 0, H, S, T, product_rows(H, S, T, threads), NULL, &b};
    atomic_init(&shared.next, 0);
    const int status = moe_tokens_with(experts, E, ids, w, T, K, x, H, I, &shared, threads, routed);
    for (long t = 0; t < T && !status; t++) {
        const float s = sigmoid_bf16(gu[t * ldg]);
        for (long i = t * H; i < (t + 1) * H; i++)
            out[i] = bf16(f32(resid[i]) + round_bf16(f32(routed[i]) + round_bf16(s * f32(ys[i]))));
    }
    free(hs);
    return status;
}

/* ---- Decode attention: one query token per sequence over its paged bf16 K/V history. ----

   torch's SDPA spends ~200 us per (layer, sequence) on the demo model's decode at 1100 positions
   (9/3 heads of 64), while the 845 KB of K and V it reads take ~40 us at memory speed. Here K and V
   are read once, straight from the pools through the block table (no gather), in two passes: the
   scores of every query head (fp32, q.k with vdpbf16ps), a softmax with the maximum subtracted,
   then sum_l p_l v_l in fp32. Query head h uses KV head h / (heads / kv_heads), as transformers'
   repeat_kv. */

/* [a0+a1, a2+a3, .., a14+a15, b0+b1, .., b14+b15]: one level of the tree that sums 16 vectors' lanes
   (scores_block), 16 partial sums of each becoming 8, then 4, 2, 1. */
ALWAYS_INLINE __m512 pairs(__m512 a, __m512 b) {
#ifdef AVX2_512 /* vhaddps adds the same pairs, the even element first; vpermpd puts them in order */
    const __m256 ha = _mm256_hadd_ps(a.lo, a.hi), hb = _mm256_hadd_ps(b.lo, b.hi);
    return f2(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ha), _MM_SHUFFLE(3, 1, 2, 0))),
              _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(hb), _MM_SHUFFLE(3, 1, 2, 0))));
#else
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
#endif
}

ALWAYS_INLINE __mmask32 mask32(long n) { return n >= 32 ? (__mmask32)~0u : (__mmask32)((1ULL << n) - 1); }
ALWAYS_INLINE __mmask16 mask16(long n) { return n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0; }

/* Asks for the rows of positions l0..l1-1 (row_bytes each, every KV head) ahead of their use. The
   rows are scattered by the block table and read a KV head (128 bytes) at a time, a pattern the
   hardware prefetchers miss: 1100 positions from RAM, 9/3 heads of 64, took ~167 us without this and
   ~85-135 us with it (consecutive / shuffled blocks; 16, 64 or 128 positions ahead did no better).
   On the Intel VM of docs/notes/2026-12-06-one-token-streams.md, 8 ahead beat 32 at 8192 positions
   (interleaved A/B, 1 thread, cold: 32/4 heads of 128 3320 -> 3187 us, 9/3 of 64 833 -> 756 us; alike
   at 512 and 2048): 32 rows of 32/4 heads of 128 (1 KB each) are 32 KB, most of L1. The AMX paths ask so;
   the vdpbf16ps path asks so for its first block only, for every later one a share at a time (attend_one). */
#define AHEAD 8  /* positions */
ALWAYS_INLINE void prefetch_part(const uint16_t *row, long bytes) {
    for (long b = 0; b < bytes; b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T0);
}
ALWAYS_INLINE void prefetch_rows(const uint16_t *base, long ld, const long *slots, long l0, long l1, long row_bytes) {
    for (long l = l0; l < l1; l++) prefetch_part(base + slots[l] * ld, row_bytes);
}
/* Positions of the block from l on (the one ahead) that lie before L: 0 to 16. */
ALWAYS_INLINE long rows_from(long l, long L) { return L - l < 0 ? 0 : L - l < 16 ? L - l : 16; }

/* S[h][0..16) = scale q_h . k_j for the n query heads at q (rows d apart; S rows ldp apart) and the
   16 key rows at k + off[j] (d elements each); asks for the d elements at k + next[j], j < rows, a
   share at each head (attend_one). Out of line, the sums in named variables: inlined into
   attend_one with an array of them, GCC kept the array in memory, a store after every vdpbf16ps
   (32/4 heads of 128, warm, 1 thread: 2048 positions 644 -> 600 us, 8192 2582 -> 2425 us). */
__attribute__((noinline)) static void scores_block(const uint16_t *q, long n, const uint16_t *k, const long *off,
                                                   long d, float scale, float *S, long ldp, const long *next,
                                                   long rows) {
    for (long h = 0; h < n; h++, q += d, S += ldp) {
        for (long j = h * rows / n; j < (h + 1) * rows / n; j++) prefetch_part(k + next[j], d * 2);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
               a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
        DP_BEGIN
        for (long i = 0; i < d; i += 32) {
            __mmask32 m = mask32(d - i);
            bh512 qv = BH(_mm512_maskz_loadu_epi16(m, q + i));
#define DOT(J) a##J = dpbf16(a##J, qv, BH(_mm512_maskz_loadu_epi16(m, k + off[J] + i)))
            DOT(0), DOT(1), DOT(2), DOT(3), DOT(4), DOT(5), DOT(6), DOT(7);
            DOT(8), DOT(9), DOT(10), DOT(11), DOT(12), DOT(13), DOT(14), DOT(15);
#undef DOT
        }
        DP_END
        a0 = pairs(a0, a1), a2 = pairs(a2, a3), a4 = pairs(a4, a5), a6 = pairs(a6, a7);
        a8 = pairs(a8, a9), a10 = pairs(a10, a11), a12 = pairs(a12, a13), a14 = pairs(a14, a15);
        a0 = pairs(a0, a2), a4 = pairs(a4, a6), a8 = pairs(a8, a10), a12 = pairs(a12, a14);
        a0 = pairs(a0, a4), a8 = pairs(a8, a12);
        _mm512_storeu_ps(S, _mm512_mul_ps(pairs(a0, a8), _mm512_set1_ps(scale)));
    }
}

/* ---- The scores on AMX tiles (Sapphire Rapids and later) ----

   With vdpbf16ps each query head reloads the block's key rows and folds 16 lanes per score
   (scores_block): at 576 positions of 32/4 heads of 128 that was ~60 of a layer's ~130 us of decode
   attention from L2 (1 thread, Intel Xeon VM). A tile product takes 16 positions of a KV head's keys as
   the rows of A (32 dimensions a tile, straight from the pool when 16 aligned positions are 16
   consecutive slots, else copied into Kg) and the group's G query heads as B (Qp: pairs of dimensions
   interleaved, [d / 32][16][G][2], packed once a call): C [16 positions, G heads] in fp32, ~15 us for
   the same scores. Each score is the same products summed in another order (fp32 throughout), so it
   differs from scores_block's in the last bits; every call on a machine takes one path or the other
   (hm_set_amx), so a head's result still depends on nothing but its inputs. */
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int amx_on;
#define ROWS_MAX 8 /* query rows of one history in one tile (rows_together) */

/* Asks Linux for the tile registers' state for this process (every thread); 1 if granted. */
int hm_amx_permit(void) {
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) != 0) return 0;
    return (int)((mask >> XFEATURE_XTILEDATA) & 1);
}

/* Whether the decode attention takes the tiles (only once hm_amx_permit said yes). */
void hm_set_amx(int on) { amx_on = on; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether the tiles take N columns (a group's heads, of every row) over a head size d in whole
   tiles of `tile` (32 dimensions for the scores, 16 columns for the values). */
ALWAYS_INLINE int amx_takes(long N, long d, long tile) { return amx_on && d % tile == 0 && d <= 256 && N <= 16; }

/* S[(g G + h) R + r][l] = scale q_{r,h} . k_l for the query heads of KV heads 0..groups-1 (G each) of R
   query rows that share a history (qs[r]: row r's heads, rows d apart; the group's keys at K + g * d +
   slots[l] * ldk), l < L; as scores_block's loop writes them, 16 positions at a time (past L: position
   L - 1 again). The R G columns of a tile are independent sums: a row's scores are the same alone and
   in a pair. runs16: every aligned 16 positions are 16 consecutive slots (the block size a multiple of
   16). Scratch: Qp groups * R * G * d, Kg 16 * d, Ct 16 * R * G. */
AMX_TARGET static void scores_amx(const uint16_t *const *qs, long R, long G, long groups, const uint16_t *K,
                                  long ldk, const long *slots, long L, long d, int runs16, float scale,
                                  float *S, long ldp, uint16_t *Qp, uint16_t *Kg, float *Ct) {
    const long N = R * G; /* a tile's columns: head h of row r at h R + r */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.colsb[0] = (uint16_t)(4 * N), cfg.rows[0] = 16; /* C: 16 positions x N, fp32 */
    cfg.colsb[1] = 64, cfg.rows[1] = 16;                /* A: 16 positions x 32 dimensions */
    cfg.colsb[2] = (uint16_t)(4 * N), cfg.rows[2] = 16; /* B: 16 pairs of dimensions x N */
    _tile_loadconfig(&cfg);
    const long C = d / 32, tile = 32 * N; /* Qp elements per tile */
    for (long g = 0; g < groups; g++)
        for (long c = 0; c < C; c++)
            for (long k = 0; k < 16; k++)
                for (long h = 0; h < G; h++)
                    for (long r = 0; r < R; r++) {
                        const uint16_t *src = qs[r] + (g * G + h) * d + c * 32 + 2 * k;
                        uint16_t *dst = Qp + (g * C + c) * tile + (k * N + h * R + r) * 2;
                        dst[0] = src[0], dst[1] = src[1];
                    }
    const __m512i lanes = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((int)N));
    const __m512 sc = _mm512_set1_ps(scale);
    const long row_bytes = groups * d * 2;
    prefetch_rows(K, ldk, slots, 0, L < AHEAD ? L : AHEAD, row_bytes);
    for (long l0 = 0; l0 < L; l0 += 16) {
        prefetch_rows(K, ldk, slots, l0 + AHEAD, l0 + AHEAD + 16 < L ? l0 + AHEAD + 16 : L, row_bytes);
        const int direct = runs16 && l0 + 16 <= L;
        for (long g = 0; g < groups; g++) {
            const uint16_t *A = K + g * d;
            long stride = ldk * 2;
            if (direct) {
                A += slots[l0] * ldk;
            } else {
                for (long j = 0; j < 16; j++)
                    memcpy(Kg + j * d, A + slots[l0 + j < L ? l0 + j : L - 1] * ldk, d * 2);
                A = Kg, stride = d * 2;
            }
            _tile_zero(0);
            for (long c = 0; c < C; c++) {
                _tile_loadd(1, A + c * 32, stride);
                _tile_loadd(2, Qp + (g * C + c) * tile, 4 * N);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, Ct, 4 * N);
            for (long n = 0; n < N; n++) /* C's column n: its 16 scores */
                _mm512_storeu_ps(S + (g * N + n) * ldp + l0,
                                 _mm512_mul_ps(_mm512_i32gather_ps(
                                     _mm512_add_epi32(lanes, _mm512_set1_epi32((int)n)), Ct, 4), sc));
        }
    }
    _tile_release();
}

/* Two rows of 32 bf16 as B tiles' rows: [a0 b0 a1 b1 .. a15 b15] and [a16 b16 .. a31 b31]. */
static const uint16_t PAIRS_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t PAIRS_HI[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
static const uint16_t ZERO_ROW[256];
#define VALUES_RUN 256 /* positions: 256 KB of value rows at 32/4 heads of 128 */

/* O[i][c] = sum_l P[i][l] V[l][c] for the rows i = (g G + h) R + r: head h of KV head g (of
   0..groups-1) of query row r (P: S's rows, ldp apart, taken to row r's length L0 + r; the group's
   values at V + g * dv + slots[l] * ldv), on tiles: 32 positions and 16 columns a product, C [R G, 16
   columns] in fp32 held across the positions; a row's sums are the same alone and in a pair (the
   other row's last position adds its value times a weight of 0). The tiles multiply
   bf16, so each weight goes in as three bf16 parts, p = hi + mid + lo (each the rest of the one
   before, rounded to nearest even): their sum is p to ~2^-24 of it, as close as fp32 holds it, and
   each part's product with a value (bf16) is exact in fp32. The value rows go into B with pairs of
   positions interleaved (Vp). 32/4 heads of 128, 1 thread, the Intel Xeon VM: the whole attention of
   a token over 576 positions from L2 went from ~138 to ~56 us with scores_amx (the weighted sum ~28
   us of it), over 8192 positions from RAM from ~2550 to ~1600 us (the sum ~880 us: it streams 8.4 MB
   of values at ~9.5 GB/s, its tile work not hidden behind the reads). Scratch: Ap 3 * 16 * 32, Vp
   4 * 16 * 32. */
AMX_TARGET static void values_amx(const float *S, long ldp, long R, long G, long groups, const uint16_t *V,
                                  long ldv, const long *slots, long L0, long dv, float *O, uint16_t *Ap,
                                  uint16_t *Vp) {
    const long N = R * G, L = L0 + R - 1; /* a C tile's rows; the last row's length */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.colsb[t] = 64, cfg.rows[t] = (uint8_t)N; /* C: N rows x 16 columns */
    cfg.colsb[4] = 64, cfg.rows[4] = 16;                                    /* B: 16 pairs x 16 columns */
    for (int t = 5; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = (uint8_t)N; /* A: hi, mid, lo */
    _tile_loadconfig(&cfg);
    const __m512i lo = _mm512_loadu_si512(PAIRS_LO), hi = _mm512_loadu_si512(PAIRS_HI);
    const long row_bytes = groups * dv * 2;
    memset(O, 0, sizeof(float) * groups * N * dv);
    /* VALUES_RUN positions at a time, their value rows read from RAM once (asked for a run ahead, into
       L2) and kept in L2 for every group and every 64 columns */
    for (long r0 = 0; r0 < L; r0 += VALUES_RUN) {
        const long r1 = r0 + VALUES_RUN < L ? r0 + VALUES_RUN : L;
        for (long g = 0; g < groups; g++)
            for (long c0 = 0; c0 < dv; c0 += 64) {
                const long nj = (dv - c0) / 16 < 4 ? (dv - c0) / 16 : 4; /* C tiles in this pass */
                float *o = O + g * N * dv + c0;
                _tile_loadd(0, o, dv * 4);
                if (nj > 1) _tile_loadd(1, o + 16, dv * 4);
                if (nj > 2) _tile_loadd(2, o + 32, dv * 4);
                if (nj > 3) _tile_loadd(3, o + 48, dv * 4);
                for (long l0 = r0; l0 < r1; l0 += 32) {
                    for (long i = 0; i < N; i++) {
                        const float *p = S + (g * N + i) * ldp + l0;
                        const long end = r1 < L0 + i % R ? r1 : L0 + i % R; /* row i's positions */
                        for (int half = 0; half < 2; half++) {
                            __m512 x = _mm512_maskz_loadu_ps(mask16(end - l0 - 16 * half), p + 16 * half);
                            for (int t = 0; t < 3; t++) {
                                __m256i b = cvtne(x);
                                _mm256_storeu_si256((__m256i *)(Ap + (t * 16 + i) * 32 + 16 * half), b);
                                x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
                            }
                        }
                    }
                    for (long k = 0; k < 16; k++) {
                        const long la = l0 + 2 * k, lb = la + 1;
                        if (g == 0 && c0 == 0) /* the first pass over the run asks for the next run's rows */
                            for (long l = la + VALUES_RUN; l <= lb + VALUES_RUN && l < L; l++) {
                                const char *row = (const char *)(V + slots[l] * ldv);
                                for (long b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
                            }
                        const uint16_t *a = la < r1 ? V + slots[la] * ldv + g * dv + c0 : ZERO_ROW;
                        const uint16_t *b = lb < r1 ? V + slots[lb] * ldv + g * dv + c0 : ZERO_ROW;
                        for (long j = 0; j < nj; j += 2) {
                            const __mmask32 m = mask32(16 * (nj - j));
                            const __m512i av = _mm512_maskz_loadu_epi16(m, a + 16 * j);
                            const __m512i bv = _mm512_maskz_loadu_epi16(m, b + 16 * j);
                            _mm512_storeu_si512(Vp + (j * 16 + k) * 32, _mm512_permutex2var_epi16(av, lo, bv));
                            if (j + 1 < nj)
                                _mm512_storeu_si512(Vp + ((j + 1) * 16 + k) * 32, _mm512_permutex2var_epi16(av, hi, bv));
                        }
                    }
                    _tile_loadd(5, Ap, 64);
                    _tile_loadd(6, Ap + 16 * 32, 64);
                    _tile_loadd(7, Ap + 32 * 32, 64);
#define COLUMNS(J)                            \
    if (J < nj) {                             \
        _tile_loadd(4, Vp + J * 16 * 32, 64); \
        _tile_dpbf16ps(J, 5, 4);              \
        _tile_dpbf16ps(J, 6, 4);              \
        _tile_dpbf16ps(J, 7, 4);              \
    }
                    COLUMNS(0) COLUMNS(1) COLUMNS(2) COLUMNS(3)
#undef COLUMNS
                }
                _tile_stored(0, o, dv * 4);
                if (nj > 1) _tile_stored(1, o + 16, dv * 4);
                if (nj > 2) _tile_stored(2, o + 32, dv * 4);
                if (nj > 3) _tile_stored(3, o + 48, dv * 4);
            }
    }
    _tile_release();
}

/* O[r][c0 + i] += sum_{l0 <= l < l1} P[r][l] V[slot l][c0 + i] for R heads (rows of O dv apart, of P
   ldp apart) and i < 64 (masked at dv), the accumulators in registers across positions: T x 16 columns a
   pass. On AVX2 the R x 64 sums of one pass are twice its 16 ymm registers, spilled at every fma: there 16
   columns a pass, each column's sum over the positions in the same order, so the same bits. One sequence of
   576 positions, 32/4 heads of 128, after a 48 MB read, 1 thread, Zen 5 capped to AVX2: 237 -> 173-176 us a
   call; 1100 positions of 9/3 heads of 64: 124-125 -> 107-108. */
ALWAYS_INLINE void weigh_values(float *O, long dv, long c0, const float *P, long ldp, const uint16_t *V,
                                long ldv, const long *slots, long l0, long l1, const int R) {
#ifdef AVX2_512
    enum { T = 1 };
#else
    enum { T = 4 };
#endif
    for (int t0 = 0; t0 < 4; t0 += T) {
        __mmask16 m[T];
        __m512 acc[4][T];
        for (int t = 0; t < T; t++) m[t] = mask16(dv - c0 - 16 * (t0 + t));
        if (!m[0]) break;
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) acc[r][t] = _mm512_maskz_loadu_ps(m[t], O + r * dv + c0 + 16 * (t0 + t));
        for (long l = l0; l < l1; l++) {
            const uint16_t *v = V + slots[l] * ldv + c0 + 16 * t0;
            __m512 vv[T];
            for (int t = 0; t < T; t++)  /* bf16 -> fp32: the 16 bits on top of a zero half */
                vv[t] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m[t], v + 16 * t)), 16));
            for (int r = 0; r < R; r++) {
                __m512 p = _mm512_set1_ps(P[r * ldp + l]);
                for (int t = 0; t < T; t++) acc[r][t] = _mm512_fmadd_ps(p, vv[t], acc[r][t]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(O + r * dv + c0 + 16 * (t0 + t), m[t], acc[r][t]);
    }
}

/* R query rows (1, or up to ROWS_MAX where rows_together says) of one history: row r's heads of KV heads g0..g1-1,
   qs[r] [heads, d] bf16 -> outs[r] [heads, dv] (fp32, or bf16 if out_bf16), over its L + r positions
   at slots[0..L + r). S: R x heads x roundup(L + R - 1, 16) floats, O: R x heads x dv floats of
   scratch, tiles: the tiles' (scores_amx, values_amx). Each head's arithmetic is its own, whichever
   other heads and rows come with it; several rows only where both halves take the tiles. */
static void attend_one(const uint16_t *const *qs, void *const *outs, long R, const uint16_t *K, long ldk,
                       const uint16_t *V, long ldv, const long *slots, long L, long heads, long kv_heads,
                       long g0, long g1, long d, long dv, int runs16, float scale, int out_bf16, float *S,
                       float *O, uint16_t *tiles) {
    const long G = heads / kv_heads, Lr = L + R - 1, ldp = (Lr + 15) & ~15L, h0 = g0 * G, h1 = g1 * G;
    K += g0 * d, V += g0 * dv;  /* the rows' part of these KV heads: what the prefetches ask for */
    const uint16_t *q = qs[0];
    if (amx_takes(R * G, d, 32)) {  /* S's row for head h of row r: h R + r */
        uint16_t *Qp = tiles, *Kg = tiles + ROWS_MAX * heads * d;
        const uint16_t *from[ROWS_MAX];
        for (long r = 0; r < R; r++) from[r] = qs[r] + h0 * d;
        scores_amx(from, R, G, g1 - g0, K, ldk, slots, Lr, d, runs16, scale, S + h0 * R * ldp, ldp, Qp, Kg,
                   (float *)(Kg + 16 * d));
    } else {
        /* scores, 16 positions at a time; the block's key rows stay in L1 for every head. The next block's rows
           are asked for a few at a time, each head of each group a share (scores_block). On AMD's Zen 5, 16 rows
           asked for at once (prefetch_rows) did little more than not asking: a plain read of 576 such rows of K
           and of V with 25 fma a row took 86-89 us asked for in bursts, 96 without and 44-46 asked for a row at a
           time, and this call read its rows from RAM at ~6 GB/s (the L1's miss buffers full, most likely). One
           sequence of 576 positions, 32/4 heads of 128, after a 48 MB read, 1 thread: 196 -> 96 us a call, 8192
           positions 2479 -> 1048 us (docs/notes/2026-12-07-attention-prefetch.md). */
        const long ahead = 16;
        prefetch_rows(K, ldk, slots, 0, L < ahead ? L : ahead, (g1 - g0) * d * 2);
        for (long l0 = 0; l0 < L; l0 += 16) {
            long off[16], next[16];  /* the key rows' offsets in K: this block's, the one ahead's */
            const long rows = rows_from(l0 + ahead, L);
            for (int j = 0; j < 16; j++)  /* past L: position L - 1 again, its scores unused */
                off[j] = slots[l0 + j < L ? l0 + j : L - 1] * ldk;
            for (long j = 0; j < rows; j++) next[j] = slots[l0 + ahead + j] * ldk;
            for (long g = g0; g < g1; g++)
                scores_block(q + g * G * d, G, K + (g - g0) * d, off, d, scale, S + g * G * ldp + l0, ldp, next, rows);
        }
    }
    /* softmax numerators exp(s - max) in place; 1 / sum kept per head and row */
    float inv[R * heads];
    for (long i = h0 * R; i < h1 * R; i++) {
        float *s = S + i * ldp;
        const long n = L + i % R;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (long l = 0; l < n; l += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, mask16(n - l), s + l));
        __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (long l = 0; l < n; l += 16) {
            __mmask16 m = mask16(n - l);
            __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + l), top)));
            _mm512_storeu_ps(s + l, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[i] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* sum_l p_l v_l: 16 positions at a time, for up to 4 heads of a group and 64 columns at once */
    if (amx_takes(R * G, dv, 16)) {
        uint16_t *Ap = tiles + (ROWS_MAX * heads + 16) * d + 2 * 16 * 16;
        values_amx(S + h0 * R * ldp, ldp, R, G, g1 - g0, V, ldv, slots, L, dv, O + h0 * R * dv, Ap,
                   Ap + 3 * 16 * 32);
    } else {
    memset(O + h0 * dv, 0, sizeof(float) * (h1 - h0) * dv);
    /* the next block's value rows asked for as the keys' are, a share at each call of weigh_values (calls
       a group) */
    const long ahead = 16, calls = (G + 3) / 4 * ((dv + 63) / 64);
    prefetch_rows(V, ldv, slots, 0, L < ahead ? L : ahead, (g1 - g0) * dv * 2);
    for (long l0 = 0; l0 < L; l0 += 16) {
        const long l1 = l0 + 16 < L ? l0 + 16 : L, rows = rows_from(l0 + ahead, L);
        for (long g = g0; g < g1; g++)
            for (long h = g * G, call = 0; h < (g + 1) * G; h += 4)
                for (long c0 = 0; c0 < dv; c0 += 64, call++) {
                    for (long j = call * rows / calls; j < (call + 1) * rows / calls; j++)
                        prefetch_part(V + slots[l0 + ahead + j] * ldv + (g - g0) * dv, dv * 2);
                    float *o = O + h * dv;
                    const float *p = S + h * ldp;
                    const uint16_t *v = V + (g - g0) * dv;
                    switch ((g + 1) * G - h < 4 ? (g + 1) * G - h : 4) {
                    case 4: weigh_values(o, dv, c0, p, ldp, v, ldv, slots, l0, l1, 4); break;
                    case 3: weigh_values(o, dv, c0, p, ldp, v, ldv, slots, l0, l1, 3); break;
                    case 2: weigh_values(o, dv, c0, p, ldp, v, ldv, slots, l0, l1, 2); break;
                    default: weigh_values(o, dv, c0, p, ldp, v, ldv, slots, l0, l1, 1); break;
                    }
                }
    }
    }
    for (long i = h0 * R; i < h1 * R; i++) {
        const long h = i / R, r = i % R;
        for (long c = 0; c < dv; c += 16) {
            __mmask16 m = mask16(dv - c);
            __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, O + i * dv + c), _mm512_set1_ps(inv[i]));
            if (out_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)outs[r] + h * dv + c, m, cvtne(y));
            else
                _mm512_mask_storeu_ps((float *)outs[r] + h * dv + c, m, y);
        }
    }
}

/* How many sequences from s on go through attend_one together: rows of one history (a prefill chunk's
   rows, each its own sequence: the same table, each one position after the one before), as many as
   one tile's columns hold with every row's heads of a KV head (16 / G, at most ROWS_MAX), both halves
   on tiles. Their keys and values are then read once for all of them, and each row's bits are those
   it has alone (scores_amx, values_amx). Depends on the rows alone, not on the threads. */
static long rows_together(const int32_t *table_starts, const int32_t *lengths, long s, long n, long G, long d,
                          long dv) {
    long most = 16 / (G > 0 ? G : 1), R = 1;
    most = most < ROWS_MAX ? most : ROWS_MAX;
    while (R < most && s + R < n && table_starts[s + R] == table_starts[s] && lengths[s + R] == lengths[s] + R)
        R++;
    return R > 1 && amx_takes(R * G, d, 32) && amx_takes(R * G, dv, 16) ? R : 1;
}

/* Decode attention for n sequences, one query token each. Sequence s: its query row is
   Q + rows[s] * ldq ([heads, d] bf16), its output row out + rows[s] * ldo ([heads, dv], fp32 or bf16);
   it attends to positions 0..lengths[s]-1, position l at pool slot table[l / block_size] * block_size
   + l % block_size with table = tables + table_starts[s]. K: [slots, kv_heads, d] bf16 with slot
   rows ldk apart, V: [slots, kv_heads, dv] with rows ldv apart. The sequences are shared out over
   `threads` threads, one at a time from a counter (a chunk of prefill rows, each its own sequence,
   has lengths 1, 2, ..., n); fewer sequences than threads (a decode step of one) are cut into parts of
   their KV heads, so that every thread has work. Each head is computed alone, so the bits depend on
   neither the thread count nor the cut. Returns 0, or -1 if out of memory. */
typedef struct {
    const uint16_t *Q, *K, *V;
    long ldq, ldk, ldv, n, block_size, heads, kv_heads, d, dv, ldo, most;
    long parts; /* units per item: each a share of its KV heads */
    const int32_t *tables, *table_starts, *lengths, *rows;
    float scale;
    void *out;
    int out_bf16;
    const long *items; /* each item's first sequence: one, or the rows that rows_together joins */
    long count;        /* items */
    atomic_long next;
    atomic_int failed;
} decode_call;

static void decode_region(void *arg, int t, int T) {
    decode_call *c = arg;
    (void)t, (void)T;
    const long most = c->most + ROWS_MAX, ldp = (most + 15) & ~15L; /* a group's last row: more */
    long *slots = malloc(sizeof(long) * most);
    float *S = malloc(sizeof(float) * ROWS_MAX * c->heads * ldp), *O = malloc(sizeof(float) * ROWS_MAX * c->heads * c->dv);
    /* the tiles' scratch: the packed queries, 16 gathered key rows, a C tile (scores_amx); the weights'
       parts and the value rows in pairs (values_amx) */
    uint16_t *tiles = malloc(sizeof(uint16_t) * ((ROWS_MAX * c->heads + 16) * c->d + 2 * 16 * 16 + 7 * 16 * 32));
    if (!slots || !S || !O || !tiles) {
        atomic_store(&c->failed, 1);
        free(slots), free(S), free(O), free(tiles);
        return;
    }
    for (long u; (u = next_unit(&c->next, c->count * c->parts)) >= 0;) {
        const long item = u / c->parts, part = u % c->parts, s = c->items[item];
        const long R = (item + 1 < c->count ? c->items[item + 1] : c->n) - s; /* rows together */
        const long g0 = part * c->kv_heads / c->parts, g1 = (part + 1) * c->kv_heads / c->parts;
        const int32_t *table = c->tables + c->table_starts[s];
        const long L = c->lengths[s], Lr = L + R - 1;
        for (long l = 0, b = 0; l < Lr; b++)  /* no division per position */
            for (long i = 0; i < c->block_size && l < Lr; i++) slots[l++] = (long)table[b] * c->block_size + i;
        const uint16_t *qs[ROWS_MAX];
        void *outs[ROWS_MAX];
        for (long r = 0; r < R; r++) {
            const long row = c->rows[s + r];
            qs[r] = c->Q + row * c->ldq;
            outs[r] = c->out_bf16 ? (void *)((uint16_t *)c->out + row * c->ldo) : (void *)((float *)c->out + row * c->ldo);
        }
        attend_one(qs, outs, R, c->K, c->ldk, c->V, c->ldv, slots, L, c->heads, c->kv_heads, g0, g1, c->d, c->dv,
                   c->block_size % 16 == 0, c->scale, c->out_bf16, S, O, tiles);
    }
    free(slots), free(S), free(O), free(tiles);
}

int hm_decode_attention_bf16(const uint16_t *Q, long ldq, const uint16_t *K, long ldk, const uint16_t *V,
                             long ldv, const int32_t *tables, const int32_t *table_starts, const int32_t *lengths,
                             const int32_t *rows, long n, long block_size, long heads, long kv_heads, long d,
                             long dv, float scale, void *out, long ldo, int out_bf16, int threads) {
    long *items = malloc(sizeof(long) * (n > 0 ? n : 1)), count = 0;
    if (!items) return -1;
    for (long s = 0; s < n; s += rows_together(table_starts, lengths, s, n, heads / kv_heads, d, dv))
        items[count++] = s;
    decode_call c = {Q, K, V, ldq, ldk, ldv, n, block_size, heads, kv_heads, d, dv, ldo, 1,
                     count < threads ? kv_heads : 1, tables, table_starts, lengths, rows, scale, out, out_bf16,
                     items, count};
    for (long s = 0; s < n; s++) c.most = lengths[s] > c.most ? lengths[s] : c.most;
    atomic_init(&c.next, 0);
    atomic_init(&c.failed, 0);
    hm_parallel(decode_region, &c, (int)min_l(threads, count * c.parts));
    free(items);
    return atomic_load(&c.failed) ? -1 : 0;
}

/* ---- Prefill attention: a chunk of n queries over its L positions, causal, bf16 K/V. ----

   torch's CPU flash kernel spends most of a bf16 prefill chunk's attention on the softmax and on the
   masked half (9/3 heads of 64, 512 queries over 1024 positions: ~15 ms, ~60 GFLOP/s, one thread).
   Here, flash-attention style, for each KV head: K is packed once into tiles of 16 keys in pairs
   ([d/2][16][2], what vdpbf16ps multiplies by a broadcast query pair, so a row's 16 scores come out
   in one register with no horizontal sums) and V converted once to fp32; then blocks of query rows
   (every query head of the group at QB positions, so the group shares each K/V load) run against
   blocks of BK keys up to their causal limit, with a running maximum and sum per row (online
   softmax, fp32) and the output accumulated in fp32. Query i of the chunk sits at position L - n + i
   and sees keys 0..L-n+i. */

#define BK 64     /* keys a block; the S tile of a row block is ROWS x BK floats */
#define ROWS 48   /* query rows (position, head of the group) a block, about */

/* S[r][0..32) = q_r . k_j for R packed query rows (dp bf16 each, dp even) and the 32 keys of two
   packed tiles at Kt (dp/2 pairs of 16 keys each, tile after tile). */
ALWAYS_INLINE void qk_tile(const uint16_t *Q, long dp, const uint16_t *Kt, float *S, const int R) {
    __m512 acc[12][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t *K1 = Kt + dp * 16;
    DP_BEGIN
    for (long c = 0; c < dp / 2; c++) {
        bh512 k0 = BH(_mm512_loadu_si512(Kt + c * 32)), k1 = BH(_mm512_loadu_si512(K1 + c * 32));
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, Q + r * dp + 2 * c, 4);
            bh512 qb = BH(_mm512_set1_epi32((int)pair));
            acc[r][0] = dpbf16(acc[r][0], qb, k0);
            acc[r][1] = dpbf16(acc[r][1], qb, k1);
        }
    }
    DP_END
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(S + r * BK, acc[r][0]);
        _mm512_storeu_ps(S + r * BK + 16, acc[r][1]);
    }
}

/* O[r][c0..c0+64) = alpha[r] O[r][..] + sum_{j < keys} P[r][j] Vf[j][c0..] for R rows (O rows ldo apart,
   Vf rows ldv apart, fp32, padded so that 64 columns are always there). */
ALWAYS_INLINE void pv_tile(float *O, long ldo, const float *alpha, const float *P, const float *Vf, long ldv,
                           long keys, const int R) {
    __m512 acc[6][4];
    for (int r = 0; r < R; r++) {
        __m512 a = _mm512_set1_ps(alpha[r]);
        for (int t = 0; t < 4; t++) acc[r][t] = _mm512_mul_ps(a, _mm512_loadu_ps(O + r * ldo + 16 * t));
    }
    for (long j = 0; j < keys; j++) {
        __m512 v[4];
        for (int t = 0; t < 4; t++) v[t] = _mm512_loadu_ps(Vf + j * ldv + 16 * t);
        for (int r = 0; r < R; r++) {
            __m512 p = _mm512_set1_ps(P[r * BK + j]);
            for (int t = 0; t < 4; t++) acc[r][t] = _mm512_fmadd_ps(p, v[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(O + r * ldo + 16 * t, acc[r][t]);
}

/* Scores to softmax numerators in place for one row of a block: keys kb..kb+keys-1, of which the row
   sees the first `seen` (<= 0: none). Updates the row's running maximum *m (of scaled scores) and sum
   *l; returns the factor by which the row's earlier output must be multiplied. */
ALWAYS_INLINE float softmax_row(float *s, long keys, long seen, float scale, float *m, float *l) {
    if (seen > keys) seen = keys;
    if (seen <= 0) {
        for (long j = 0; j < keys; j += 16) _mm512_storeu_ps(s + j, _mm512_setzero_ps());
        return 1.0f;
    }
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (long j = 0; j < seen; j += 16)
        mx = _mm512_mask_max_ps(mx, mask16(seen - j), mx, _mm512_mul_ps(_mm512_loadu_ps(s + j), sc));
    float top = _mm512_reduce_max_ps(mx), m_new = top > *m ? top : *m;
    float alpha = expf(*m - m_new);  /* 0 on the row's first block (*m = -inf) */
    __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(m_new);
    for (long j = 0; j < keys; j += 16) {
        __m512 e = _mm512_maskz_mov_ps(mask16(seen - j), exp512(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, mv)));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    *m = m_new;
    *l = fmaf(*l, alpha, _mm512_reduce_add_ps(sum));
    return alpha;
}

/* One block of rows (positions i0..i0+P-1 of the chunk, G heads each: row r is position i0 + r / G,
   head r % G of the group) against every key block it sees. Qp: the rows packed, dp bf16 each; Kp, Vf:
   the KV head's keys packed and values in fp32 (dvp columns, a multiple of 64). */
static void attend_rows(const uint16_t *Qp, long rows, long G, long i0, long n, long L, long dp, long dvp,
                        const uint16_t *Kp, const float *Vf, float scale, float *S, float *O, float *m, float *l,
                        float *alpha) {
    const long first = L - n + i0, last = L - n + i0 + (rows - 1) / G;  /* positions of the first, last row */
    for (long r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(O, 0, sizeof(float) * rows * dvp);
    for (long kb = 0; kb <= last; kb += BK) {
        long keys = last + 1 - kb < BK ? last + 1 - kb : BK;  /* keys any row of the block sees */
        for (long j = 0; j < keys; j += 32)
            for (long r = 0; r < rows; r += 12) {
                const uint16_t *q = Qp + r * dp, *kt = Kp + (kb + j) * dp;
                float *s = S + r * BK + j;
                switch (rows - r < 12 ? rows - r : 12) {
                case 12: qk_tile(q, dp, kt, s, 12); break;
                case 11: qk_tile(q, dp, kt, s, 11); break;
                case 10: qk_tile(q, dp, kt, s, 10); break;
                case 9: qk_tile(q, dp, kt, s, 9); break;
                case 8: qk_tile(q, dp, kt, s, 8); break;
                case 7: qk_tile(q, dp, kt, s, 7); break;
                case 6: qk_tile(q, dp, kt, s, 6); break;
                case 5: qk_tile(q, dp, kt, s, 5); break;
                case 4: qk_tile(q, dp, kt, s, 4); break;
                case 3: qk_tile(q, dp, kt, s, 3); break;
                case 2: qk_tile(q, dp, kt, s, 2); break;
                default: qk_tile(q, dp, kt, s, 1); break;
                }
            }
        for (long r = 0; r < rows; r++) {
            long seen = kb + keys <= first + 1 ? keys : first + r / G - kb + 1;
            alpha[r] = softmax_row(S + r * BK, keys, seen, scale, m + r, l + r);
        }
        for (long c0 = 0; c0 < dvp; c0 += 64)
            for (long r = 0; r < rows; r += 6) {
                float *o = O + r * dvp + c0;
                const float *p = S + r * BK, *vf = Vf + kb * dvp + c0;
                switch (rows - r < 6 ? rows - r : 6) {
                case 6: pv_tile(o, dvp, alpha + r, p, vf, dvp, keys, 6); break;
                case 5: pv_tile(o, dvp, alpha + r, p, vf, dvp, keys, 5); break;
                case 4: pv_tile(o, dvp, alpha + r, p, vf, dvp, keys, 4); break;
                case 3: pv_tile(o, dvp, alpha + r, p, vf, dvp, keys, 3); break;
                case 2: pv_tile(o, dvp, alpha + r, p, vf, dvp, keys, 2); break;
                default: pv_tile(o, dvp, alpha + r, p, vf, dvp, keys, 1); break;
                }
            }
    }
}

/* Causal attention of a chunk: Q [n, heads, d] bf16 (position rows ldq apart, heads ldqh apart, d
   contiguous), K [L, kv_heads, d] and V [L, kv_heads, dv] bf16 (rows ldk / ldv apart, heads ldkh / ldvh
   apart), out [n, heads, dv] (fp32, or bf16 if out_bf16) with position rows ldo apart, heads dv apart.
   Query i sits at position L - n + i; query head h uses KV head h / (heads / kv_heads). Scores, softmax
   and sums in fp32. Returns 0, or -1 if out of memory. */
int hm_prefill_attention_bf16(const uint16_t *Q, long ldq, long ldqh, const uint16_t *K, long ldk, long ldkh,
                              const uint16_t *V, long ldv, long ldvh, long n, long L, long heads, long kv_heads,
                              long d, long dv, float scale, void *out, long ldo, int out_bf16) {
    const long G = heads / kv_heads, dp = (d + 1) & ~1L, dvp = (dv + 63) & ~63L, Lp = (L + BK - 1) / BK * BK;
    const long P = ROWS / G > 1 ? ROWS / G : 1, rows_max = P * G;  /* positions, rows a block */
    uint16_t *Kp = aligned_alloc(64, sizeof(uint16_t) * Lp * dp), *Qp = malloc(sizeof(uint16_t) * rows_max * dp);
    float *Vf = aligned_alloc(64, sizeof(float) * Lp * dvp), *S = malloc(sizeof(float) * rows_max * BK);
    float *O = malloc(sizeof(float) * rows_max * dvp), *ml = malloc(sizeof(float) * rows_max * 3);
    if (!Kp || !Qp || !Vf || !S || !O || !ml) {
        free(Kp), free(Qp), free(Vf), free(S), free(O), free(ml);
        return -1;
    }
    for (long g = 0; g < kv_heads; g++) {
        /* Kp: tile t of keys 16t..16t+15 holds, for pair c, the 16 keys' elements 2c and 2c+1 */
        memset(Kp, 0, sizeof(uint16_t) * Lp * dp);
        for (long key = 0; key < L; key++) {
            const uint16_t *k = K + key * ldk + g * ldkh;
            uint16_t *t = Kp + (key / 16) * 16 * dp + (key % 16) * 2;
            for (long i = 0; i < d; i++) t[(i / 2) * 32 + (i & 1)] = k[i];
        }
        memset(Vf, 0, sizeof(float) * Lp * dvp);
        for (long key = 0; key < L; key++) {
            const uint16_t *v = V + key * ldv + g * ldvh;
            uint32_t *f = (uint32_t *)(Vf + key * dvp);
            for (long i = 0; i < dv; i++) f[i] = (uint32_t)v[i] << 16;
        }
        for (long i0 = 0; i0 < n; i0 += P) {
            long rows = (n - i0 < P ? n - i0 : P) * G;
            memset(Qp, 0, sizeof(uint16_t) * rows * dp);
            for (long r = 0; r < rows; r++)
                memcpy(Qp + r * dp, Q + (i0 + r / G) * ldq + (g * G + r % G) * ldqh, sizeof(uint16_t) * d);
            attend_rows(Qp, rows, G, i0, n, L, dp, dvp, Kp, Vf, scale, S, O, ml, ml + rows_max, ml + 2 * rows_max);
            for (long r = 0; r < rows; r++) {
                long at = (i0 + r / G) * ldo + (g * G + r % G) * dv;
                __m512 inv = _mm512_set1_ps(1.0f / ml[rows_max + r]);
                for (long c = 0; c < dv; c += 16) {
                    __mmask16 mk = mask16(dv - c);
                    __m512 y = _mm512_mul_ps(_mm512_loadu_ps(O + r * dvp + c), inv);
                    if (out_bf16)
                        _mm256_mask_storeu_epi16((uint16_t *)out + at + c, mk, cvtne(y));
                    else
                        _mm512_mask_storeu_ps((float *)out + at + c, mk, y);
                }
            }
        }
    }
    free(Kp), free(Qp), free(Vf), free(S), free(O), free(ml);
    return 0;
}

/* ---- A decode step's attention block in one call ----

   For the rows of a step whose sequences all bring one token (or every row alone, under batch
   invariance), layers/attention.py's forward is: q, k, v = linear(x) (bf16, biases), per-head RMSNorm
   of q and k (Qwen3), the rotary embedding, k and v written to the paged pools at the rows' slots,
   hm_decode_attention_bf16 into bf16 rows, then o = linear(attention). Each step here is the C function
   the Python path calls for it, in the same order with the same roundings, so the output is the same,
   bit for bit; what it saves is ~20 torch and Python calls a layer (docs/notes/2026-11-24-gemv-streams.md).
   The projections' weights may be plain bf16 or kept in GGUF blocks (each its own), the latter through
   quant.c's product as quant/tensor.py's `linear` calls it. */

typedef struct {
    const void *w[4];                  /* q, k, v, o: [h d, H], [kvh d, H], [kvh d, H], [H, h d], bf16 or blocks */
    const uint16_t *bias[4];           /* their biases [rows] bf16, or NULL */
    const uint16_t *qn, *kn;           /* per-head RMSNorm weights [d] bf16 (q_norm, k_norm), or NULL */
    uint16_t *kpool, *vpool;           /* [slots, kvh, d] bf16, contiguous */
    long hidden, heads, kv_heads, d;
    long fmt[4];                       /* each weight's ggml block type (quant.c), or 0: plain bf16 */
    long ldw[4];                       /* bytes per row of a weight in blocks */
    long isa;                          /* quant.c's instruction-set path for the weights in blocks */
} attn_block;

/* quant.c's hm_qlinear, for weights kept in GGUF blocks. The two kernels stay in two libraries (this
   one needs AVX512-BF16, quant.c runs on any AVX2 CPU); Python hands this one the other's function
   when it loads that one (hm_bind_quant, native/quant.py). NULL until then. */
typedef int (*qlinear_fn)(int fmt, const void *W, long ldw, long N, long K, const void *x, long ldx, int x_bf16,
                          long M, float *Y, long ldy, int threads, int isa);
static qlinear_fn qlinear;

/* quant.c's qproduct and hm_qlinear_many: several products of one x, quantised once, in one region. */
typedef struct {
    long fmt;
    const void *W;
    long ldw, N;
    float *Y;
    long ldy;
} qproduct;
typedef int (*qmany_fn)(const qproduct *p, long n, long K, const void *x, long ldx, int x_bf16, long M, int threads,
                        int isa);
static qmany_fn qmany;

void hm_bind_quant(qlinear_fn f, qmany_fn g) {
    qlinear = f;
    qmany = g;
}

/* Y [M, O] bf16 (rows ldy apart) = bf16(P) + bias, P [M, O] fp32 a product in blocks: quant/tensor.py's
   `linear` rounds the product to bf16, then adds the bias in bf16 (torch's bf16 sum: fp32, rounded once). */
static void round_bias(const float *P, const uint16_t *bias, uint16_t *Y, long ldy, long O, long M) {
    for (long m = 0; m < M; m++)
        for (long o = 0; o < O; o++) {
            float y = round_bf16(P[m * O + o]);
            Y[m * ldy + o] = bf16(bias ? y + f32(bias[o]) : y);
        }
}

/* Y [M, O] bf16 (rows ldy apart) = projection j of the block on X [M, I], as layers/linear.py computes it:
   a bf16 weight as F.linear (hm_linear_bf16); a weight in blocks as quant/tensor.py's `linear`: the fp32
   product rounded to bf16, then the bias added to it in bf16 (torch's bf16 sum: fp32, rounded once).
   scratch: M x O floats. Returns 0, or quant.c's error. */
static int project(const attn_block *a, int j, const uint16_t *X, long ldx, uint16_t *Y, long ldy, long O, long I,
                   long M, int threads, long threaded_min_bytes, float *scratch) {
    const uint16_t *bias = a->bias[j];
    if (!a->fmt[j]) {
        hm_linear_bf16(a->w[j], X, ldx, bias, Y, ldy, O, I, M, 2 * O * I < threaded_min_bytes ? 1 : threads);
        return 0;
    }
    if (!qlinear) return -1;
    int status = qlinear((int)a->fmt[j], a->w[j], a->ldw[j], O, I, X, ldx, 1, M, scratch, O,
                         a->ldw[j] * O < threaded_min_bytes ? 1 : threads, (int)a->isa);
    if (status == 0) round_bias(scratch, bias, Y, ldy, O, M);
    return status;
}

/* Several bf16 products' units in one region (each unit as gemm_unit computes it alone). */
typedef struct {
    const gemm_call *c;
    long n, first[5]; /* product i's units are first[i] .. first[i + 1] - 1 */
    atomic_long next;
} gemms_call;

static void gemms_region(void *arg, int t, int T) {
    (void)t;
    (void)T;
    gemms_call *g = arg;
    for (long u; (u = next_unit(&g->next, g->first[g->n])) >= 0;) {
        long i = part_of(g->first, g->n, &u);
        gemm_unit(&g->c[i], u);
    }
}

/* q, k and v (projections 0..2) of X [M, I] into Y[j] [M, O[j]] bf16 (rows O[j] apart), each as project()
   gives it, bit for bit, but the three in one region of up to `threads` threads where they are alike:
   all plain bf16 (their units shared out together), or all in blocks (quant.c's hm_qlinear_many: X
   quantised once per kind of activations, not once per projection). Apart, k and v (a fifth of q's
   bytes each on Qwen3-30B-A3B) fell under threaded_min_bytes and ran on one thread while the other
   waited; now they go wherever q goes: on threads where q alone has threaded_min_bytes. (Counting
   the three together sent the demo's 1.1 MB of q, k and v to two threads, where its attention half
   took ~20 us longer: docs/notes/2026-11-25-decode-two-threads.md.) scratch: M (O[0] + O[1] + O[2])
   floats. */
static int project_qkv(const attn_block *a, const uint16_t *X, long ldx, uint16_t *const Y[3], const long O[3],
                       long I, long M, int threads, long threaded_min_bytes, float *scratch) {
    int blocks = 0;
    long bytes = 0; /* the largest projection's */
    for (int j = 0; j < 3; j++) {
        blocks += a->fmt[j] != 0;
        const long b = a->fmt[j] ? a->ldw[j] * O[j] : 2 * O[j] * I;
        bytes = b > bytes ? b : bytes;
    }
    const int T = bytes < threaded_min_bytes ? 1 : threads;
    if (blocks == 0) {
        out_bf16 b[3];
        gemms_call g = {.n = 3};
        gemm_call c[3];
        for (int j = 0; j < 3; j++) {
            b[j] = (out_bf16){Y[j], O[j], a->bias[j]};
            c[j] = (gemm_call){a->w[j], X, ldx, 0, O[j], I, M, product_rows(O[j], I, M, T), NULL, &b[j]};
            g.first[j + 1] = g.first[j] + gemm_units(&c[j]);
        }
        g.c = c;
        atomic_init(&g.next, 0);
        hm_parallel(gemms_region, &g, (int)min_l(T, g.first[3]));
        return 0;
    }
    if (blocks < 3 || !qmany) {
        int status = 0;
        for (int j = 0; j < 3 && !status; j++)
            status = project(a, j, X, ldx, Y[j], O[j], O[j], I, M, threads, threaded_min_bytes, scratch);
        return status;
    }
    qproduct p[3];
    for (int j = 0, at = 0; j < 3; at += M * O[j], j++)
        p[j] = (qproduct){a->fmt[j], a->w[j], a->ldw[j], O[j], scratch + at, O[j]};
    int status = qmany(p, 3, I, X, ldx, 1, M, T, (int)a->isa);
    for (int j = 0; j < 3 && !status; j++) round_bias(p[j].Y, a->bias[j], Y[j], O[j], O[j], M);
    return status;
}

/* x [T, H] bf16 (rows ldx apart) -> out [T, H] bf16 (rows ldo apart). C, S: [T, d] fp32 cos and sin, rows
   ldc apart; slots [T] int64: each row's pool slot; tables .. n: hm_decode_attention_bf16's, covering
   every row. Products of fewer than threaded_min_bytes of weights stay on one thread. Returns 0, or
   nonzero: out of memory, or quant.c's error for a weight in blocks. */
static int attention_block(const attn_block *a, const uint16_t *X, long ldx, long T, const float *C, const float *S,
                            long ldc, const int64_t *slots, const int32_t *tables, const int32_t *table_starts,
                            const int32_t *lengths, const int32_t *rows, long n, long block_size, float scale,
                            float eps, uint16_t *out, long ldo, int threads, long threaded_min_bytes) {
    const long H = a->hidden, d = a->d, hd = a->heads * d, kd = a->kv_heads * d;
    const long most = hd + 2 * kd > H ? hd + 2 * kd : H;
    uint16_t *buf = malloc(sizeof(uint16_t) * T * (3 * hd + 3 * kd) + sizeof(float) * T * most);
    if (!buf) return -1;
    uint16_t *q = buf, *k = q + T * hd, *v = k + T * kd, *qr = v + T * kd, *kr = qr + T * hd, *att = kr + T * kd;
    float *scratch = (float *)(att + T * hd);  /* [T, max(h d + 2 kvh d, H)]: products in blocks before rounding */
    uint16_t *const qkv[3] = {q, k, v};  /* [T, h d], [T, kvh d], [T, kvh d] */
    const long O[3] = {hd, kd, kd};
    int status = project_qkv(a, X, ldx, qkv, O, H, T, threads, threaded_min_bytes, scratch);
    if (status) {
        free(buf);
        return status;
    }
    if (a->qn) { /* in place: each head's row is read whole before it is written */
        for (long r = 0; r < T * a->heads; r++) rmsnorm_row(q + r * d, a->qn, q + r * d, d, eps);
        for (long r = 0; r < T * a->kv_heads; r++) rmsnorm_row(k + r * d, a->kn, k + r * d, d, eps);
    }
    for (long t = 0; t < T; t++) {
        for (long h = 0; h < a->heads; h++)
            rotary_head(q + t * hd + h * d, C + t * ldc, S + t * ldc, qr + t * hd + h * d, d);
        for (long h = 0; h < a->kv_heads; h++)
            rotary_head(k + t * kd + h * d, C + t * ldc, S + t * ldc, kr + t * kd + h * d, d);
        memcpy(a->kpool + slots[t] * kd, kr + t * kd, sizeof(uint16_t) * kd);
        memcpy(a->vpool + slots[t] * kd, v + t * kd, sizeof(uint16_t) * kd);
    }
    status = hm_decode_attention_bf16(qr, hd, a->kpool, kd, a->vpool, kd, tables, table_starts, lengths, rows, n,
                                      block_size, a->heads, a->kv_heads, d, d, scale, att, hd, 1, threads);
    if (status == 0) status = project(a, 3, att, hd, out, ldo, H, hd, T, threads, threaded_min_bytes, scratch);
    free(buf);
    return status;
}

/* The attention half of a decoder layer (layers/decoder.py) around attention_block: h = RMSNorm(x)
   with in_w, the block on h, x_out = x + its output (bf16 sum, as torch adds bf16 tensors), h_out =
   RMSNorm(x_out) with post_w, the feed-forward's input; both norms with norm_eps. x_out, h_out: [T, H]
   bf16 contiguous. Where next_w ([next_rows, H] bf16) is given, next_out [T, next_rows] = h_out next_w^T
   as hm_linear_bf16 computes it: the feed-forward half's first product (an MoE block's router), without
   a return to Python between. Returns 0, or attention_block's error. */
int hm_decoder_attention_bf16(const attn_block *a, const uint16_t *in_w, const uint16_t *post_w, float norm_eps,
                              const uint16_t *X, long ldx, long T, const float *C, const float *S, long ldc,
                              const int64_t *slots, const int32_t *tables, const int32_t *table_starts,
                              const int32_t *lengths, const int32_t *rows, long n, long block_size, float scale,
                              float eps, uint16_t *x_out, uint16_t *h_out, int threads, long threaded_min_bytes,
                              const uint16_t *next_w, long next_rows, uint16_t *next_out) {
    const long H = a->hidden;
    uint16_t *h = malloc(sizeof(uint16_t) * 2 * T * H), *o = h + T * H;
    if (!h) return -1;
    for (long t = 0; t < T; t++) rmsnorm_row(X + t * ldx, in_w, h + t * H, H, norm_eps);
    int status = attention_block(a, h, H, T, C, S, ldc, slots, tables, table_starts, lengths, rows, n,
                                         block_size, scale, eps, o, H, threads, threaded_min_bytes);
    if (status == 0)
        for (long t = 0; t < T; t++) {
            for (long i = 0; i < H; i++) x_out[t * H + i] = bf16(f32(X[t * ldx + i]) + f32(o[t * H + i]));
            rmsnorm_row(x_out + t * H, post_w, h_out + t * H, H, norm_eps);
        }
    if (status == 0 && next_w) /* the feed-forward half's first product on h_out, as F.linear's */
        hm_linear_bf16(next_w, h_out, H, NULL, next_out, next_rows, next_rows, H, T,
                       2 * next_rows * H < threaded_min_bytes ? 1 : threads);
    free(h);
    return status;
}

/* ---- A decode step's MoE layers in one call ----

   A decode step runs, per layer, the attention half, the router's choice and the routed
   experts: three calls into C with Python and torch between them, which after each call's weight stream
   run on emptied caches (~0.1-0.3 ms a layer; docs/notes/2026-12-06-decode-layers-in-one-call.md). Here
   consecutive layers run in one call, each as the calls it replaces, in their order and with their bits:
   hm_decoder_attention_bf16 (with the router's product), route_row (layers/moe.py softmax_topk), then the
   experts (quant.c's hm_qmoe_tokens through a pointer, or hm_moe_tokens_bf16) and the residual sum as
   torch rounds it, or a Qwen2-MoE block's hm_shared_moe_tokens_bf16. A layer is DL_FIELDS int64 fields (the
   enum below; floats as their bits). */
enum {
    DL_ATTN, DL_IN_W, DL_POST_W, DL_NORM_EPS, DL_SCALE, DL_QK_EPS, /* hm_decoder_attention_bf16's */
    DL_ROUTER, DL_ROUTER_ROWS,                                       /* its next_w: the router's rows first */
    DL_E, DL_K, DL_RENORM,                                           /* route_row's */
    DL_KIND, DL_EXPERTS, DL_INTER, DL_DOWN, DL_S,                    /* the experts: DL_QUANT, DL_BF16, DL_SHARED */
    DL_FIELDS
};
enum { DL_QUANT, DL_BF16, DL_SHARED };

typedef int (*qmoe_fn)(const int64_t *experts, long E, const int64_t *ids, const float *w, long T, long K,
                       const void *x, int x_bf16, long H, long I, int threads, int isa, void *out);

static float bits_f32(int64_t v) {
    const uint32_t u = (uint32_t)v;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Layers [0, L) of a decode step of T tokens, one per sequence: X [T, H] bf16 in, x_out [T, H] the last
   layer's output. hs [L, T, H]: each layer's post-attention norm (the experts' input: the runtime's
   look-ahead reads it); ids, w [L, T, K]: each router's choice; secs [L]: each layer's experts' time. The
   step's attention arguments as hm_decoder_attention_bf16 takes them; threads: its threads, workers: the
   experts'; qmoe, isa: quant.c's hm_qmoe_tokens and its path (experts in blocks: the T tokens in one
   call; plain bf16 experts too, with or without a shared expert, each expert's tokens' rows gathered:
   hm_moe_tokens_bf16, hm_shared_moe_tokens_bf16, each token's bits as alone, which the caller asks for
   where the runtime's mix_tokens gives those rows to the bf16 kernels). Returns the number of layers
   done: L, or fewer where a router's logit was not finite or a call found no memory for its scratch;
   x_out is then the
   input of the first layer not done, which the caller runs its own way (its attention writes the same
   K and V again). */
long hm_decode_layers_bf16(const int64_t *layers, long L, long T, long H, const uint16_t *X, const float *C,
                           const float *S, long ldc, const int64_t *slots, const int32_t *tables,
                           const int32_t *table_starts, const int32_t *lengths, const int32_t *rows, long n,
                           long block_size, int threads, long threaded_min_bytes, int workers, qmoe_fn qmoe,
                           int isa, uint16_t *hs, int64_t *ids, float *w, double *secs, uint16_t *x_out) {
    long max_rows = 0;
    for (long l = 0; l < L; l++) {
        const int64_t *f = layers + l * DL_FIELDS;
        if (f[DL_ROUTER_ROWS] > max_rows) max_rows = f[DL_ROUTER_ROWS];
    }
    /* x [T, H]: after attention; out [T, H]: the experts' sums; row [T, max_rows]: the routers' logits */
    uint16_t *x = malloc(sizeof(uint16_t) * T * (2 * H + max_rows)), *out = x + T * H, *row = x + 2 * T * H;
    if (!x) return 0;
    memcpy(x_out, X, sizeof(uint16_t) * T * H);
    long l = 0;
    for (; l < L; l++) {
        const int64_t *f = layers + l * DL_FIELDS;
        const long K = f[DL_K], E = f[DL_E], N = f[DL_ROUTER_ROWS];
        uint16_t *h = hs + l * T * H;
        int64_t *lid = ids + l * T * K;
        float *lw = w + l * T * K;
        int status = hm_decoder_attention_bf16(
            (const attn_block *)f[DL_ATTN], (const uint16_t *)f[DL_IN_W], (const uint16_t *)f[DL_POST_W],
            bits_f32(f[DL_NORM_EPS]), x_out, H, T, C, S, ldc, slots, tables, table_starts, lengths, rows, n,
            block_size, bits_f32(f[DL_SCALE]), bits_f32(f[DL_QK_EPS]), x, h, threads, threaded_min_bytes,
            (const uint16_t *)f[DL_ROUTER], N, row);
        if (status) break;
        long t = 0;
        for (; t < T; t++)
            if (route_row(row + t * N, 1, E, K, (int)f[DL_RENORM], lid + t * K, lw + t * K)) break;
        if (t < T) break; /* x_out: the layer's input */
        const double t0 = now_s();
        const int64_t *experts = (const int64_t *)f[DL_EXPERTS];
        if (f[DL_KIND] == DL_QUANT) { /* every token in one call, as the runtime mixes them */
            status = qmoe(experts, E, lid, lw, T, K, h, 1, H, f[DL_INTER], workers, isa, out);
        } else if (f[DL_KIND] == DL_SHARED) { /* plain bf16 experts and a shared expert */
            status = T == 1 ? hm_shared_moe_token_bf16(experts, lid, lw, K, h, H, f[DL_INTER], row + E,
                                                       (const uint16_t *)f[DL_DOWN], f[DL_S], x, workers, out)
                            : hm_shared_moe_tokens_bf16(experts, E, lid, lw, T, K, h, H, f[DL_INTER], row + E, N,
                                                        (const uint16_t *)f[DL_DOWN], f[DL_S], x, workers, out);
        } else { /* plain bf16 experts, each read once for the step's tokens */
            status = T == 1 ? hm_moe_token_bf16(experts, lid, lw, K, h, H, f[DL_INTER], workers, out)
                            : hm_moe_tokens_bf16(experts, E, lid, lw, T, K, h, H, f[DL_INTER], workers, out);
        }
        if (!status) {
            if (f[DL_KIND] == DL_SHARED) /* the block's call made the residual sum */
                memcpy(x_out, out, sizeof(uint16_t) * T * H);
            else
                for (long i = 0; i < T * H; i++) x_out[i] = bf16(f32(x[i]) + f32(out[i])); /* x + out, torch's */
        }
        secs[l] = now_s() - t0;
        if (status) break; /* x_out is written only by a call that succeeds: still the layer's input */
    }
    free(x);
    return l;
}
