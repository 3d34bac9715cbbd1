/* Integer kernels on GGUF weight blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), as llama.cpp stores them.

   Y[m, n] = sum_k W[n, k] X[m, k]. The weights stay in their blocks, read in place (a row is the blocks of
   one output, as in the file). The activations are quantised once per row to int8, as llama.cpp's q8
   formats do: for the formats with blocks of 32, per block of 32 (scale dx = max|x| / 127); for the
   K-quants, per super-block of 256, with the sums of each 16 values kept beside them. Every weight is
   unpacked to a small unsigned integer q (0..15, 0..31, 0..63; Q8_0's int8 as it is, or plus 128), whose
   products with the activation bytes are summed exactly in 32-bit integer lanes of four products each:
   AVX512-VNNI's vpdpbusd in one instruction, AVX2's vpmaddubsw + vpmaddwd in two. Scales are applied in
   fp32.

   Both paths give the same bits. The integer lane sums are exact, so the same in both whichever
   instructions made them, and a row's lanes are summed in integers before any float operation: Q8_0,
   Q4_0, Q4_1 per block, the row's one sum taking fma(I_b, w_b * dx_b) per block (Q4_1 then
   fma(S_b * dx_b, m_b) too: "block sums"); Q4_K, Q5_K, Q6_K per super-block, to one scaled dot and one
   minimums' (Q6_K: offset's) term per row, each added by one fma (K_FMA). The float operations are the
   same on every path in the same order, so an AMX tile's sums, a register of eight or sixteen rows' and
   one row's give the same result. A row's result depends on nothing but the row: not on how many rows
   came with it, nor on which thread computed it.

   Work is split over the threads of pool.h in units of whole output rows. The library is compiled without
   ISA flags: each path carries its own target attribute and the caller picks one from the CPU's flags
   (hybridmoe/native/quant.py).

   Besides the products: quantisers (rows of fp32 to blocks, hm_quantize) and the way back for a few rows
   (hm_qrows, a token embedding's lookup). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "rows.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define MIX_TARGET AVX2
#include "mix.h"

/* ggml type ids (gguf.GGMLQuantizationType) */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
/* Not ggml types: Q4_K, Q5_K and Q6_K blocks whose rows are interleaved eight at a time, Q8_0, Q4_0 and Q4_1
   blocks whose rows are interleaved sixteen at a time (the layouts at "rows in eights" and
   "rows in sixteens" below; hybridmoe/quant/formats.py's q4_k_x8, q5_k_x8, q6_k_x8, q8_0_x16,
   q4_0_x16, q4_1_x16). */
enum { Q4_K_X8 = 268, Q5_K_X8 = 269, Q6_K_X8 = 270, Q8_0_X16 = 264, Q4_0_X16 = 258, Q4_1_X16 = 259 };
enum { PATH_AVX2 = 1, PATH_AVXVNNI = 2, PATH_AVX512 = 3 };

/* Tokens per pass over a tile of weight rows (the kernels keep one accumulator set per token in
   registers), and the weight bytes a tile of rows spans: small enough to stay in L1 while every group of
   tokens passes over it. A group's activations must stay in L1 too: blocks of 32 keep ~3 bytes per
   element of a token (its int8 values, a scale and a byte sum per lane), so 8 tokens of K = 2048 (48 KB)
   spilled to L2 and ran slower per token than one; 4 ran 2.4x faster than 8 at 8 tokens
   (docs/notes/2026-11-24-prefill-tiles.md). */
#define GROUP 4
#define TILE_BYTES 16384
/* Set in R where x8_vnni (interleaved rows) or product_tiles (GGUF's rows) calls a kernel: these tokens are the
   first of their chunk to meet the rows, which then come from RAM or a far cache, so the kernel asks for them
   ahead as it goes (prefetch_near_far, prefetch_far; on AVX2 in its first pass, a token or two); the passes
   after it find the rows in L1 and ask for nothing. One-token calls always ask (R == 1, a constant).
   Where only those asked, a Q6_K matrix of 1536 x 1536 met 8 tokens from RAM in 277 us against 113 from L1,
   and now in 109 (one thread, Zen 5; Q4_K 2048 x 2048 at 8 tokens 234 -> 140 us, at 32 690 -> 531); the AVX2
   kernels, which asked in every pass, run 5-10% faster from 4 tokens on
   (docs/notes/2026-12-08-rows-ahead-for-every-token-count.md). */
#define FIRST_GROUP 0x100
/* Weight rows a one-token K-quant product takes side by side. */
#define ONE_ROWS 2
/* Tokens whose activations one unit's tiles meet before the next tokens: about 64 x 6 KB (blocks of 32,
   K = 2048) stays in L2 while a unit's tiles pass, where a prefill chunk's whole set (3 MB at 512 tokens)
   came from L3 for every tile. And the fewest rows a unit has, so that those activations serve several
   tiles of rows before they are read again. */
#define CHUNK_TOKENS 64
#define MIN_UNIT_ROWS 16
/* Weight bytes of one unit of work handed to a thread: large enough that taking a unit (an atomic add)
   costs nothing beside it and that each thread's stream runs long enough for the core's prefetchers,
   small enough that 2..16 threads get several units each from one expert (a Qwen3-30B-A3B Q4_K
   expert: ~7 of gate/up, ~3.5 of down). 64 KB units had two threads' streams alternate every 64 KB;
   at 256 KB the Qwen3-30B-A3B shape's decode loop, two threads, took 28.5-30.1 -> 26.2-28.2 ms a
   token over 16 layers, and the 4-layer file's decode went 114-116 -> 122-123 tok/s (one thread
   67-68 -> 69-70, prefill level; Intel Xeon VM, docs/notes/2026-12-07-amx-attention-and-decode-plans.md). */
#define UNIT_BYTES 262144
/* How far ahead of the weights being read a one-token K-quant product asks for them (into L2): its work
   per byte leaves too few loads in flight for the hardware prefetcher to keep up with a stream from RAM.
   The same holds for a one-token product of blocks of 32 (Q8_0) over a model's shapes read from RAM,
   though a lone 768x2048 product reads no faster with it (docs/notes/2026-11-25-one-token-kernels.md). */
#define FAR 8192

/* Bytes per block of `fmt` and its elements, 0 for an unknown format. */
static long block_bytes(int fmt) {
    switch (fmt) {
    case Q8_0:
    case Q8_0_X16: return 34;
    case Q4_0:
    case Q4_0_X16: return 18;
    case Q4_1:
    case Q4_1_X16: return 20;
    case Q4_K:
    case Q4_K_X8: return 144;
    case Q5_K:
    case Q5_K_X8: return 176;
    case Q6_K:
    case Q6_K_X8: return 210;
    }
    return 0;
}

static int is_x8(int fmt) { return fmt == Q4_K_X8 || fmt == Q5_K_X8 || fmt == Q6_K_X8; }
static int is_x16(int fmt) { return fmt == Q8_0_X16 || fmt == Q4_0_X16 || fmt == Q4_1_X16; }
/* Rows interleaved by a layout: 8, 16, or 1 for GGUF's rows. */
static int group_rows(int fmt) { return is_x8(fmt) ? 8 : is_x16(fmt) ? 16 : 1; }

/* The ggml type whose blocks a format holds (an interleaved layout: its rows' format). */
static int rows_fmt(int fmt) {
    switch (fmt) {
    case Q4_K_X8: return Q4_K;
    case Q5_K_X8: return Q5_K;
    case Q6_K_X8: return Q6_K;
    case Q8_0_X16: return Q8_0;
    case Q4_0_X16: return Q4_0;
    case Q4_1_X16: return Q4_1;
    }
    return fmt;
}

static int is_k(int fmt) {
    fmt = rows_fmt(fmt);
    return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K;
}

static long block_elems(int fmt) { return is_k(fmt) ? 256 : 32; }

/* What the AVX-512 path subtracts per activation byte: Q8_0's weights are flipped to unsigned (+128),
   Q4_0's nibbles carry an offset of 8. */
static int offset_of(int fmt) { return rows_fmt(fmt) == Q8_0 ? 128 : rows_fmt(fmt) == Q4_0 ? 8 : 0; }

/* How the lines FAR ahead are asked for: into L2 (_MM_HINT_T1), or as non-temporal on AMD's Zen 5
   (_MM_HINT_NTA: native/build.py, far_hint_flag), where the one-token products read as fast or faster so (Q4_K
   4096 x 2048 from RAM, 1 thread, 34.5 -> 37.2 GB/s; Q8_0 38.5 -> 39.1) and the weights a decode step
   streams leave more of the caches' lines to the Python between two kernels (its inputs 71 -> 57 us a
   step, the final norm 40 -> 33: docs/notes/2026-12-07-attention-prefetch.md). */
#ifndef FAR_HINT
#define FAR_HINT _MM_HINT_T1
#endif

/* Ask for `bytes` from p + FAR on into L2 (or as FAR_HINT says). */
ALWAYS_INLINE void prefetch_far(const uint8_t *p, long bytes) {
    for (long c = 0; c < bytes; c += 64) _mm_prefetch((const char *)p + FAR + c, FAR_HINT);
}

/* Ask for `bytes` from p + NEAR on into L1 as well as from p + FAR on into L2: a stream read at the pace
   of the one-token Q4_K_X8 product leaves the lines just ahead to the hardware, which on an Intel core
   (a Sapphire Rapids-class VM, ~13 GB/s a core) asked for them too late; asked for here, the product read
   a 1.2 GB set of 4096 x 2048 matrices at 9.98 GB/s against 8.51 (docs/notes/2026-12-06-one-token-streams.md).
   The two-row products of Q6_K and blocks of 32 read no faster with it. On AMD's Zen 5 (an EPYC VM, ~39 GB/s
   a core) the near requests slowed the same product from RAM instead: 768 x 2048 29.5 -> 21.8 GB/s,
   4096 x 2048 35.0 -> 24.3 (docs/notes/2026-12-07-bf16-emulated.md), so the library asks for them on Intel's
   cores alone (native/quant.py, NEAR_PREFETCH by vendor). */
#define NEAR 512
#ifndef NEAR_PREFETCH
#define NEAR_PREFETCH 1
#endif
ALWAYS_INLINE void prefetch_near_far(const uint8_t *p, long bytes) {
    for (long c = 0; c < bytes; c += 64) {
#if NEAR_PREFETCH
        _mm_prefetch((const char *)p + NEAR + c, _MM_HINT_T0);
#endif
        _mm_prefetch((const char *)p + FAR + c, FAR_HINT);
    }
}

/* AVX-VNNI (Intel's client cores from Alder Lake on; AMD's Zen 5): vpdpbusd and vpdpwssd on ymm registers,
   VEX-encoded, for the AVX2 kernels of interleaved rows on PATH_AVXVNNI. Inline assembly, not intrinsics:
   an intrinsic needs the avxvnni target in the function that holds it, and each of these kernels is one
   body for both AVX2 paths (its `vnni` a constant), run with them only where the CPU has them (native/
   quant.py). The integers are those of vpmaddubsw, vpmaddwd and the adds they replace, exactly. */
#if AVXVNNI_ASM
AVX2 ALWAYS_INLINE __m256i vnni_dpbusd(__m256i acc, __m256i u8, __m256i s8) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(s8));
    return acc;
}
AVX2 ALWAYS_INLINE __m256i vnni_dpwssd(__m256i acc, __m256i a, __m256i b) {
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}
#else /* an assembler without them (binutils before 2.36): the path is not offered (native/quant.py) */
AVX2 ALWAYS_INLINE __m256i vnni_dpbusd(__m256i acc, __m256i u8, __m256i s8) { (void)u8, (void)s8; abort(); return acc; }
AVX2 ALWAYS_INLINE __m256i vnni_dpwssd(__m256i acc, __m256i a, __m256i b) { (void)a, (void)b; abort(); return acc; }
#endif

static uint16_t ld16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

AVX2 static float half_at(const uint8_t *p) { return _cvtsh_ss(ld16(p)); }

/* Q4_K, Q5_K and Q6_K, every path: a super-block of a row against a token gives two exact integers, its scaled
   dot (the sum over its sub-blocks of scale x the integer dot, `isum`) and its minimums' term (`csum`: the
   sum of minimum x the activations' 16-value sums; Q6_K: of scale x those sums, for its offset of 32). The
   row's two fp32 sums take one fused multiply-add each per super-block, in the order of the super-blocks:
   acc = fma(isum, d dx, acc), accm = fma(csum, dm dx, accm) (dm: Q4_K's and Q5_K's -dmin, Q6_K's -32 d; d dx, dm dx:
   fp32 products; both in one register); the result is acc + accm. Where the integers' lanes are summed
   does not change them, so each path sums its lanes wherever it is cheapest: Q4_K rows in eights sum a
   sub-block's four 8-byte chunks before its scale, one vpdpwssd where there were four (dotk_x8_512_t).
   Q4_K: |isum| <= 256 x 15 x 127 x 63 < 2^25 (Q5_K, q <= 31: < 2^26); Q6_K: |isum| <= 256 x 63 x 128 x 128 < 2^29, |csum| <= 16 x
   128 x 2048 < 2^23; they convert to fp32 rounded to nearest, as (float) does. (Q5_K kept its lanes in
   fp32 until it had rows in eights too. Q6_K's GGUF rows, summed in integers, read from RAM level on AVX2 and 4%
   slower row by row on AVX-512, whose products now read Q6_K in rows of eights, which need the integer
   sums for the tiles: docs/notes/2026-12-07-q4k-sums-in-integers.md, 2026-12-07-q6k-rows-in-eights.md.) */
#define K_FMA(am, u, d, dm, dx) /* am = [acc, accm, 0, 0], u = [isum, csum, ...] */ \
    (am) = _mm_fmadd_ps(_mm_cvtepi32_ps(u), _mm_mul_ps(_mm_setr_ps(d, dm, 0.0f, 0.0f), _mm_set1_ps(dx)), am)
#define K_RESULT(am) (_mm_cvtss_f32(am) + _mm_cvtss_f32(_mm_movehdup_ps(am)))

/* ---- activations ------------------------------------------------------------------------------------ */

/* Quantised activation rows, as one format family's kernels read them. */
typedef struct {
    long K;
    int8_t *qs;     /* [M, K] */
    float *dx;      /* K-quants: [M, K/256], the super-block's scale */
    float *db;      /* blocks of 32: [M, K/32], the block's scale */
    int32_t *ob;    /* blocks of 32: [M, K/32], offset_of(fmt) * the block's byte sum */
    float *sf;      /* Q4_1: [M, K/32], db * the block's byte sum (its minimums' term); NULL for the others */
    int16_t *bsum;  /* K-quants: [M, K/256, 16], sums of each 16 bytes */
    int32_t *bpair; /* K-quants: [M, K/256, 4], dword j: the sums of natural blocks 2j, 2j + 1 as words */
    int8_t *qt;     /* NULL, or qs's first M / 16 * 16 rows for AMX tiles (acts_of's `tiles`) */
    float *dbt;     /* with qt, blocks of 32: db of each 16 rows block by block, [M / 16, K/32, 16], then
                       their sf likewise (sft) */
    float *sft;
    void *mem;
} acts;

/* 32 values of row x (fp32, or bf16 when x_bf16) from element `at`, as fp32. */
AVX2 ALWAYS_INLINE void load32(const void *x, int x_bf16, long at, __m256 v[4]) {
    for (int i = 0; i < 4; i++) {
        if (x_bf16) {
            __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + 8 * i));
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
            v[i] = _mm256_loadu_ps((const float *)x + at + 8 * i);
        }
    }
}

AVX2 ALWAYS_INLINE float amax32(const __m256 v[4]) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                             _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* 32 values times id, rounded to nearest even (as lrintf), to int8 at q. */
AVX2 ALWAYS_INLINE void round32(const __m256 v[4], float id, int8_t *q) {
    const __m256 s = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], s));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], s));
    __m256i w01 = _mm256_packs_epi32(i0, i1), w23 = _mm256_packs_epi32(i2, i3);  /* lane-interleaved */
    __m256i b = _mm256_packs_epi16(w01, w23);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, b);
}

/* Blocks of 32: M rows of K values (rows[m] of x, or row m where rows is NULL) -> qs, and per block db,
   ob, sf. */
AVX2 static void q8_rows(const void *x, long ldx, int x_bf16, const long *rows, long M, long K, int offset, acts *a) {
    long nb = K / 32;
    for (long m = 0; m < M; m++) {
        const long xm = (rows ? rows[m] : m) * ldx;
        for (long b = 0; b < nb; b++) {
            __m256 v[4];
            load32(x, x_bf16, xm + b * 32, v);
            float amax = amax32(v), d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = a->qs + m * K + b * 32;
            round32(v, id, q);
            /* the block's sum: sums of q + 128 over each 8 bytes, less 32 x 128 */
            const __m256i s4 = _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)q), _mm256_set1_epi8((char)0x80)),
                                               _mm256_setzero_si256());
            const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
            const int sum = _mm_cvtsi128_si32(_mm_add_epi64(s2, _mm_unpackhi_epi64(s2, s2))) - 32 * 128;
            a->db[m * nb + b] = d;
            a->ob[m * nb + b] = offset * sum;
            if (a->sf) a->sf[m * nb + b] = (float)sum * d;
        }
    }
}

/* K-quants: M rows of K values -> qs, dx per 256 values, bsum per 16. `paired` stores each super-block's
   eight blocks of 32 in the order 0 2 1 3 4 6 5 7: the order in which one 64-byte load of Q4_K/Q5_K
   nibbles unpacks (groups g, g+1 -> low nibbles of both, then high nibbles of both). */
AVX2 static void q8k_rows(const void *x, long ldx, int x_bf16, const long *rows, long M, long K, int paired,
                          acts *a) {
    static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    long ns = K / 256;
    for (long m = 0; m < M; m++) {
        const long xm = (rows ? rows[m] : m) * ldx;
        for (long s = 0; s < ns; s++) {
            __m256 v[8][4];
            float amax = 0.0f;
            for (int j = 0; j < 8; j++) {
                load32(x, x_bf16, xm + s * 256 + 32 * j, v[j]);
                float mj = amax32(v[j]);
                amax = mj > amax ? mj : amax;
            }
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *out = a->qs + m * K + s * 256;
            int16_t *bs = a->bsum + (m * ns + s) * 16;
            for (int j = 0; j < 8; j++) {
                int8_t *q = out + 32 * (paired ? order[j] : j);  /* natural block j goes here */
                round32(v[j], id, q);
                /* the sums of bytes 0..15 and 16..31: pairs, fours, then each 128-bit half's four */
                __m256i f = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *)q)),
                                              _mm256_set1_epi16(1));
                f = _mm256_hadd_epi32(f, f);
                f = _mm256_hadd_epi32(f, f);
                bs[2 * j] = (int16_t)_mm256_extract_epi32(f, 0);
                bs[2 * j + 1] = (int16_t)_mm256_extract_epi32(f, 4);
            }
            for (int j = 0; j < 4; j++) /* |a block's sum| <= 32 x 127: a word */
                a->bpair[(m * ns + s) * 4 + j] = (int32_t)((uint32_t)(uint16_t)(bs[4 * j] + bs[4 * j + 1]) |
                                                           (uint32_t)(uint16_t)(bs[4 * j + 2] + bs[4 * j + 3]) << 16);
            a->dx[m * ns + s] = amax / 127.0f;
        }
    }
}

