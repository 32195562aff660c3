// The passes of an attention span on 8-lane vectors, for CPUs with AVX2 and FMA but no AVX-512
// (attention.cpp holds the span's plan and the other paths). Each key or value row is widened
// once per pass and serves up to three query heads (grouped-query attention), with many
// independent sums in registers: a dot product's single chain of FMAs, or a value row added to
// one sum at a time, waits on the FMA latency instead of the memory.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace avx2_span {

// Keys ahead of the scores' pass whose K and V rows it prefetches (32 and 128 measured the same
// on a 2-core AVX2-only AMD EPYC; none at all, 1.4x slower from memory).
constexpr int64_t kAhead = 64;

// Lane j of the result is the sum of vj's lanes.
inline __m128 reduce4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// s[h * stride + t] = scale * q_h . k_t for H heads (q: [H, dim] in fp32) and the n keys at these
// offsets, 4 keys at a time (a short last group repeats its last key and drops the sums). A head
// of kChunks x 8 dims unrolls the loop over them, which keeps the 4H sums in registers (GCC
// stores them to the stack on every step of a loop); kChunks 0 takes dim at run time. The first
// heads' pass (ahead) prefetches the rows kAhead keys on.
template <int H, int kChunks, typename T>
void score(const float* q, const T* k_cache, const T* v_cache, const int64_t* offsets, int64_t n,
           int64_t dim, float scale, float* s, int64_t stride, bool ahead) {
  constexpr int kKeys = 4;
  const int64_t chunks = kChunks ? kChunks : dim / 8;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  if (ahead) prefetch_kv(k_cache, v_cache, offsets, std::min(n, kAhead), row_bytes);
  for (int64_t t = 0; t < n; t += kKeys) {
    if (ahead && t + kAhead < n)
      prefetch_kv(k_cache, v_cache, offsets + t + kAhead, std::min<int64_t>(kKeys, n - t - kAhead),
                  row_bytes);
    const T* k[kKeys];
    for (int j = 0; j < kKeys; ++j) k[j] = k_cache + offsets[std::min(t + j, n - 1)];
    __m256 acc[H * kKeys];
    for (int x = 0; x < H * kKeys; ++x) acc[x] = _mm256_setzero_ps();
#pragma GCC unroll 32
    for (int64_t c = 0; c < chunks; ++c) {
      __m256 kv[kKeys];
      for (int j = 0; j < kKeys; ++j) kv[j] = load8(k[j] + 8 * c);
      for (int h = 0; h < H; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + h * dim + 8 * c);
        for (int j = 0; j < kKeys; ++j)
          acc[h * kKeys + j] = _mm256_fmadd_ps(qv, kv[j], acc[h * kKeys + j]);
      }
    }
    const int64_t keys = std::min<int64_t>(kKeys, n - t);
    for (int h = 0; h < H; ++h) {
      const __m128 sums = _mm_mul_ps(
          reduce4(acc[4 * h], acc[4 * h + 1], acc[4 * h + 2], acc[4 * h + 3]), _mm_set1_ps(scale));
      if (keys == kKeys) {
        _mm_storeu_ps(s + h * stride + t, sums);
      } else {
        float part[kKeys];
        _mm_storeu_ps(part, sums);
        std::copy(part, part + keys, s + h * stride + t);
      }
    }
  }
}

// acc[h * dim + d0 + d] += sum over t in [t0, t1) of w[h * stride + t] v_t[d0 + d], for H heads
// and C x 8 dims, the sums in registers over the keys. GCC keeps a 2-D array of sums on the
// stack, stored on every key (12 stores a key: 1.3x slower), unless the loops that load and
// store it are unrolled whole.
template <int H, int C, typename T>
void weigh_dims(const float* w, int64_t stride, const T* v_cache, const int64_t* offsets,
                int64_t t0, int64_t t1, int64_t dim, int64_t d0, float* acc) {
  __m256 sums[H][C];
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) sums[h][c] = _mm256_loadu_ps(acc + h * dim + d0 + 8 * c);
  for (int64_t t = t0; t < t1; ++t) {
    const T* v = v_cache + offsets[t] + d0;
    __m256 weight[H];
    for (int h = 0; h < H; ++h) weight[h] = _mm256_broadcast_ss(w + h * stride + t);
    for (int c = 0; c < C; ++c) {
      const __m256 vv = load8(v + 8 * c);
      for (int h = 0; h < H; ++h) sums[h][c] = _mm256_fmadd_ps(weight[h], vv, sums[h][c]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + h * dim + d0 + 8 * c, sums[h][c]);
}

// acc[h * dim + d] += sum over t < n of w[h * stride + t] v_t[d], for H heads: keys in tiles
// whose value rows stay in L1 while every slice of 32 dims passes over them.
template <int H, typename T>
void weigh(const float* w, int64_t stride, const T* v_cache, const int64_t* offsets, int64_t n,
           int64_t dim, float* acc) {
  constexpr int64_t kTile = 32;
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t t1 = std::min(n, t0 + kTile);
    int64_t d0 = 0;
    for (; d0 + 32 <= dim; d0 += 32)
      weigh_dims<H, 4>(w, stride, v_cache, offsets, t0, t1, dim, d0, acc);
    for (; d0 < dim; d0 += 8) weigh_dims<H, 1>(w, stride, v_cache, offsets, t0, t1, dim, d0, acc);
  }
}

}  // namespace avx2_span
#endif
