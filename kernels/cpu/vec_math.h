// Vector math the kernels share.
#pragma once

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