/* Room for M rows of K values quantised for `fmt` (rows[m] of x, or row m where rows is NULL), and the
   quantisation; 0, or -2 without memory. With `tiles` (products that take the AMX tiles), also the bytes
   of each 16 rows in the order their A tiles read them, `qt`: per 16 rows and 64 columns, 16 x 64 bytes
   in a row. Read in place, 16 rows K bytes apart (K = 2048: 16 lines in 2 sets of the L1 cache), the
   tiles' loads took more time than their products (1 MB copied at 512 tokens: ~50 us). */
static int acts_of(acts *a, int fmt, const void *x, long ldx, int x_bf16, const long *rows, long M, long K,
                   int tiles) {
    long nb = K / 32, ns = K / 256;
    size_t q = ((size_t)(M * K) + 63) & ~(size_t)63;
    size_t per = is_k(fmt) ? (size_t)(M * ns) * (4 + 32 + 16) : (size_t)(M * nb) * 12;
    size_t qt = tiles ? (size_t)(M / 16 * 16 * K) + (is_k(fmt) ? 0 : (size_t)(M / 16 * 16 * nb) * 8) : 0;
    a->K = K;
    a->mem = malloc(q + per + qt + 128);
    if (!a->mem) return -2;
    char *p = a->mem;
    a->qs = (int8_t *)p;
    a->qt = NULL;
    p += q;
    if (tiles) a->qt = (int8_t *)(((uintptr_t)(p + per) + 63) & ~(uintptr_t)63);
    if (is_k(fmt)) {
        a->dx = (float *)p;
        a->bsum = (int16_t *)(p + 4 * M * ns);
        a->bpair = (int32_t *)(p + 36 * M * ns);
        q8k_rows(x, ldx, x_bf16, rows, M, K, rows_fmt(fmt) != Q6_K, a);
    } else {
        a->db = (float *)p;
        a->ob = (int32_t *)(p + 4 * M * nb);
        a->sf = rows_fmt(fmt) == Q4_1 ? (float *)(p + 8 * M * nb) : NULL;
        q8_rows(x, ldx, x_bf16, rows, M, K, offset_of(fmt), a);
    }
    for (long T = 0; a->qt && T < M / 16; T++)
        for (long c = 0; c < K / 64; c++)
            for (int i = 0; i < 16; i++)
                memcpy(a->qt + ((T * (K / 64) + c) * 16 + i) * 64, a->qs + (16 * T + i) * K + 64 * c, 64);
    a->dbt = a->qt && !is_k(fmt) ? (float *)(a->qt + M / 16 * 16 * K) : NULL;
    a->sft = a->dbt && a->sf ? a->dbt + M / 16 * nb * 16 : NULL;
    for (long T = 0; a->dbt && T < M / 16; T++)
        for (long b = 0; b < nb; b++)
            for (int i = 0; i < 16; i++) {
                a->dbt[(T * nb + b) * 16 + i] = a->db[(16 * T + i) * nb + b];
                if (a->sft) a->sft[(T * nb + b) * 16 + i] = a->sf[(16 * T + i) * nb + b];
            }
    return 0;
}

/* ---- unpacking, AVX2: the 32 q bytes of block b of a row (u8; Q8_0: its int8 bytes) --------------- */

AVX2 ALWAYS_INLINE __m256i nibbles(__m128i x) {  /* 16 bytes -> low nibbles, then high nibbles */
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0F));
}

AVX2 ALWAYS_INLINE __m256i bits(__m256i x, int shift, int mask) {  /* (x >> shift) & mask, per byte */
    return _mm256_and_si256(_mm256_srli_epi16(x, shift), _mm256_set1_epi8((char)mask));
}

AVX2 ALWAYS_INLINE __m256i unpack32(int fmt, const uint8_t *blk) {
    switch (fmt) {
    case Q8_0: return _mm256_loadu_si256((const __m256i *)(blk + 2));
    case Q4_0: return nibbles(_mm_loadu_si128((const __m128i *)(blk + 2)));
    default: return nibbles(_mm_loadu_si128((const __m128i *)(blk + 4)));  /* Q4_1 */
    }
}

/* ---- blocks of 32 in block sums (Q8_0, Q4_0, Q4_1) ------------------------------------------------

   Every path: block b of a row against a token gives one exact integer I_b = sum of its 32 (q - offset)
   x (|I_b| <= 32 x 128 x 127 < 2^24, so exact in fp32 too), and the row's one fp32 sum takes
   acc = fma(I_b, w_b dx_b, acc) for b = 0, 1, ... from acc = 0 (w_b dx_b an fp32 product), Q4_1's
   then acc = fma(sf_b, m_b, acc) (sf_b = dx_b x the block's byte sum, an fp32 product: acts' sf). Where a
   block's lanes are summed does not change I_b, so an AMX tile's block product (a 16 x 16 tile of
   them at once) and a VNNI register holding sixteen rows' I_b in its lanes (rows in sixteens) give the
   same bits as GGUF's rows summed here eight rows at a time. (Blocks of 32 had kept eight lanes per block
   in fp32: a tile product would have had to stop at every 4 bytes. docs/notes/2026-12-07-q8-0-tiles.md.
   Q4_1 kept them, with panels for many tokens, until it took block sums too.) */

/* Lane r: the sum of v[r]'s eight lanes. */
AVX2 ALWAYS_INLINE __m256i sum8(const __m256i v[8]) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67); /* rows 0..3 | 4..7 per half */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The fp16 values at byte `at` of eight rows, as fp32. */
AVX2 ALWAYS_INLINE __m256 halves8(const uint8_t *const row[8], long at) {
    return _mm256_cvtph_ps(_mm_setr_epi16((short)ld16(row[0] + at), (short)ld16(row[1] + at), (short)ld16(row[2] + at),
                                          (short)ld16(row[3] + at), (short)ld16(row[4] + at), (short)ld16(row[5] + at),
                                          (short)ld16(row[6] + at), (short)ld16(row[7] + at)));
}

/* Rows n0..n1 of GGUF's Q8_0, Q4_0 or Q4_1 rows against the R tokens mi[0..R), eight rows at a time (the last
   eight repeats its last row where fewer are left), lane r row n + r: the one kernel on those rows for
   both paths (on AVX-512 the rows mostly come in sixteens instead, dot32_x16_512_t). */
AVX2 ALWAYS_INLINE void dot32s_t(const int fmt, const int R, const int ahead, const uint8_t *W, long ldw, long n0,
                                 long n1, const acts *a, const long *mi, float *Y, long ldy) {
    const long bb = block_bytes(fmt), K = a->K, nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    for (long n = n0; n < n1; n += 8) {
        const int c = n1 - n < 8 ? (int)(n1 - n) : 8;
        const uint8_t *row[8];
        for (int i = 0; i < 8; i++) row[i] = W + (n + (i < c ? i : c - 1)) * ldw;
        __m256 acc[GROUP];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (long b = 0; b < nb; b++) {
            /* the next eight rows' line, every other block (34, 18 or 20 bytes): the Q8_0 file read in place (its
               map's 4 KB pages) decoded 50-53 tok/s asking for these rows' lines 8 KB on, 63-79 so */
            if ((R == 1 || ahead) && b % 2 == 0)
                for (int i = 0; i < 8; i++) _mm_prefetch((const char *)row[i] + 8 * ldw + b * bb, FAR_HINT);
            __m256i q[8];
            for (int i = 0; i < 8; i++) q[i] = unpack32(fmt, row[i] + b * bb);
            const __m256 w = halves8(row, b * bb);
            const __m256 wm = fmt == Q4_1 ? halves8(row, b * bb + 2) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a->qs + mi[r] * K + b * 32));
                __m256i L[8];
                for (int i = 0; i < 8; i++) /* Q8_0: |q| times x with q's sign (u8 x s8 pairs fit int16) */
                    L[i] = _mm256_madd_epi16(fmt == Q8_0 ? _mm256_maddubs_epi16(_mm256_abs_epi8(q[i]), _mm256_sign_epi8(x, q[i]))
                                                         : _mm256_maddubs_epi16(q[i], x),
                                             ones);
                __m256i I = sum8(L);
                if (fmt == Q4_0) I = _mm256_sub_epi32(I, _mm256_set1_epi32(a->ob[mi[r] * nb + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(w, _mm256_set1_ps(a->db[mi[r] * nb + b])), acc[r]);
                if (fmt == Q4_1) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a->sf[mi[r] * nb + b]), wm, acc[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            float y[8];
            _mm256_storeu_ps(y, acc[r]);
            for (int i = 0; i < c; i++) Y[r * ldy + n + i] = y[i];
        }
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

/* A super-block's scales, both paths: `words`, the 16 weight scales of its 16-value sub-blocks as int16
   (Q4_K/Q5_K: each block's scale twice, blocks in the unpacked order 0 2 1 3 4 6 5 7; Q6_K: natural);
   mnw, the 16 words that multiply the activation's bsum (natural order): the minimums, or Q6_K's scales
   (for its offset of 32); d and dm: y += d dx (scaled dot) + dm dx (mnw . bsum). */
typedef struct {
    __m256i words, mnw;
    float d, dm;
} kscales;

AVX2 ALWAYS_INLINE kscales kscales_of(int fmt, const uint8_t *p) {
    kscales k;
    if (fmt == Q6_K) {
        k.words = k.mnw = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
        k.d = half_at(p + 208);
        k.dm = -32.0f * k.d;
        return k;
    }
    __m128i v = unpack_scales_k4(p + 4);  /* 8 scales, then 8 minimums */
    k.words = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 0, 2, 2, 1, 1, 3, 3, 4, 4, 6, 6, 5, 5, 7, 7)));
    k.mnw = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
    __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(ld16(p) | (uint32_t)ld16(p + 2) << 16)));  /* d, dmin */
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

/* AVX2: words [scale 2i x 8 | scale 2i+1 x 8], the scales of unpacked half i's two 16-value parts. */
AVX2 ALWAYS_INLINE void half_scales(const kscales *k, __m256i sc[8]) {
    __m256i lo = _mm256_permute2x128_si256(k->words, k->words, 0x00);
    __m256i hi = _mm256_permute2x128_si256(k->words, k->words, 0x11);
    sc[0] = _mm256_shuffle_epi8(lo, WORD_MASK(0, 1));
    sc[1] = _mm256_shuffle_epi8(lo, WORD_MASK(2, 3));
    sc[2] = _mm256_shuffle_epi8(lo, WORD_MASK(4, 5));
    sc[3] = _mm256_shuffle_epi8(lo, WORD_MASK(6, 7));
    sc[4] = _mm256_shuffle_epi8(hi, WORD_MASK(0, 1));
    sc[5] = _mm256_shuffle_epi8(hi, WORD_MASK(2, 3));
    sc[6] = _mm256_shuffle_epi8(hi, WORD_MASK(4, 5));
    sc[7] = _mm256_shuffle_epi8(hi, WORD_MASK(6, 7));
}

/* AVX2: the 8 halves of 32 q bytes of super-block p (Q4_K, Q5_K: block order 0 2 1 3 4 6 5 7; Q6_K:
   natural); halves 2i and 2i + 1 are what AVX-512 holds in one register. */
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

/* Q4_K's two integers of a super-block (K_FMA) from its lanes: u[0] the sum of A's 8, u[1] of C's. */
AVX2 ALWAYS_INLINE __m128i sums2(__m256i A, __m256i C) {
    __m256i h = _mm256_hadd_epi32(A, C);
    h = _mm256_hadd_epi32(h, h); /* per 128-bit half: its A sum, its C sum, twice */
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

AVX2 ALWAYS_INLINE void dotk_avx2_t(const int fmt, const int R, const int ahead, const uint8_t *W, long ldw, long n0,
                                    long n1, const acts *a, const long *mi, float *Y, long ldy) {
    const long bb = block_bytes(fmt), K = a->K, ns = K / 256;
    for (long n = n0; n < n1; n++) {
        const uint8_t *row = W + n * ldw;
        __m128 am[GROUP]; /* K_FMA's two sums */
        for (int r = 0; r < R; r++) am[r] = _mm_setzero_ps();
        for (long s = 0; s < ns; s++) {
            const uint8_t *p = row + s * bb;
            if (R == 1 || ahead) prefetch_far(p, bb);
            __m256i q[8], sc[8];
            unpack_k(fmt, p, q);
            kscales k = kscales_of(fmt, p);
            half_scales(&k, sc);
            for (int r = 0; r < R; r++) {
                long sb = mi[r] * ns + s;
                const int8_t *x = a->qs + mi[r] * K + s * 256;
                __m256i A = _mm256_setzero_si256(), B = _mm256_setzero_si256();
                for (int i = 0; i < 8; i++) {  /* halves 0,1 of register i/2: A takes even, B odd */
                    __m256i p16 = _mm256_maddubs_epi16(q[i], _mm256_loadu_si256((const __m256i *)(x + 32 * i)));
                    __m256i p32 = _mm256_madd_epi16(sc[i], p16);
                    if (i & 1) B = _mm256_add_epi32(B, p32); else A = _mm256_add_epi32(A, p32);
                }
                __m256i C = _mm256_madd_epi16(k.mnw, _mm256_loadu_si256((const __m256i *)(a->bsum + sb * 16)));
                K_FMA(am[r], sums2(_mm256_add_epi32(A, B), C), k.d, k.dm, a->dx[sb]);
            }
        }
        for (int r = 0; r < R; r++) Y[r * ldy + n] = K_RESULT(am[r]);
    }
}

/* AVX-512: the four 64-byte registers of super-block p, register i = [half 2i | half 2i+1] of unpack_k. */
AVX512 ALWAYS_INLINE void unpack_k512(int fmt, const uint8_t *p, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (fmt == Q6_K) {  /* register 2h: ql's low nibbles + qh bits (0,1 | 2,3); 2h+1: high + (4,5 | 6,7) */
        const __m512i up = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);  /* word shifts of the two halves */
        const __m512i down = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
        const __m512i m2 = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            __m512i l = _mm512_loadu_si512((const void *)(p + 64 * h));
            __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h)));
            __m512i hl = _mm512_and_si512(_mm512_sllv_epi64(qh, up), m2);
            __m512i hh = _mm512_and_si512(_mm512_srlv_epi64(qh, down), m2);
            q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), hl);
            q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), hh);
        }
        return;
    }
    const uint8_t *qs = p + (fmt == Q4_K ? 16 : 48);
    __m512i qh = fmt == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 16)))
                             : _mm512_setzero_si512();
    for (int j = 0; j < 2; j++) {  /* groups 2j, 2j+1: low nibbles (bits 4j, 4j+2), high (4j+1, 4j+3) */
        __m512i x = _mm512_loadu_si512((const void *)(qs + 64 * j));
        __m512i lo = _mm512_and_si512(x, m4), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
        if (fmt == Q5_K) {
            const __m512i sixteen = _mm512_set1_epi8(16);
            __m512i blo = _mm512_setr_epi64(1ll << 4 * j, 1ll << 4 * j, 1ll << 4 * j, 1ll << 4 * j, 1ll << (4 * j + 2),
                                            1ll << (4 * j + 2), 1ll << (4 * j + 2), 1ll << (4 * j + 2));
            blo = _mm512_shuffle_epi8(blo, _mm512_setzero_si512());  /* byte 0 of each 128-bit lane, everywhere */
            __m512i bhi = _mm512_add_epi8(blo, blo);
            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, blo), lo, sixteen);
            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, bhi), hi, sixteen);
        }
        q[2 * j] = lo;
        q[2 * j + 1] = hi;
    }
}

/* AVX-512: register i's 16 scales (the 16-value parts of halves 2i and 2i+1), from kscales' words: lane l
   of register i belongs to part 4i + l / 4, its scale in the lane's low word and 0 above (what vpdpwssd
   multiplies a lane's sum of 4 products by: k_token512). */
AVX512 ALWAYS_INLINE void scales_k512(const kscales *k, __m512i sc[4]) {
    static const int16_t part[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    __m512i w = _mm512_castsi256_si512(k->words), j8 = _mm512_loadu_si512((const void *)part);
    for (int i = 0; i < 4; i++)
        sc[i] = _mm512_and_si512(_mm512_permutexvar_epi16(_mm512_add_epi16(j8, _mm512_set1_epi16((short)(4 * i))), w),
                                 _mm512_set1_epi32(0xFFFF));
}

/* A super-block unpacked for AVX-512: its four q registers, their scale words, its scales. */
typedef struct {
    __m512i q[4], sc[4];
    kscales k;
} kblock512;

AVX512 ALWAYS_INLINE void kblock_of(const int fmt, const uint8_t *p, kblock512 *b) {
    unpack_k512(fmt, p, b->q);
    b->k = kscales_of(fmt, p);
    scales_k512(&b->k, b->sc);
}

/* One token's share of super-block b: x its 256 bytes as 4 registers, bsum and dx its sums and scale,
   added into c. A lane's 4 products summed by vpdpbusd fit a word (|sum| <= 4 * 63 * 127), which vpdpwssd
   multiplies by the lane's scale and adds: the exact integers of vpmaddubsw, vpmaddwd and an add, in two
   instructions instead of three (1.1-1.2x on SPR, docs/notes/2026-12-06-prefill-two-threads.md). Q4_K's
   16 + 8 lanes are then summed (sums2) into a row's two sums am (K_FMA). */
AVX512 ALWAYS_INLINE void k_token512(const kblock512 *b, const __m512i x[4], __m256i bsum, float dx, __m128 *am) {
    __m512i A = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) A = _mm512_dpwssd_epi32(A, _mm512_dpbusd_epi32(_mm512_setzero_si512(), b->q[i], x[i]), b->sc[i]);
    __m256i C = _mm256_madd_epi16(b->k.mnw, bsum);
    K_FMA(*am, sums2(_mm256_add_epi32(_mm512_castsi512_si256(A), _mm512_extracti64x4_epi64(A, 1)), C), b->k.d, b->k.dm,
          dx);
}

/* Token row m's 256 bytes of super-block s as 4 registers, and their 16-value sums. */
AVX512 ALWAYS_INLINE void k_acts512(const acts *a, long m, long s, __m512i x[4], __m256i *bsum) {
    const long ns = a->K / 256;
    const int8_t *xs = a->qs + m * a->K + s * 256;
    for (int i = 0; i < 4; i++) x[i] = _mm512_loadu_si512((const void *)(xs + 64 * i));
    *bsum = _mm256_loadu_si256((const __m256i *)(a->bsum + (m * ns + s) * 16));
}

/* Rows n..n+RR of Y for token row m alone (decode): the rows side by side, so that their independent
   work overlaps and they share the activation loads. */
AVX512 ALWAYS_INLINE void dotk_512_rows(const int fmt, const int RR, const uint8_t *W, long ldw, long n,
                                        const acts *a, long m, float *Y) {
    const long bb = block_bytes(fmt), ns = a->K / 256;
    __m128 am[ONE_ROWS];
    for (int j = 0; j < RR; j++) am[j] = _mm_setzero_ps();
    for (long s = 0; s < ns; s++) {
        __m512i x[4];
        __m256i bsum;
        k_acts512(a, m, s, x, &bsum);
        for (int j = 0; j < RR; j++) {
            const uint8_t *p = W + (n + j) * ldw + s * bb;
            kblock512 b;
            prefetch_far(p, bb);
            kblock_of(fmt, p, &b);
            k_token512(&b, x, bsum, a->dx[m * ns + s], &am[j]);
        }
    }
    for (int j = 0; j < RR; j++) Y[n + j] = K_RESULT(am[j]);
}

