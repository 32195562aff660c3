// int4 products on bf16 panels, for a bf16 x past a decode step at 16-bit activations, on
// AVX-512 BF16 with VBMI. A task decodes its panel of 48 W rows once a call into
// panels.cpp's layout, each weight q * step + min in fp32 (as int4.cpp's decode rows take it)
// rounded once to bf16: with a GGUF's fp16 steps q * step is exact, so these are the weights
// bf16 serving of the same file multiplies. x goes in as it is, and the tiles are the bf16
// panels' (panels.h): 0.84-0.93x their speed at 64 rows, the decode shared by fewer rows below
// (about 0.5x at 8). Over the tiles of a panel the next panel's records are prefetched: read
// as the decode met them they stalled it on memory (a decode step of 64 sequences 1.1x
// faster, of 8 1.35x). Sums per block, scaled by each block's steps and plus its minimums times
// x's block sums, ran at 0.66-0.77x at 64 rows: rescaling 24 sums every 32 columns cost more
// than the decode to bf16 does.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "panels.h"
#include "records.h"

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

// A task's panel of W rows [n, n + 48) in panel_pack's layout, pairs [K / 2][48] (bf16); zeros
// past N.
struct Panel {
  std::vector<uint32_t> pairs;
  uint64_t call = 0;   // which call's panel this is (int4_panel_linear numbers them) ...
  int64_t first = -1;  // ... and its first row: a thread's chunks of one panel decode it once

