// bf16 products y = x W^T on W repacked once into panels of 48 output features, K's pairs
// interleaved: [N / 48 (rounded up)][K / 2][48][2], the AVX-512 BF16 pair dot product's operand
// order. Each k-pair of a panel is three vectors; a tile of up to 8 rows of x broadcasts its
// pair and sums 8 x 48 outputs in 24 registers, so nothing is reduced across lanes and every
// loaded W vector serves 8 rows. A thread walks its panels in order, prefetching the next one
// into L2 while this one computes: a decode step's W comes from memory, and oneDNN's blocked
// GEMM (which this replaces on AVX-512 BF16 CPUs without AMX) stalls on it
// (bench.cpu_backend_step --against onednn). panel_silu_linear runs a gate panel and its up
// panel in one task and stores SiLU(gate) * up, the MLP's activation, straight from the tiles.
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "panels.h"
#include "silu.h"

namespace {

using panels::for_tasks;
using panels::kPanel;
using panels::kTileRows;

#if defined(__AVX512BF16__)
using panels::kTiles;
using panels::Spread;
#endif

}  // namespace

bool panels_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// W [N, K] (bf16, K even) -> its panels [N / 48 rounded up, K / 2, 48, 2], features past N zero.
at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.size(1) % 2 == 0,
              "panel_pack takes a bfloat16 weight [N, K] with K even");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  return at::constant_pad_nd(weight, {0, 0, 0, panels * kPanel - N})
      .view({panels, kPanel, K / 2, 2})
      .permute({0, 2, 1, 3})
      .contiguous();
}

// x [M, K] W^T for W as panel_pack packed it (n: W's rows), fp32 sums; each row's bits are the
// same at any M (its sums run over K in one order whatever the tile).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(panels_available(), "panel_linear needs AVX-512 BF16 (this build has none)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && panels.dim() == 4 &&
                  panels.size(2) == kPanel && x.size(1) == 2 * panels.size(1) &&
                  n <= panels.size(0) * kPanel && n > (panels.size(0) - 1) * kPanel,
              "panel_linear: x [M, K] and panels as panel_pack made them for K and n rows");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = panels.size(0), kp = K / 2;
  auto out = at::empty({M, n}, x.options());
#if defined(__AVX512BF16__)
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = reinterpret_cast<const uint32_t*>(panels.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t panel = kp * kPanel;
  for_tasks(P, M, [&](int64_t j, int64_t t0, int64_t t1, bool last) {
    const Spread ahead(last ? wp + (j + 1) * panel : nullptr, panel * 4, kp, t1 - t0);
    const int64_t cols = std::min(kPanel, n - j * kPanel);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t * kTileRows, rows = std::min(kTileRows, M - m);
      kTiles[rows - 1](xp + m * K, K, wp + j * panel, kp, op + m * n + j * kPanel, n, cols,
                       ahead.from(t - t0), ahead.lines_of(t - t0), ahead.every);
    }
  });
#endif
  return out;
}

// Whether panel_silu_linear takes gate_up's panels for n rows: its gate and up halves each a
// whole number of panels, so that gate panel j and up panel j hold the same features.
bool panel_silu_fits(const at::Tensor& panels, int64_t n) {
  return panels_available() && n % (2 * kPanel) == 0 && panels.size(0) * kPanel == n;
}

// SiLU(x G^T) * (x U^T) for gate_up = [G | U] as panel_pack packed it (n rows, see
// panel_silu_fits): panel_linear's products, each tile's gate and up sums rounded to bf16 as
// panel_linear stores them, then silu_mul's arithmetic on them as they are stored: the bits of
// silu_mul(panel_linear(x, gate_up, n)) without the [M, n] pass between them.
at::Tensor panel_silu_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(panel_silu_fits(panels, n) && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.size(1) == 2 * panels.size(1),
              "panel_silu_linear: x [M, K] and gate_up's panels as panel_pack made them, each "
              "half a whole number of panels");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), half = panels.size(0) / 2, kp = K / 2;
  const int64_t width = n / 2;
  auto out = at::empty({M, width}, x.options());
#if defined(__AVX512BF16__)
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = reinterpret_cast<const uint32_t*>(panels.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t panel = kp * kPanel;
  for_tasks(half, M, [&](int64_t j, int64_t t0, int64_t t1, bool last) {
    const uint32_t *gate = wp + j * panel, *up = wp + (j + half) * panel;
    // The up panel comes in over the gate tiles, the next gate panel over the up tiles.
    const Spread up_ahead(up, panel * 4, kp, t1 - t0),
        next(last ? gate + panel : nullptr, panel * 4, kp, t1 - t0);
    at::BFloat16 g[kTileRows * kPanel], u[kTileRows * kPanel];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t * kTileRows, rows = std::min(kTileRows, M - m), i = t - t0;
      kTiles[rows - 1](xp + m * K, K, gate, kp, g, kPanel, kPanel, up_ahead.from(i),
                       up_ahead.lines_of(i), up_ahead.every);
      kTiles[rows - 1](xp + m * K, K, up, kp, u, kPanel, kPanel, next.from(i), next.lines_of(i),
                       next.every);
      for (int64_t r = 0; r < rows; ++r)
        silu_mul_row(g + r * kPanel, u + r * kPanel, op + (m + r) * width + j * kPanel, kPanel);
    }
  });
#endif
  return out;
}