AVX512 ALWAYS_INLINE void dotk_512_t(const int fmt, const int R, const int ahead, const uint8_t *W, long ldw, long n0,
                                     long n1, const acts *a, const long *mi, float *Y, long ldy) {
    const long bb = block_bytes(fmt), ns = a->K / 256;
    if (R == 1) {  /* one token: the same arithmetic per row, rows in pairs */
        long n = n0;
        for (; n + ONE_ROWS <= n1; n += ONE_ROWS) dotk_512_rows(fmt, ONE_ROWS, W, ldw, n, a, mi[0], Y);
        for (; n < n1; n++) dotk_512_rows(fmt, 1, W, ldw, n, a, mi[0], Y);
        return;
    }
    for (long n = n0; n < n1; n++) {
        const uint8_t *row = W + n * ldw;
        __m128 am[GROUP];
        for (int r = 0; r < R; r++) am[r] = _mm_setzero_ps();
        for (long s = 0; s < ns; s++) {
            kblock512 b;
            if (ahead) prefetch_far(row + s * bb, bb);
            kblock_of(fmt, row + s * bb, &b);
            for (int r = 0; r < R; r++) {
                __m512i x[4];
                __m256i bsum;
                k_acts512(a, mi[r], s, x, &bsum);
                k_token512(&b, x, bsum, a->dx[mi[r] * ns + s], &am[r]);
            }
        }
        for (int r = 0; r < R; r++) Y[r * ldy + n] = K_RESULT(am[r]);
    }
}

/* ---- rows in eights (Q4_K_X8, Q5_K_X8, Q6_K_X8) --------------------------------------------------- */

/* The layouts, made at load where the AVX-512 or the AVX2 path runs (hm_interleave,
   called by quant/tensor.py for_kernels; quant/interleave.py turns them back in torch ops): a matrix of
   Q4_K, Q5_K or Q6_K rows, their number a multiple of 8, keeps its bytes, but rows 8g .. 8g+7 (their 8
   row lengths of bytes, rows of exactly K / 256 blocks) hold their super-blocks s side by side at
   s * 8 * (block bytes). Each piece of a row's block (X8_PIECES: `len` bytes at `at`, in units of `unit`
   bytes) lies with that piece of the other seven rows, unit i of row r at unit 8i + r, the pieces one
   after another:
     Q4_K (1152 bytes): [0, 16) the rows' d (fp16), [16, 32) their dmin, [32, 128) their 12 scale bytes
       (byte j of row r at 32 + 8j + r), [128, 1152) their nibbles (bytes 8c .. 8c + 7 of row r's qs at
       128 + 64c + 8r);
     Q5_K (1408 bytes): as Q4_K's, with their 32 bytes of fifth bits before the nibbles: [128, 384) their
       qh (bytes 8c .. 8c + 7 of row r's at 128 + 64c + 8r), [384, 1408) their nibbles;
     Q6_K (1680 bytes): [0, 1024) their ql (bytes 8c .. 8c + 7 of row r's at 64c + 8r), [1024, 1536) their
       qh (likewise), [1536, 1664) their int8 scales (scale j of row r at 1536 + 8j + r), [1664, 1680) d.
   One 64-byte load of quants then holds the same 8 bytes of eight rows, which share one sub-block scale
   per row: a sub-block's scale register serves several registers of eight rows, and the scales of eight
   rows unpack in a few vector operations, where the GGUF layout unpacks them row by row in scalar code
   (llama.cpp repacks its CPU weights likewise, block_q4_Kx8). Each row's integers per super-block and
   its float operations are those of K_FMA, as on the rows in GGUF's layout, so the results keep their
   bits (docs/notes/2026-11-25-q4k-rows-in-eights.md, 2026-12-07-q6k-rows-in-eights.md). */
#define X8 8
#define X8_BYTES (X8 * 144)
#define X8_5_BYTES (X8 * 176)
#define X8_6_BYTES (X8 * 210)

typedef struct {
    int at, unit, len;
} x8_piece;
/* The pieces of a block in each interleaved layout (blocks of 32's in "rows in sixteens" below). */
static const x8_piece X8_PIECES[6][5] = {{{0, 2, 2}, {2, 2, 2}, {4, 1, 12}, {16, 8, 128}},
                                         {{0, 8, 128}, {128, 8, 64}, {192, 1, 16}, {208, 2, 2}},
                                         {{0, 2, 2}, {2, 4, 32}},
                                         {{0, 2, 2}, {2, 4, 16}},
                                         {{0, 2, 2}, {2, 2, 2}, {4, 4, 16}},
                                         {{0, 2, 2}, {2, 2, 2}, {4, 1, 12}, {16, 8, 32}, {48, 8, 128}}};

static const x8_piece *pieces_of(int fmt) {
    switch (rows_fmt(fmt)) {
    case Q4_K: return X8_PIECES[0];
    case Q6_K: return X8_PIECES[1];
    case Q8_0: return X8_PIECES[2];
    case Q4_0: return X8_PIECES[3];
    case Q4_1: return X8_PIECES[4];
    default: return X8_PIECES[5]; /* Q5_K */
    }
}

/* The units of one piece of n rows: unit i of row r between x8 + (n i + r) u and row r's at + i u
   (a constant `u` per call, so that each copy is one move: with `u` a variable each was a call to
   memcpy, and a load rearranged 1.1 GB/s instead of 6.4). */
ALWAYS_INLINE void x8_units(const int u, const int n, uint8_t *x8, const uint8_t *rows, long ldq, int len) {
    for (int r = 0; r < n; r++)
        for (int i = 0; i < len / u; i++) memcpy(x8 + (long)(n * i + r) * u, rows + r * ldq + i * u, (size_t)u);
}

/* Block s of a group of interleaved rows in `fmt` (p) from the blocks of rows q + r * ldq. */
ALWAYS_INLINE void x8_pieces(const int n, const x8_piece *piece, uint8_t *p, const uint8_t *q, long ldq) {
    long off = 0;
    for (int k = 0; k < 5 && piece[k].len; k++) {
        uint8_t *x8 = p + off;
        const uint8_t *rows = q + piece[k].at;
        switch (piece[k].unit) {
        case 1: x8_units(1, n, x8, rows, ldq, piece[k].len); break;
        case 2: x8_units(2, n, x8, rows, ldq, piece[k].len); break;
        case 4: x8_units(4, n, x8, rows, ldq, piece[k].len); break;
        default: x8_units(8, n, x8, rows, ldq, piece[k].len); break;
        }
        off += n * piece[k].len;
    }
}

/* (The rows of a group a constant in each case: with it a variable, a load rearranged Q4_K 7.6 ->
   6.1 GB/s.) */
static void x8_move(int fmt, uint8_t *p, const uint8_t *q, long ldq) {
    if (group_rows(fmt) == 16) x8_pieces(16, pieces_of(fmt), p, q, ldq);
    else x8_pieces(8, pieces_of(fmt), p, q, ldq);
}

/* The interleaved layout of GGUF's `fmt`, 0 for none. */
static int layout_of(int fmt) {
    switch (fmt) {
    case Q4_K: return Q4_K_X8;
    case Q5_K: return Q5_K_X8;
    case Q6_K: return Q6_K_X8;
    case Q8_0: return Q8_0_X16;
    case Q4_0: return Q4_0_X16;
    case Q4_1: return Q4_1_X16;
    }
    return 0;
}

/* N rows of Q4_K, Q6_K, Q8_0 or Q4_0 blocks (`fmt`; N a multiple of the layout's 8 or 16 rows, rows of
   exactly K / block elements blocks) rearranged in place into their interleaved layout (made at load:
   quant/tensor.py for_kernels). Returns 0, -1 for a format or shape it does not take, -2 without memory. */
int hm_interleave(int fmt, uint8_t *W, long N, long K) {
    const int x = layout_of(fmt), g = group_rows(x);
    if (!x || N % g || K <= 0 || K % block_elems(fmt)) return -1;
    const long bb = block_bytes(fmt), nb = K / block_elems(fmt), ldw = nb * bb;
    uint8_t *rows = malloc((size_t)(g * ldw));
    if (!rows) return -2;
    for (long n = 0; n < N; n += g) {
        uint8_t *G = W + n * ldw;
        memcpy(rows, G, (size_t)(g * ldw));
        for (long s = 0; s < nb; s++) x8_move(x, G + s * g * bb, rows + s * bb, ldw);
    }
    free(rows);
    return 0;
}

/* Word i of a scale register is row i / 4's (WSEL[k]: of block k of 32 words 8k + r). */
#define W4(v) v, v, v, v
#define W32(k) W4(8 * k), W4(8 * k + 1), W4(8 * k + 2), W4(8 * k + 3), W4(8 * k + 4), W4(8 * k + 5), W4(8 * k + 6), \
    W4(8 * k + 7)
static const int16_t WSEL[4][32] = {{W32(0)}, {W32(1)}, {W32(2)}, {W32(3)}};
#undef W4
#undef W32
/* The minimums' term as word pairs, for vpdpwssd: MIDX puts word 8 (2j + t) + r of the widened minimum
   bytes (block 2j + t, row r: x8_scales' mn) at word 2 (8j + r) + t, so that dword lane 8j + r holds row
   r's minimums of blocks 2j and 2j + 1, against the activations' block sums of those blocks (acts'
   bpair, dword j: the same two words). */
#define MI(l, t) (8 * (2 * ((l) / 8) + (t)) + (l) % 8)
#define MI2(l) MI(l, 0), MI(l, 1)
static const int16_t MIDX_W[32] = {MI2(0), MI2(1), MI2(2),  MI2(3),  MI2(4),  MI2(5),  MI2(6),  MI2(7),
                                   MI2(8), MI2(9), MI2(10), MI2(11), MI2(12), MI2(13), MI2(14), MI2(15)};
#undef MI
#undef MI2

/* Super-block p's 6-bit scales of eight rows as words (sw[0]: blocks 0..3, word 8b + r; sw[1]: 4..7) and
   its minimums as bytes (mn[0]: blocks 0..3, byte 8b + r; mn[1]: 4..7), as unpack_scales_k4 splits them. */
AVX512 ALWAYS_INLINE void x8_scales(const uint8_t *p, __m512i sw[2], __m256i mn[2]) {
    const __m256i m63 = _mm256_set1_epi8(63), m15 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    __m256i u0 = _mm256_loadu_si256((const __m256i *)(p + 32)), u1 = _mm256_loadu_si256((const __m256i *)(p + 64));
    __m256i u2 = _mm256_loadu_si256((const __m256i *)(p + 96));
    __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(u2, m15), _mm256_and_si256(_mm256_srli_epi16(u0, 2), m30));
    sw[0] = _mm512_cvtepu8_epi16(_mm256_and_si256(u0, m63));
    sw[1] = _mm512_cvtepu8_epi16(sc_hi);
    mn[0] = _mm256_and_si256(u1, m63);
    mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u2, 4), m15),
                            _mm256_and_si256(_mm256_srli_epi16(u1, 2), m30));
}

/* Eight rows' K_FMA for one token and super-block: isum from Z's lane pairs (lanes 2k, 2k + 1: row k),
   csum from C's halves (lanes k, 8 + k). */
AVX512 ALWAYS_INLINE void x8_fma(__m512i Z, __m512i C, __m256 d, __m256 dm, float dx, __m256 *F, __m256 *Mn) {
    const __m256i csum = _mm256_add_epi32(_mm512_castsi512_si256(C), _mm512_extracti64x4_epi64(C, 1));
    const __m256i isum = _mm512_cvtepi64_epi32(_mm512_add_epi32(Z, _mm512_srli_epi64(Z, 32)));
    const __m256 x = _mm256_set1_ps(dx);
    *F = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, x), *F);
    *Mn = _mm256_fmadd_ps(_mm256_cvtepi32_ps(csum), _mm256_mul_ps(dm, x), *Mn);
}

/* Super-block p of eight Q4_K or Q5_K rows: d, -dmin, the scale words (x8_scales) and the minimums'
   word pairs (dword lane 8j + r: row r's minimums of blocks 2j, 2j + 1; mp[1]: 4 + those). */
AVX512 ALWAYS_INLINE void x8_head(const uint8_t *p, __m256 *d, __m256 *dm, __m512i sw[2], __m512i mp[2]) {
    const __m512i MIDX = _mm512_loadu_si512((const void *)MIDX_W);
    __m256i mn[2];
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    *dm = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))), _mm256_set1_ps(-0.0f));
    x8_scales(p, sw, mn);
    mp[0] = _mm512_permutexvar_epi16(MIDX, _mm512_cvtepu8_epi16(mn[0]));
    mp[1] = _mm512_permutexvar_epi16(MIDX, _mm512_cvtepu8_epi16(mn[1]));
}

/* One token's csum against the minimums' word pairs (its bpair dwords 0, 1 (2, 3) beside mp[0]'s
   (mp[1]'s) lanes 0..7 and 8..15) and the K_FMA of eight rows (x8_fma); sb: its super-block's index in
   the activations. */
AVX512 ALWAYS_INLINE void x8_minimums(__m512i Z, const __m512i mp[2], const acts *a, long sb, __m256 d, __m256 dm,
                                      __m256 *F, __m256 *Mn) {
    const __m512i pairs[2] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                              _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)};
    const __m512i bp = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(a->bpair + sb * 4)));
    __m512i C = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mp[0], _mm512_permutexvar_epi32(pairs[0], bp));
    C = _mm512_dpwssd_epi32(C, mp[1], _mm512_permutexvar_epi32(pairs[1], bp));
    x8_fma(Z, C, d, dm, a->dx[sb], F, Mn);
}

/* Chunk c of blocks bl (lo) and bh (hi) of eight rows against R tokens' bytes x (paired block order),
   into L and H. */
AVX512 ALWAYS_INLINE void x8_chunk(const int R, __m512i lo, __m512i hi, const int8_t *const x[GROUP], int bl, int bh,
                                   int c, __m512i L[GROUP], __m512i H[GROUP]) {
    static const int8_t pos[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int r = 0; r < R; r++) {
        int64_t vl, vh;
        memcpy(&vl, x[r] + 32 * pos[bl] + 8 * c, 8);
        memcpy(&vh, x[r] + 32 * pos[bh] + 8 * c, 8);
        L[r] = _mm512_dpbusd_epi32(L[r], lo, _mm512_set1_epi64(vl));
        H[r] = _mm512_dpbusd_epi32(H[r], hi, _mm512_set1_epi64(vh));
    }
}

/* Eight interleaved rows at G (ns super-blocks) against the R tokens mi[0..R) of `a`: Y[r * ldy + 0..8),
   lane k row k. A 64-byte load of nibbles holds 8 bytes of each row (chunk c of group g: low nibbles
   of block 2g, high of 2g + 1), dword lane 2k + i four of row k's. vpdpbusd sums the four chunks of a
   group into L (low) and H (high nibbles masked in place: 16 x their values, shifted back after), so that
   |lane| <= 16 x 15 x 127 fits the word vpdpwssd multiplies by the block's scale (one per group and
   nibble half, where there was one per chunk: 1.38x hot, 1.13x from RAM, one token); lanes 2k and 2k + 1
   then give row k's isum and the minimums' words its csum (K_FMA). */
AVX512 ALWAYS_INLINE void dotk_x8_512_t(const int R, const int ahead, const uint8_t *G, long ns, const acts *a,
                                        const long *mi, float *Y, long ldy) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), mf0 = _mm512_set1_epi8((char)0xF0);
    __m256 F[GROUP], Mn[GROUP]; /* acc and accm of the eight rows */
    for (int r = 0; r < R; r++) F[r] = Mn[r] = _mm256_setzero_ps();
    for (long s = 0; s < ns; s++) {
        const uint8_t *p = G + s * X8_BYTES;
        if (R == 1 || ahead) prefetch_near_far(p, X8_BYTES);
        __m256 d, dm;
        __m512i sw[2], mp[2], Z[GROUP];
        const int8_t *x[GROUP];
        x8_head(p, &d, &dm, sw, mp);
        for (int r = 0; r < R; r++) {
            x[r] = a->qs + mi[r] * a->K + s * 256;
            Z[r] = _mm512_setzero_si512();
        }
        for (int g = 0; g < 4; g++) {
            const int bl = 2 * g, bh = 2 * g + 1;
            __m512i sl = _mm512_maskz_permutexvar_epi16(0x55555555u, _mm512_loadu_si512((const void *)WSEL[bl % 4]), sw[bl / 4]);
            __m512i sh = _mm512_maskz_permutexvar_epi16(0x55555555u, _mm512_loadu_si512((const void *)WSEL[bh % 4]), sw[bh / 4]);
            __m512i L[GROUP], H[GROUP];
            for (int r = 0; r < R; r++) L[r] = H[r] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                __m512i w = _mm512_loadu_si512((const void *)(p + 128 + 64 * (4 * g + c)));
                __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(w, mf0);
                x8_chunk(R, lo, hi, x, bl, bh, c, L, H);
            }
            for (int r = 0; r < R; r++) {
                Z[r] = _mm512_dpwssd_epi32(Z[r], L[r], sl);
                Z[r] = _mm512_dpwssd_epi32(Z[r], _mm512_srai_epi32(H[r], 4), sh);
            }
        }
        for (int r = 0; r < R; r++) x8_minimums(Z[r], mp, a, mi[r] * ns + s, d, dm, &F[r], &Mn[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * ldy, _mm256_add_ps(F[r], Mn[r]));
}

/* Q5_K's fifth bits of a 64-byte load of nibbles: bit j of each byte of qh (the same 8 bytes of eight
   rows) as 16 in that byte, 0 else. */
AVX512 ALWAYS_INLINE __m512i x8_fifth(__m512i qh, int j) {
    const __m512i v = j <= 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
    return _mm512_and_si512(v, _mm512_set1_epi8(16));
}

/* Eight interleaved Q5_K rows at G (ns super-blocks) against the R tokens mi[0..R): as dotk_x8_512_t,
   the values 0..31 (nibble + 16 x its fifth bit, chunk c's qh bits 2g and 2g + 1). A lane of vpdpbusd
   over two chunks stays a word (8 x 31 x 127), so each two chunks take their own vpdpwssd by the
   sub-block's scale (Q4_K's four chunks of 0..15 share one). Its own function, sharing its steps
   (x8_head, x8_chunk, x8_minimums): one kernel for both formats, the chunks per vpdpwssd a constant,
   ran Q4_K's one-token product 3% slower from RAM (10.04 against 10.34, 11.41 against 11.86 GB/s,
   either order; its registers allocated otherwise), the shared steps level with it. */
