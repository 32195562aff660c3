// The panel layout's shape, its task split and its tile, shared by the bf16 panel products
// (panels.cpp) and int4's and int8's, which decode their weights into the same panels
// (quant_panels.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace panels {

constexpr int64_t kVectors = 3;              // W vectors a k-pair of a panel
constexpr int64_t kPanel = 16 * kVectors;    // output features a panel
constexpr int64_t kTileRows = 8;             // rows of x a tile: 8 x 3 sums in registers
// Rows of x a task takes at most: its tiles' x (K = 4096: 2 MB at 256 rows) stays in L2 while
// the panel passes over it.
constexpr int64_t kChunkRows = 256;

// Runs task(unit, t0, t1, last) over (unit, chunk of row tiles) pairs: a unit is a panel, or a
// gate panel and its up panel. A unit's chunks lie next to each other so that a thread reads
// each of its panels from memory once: chunks of kChunkRows, and more where there are too few
// units to keep every thread busy. `last`: the thread's next task reads unit + 1.
template <typename Task>
void for_tasks(int64_t units, int64_t M, const Task& task) {
  if (units == 0 || M == 0) return;  // nothing to compute (and no division by zero)
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t busy = (2 * at::get_num_threads() + units - 1) / units;
  const int64_t chunks = std::min(tiles, std::max((M + kChunkRows - 1) / kChunkRows, busy));
  const int64_t chunk_tiles = (tiles + chunks - 1) / chunks;
  at::parallel_for(0, units * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j = t / chunks, c = t % chunks;
      const int64_t t0 = c * chunk_tiles, t1 = std::min(tiles, t0 + chunk_tiles);
      if (t0 < t1) task(j, t0, t1, c == chunks - 1 && t + 1 < end && j + 1 < units);
    }
  });
}

#if defined(__AVX512BF16__)
// rows x kPanel sums over the panel's kp pairs; `cols` of them are stored (the last panel's
// are fewer). Along the way `count` cache lines from `ahead` are prefetched into L2, `every` a
// pair: the thread's next panel, spread over this panel's tiles.
template <int rows>
void tile(const at::BFloat16* x, int64_t K, const uint32_t* panel, int64_t kp,
          at::BFloat16* out, int64_t ldo, int64_t cols, const char* ahead, int64_t count,
          int64_t every) {
  __m512 acc[rows][kVectors];
  for (int m = 0; m < rows; ++m)
    for (int j = 0; j < kVectors; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* pairs = reinterpret_cast<const int32_t*>(x);  // x's (k, k + 1), K even
  const int64_t ldp = K / 2;
  for (int64_t p = 0; p < kp; ++p) {
    for (int64_t i = 0; i < every && count > 0; ++i, --count, ahead += 64)
      _mm_prefetch(ahead, _MM_HINT_T1);
    __m512bh w[kVectors];
    for (int j = 0; j < kVectors; ++j)
      w[j] = (__m512bh)_mm512_loadu_si512(panel + p * kPanel + 16 * j);
    for (int m = 0; m < rows; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pairs[m * ldp + p]);
      for (int j = 0; j < kVectors; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b, w[j]);
    }
  }
  // Each sum rounded to bf16 once, to nearest even, as oneDNN's bf16 product rounds it.
  for (int m = 0; m < rows; ++m)
    for (int j = 0; j < kVectors; ++j) {
      const int64_t left = std::clamp<int64_t>(cols - 16 * j, 0, 16);
      if (left == 0) break;
      _mm256_mask_storeu_epi16(out + m * ldo + 16 * j, static_cast<__mmask16>((1u << left) - 1),
                               (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
    }
}

// A region's cache lines (the thread's next panel) spread over a task's n tiles of kp pairs:
// tile i prefetches its share, `every` a pair (none where `region` is null).
struct Spread {
  const char* lines;
  int64_t count, share, every;

  Spread(const void* region, int64_t bytes, int64_t kp, int64_t n)
      : lines(static_cast<const char*>(region)), count(region ? (bytes + 63) / 64 : 0),
        share((count + n - 1) / n), every((share + kp - 1) / kp) {}
  const char* from(int64_t i) const { return lines + i * share * 64; }
  int64_t lines_of(int64_t i) const { return std::clamp<int64_t>(count - i * share, 0, share); }
};

using Tile = void (*)(const at::BFloat16*, int64_t, const uint32_t*, int64_t, at::BFloat16*,
                      int64_t, int64_t, const char*, int64_t, int64_t);
constexpr Tile kTiles[kTileRows] = {tile<1>, tile<2>, tile<3>, tile<4>,
                                    tile<5>, tile<6>, tile<7>, tile<8>};

#endif

}  // namespace panels
