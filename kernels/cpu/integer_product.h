// The int4 and int8 products of a decode step (up to dequant::kTile rows of x) on CPUs with AVX2
// but no AVX-512: x rounded to 16-bit integers per block of 32 columns, and each block's sum of
// W's integers times x's taken exactly in int32 (vpmaddwd), then scaled into an fp32 sum once a
// block. Widening every weight to fp32 first (dequant_product.h) cost more than the bytes it
// saved: the one-row int4 product was compute-bound at ~3x its weights' memory time.
//
// Why 16 bits, where llama.cpp rounds x to 8: the step is a power of two that puts the block's
// largest |x| in [2^14, 2^15) steps, so a bf16 activation within 2^7 of it (8 significant
// bits) is exact, and a smaller one is off by at most 2^-15 of the largest: the int4 path keeps
// what the activations carry, as the fp32 path did, rather than a precision loss of its own.
//
// A format adds, for these builds,
//   kMins                       whether W has a minimum per block (int4) or not (int8),
//   widen16(n, rows, r, k, w)   W[n + r, k:k+16] and W[n + r, k+16:k+32] as int16 in w[0], w[1],
//   steps(n, rows, k)           the rows' scales at columns [k, k + 32), `rows` floats,
//   mins(n, rows, k)            and their minimums (kMins formats).
#pragma once

#include "dequant_product.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <cmath>
#include <limits>

namespace integer {

using dequant::kRows;
constexpr int64_t kBlock = 32;

// A block of 32 x values' step (a power of two, see above), or 0 for a block of zeros, or NaN
// for one holding a NaN or an infinity (which max_ps can drop, but a sum keeps): that row's
// sums then come out NaN, as fp32 sums would.
inline float block_step(const __m256 (&v)[4]) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 top = _mm256_max_ps(
      _mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
      _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  const float largest = *std::max_element(lanes, lanes + 8);
  if (!std::isfinite(sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])))))
    return std::numeric_limits<float>::quiet_NaN();
  if (!(largest > 0.0f)) return 0.0f;
  // -126: the inverse stays a normal float for blocks of denormals.
  return std::ldexp(1.0f, std::max(std::ilogb(largest) - 14, -126));
}

// The block of 32 x values at p as integers q (in fp32) and its step, x ~ q * step: x / step
// rounded to the nearest integer (even on ties), in int16's range (the one value that can
// reach 2^15 saturates). A block of zeros (or non-finite values) gives zeros.
inline float round_block(const float* p, __m256 (&q)[4]) {
  __m256 v[4];
  for (int e = 0; e < 4; ++e) v[e] = _mm256_loadu_ps(p + 8 * e);
  const float step = block_step(v);
  const __m256 inverse = _mm256_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);  // exact
  for (int e = 0; e < 4; ++e)
    q[e] = _mm256_min_ps(
        _mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(v[e], inverse),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                      _mm256_set1_ps(-32768.0f)),
        _mm256_set1_ps(32767.0f));
  return step;
}

// x [M, K] per block of 32 columns as q * step (round_block), and the block's sum
// of those values (exact in fp32: step times a sum of q under 2^20) for the minimums' term.
struct RoundedX {
  std::vector<int16_t> q;
  std::vector<float> step, sum;  // [M, K / 32]
  int64_t K, blocks;

  RoundedX(const float* x, int64_t M, int64_t K)
      : q(M * K), step(M * K / kBlock), sum(M * K / kBlock), K(K), blocks(K / kBlock) {
    for (int64_t i = 0; i < M * blocks; ++i) {
      __m256 rounded[4];
      step[i] = round_block(x + i * kBlock, rounded);
      __m256i total = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_permute4x64_epi64(
            _mm256_packs_epi32(_mm256_cvtps_epi32(rounded[2 * h]),
                               _mm256_cvtps_epi32(rounded[2 * h + 1])), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + i * kBlock + 16 * h), packed);
        total = _mm256_add_epi32(total, _mm256_madd_epi16(packed, _mm256_set1_epi16(1)));
      }
      sum[i] = step[i] * sum8(_mm256_cvtepi32_ps(total));
    }
  }
};

// x [M, K] as RoundedX reads it, q * step in fp32 (exact), for the fp32 products past kTile rows.
inline at::Tensor rounded(const float* x, int64_t M, int64_t K) {
  auto out = at::empty({M, K}, at::kFloat);
  float* p = out.data_ptr<float>();
  at::parallel_for(0, M * K / kBlock, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      __m256 q[4];
      const float step = round_block(x + i * kBlock, q);
      for (int e = 0; e < 4; ++e)
        _mm256_storeu_ps(p + i * kBlock + 8 * e, _mm256_mul_ps(q[e], _mm256_set1_ps(step)));
    }
  });
  return out;
}