AVX512 ALWAYS_INLINE void dotk5_x8_512_t(const int R, const int ahead, const uint8_t *G, long ns, const acts *a,
                                         const long *mi, float *Y, long ldy) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m256 F[GROUP], Mn[GROUP];
    for (int r = 0; r < R; r++) F[r] = Mn[r] = _mm256_setzero_ps();
    for (long s = 0; s < ns; s++) {
        const uint8_t *p = G + s * X8_5_BYTES;
        if (R == 1 || ahead) prefetch_near_far(p, X8_5_BYTES);
        __m256 d, dm;
        __m512i sw[2], mp[2], Z[GROUP];
        const int8_t *x[GROUP];
        x8_head(p, &d, &dm, sw, mp);
        __m512i qh[4];
        for (int c = 0; c < 4; c++) qh[c] = _mm512_loadu_si512((const void *)(p + 128 + 64 * c));
        for (int r = 0; r < R; r++) {
            x[r] = a->qs + mi[r] * a->K + s * 256;
            Z[r] = _mm512_setzero_si512();
        }
        for (int g = 0; g < 4; g++) {
            const int bl = 2 * g, bh = 2 * g + 1;
            __m512i sl = _mm512_maskz_permutexvar_epi16(0x55555555u, _mm512_loadu_si512((const void *)WSEL[bl % 4]), sw[bl / 4]);
            __m512i sh = _mm512_maskz_permutexvar_epi16(0x55555555u, _mm512_loadu_si512((const void *)WSEL[bh % 4]), sw[bh / 4]);
            for (int c2 = 0; c2 < 4; c2 += 2) {
                __m512i L[GROUP], H[GROUP];
                for (int r = 0; r < R; r++) L[r] = H[r] = _mm512_setzero_si512();
                for (int c = c2; c < c2 + 2; c++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(p + 384 + 64 * (4 * g + c)));
                    const __m512i lo = _mm512_or_si512(_mm512_and_si512(w, m4), x8_fifth(qh[c], bl));
                    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), m4), x8_fifth(qh[c], bh));
                    x8_chunk(R, lo, hi, x, bl, bh, c, L, H);
                }
                for (int r = 0; r < R; r++) {
                    Z[r] = _mm512_dpwssd_epi32(Z[r], L[r], sl);
                    Z[r] = _mm512_dpwssd_epi32(Z[r], H[r], sh);
                }
            }
        }
        for (int r = 0; r < R; r++) x8_minimums(Z[r], mp, a, mi[r] * ns + s, d, dm, &F[r], &Mn[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * ldy, _mm256_add_ps(F[r], Mn[r]));
}

/* Q6_K rows in eights: the scale words of sub-block j of eight rows, for vpdpwssd (row r's in the low
   words of dword lanes 2r, 2r + 1), from the widened scales sw[j / 4] (word 8 (j % 4) + r). */
AVX512 ALWAYS_INLINE __m512i x8_scale6(const __m512i sw[4], int j) {
    return _mm512_maskz_permutexvar_epi16(0x55555555u, _mm512_loadu_si512((const void *)WSEL[j % 4]), sw[j / 4]);
}

/* Q6_K value register t (0..3) of a 64-byte load of ql (w) and its qh bits (qh): t = 0, 1 the low
   nibbles with qh bits 0,1 and 2,3; t = 2, 3 the high nibbles with bits 4,5 and 6,7 (values 32t + l of
   the half, l the chunk's byte places). */
AVX512 ALWAYS_INLINE __m512i x8_q6(__m512i w, __m512i qh, int t) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i low = t < 2 ? _mm512_and_si512(w, m4) : _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
    const __m512i high = t == 0 ? _mm512_slli_epi16(qh, 4) : t == 1 ? _mm512_slli_epi16(qh, 2)
                       : t == 2 ? qh : _mm512_srli_epi16(qh, 2);
    return _mm512_ternarylogic_epi32(low, high, m30, 0xF8); /* low | (high & 0x30) */
}

/* Eight interleaved Q6_K rows at G (ns super-blocks) against the R tokens mi[0..R): Y[r * ldy + 0..8),
   lane k row k. A 64-byte load of ql (chunk c of half h: its bytes 8c .. 8c + 7, c < 4 the values 8c..
   of parts 0 and 2, c >= 4 of parts 1 and 3, a part being 32 values of the half) with its qh bits gives
   two registers of 8 values of eight rows, dword lane 2k + i four of row k's. vpdpbusd sums each
   lane's four products (|lane| <= 4 x 63 x 128: a word), vpdpwssd multiplies it by the row's scale of the
   sub-block and adds; lanes 2k and 2k + 1 then give row k's isum, the scales' word pairs against the
   activations' 16-value sums its csum (K_FMA, dm = -32 d). */
AVX512 ALWAYS_INLINE void dotk6_x8_512_t(const int R, const int ahead, const uint8_t *G, long ns, const acts *a,
                                         const long *mi, float *Y, long ldy) {
    /* Independent integer sums per token (exact: their order changes nothing), so that one token's
       vpdpwssd do not wait on each other: one chain of 32 ran at 0.7x the two-row GGUF path. */
    enum { NZ = 4 };
    const int nz = R == 1 ? NZ : 2;
    const __m512i MIDX = _mm512_loadu_si512((const void *)MIDX_W);
    __m256 F[GROUP], Mn[GROUP]; /* acc and accm of the eight rows */
    for (int r = 0; r < R; r++) F[r] = Mn[r] = _mm256_setzero_ps();
    for (long s = 0; s < ns; s++) {
        const uint8_t *p = G + s * X8_6_BYTES;
        if (R == 1 || ahead) prefetch_near_far(p, X8_6_BYTES);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 1664)));
        const __m256 dm = _mm256_mul_ps(d, _mm256_set1_ps(-32.0f));
        __m512i sw[4], Z[GROUP][NZ];
        const int8_t *x[GROUP];
        for (int q = 0; q < 4; q++) sw[q] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 1536 + 32 * q)));
        for (int r = 0; r < R; r++) {
            x[r] = a->qs + mi[r] * a->K + s * 256;
            for (int z = 0; z < nz; z++) Z[r][z] = _mm512_setzero_si512();
        }
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) { /* i = 8h + 4 half + 2 tq + cc (unrolled: constant indices) */
            const int h = i / 8, half = (i / 4) % 2, tq = (i / 2) % 2, cc = i % 2;
            /* parts tq (low nibbles) and tq + 2 (high), values 16 half .. of each: sub-blocks 8h + 2t + half */
            const __m512i S[2] = {x8_scale6(sw, 8 * h + 2 * tq + half), x8_scale6(sw, 8 * h + 2 * (tq + 2) + half)};
            const int c = 4 * tq + 2 * half + cc; /* ql chunk 8h + c; qh chunk 4h + c % 4 */
            const __m512i w = _mm512_loadu_si512((const void *)(p + 64 * (8 * h + c)));
            const __m512i qh = _mm512_loadu_si512((const void *)(p + 1024 + 64 * (4 * h + c % 4)));
#pragma GCC unroll 2
            for (int u = 0; u < 2; u++) {
                const int t = tq + 2 * u, v = 128 * h + 32 * t + 8 * (c % 4), z = (2 * i + u) % nz;
                const __m512i q = x8_q6(w, qh, t);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    int64_t xv;
                    memcpy(&xv, x[r] + v, 8);
                    Z[r][z] = _mm512_dpwssd_epi32(Z[r][z], _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_set1_epi64(xv)), S[u]);
                }
            }
        }
        __m512i mp[4]; /* dword lane 8i + r: row r's scales 4q + 2i, 4q + 2i + 1 */
        for (int q = 0; q < 4; q++) mp[q] = _mm512_permutexvar_epi16(MIDX, sw[q]);
        for (int r = 0; r < R; r++) {
            const __m512i bs = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a->bsum + (mi[r] * ns + s) * 16)));
            __m512i C = _mm512_setzero_si512();
            for (int q = 0; q < 4; q++) {
                const __m512i pair = _mm512_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1, 2 * q + 1,
                                                       2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1);
                C = _mm512_dpwssd_epi32(C, mp[q], _mm512_permutexvar_epi32(pair, bs));
            }
            __m512i Zr = Z[r][0];
            for (int k = 1; k < nz; k++) Zr = _mm512_add_epi32(Zr, Z[r][k]);
            x8_fma(Zr, C, d, dm, a->dx[mi[r] * ns + s], &F[r], &Mn[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * ldy, _mm256_add_ps(F[r], Mn[r]));
}

/* Rows [n0, n1) (whole eights) of Q4_K_X8 (dotk_x8_512), Q5_K_X8 (dotk5_x8_512) or Q6_K_X8 (dotk6_x8_512)
   weights against tokens mi[0..R) (R <= GROUP), the token count a constant in each case; one function per
   format (Q4_K's and Q6_K's kernels inlined into one ran Q6_K's one-token product 6% slower). */
#define X8_DOT(NAME, T)                                                                                     \
    AVX512 static void NAME(const uint8_t *W, long ldw, long n0, long n1, const acts *a, const long *mi, int R, \
                            float *Y, long ldy) {                                                           \
        const long ns = a->K / 256;                                                                         \
        const int ahead = R & FIRST_GROUP;                                                                  \
        R &= ~FIRST_GROUP;                                                                                  \
        for (long n = n0; n < n1; n += X8) {                                                                \
            const uint8_t *G = W + n * ldw;                                                                 \
            switch (R) {                                                                                    \
            case 1: T(1, ahead, G, ns, a, mi, Y + n, ldy); break;                                           \
            case 2: T(2, ahead, G, ns, a, mi, Y + n, ldy); break;                                           \
            case 3: T(3, ahead, G, ns, a, mi, Y + n, ldy); break;                                           \
            default: T(GROUP, ahead, G, ns, a, mi, Y + n, ldy); break;                                      \
            }                                                                                               \
        }                                                                                                   \
    }
X8_DOT(dotk_x8_512, dotk_x8_512_t)
X8_DOT(dotk5_x8_512, dotk5_x8_512_t)
X8_DOT(dotk6_x8_512, dotk6_x8_512_t)
#undef X8_DOT

/* ---- Q4_K rows in eights on AVX2 ---------------------------------------------------------------------

   AVX2's one-token Q4_K product on GGUF's rows is bound by its arithmetic (each row's scales unpacked,
   each 32 values' products scaled alone: 22.6 GB/s with its weights in L2 on AMD's Zen 5, against 59 for
   AVX-512 on rows in eights; docs/notes/2026-12-07-avx2-only.md). On rows in eights one 32-byte load holds
   the same 8 bytes of four rows; the eight rows' scales unpack in a few vector operations; a group's four
   chunks are summed in words (|sum| <= 4 x 2 x 15 x 128 < 2^15) before one vpmaddwd by the rows' scales,
   as dotk_x8_512_t sums them before its vpdpwssd. The integers are exact and the float operations those
   of K_FMA (x8_fma's), so each row keeps the bits of dotk_avx2_t. Each token is computed alone. One
   token, one thread, from RAM: 4096 x 2048 23.1 -> 37.3 GB/s; 768 x 2048 in L2 23.2 -> 36.6. */

/* Byte 2w of lane l of SCALE_SEL[b % 2][h]: the scale byte of row 4h + 2l + w / 4 in block b's 8 (the
   16 bytes of blocks 2 (b / 2), 2 (b / 2) + 1 broadcast to both lanes); byte 2w + 1 zero. */
#define SB(b, h, l, w) (char)(8 * (b) + 4 * (h) + 2 * (l) + (w) / 4), (char)0x80
#define SLANE(b, h, l) SB(b, h, l, 0), SB(b, h, l, 1), SB(b, h, l, 2), SB(b, h, l, 3), SB(b, h, l, 4), \
    SB(b, h, l, 5), SB(b, h, l, 6), SB(b, h, l, 7)
static const char SCALE_SEL[2][2][32] = {{{SLANE(0, 0, 0), SLANE(0, 0, 1)}, {SLANE(0, 1, 0), SLANE(0, 1, 1)}},
                                         {{SLANE(1, 0, 0), SLANE(1, 0, 1)}, {SLANE(1, 1, 0), SLANE(1, 1, 1)}}};
#undef SLANE
#undef SB

/* Q5_K's fifth bits on AVX2 (x8_fifth): bit j of each byte of qh as 16 in that byte, 0 else. */
AVX2 ALWAYS_INLINE __m256i x8_fifth_avx2(__m256i qh, int j) {
    const __m256i v = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* Eight interleaved Q4_K or Q5_K rows (fmt, a constant) at G (ns super-blocks) against the R (1 or 2) token
   rows mi[0..R) of `a`: Y[r * ldy + 0..8), each token's integers its own. Q5_K's values 0..31 (nibble + 16 x its fifth bit, chunk c's qh bits 2g and 2g + 1): a group's
   four chunks still sum in words (|sum| <= 4 x 2 x 31 x 128 < 2^15). */
AVX2 ALWAYS_INLINE void dotk_x8_avx2_t(const int fmt, const int vnni, const int R, const int ahead, const uint8_t *G,
                                       long ns, const acts *a, const long *mi, float *Y, long ldy) {
    const int five = fmt == Q5_K_X8;
    const long gb = five ? X8_5_BYTES : X8_BYTES, at = five ? 384 : 128; /* a super-block's bytes; its nibbles' */
    static const int8_t pos[8] = {0, 2, 1, 3, 4, 6, 5, 7}; /* natural block b's 32 bytes at 32 pos[b] */
    const __m256i m4 = _mm256_set1_epi8(0x0F), m63 = _mm256_set1_epi8(63), m30 = _mm256_set1_epi8(0x30);
    const __m256i rows = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* vphaddd's lanes back in row order */
    __m256 F[2], Mn[2];
    for (int r = 0; r < R; r++) F[r] = Mn[r] = _mm256_setzero_ps();
    for (long s = 0; s < ns; s++) {
        const uint8_t *p = G + s * gb;
        if (ahead) prefetch_near_far(p, gb);
        const int8_t *x[2];
        for (int r = 0; r < R; r++) x[r] = a->qs + mi[r] * a->K + s * 256;
        /* the scale bytes (byte 8b + r: block b of row r) and minimums, as x8_scales splits them */
        const __m256i u0 = _mm256_loadu_si256((const __m256i *)(p + 32)), u1 = _mm256_loadu_si256((const __m256i *)(p + 64));
        const __m256i u2 = _mm256_loadu_si256((const __m256i *)(p + 96));
        const __m256i sc[2] = {_mm256_and_si256(u0, m63),
                               _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi16(u0, 2), m30))};
        const __m256i mn[2] = {_mm256_and_si256(u1, m63),
                               _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u2, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(u1, 2), m30))};
        __m256i Z[2][2]; /* token r's rows 4h..4h+3: dwords 2k, 2k + 1 of Z[r][h] */
        for (int r = 0; r < R; r++) Z[r][0] = Z[r][1] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const int bl = 2 * g, bh = 2 * g + 1; /* the chunks' low nibbles are block bl's, high bh's */
            /* blocks bl, bh lie in the same 16 bytes of their register (bl % 4 = 0 or 2) */
            const __m256i src = g % 2 ? _mm256_permute2x128_si256(sc[g / 2], sc[g / 2], 0x11)
                                      : _mm256_permute2x128_si256(sc[g / 2], sc[g / 2], 0x00);
            for (int h = 0; h < 2; h++) {
                /* the rows' scale words of blocks bl, bh; on AVX-VNNI a dword of vpdpbusd (4 products) is
                   multiplied by the scale in its low word by vpdpwssd (a row's dwords are a word each: Q4_K's
                   four chunks, |sum| <= 16 x 15 x 128; Q5_K's two, <= 8 x 31 x 128), the high words (signs)
                   against 0. (Made after the chunks on AVX2: before them, 512 tokens ran 1-7% slower.) */
                __m256i sl, sh;
                if (vnni) {
                    const __m256i low = _mm256_set1_epi32(0xFFFF);
                    sl = _mm256_and_si256(_mm256_shuffle_epi8(src, _mm256_loadu_si256((const __m256i *)SCALE_SEL[0][h])), low);
                    sh = _mm256_and_si256(_mm256_shuffle_epi8(src, _mm256_loadu_si256((const __m256i *)SCALE_SEL[1][h])), low);
                }
                __m256i L[2], H[2];
                for (int r = 0; r < R; r++) L[r] = H[r] = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    if (vnni && five && c == 2)
                        for (int r = 0; r < R; r++) {
                            Z[r][h] = vnni_dpwssd(vnni_dpwssd(Z[r][h], L[r], sl), H[r], sh);
                            L[r] = H[r] = _mm256_setzero_si256();
                        }
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(p + at + 64 * (4 * g + c) + 32 * h));
                    __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                    if (five) {
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 64 * c + 32 * h));
                        lo = _mm256_or_si256(lo, x8_fifth_avx2(qh, bl));
                        hi = _mm256_or_si256(hi, x8_fifth_avx2(qh, bh));
                    }
                    for (int r = 0; r < R; r++) {
                        int64_t vl, vh;
                        memcpy(&vl, x[r] + 32 * pos[bl] + 8 * c, 8);
                        memcpy(&vh, x[r] + 32 * pos[bh] + 8 * c, 8);
                        if (vnni) {
                            L[r] = vnni_dpbusd(L[r], lo, _mm256_set1_epi64x(vl));
                            H[r] = vnni_dpbusd(H[r], hi, _mm256_set1_epi64x(vh));
                        } else {
                            L[r] = _mm256_add_epi16(L[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi64x(vl)));
                            H[r] = _mm256_add_epi16(H[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi64x(vh)));
                        }
                    }
                }
                if (!vnni) {
                    sl = _mm256_shuffle_epi8(src, _mm256_loadu_si256((const __m256i *)SCALE_SEL[0][h]));
                    sh = _mm256_shuffle_epi8(src, _mm256_loadu_si256((const __m256i *)SCALE_SEL[1][h]));
                }
                for (int r = 0; r < R; r++)
                    Z[r][h] = vnni ? vnni_dpwssd(vnni_dpwssd(Z[r][h], L[r], sl), H[r], sh)
                                   : _mm256_add_epi32(Z[r][h], _mm256_add_epi32(_mm256_madd_epi16(L[r], sl), _mm256_madd_epi16(H[r], sh)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 dm = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))), _mm256_set1_ps(-0.0f));
        for (int r = 0; r < R; r++) {
            const long sb = mi[r] * ns + s;
            const __m256i isum = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(Z[r][0], Z[r][1]), rows);
            /* csum: row k's minimums of blocks 2j, 2j + 1 as a word pair against the token's sums of them */
            __m256i C = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m128i half = j % 2 ? _mm256_extracti128_si256(mn[j / 2], 1) : _mm256_castsi256_si128(mn[j / 2]);
                const __m256i w = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(half, _mm_srli_si128(half, 8)));
                C = _mm256_add_epi32(C, _mm256_madd_epi16(w, _mm256_set1_epi32(a->bpair[sb * 4 + j])));
            }
            const __m256 dx = _mm256_set1_ps(a->dx[sb]);
            F[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx), F[r]);
            Mn[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(C), _mm256_mul_ps(dm, dx), Mn[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * ldy, _mm256_add_ps(F[r], Mn[r]));
}

/* ---- Q6_K rows in eights on AVX2 ---------------------------------------------------------------------

   GGUF's Q6_K rows on AVX2 (dotk_avx2_t) read ~23-26 GB/s from RAM in a decode step on a Zen 5 core capped
   to AVX2, against ~35-37 for Q4_K's rows in eights: a Q4_K_M file's Q6_K matrices (half its layers' expert
   downs, half its attn_v, the output head; ~20% of its bytes a token) took ~19% of the step. On rows in
   eights (X8_PIECES' Q6_K layout, as dotk6_x8_512_t reads it) a 32-byte load of ql and one of qh hold the
   same 8 bytes of four rows; a sub-block's two chunks are summed in words by vpmaddubsw (|word| <= 2 x 2 x
   63 x 128 < 2^15) before one vpmaddwd by the rows' scale of the sub-block; csum takes the rows' scales
   of sub-blocks 2i, 2i + 1 as word pairs against the token's sums of those. The integers are exact and the
   float operations those of K_FMA (dm = -32 d), so each row keeps the bits of dotk_avx2_t. */

