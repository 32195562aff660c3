// The product shared by the weight formats (int4.cpp, int8.cpp, and bf16_linear in gemv.cpp
// for CPUs where oneDNN has no bf16 path), y = x W^T with x in fp32 and W read through its format's `load`,
// which gives 32 columns of a task's W rows in fp32. Every W value is the same fp32 whatever
// the rows, and every sum runs in the same order (a vector's lanes, k ascending), so a row of y
// has the same bits alone or in a batch.
//
// A format is a struct with
//   load<rows>(n, k, lo, hi)    W[n + r, k:k+16] and W[n + r, k+16:k+32] into lo[r], hi[r] for
//                               r < rows (n a multiple of kRows; AVX-512 builds; the row count
//                               a template argument so that the rows' vectors stay in registers),
//   load(n, rows, r, k, v)      W[n + r, k:k+32] into v[0..3], eight columns each, of the row
//                               block [n, n + rows) (AVX2 builds), or into v[0..31] (others);
//   prefetch(n, k)              hints W[n, k:k+32]'s cache lines in.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace dequant {

constexpr int64_t kRows = 4;  // W rows a task takes at once
// x rows per pass over them: kRows x kTile accumulators, the kRows W vectors and an x vector
// fit the registers (32 with AVX-512, 16 with AVX2).
#if defined(__AVX512F__)
constexpr int64_t kTile = 4;
#else
constexpr int64_t kTile = 2;
#endif
// The direct product prefetches the W rows this many rows ahead, at the columns it is
// reading: kRows interleaved rows do not wake the hardware prefetcher early enough. int8 from
// memory at one row (3072 x 576 / 576 x 1536): 77 / 39 us without, 48 / 21 four rows ahead,
// 40 / 21 sixteen. int4's records are one stream (int4.cpp), which needs none.
constexpr int64_t kAheadRows = 4 * kRows;

