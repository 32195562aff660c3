// The int4 and int8 products summed in integers: x rounded to 16-bit integers per block of 32
// columns, and each block's sum of W's integers times x's taken exactly in int32, then scaled
// into an fp32 sum once a block. Two builds:
// - AVX2 without AVX-512, a decode step (up to dequant::kTile rows of x, vpmaddwd): widening
//   every weight to fp32 first (dequant_product.h) cost more than the bytes it saved, the
//   one-row int4 product being compute-bound at ~3x its weights' memory time;
// - AVX-512 with VNNI, past a decode step (batched decode and prefill chunks, vpdpwssd): one
//   int32 lane a W row, so that a block's scaling is one vector operation for 16 rows, where
//   dequant_product.h's fp32 tiles ran at a quarter of oneDNN's bf16 product at 64 rows, and
//   MKL's fp32 product on W widened whole (past kWidenRows) at 0.6x this one per row. Up to
//   kTile rows AVX-512 keeps the fp32 product, which is bound by W's bytes there.
//
// Why 16 bits, where llama.cpp rounds x to 8: the step is a power of two that puts the block's
// largest |x| in [2^14, 2^15) steps, so a bf16 activation within 2^7 of it (8 significant
// bits) is exact, and a smaller one is off by at most 2^-15 of the largest: the int4 path keeps
// what the activations carry, as the fp32 path did, rather than a precision loss of its own.
// Both builds round alike and scale a block's sum alike, so they give a row the same bits.
// Asked for 8 bits (--quant-activation-bits 8), AVX-512 VNNI past a decode step rounds x to 8
// bits a block as llama.cpp's Q8_1 and Q8_0 do (the largest |x| at 127 steps), so that vpdpbusd
// sums four products at once, twice vpdpwssd's (and oneDNN's bf16) an instruction: at 16 bits
// the int4 product runs at 0.72-0.80x oneDNN's bf16 one at 64 rows. vpdpbusd takes one operand
// unsigned: int4's nibbles are; int8's W stays signed and x goes in offset by 128 (q + 128),
// the sums starting at -128 times each W row's block sum to take the offset back out. The
// error this rounding adds (at most half a step, 1/254 of the block's largest |x|) is smaller
// than what rounding W to 4 bits moves a sum by, but not nothing: see --quant-activation-bits.
//
// A format adds, for these builds,
//   kMins                       whether W has a minimum per block (int4) or not (int8),
//   widen16(n, rows, r, k, w)   W[n + r, k:k+16] and W[n + r, k+16:k+32] as int16 in w[0], w[1]
//                               (AVX2),
//   widen32(n, rows, r, k)      W[n + r, k:k+32] as 32 int16 in one vector (AVX-512),
//   kSigned                     whether W's integers are signed (int8) or not (int4's nibbles),
//   bytes32(n, rows, r, k)      W[n + r, k:k+32] as 32 bytes (AVX-512, for 8-bit x),
//   whole(n, k, words, ...)     W[n:n+16, k:k+32] (four whole records) as bytes32 gives each row,
//                               in Lanes' layout, with the rows' steps (and minimums) (AVX-512,
//                               for 8-bit x),
//   steps(n, rows, k)           the rows' scales at columns [k, k + 32), `rows` floats,
//   mins(n, rows, k)            and their minimums (kMins formats).
#pragma once

#include "dequant_product.h"
#include "records.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SURGE_INTEGER_AVX2 1
#else
#define SURGE_INTEGER_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SURGE_INTEGER_VNNI 1
#else
#define SURGE_INTEGER_VNNI 0
#endif

#if SURGE_INTEGER_AVX2 || SURGE_INTEGER_VNNI
#include <cmath>
#include <cstring>
#include <limits>

namespace integer {

using dequant::kRows;
constexpr int64_t kBlock = 32;

// A block's step from its largest |x| for integers Q (int16: a power of two, see above; int8:
// the largest at 127 steps), or 0 for a block of zeros, or NaN for one whose sum is not finite
// (a NaN or an infinity, which max can drop, but a sum keeps): that row's sums then come out
// NaN, as fp32 sums would. Never under the least normal float: the inverse stays finite.
template <typename Q>
inline float step_of(float largest, float sum) {
  if (!std::isfinite(sum)) return std::numeric_limits<float>::quiet_NaN();
  if (!(largest > 0.0f)) return 0.0f;
  if constexpr (sizeof(Q) == 1)
    return std::max(largest / 127.0f, std::numeric_limits<float>::min());
  return std::ldexp(1.0f, std::max(std::ilogb(largest) - 14, -126));
}

#if SURGE_INTEGER_AVX2
// The block of 32 x values at p as integers q, x ~ q * step: x / step rounded to the nearest
// integer (even on ties), in int16's range (the one value that can reach 2^15 saturates), and
// their sum in total; returns the step. A block of zeros (or non-finite values) gives zeros.
inline float round_block(const float* p, int16_t* q, int32_t& total) {
  __m256 v[4];
  for (int e = 0; e < 4; ++e) v[e] = _mm256_loadu_ps(p + 8 * e);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 top = _mm256_max_ps(
      _mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
      _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  const float step = step_of<int16_t>(
      *std::max_element(lanes, lanes + 8),
      sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]))));
  const __m256 inverse = _mm256_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);  // exact
  __m256i sums = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    __m256i half[2];
    for (int e = 0; e < 2; ++e)
      half[e] = _mm256_cvtps_epi32(_mm256_min_ps(
          _mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(v[2 * h + e], inverse),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                        _mm256_set1_ps(-32768.0f)),
          _mm256_set1_ps(32767.0f)));
    const __m256i packed =
        _mm256_permute4x64_epi64(_mm256_packs_epi32(half[0], half[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * h), packed);
    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(packed, _mm256_set1_epi16(1)));
  }
  total = static_cast<int32_t>(sum8(_mm256_cvtepi32_ps(sums)));  // exact: under 2^20
  return step;
}
#else
// The AVX-512 round_block, for int16 (above) and int8 (the largest |x| at 127 steps) alike.
template <typename Q>
inline float round_block(const float* p, Q* q, int32_t& total) {
  // int8 stays symmetric, as llama.cpp's grid; int16 takes its whole range.
  constexpr float kLow = sizeof(Q) == 1 ? -127.0f : -32768.0f;
  constexpr float kHigh = sizeof(Q) == 1 ? 127.0f : 32767.0f;
  const __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
  const float step =
      step_of<Q>(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))),
                 _mm512_reduce_add_ps(_mm512_add_ps(v0, v1)));
  const __m512 inverse = _mm512_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
  auto integers = [&](__m512 v) {
    return _mm512_cvtps_epi32(_mm512_min_ps(
        _mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(v, inverse),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                      _mm512_set1_ps(kLow)),
        _mm512_set1_ps(kHigh)));
  };
  const __m512i q0 = integers(v0), q1 = integers(v1);
  if constexpr (sizeof(Q) == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(q1));
  }
  total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  return step;
}
#endif

#if SURGE_INTEGER_AVX2
// x [M, K] per block of 32 columns as q * step (round_block), and the block's sum of those
// values (step times a sum of q, exact for int16's power-of-two steps) for the minimums' term.
struct RoundedX {
  std::vector<int16_t> q;
  std::vector<float> step, sum;  // [M, K / 32]
  int64_t K, blocks;

  RoundedX(const float* x, int64_t M, int64_t K)
      : q(M * K), step(M * K / kBlock), sum(M * K / kBlock), K(K), blocks(K / kBlock) {
    at::parallel_for(0, M * blocks, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int32_t total;
        step[i] = round_block(x + i * kBlock, q.data() + i * kBlock, total);
        sum[i] = step[i] * static_cast<float>(total);
      }
    });
  }
};

// x [M, K] as RoundedX reads it, q * step in fp32 (exact), for the fp32 products past kTile rows.
inline at::Tensor rounded(const float* x, int64_t M, int64_t K) {
  auto out = at::empty({M, K}, at::kFloat);
  float* p = out.data_ptr<float>();
  at::parallel_for(0, M * K / kBlock, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int16_t q[kBlock];
      int32_t total;
      const float step = round_block(x + i * kBlock, q, total);
      for (int64_t e = 0; e < kBlock; ++e) p[i * kBlock + e] = static_cast<float>(q[e]) * step;
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

#else
constexpr int64_t kLanes = 16;  // W rows a task takes: one an int32 lane
constexpr int64_t kXTile = 8;   // x rows a pass takes: 8 int32 and 8 fp32 sums in registers

// v[r]: row r's 16 column pairs (as int32) -> v[p]: column pair p of the 16 rows.
inline void transpose(__m512i (&v)[kLanes]) {
  __m512i t[kLanes];
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: pairs of rows
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads of rows: v[i + c] holds columns 4L + c, lane L
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 128-bit lanes of the quads, transposed
    const __m512i quads[4] = {v[c], v[4 + c], v[8 + c], v[12 + c]};
    __m512i across[4];
    records::lanes_across(quads, across);
    for (int p = 0; p < 4; ++p) t[4 * p + c] = across[p];
  }
  for (int p = 0; p < 16; ++p) v[p] = t[p];
}

// W rows [n, n + 16) (fewer at N) as the tiles read them, once a call: each block's words of
// the 16 rows (lane r: row r's column pair as two int16, or its 4 columns as bytes for Q int8),
// then the rows' steps and minimums, and for signed bytes the sums' start (-128 times the
// row's block sum: x goes in offset by 128).
template <typename Q>
struct Lanes {
  static constexpr int64_t kWords = kBlock * sizeof(Q) / 4;  // a block's words a row: 16 or 8
  std::vector<__m512i> words;       // [blocks][kWords]
  std::vector<float> steps, mins;   // [blocks][16]
  std::vector<int32_t> start;       // [blocks][16]

  explicit Lanes(int64_t blocks) : words(blocks * kWords + kWords), steps(blocks * kLanes),
                                   mins(blocks * kLanes), start(blocks * kLanes + kLanes) {}

  template <typename W>
  void fill(const W& w, int64_t n, int64_t N) {
    static_assert(kLanes % kRows == 0, "a task's rows are whole records");
    const int64_t blocks = static_cast<int64_t>(steps.size()) / kLanes;
    if constexpr (sizeof(Q) == 1) {
      if (N - n >= kLanes) {  // a whole task: straight from its records
        for (int64_t b = 0; b < blocks; ++b)
          w.whole(n, b * kBlock, &words[b * kWords], &steps[b * kLanes], &mins[b * kLanes]);
        if constexpr (W::kSigned) starts(blocks);
        return;
      }
    }
    constexpr int64_t kPer = kLanes / kWords;  // blocks a transpose takes: 1, or 2 for bytes
    for (int64_t b = 0; b < blocks; b += kPer) {
      const int64_t count = std::min(kPer, blocks - b);
      __m512i v[kLanes];
      for (int64_t first = n; first < n + kLanes; first += kRows) {  // a record's rows at once
        const int64_t rows = std::clamp<int64_t>(N - first, 0, kRows), lane = first - n;
        const auto real = static_cast<__mmask8>((1u << rows) - 1);
        for (int64_t j = 0; j < count; ++j) {  // the rows' steps and minimums, as loaded
          const int64_t at = (b + j) * kLanes + lane, k = (b + j) * kBlock;
          _mm_storeu_ps(&steps[at], rows ? _mm_maskz_loadu_ps(real, w.steps(first, rows, k))
                                         : _mm_setzero_ps());
          __m128 least = _mm_setzero_ps();
          if constexpr (W::kMins)
            if (rows) least = _mm_maskz_loadu_ps(real, w.mins(first, rows, k));
          _mm_storeu_ps(&mins[at], least);
        }
        for (int64_t r = 0; r < kRows; ++r) {
          __m512i& row = v[lane + r];
          if (r >= rows) {
            row = _mm512_setzero_si512();
          } else if constexpr (kPer == 1) {
            row = w.widen32(first, rows, r, b * kBlock);
          } else {
            const __m256i next = count > 1 ? w.bytes32(first, rows, r, (b + 1) * kBlock)
                                           : _mm256_setzero_si256();
            row = _mm512_inserti64x4(
                _mm512_castsi256_si512(w.bytes32(first, rows, r, b * kBlock)), next, 1);
          }
        }
      }
      transpose(v);  // 16 words a row: a block's word p of every row in v[p], two blocks' bytes
      for (int64_t p = 0; p < kLanes; ++p) words[b * kWords + p] = v[p];
    }
    if constexpr (W::kSigned && kPer > 1) starts(blocks);
  }

  // Signed bytes' sums start at -128 times the row's sum of the block's values, which takes
  // back what x's offset of 128 adds (a row past N: zeros, whose start is 0 too).
  void starts(int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i total = _mm512_setzero_si512();
      for (int64_t p = 0; p < kWords; ++p)
        total = _mm512_dpbusd_epi32(total, _mm512_set1_epi8(1), words[b * kWords + p]);
      _mm512_storeu_si512(&start[b * kLanes], _mm512_mullo_epi32(total, _mm512_set1_epi32(-128)));
    }
  }
};

// x [M, K] rounded a block at a time (round_block, integers Q) and laid out for the tiles: per
// group of kXTile rows and per block, word p of row t at [p][t], and the rows' steps and sums
// (step times the sum of q, for the minimums' term) at [t], so that a tile reads all its
// rows' broadcasts through one pointer (eight row pointers, with their steps' and sums',
// spilled the registers). A last group's missing rows are zeros.
template <typename Q>
struct TiledX {
  static constexpr int64_t kWords = kBlock * sizeof(Q) / 4;  // a block's words a row: 16 or 8
  std::vector<int32_t> words;     // [groups][blocks][kWords][kXTile]
  std::vector<float> step, sum;   // [groups][blocks][kXTile]
  int64_t blocks;

  TiledX(const float* x, int64_t M, int64_t K)
      : words(groups(M) * K / kBlock * kWords * kXTile), step(groups(M) * K / kBlock * kXTile),
        sum(step.size()), blocks(K / kBlock) {
    at::parallel_for(0, M * blocks, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / blocks, b = i % blocks;
        const int64_t at = (m / kXTile * blocks + b) * kXTile + m % kXTile;
        Q q[kBlock];
        int32_t total;
        step[at] = round_block(x + i * kBlock, q, total);
        sum[at] = step[at] * static_cast<float>(total);
        int32_t* w = words.data() + (at - m % kXTile) * kWords + m % kXTile;
        for (int64_t p = 0; p < kWords; ++p) std::memcpy(w + p * kXTile, q + p * 4 / sizeof(Q), 4);
      }
    });
  }
  static int64_t groups(int64_t M) { return (M + kXTile - 1) / kXTile; }
};

// tile x rows of group g against the 16 W rows of `lanes` (the first `rows` real): per block,
// each row's exact int32 sum of W times x (vpdpwssd on int16 pairs; vpdpbusd on bytes, four at
// a time: int4's unsigned nibbles times x's int8, or x + 128 times int8's signed values), scaled
// as the AVX2 product scales them.
template <int64_t tile, bool mins, bool is_signed, typename Q, typename T>
void dot(const TiledX<Q>& x, int64_t g, const Lanes<Q>& lanes, int64_t rows, T* out,
         int64_t ldo) {
  constexpr int64_t kWords = Lanes<Q>::kWords;
  constexpr bool kOffset = sizeof(Q) == 1 && is_signed;
  __m512 acc[tile];
  for (int64_t t = 0; t < tile; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512i dots[tile];
    const __m512i first = kOffset ? _mm512_loadu_si512(lanes.start.data() + b * kLanes)
                                  : _mm512_setzero_si512();
    for (int64_t t = 0; t < tile; ++t) dots[t] = first;
    const int64_t at = (g * x.blocks + b) * kXTile;
    const int32_t* xw = x.words.data() + at * kWords;
    const __m512i* w = lanes.words.data() + b * kWords;
#pragma GCC unroll 16
    for (int64_t p = 0; p < kWords; ++p) {
      const __m512i wv = _mm512_load_si512(w + p);
#pragma GCC unroll 8
      for (int64_t t = 0; t < tile; ++t) {
        const int32_t word = xw[p * kXTile + t];
        if constexpr (kOffset) {  // each byte's top bit flipped: q + 128, unsigned
          dots[t] = _mm512_dpbusd_epi32(dots[t], _mm512_set1_epi32(word ^ 0x80808080), wv);
        } else if constexpr (sizeof(Q) == 1) {
          dots[t] = _mm512_dpbusd_epi32(dots[t], wv, _mm512_set1_epi32(word));
        } else {
          dots[t] = _mm512_dpwssd_epi32(dots[t], wv, _mm512_set1_epi32(word));
        }
      }
    }
    const __m512 steps = _mm512_loadu_ps(lanes.steps.data() + b * kLanes);
    const __m512 least = _mm512_loadu_ps(lanes.mins.data() + b * kLanes);
#pragma GCC unroll 8
    for (int64_t t = 0; t < tile; ++t) {
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[t]),
                               _mm512_mul_ps(steps, _mm512_set1_ps(x.step[at + t])), acc[t]);
      if constexpr (mins) acc[t] = _mm512_fmadd_ps(least, _mm512_set1_ps(x.sum[at + t]), acc[t]);
    }
  }
  for (int64_t t = 0; t < tile; ++t) {
    alignas(64) float sums[kLanes];
    _mm512_store_ps(sums, acc[t]);
    for (int64_t r = 0; r < rows; ++r) out[t * ldo + r] = static_cast<T>(sums[r]);
  }
}