/* Bytes of the word lanes 4k .. 4k + 3 of SCALE6_SEL[q]: word 4q + k of the 8 (rows 0..7 of a sub-block's
   scales as words, the same 8 in both 128-bit lanes): row 4q + k's scale against its 4 words of products. */
#define SW(w) (char)(2 * (w)), (char)(2 * (w) + 1), (char)(2 * (w)), (char)(2 * (w) + 1), (char)(2 * (w)), \
    (char)(2 * (w) + 1), (char)(2 * (w)), (char)(2 * (w) + 1)
static const char SCALE6_SEL[2][32] = {{SW(0), SW(1), SW(2), SW(3)}, {SW(4), SW(5), SW(6), SW(7)}};
#undef SW

/* x8_q6 on AVX2: Q6_K value register t (0..3) of a 32-byte load of ql (w) and of its qh bits (qh). */
AVX2 ALWAYS_INLINE __m256i x8_q6_avx2(__m256i w, __m256i qh, int t) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i low = t < 2 ? _mm256_and_si256(w, m4) : _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    const __m256i high = t == 0 ? _mm256_slli_epi16(qh, 4) : t == 1 ? _mm256_slli_epi16(qh, 2)
                       : t == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(low, _mm256_and_si256(high, m30));
}

/* Eight interleaved Q6_K rows at G (ns super-blocks) against the R (1 or 2) token rows mi[0..R) of `a`:
   Y[r * ldy + 0..8), each token's integers its own (vnni: AVX-VNNI's vpdpwssd for vpmaddwd and its add).
   Chunk c of half h (its ql bytes 8c .. 8c + 7: c < 4 values of parts 0 and 2, c >= 4 of parts 1 and 3; its
   qh bytes 8 (c % 4) ..) as dotk6_x8_512_t reads it, rows 4q .. 4q + 3 a 32-byte load (q = 0, 1). */
AVX2 ALWAYS_INLINE void dotk6_x8_avx2_t(const int vnni, const int R, const int ahead, const uint8_t *G, long ns,
                                        const acts *a, const long *mi, float *Y, long ldy) {
    const __m256i rows = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* vphaddd's lanes back in row order */
    const __m256i sel0 = _mm256_loadu_si256((const __m256i *)SCALE6_SEL[0]);
    const __m256i sel1 = _mm256_loadu_si256((const __m256i *)SCALE6_SEL[1]);
    __m256 F[2], Mn[2];
    for (int r = 0; r < R; r++) F[r] = Mn[r] = _mm256_setzero_ps();
    for (long s = 0; s < ns; s++) {
        const uint8_t *p = G + s * X8_6_BYTES;
        if (ahead) prefetch_near_far(p, X8_6_BYTES);
        const int8_t *x[2];
        __m256i Z[2][2]; /* token r's rows 4q + k: dwords 2k, 2k + 1 of Z[r][q] */
        for (int r = 0; r < R; r++) {
            x[r] = a->qs + mi[r] * a->K + s * 256;
            Z[r][0] = Z[r][1] = _mm256_setzero_si256();
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) { /* i = 4h + 2 half + tq: parts tq, tq + 2 of sub-blocks 8h + 2t + half */
            const int h = i / 4, half = (i / 2) % 2, tq = i % 2;
            __m256i W[2][2][2]; /* [r][u][q]: token r, part tq + 2u, rows 4q.. */
            for (int r = 0; r < R; r++)
                for (int u = 0; u < 2; u++) W[r][u][0] = W[r][u][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int cc = 0; cc < 2; cc++) {
                const int c = 4 * tq + 2 * half + cc; /* ql chunk 8h + c; qh chunk 4h + c % 4 */
                int64_t xv[2][2]; /* token r's 8 values of parts tq and tq + 2 */
                for (int r = 0; r < R; r++) {
                    memcpy(&xv[r][0], x[r] + 128 * h + 32 * tq + 8 * (c % 4), 8);
                    memcpy(&xv[r][1], x[r] + 128 * h + 32 * (tq + 2) + 8 * (c % 4), 8);
                }
#pragma GCC unroll 2
                for (int q = 0; q < 2; q++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(p + 64 * (8 * h + c) + 32 * q));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 1024 + 64 * (4 * h + c % 4) + 32 * q));
                    const __m256i v0 = x8_q6_avx2(w, qh, tq), v1 = x8_q6_avx2(w, qh, tq + 2);
                    for (int r = 0; r < R; r++) {
                        W[r][0][q] = _mm256_add_epi16(W[r][0][q], _mm256_maddubs_epi16(v0, _mm256_set1_epi64x(xv[r][0])));
                        W[r][1][q] = _mm256_add_epi16(W[r][1][q], _mm256_maddubs_epi16(v1, _mm256_set1_epi64x(xv[r][1])));
                    }
                }
            }
#pragma GCC unroll 2
            for (int u = 0; u < 2; u++) {
                const int j = 8 * h + 2 * (tq + 2 * u) + half;
                const __m256i sw = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(p + 1536 + 8 * j))));
                const __m256i s0 = _mm256_shuffle_epi8(sw, sel0), s1 = _mm256_shuffle_epi8(sw, sel1);
                for (int r = 0; r < R; r++) {
                    Z[r][0] = vnni ? vnni_dpwssd(Z[r][0], W[r][u][0], s0) : _mm256_add_epi32(Z[r][0], _mm256_madd_epi16(W[r][u][0], s0));
                    Z[r][1] = vnni ? vnni_dpwssd(Z[r][1], W[r][u][1], s1) : _mm256_add_epi32(Z[r][1], _mm256_madd_epi16(W[r][u][1], s1));
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 1664)));
        const __m256 dm = _mm256_mul_ps(d, _mm256_set1_ps(-32.0f));
        for (int r = 0; r < R; r++) {
            const long sb = mi[r] * ns + s;
            const __m256i isum = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(Z[r][0], Z[r][1]), rows);
            /* csum: row k's scales of sub-blocks 2i, 2i + 1 as a word pair against the token's sums of them */
            __m256i C = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(p + 1536 + 16 * i));
                int32_t pair;
                memcpy(&pair, a->bsum + sb * 16 + 2 * i, 4);
                C = _mm256_add_epi32(C, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, _mm_srli_si128(b, 8))),
                                                          _mm256_set1_epi32(pair)));
            }
            const __m256 dx = _mm256_set1_ps(a->dx[sb]);
            F[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx), F[r]);
            Mn[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(C), _mm256_mul_ps(dm, dx), Mn[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + r * ldy, _mm256_add_ps(F[r], Mn[r]));
}

/* Rows [n0, n1) (whole eights) of Q4_K_X8, Q5_K_X8 or Q6_K_X8 (F) against tokens mi[0..R), T at a time where
   there are T, each token's integers its own, with AVX-VNNI's instructions where V. 2048 x 768, one thread,
   Zen 5 capped to AVX2, ms at 64 / 512 tokens, one token at a time -> two: Q5_K 2.10 / 16.9 -> 1.69 / 13.4
   (its GGUF rows, four tokens at a time, 2.06 / 16.4), Q6_K 1.91-2.00 / 14.8-15.7 -> 1.45-1.62 / 11.9-12.6,
   Q4_K on AVX-VNNI 1.04-1.07 / 8.6-8.8 -> 0.91 / 7.1-7.2; Q4_K on AVX2 1.25-1.28 / 10.1-10.5 -> 1.30-1.37 /
   10.6-11.1, so a token at a time there. */
AVX2 ALWAYS_INLINE void x8_avx2_t(const int fmt, const int vnni, const int R, const int ahead, const uint8_t *G,
                                  long ns, const acts *a, const long *mi, float *Y, long ldy) {
    if (fmt == Q6_K_X8) dotk6_x8_avx2_t(vnni, R, ahead, G, ns, a, mi, Y, ldy);
    else dotk_x8_avx2_t(fmt, vnni, R, ahead, G, ns, a, mi, Y, ldy);
}
#define X8_AVX2(NAME, F, V, T)                                                                                \
    AVX2 static void NAME(const uint8_t *W, long ldw, long n0, long n1, const acts *a, const long *mi, int R, \
                          float *Y, long ldy) {                                                               \
        const long ns = a->K / 256;                                                                           \
        const int ahead = R & FIRST_GROUP;                                                                    \
        R &= ~FIRST_GROUP;                                                                                    \
        for (long n = n0; n < n1; n += X8)                                                                    \
            for (int r = 0; r < R; r += T) {                                                                  \
                const uint8_t *G = W + n * ldw;                                                               \
                if (T == 2 && r + 1 < R) x8_avx2_t(F, V, T, ahead && !r, G, ns, a, mi + r, Y + r * ldy + n, ldy); \
                else x8_avx2_t(F, V, 1, ahead && !r, G, ns, a, mi + r, Y + r * ldy + n, ldy);                   \
            }                                                                                                 \
    }
X8_AVX2(dotk_x8_avx2, Q4_K_X8, 0, 1)
X8_AVX2(dotk5_x8_avx2, Q5_K_X8, 0, 2)
X8_AVX2(dotk6_x8_avx2, Q6_K_X8, 0, 2)
X8_AVX2(dotk_x8_vnni, Q4_K_X8, 1, 2)
X8_AVX2(dotk5_x8_vnni, Q5_K_X8, 1, 2)
X8_AVX2(dotk6_x8_vnni, Q6_K_X8, 1, 2)
#undef X8_AVX2

/* ---- rows in sixteens (Q8_0_X16, Q4_0_X16, Q4_1_X16) ---------------------------------------------

   The layouts, made at load where the AVX-512 or the AVX2 path runs (hm_interleave; quant/interleave.py
   turns them back): a matrix of Q8_0, Q4_0 or Q4_1 rows, their number a multiple of 16, keeps its bytes, but rows 16g ..
   16g + 15 hold their blocks b side by side at b * 16 * (block bytes), each block's pieces with the same
   piece of the other fifteen rows (X8_PIECES, unit i of row r at unit 16i + r):
     Q8_0 (544 bytes): [0, 32) the rows' d (fp16), [32, 544) their int8 q in units of 4 (bytes 4i ..
       4i + 3 of row r at 32 + 64i + 4r);
     Q4_0 (288 bytes): [0, 32) their d, [32, 288) their nibbles in units of 4 (bytes 4i .. 4i + 3 of
       row r, whose low nibbles are values 4i .. 4i + 3 and high nibbles 16 + 4i .., at 32 + 64i + 4r);
     Q4_1 (320 bytes): [0, 32) their d, [32, 64) their m, [64, 320) their nibbles as Q4_0's.
   A 64-byte load then holds four values of sixteen rows, dword lane r row r's: vpdpbusd against the
   token's four bytes broadcast sums each row's block in its own lane, with no sum across lanes, and
   sixteen rows' I_b take one fma (block sums, above; Q4_1's minimums a second). The 16 x 16 bytes of
   four values also are a tile's 16 columns, so the AMX tiles read Q8_0's blocks as they lie (copied
   to 64-byte lines) and Q4_0's and Q4_1's once their nibbles are split (amx_x16). */
#define X16 16

/* Sixteen interleaved rows at G (nb blocks) against the R tokens mi[0..R): Y[r * ldy + 0..16), lane k
   row k. Q8_0's int8 flipped to unsigned (+128: what ob takes back off), Q4_0's nibbles as they are (8:
   likewise). */
AVX512 ALWAYS_INLINE void dot32_x16_512_t(const int fmt, const int R, const int ahead, const uint8_t *G, long nb,
                                          const acts *a, const long *mi, float *Y, long ldy) {
    const long gb = X16 * block_bytes(fmt), K = a->K;
    const int q41 = fmt == Q4_1_X16, at = q41 ? 64 : 32; /* where the quants start (Q4_1: after d, m) */
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[GROUP];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = G + b * gb;
        if (R == 1 || ahead) prefetch_far(p, gb);
        const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 wm = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))) : _mm512_setzero_ps();
        __m512i q[8]; /* q[k]: values 4k .. 4k + 3 of the sixteen rows */
        if (rows_fmt(fmt) == Q8_0) {
            for (int k = 0; k < 8; k++) q[k] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + 32 + 64 * k)), flip);
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(p + at + 64 * c));
                q[c] = _mm512_and_si512(v, m4);
                q[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t *x = a->qs + mi[r] * K + 32 * b;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int k = 0; k < 8; k += 2) {
                int32_t x0, x1;
                memcpy(&x0, x + 4 * k, 4);
                memcpy(&x1, x + 4 * k + 4, 4);
                s0 = _mm512_dpbusd_epi32(s0, q[k], _mm512_set1_epi32(x0));
                s1 = _mm512_dpbusd_epi32(s1, q[k + 1], _mm512_set1_epi32(x1));
            }
            const long l = mi[r] * (K / 32) + b;
            const __m512i I = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(a->ob[l]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(w, _mm512_set1_ps(a->db[l])), acc[r]);
            if (q41) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a->sf[l]), wm, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(Y + r * ldy, acc[r]);
}

/* Rows [n0, n1) (whole sixteens) of Q8_0_X16, Q4_0_X16 or Q4_1_X16 weights against tokens mi[0..R) on a path's
   kernel (dot32_x16_512_t, dot32_x16_avx2_t below). */
#define X16_DOT(NAME, F, TARGET, KERNEL)                                                                    \
    TARGET static void NAME(const uint8_t *W, long ldw, long n0, long n1, const acts *a, const long *mi, int R, \
                            float *Y, long ldy) {                                                           \
        const long nb = a->K / 32;                                                                          \
        const int ahead = R & FIRST_GROUP;                                                                  \
        R &= ~FIRST_GROUP;                                                                                  \
        for (long n = n0; n < n1; n += X16) {                                                               \
            const uint8_t *G = W + n * ldw;                                                                 \
            switch (R) {                                                                                    \
            case 1: KERNEL(F, 1, ahead, G, nb, a, mi, Y + n, ldy); break;                                   \
            case 2: KERNEL(F, 2, ahead, G, nb, a, mi, Y + n, ldy); break;                                   \
            case 3: KERNEL(F, 3, ahead, G, nb, a, mi, Y + n, ldy); break;                                   \
            default: KERNEL(F, GROUP, ahead, G, nb, a, mi, Y + n, ldy); break;                              \
            }                                                                                               \
        }                                                                                                   \
    }
X16_DOT(dot8_x16_512, Q8_0_X16, AVX512, dot32_x16_512_t)
X16_DOT(dot4_x16_512, Q4_0_X16, AVX512, dot32_x16_512_t)
X16_DOT(dot41_x16_512, Q4_1_X16, AVX512, dot32_x16_512_t)

/* ---- one function per (path, format), the token count R a constant in each case of its switch ---- */

typedef void (*dot_fn)(const uint8_t *W, long ldw, long n0, long n1, const acts *a, const long *mi, int R,
                       float *Y, long ldy);

#define R_CASES(T, F)                                                   \
    const int ahead = R & FIRST_GROUP;                                  \
    R &= ~FIRST_GROUP;                                                  \
    switch (R) {                                                        \
    case 1: T(F, 1, ahead, W, ldw, n0, n1, a, mi, Y, ldy); break;       \
    case 2: T(F, 2, ahead, W, ldw, n0, n1, a, mi, Y, ldy); break;       \
    case 3: T(F, 3, ahead, W, ldw, n0, n1, a, mi, Y, ldy); break;       \
    default: T(F, GROUP, ahead, W, ldw, n0, n1, a, mi, Y, ldy); break;  \
    }
#define PATHS(F, T2, T512)                                                                                  \
    AVX2 static void dot_avx2_##F(const uint8_t *W, long ldw, long n0, long n1, const acts *a, const long *mi, \
                                  int R, float *Y, long ldy) {                                             \
        R_CASES(T2, F)                                                                                      \
    }                                                                                                       \
    AVX512 static void dot_512_##F(const uint8_t *W, long ldw, long n0, long n1, const acts *a, const long *mi, \
                                   int R, float *Y, long ldy) {                                            \
        R_CASES(T512, F)                                                                                    \
    }
PATHS(Q4_K, dotk_avx2_t, dotk_512_t)
PATHS(Q5_K, dotk_avx2_t, dotk_512_t)
PATHS(Q6_K, dotk_avx2_t, dotk_512_t)

#define SUMS(F)                                                                                             \
    AVX2 static void dot_##F(const uint8_t *W, long ldw, long n0, long n1, const acts *a, const long *mi, int R, \
                             float *Y, long ldy) {                                                          \
        R_CASES(dot32s_t, F)                                                                                \
    }
SUMS(Q8_0)
SUMS(Q4_0)
SUMS(Q4_1)

/* The kernel of GGUF's rows in `fmt` on a path (NULL for the interleaved layouts, which product_x8 reads
   through grouped_dot). */
static dot_fn dot_for(int fmt, int isa) {
    int wide = isa == PATH_AVX512;
    switch (fmt) {
    case Q8_0: return dot_Q8_0; /* both paths */
    case Q4_0: return dot_Q4_0;
    case Q4_1: return dot_Q4_1;
    case Q4_K: return wide ? dot_512_Q4_K : dot_avx2_Q4_K;
    case Q5_K: return wide ? dot_512_Q5_K : dot_avx2_Q5_K;
    case Q6_K: return wide ? dot_512_Q6_K : dot_avx2_Q6_K;
    }
    return NULL;
}

/* dot32_x16_512_t on AVX2: sixteen interleaved rows as two halves of eight (a 32-byte load holds four values of
   eight rows, dword lane r row r's), against the R tokens mi[0..R). Q8_0's int8 by the signs trick of dot32s_t
   (|q| times x with q's sign: u8 x s8 pairs within int16; vpmaddubsw on q + 128 would saturate), Q4_0's and
   Q4_1's nibbles as they are (Q4_0's 8 taken off by ob). Each row's I_b is the same exact integer and its float
   operations dot32s_t's, so each row keeps the bits of GGUF's rows. On a Zen 5 core capped to AVX2 GGUF's
   Q8_0 rows, eight side by side, read ~9 GB/s a token from RAM in a decode step. */
AVX2 ALWAYS_INLINE void dot32_x16_avx2_t(const int fmt, const int vnni, const int R, const int ahead, const uint8_t *G,
                                         long nb, const acts *a, const long *mi, float *Y, long ldy) {
    const long gb = X16 * block_bytes(fmt), K = a->K;
    const int q41 = fmt == Q4_1_X16, q8 = rows_fmt(fmt) == Q8_0, at = q41 ? 64 : 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[GROUP][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = G + b * gb;
        if (R == 1 || ahead) prefetch_near_far(p, gb);
        for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
            const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
            const __m256 wm = q41 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * h))) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const int8_t *x = a->qs + mi[r] * K + 32 * b;
                __m256i S = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) { /* values 4k .. 4k + 3 of the eight rows */
                    int32_t xk;
                    memcpy(&xk, x + 4 * k, 4);
                    const __m256i xv = _mm256_set1_epi32(xk);
                    __m256i u, s; /* unsigned and signed bytes whose products are the values' */
                    if (q8) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 + 64 * k + 32 * h));
                        u = _mm256_abs_epi8(v), s = _mm256_sign_epi8(xv, v);
                    } else { /* nibbles: byte 4i + j's low nibble value 4i + j, its high 16 + 4i + j */
                        const __m256i n = _mm256_loadu_si256((const __m256i *)(p + at + 64 * (k % 4) + 32 * h));
                        u = k < 4 ? _mm256_and_si256(n, m4) : _mm256_and_si256(_mm256_srli_epi16(n, 4), m4), s = xv;
                    }
                    S = vnni ? vnni_dpbusd(S, u, s) : _mm256_add_epi32(S, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
                }
                const long l = mi[r] * (K / 32) + b;
                if (fmt == Q4_0_X16) S = _mm256_sub_epi32(S, _mm256_set1_epi32(a->ob[l]));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(w, _mm256_set1_ps(a->db[l])), acc[r][h]);
                if (q41) acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(a->sf[l]), wm, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(Y + r * ldy, acc[r][0]);
        _mm256_storeu_ps(Y + r * ldy + 8, acc[r][1]);
    }
}