#if defined(__AVX512F__)
inline float sum_lanes(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline float sum_lanes(__m256 v) { return sum8(v); }
#endif

// A tile's sums, acc[m][r] for x row m and W row r, set to zero. Here and in store_sums every
// loop over them unrolls whole: otherwise GCC keeps the array on the stack and stores every sum
// on every step of the loop over K.
template <int64_t tile, typename V>
inline void zero_sums(V (&acc)[tile][kRows]) {
#pragma GCC unroll 4
  for (int64_t m = 0; m < tile; ++m)
#pragma GCC unroll 4
    for (int64_t r = 0; r < kRows; ++r) acc[m][r] = V{};
}

// out[m * ldo + r] = the sum of acc[m][r]'s lanes, for the first `rows` W rows (tested inside a
// loop over all kRows, which unrolls whole).
template <int64_t tile, typename V, typename T>
inline void store_sums(V (&acc)[tile][kRows], int64_t rows, T* out, int64_t ldo) {
#pragma GCC unroll 4
  for (int64_t m = 0; m < tile; ++m)
#pragma GCC unroll 4
    for (int64_t r = 0; r < kRows; ++r)
      if (r < rows) out[m * ldo + r] = static_cast<T>(sum_lanes(acc[m][r]));
}

#if defined(__AVX512F__)
// w.load<rows> for a row count known at run time (all but a matrix's last task: kRows).
template <typename W, typename... Out>
inline void load(const W& w, int64_t n, int64_t rows, int64_t k, Out... out) {
  static_assert(kRows == 4, "one case per row count");
  switch (rows) {
    case 4: w.template load<4>(n, k, out...); break;
    case 3: w.template load<3>(n, k, out...); break;
    case 2: w.template load<2>(n, k, out...); break;
    default: w.template load<1>(n, k, out...); break;
  }
}

// tile x rows against W rows [n, n + rows), each W vector dequantized into registers and used
// by every x row at once: W's bytes are read once, nothing is written back.
template <int64_t tile, typename W, typename T>
void dot_direct(const float* x, int64_t K, const W& w, int64_t n, int64_t rows, T* out,
                int64_t ldo) {
  __m512 acc[tile][kRows];
  zero_sums(acc);
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
  store_sums(acc, rows, out, ldo);
}

// tile x rows against `rows` W rows dequantized into buf [rows][K], in the same order.
template <int64_t tile, typename T>
void dot_block(const float* x, int64_t K, const float* buf, int64_t rows, T* out, int64_t ldo) {
  __m512 acc[tile][kRows];
  zero_sums(acc);
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      wv[r] = r < rows ? _mm512_loadu_ps(buf + r * K + k) : _mm512_setzero_ps();
    for (int64_t m = 0; m < tile; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  store_sums(acc, rows, out, ldo);
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
// W rows [n, n + rows) at columns [k, k + 32) into out[r * ld, r * ld + 32).
template <typename W>
inline void load_rows(const W& w, int64_t n, int64_t rows, int64_t k, float* out, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 v[4];
    w.load(n, rows, r, k, v);
    for (int64_t e = 0; e < 4; ++e) _mm256_storeu_ps(out + r * ld + 8 * e, v[e]);
#else
    w.load(n, rows, r, k, out + r * ld);
#endif
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// acc[m][r] += x[m, 0:count] . w[r, 0:count] for m < tile, r < rows (x rows ldx apart, w rows
// ldw apart), 8 lanes at a time, k ascending.
template <int64_t tile>
inline void accumulate(__m256 (&acc)[tile][kRows], const float* x, int64_t ldx, const float* w,
                       int64_t ldw, int64_t rows, int64_t count) {
  for (int64_t k = 0; k < count; k += 8) {
    __m256 wv[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      wv[r] = r < rows ? _mm256_loadu_ps(w + r * ldw + k) : _mm256_setzero_ps();
    for (int64_t m = 0; m < tile; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
}

// tile x rows against W rows [n, n + rows), W dequantized 32 columns at a time and used by
// every x row at once (a decode step: W's bytes are read once). Each sum runs over k in steps
// of 8 as accumulate's does, so the bits match the buffer's.
template <int64_t tile, typename W, typename T>
void dot_direct(const float* x, int64_t K, const W& w, int64_t n, int64_t rows, T* out,
                int64_t ldo) {
  __m256 acc[tile][kRows];
  zero_sums(acc);
  for (int64_t k = 0; k < K; k += 32) {
    for (int64_t r = 0; r < kRows; ++r) w.prefetch(n + r + kAheadRows, k);
    if constexpr (tile == 1) {
      // Through a block L1 holds: one x row gives each W row one chain of dependent FMAs,
      // and only accumulate's order (the rows' chains interleaved) keeps the FMA pipes busy
      // (int4, 3072 x 576, one thread, cached: 206 us this way, 388 us from registers).
      alignas(32) float block[kRows * 32];
      load_rows(w, n, rows, k, block, 32);
      accumulate(acc, x + k, K, block, 32, rows, 32);
    } else {
      // From registers, each row r a constant so that acc stays in registers (GCC did not
      // unroll a loop over r here): 1.4x the block's speed at two x rows.
      auto row = [&](auto r) {
        if (r >= rows) return;
        __m256 v[4];
        w.load(n, rows, r, k, v);
        for (int64_t e = 0; e < 4; ++e)
          for (int64_t m = 0; m < tile; ++m)
            acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * e), v[e], acc[m][r]);
      };
      static_assert(kRows == 4, "one call per row");
      row(std::integral_constant<int64_t, 0>{});
      row(std::integral_constant<int64_t, 1>{});
      row(std::integral_constant<int64_t, 2>{});
      row(std::integral_constant<int64_t, 3>{});
    }
  }
  store_sums(acc, rows, out, ldo);
}

// tile x rows against `rows` W rows dequantized into buf [rows][K], in the same order.
template <int64_t tile, typename T>
void dot_block(const float* x, int64_t K, const float* buf, int64_t rows, T* out, int64_t ldo) {
  __m256 acc[tile][kRows];
  zero_sums(acc);
  accumulate(acc, x, K, buf, K, rows, K);
  store_sums(acc, rows, out, ldo);
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
#endif

template <typename W>
void dequantize(const W& w, int64_t n, int64_t rows, int64_t K, float* buf) {
  for (int64_t k = 0; k < K; k += 32) load_rows(w, n, rows, k, buf + k, K);
}
#endif

// Up to kTile rows of x at once through the W rows of one task.
template <typename T, typename W>
void pass(const float* x, int64_t M, int64_t K, int64_t N, T* out, const W& w, int64_t n,
          int64_t rows, const float* buf) {
  auto run = [&](auto tile, int64_t m) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

// Past kTile rows, W rows are dequantized a group of kGroup row blocks at a time into a buffer
// L2 holds, and x passes over them kChunk rows at a time, so that a long prefill's x is read
// once a group from the caches rather than once a row block from memory.
constexpr int64_t kGroup = 8;
constexpr int64_t kChunk = 32;

// out [M, N] = x [M, K] (fp32) W^T; K is a multiple of 32. Up to kTile rows of x, each W
// value goes from memory into registers once (a decode step: the time is W's bytes); more
// rows dequantize each W row once a call into the buffer and pass every x row over it.
template <typename T, typename W>
void product(const float* x, int64_t M, int64_t K, int64_t N, T* out, const W& w) {
  const int64_t blocks = (N + kRows - 1) / kRows;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const bool direct = M <= kTile;
#else
  const bool direct = false;
#endif
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    if (direct) {
      for (int64_t b = begin; b < end; ++b)
        pass(x, M, K, N, out, w, b * kRows, std::min(kRows, N - b * kRows), nullptr);
      return;
    }
    std::vector<float> buf(kGroup * kRows * K);
    for (int64_t first = begin; first < end; first += kGroup) {
      const int64_t last = std::min(end, first + kGroup);
      for (int64_t b = first; b < last; ++b)
        dequantize(w, b * kRows, std::min(kRows, N - b * kRows), K,
                   buf.data() + (b - first) * kRows * K);
      for (int64_t m = 0; m < M; m += kChunk)
        for (int64_t b = first; b < last; ++b)
          pass(x + m * K, std::min(kChunk, M - m), K, N, out + m * N, w, b * kRows,
               std::min(kRows, N - b * kRows), buf.data() + (b - first) * kRows * K);
    }
  });
}

// Past this many rows of x (prefill chunks) W is dequantized whole into fp32 once a call and
// MKL's GEMM takes the product: its cache blocking beats the tiles here there, for every format
// (AVX2-only AMD EPYC, int4, 960 x 576 / 3072 x 576 / 576 x 1536: 320 rows 2.8 / 9.8 / 4.4 ms
// against 3.4 / 11.0 / 5.5, 1024 rows 9.0 / 26.4 / 12.6 against 11.4 / 27.8 / 17.4). Between
// 192 and 256 rows the products alone are mixed, but served at 64 streams (bf16, 128 in / 128
// out) 192 gave 169 tok/s against 156 at 256. A row's bits then depend on whether its call has more
// rows than this, as with oneDNN's products.
constexpr int64_t kWidenRows = 192;

// W [N, K] in fp32: the same values the products here read.
template <typename W>
at::Tensor widen(const W& w, int64_t N, int64_t K) {
  auto out = at::empty({N, K}, at::kFloat);
  float* p = out.data_ptr<float>();
  at::parallel_for(0, (N + kRows - 1) / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      dequantize(w, b * kRows, std::min(kRows, N - b * kRows), K, p + b * kRows * K);
  });
  return out;
}

// y = x W^T in `dtype` (x's by default), rows past kWidenRows by MKL on W widened (see above).
template <typename W>
at::Tensor linear(const at::Tensor& x, const W& w, int64_t N,
                  std::optional<at::ScalarType> dtype = std::nullopt) {
  const int64_t M = x.size(0), K = x.size(1);
  const at::ScalarType type = dtype.value_or(x.scalar_type());
  if (M > kWidenRows) return at::linear(x.to(at::kFloat), widen(w, N, K)).to(type);
  auto xf = x.to(at::kFloat).contiguous();  // M x K: a few rows, converted once
  auto out = at::empty({M, N}, x.options().dtype(type));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "dequant::linear",
                                  [&] {
    product(xf.data_ptr<float>(), M, K, N, out.data_ptr<scalar_t>(), w);
  });
  return out;
}

}  // namespace dequant
