// The passes of a bf16 attention span on AVX512-BF16 pair dot products (attention.cpp holds the
// span's plan and the other dtypes). A head of kChunks x 32 dims: q's chunks stay in registers,
// and K and V are used as the cache holds them, never widened to fp32.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace bf16_span {

// Keys ahead of the scores' pass that the first head's pass prefetches: four groups of 16, about
// a memory latency at its pace (32 and 128 measured no better on a 2-core EPYC).
constexpr int64_t kAhead = 64;

using bf16 = c10::BFloat16;

inline __m512i load(const bf16* p) { return _mm512_loadu_si512(p); }

// The K and V rows of keys [t, t + 16) ahead of their use (inlined, as prefetch_kv says why).
template <int kChunks>
[[gnu::always_inline]] inline void prefetch(const bf16* k_cache, const bf16* v_cache,
                                            const int64_t* offsets, int64_t t, int64_t n) {
  prefetch_kv(k_cache, v_cache, offsets + t, std::min<int64_t>(16, n - t), 64 * kChunks);
}

// s[t] = scale * q . k_t for the n keys at these offsets; 16 keys' sums reduced at once. The
// first head's pass (ahead > 0) also prefetches the rows `ahead` keys on.
template <int kChunks>
void score(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int64_t* offsets,
           int64_t n, float scale, float* s, int64_t ahead) {
  __m512bh qv[kChunks];
  for (int c = 0; c < kChunks; ++c) qv[c] = (__m512bh)load(q + 32 * c);
  auto dot = [&](int64_t t) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < kChunks; ++c)
      acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)load(k_cache + offsets[t] + 32 * c));
    return acc;
  };
  // The last few keys too go through reduce16 (its lanes past them zeros), so a key's score has
  // the same bits wherever its row's keys end.
  for (int64_t t = 0; t < n; t += 16) {
    if (ahead) prefetch<kChunks>(k_cache, v_cache, offsets, t + ahead, n);
    const int64_t keys = std::min<int64_t>(16, n - t);
    __m512 parts[16];
    for (int j = 0; j < 16; ++j) parts[j] = j < keys ? dot(t + j) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(s + t, static_cast<__mmask16>((1u << keys) - 1),
                          _mm512_mul_ps(reduce16(parts), _mm512_set1_ps(scale)));
  }
}

// The weights w[0, n) rounded to bf16 (as the reference's softmax(...).to(v.dtype) rounds
// them), two to a 32-bit pair: pairs[i] = (w[2i], w[2i + 1]), an odd last one with 0. Returns
// the sum of the rounded weights. pairs has room for n rounded up to 32.
inline float to_pairs(const float* w, int64_t n, uint32_t* pairs) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 32) {
    auto part = [&](int64_t at) {
      const int64_t left = std::clamp<int64_t>(n - at, 0, 16);
      return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), w + at);
    };
    const __m512i rounded = (__m512i)_mm512_cvtne2ps_pbh(part(t + 16), part(t));
    _mm512_storeu_si512(pairs + t / 2, rounded);
    // Back to fp32 by a shift: the low 16-bit halves, then the high ones.
    const __m512i lo = _mm512_slli_epi32(rounded, 16);
    const __m512i hi = _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    total = _mm512_add_ps(total, _mm512_add_ps(_mm512_castsi512_ps(lo), _mm512_castsi512_ps(hi)));
  }
  return _mm512_reduce_add_ps(total);
}

// The value rows of keys [t, t + 2 * pairs) interleaved two by two: out[(p * kChunks + c) * 2
// + h] holds chunk c of keys t + 2p and t + 2p + 1 with their 16-bit lanes alternating (h = 0:
// unpacklo, the dims 8k + 0..3 of each 128-bit block k; h = 1: unpackhi, 8k + 4..7). A pair
// past n repeats its first row (its weight is 0).
template <int kChunks>
void interleave(const bf16* v_cache, const int64_t* offsets, int64_t t, int64_t n,
                int64_t pairs, __m512i* out) {
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16* a = v_cache + offsets[t + 2 * p];
    const bf16* b = t + 2 * p + 1 < n ? v_cache + offsets[t + 2 * p + 1] : a;
    for (int c = 0; c < kChunks; ++c) {
      const __m512i x = load(a + 32 * c), y = load(b + 32 * c);
      out[(p * kChunks + c) * 2] = _mm512_unpacklo_epi16(x, y);
      out[(p * kChunks + c) * 2 + 1] = _mm512_unpackhi_epi16(x, y);
    }
  }
}

// acc += the weighted value rows: one pair dot product adds w[t] v_t[d] + w[t+1] v_t+1[d] for
// 16 dims. acc is in interleave's order: [kChunks][2][16] (see deinterleave).
template <int kChunks>
void weigh(float* acc, const uint32_t* pairs, const __m512i* rows, int64_t count) {
  __m512 sums[2 * kChunks];
  for (int i = 0; i < 2 * kChunks; ++i) sums[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t p = 0; p < count; ++p) {
    const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[p]));
    for (int i = 0; i < 2 * kChunks; ++i)
      sums[i] = _mm512_dpbf16_ps(sums[i], w, (__m512bh)rows[p * 2 * kChunks + i]);
  }
  for (int i = 0; i < 2 * kChunks; ++i) _mm512_storeu_ps(acc + 16 * i, sums[i]);
}

// weigh's sums of one head back in dim order.
inline void deinterleave(const float* pairs, float* acc, int64_t dim) {
  for (int64_t c = 0; c < dim; c += 32)
    for (int64_t k = 0; k < 4; ++k)
      for (int64_t i = 0; i < 4; ++i) {
        acc[c + 8 * k + i] = pairs[c + 4 * k + i];
        acc[c + 8 * k + 4 + i] = pairs[c + 16 + 4 * k + i];
      }
}

}  // namespace bf16_span
#endif