#define X16_AVX2(F, R, ...) dot32_x16_avx2_t(F, 0, R, __VA_ARGS__)
#define X16_VNNI(F, R, ...) dot32_x16_avx2_t(F, 1, R, __VA_ARGS__)
X16_DOT(dot8_x16_avx2, Q8_0_X16, AVX2, X16_AVX2)
X16_DOT(dot4_x16_avx2, Q4_0_X16, AVX2, X16_AVX2)
X16_DOT(dot41_x16_avx2, Q4_1_X16, AVX2, X16_AVX2)
X16_DOT(dot8_x16_vnni, Q8_0_X16, AVX2, X16_VNNI)
X16_DOT(dot4_x16_vnni, Q4_0_X16, AVX2, X16_VNNI)
X16_DOT(dot41_x16_vnni, Q4_1_X16, AVX2, X16_VNNI)
#undef X16_AVX2
#undef X16_VNNI
#undef X16_DOT

/* The kernel that reads an interleaved layout (`fmt`, one of the six) as it lies on a path: AVX-512
   VNNI's, or AVX2's, with AVX-VNNI's vpdpbusd and vpdpwssd on PATH_AVXVNNI. */
static dot_fn grouped_dot(int fmt, int isa) {
    if (isa == PATH_AVXVNNI) {
        switch (fmt) {
        case Q4_K_X8: return dotk_x8_vnni;
        case Q5_K_X8: return dotk5_x8_vnni;
        case Q6_K_X8: return dotk6_x8_vnni;
        case Q8_0_X16: return dot8_x16_vnni;
        case Q4_0_X16: return dot4_x16_vnni;
        default: return dot41_x16_vnni;
        }
    }
    if (isa != PATH_AVX512) {
        switch (fmt) {
        case Q4_K_X8: return dotk_x8_avx2;
        case Q5_K_X8: return dotk5_x8_avx2;
        case Q6_K_X8: return dotk6_x8_avx2;
        case Q8_0_X16: return dot8_x16_avx2;
        case Q4_0_X16: return dot4_x16_avx2;
        default: return dot41_x16_avx2;
        }
    }
    switch (fmt) {
    case Q4_K_X8: return dotk_x8_512;
    case Q5_K_X8: return dotk5_x8_512;
    case Q6_K_X8: return dotk6_x8_512;
    case Q8_0_X16: return dot8_x16_512;
    case Q4_0_X16: return dot4_x16_512;
    default: return dot41_x16_512;
    }
}

/* ---- products: rows of W against all tokens, in tiles ----------------------------------------------- */

/* One weight matrix against quantised activations: rows [n0, n1) of Y [M, ldy] for tokens mi[0..M) (the
   activation rows; NULL: 0..M-1). Rows go in tiles of TILE_BYTES, each tile met by every group of GROUP
   tokens while it is in L1. */
typedef struct product product;
struct product {
    dot_fn dot;
    const uint8_t *W;
    long ldw;
    const acts *a;
    const long *mi;
    long M;
    float *Y;
    long ldy;
    int fmt;        /* the weights' format: interleaved rows (in eights or sixteens) go to product_x8 */
    int isa;        /* the path it runs on */
};

static void product_x8(const product *p, long n0, long n1);

/* GGUF's rows of a format with an interleaved layout against REGROUP_TOKENS or more tokens at a time (blocks
   left in the file's map, which the loader cannot rearrange): each group of 8 or 16 rows is rearranged into
   `buf` as hm_interleave lays it out, for each chunk of tokens, and read by the layout's kernel, whose bits
   are the rows' (the same integers, the same float operations). Rows [n0, n1) of one chunk; returns the
   first row it left (past the last whole group). One thread, Zen 5, 2048 x 2048 from L2, 64 tokens: GGUF's
   rows Q4_K 3.00 ms, Q6_K 2.84, Q8_0 6.25 against 1.01, 1.38, 0.96 in the layout, which its rearranging
   (~7 GB/s) adds ~0.3-0.6 ms to (docs/notes/2026-12-08-rows-ahead-for-every-token-count.md). */
#define REGROUP_TOKENS 16
static long regrouped(const product *p, long n0, long n1, long m0, long m1, uint8_t *buf) {
    const int x = layout_of(p->fmt);
    const long g = group_rows(x), bb = block_bytes(p->fmt), nb = p->a->K / block_elems(p->fmt);
    const dot_fn dot = grouped_dot(x, p->isa);
    long n = n0;
    for (; n + g <= n1; n += g) {
        for (long s = 0; s < nb; s++) x8_move(x, buf + s * g * bb, p->W + n * p->ldw + s * bb, p->ldw);
        for (long m = m0; m < m1; m += GROUP) {
            long idx[GROUP];
            int R = (int)min_l(m1 - m, GROUP);
            for (int r = 0; r < R; r++) idx[r] = p->mi ? p->mi[m + r] : m + r;
            dot(buf, 0, 0, g, p->a, idx, R, p->Y + m * p->ldy + n, p->ldy);
        }
    }
    return n;
}

static void product_tiles(const product *p, long n0, long n1) {
    if (group_rows(p->fmt) > 1) {
        product_x8(p, n0, n1);
        return;
    }
    /* GGUF's rows that a layout's kernels can take, many tokens at a time: a buffer of one group (none: the
       rows' own kernels) */
    uint8_t *buf = NULL;
    const long g = layout_of(p->fmt) ? group_rows(layout_of(p->fmt)) : 0;
    if (g && p->isa && p->M >= REGROUP_TOKENS && n1 - n0 >= g)
        buf = malloc((size_t)(g * (p->a->K / block_elems(p->fmt)) * block_bytes(p->fmt)));
    long tile = TILE_BYTES / p->ldw > 0 ? TILE_BYTES / p->ldw : 1;
    for (long m0 = 0; m0 < p->M; m0 += CHUNK_TOKENS) {
        long m1 = min_l(m0 + CHUNK_TOKENS, p->M);
        const long r0 = buf && m1 - m0 >= REGROUP_TOKENS ? regrouped(p, n0, n1, m0, m1, buf) : n0;
        for (long t = r0; t < n1; t += tile) {
            long t1 = min_l(t + tile, n1);
            for (long m = m0; m < m1; m += GROUP) {
                long idx[GROUP];
                int R = (int)min_l(m1 - m, GROUP);
                for (int r = 0; r < R; r++) idx[r] = p->mi ? p->mi[m + r] : m + r;
                p->dot(p->W, p->ldw, t, t1, p->a, idx, m == m0 ? R | FIRST_GROUP : R, p->Y + m * p->ldy, p->ldy);
            }
        }
    }
    free(buf);
}

/* Rows [n0, n1) (whole groups) of interleaved rows, read as they lie: on AVX-512 a group of rows against up
   to GROUP tokens at a time, CHUNK_TOKENS tokens' activations meeting every group before the next tokens
   (as product_tiles); on AVX2 likewise, the rows in eights a token or two at a time (X8_AVX2), which beat
   GGUF's rows four tokens at a time at every count (one thread, Zen 5 capped to AVX2: Q4_K 768 x 2048
   1.3-1.5x from 1 to 512 tokens; 2048 x 768 from RAM, one token: Q5_K 20 -> 27 GB/s, Q6_K 23 -> 32), and
   the rows in sixteens (dot32_x16_avx2_t). The results are the GGUF rows' bits. */
/* Rows [n0, n1) (whole groups) and tokens [t0, t1) of a product of interleaved rows on the kernels that
   read them as they lie (grouped_dot). */
static void x8_vnni(const product *p, long n0, long n1, long t0, long t1) {
    const dot_fn dot = grouped_dot(p->fmt, p->isa);
    const long g = group_rows(p->fmt);
    for (long m0 = t0; m0 < t1; m0 += CHUNK_TOKENS) {
        long m1 = min_l(m0 + CHUNK_TOKENS, t1);
        for (long n = n0; n < n1; n += g)
            for (long m = m0; m < m1; m += GROUP) {
                long idx[GROUP];
                int R = (int)min_l(m1 - m, GROUP);
                for (int r = 0; r < R; r++) idx[r] = p->mi ? p->mi[m + r] : m + r;
                dot(p->W, p->ldw, n, n + g, p->a, idx, m == m0 ? R | FIRST_GROUP : R, p->Y + m * p->ldy, p->ldy);
            }
    }
}

static int amx_x8(const product *p, long n0, long n1);
static int amx_x16(const product *p, long n0, long n1);

static void product_x8(const product *p, long n0, long n1) {
    if (p->isa == PATH_AVX512) {
        if (!(is_x16(p->fmt) ? amx_x16(p, n0, n1) : amx_x8(p, n0, n1))) x8_vnni(p, n0, n1, 0, p->M);
        return;
    }
    x8_vnni(p, n0, n1, 0, p->M);
}

/* ---- Q4_K, Q5_K and Q6_K rows in eights against many tokens on AMX-INT8 tiles ----------------------

   Where the CPU has AMX-INT8 (and Linux grants the tiles' state: native/quant.py), a product of rows
   in eights with 16 or more consecutive token rows (a dense linear's prefill, a routed expert's tokens
   quantised as its own rows) computes each super-block's two integers (K_FMA's isum and csum) on tiles
   and in vpdpwssd, 16 weight rows by 16 or 32 tokens at a time, then the same float operations as
   dotk_x8_512_t / dotk5_x8_512_t / dotk6_x8_512_t: the same bits.

   The weights of 16 rows are first laid out as B tiles, per super-block two planes of 64 k-rows x 16
   rows x 4 bytes (k-row k: positions 4k..4k+3 of the super-block in the activations' order, paired for
   Q4_K and Q5_K, natural for Q6_K): the low byte of scale x q and the byte above it (Q4_K: scale x q <=
   63 x 15 < 1024, high bits 0..3; Q5_K: <= 63 x 31 < 2048, 0..7; Q6_K: int8 scale x q in -8128..8001, high byte -32..31, signed). With A the
   tokens' int8 bytes as quantised (16 tokens x 64 positions; acts' qt holds them 16 x 64 bytes in a
   row), tile dot products (signed x unsigned bytes for the low plane, signed x signed for the high)
   give C_lo + 256 C_hi = isum exactly; csum is the rows' minimums of blocks 2j, 2j + 1 (Q6_K: scales
   of sub-blocks 2j, 2j + 1) as word pairs against the tokens' sums of those (acts' bpair; Q6_K: bsum)
   in four (eight) vpdpwssd. Each B tile serves two tiles of tokens where there are two. Rows past the
   last whole 16, tokens past the last whole 16, and tokens picked out of a larger set (an expert's,
   `mi`) take the VNNI path. */
#define AMX8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define AMX_ROWS 16
#define AMX_TOKENS 16
#define AMX_PLANE (64 * 64) /* a plane's bytes per super-block: 64 k-rows x 16 rows x 4 */
/* A super-block's panel: 2 planes, the minimums' (Q6_K: scales') word pairs against the activations' sums
   (4 or 8 registers), d and dm. */
#define AMX_PAIRS(fmt) ((fmt) == Q6_K_X8 ? 8 : 4)
#define AMX_SB(fmt) (2 * AMX_PLANE + AMX_PAIRS(fmt) * 64 + 2 * 64)
static int amx8_on;

/* Whether products on rows in eights take the tiles (only once Linux granted them: native/quant.py). */
void hm_set_amx8(int on) { amx8_on = on; }

/* Whether a product of weights in `fmt` with M tokens takes the tiles where its tokens are consecutive
   rows (a routed expert's tokens are then quantised as its own rows: experts_run). One tile of 16
   tokens already gains since the tiles read the tokens in tile order (hot, 1 thread: Q4_K 768x2048 /
   2048x768 at 16 tokens 0.18 -> 0.16 / 0.19 -> 0.12 ms, Q6_K 0.27 -> 0.21 / 0.29 -> 0.20; before that
   copy, fewer than 32 tokens measured no faster; docs/notes/2026-12-07-q6k-rows-in-eights.md). */
#define AMX_MIN_TOKENS 16
static int tiles_take(int fmt, int isa, long M) {
    return amx8_on && (is_x8(fmt) || is_x16(fmt)) && isa == PATH_AVX512 && M >= AMX_MIN_TOKENS;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_cfg;

static const int32_t EVEN_D[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const int32_t ODD_D[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

/* Bytes q (u8) times per-row scales: the low bytes of the products and their high bits, each in q's
   byte places. S: words 4r + i = row r's scale (the pairs (s, 0) of WSEL), for the even bytes. */
AMX8 ALWAYS_INLINE void scaled_bytes(__m512i q, __m512i S, __m512i *lo, __m512i *hi) {
    const __m512i even = _mm512_maddubs_epi16(q, S), odd = _mm512_maddubs_epi16(q, _mm512_slli_epi16(S, 8));
    const __m512i m00ff = _mm512_set1_epi16(0x00FF), mff00 = _mm512_set1_epi16((short)0xFF00);
    *lo = _mm512_or_si512(_mm512_and_si512(even, m00ff), _mm512_slli_epi16(odd, 8));
    *hi = _mm512_or_si512(_mm512_srli_epi16(even, 8), _mm512_and_si512(odd, mff00));
}

/* Rows in eights G[0], G[1] (16 rows, ns super-blocks) as `panel`, AMX_SB bytes a super-block: the two B
   tile planes, then the minimums' word pairs (4 x 16 dwords: row r's minimums of blocks 2j, 2j + 1), then
   d and -dmin as fp32 (16 each). */
AMX8 static void amx_panel(const int fmt, const uint8_t *const G[2], long ns, uint8_t *panel) {
    static const int8_t pos[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    const __m512i m4 = _mm512_set1_epi8(0x0F), even = _mm512_loadu_si512((const void *)EVEN_D),
                  odd = _mm512_loadu_si512((const void *)ODD_D), midx = _mm512_loadu_si512((const void *)MIDX_W);
    for (long s = 0; s < ns; s++) {
        const long xb = fmt == Q5_K_X8 ? X8_5_BYTES : X8_BYTES, qs = fmt == Q5_K_X8 ? 384 : 128;
        const uint8_t *p[2] = {G[0] + s * xb, G[1] + s * xb};
        uint8_t *lo_plane = panel + s * AMX_SB(Q4_K_X8), *hi_plane = lo_plane + AMX_PLANE, *mins = hi_plane + AMX_PLANE;
        float *d = (float *)(mins + 4 * 64);
        __m512i sw[2][2];
        __m256i mn[2][2];
        __m512i mp[2][2]; /* an eight's minimum word pairs, dword lane 8j + r (x8's mp) */
        for (int e = 0; e < 2; e++) {
            x8_scales(p[e], sw[e], mn[e]);
            mp[e][0] = _mm512_permutexvar_epi16(midx, _mm512_cvtepu8_epi16(mn[e][0]));
            mp[e][1] = _mm512_permutexvar_epi16(midx, _mm512_cvtepu8_epi16(mn[e][1]));
            _mm256_storeu_ps(d + 8 * e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p[e])));
            _mm256_storeu_ps(d + 16 + 8 * e, _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p[e] + 16))),
                                                            _mm256_set1_ps(-0.0f)));
        }
        for (int j = 0; j < 4; j++) { /* blocks 2j, 2j + 1: lanes 8 (j % 2) + r of mp[.][j / 2], 16 rows */
            const __m512i lanes = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                                                   _mm512_set1_epi32(8 * (j % 2)));
            _mm512_storeu_si512((void *)(mins + 64 * j), _mm512_permutex2var_epi32(mp[0][j / 2], lanes, mp[1][j / 2]));
        }
        for (int b = 0; b < 8; b++) { /* natural block b: group b / 2, low (even b) or high nibbles */
            const long k0 = 8 * pos[b]; /* its k-rows k0 .. k0 + 7 */
            const int g = b / 2;
            __m512i S[2];
            for (int e = 0; e < 2; e++) S[e] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)WSEL[b % 4]), sw[e][b / 4]);
            for (int c = 0; c < 4; c++) {
                __m512i lo[2], hi[2];
                for (int e = 0; e < 2; e++) {
                    __m512i w = _mm512_loadu_si512((const void *)(p[e] + qs + 64 * (4 * g + c)));
                    w = b & 1 ? _mm512_and_si512(_mm512_srli_epi16(w, 4), m4) : _mm512_and_si512(w, m4);
                    if (fmt == Q5_K_X8) w = _mm512_or_si512(w, x8_fifth(_mm512_loadu_si512((const void *)(p[e] + 128 + 64 * c)), b));
                    scaled_bytes(w, S[e], &lo[e], &hi[e]);
                }
                /* dwords 2r, 2r + 1 of an eight's register: row r's positions 8c .. 8c + 3, 8c + 4 .. 8c + 7 */
                const long k = k0 + 2 * c;
                _mm512_storeu_si512((void *)(lo_plane + 64 * k), _mm512_permutex2var_epi32(lo[0], even, lo[1]));
                _mm512_storeu_si512((void *)(lo_plane + 64 * (k + 1)), _mm512_permutex2var_epi32(lo[0], odd, lo[1]));
                _mm512_storeu_si512((void *)(hi_plane + 64 * k), _mm512_permutex2var_epi32(hi[0], even, hi[1]));
                _mm512_storeu_si512((void *)(hi_plane + 64 * (k + 1)), _mm512_permutex2var_epi32(hi[0], odd, hi[1]));
            }
        }
    }
}

/* Q6_K rows in eights G[0], G[1] (16 rows, ns super-blocks) as `panel`, AMX_SB(Q6_K_X8) bytes a
   super-block: the two B tile planes of scale x q (signed: its low byte and the byte above, -32 .. 31),
   k-rows in the activations' natural order; then the scales' word pairs (8 x 16 dwords: row r's scales
   2i, 2i + 1), then d and -32 d as fp32 (16 each). */
