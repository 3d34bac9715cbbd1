/* bf16.c's AVX-512 operations in AVX2 and FMA, for CPUs without AVX-512 (AMD's Zen 2 and Zen 3, Intel's
   client cores from Alder Lake on): included by bf16.c when built with -DAVX2_512 (native/bf16.py, the AVX2
   build, which also defines EMULATE_BF16: vdpbf16ps and vcvtneps2bf16 as their definitions).

   A 512-bit vector is two 256-bit halves (a struct, which GCC keeps in two ymm registers; __m512 and
   __m512i are renamed to these types), and each intrinsic bf16.c uses is defined here on the halves with
   the results AVX-512 gives, bit for bit: lane-wise operations lane by lane, the reductions in the order
   of GCC's own _mm512_reduce_* (avx512fintrin.h), vscalefps as two exact scalings by powers of two, masks
   as bits (__mmask16 is an integer type without AVX-512 too). Masked loads and stores touch only the lanes
   their mask names, as AVX-512's do (the kernels' masks name the tail of a row, never past its end).
   tests/test_bf16_isa.py holds the AVX2 build to the AVX512-BF16 one on every kind of value and over whole
   runs of models; its disassembly holds no zmm register and no mask register. */

#ifndef HM_AVX2_512_H
#define HM_AVX2_512_H

#include <immintrin.h>
#include <stdint.h>

typedef struct {
    __m256 lo, hi;
} hm512;
typedef struct {
    __m256i lo, hi;
} hm512i;
#define __m512 hm512
#define __m512i hm512i

#define H5 static inline __attribute__((always_inline))

H5 hm512 f2(__m256 lo, __m256 hi) { return (hm512){lo, hi}; }
H5 hm512i i2(__m256i lo, __m256i hi) { return (hm512i){lo, hi}; }

/* Lanes of mask bits k (the low 8 for lo, the next 8 for hi) as all-ones or zero. */
H5 __m256i lanes8(unsigned k) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)k), bit), bit);
}
H5 __m128i lanes4(unsigned k) {
    const __m128i bit = _mm_setr_epi32(1, 2, 4, 8);
    return _mm_cmpeq_epi32(_mm_and_si128(_mm_set1_epi32((int)k), bit), bit);
}

