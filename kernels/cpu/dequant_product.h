// The product shared by the low-bit kernels (int4.cpp, int8.cpp): each task dequantizes a few
// W rows into an fp32 buffer L1 holds, then passes every row of x over it, so W is read from
// memory once per call whatever M is, and the sums are fp32.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dequant {

constexpr int64_t kRows = 4;  // W rows a task dequantizes at once
constexpr int64_t kTile = 4;  // x rows per pass over that buffer (16 accumulators)

// tile x rows (fp32) against `rows` dequantized W rows; K is a multiple of 16.
template <int64_t tile, typename T>
void dot_block(const float* x, int64_t K, const float* w, int64_t rows, T* out, int64_t ldo) {
#if defined(__AVX512F__)
  __m512 acc[tile][kRows];
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      wv[r] = r < rows ? _mm512_loadu_ps(w + r * K + k) : _mm512_setzero_ps();
    for (int64_t m = 0; m < tile; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < rows; ++r)
      out[m * ldo + r] = static_cast<T>(_mm512_reduce_add_ps(acc[m][r]));
#else
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[r * K + k];
      out[m * ldo + r] = static_cast<T>(s);
    }
#endif
}

// out [M, N] = x [M, K] (fp32) times the W that dequantize(n, rows, buf) writes, rows
// [n, n + rows) of it into buf [rows][K].
template <typename T, typename Dequantize>
void product(const float* x, int64_t M, int64_t K, int64_t N, T* out, Dequantize dequantize) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kRows * K);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kRows, rows = std::min(kRows, N - n);
      dequantize(n, rows, buf.data());
      int64_t m = 0;
      for (; m + kTile <= M; m += kTile)
        dot_block<kTile>(x + m * K, K, buf.data(), rows, out + m * N + n, N);
      switch (M - m) {
        case 3: dot_block<3>(x + m * K, K, buf.data(), rows, out + m * N + n, N); break;
        case 2: dot_block<2>(x + m * K, K, buf.data(), rows, out + m * N + n, N); break;
        case 1: dot_block<1>(x + m * K, K, buf.data(), rows, out + m * N + n, N); break;
        default: break;
      }
    }
  });
}

}  // namespace dequant
