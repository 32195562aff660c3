// int4 and int8 products on bf16 panels, for a bf16 x past a decode step at 16-bit
// activations, on AVX-512 BF16 with VBMI. A task decodes its panel of 48 W rows once a call into
// panels.cpp's layout, each weight q * step + min (int4) or q * scale (int8) in fp32, as the
// decode rows of int4.cpp and int8.cpp take it, rounded once to bf16: with a GGUF's fp16 steps
// and scales q * step and q * scale are exact in fp32 (+ min rounds once, as the loader's
// dequantization does), so these are the weights bf16 serving of the same file multiplies (its
// Q4_1 layers and Q8_0 head). x goes in as it is, and the tiles are the bf16 panels'
// (panels.h): int4 at 0.84-0.93x their speed at 64 rows with W in cache, the decode shared by
// fewer rows below. Over the tiles of a panel the next panel's records are prefetched: read as
// the decode met them they stalled it on memory (a decode step of 64 sequences 1.1x faster, of
// 8 1.35x). For int4, sums per block, scaled by each block's steps and plus its minimums times
// x's block sums, ran at 0.66-0.77x at 64 rows: rescaling 24 sums every 32 columns cost more
// than the decode to bf16 does.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "kernels.h"
#include "panels.h"
#include "records.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define SURGE_QUANT_PANELS 1
#else
#define SURGE_QUANT_PANELS 0
#endif