/* ---- fp32 ---- */
H5 hm512 h5_set1_ps(float a) { return f2(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
H5 hm512 h5_setzero_ps(void) { return f2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
#define H5_F2(name, op)                                                                         \
    H5 hm512 h5_##name(hm512 a, hm512 b) { return f2(op(a.lo, b.lo), op(a.hi, b.hi)); }
H5_F2(add_ps, _mm256_add_ps)
H5_F2(sub_ps, _mm256_sub_ps)
H5_F2(mul_ps, _mm256_mul_ps)
H5_F2(div_ps, _mm256_div_ps)
H5_F2(max_ps, _mm256_max_ps)
H5_F2(min_ps, _mm256_min_ps)
#undef H5_F2
#define H5_F3(name, op)                                                                         \
    H5 hm512 h5_##name(hm512 a, hm512 b, hm512 c) {                                             \
        return f2(op(a.lo, b.lo, c.lo), op(a.hi, b.hi, c.hi));                                  \
    }
H5_F3(fmadd_ps, _mm256_fmadd_ps)
H5_F3(fnmadd_ps, _mm256_fnmadd_ps)
H5_F3(fmsub_ps, _mm256_fmsub_ps)
#undef H5_F3
H5 hm512 h5_loadu_ps(const void *p) {
    return f2(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}
H5 hm512 h5_load_ps(const void *p) {
    return f2(_mm256_load_ps((const float *)p), _mm256_load_ps((const float *)p + 8));
}
H5 void h5_storeu_ps(void *p, hm512 a) {
    _mm256_storeu_ps((float *)p, a.lo), _mm256_storeu_ps((float *)p + 8, a.hi);
}
H5 void h5_store_ps(void *p, hm512 a) {
    _mm256_store_ps((float *)p, a.lo), _mm256_store_ps((float *)p + 8, a.hi);
}
H5 hm512 h5_maskz_loadu_ps(__mmask16 k, const void *p) {
    const float *f = (const float *)p;
    return f2(_mm256_maskload_ps(f, lanes8(k)), _mm256_maskload_ps(f + 8, lanes8(k >> 8)));
}
H5 hm512 h5_maskz_mov_ps(__mmask16 k, hm512 a) {
    return f2(_mm256_and_ps(a.lo, _mm256_castsi256_ps(lanes8(k))),
              _mm256_and_ps(a.hi, _mm256_castsi256_ps(lanes8(k >> 8))));
}
H5 hm512 h5_mask_mov_ps(hm512 src, __mmask16 k, hm512 a) {
    return f2(_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(lanes8(k))),
              _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(lanes8(k >> 8))));
}
H5 hm512 h5_mask_loadu_ps(hm512 src, __mmask16 k, const void *p) {
    return h5_mask_mov_ps(src, k, h5_maskz_loadu_ps(k, p));
}
H5 hm512 h5_mask_max_ps(hm512 src, __mmask16 k, hm512 a, hm512 b) {
    return h5_mask_mov_ps(src, k, h5_max_ps(a, b));
}
H5 void h5_mask_storeu_ps(void *p, __mmask16 k, hm512 a) {
    _mm256_maskstore_ps((float *)p, lanes8(k), a.lo);
    _mm256_maskstore_ps((float *)p + 8, lanes8(k >> 8), a.hi);
}
H5 void h5_mm_mask_storeu_ps(void *p, __mmask8 k, __m128 a) { _mm_maskstore_ps((float *)p, lanes4(k), a); }
/* GCC's _mm512_reduce_add_ps and _mm512_reduce_max_ps: halves, quarters, then pairs. */
H5 float h5_reduce_add_ps(hm512 a) {
    const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
H5 float h5_reduce_max_ps(hm512 a) {
    const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
/* vrndscaleps to an integer, nearest even */
H5 hm512 h5_roundscale_ps(hm512 a, int mode) {
    (void)mode; /* bf16.c asks for _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC alone */
    return f2(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
              _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* vscalefps a 2^n for integral n with |n| <= 252 (exp512's: |n| <= 151): a 2^(n/2) is exact for bf16.c's a
   (about 1), and times 2^(n - n/2) rounds once, as vscalefps rounds (to a subnormal, zero or inf too). */
H5 __m256 pow2(__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); }
H5 __m256 scalef8(__m256 a, __m256 n) {
    const __m256i e = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(e, 1);
    return _mm256_mul_ps(_mm256_mul_ps(a, pow2(h)), pow2(_mm256_sub_epi32(e, h)));
}
H5 hm512 h5_scalef_ps(hm512 a, hm512 n) { return f2(scalef8(a.lo, n.lo), scalef8(a.hi, n.hi)); }

/* ---- int32 lanes and bits ---- */
H5 hm512i h5_set1_epi32(int a) { return i2(_mm256_set1_epi32(a), _mm256_set1_epi32(a)); }
H5 hm512i h5_setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9,
                        int a10, int a11, int a12, int a13, int a14, int a15) {
    return i2(_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7),
              _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15));
}
#define H5_I2(name, op)                                                                         \
    H5 hm512i h5_##name(hm512i a, hm512i b) { return i2(op(a.lo, b.lo), op(a.hi, b.hi)); }
H5_I2(and_si512, _mm256_and_si256)
H5_I2(or_si512, _mm256_or_si256)
H5_I2(add_epi32, _mm256_add_epi32)
H5_I2(mullo_epi32, _mm256_mullo_epi32)
#undef H5_I2
H5 hm512i h5_slli_epi32(hm512i a, int n) { return i2(_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)); }
H5 hm512i h5_srli_epi32(hm512i a, int n) { return i2(_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)); }
H5 hm512 h5_castsi512_ps(hm512i a) { return f2(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)); }
H5 hm512i h5_castps_si512(hm512 a) { return i2(_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)); }
H5 __m256 h5_castps512_ps256(hm512 a) { return a.lo; }
H5 __m256i h5_extracti64x4_epi64(hm512i a, int half) { return half ? a.hi : a.lo; }
H5 hm512i h5_loadu_si512(const void *p) {
    return i2(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
H5 void h5_storeu_si512(void *p, hm512i a) {
    _mm256_storeu_si256((__m256i *)p, a.lo), _mm256_storeu_si256((__m256i *)p + 1, a.hi);
}
H5 unsigned mask_of(__m256i lo, __m256i hi) {
    return (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(lo)) |
           (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(hi)) << 8;
}
H5 __mmask16 h5_cmpgt_epi32_mask(hm512i a, hm512i b) {
    return (__mmask16)mask_of(_mm256_cmpgt_epi32(a.lo, b.lo), _mm256_cmpgt_epi32(a.hi, b.hi));
}
H5 __mmask16 h5_cmplt_epi32_mask(hm512i a, hm512i b) { return h5_cmpgt_epi32_mask(b, a); }
H5 hm512i h5_mask_mov_epi32(hm512i src, __mmask16 k, hm512i a) {
    return i2(_mm256_blendv_epi8(src.lo, a.lo, lanes8(k)), _mm256_blendv_epi8(src.hi, a.hi, lanes8(k >> 8)));
}
/* vpermt2w (the AMX values' packing): lane i of the result is lane idx[i] of the pair (a, b), a first. */
H5 hm512i h5_permutex2var_epi16(hm512i a, hm512i idx, hm512i b) {
    uint16_t ab[64], ix[32], out[32];
    h5_storeu_si512(ab, a), h5_storeu_si512(ab + 32, b), h5_storeu_si512(ix, idx);
    for (int i = 0; i < 32; i++) out[i] = ab[ix[i] & 63];
    return h5_loadu_si512(out);
}
H5 hm512 h5_i32gather_ps(hm512i idx, const void *base, int scale) {
    (void)scale; /* 4: fp32 elements */
    return f2(_mm256_i32gather_ps((const float *)base, idx.lo, 4), _mm256_i32gather_ps((const float *)base, idx.hi, 4));
}

/* ---- 16-bit lanes ---- */
/* The low 16 bits of each int32 (vpmovdw), 8 of them from a 256-bit half. */
H5 __m128i low16(__m256i a) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, pick), _MM_SHUFFLE(3, 1, 2, 0));
    return _mm256_castsi256_si128(b);
}
H5 __m256i h5_cvtepi32_epi16(hm512i a) { return _mm256_set_m128i(low16(a.hi), low16(a.lo)); }
H5 __m128i h5_mm_cvtepi32_epi16(__m128i a) {
    return _mm_shuffle_epi8(a, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
}
H5 hm512i h5_cvtepu16_epi32(__m256i a) {
    return i2(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
/* Masked 16-bit loads and stores: whole vectors where every lane is asked for; a prefix of n lanes (a row's
   tail: the kernels' masks are prefixes) as n / 2 32-bit lanes through vpmaskmovd, which touches no other
   memory, and the odd one alone; any other mask lane by lane. */
H5 void load16(uint16_t *to, const void *p, uint64_t k, int n) {
    for (int i = 0; i < n; i++) to[i] = (k >> i) & 1 ? ((const uint16_t *)p)[i] : 0;
}
H5 void store16(void *p, const uint16_t *from, uint64_t k, int n) {
    for (int i = 0; i < n; i++)
        if ((k >> i) & 1) ((uint16_t *)p)[i] = from[i];
}
H5 int prefix(uint64_t k) { return (k & (k + 1)) == 0; }
/* The first n (< 32) 16-bit elements at p, the rest zero: 32-bit lanes d0 .. d0+7 of them as a 256-bit half. */
H5 __m256i prefix_half(const void *p, int n, int d0) {
    const int d = n / 2 - d0; /* whole pairs in this half */
    const unsigned pairs = d <= 0 ? 0u : d >= 8 ? 0xFFu : (1u << d) - 1;
    __m256i v = _mm256_maskload_epi32((const int *)p + d0, lanes8(pairs));
    if ((n & 1) && d >= 0 && d < 8) /* the odd element: the low half of lane d */
        v = _mm256_or_si256(v, _mm256_and_si256(_mm256_set1_epi32(((const uint16_t *)p)[n - 1]), lanes8(1u << d)));
    return v;
}
H5 void store_prefix_half(void *p, int n, int d0, __m256i v) {
    const int d = n / 2 - d0;
    const unsigned pairs = d <= 0 ? 0u : d >= 8 ? 0xFFu : (1u << d) - 1;
    _mm256_maskstore_epi32((int *)p + d0, lanes8(pairs), v);
    if ((n & 1) && d >= 0 && d < 8) {
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, v);
        ((uint16_t *)p)[n - 1] = (uint16_t)lanes[d];
    }
}
H5 hm512i h5_maskz_loadu_epi16(__mmask32 k, const void *p) {
    if (k == 0xFFFFFFFFu) return h5_loadu_si512(p);
    if (prefix(k)) {
        const int n = __builtin_popcount(k);
        return i2(prefix_half(p, n, 0), prefix_half(p, n, 8));
    }
    uint16_t v[32];
    load16(v, p, k, 32);
    return h5_loadu_si512(v);
}
H5 __m256i h5_mm256_maskz_loadu_epi16(__mmask16 k, const void *p) {
    if (k == 0xFFFF) return _mm256_loadu_si256((const __m256i *)p);
    if (prefix(k)) return prefix_half(p, __builtin_popcount(k), 0);
    uint16_t v[16];
    load16(v, p, k, 16);
    return _mm256_loadu_si256((const __m256i *)v);
}
H5 __m128i h5_mm_maskz_loadu_epi16(__mmask8 k, const void *p) {
    if (k == 0xF) return _mm_loadl_epi64((const __m128i *)p); /* four lanes: bf16.c's store_bf16 */
    uint16_t v[8];
    load16(v, p, k, 8);
    return _mm_loadu_si128((const __m128i *)v);
}
H5 void h5_mm256_mask_storeu_epi16(void *p, __mmask16 k, __m256i a) {
    if (k == 0xFFFF) {
        _mm256_storeu_si256((__m256i *)p, a);
        return;
    }
    if (prefix(k)) {
        store_prefix_half(p, __builtin_popcount(k), 0, a);
        return;
    }
    uint16_t v[16];
    _mm256_storeu_si256((__m256i *)v, a);
    store16(p, v, k, 16);
}
H5 void h5_mm_mask_storeu_epi16(void *p, __mmask8 k, __m128i a) {
    if (k == 0xF) {
        _mm_storel_epi64((__m128i *)p, a);
        return;
    }
    uint16_t v[8];
    _mm_storeu_si128((__m128i *)v, a);
    store16(p, v, k, 8);
}
H5 __mmask8 h5_mm_cmpgt_epi32_mask(__m128i a, __m128i b) {
    return (__mmask8)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(a, b)));
}
H5 __m128i h5_mm_mask_mov_epi32(__m128i src, __mmask8 k, __m128i a) { return _mm_blendv_epi8(src, a, lanes4(k)); }

