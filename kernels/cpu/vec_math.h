// Vector math and cache prefetches the kernels share.
#pragma once

#include <cstdint>

// Every cache line of n rows of row_bytes at these offsets into `rows`, ahead of their use, into
// L1 (Locality 3) or L2 (2): a paged cache's blocks lie anywhere in its pool, so the hardware
// prefetcher only ever sees one block at a time. Always inlined, as must be every function that
// only prefetches: GCC counts a prefetch as no effect and deletes a call to one.
template <int Locality, typename T>
[[gnu::always_inline]] inline void prefetch_rows(const T* rows, const int64_t* offsets, int64_t n,
                                                 int64_t row_bytes) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows + offsets[t]) + b, 0, Locality);
}

// The K rows (into L1 by default; L2 for a unit of work that comes next) and V rows (into L2:
// they are weighed after every key is scored) of n keys.
template <int KLocality = 3, typename T>
[[gnu::always_inline]] inline void prefetch_kv(const T* k_cache, const T* v_cache,
                                               const int64_t* offsets, int64_t n,
                                               int64_t row_bytes) {
  prefetch_rows<KLocality>(k_cache, offsets, n, row_bytes);
  prefetch_rows<2>(v_cache, offsets, n, row_bytes);
}

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x for 16 lanes: 2^(x log2 e) split into an integer power (the exponent bits) and a
// fraction's power (a degree-6 polynomial, relative error ~2e-7); -inf gives 0, and past 88
// it stays at e^88 (the largest power below float's maximum).
inline __m512 exp16(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                       _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  // Below -87 (and -inf: masked-out keys) the weight is 0, not a denormal.
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), e);
}

// Lane t of the result is the sum of v[t]'s lanes: four rounds of pairwise shuffles and adds
// (45 instructions for 16 dot products, where a horizontal sum each costs ~8).
inline __m512 reduce16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit block: [v0 0+2, v1 0+2, v0 1+3, v1 1+3]
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit block: one partial sum of each of 4 rows
    const __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Blocks: fold the four 128-bit partials of each group of 4 rows into one.
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88),
                       _mm512_shuffle_f32x4(h01, h23, 0xDD));
}
#endif

#if defined(__AVX512BF16__)
// 16 bf16 widened to fp32 (a bf16 is the top half of a float).
inline __m512 from_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load_bf16(const void* p) {
  return from_bf16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}
// 16 floats rounded to bf16, to nearest even as PyTorch rounds.
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline void store_bf16(void* p, __m512 v) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), to_bf16(v));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The 8-lane forms of the above, for CPUs with AVX2 and FMA but no AVX-512.
#include <immintrin.h>

#include <initializer_list>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

// e^x for 8 lanes, exp16's polynomial and limits, but the fraction taken from x itself (x - n
// ln 2, ln 2 in two parts): fp32 callers (SiLU) need e^x within ~2e-7 where x is large, which
// the fraction of x log2(e) loses (1.6e-6 at x = 27).
inline __m256 exp8(__m256 x) {
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)),
                                       _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
}

// log x for 8 lanes of positive, normal x: x = 2^e m with m in [sqrt(1/2), sqrt(2)), and
// log(m) by Cephes' degree-9 polynomial in m - 1 (within ~1 ulp); ln 2 in two parts, as exp8.
inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F000000)));
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_add_epi32(e, _mm256_castps_si256(small));  // all ones: -1
  m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(m, small)), _mm256_set1_ps(1.0f));
  const __m256 ef = _mm256_cvtepi32_ps(e);
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 y = _mm256_set1_ps(7.0376836292E-2f);
  for (const float c : {-1.1514610310E-1f, 1.1676998740E-1f, -1.2420140846E-1f, 1.4249322787E-1f,
                        -1.6668057665E-1f, 2.0000714765E-1f, -2.4999993993E-1f, 3.3333331174E-1f})
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(c));
  y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
  y = _mm256_fmadd_ps(ef, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  return _mm256_fmadd_ps(ef, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 8 elements as float32: bfloat16 by a shift of its bits, half by F16C.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 floats stored as float32, or rounded as PyTorch rounds them: bfloat16 to nearest even (NaN
// to its quiet NaN 0x7FC0, as c10::BFloat16 does), half by F16C.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif
