// int4 products on bf16 panels, for a bf16 x past a decode step at 16-bit activations, on
// AVX-512 BF16 with VBMI. A nibble is exact in bf16, so a task decodes its panel of 48 W rows
// into bf16 pairs once a call, in panels.cpp's layout, and x goes in as it is through the pair
// dot product: as many products an instruction as the 16-bit integer sums
// (integer_product.h), whose tile loads a W vector for every 8 of them and rescales by x's step
// every block, and nothing of x rounded. Each block's fp32 sums are scaled by its steps, and
// its minimums times x's block sums added, in fp32, as int4_linear's other products do. At 64
// rows 0.66-0.74x the bf16 panels' speed, where the integer sums ran at 0.56-0.64x.
//
// A Q4_1 byte holds a block's columns i and i + 16, so a W pair here is (i, i + 16), and each
// row's x is permuted into the same pairs once a call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "panels.h"
#include "records.h"
#include "vec_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define SURGE_INT4_PANELS 1
#else
#define SURGE_INT4_PANELS 0
#endif

namespace {

#if SURGE_INT4_PANELS
using panels::kPanel;
using panels::kTileRows;
using panels::kVectors;
using records::kBlock;
constexpr int64_t kPairs = kBlock / 2;  // pairs a block

// x [M, K] as the tiles read it: each block's columns (i, i + 16) as one word, and the block's
// sum in fp32 for the minimums.
struct PairedX {
  std::unique_ptr<uint32_t[]> pairs;  // [M][K / 2]
  std::unique_ptr<float[]> sums;      // [M][K / 32]

  PairedX(const at::BFloat16* x, int64_t M, int64_t K)
      : pairs(new uint32_t[M * K / 2]), sums(new float[M * K / kBlock]) {
    alignas(64) int16_t order[kBlock];
    for (int64_t i = 0; i < kPairs; ++i) {
      order[2 * i] = static_cast<int16_t>(i);
      order[2 * i + 1] = static_cast<int16_t>(i + kPairs);
    }
    const __m512i take = _mm512_load_si512(order);
    const int64_t blocks = K / kBlock;
    // A decode step's x is a few microseconds' work: one thread, no parallel region to wait on.
    at::parallel_for(0, M, 128, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * blocks; i < end * blocks; ++i)
        _mm512_storeu_si512(pairs.get() + i * kPairs,
                            _mm512_permutexvar_epi16(take, _mm512_loadu_si512(x + i * kBlock)));
      // Each block's sum: 16 at a time by reduce16, the rest of a row alone (a row's bits the
      // same in any call).
      auto block = [&](int64_t i) {
        const __m512i v = _mm512_loadu_si512(x + i * kBlock);
        return _mm512_add_ps(from_bf16(_mm512_castsi512_si256(v)),
                             from_bf16(_mm512_extracti64x4_epi64(v, 1)));
      };
      for (int64_t m = begin; m < end; ++m) {
        int64_t i = m * blocks;
        for (; i + 16 <= (m + 1) * blocks; i += 16) {
          __m512 v[16];
          for (int64_t e = 0; e < 16; ++e) v[e] = block(i + e);
          _mm512_storeu_ps(sums.get() + i, reduce16(v));
        }
        for (; i < (m + 1) * blocks; ++i) sums[i] = _mm512_reduce_add_ps(block(i));
      }
    });
  }
};

// A task's panel of W rows [n, n + 48): pairs [K / 2][48] (bf16, panel_pack's layout but for
// the pairs' columns), and each block's steps and minimums [K / 32][48]; zeros past N.
struct Panel {
  std::vector<uint32_t> pairs;
  std::vector<float> steps, mins;
  uint64_t call = 0;   // which call's panel this is (int4_panel_linear numbers them) ...
  int64_t first = -1;  // ... and its first row: a thread's chunks of one panel decode it once