namespace {

#if SURGE_QUANT_PANELS
using panels::kPanel;
using panels::kTileRows;
using panels::kVectors;
using records::kBlock;
constexpr int64_t kPairs = kBlock / 2;  // pairs a block

// A decode: W rows [n, n + 48) of a blob of N rows into `out` in panel_pack's layout, pairs
// [K / 2][48] (bf16); zeros past N.
using Decode = void (*)(const uint8_t* blob, const records::Layout& w, int64_t N, int64_t n,
                        uint32_t* out);

// int4's records (int4.cpp): a row's 16 bytes of nibbles a block, then its steps and minimums.
void decode_int4(const uint8_t* blob, const records::Layout& w, int64_t N, int64_t n,
                 uint32_t* out) {
  const int64_t blocks = w.K / kBlock;
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

// m[i]'s lane j <- m[j]'s lane i: a 16 x 16 transpose of 32-bit lanes, within 128-bit lanes
// (rows by fours, each column of four rows), then of the 128-bit lanes.
inline void transpose16(__m512i (&m)[16]) {
  __m512i t[16];
  for (int g = 0; g < 16; g += 4) {
    const __m512i a = _mm512_unpacklo_epi32(m[g], m[g + 1]);
    const __m512i b = _mm512_unpackhi_epi32(m[g], m[g + 1]);
    const __m512i c = _mm512_unpacklo_epi32(m[g + 2], m[g + 3]);
    const __m512i d = _mm512_unpackhi_epi32(m[g + 2], m[g + 3]);
    // t[4 c + g / 4]'s 128-bit lane k: rows g..g + 3 of column 4 k + c.
    t[g / 4] = _mm512_unpacklo_epi64(a, c);
    t[4 + g / 4] = _mm512_unpackhi_epi64(a, c);
    t[8 + g / 4] = _mm512_unpacklo_epi64(b, d);
    t[12 + g / 4] = _mm512_unpackhi_epi64(b, d);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i* u = t + 4 * c;
    const __m512i x0 = _mm512_shuffle_i32x4(u[0], u[1], 0x44);  // lanes 0, 1 of each
    const __m512i x1 = _mm512_shuffle_i32x4(u[0], u[1], 0xEE);  // lanes 2, 3 of each
    const __m512i y0 = _mm512_shuffle_i32x4(u[2], u[3], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[2], u[3], 0xEE);
    m[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    m[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    m[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    m[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// int8's records (int8.cpp): a row's 32 values a block, then its scale. Each row's weights
// rounded to bf16 pairs (lane p: columns 2 p and 2 p + 1), then 16 rows' pairs transposed.
void decode_int8(const uint8_t* blob, const records::Layout& w, int64_t N, int64_t n,
                 uint32_t* out) {
  const int64_t blocks = w.K / kBlock;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t v = 0; v < kVectors; ++v) {
      __m512i rows[16];
      for (int64_t q = 0; q < 4; ++q) {
        const int64_t f = n + 16 * v + 4 * q, real = std::clamp<int64_t>(N - f, 0, 4);
        const int8_t* rec =
            real ? reinterpret_cast<const int8_t*>(blob + w.offset(f, real, b * kBlock)) : nullptr;
        for (int64_t r = 0; r < 4; ++r) {
          if (r >= real) {  // rows past N
            rows[4 * q + r] = _mm512_setzero_si512();
            continue;
          }
          const float* scales = reinterpret_cast<const float*>(rec + real * kBlock);
          const __m512 scale = _mm512_set1_ps(scales[r]);
          auto half = [&](int64_t at) {
            const __m128i q8 =
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + r * kBlock + at));
            return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), scale);
          };
          rows[4 * q + r] = (__m512i)_mm512_cvtne2ps_pbh(half(16), half(0));
        }
      }
      transpose16(rows);
      for (int64_t p = 0; p < kPairs; ++p)
        _mm512_storeu_si512(out + (b * kPairs + p) * kPanel + 16 * v, rows[p]);
    }
}

// Which call of the products a thread's panel is from (numbered, both formats in one count) and
// its first row: a thread's chunks of one panel decode it once.
std::atomic<uint64_t> calls{0};
struct Panel {
  std::vector<uint32_t> pairs;
  uint64_t call = 0;
  int64_t first = -1;
};

// x W^T for the blob's N rows in layout w, each task's panel decoded by `decode`.
at::Tensor product(const at::Tensor& x, const uint8_t* bytes, int64_t N, const records::Layout& w,
                   Decode decode) {
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto out = at::empty({M, N}, x.options());
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const uint64_t call = ++calls;
  const int64_t row_bytes = (K / kBlock) * w.row_bytes(), panel_bytes = kPanel * row_bytes;
  panels::for_tasks((N + kPanel - 1) / kPanel, M, [&](int64_t j, int64_t t0, int64_t t1,
                                                       bool last) {
    // The next panel's records come into L2 over this panel's tiles: the decode reads them as
    // 12 streams (a record a row block) that the hardware prefetcher does not keep ahead of.
    const panels::Spread ahead(last ? bytes + (j + 1) * panel_bytes : nullptr,
                               std::min(kPanel, N - (j + 1) * kPanel) * row_bytes,
                               K / 2, t1 - t0);
    thread_local Panel panel;
    if (panel.call != call || panel.first != j * kPanel) {
      panel.pairs.resize(K / 2 * kPanel);
      decode(bytes, w, N, j * kPanel, panel.pairs.data());
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
  return out;
}
#endif

}  // namespace

bool quant_on_panels(at::ScalarType x, int64_t rows, int64_t activation_bits) {
  return SURGE_QUANT_PANELS && x == at::kBFloat16 && activation_bits == 16 &&
         rows > dequant::kTile;
}

// x W^T for W as int4_pack or int8_pack packed it (the blob's dtype says which).
at::Tensor quant_panel_linear(const at::Tensor& x, const at::Tensor& blob) {
  TORCH_CHECK(quant_on_panels(x.scalar_type(), x.size(0), 16),
              "quant_panel_linear: a bf16 x past the decode tile, on AVX-512 BF16 and VBMI");
#if SURGE_QUANT_PANELS
  const auto* bytes = static_cast<const uint8_t*>(blob.data_ptr());
  const int64_t K = x.size(1);
  if (blob.scalar_type() == at::kByte)
    return product(x, bytes, blob.size(0), records::int4(K), decode_int4);
  return product(x, bytes, blob.size(0), records::int8(K), decode_int8);
#else
  return {};  // not reached: the check fails in these builds
#endif
}
