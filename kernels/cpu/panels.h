// The panel layout's shape and its task split, shared by the bf16 panel products (panels.cpp)
// and int4's, which decodes its nibbles into the same panels (int4_panels.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace panels