// out [M, N] = x [M, K] W^T, x rounded to integers Q: a task widens 16 W rows once and every x
// row passes over them.
template <typename Q, typename T, typename W>
void product(const float* x, int64_t M, int64_t K, int64_t N, T* out, const W& w) {
  const TiledX<Q> xr(x, M, K);
  at::parallel_for(0, (N + kLanes - 1) / kLanes, 1, [&](int64_t begin, int64_t end) {
    Lanes<Q> lanes(K / kBlock);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * kLanes, rows = std::min(kLanes, N - n);
      lanes.fill(w, n, N);
      for (int64_t m = 0; m < M; m += kXTile) {
        auto run = [&](auto tile) {
          dot<decltype(tile)::value, W::kMins, W::kSigned>(xr, m / kXTile, lanes, rows,
                                                           out + m * N + n, N);
        };
        switch (std::min(kXTile, M - m)) {
          case 8: run(std::integral_constant<int64_t, 8>{}); break;
          case 7: run(std::integral_constant<int64_t, 7>{}); break;
          case 6: run(std::integral_constant<int64_t, 6>{}); break;
          case 5: run(std::integral_constant<int64_t, 5>{}); break;
          case 4: run(std::integral_constant<int64_t, 4>{}); break;
          case 3: run(std::integral_constant<int64_t, 3>{}); break;
          case 2: run(std::integral_constant<int64_t, 2>{}); break;
          default: run(std::integral_constant<int64_t, 1>{}); break;
        }
      }
    }
  });
}
#endif

}  // namespace integer
#endif

namespace integer {

// The bits this build's int4 and int8 products round x to a block for a call of `rows` rows of
// x, asked for `bits` (8 or 16; see above), 0 where they read x as it is: 8 only past a decode
// step on AVX-512 VNNI, 16 otherwise.
inline int64_t x_bits([[maybe_unused]] int64_t rows, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 16, "activation bits are 8 or 16, not ", bits);
#if SURGE_INTEGER_AVX2
  return 16;
#elif SURGE_INTEGER_VNNI
  return rows > dequant::kTile ? bits : 0;
#else
  return 0;
#endif
}

// y = x W^T for the int4 and int8 formats: the integer product where x_bits (the
// builds above), else dequant::linear's fp32 products. On AVX2, past kTile rows those take x
// rounded as the integer sums read it, so that a row's values agree across the two to fp32
// rounding: there the fp32 FMAs are as fast, and 1.1x faster at 64 rows than the integer
// product's per-block scaling (AVX2-only AMD EPYC).
template <typename W>
at::Tensor linear(const at::Tensor& x, const W& w, int64_t N, int64_t bits = 16) {
  const int64_t M = x.size(0);
  [[maybe_unused]] const int64_t read = x_bits(M, bits);
#if SURGE_INTEGER_AVX2 || SURGE_INTEGER_VNNI
  const int64_t K = x.size(1);
  if (read) {
    auto xf = x.to(at::kFloat).contiguous();
#if SURGE_INTEGER_AVX2
    if (M > dequant::kTile)
      return dequant::linear(rounded(xf.data_ptr<float>(), M, K), w, N, x.scalar_type());
#endif
    auto out = at::empty({M, N}, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                    "integer::linear", [&] {
#if SURGE_INTEGER_VNNI
      if (read == 8)
        return product<int8_t>(xf.data_ptr<float>(), M, K, N, out.data_ptr<scalar_t>(), w);
      product<int16_t>(xf.data_ptr<float>(), M, K, N, out.data_ptr<scalar_t>(), w);
#else
      product(xf.data_ptr<float>(), M, K, N, out.data_ptr<scalar_t>(), w);
#endif
    });
    return out;
  }
#endif
  return dequant::linear(x, w, N);
}

}  // namespace integer