AMX8 static void amx_panel6(const uint8_t *const G[2], long ns, uint8_t *panel) {
    const __m512i even = _mm512_loadu_si512((const void *)EVEN_D), odd = _mm512_loadu_si512((const void *)ODD_D),
                  midx = _mm512_loadu_si512((const void *)MIDX_W), low = _mm512_set1_epi16(0x00FF);
    for (long s = 0; s < ns; s++) {
        const uint8_t *p[2] = {G[0] + s * X8_6_BYTES, G[1] + s * X8_6_BYTES};
        uint8_t *lo_plane = panel + s * AMX_SB(Q6_K_X8), *hi_plane = lo_plane + AMX_PLANE, *pairs = hi_plane + AMX_PLANE;
        float *d = (float *)(pairs + 8 * 64);
        __m512i sw[2][4];
        for (int e = 0; e < 2; e++) {
            for (int q = 0; q < 4; q++)
                sw[e][q] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p[e] + 1536 + 32 * q)));
            const __m256 de = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p[e] + 1664)));
            _mm256_storeu_ps(d + 8 * e, de);
            _mm256_storeu_ps(d + 16 + 8 * e, _mm256_mul_ps(de, _mm256_set1_ps(-32.0f)));
        }
        for (int i = 0; i < 8; i++) { /* scales 2i, 2i + 1: lanes 8 (i % 2) + r of the pairs of sw[.][i / 2], 16 rows */
            const __m512i lanes = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                                                   _mm512_set1_epi32(8 * (i % 2)));
            const __m512i m0 = _mm512_permutexvar_epi16(midx, sw[0][i / 2]), m1 = _mm512_permutexvar_epi16(midx, sw[1][i / 2]);
            _mm512_storeu_si512((void *)(pairs + 64 * i), _mm512_permutex2var_epi32(m0, lanes, m1));
        }
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 8; c++)
                for (int t = c / 4; t < 4; t += 2) { /* values v .. v + 7: k-rows v / 4, v / 4 + 1 */
                    const int v = 128 * h + 32 * t + 8 * (c % 4), j = v / 16;
                    __m512i lo[2], hi[2];
                    for (int e = 0; e < 2; e++) {
                        const __m512i w = _mm512_loadu_si512((const void *)(p[e] + 64 * (8 * h + c)));
                        const __m512i qh = _mm512_loadu_si512((const void *)(p[e] + 1024 + 64 * (4 * h + c % 4)));
                        const __m512i S = _mm512_and_si512(
                            _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)WSEL[j % 4]), sw[e][j / 4]), low);
                        scaled_bytes(x8_q6(w, qh, t), S, &lo[e], &hi[e]);
                    }
                    const long k = v / 4;
                    _mm512_storeu_si512((void *)(lo_plane + 64 * k), _mm512_permutex2var_epi32(lo[0], even, lo[1]));
                    _mm512_storeu_si512((void *)(lo_plane + 64 * (k + 1)), _mm512_permutex2var_epi32(lo[0], odd, lo[1]));
                    _mm512_storeu_si512((void *)(hi_plane + 64 * k), _mm512_permutex2var_epi32(hi[0], even, hi[1]));
                    _mm512_storeu_si512((void *)(hi_plane + 64 * (k + 1)), _mm512_permutex2var_epi32(hi[0], odd, hi[1]));
                }
    }
}

/* TT tiles of 16 tokens from m (consecutive rows of `a`) against a panel of 16 rows in `fmt` (Q4_K_X8,
   Q6_K_X8): Y[t * ldy + 0..16). Tiles: C lo / hi of token tile i at 2i, 2i + 1; A of tile i at 4 + 3i;
   the B planes at 5, 6. The high plane is signed (Q6_K's scales are; Q4_K's high bits, 0..3, read the
   same either way). */
AMX8 ALWAYS_INLINE void amx_tokens(const int fmt, const int TT, const uint8_t *panel, long ns, const acts *a, long m,
                                   float *Y, long ldy) {
    int32_t C[4][AMX_TOKENS * AMX_ROWS];
    float F[2 * AMX_TOKENS][AMX_ROWS], Fm[2 * AMX_TOKENS][AMX_ROWS];
    for (long s = 0; s < ns; s++) {
        const uint8_t *P = panel + s * AMX_SB(fmt);
        const __m512i *mins = (const __m512i *)(P + 2 * AMX_PLANE);
        const float *dd = (const float *)(P + 2 * AMX_PLANE + AMX_PAIRS(fmt) * 64);
        /* token tile i's 64 columns j: in qt (16 x 64 bytes in a row), else in place (rows K apart); the
           next token tile 16 K bytes on either way */
        const long lda = a->qt ? 64 : a->K, step = a->qt ? 1024 : 64, next = AMX_TOKENS * a->K;
        const int8_t *A = a->qt ? a->qt + (m / AMX_TOKENS * (a->K / 64) + 4 * s) * 1024 : a->qs + m * a->K + s * 256;
        _tile_zero(0);
        _tile_zero(1);
        if (TT == 2) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int j = 0; j < 4; j++) { /* positions 64j .. 64j + 63: k-rows 16j .. 16j + 15 */
            _tile_loadd(5, P + 1024 * j, 64);
            _tile_loadd(6, P + AMX_PLANE + 1024 * j, 64);
            _tile_loadd(4, A + step * j, lda);
            _tile_dpbsud(0, 4, 5);
            _tile_dpbssd(1, 4, 6);
            if (TT == 2) {
                _tile_loadd(7, A + next + step * j, lda);
                _tile_dpbsud(2, 7, 5);
                _tile_dpbssd(3, 7, 6);
            }
        }
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        if (TT == 2) {
            _tile_stored(2, C[2], 64);
            _tile_stored(3, C[3], 64);
        }
        const __m512 d = _mm512_loadu_ps(dd), dm = _mm512_loadu_ps(dd + 16);
        for (int t = 0; t < TT * AMX_TOKENS; t++) {
            const int32_t *lo = C[2 * (t / AMX_TOKENS)] + 16 * (t % AMX_TOKENS), *hi = lo + AMX_TOKENS * AMX_ROWS;
            const __m512i isum = _mm512_add_epi32(_mm512_loadu_si512((const void *)lo),
                                                  _mm512_slli_epi32(_mm512_loadu_si512((const void *)hi), 8));
            /* the activations' sums as dwords of word pairs: Q4_K's block pairs, Q6_K's 16-value sums */
            const int32_t *bp = fmt == Q6_K_X8 ? (const int32_t *)(a->bsum + ((m + t) * ns + s) * 16)
                                               : a->bpair + ((m + t) * ns + s) * 4;
            __m512i csum = _mm512_setzero_si512();
            for (int j = 0; j < AMX_PAIRS(fmt); j++) csum = _mm512_dpwssd_epi32(csum, mins[j], _mm512_set1_epi32(bp[j]));
            const __m512 dx = _mm512_set1_ps(a->dx[(m + t) * ns + s]);
            /* the sums start at 0 (the VNNI path's fma onto a zeroed register), not read from memory */
            const __m512 f0 = s ? _mm512_loadu_ps(F[t]) : _mm512_setzero_ps(), fm0 = s ? _mm512_loadu_ps(Fm[t]) : _mm512_setzero_ps();
            _mm512_storeu_ps(F[t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), f0));
            _mm512_storeu_ps(Fm[t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(csum), _mm512_mul_ps(dm, dx), fm0));
        }
    }
    for (int t = 0; t < TT * AMX_TOKENS; t++)
        _mm512_storeu_ps(Y + t * ldy, _mm512_add_ps(_mm512_loadu_ps(F[t]), _mm512_loadu_ps(Fm[t])));
}

/* Rows [n0, n1) of a product of rows in eights on the tiles where they apply, the rest on the VNNI path; 0
   where the tiles do not apply at all (the caller then runs it all on the VNNI path). */
AMX8 static int amx_x8(const product *p, long n0, long n1) {
    const long rows = (n1 - n0) / AMX_ROWS * AMX_ROWS, tokens = p->M / AMX_TOKENS * AMX_TOKENS;
    const long ns = p->a->K / 256;
    const int six = p->fmt == Q6_K_X8;
    if (!tiles_take(p->fmt, p->isa, p->M) || p->mi || !rows) return 0;
    uint8_t *panel = aligned_alloc(64, (size_t)(ns * AMX_SB(p->fmt)));
    if (!panel) return 0;
    tile_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16; /* every tile 16 x 64 bytes */
    _tile_loadconfig(&cfg);
    for (long n = n0; n < n0 + rows; n += AMX_ROWS) {
        const uint8_t *G[2] = {p->W + n * p->ldw, p->W + (n + X8) * p->ldw};
        if (six) amx_panel6(G, ns, panel);
        else amx_panel(p->fmt, G, ns, panel); /* Q4_K's and Q5_K's panels are alike */
        long m = 0;
        for (; m + 2 * AMX_TOKENS <= tokens; m += 2 * AMX_TOKENS) {
            float *Y = p->Y + m * p->ldy + n;
            if (six) amx_tokens(Q6_K_X8, 2, panel, ns, p->a, m, Y, p->ldy);
            else amx_tokens(Q4_K_X8, 2, panel, ns, p->a, m, Y, p->ldy);
        }
        if (m < tokens) {
            float *Y = p->Y + m * p->ldy + n;
            if (six) amx_tokens(Q6_K_X8, 1, panel, ns, p->a, m, Y, p->ldy);
            else amx_tokens(Q4_K_X8, 1, panel, ns, p->a, m, Y, p->ldy);
        }
    }
    _tile_release();
    free(panel);
    if (tokens < p->M) x8_vnni(p, n0, n0 + rows, tokens, p->M);
    if (n0 + rows < n1) x8_vnni(p, n0 + rows, n1, 0, p->M);
    return 1;
}

/* ---- rows in sixteens against many tokens on AMX-INT8 tiles ----------------------------------------

   Where the tiles are granted (as for rows in eights), a product of rows in sixteens with 16 or more
   consecutive token rows and K a multiple of 64 takes each block's 16 tokens x 16 rows of I_b from one
   tile product of K = 32: A the tokens' 32 bytes of the block (acts' qt), B the rows' 32 values as 8
   k-rows of 16 rows x 4 bytes (Q8_0's layout as it lies; Q4_0's nibbles as q - 8, Q4_1's as q), copied once per
   sixteen rows into a panel; signed x signed bytes (tdpbssd) give I_b with no offset. Each I_b then
   takes the fma of block sums, sixteen rows of one token in a register: the VNNI path's bits. Tokens
   past the last whole 16 and tokens picked out of a larger set take the VNNI path. The same products
   in bf16 (tdpbf16ps: int8 values and a block's sums are exact there, and I_b comes out as fp32, no
   conversion in the float pass) gave the same bits 1.5x slower (768x2048 x 512 tokens 4.34 against
   2.78 ms). */

/* Rows in sixteens G (nb blocks) as `panel`: per block 8 k-rows of 16 rows x 4 values, int8: Q8_0's q
   as they lie (a copy: B tiles read from 64-byte lines, not across two), Q4_0's q - 8. */
AMX8 static void x16_panel(const int fmt, const uint8_t *G, long nb, uint8_t *panel) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    if (fmt == Q8_0_X16) {
        for (long b = 0; b < nb; b++)
            for (int c = 0; c < 8; c++)
                _mm512_storeu_si512((void *)(panel + 512 * b + 64 * c), _mm512_loadu_si512((const void *)(G + b * X16 * 34 + 32 + 64 * c)));
        return;
    }
    const __m512i off = fmt == Q4_0_X16 ? eight : _mm512_setzero_si512(); /* Q4_1's q as they are */
    const long gb = X16 * block_bytes(fmt), at = fmt == Q4_0_X16 ? 32 : 64;
    for (long b = 0; b < nb; b++)
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(G + b * gb + at + 64 * c));
            _mm512_storeu_si512((void *)(panel + 512 * b + 64 * c), _mm512_sub_epi8(_mm512_and_si512(v, m4), off));
            _mm512_storeu_si512((void *)(panel + 512 * b + 64 * (4 + c)),
                                _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), off));
        }
}

/* Block b's tile of I_b (C: row t token m + t, lane r row r; the rows' scales at d, Q4_1's minimums
   after them) into the sixteen rows' sums of each token. */
AMX8 ALWAYS_INLINE void x16_fold(const int q41, const int32_t *C, const uint8_t *d, const acts *a, long m, long b,
                                 __m512 acc[AMX_TOKENS]) {
    const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
    const __m512 wm = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 32))) : _mm512_setzero_ps();
    const long at = (m / AMX_TOKENS * (a->K / 32) + b) * AMX_TOKENS;
    const float *db = a->dbt + at, *sf = q41 ? a->sft + at : NULL;
    for (int t = 0; t < AMX_TOKENS; t++) {
        const __m512i I = _mm512_loadu_si512((const void *)(C + 16 * t));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(w, _mm512_set1_ps(db[t])), acc[t]);
        if (q41) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(sf[t]), wm, acc[t]);
    }
}

/* Block b on C tile c, its A and B on tiles ta, tb (tile numbers: literals). */
#define X16_TILE(c, ta, tb, b)                                                                             \
    do {                                                                                                   \
        _tile_loadd(ta, A + (b) / 2 * 1024 + (b) % 2 * 32, 64);                                             \
        _tile_loadd(tb, panel + 512 * (b), 64);                                                            \
        _tile_zero(c);                                                                                     \
        _tile_dpbssd(c, ta, tb);                                                                           \
    } while (0)

/* 16 tokens from m against sixteen rows G in `fmt` (Q4_0_X16: their panel): Y[t * ldy + 0..16). Four
   blocks at a time on C tiles 0..3, so that a tile's store and float pass overlap the next blocks'
   products. */
AMX8 ALWAYS_INLINE void amx16_tokens(const int fmt, const uint8_t *G, const uint8_t *panel, const acts *a, long m,
                                     float *Y, long ldy) {
    const long nb = a->K / 32, gb = X16 * block_bytes(fmt);
    int32_t C[4][AMX_TOKENS * AMX_ROWS];
    __m512 acc[AMX_TOKENS];
    for (int t = 0; t < AMX_TOKENS; t++) acc[t] = _mm512_setzero_ps();
    const int8_t *A = a->qt + m / AMX_TOKENS * (a->K / 64) * 1024; /* 16 x 64 bytes per 64 columns */
    long b = 0;
    for (; b + 4 <= nb; b += 4) {
        X16_TILE(0, 4, 6, b);
        X16_TILE(1, 5, 7, b + 1);
        X16_TILE(2, 4, 6, b + 2);
        X16_TILE(3, 5, 7, b + 3);
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        _tile_stored(2, C[2], 64);
        _tile_stored(3, C[3], 64);
        for (int j = 0; j < 4; j++) x16_fold(fmt == Q4_1_X16, C[j], G + (b + j) * gb, a, m, b + j, acc);
    }
    for (; b < nb; b += 2) {
        X16_TILE(0, 4, 6, b);
        X16_TILE(1, 5, 7, b + 1);
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        x16_fold(fmt == Q4_1_X16, C[0], G + b * gb, a, m, b, acc);
        x16_fold(fmt == Q4_1_X16, C[1], G + (b + 1) * gb, a, m, b + 1, acc);
    }
    for (int t = 0; t < AMX_TOKENS; t++) _mm512_storeu_ps(Y + t * ldy, acc[t]);
}
#undef X16_TILE

/* Rows [n0, n1) (whole sixteens) of a product of rows in sixteens on the tiles where they apply, the rest
   on the VNNI path; 0 where the tiles do not apply at all. */
