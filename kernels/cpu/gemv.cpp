// Small-M products y = x W^T for decode steps (M up to ~16 rows of x). At this size the time is
// W's bytes over the memory bandwidth, so W is read exactly once a call: each task takes a few
// of W's rows and every row of x reuses each loaded W vector while it is in registers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "dequant_product.h"
#include "vec_math.h"

namespace {

// Output features per task: their W vectors stay in registers while x's rows pass over them
// (the sums too: dequant::zero_sums and store_sums).
constexpr int64_t kRows = dequant::kRows;
// Bytes ahead of each W row's loads that are prefetched: a decode step streams every weight
// from memory, and four short interleaved rows a task do not wake the hardware prefetcher
// early enough (a model's worth of 576 x 3072 weights at one row: 1.2x with it, on a par with
// oneDNN's packed GEMV; 1 KB and 2 KB ahead gained less, 8 KB no more).
constexpr int64_t kAhead = 4096;
// x rows per pass: kRows x kTile accumulators (16) + kRows W vectors + one x vector fit in the
// 32 AVX-512 registers.
constexpr int64_t kTile = 4;

#if defined(__AVX512BF16__)
// 32 bf16 of a row from k; past `k_end` the lanes read as 0 (a masked load never touches them).
inline __m512bh load32(const at::BFloat16* p, int64_t k, int64_t k_end) {
  const int64_t left = k_end - k;
  const __mmask32 mask = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p + k);
}

// rows x `tile` dot products over K with the AVX-512 BF16 pair dot product (fp32 sums).
template <int64_t tile>
void dot_block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw,
               int64_t rows, int64_t K, at::BFloat16* out, int64_t ldo) {
  __m512 acc[tile][kRows];
  dequant::zero_sums(acc);
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[kRows];
    for (int64_t r = 0; r < kRows; ++r)  // past a row's end this reads ahead into the next
      _mm_prefetch(reinterpret_cast<const char*>(w + r * ldw + k) + kAhead, _MM_HINT_T0);
    for (int64_t r = 0; r < kRows; ++r)
      wv[r] = r < rows ? load32(w + r * ldw, k, K) : (__m512bh)_mm512_setzero_si512();
    for (int64_t m = 0; m < tile; ++m) {
      const __m512bh xv = load32(x + m * ldx, k, K);
      for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  dequant::store_sums(acc, rows, out, ldo);
}
#elif defined(__AVX2__) && defined(__FMA__)
// 8 bf16 of a row from k, widened to fp32; lanes past k_end read as 0.
inline __m256 load8(const at::BFloat16* p, int64_t k, int64_t k_end) {
  if (k_end - k >= 8) return ::load8(p + k);
  at::BFloat16 tail[8] = {};
  std::copy(p + k, p + k_end, tail);
  return ::load8(tail);
}

template <int64_t tile>
void dot_block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw,
               int64_t rows, int64_t K, at::BFloat16* out, int64_t ldo) {
  __m256 acc[tile][kRows];
  dequant::zero_sums(acc);
  for (int64_t k = 0; k < K; k += 8) {
    // Once a cache line, the rows dequant::kAheadRows ahead (past W's end a hint never
    // faults): on an AVX2-only AMD EPYC, 1.2-1.35x over none for 960-49152 x 576 from memory, where
    // kAhead's bytes ahead gained at K = 576 but lost at K = 1536 (inside the task's rows).
    if (k % 32 == 0)
      for (int64_t r = 0; r < kRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + dequant::kAheadRows) * ldw + k),
                     _MM_HINT_T0);
    __m256 wv[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      wv[r] = r < rows ? load8(w + r * ldw, k, K) : _mm256_setzero_ps();
    for (int64_t m = 0; m < tile; ++m) {
      const __m256 xv = load8(x + m * ldx, k, K);
      for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  dequant::store_sums(acc, rows, out, ldo);
}
#else
template <int64_t tile>
void dot_block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw,
               int64_t rows, int64_t K, at::BFloat16* out, int64_t ldo) {
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        s += static_cast<float>(x[m * ldx + k]) * static_cast<float>(w[r * ldw + k]);
      out[m * ldo + r] = at::BFloat16(s);
    }
}
#endif

// W in bf16 as the model holds it, for dequant::product: widening a bf16 to fp32 is exact.
struct BF16W {
  const at::BFloat16* w;
  int64_t K;

  void prefetch(int64_t, int64_t) const {}  // one row at a time: the hardware prefetcher's pace
#if defined(__AVX512F__)
  template <int64_t rows>
  void load(int64_t n, int64_t k, __m512* lo, __m512* hi) const {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i bits = _mm512_loadu_si512(w + (n + r) * K + k);
      lo[r] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
      hi[r] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  void load(int64_t n, int64_t, int64_t r, int64_t k, __m256 (&v)[4]) const {
    for (int64_t e = 0; e < 4; ++e) v[e] = ::load8(w + (n + r) * K + k + 8 * e);
  }
#else
  void load(int64_t n, int64_t, int64_t r, int64_t k, float* out) const {
    for (int64_t i = 0; i < 32; ++i) out[i] = static_cast<float>(w[(n + r) * K + k + i]);
  }
#endif
};

}  // namespace

// The ISA the products were built for (-march=native picks it per machine at install).
std::string gemv_isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "small_m_linear takes bfloat16 x and weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_m_linear: x [M, K] and weight [N, K]");
  auto xc = x.contiguous(), wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  // Each sum is rounded to bf16 once, from fp32, as oneDNN's bf16 product rounds it.
  auto out = at::empty({M, N}, x.options());
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = wc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t blocks = (N + kRows - 1) / kRows;
  // Grain 16 blocks (64 rows of W): enough work per task to hide the scheduling, while the
  // smallest projections (576 rows) still spread over every thread.
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kRows, rows = std::min(kRows, N - n);
      int64_t m = 0;
      for (; m + kTile <= M; m += kTile)
        dot_block<kTile>(xp + m * K, K, wp + n * K, K, rows, K, op + m * N + n, N);
      const at::BFloat16* xm = xp + m * K;
      at::BFloat16* om = op + m * N + n;
      switch (M - m) {
        case 3: dot_block<3>(xm, K, wp + n * K, K, rows, K, om, N); break;
        case 2: dot_block<2>(xm, K, wp + n * K, K, rows, K, om, N); break;
        case 1: dot_block<1>(xm, K, wp + n * K, K, rows, K, om, N); break;
        default: break;
      }
    }
  });
  return out;
}

// x W^T for bf16 x and W of any rows, each task's W rows widened to fp32 once (dequant::product;
// past dequant::kWidenRows rows, all of W for MKL) and the sums fp32, each rounded to bf16 once:
// where oneDNN has no bf16 path (AVX2-only CPUs) PyTorch's own bf16 GEMM is 4-10x slower than
// this past a few rows.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_linear takes bfloat16 x and weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) &&
                  x.size(1) % 32 == 0,
              "bf16_linear: x [M, K] and weight [N, K], K a multiple of 32");
  auto wc = weight.contiguous();
  return dequant::linear(x, BF16W{wc.data_ptr<at::BFloat16>(), x.size(1)}, weight.size(0));
}

int64_t widen_rows() { return dequant::kWidenRows; }