  void decode(const uint8_t* blob, const records::Layout& w, int64_t N, int64_t n) {
    const int64_t blocks = w.K / kBlock;
    pairs.resize(blocks * kPairs * kPanel);
    // A block's bytes of 16 rows (4 records of 4) into words in two rounds of byte permutes:
    // per half of the records (rows [0, 8) and [8, 16)), byte 8 pp + f of gather[h] is row f's
    // byte 8 h + pp (it lies at 16 f + p of the pair of records); then, for an even byte p,
    // the low byte of word 2 f + e of spread[pp / 2][s] is row 8 s + f's byte p + e, from the
    // halves' gathers: 8 rows' bytes p and p + 1 in panel_pack's pair order.
    alignas(64) uint8_t order[2][64] = {};
    for (int f = 0; f < 8; ++f)
      for (int pp = 0; pp < 8; ++pp)
        for (int h = 0; h < 2; ++h)
          order[h][8 * pp + f] = static_cast<uint8_t>(16 * f + 8 * h + pp);
    const __m512i gather[2] = {_mm512_load_si512(order[0]), _mm512_load_si512(order[1])};
    __m512i spread[4][2];
    for (int pp = 0; pp < 8; pp += 2)
      for (int s = 0; s < 2; ++s) {
        alignas(64) uint8_t bytes[64] = {};
        for (int f = 0; f < 8; ++f)
          for (int e = 0; e < 2; ++e)
            bytes[4 * (2 * f + e)] = static_cast<uint8_t>(64 * s + 8 * (pp + e) + f);
        spread[pp / 2][s] = _mm512_load_si512(bytes);
      }
    constexpr __mmask64 kWords = 0x1111111111111111ULL;  // each word's low byte
    // Each row's step and minimum for both words of its pair: lanes (2 i, 2 i + 1) <- i.
    const __m512i twice[2] = {
        _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
        _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)};
    // A word's low nibble as a float: the lookup reads an index's low 4 bits only.
    const __m512 nibble =
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    uint32_t* out = pairs.data();
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t v = 0; v < kVectors; ++v) {
        __m512i z[4];
        // The 16 rows' steps and minimums, record q's into lanes [4 q, 4 q + 4): a masked load
        // from 4 q floats before them reads only those lanes (and no stack round trip, whose
        // narrow stores a wide load cannot forward).
        __m512 steps = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
        for (int64_t q = 0; q < 4; ++q) {
          const int64_t f = n + 16 * v + 4 * q, rows = std::clamp<int64_t>(N - f, 0, 4);
          z[q] = _mm512_setzero_si512();
          if (rows == 0) continue;  // rows past N: zeros
          const uint8_t* rec = blob + w.offset(f, rows, b * kBlock);
          const auto lanes = static_cast<__mmask16>(((1u << rows) - 1) << (4 * q));
          const float* floats = reinterpret_cast<const float*>(rec + rows * kPairs) - 4 * q;
          z[q] = _mm512_maskz_loadu_epi8(rows == 4 ? ~0ULL : (1ULL << (16 * rows)) - 1, rec);
          steps = _mm512_mask_loadu_ps(steps, lanes, floats);
          mins = _mm512_mask_loadu_ps(mins, lanes, floats + rows);
        }
        __m512 step[2], least[2];
        for (int s = 0; s < 2; ++s) {
          step[s] = _mm512_permutexvar_ps(twice[s], steps);
          least[s] = _mm512_permutexvar_ps(twice[s], mins);
        }
        // Pair `pair` of the block: rows [0, 8) from a's floats, [8, 16) from c's, each
        // q * step + min rounded once to bf16.
        auto store = [&](int64_t pair, __m512 a, __m512 c) {
          const __m512 wa = _mm512_fmadd_ps(a, step[0], least[0]);
          const __m512 wc = _mm512_fmadd_ps(c, step[1], least[1]);
          _mm512_storeu_si512(out + (b * kPairs + pair) * kPanel + 16 * v,
                              (__m512i)_mm512_cvtne2ps_pbh(wc, wa));
        };
        auto high = [](__m512i bytes) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)); };
        for (int64_t h = 0; h < 2; ++h) {
          const __m512i top = _mm512_permutex2var_epi8(z[0], gather[h], z[1]);
          const __m512i bottom = _mm512_permutex2var_epi8(z[2], gather[h], z[3]);
          for (int64_t pp = 0; pp < 8; pp += 2) {
            const __m512i a =
                _mm512_maskz_permutex2var_epi8(kWords, top, spread[pp / 2][0], bottom);
            const __m512i c =
                _mm512_maskz_permutex2var_epi8(kWords, top, spread[pp / 2][1], bottom);
            // Bytes k and k + 1: low nibbles columns k and k + 1 (pair k / 2), high ones
            // k + 16 and k + 17.
            const int64_t k = 8 * h + pp;
            store(k / 2, _mm512_permutexvar_ps(a, nibble), _mm512_permutexvar_ps(c, nibble));
            store(kPairs / 2 + k / 2, high(a), high(c));
          }
        }
      }
  }
};
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
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const uint8_t* bytes = blob.data_ptr<uint8_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  const int64_t panel_bytes = kPanel * (K / kBlock) * w.row_bytes();  // a panel's records
  panels::for_tasks((N + kPanel - 1) / kPanel, M, [&](int64_t j, int64_t t0, int64_t t1,
                                                       bool last) {
    // The next panel's records come into L2 over this panel's tiles: the decode reads them as
    // 12 streams (a record a row block) that the hardware prefetcher does not keep ahead of.
    const panels::Spread ahead(last ? bytes + (j + 1) * panel_bytes : nullptr,
                               std::min(panel_bytes, (N - (j + 1) * kPanel) * panel_bytes / kPanel),
                               K / 2, t1 - t0);
    thread_local Panel panel;
    if (panel.call != call || panel.first != j * kPanel) {
      panel.decode(bytes, w, N, j * kPanel);
      panel.call = call;
      panel.first = j * kPanel;
    }
    const int64_t cols = std::min(kPanel, N - j * kPanel);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t * kTileRows, rows = std::min(kTileRows, M - m);
      panels::kTiles[rows - 1](xp + m * K, K, panel.pairs.data(), K / 2, op + m * N + j * kPanel,
                               N, cols, ahead.from(t - t0), ahead.lines_of(t - t0), ahead.every);
    }
  });
#endif
  return out;
}
