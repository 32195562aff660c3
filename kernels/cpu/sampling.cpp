// The greedy pick of each row of logits: the first index of its largest value (of its first
// NaN, if it has one), as torch.argmax picks it, in one pass of 16 lanes over the row (64 rows
// of a 49152-token vocabulary: PyTorch's reduction took 0.9 ms, most of the sampling).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  int64_t best = 0, i = 1;
  float top = x[0];
  bool nan = std::isnan(top);
#if defined(__AVX512F__)
  if (n >= 16) {
    // Per lane: the largest value so far and its first index (a later equal one never wins).
    __m512 tops = _mm512_loadu_ps(x);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = at;
    __mmask16 nans = _mm512_cmp_ps_mask(tops, tops, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
      const __mmask16 up = _mm512_cmp_ps_mask(v, tops, _CMP_GT_OQ);
      tops = _mm512_mask_mov_ps(tops, up, v);
      at = _mm512_mask_mov_epi32(at, up, index);
      nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    top = _mm512_reduce_max_ps(tops);
    const __mmask16 ties = _mm512_cmp_ps_mask(tops, _mm512_set1_ps(top), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(ties, at);
    nan = nans != 0;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {  // argmax's 16 lanes above, in 8
    __m256 tops = _mm256_loadu_ps(x);
    __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i index = at;
    __m256 nans = _mm256_cmp_ps(tops, tops, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
      const __m256 up = _mm256_cmp_ps(v, tops, _CMP_GT_OQ);
      tops = _mm256_blendv_ps(tops, v, up);
      at = _mm256_blendv_epi8(at, index, _mm256_castps_si256(up));
      nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lane_tops[8];
    alignas(32) int32_t lane_at[8];
    _mm256_store_ps(lane_tops, tops);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), at);
    top = *std::max_element(lane_tops, lane_tops + 8);
    best = n;
    for (int lane = 0; lane < 8; ++lane)
      if (lane_tops[lane] == top) best = std::min<int64_t>(best, lane_at[lane]);
    nan = _mm256_movemask_ps(nans) != 0;
  }
#endif
  for (; i < n; ++i) {
    if (x[i] > top) {
      top = x[i];
      best = i;
    }
    nan = nan || std::isnan(x[i]);
  }
  return nan ? first_nan(x, n) : best;
}

}  // namespace

// logits [B, V] float32 -> [B] int64.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0 &&
                  logits.device().is_cpu(),
              "argmax_rows: float32 logits [B, V] on the CPU");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * n, n);
  });
  return out;
}
