// The product shared by the low-bit kernels (int4.cpp, int8.cpp), y = x W^T with x in fp32 and
// W read through its format's `load`, which gives 32 columns of a task's W rows in fp32. Every
// W value is the same fp32 whatever the rows, and every sum runs in the same order (16 lanes, k
// ascending), so a row of y has the same bits alone or in a batch.
//
// A format is a struct with
//   load<rows>(n, k, lo, hi)  W[n + r, k:k+16] and W[n + r, k+16:k+32] into lo[r], hi[r] for
//                             r < rows (n a multiple of kRows; AVX-512 builds), or
//   load<rows>(n, k, out)     the same into out[r * 32, r * 32 + 32) (other builds);
//   prefetch(n, k)            hints W[n, k:k+32]'s cache lines in.
// The row count is a template argument so that the rows' vectors stay in registers.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dequant {

constexpr int64_t kRows = 4;  // W rows a task takes at once
constexpr int64_t kTile = 4;  // x rows per pass over them (16 accumulators)
// The direct product prefetches the W rows this many rows ahead, at the columns it is
// reading: kRows interleaved rows do not wake the hardware prefetcher early enough. int8 from
// memory at one row (3072 x 576 / 576 x 1536): 77 / 39 us without, 48 / 21 four rows ahead,
// 40 / 21 sixteen. int4's records are one stream (int4.cpp), which needs none.
constexpr int64_t kAheadRows = 4 * kRows;

// w.load<rows> for a row count known at run time (all but a matrix's last task: kRows).
template <typename W, typename... Out>
inline void load(const W& w, int64_t n, int64_t rows, int64_t k, Out*... out) {
  static_assert(kRows == 4, "one case per row count");
  switch (rows) {
    case 4: w.template load<4>(n, k, out...); break;
    case 3: w.template load<3>(n, k, out...); break;
    case 2: w.template load<2>(n, k, out...); break;
    default: w.template load<1>(n, k, out...); break;
  }
}

#if defined(__AVX512F__)
// tile x rows against W rows [n, n + rows), each W vector dequantized into registers and used
// by every x row at once: W's bytes are read once, nothing is written back.
template <int64_t tile, typename W, typename T>
void dot_direct(const float* x, int64_t K, const W& w, int64_t n, int64_t rows, T* out,
                int64_t ldo) {
  __m512 acc[tile][kRows];
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512 lo[kRows], hi[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      w.prefetch(n + r + kAheadRows, k);  // past W's end: a hint never faults
      lo[r] = hi[r] = _mm512_setzero_ps();
    }
    load(w, n, rows, k, lo, hi);
    for (int64_t m = 0; m < tile; ++m) {
      const __m512 x0 = _mm512_loadu_ps(x + m * K + k), x1 = _mm512_loadu_ps(x + m * K + k + 16);
      for (int64_t r = 0; r < kRows; ++r)
        acc[m][r] = _mm512_fmadd_ps(x1, hi[r], _mm512_fmadd_ps(x0, lo[r], acc[m][r]));
    }
  }
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < rows; ++r)
      out[m * ldo + r] = static_cast<T>(_mm512_reduce_add_ps(acc[m][r]));
}

// tile x rows against `rows` W rows dequantized into buf [rows][K], in the same order.
template <int64_t tile, typename T>
void dot_block(const float* x, int64_t K, const float* buf, int64_t rows, T* out, int64_t ldo) {
  __m512 acc[tile][kRows];
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      wv[r] = r < rows ? _mm512_loadu_ps(buf + r * K + k) : _mm512_setzero_ps();
    for (int64_t m = 0; m < tile; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < rows; ++r)
      out[m * ldo + r] = static_cast<T>(_mm512_reduce_add_ps(acc[m][r]));
}

template <typename W>
void dequantize(const W& w, int64_t n, int64_t rows, int64_t K, float* buf) {
  for (int64_t k = 0; k < K; k += 32) {
    __m512 lo[kRows], hi[kRows];
    load(w, n, rows, k, lo, hi);
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_storeu_ps(buf + r * K + k, lo[r]);
      _mm512_storeu_ps(buf + r * K + k + 16, hi[r]);
    }
  }
}
#else
template <int64_t tile, typename T>
void dot_block(const float* x, int64_t K, const float* buf, int64_t rows, T* out, int64_t ldo) {
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * buf[r * K + k];
      out[m * ldo + r] = static_cast<T>(s);
    }
}

template <typename W>
void dequantize(const W& w, int64_t n, int64_t rows, int64_t K, float* buf) {
  float block[kRows * 32];
  for (int64_t k = 0; k < K; k += 32) {
    load(w, n, rows, k, block);
    for (int64_t r = 0; r < rows; ++r)
      std::copy(block + r * 32, block + r * 32 + 32, buf + r * K + k);
  }
}
#endif

// Up to kTile rows of x at once through the W rows of one task.
template <typename T, typename W>
void pass(const float* x, int64_t M, int64_t K, int64_t N, T* out, const W& w, int64_t n,
          int64_t rows, const float* buf) {
  auto run = [&](auto tile, int64_t m) {
#if defined(__AVX512F__)
    if (buf == nullptr) {
      dot_direct<decltype(tile)::value>(x + m * K, K, w, n, rows, out + m * N + n, N);
      return;
    }
#endif
    dot_block<decltype(tile)::value>(x + m * K, K, buf, rows, out + m * N + n, N);
  };
  int64_t m = 0;
  for (; m + kTile <= M; m += kTile) run(std::integral_constant<int64_t, kTile>{}, m);
  switch (M - m) {
    case 3: run(std::integral_constant<int64_t, 3>{}, m); break;
    case 2: run(std::integral_constant<int64_t, 2>{}, m); break;
    case 1: run(std::integral_constant<int64_t, 1>{}, m); break;
    default: break;
  }
}

// out [M, N] = x [M, K] (fp32) W^T; K is a multiple of 32. Up to kTile rows of x, each W
// value goes from memory into registers once (a decode step: the time is W's bytes); more
// rows dequantize each task's W rows once into a buffer L1 holds and pass every x row over it.
template <typename T, typename W>
void product(const float* x, int64_t M, int64_t K, int64_t N, T* out, const W& w) {
  const int64_t blocks = (N + kRows - 1) / kRows;
#if defined(__AVX512F__)
  const bool direct = M <= kTile;
#else
  const bool direct = false;
#endif
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(direct ? 0 : kRows * K);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kRows, rows = std::min(kRows, N - n);
      if (!direct) dequantize(w, n, rows, K, buf.data());
      pass(x, M, K, N, out, w, n, rows, direct ? nullptr : buf.data());
    }
  });
}

}  // namespace dequant