  void decode(const uint8_t* blob, const records::Layout& w, int64_t N, int64_t n) {
    const int64_t blocks = w.K / kBlock;
    pairs.resize(blocks * kPairs * kPanel);
    steps.resize(blocks * kPanel);
    mins.resize(blocks * kPanel);
    // A block's bytes of 16 rows (4 records of 4) into each byte p's word of every row, in two
    // rounds of byte permutes: per half of the records (rows [0, 8) and [8, 16)), byte
    // 8 pp + f of gather[h] is row f's byte 8 h + pp (it lies at 16 f + p of the pair of
    // records); then byte 4 f of byte p's word is row f's, from the halves' gathers.
    alignas(64) uint8_t order[3][64] = {};
    for (int f = 0; f < 8; ++f)
      for (int pp = 0; pp < 8; ++pp)
        for (int h = 0; h < 2; ++h)
          order[h][8 * pp + f] = static_cast<uint8_t>(16 * f + 8 * h + pp);
    for (int f = 0; f < 16; ++f) order[2][4 * f] = static_cast<uint8_t>(f < 8 ? f : 56 + f);
    const __m512i gather[2] = {_mm512_load_si512(order[0]), _mm512_load_si512(order[1])};
    __m512i spread[8];
    for (int pp = 0; pp < 8; ++pp)
      spread[pp] = _mm512_add_epi8(_mm512_load_si512(order[2]), _mm512_set1_epi8(8 * pp));
    constexpr __mmask64 kWords = 0x1111111111111111ULL;  // each word's low byte
    const __m256i values = (__m256i)_mm512_cvtneps_pbh(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i bf16 = _mm512_broadcast_i64x4(values);  // nibble -> its bf16, exact
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
    // Raw pointers: a vector store may alias anything, the vectors' own pointers included.
    uint32_t* out = pairs.data();
    float *step = steps.data(), *least = mins.data();
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t v = 0; v < kVectors; ++v) {
        __m512i z[4];
        for (int64_t q = 0; q < 4; ++q) {
          const int64_t f = n + 16 * v + 4 * q, rows = std::clamp<int64_t>(N - f, 0, 4);
          const int64_t at = b * kPanel + 16 * v + 4 * q;
          const uint8_t* rec = rows ? blob + w.offset(f, rows, b * kBlock) : blob;
          const auto real = static_cast<__mmask8>((1u << rows) - 1);
          const float* floats = reinterpret_cast<const float*>(rec + rows * kPairs);
          z[q] = _mm512_maskz_loadu_epi8(rows == 4 ? ~0ULL : (1ULL << (16 * rows)) - 1, rec);
          _mm_storeu_ps(step + at, _mm_maskz_loadu_ps(real, floats));
          _mm_storeu_ps(least + at, _mm_maskz_loadu_ps(real, floats + rows));
        }
        for (int64_t h = 0; h < 2; ++h) {
          const __m512i low = _mm512_permutex2var_epi8(z[0], gather[h], z[1]);
          const __m512i high = _mm512_permutex2var_epi8(z[2], gather[h], z[3]);
          for (int64_t pp = 0; pp < 8; ++pp) {
            const __m512i bytes = _mm512_maskz_permutex2var_epi8(kWords, low, spread[pp], high);
            // A byte c -> its word's halves (c & 15, c >> 4): (c | c << 12) & 0x000F000F.
            const __m512i split =
                _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12), nibbles, 0xA8);
            _mm512_storeu_si512(out + (b * kPairs + 8 * h + pp) * kPanel + 16 * v,
                                _mm512_permutexvar_epi16(split, bf16));
          }
        }
      }
  }
};

// rows x kPanel outputs: per block, rows x 3 fp32 pair dot products of x with the panel in
// registers, then scaled by the block's steps and added, with its minimums times x's block
// sums, into acc (in L1: the two sets would not fit the registers together). A row's sums run
// in the same order whatever the tile.
template <int rows>
void tile(const PairedX& x, int64_t m0, int64_t K, const Panel& w, at::BFloat16* out,
          int64_t ldo, int64_t cols) {
  const int64_t blocks = K / kBlock, ldp = K / 2;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.pairs.get()) + m0 * ldp;
  const float* xs = x.sums.get() + m0 * blocks;
  alignas(64) float acc[rows][kPanel];
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 sums[rows][kVectors];
    for (int m = 0; m < rows; ++m)
      for (int j = 0; j < kVectors; ++j) sums[m][j] = _mm512_setzero_ps();
    const uint32_t* panel = w.pairs.data() + b * kPairs * kPanel;
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512bh wv[kVectors];
      for (int j = 0; j < kVectors; ++j)
        wv[j] = (__m512bh)_mm512_loadu_si512(panel + p * kPanel + 16 * j);
      for (int m = 0; m < rows; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m * ldp + b * kPairs + p]);
        for (int j = 0; j < kVectors; ++j) sums[m][j] = _mm512_dpbf16_ps(sums[m][j], xv, wv[j]);
      }
    }
    for (int j = 0; j < kVectors; ++j) {
      const __m512 step = _mm512_loadu_ps(&w.steps[b * kPanel + 16 * j]);
      const __m512 least = _mm512_loadu_ps(&w.mins[b * kPanel + 16 * j]);
      for (int m = 0; m < rows; ++m) {
        float* a = acc[m] + 16 * j;
        const __m512 scaled =
            _mm512_fmadd_ps(sums[m][j], step, b ? _mm512_load_ps(a) : _mm512_setzero_ps());
        _mm512_store_ps(a, _mm512_fmadd_ps(least, _mm512_set1_ps(xs[m * blocks + b]), scaled));
      }
    }
  }
  for (int m = 0; m < rows; ++m)
    for (int j = 0; j < kVectors; ++j) {
      const int64_t left = std::clamp<int64_t>(cols - 16 * j, 0, 16);
      if (left == 0) break;
      _mm256_mask_storeu_epi16(out + m * ldo + 16 * j, static_cast<__mmask16>((1u << left) - 1),
                               (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc[m] + 16 * j)));
    }
}

using Tile = void (*)(const PairedX&, int64_t, int64_t, const Panel&, at::BFloat16*, int64_t,
                      int64_t);
constexpr Tile kTiles[kTileRows] = {tile<1>, tile<2>, tile<3>, tile<4>,
                                    tile<5>, tile<6>, tile<7>, tile<8>};
#endif

}  // namespace

bool int4_on_panels(at::ScalarType x, int64_t rows, int64_t activation_bits) {
  return SURGE_INT4_PANELS && x == at::kBFloat16 && activation_bits == 16 &&
         rows > dequant::kTile;
}

at::Tensor int4_panel_linear(const at::Tensor& x, const at::Tensor& blob) {
  TORCH_CHECK(int4_on_panels(x.scalar_type(), x.size(0), 16),
              "int4_panel_linear: a bf16 x past the decode tile, on AVX-512 BF16 and VBMI");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = blob.size(0);
  auto out = at::empty({M, N}, x.options());
#if SURGE_INT4_PANELS
  const records::Layout w = records::int4(K);
  const PairedX paired(xc.data_ptr<at::BFloat16>(), M, K);
  const uint8_t* bytes = blob.data_ptr<uint8_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  panels::for_tasks((N + kPanel - 1) / kPanel, M, [&](int64_t j, int64_t t0, int64_t t1, bool) {
    thread_local Panel panel;
    if (panel.call != call || panel.first != j * kPanel) {
      panel.decode(bytes, w, N, j * kPanel);
      panel.call = call;
      panel.first = j * kPanel;
    }
    const int64_t cols = std::min(kPanel, N - j * kPanel);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t * kTileRows, rows = std::min(kTileRows, M - m);
      kTiles[rows - 1](paired, m, K, panel, op + m * N + j * kPanel, N, cols);
    }
  });
#endif
  return out;
}