AMX8 static int amx_x16(const product *p, long n0, long n1) {
    const long tokens = p->M / AMX_TOKENS * AMX_TOKENS, K = p->a->K, nb = K / 32;
    if (!tiles_take(p->fmt, p->isa, p->M) || p->mi || K % 64 || !p->a->dbt) return 0;
    uint8_t *panel = aligned_alloc(64, (size_t)(nb * 512));
    if (!panel) return 0;
    tile_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 4; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16; /* C: 16 tokens x 16 rows */
    for (int i = 4; i < 6; i++) cfg.colsb[i] = 32, cfg.rows[i] = 16; /* A: 16 tokens x 32 bytes */
    for (int i = 6; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 8;  /* B: 8 k-rows x 16 rows x 4 bytes */
    _tile_loadconfig(&cfg);
    for (long n = n0; n < n1; n += X16) {
        const uint8_t *G = p->W + n * p->ldw;
        x16_panel(p->fmt, G, nb, panel);
        for (long m = 0; m < tokens; m += AMX_TOKENS) {
            float *Y = p->Y + m * p->ldy + n;
            switch (p->fmt) {
            case Q4_0_X16: amx16_tokens(Q4_0_X16, G, panel, p->a, m, Y, p->ldy); break;
            case Q4_1_X16: amx16_tokens(Q4_1_X16, G, panel, p->a, m, Y, p->ldy); break;
            default: amx16_tokens(Q8_0_X16, G, panel, p->a, m, Y, p->ldy); break;
            }
        }
    }
    _tile_release();
    free(panel);
    if (tokens < p->M) x8_vnni(p, n0, n1, tokens, p->M);
    return 1;
}

/* Rows of one unit of work: about UNIT_BYTES of weights, fewer as more tokens share them, at least
   MIN_UNIT_ROWS. (Every token's result is computed alike whatever the unit, tile and group sizes: each
   output is one row's dot product with one token, in the order of its blocks.) */
static long unit_rows(int fmt, long ldw, long M) {
    long rows = UNIT_BYTES / (ldw * (M < GROUP ? 1 : M / GROUP));
    rows = rows > MIN_UNIT_ROWS ? rows : MIN_UNIT_ROWS;
    const long g = group_rows(fmt);
    return (rows + g - 1) / g * g; /* whole groups of interleaved rows */
}


/* ---- entry points ---------------------------------------------------------------------------------- */

/* Which path (`isa`): 3 = AVX-512 VNNI, 2 = AVX2 with AVX-VNNI, 1 = AVX2 (the caller checks the CPU has it:
   native/quant.py paths()). Errors: -1 an unknown format or a width that is not a multiple of its block, -2
   no memory. */

static int check_shape(int fmt, long ldw, long K) {
    if (!block_bytes(fmt) || K <= 0 || K % block_elems(fmt)) return -1;
    if (group_rows(fmt) > 1) return ldw == K / block_elems(fmt) * block_bytes(fmt) ? 0 : -1; /* no padding */
    return ldw >= K / block_elems(fmt) * block_bytes(fmt) ? 0 : -1;
}

typedef struct {
    product p;
    long N, rows;
    atomic_long next;
} linear_call;

static void linear_region(void *arg, int t, int T) {
    (void)t;
    (void)T;
    linear_call *c = arg;
    long units = (c->N + c->rows - 1) / c->rows;
    for (long u; (u = next_unit(&c->next, units)) >= 0;)
        product_tiles(&c->p, u * c->rows, min_l(u * c->rows + c->rows, c->N));
}

/* Y [M, N] fp32 (rows ldy apart) = X [M, K] (fp32, or bf16 when x_bf16) times W [N, K]^T in `fmt` blocks,
   on up to `threads` threads. */
int hm_qlinear(int fmt, const uint8_t *W, long ldw, long N, long K, const void *x, long ldx, int x_bf16, long M,
               float *Y, long ldy, int threads, int isa) {
    if (check_shape(fmt, ldw, K) || N % group_rows(fmt)) return -1;
    acts a;
    if (acts_of(&a, fmt, x, ldx, x_bf16, NULL, M, K, tiles_take(fmt, isa, M))) return -2;
    linear_call c = {{dot_for(fmt, isa), W, ldw, &a, NULL, M, Y, ldy, fmt, isa}, N,
                     unit_rows(fmt, ldw, M)};
    atomic_init(&c.next, 0);
    long units = (N + c.rows - 1) / c.rows;
    hm_parallel(linear_region, &c, (int)min_l(threads, units));
    free(a.mem);
    return 0;
}

/* One of several products of the same activation rows (hm_qlinear_many); Python and bf16.c pass an int64
   table [n, 6] of these fields in this order. */
typedef struct {
    long fmt;           /* ggml type of W */
    const uint8_t *W;   /* [N, K] in blocks, rows ldw bytes apart */
    long ldw, N;
    float *Y;           /* [M, N] fp32, rows ldy apart */
    long ldy;
} qproduct;

/* Which quantised activations a format's kernels read: formats with the same key read the same
   (blocks of 32 differ in the offset folded into So; Q6_K's super-blocks keep their natural block
   order, Q4_K's and Q5_K's the paired one). */
static int acts_key(int fmt) { return is_k(fmt) ? 1 + (rows_fmt(fmt) != Q6_K) : 3 + offset_of(fmt); }

typedef struct {
    const qproduct *p;
    long n;
    product *pr;     /* per product: its tiles' parameters */
    long *first;     /* per product: its first unit (n + 1 entries) */
    long *rows;      /* per product: rows per unit */
    atomic_long next;
} many_call;

static void many_region(void *arg, int t, int T) {
    (void)t;
    (void)T;
    many_call *c = arg;
    for (long u; (u = next_unit(&c->next, c->first[c->n])) >= 0;) {
        long i = part_of(c->first, c->n, &u);
        long n0 = u * c->rows[i];
        product_tiles(&c->pr[i], n0, min_l(n0 + c->rows[i], c->p[i].N));
    }
}

/* n products of the same rows X [M, K] (fp32, or bf16 when x_bf16): Y_i [M, N_i] = X W_i^T, as n calls
   of hm_qlinear give them, bit for bit, but X quantised once per kind of activations the formats read
   (acts_key) and every product's units shared out in one region of up to `threads` threads (a decode
   step's q, k and v: the two small ones no longer stay on one thread while the other waits). n <= 8. */
int hm_qlinear_many(const qproduct *p, long n, long K, const void *x, long ldx, int x_bf16, long M, int threads,
                    int isa) {
    if (n > 8) return -1;
    for (long i = 0; i < n; i++)
        if (check_shape((int)p[i].fmt, p[i].ldw, K) || p[i].N % group_rows((int)p[i].fmt)) return -1;
    acts a[8];
    product pr[8];
    long first[9] = {0}, rows[8], owner[8];
    int status = 0;
    for (long i = 0; i < n; i++) {
        owner[i] = i;
        for (long j = 0; j < i && owner[i] == i; j++)
            if (acts_key((int)p[j].fmt) == acts_key((int)p[i].fmt)) owner[i] = j;
        if (owner[i] == i && !status)
            status = acts_of(&a[i], (int)p[i].fmt, x, ldx, x_bf16, NULL, M, K, tiles_take((int)p[i].fmt, isa, M));
        if (owner[i] == i && status) a[i].mem = NULL;
        int fmt = (int)p[i].fmt;
        pr[i] = (product){dot_for(fmt, isa), p[i].W, p[i].ldw, &a[owner[i]], NULL, M, p[i].Y, p[i].ldy, fmt, isa};
        rows[i] = unit_rows(fmt, p[i].ldw, M);
        first[i + 1] = first[i] + (p[i].N + rows[i] - 1) / rows[i];
    }
    if (!status) {
        many_call c = {p, n, pr, first, rows};
        atomic_init(&c.next, 0);
        hm_parallel(many_region, &c, (int)min_l(threads, first[n]));
    }
    for (long i = 0; i < n; i++)
        if (owner[i] == i) free(a[i].mem);
    return status;
}

/* One routed expert's share of a call: its weights, its tokens, where its output goes. Python passes an
   int64 table [n, 12] of these fields in this order (rows 0: its tokens are x's first M rows). */
typedef struct {
    const uint8_t *gate, *up, *down; /* [I, H], [I, H] in fmt_gu; [H, I] in fmt_d */
    long ld_gu, ld_d;                /* bytes per weight row */
    long fmt_gu, fmt_d;
    const void *x;                   /* its tokens, rows ldx elements apart (fp32 or bf16) */
    long ldx, M;
    float *y;                        /* [M, H] fp32 out, rows H apart */
    const long *rows;                /* [M]: which rows of x are its tokens; NULL: rows 0..M-1 */
} expert_job;

typedef struct {
    const expert_job *e;
    long n, H, I;
    long xrows;      /* rows of x that the experts' `rows` index (all of them are quantised once) */
    int x_bf16, isa;
    long *owner;     /* per expert: the first expert with the same tokens (their activations are shared) */
    char *own;       /* per expert: 1 where its tokens are quantised as its own rows (tiles_take) */
    acts *ax, *ah;   /* per expert: its tokens quantised for gate/up; h = silu(gate) * up quantised for down */
    float **gu;      /* per expert: [M, 2I] fp32, gate then up; h overwrites gate */
    long *first1, *first3;  /* per expert: its first unit in stages 1 and 3 (n + 1 entries) */
    long *rows1, *rows3;    /* per expert: rows per unit in stages 1 and 3 */
    atomic_long next[4], done[3]; /* per stage: units taken, units finished */
    atomic_int status;
} experts_call;

/* Stage 1's unit u of expert i: `rows1` rows of the gate (units 0 .. half-1) or of the up projection. */
static void gate_up_unit(experts_call *c, long i, long u) {
    const expert_job *e = &c->e[i];
    long per = (c->I + c->rows1[i] - 1) / c->rows1[i], up = u >= per, n0 = (u % per) * c->rows1[i];
    product p = {dot_for((int)e->fmt_gu, c->isa), up ? e->up : e->gate, e->ld_gu, &c->ax[c->owner[i]],
                 c->own[i] ? NULL : e->rows,
                 e->M, c->gu[i] + (up ? c->I : 0), 2 * c->I,
                 (int)e->fmt_gu, c->isa};
    product_tiles(&p, n0, min_l(n0 + c->rows1[i], c->I));
}

static void down_unit(experts_call *c, long i, long u) {
    const expert_job *e = &c->e[i];
    long n0 = u * c->rows3[i];
    product p = {dot_for((int)e->fmt_d, c->isa), e->down, e->ld_d, &c->ah[i], NULL, e->M, e->y, c->H,
                 (int)e->fmt_d, c->isa};
    product_tiles(&p, n0, min_l(n0 + c->rows3[i], c->H));
}

/* h = silu(gate) * up for expert i's tokens, in the gate's place, then quantised for the down projection. */
AVX2 static void swiglu_unit(experts_call *c, long i) {
    const expert_job *e = &c->e[i];
    long I = c->I;
    for (long m = 0; m < e->M; m++) {
        float *g = c->gu[i] + m * 2 * I, *u = g + I;
        for (long k = 0; k < I; k++) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    }
    if (acts_of(&c->ah[i], (int)e->fmt_d, c->gu[i], 2 * I, 0, NULL, e->M, I, tiles_take((int)e->fmt_d, c->isa, e->M)))
        atomic_store(&c->status, -2);
}

/* Four stages, each starting when every unit of the one before is done (stage_wait): a thread the OS
   has not run yet holds no unit, so nobody waits for it (barrier() would). */
static void experts_region(void *arg, int t, int T) {
    (void)t;
    (void)T;
    experts_call *c = arg;
    long u;
    while ((u = next_unit(&c->next[0], c->n)) >= 0) {  /* quantise each distinct token set once */
        const expert_job *e = &c->e[u];
        if (c->owner[u] == u && acts_of(&c->ax[u], (int)e->fmt_gu, e->x, e->ldx, c->x_bf16, c->own[u] ? e->rows : NULL,
                                        e->rows && !c->own[u] ? c->xrows : e->M, c->H,
                                        (c->own[u] || !e->rows) && tiles_take((int)e->fmt_gu, c->isa, e->M)))
            atomic_store(&c->status, -2);
        atomic_fetch_add(&c->done[0], 1);
    }
    stage_wait(&c->done[0], c->n);
    if (atomic_load(&c->status)) return;
    while ((u = next_unit(&c->next[1], c->first1[c->n])) >= 0) {
        long i = part_of(c->first1, c->n, &u);
        gate_up_unit(c, i, u);
        atomic_fetch_add(&c->done[1], 1);
    }
    stage_wait(&c->done[1], c->first1[c->n]);
    while ((u = next_unit(&c->next[2], c->n)) >= 0) {
        swiglu_unit(c, u);
        atomic_fetch_add(&c->done[2], 1);
    }
    stage_wait(&c->done[2], c->n);
    if (atomic_load(&c->status)) return;
    while ((u = next_unit(&c->next[3], c->first3[c->n])) >= 0) {
        long i = part_of(c->first3, c->n, &u);
        down_unit(c, i, u);
    }
}

/* The n experts of e (a layer's, typically) over their tokens, in one region of `threads` threads: stage 0
   quantises each distinct token set once, stage 1 runs every gate and up row, stage 2 makes each expert's
   h = silu(gate) * up and quantises it, stage 3 runs every down row. y = down h. Experts whose tokens
   are `rows` of one x share its xrows rows quantised once. */
static int experts_run(const expert_job *e, long n, long H, long I, int x_bf16, long xrows, int threads, int isa) {
    for (long i = 0; i < n; i++)
        if (check_shape((int)e[i].fmt_gu, e[i].ld_gu, H) || check_shape((int)e[i].fmt_d, e[i].ld_d, I) ||
            I % group_rows((int)e[i].fmt_gu) || H % group_rows((int)e[i].fmt_d))
            return -1;
    experts_call c = {.e = e, .n = n, .H = H, .I = I, .xrows = xrows, .x_bf16 = x_bf16, .isa = isa};
    size_t words = (size_t)n * 6 + 2;
    char *mem = calloc(1, words * sizeof(long) + (size_t)n * (2 * sizeof(acts) + sizeof(float *) + 1));
    long tokens = 0;
    for (long i = 0; i < n; i++) tokens += e[i].M;
    float *gu = malloc(sizeof(float) * (size_t)(tokens * 2 * I) + 1);
    if (!mem || !gu) {
        free(mem);
        free(gu);
        return -2;
    }
    long *w = (long *)mem;
    c.owner = w, c.rows1 = w + n, c.rows3 = w + 2 * n, c.first1 = w + 3 * n, c.first3 = w + 4 * n + 1;
    c.ax = (acts *)(w + words), c.ah = c.ax + n, c.gu = (float **)(c.ah + n), c.own = (char *)(c.gu + n);
    for (long i = 0, at = 0; i < n; i++) {
        c.owner[i] = i;
        c.own[i] = e[i].rows && tiles_take((int)e[i].fmt_gu, isa, e[i].M);
        for (long j = 0; j < i && c.owner[i] == i && !c.own[i]; j++)
            if (!c.own[j] && e[j].x == e[i].x && e[j].ldx == e[i].ldx && e[j].fmt_gu == e[i].fmt_gu && !e[j].rows == !e[i].rows &&
                (e[i].rows || e[j].M == e[i].M))
                c.owner[i] = j;
        c.rows1[i] = unit_rows((int)e[i].fmt_gu, e[i].ld_gu, e[i].M);
        c.rows3[i] = unit_rows((int)e[i].fmt_d, e[i].ld_d, e[i].M);
        c.first1[i + 1] = c.first1[i] + 2 * ((I + c.rows1[i] - 1) / c.rows1[i]);
        c.first3[i + 1] = c.first3[i] + (H + c.rows3[i] - 1) / c.rows3[i];
        c.gu[i] = gu + at;
        at += e[i].M * 2 * I;
    }
    for (int s = 0; s < 4; s++) atomic_init(&c.next[s], 0);
    for (int s = 0; s < 3; s++) atomic_init(&c.done[s], 0);
    atomic_init(&c.status, 0);
    hm_parallel(experts_region, &c, (int)min_l(threads, c.first1[n]));
    for (long i = 0; i < n; i++) {
        free(c.ax[i].mem);
        free(c.ah[i].mem);
    }
    free(gu);
    free(mem);
    return atomic_load(&c.status);
}

int hm_qexperts(const expert_job *e, long n, long H, long I, int x_bf16, int threads, int isa) {
    return experts_run(e, n, H, I, x_bf16, 0, threads, isa);
}

/* Tokens' routed experts from the router's choice as it stands, and their weighted sums, in one call: a
   decode token's (T = 1) and a prefill chunk's. ids [T, K] (int64, top-k order, distinct per token) and
   weights w [T, K] (fp32) index experts [E, 7], the layer's table: each expert's gate, up and down
   addresses, the bytes per row of gate/up and of down, and their ggml types. x [T, H] (bf16 when x_bf16,
   else fp32; rows contiguous) is quantised once for every expert; each expert used runs over its tokens
   (rows of x, in increasing order). out [T, H] in x's type: per token, sum_j y_j * w_j over its experts in
   increasing id, each term in fp32 (y_j first rounded to bf16 for a bf16 token), added from 0, the sum
   rounded once: the bits of hm_qexperts' outputs converted to x's type and then combined as
   combine_token and combine_grouped (experts/run/ffn.py) combine them with torch (a product and a sum,
   two roundings: -ffp-contract=off). Prefill took 0.2 s of 1.5 s at two threads in those torch ops
   (per-expert gathers, conversions and index_add_, each woken onto OpenMP's threads beside this pool's:
   docs/notes/2026-12-06-prefill-two-threads.md). Returns 0, -1 a format or width it does not take or an id
   outside [0, E), -2 no memory. */
int hm_qmoe_tokens(const int64_t *experts, long E, const int64_t *ids, const float *w, long T, long K,
                   const void *x, int x_bf16, long H, long I, int threads, int isa, void *out) {
    if (K > 64 || T < 1) return -1;
    for (long i = 0; i < T * K; i++)
        if (ids[i] < 0 || ids[i] >= E) return -1;
    long *first = calloc((size_t)(E + 1), sizeof(long)), *rows = malloc(sizeof(long) * (size_t)(2 * T * K));
    expert_job *e = malloc(sizeof(expert_job) * (size_t)(E < T * K ? E : T * K));
    /* [T * K, H]: each expert's outputs, in increasing id */
    float *y = kept_buffer_of(sizeof(float) * (size_t)(T * K * H));
    int status = first && rows && e && y ? 0 : -2;
    long n = 0, *slot = rows + T * K;
    if (!status) status = group_by_expert(ids, T * K, E, first, slot);
    if (!status) {
        for (long i = 0; i < T * K; i++) rows[slot[i]] = i / K; /* each expert's tokens, in increasing order */
        for (long j = 0; j < E; j++) {
            const long count = first[j + 1] - first[j];
            if (!count) continue;
            const int64_t *p = experts + 7 * j;
            e[n++] = (expert_job){(const uint8_t *)p[0], (const uint8_t *)p[1], (const uint8_t *)p[2], p[3], p[4], p[5],
                                  p[6], x, H, count, y + first[j] * H, rows + first[j]};
        }
        status = experts_run(e, n, H, I, x_bf16, T, threads, isa);
    }
    if (!status) {
        mix_call c = {ids, w, K, H, x_bf16, y, slot, out, T};
        mix_tokens(&c, threads);
    }
    free(first);
    free(rows);
    free(e);
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

/* ---- rows back to values (a token embedding's lookup) ----------------------------------------------- */

/* One block of each format expanded to its values at y, in ggml's order of operations: that of
   hybridmoe/quant/dequant.py, whose torch ops each round to fp32, so that a row looked up here has their
   bits. Every product is exact in fp32 (an fp16 scale's 11 significant bits times integers of 12 bits at
   most), so only a last addition rounds; still no a * b - c may become an FMA: the library is compiled with
   -ffp-contract=off, and these functions carry no target attribute, so no FMA instruction is theirs to use
   (half_at's F16C, an exact fp16 -> fp32, is a call of its own). A row of 2048..4096 values is a few us of
   scalar code, where the torch ops on one row cost ~200 us a decode step. */

static void values_q8_0(const uint8_t *b, float *y) {  /* d q */
    const float d = half_at(b);
    for (int i = 0; i < 32; i++) y[i] = d * (float)(int8_t)b[2 + i];
}

static void values_q4_0(const uint8_t *b, float *y) {  /* d (q - 8): element i the low nibble of byte i */
    const float d = half_at(b);
    for (int i = 0; i < 16; i++) {
        y[i] = d * ((float)(b[2 + i] & 15) - 8.0f);
        y[i + 16] = d * ((float)(b[2 + i] >> 4) - 8.0f);
    }
}

static void values_q4_1(const uint8_t *b, float *y) {  /* d q + m */
    const float d = half_at(b), m = half_at(b + 2);
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)(b[4 + i] & 15) + m;
        y[i + 16] = d * (float)(b[4 + i] >> 4) + m;
    }
}

/* Q4_K, Q5_K (five): (d sc_j) q - (dmin m_j) in block j of 32, whose q are the low (j even) or high nibbles
   of bytes 32 (j / 2) .. of qs, and for Q5_K bit j of qh[l] as element l's fifth bit. */
static void values_k4(const uint8_t *b, int five, float *y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
        const float ds = d * (float)sc, dm = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int q = j & 1 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
            if (five) q |= (qh[l] >> j & 1) << 4;
            y[32 * j + l] = ds * (float)q - dm;
        }
    }
}

/* Q6_K: (d sc_t) (q - 32) in sub-block t of 16. Block 4h + r of 32 takes its low 4 bits from
   ql[64 h + 32 (r & 1) + l] (low nibbles for r < 2) and its high 2 from bits 2r, 2r + 1 of qh[32 h + l]. */
static void values_q6_k(const uint8_t *b, float *y) {
    const float d = half_at(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) {
                const uint8_t lo = b[64 * h + 32 * (r & 1) + l], hi = b[128 + 32 * h + l];
                const int q = (r < 2 ? lo & 15 : lo >> 4) | (hi >> 2 * r & 3) << 4, at = 32 * (4 * h + r) + l;
                y[at] = d * (float)sc[at / 16] * ((float)q - 32.0f);
            }
}

static void values_of(int fmt, const uint8_t *b, float *y) {
    switch (fmt) {
    case Q8_0: values_q8_0(b, y); break;
    case Q4_0: values_q4_0(b, y); break;
    case Q4_1: values_q4_1(b, y); break;
    case Q4_K: values_k4(b, 0, y); break;
    case Q5_K: values_k4(b, 1, y); break;
    case Q6_K: values_q6_k(b, y); break;
    }
}

/* Rows ids[0..n) of W [N, K] (`fmt` blocks, rows ldw bytes apart) as values, into out [n, K]: fp32, or bf16
   when out_bf16 (rounded to nearest even by rows.h's bf16, as torch's .to(torch.bfloat16) rounds; a NaN, which
   no valid block holds, stays a NaN, though not with torch's bits: it writes every NaN as 0xffff). Returns 0,
   -1 for a format or width it does not take (interleaved rows among them: quant/tensor.py looks those rows up
   in torch), -3 for an id outside 0 .. N-1 (nothing written). */
int hm_qrows(int fmt, const uint8_t *W, long ldw, long N, long K, const int64_t *ids, long n, void *out,
             int out_bf16) {
    if (group_rows(fmt) > 1 || check_shape(fmt, ldw, K)) return -1;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -3;
    const long elems = block_elems(fmt), bytes = block_bytes(fmt);
    float v[256];
    for (long i = 0; i < n; i++) {
        const uint8_t *row = W + ids[i] * ldw;
        for (long k = 0; k < K; k += elems) {
            values_of(fmt, row + k / elems * bytes, v);
            if (out_bf16)
                for (long e = 0; e < elems; e++) ((uint16_t *)out)[i * K + k + e] = bf16(v[e]);
            else
                memcpy((float *)out + i * K + k, v, (size_t)elems * sizeof(float));
        }
    }
    return 0;
}