#undef _mm512_set1_ps
#define _mm512_set1_ps h5_set1_ps
#undef _mm512_setzero_ps
#define _mm512_setzero_ps h5_setzero_ps
#undef _mm512_add_ps
#define _mm512_add_ps h5_add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps h5_sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps h5_mul_ps
#undef _mm512_div_ps
#define _mm512_div_ps h5_div_ps
#undef _mm512_max_ps
#define _mm512_max_ps h5_max_ps
#undef _mm512_min_ps
#define _mm512_min_ps h5_min_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps h5_fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps h5_fnmadd_ps
#undef _mm512_fmsub_ps
#define _mm512_fmsub_ps h5_fmsub_ps
#undef _mm512_loadu_ps
#define _mm512_loadu_ps h5_loadu_ps
#undef _mm512_load_ps
#define _mm512_load_ps h5_load_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps h5_storeu_ps
#undef _mm512_store_ps
#define _mm512_store_ps h5_store_ps
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps h5_maskz_loadu_ps
#undef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps h5_mask_loadu_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps h5_maskz_mov_ps
#undef _mm512_mask_max_ps
#define _mm512_mask_max_ps h5_mask_max_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps h5_mask_storeu_ps
#undef _mm_mask_storeu_ps
#define _mm_mask_storeu_ps h5_mm_mask_storeu_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps h5_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps h5_reduce_max_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps h5_roundscale_ps
#undef _mm512_scalef_ps
#define _mm512_scalef_ps h5_scalef_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 h5_set1_epi32
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 h5_setr_epi32
#undef _mm512_and_si512
#define _mm512_and_si512 h5_and_si512
#undef _mm512_or_si512
#define _mm512_or_si512 h5_or_si512
#undef _mm512_add_epi32
#define _mm512_add_epi32 h5_add_epi32
#undef _mm512_mullo_epi32
#define _mm512_mullo_epi32 h5_mullo_epi32
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 h5_slli_epi32
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 h5_srli_epi32
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps h5_castsi512_ps
#undef _mm512_castps_si512
#define _mm512_castps_si512 h5_castps_si512
#undef _mm512_castps512_ps256
#define _mm512_castps512_ps256 h5_castps512_ps256
#undef _mm512_extracti64x4_epi64
#define _mm512_extracti64x4_epi64 h5_extracti64x4_epi64
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 h5_loadu_si512
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 h5_storeu_si512
#undef _mm512_cmpgt_epi32_mask
#define _mm512_cmpgt_epi32_mask h5_cmpgt_epi32_mask
#undef _mm512_cmplt_epi32_mask
#define _mm512_cmplt_epi32_mask h5_cmplt_epi32_mask
#undef _mm512_mask_mov_epi32
#define _mm512_mask_mov_epi32 h5_mask_mov_epi32
#undef _mm512_permutex2var_epi16
#define _mm512_permutex2var_epi16 h5_permutex2var_epi16
#undef _mm512_i32gather_ps
#define _mm512_i32gather_ps h5_i32gather_ps
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 h5_cvtepi32_epi16
#undef _mm_cvtepi32_epi16
#define _mm_cvtepi32_epi16 h5_mm_cvtepi32_epi16
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 h5_cvtepu16_epi32
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16 h5_maskz_loadu_epi16
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 h5_mm256_maskz_loadu_epi16
#undef _mm_maskz_loadu_epi16
#define _mm_maskz_loadu_epi16 h5_mm_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 h5_mm256_mask_storeu_epi16
#undef _mm_mask_storeu_epi16
#define _mm_mask_storeu_epi16 h5_mm_mask_storeu_epi16
#undef _mm_cmpgt_epi32_mask
#define _mm_cmpgt_epi32_mask h5_mm_cmpgt_epi32_mask
#undef _mm_mask_mov_epi32
#define _mm_mask_mov_epi32 h5_mm_mask_mov_epi32

#endif