// Lane r of the result: the sum of d[r]'s 8 lanes (exact: int32).
inline __m128i reduce4(const __m256i (&d)[kRows]) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]),
                                      _mm256_hadd_epi32(d[2], d[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// tile x rows against W rows [n, n + rows): per block, each row pair's exact int32 sum, scaled
// by W's scale times x's step, and the minimum times x's sum, into lane r of the x row's 4-lane
// fp32 sum. A row's sums run in the same order whatever the tile, so one row alone and two
// together give the same bits.
template <int64_t tile, typename W, typename T>
void dot(const RoundedX& x, const W& w, int64_t n, int64_t rows, T* out, int64_t ldo) {
  const int64_t K = x.K;
  const __m128i valid = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(rows)),
                                        _mm_setr_epi32(0, 1, 2, 3));
  __m128 acc[tile];
  for (int64_t m = 0; m < tile; ++m) acc[m] = _mm_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const int64_t k = b * kBlock;
    __m256i wv[kRows][2];
    // Each row r a constant, so that wv stays in registers (as dequant::dot_direct).
    auto row = [&](auto r) {
      w.prefetch(n + r + dequant::kAheadRows, k);
      if (r < rows) {
        w.widen16(n, rows, r, k, wv[r]);
      } else {
        wv[r][0] = wv[r][1] = _mm256_setzero_si256();
      }
    };
    static_assert(kRows == 4, "one call per row");
    row(std::integral_constant<int64_t, 0>{});
    row(std::integral_constant<int64_t, 1>{});
    row(std::integral_constant<int64_t, 2>{});
    row(std::integral_constant<int64_t, 3>{});
    const __m128 scales = _mm_maskload_ps(w.steps(n, rows, k), valid);
    __m128 mins = _mm_setzero_ps();
    if constexpr (W::kMins) mins = _mm_maskload_ps(w.mins(n, rows, k), valid);
#pragma GCC unroll 4
    for (int64_t m = 0; m < tile; ++m) {
      const int16_t* xq = x.q.data() + m * K + k;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
      __m256i dots[kRows];
#pragma GCC unroll 4
      for (int64_t r = 0; r < kRows; ++r)
        dots[r] = _mm256_add_epi32(_mm256_madd_epi16(wv[r][0], x0),
                                   _mm256_madd_epi16(wv[r][1], x1));
      const int64_t i = m * x.blocks + b;
      acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(reduce4(dots)),
                            _mm_mul_ps(scales, _mm_set1_ps(x.step[i])), acc[m]);
      if constexpr (W::kMins) acc[m] = _mm_fmadd_ps(mins, _mm_set1_ps(x.sum[i]), acc[m]);
    }
  }
  for (int64_t m = 0; m < tile; ++m) {
    alignas(16) float sums[kRows];
    _mm_store_ps(sums, acc[m]);
    for (int64_t r = 0; r < rows; ++r) out[m * ldo + r] = static_cast<T>(sums[r]);
  }
}

// out [M, N] = x [M, K] W^T for up to dequant::kTile rows of x (a decode step): each W row is
// widened into registers once and used by every x row, so W's bytes are read once a call.
template <typename T, typename W>
void product(const float* x, int64_t M, int64_t K, int64_t N, T* out, const W& w) {
  const RoundedX xr(x, M, K);
  at::parallel_for(0, (N + kRows - 1) / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kRows, rows = std::min(kRows, N - n);
      if (M == 2) {
        dot<2>(xr, w, n, rows, out + n, N);
      } else {
        dot<1>(xr, w, n, rows, out + n, N);
      }
    }
  });
}

}  // namespace integer
#endif

namespace integer {

// Whether this build's int4 and int8 products round x to 16 bits a block (see above).
constexpr bool kRoundsX =
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    true;
#else
    false;
#endif

// y = x W^T for the int4 and int8 formats. Where this build has the integer product, it takes
// up to dequant::kTile rows (decode steps); more rows take dequant::linear's fp32 products on x
// rounded as the integer sums read it, so that a row's values agree across the two to fp32
// rounding. Past kTile rows the fp32 FMAs are as fast, and 1.1x faster at 64 rows than this
// product's per-block scaling (AVX2-only AMD EPYC).
template <typename W>
at::Tensor linear(const at::Tensor& x, const W& w, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  const int64_t M = x.size(0), K = x.size(1);
  auto xf = x.to(at::kFloat).contiguous();
  if (M > dequant::kTile)
    return dequant::linear(rounded(xf.data_ptr<float>(), M, K), w, N, x.scalar_type());
  auto out = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "integer::linear",
                                  [&] {
    product(xf.data_ptr<float>(), M, K, N, out.data_ptr<scalar_t>(), w);
  });
  return out;
#else
  return dequant::linear(x, w, N);
#endif
}

}  // namespace integer
