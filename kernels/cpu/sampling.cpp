// The greedy pick of each row of logits: the first index of its largest value (of its first
// NaN, if it has one), as torch.argmax picks it, in one pass of 16 lanes over the row (64 rows
// of a 49152-token vocabulary: PyTorch's reduction took 0.9 ms, most of the sampling).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

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
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0 &&
                  logits.device().is_cpu(),
              "argmax_rows: float32 logits [B, V] on the CPU");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * n, n);
  });
  return out;
}

namespace {

// gpu_workers/sampler.py's counter-based noise, bit for bit (its int64 tensors masked to 32
// bits are uint32 arithmetic).
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x45D9F3Bu;
  x ^= x >> 16;
  x *= 0x2C1B3C6Du;
  x ^= x >> 15;
  x *= 0x297A2D39u;
  return x ^ (x >> 16);
}

inline uint32_t row_key(int64_t seed, int64_t position) {
  const auto s = static_cast<uint64_t>(seed);
  return hash32(hash32(static_cast<uint32_t>(s)) ^ hash32(static_cast<uint32_t>(s >> 32)) * 0x2Fu ^
                static_cast<uint32_t>(position) * 0x9E3779B1u);
}

// u in (0, 1) for token `id` of the row (23 bits plus a half step).
inline float uniform(uint32_t key, int64_t id) {
  const uint32_t bits = hash32(key + static_cast<uint32_t>(id) * 0x3C6EF372u);
  return (static_cast<float>(bits >> 9) + 0.5f) / static_cast<float>(1 << 23);
}

// Tokens further than this below the top (in logits / T) are left out: the least noise
// divisor, -log(1 - 2^-24), cannot lift one past the top token (e^-30 / 6e-8 < 1 / 16.6, the
// top's worst), and together they weigh under e^-30 * V of the top's mass, below fp32's step.
constexpr float kSpan = 30.0f;

struct Candidate {
  float x;  // logit / T
  float e;  // e^(x - top's x): the weight, unnormalized
  int64_t id;
};

// Largest first; equal values in token order.
inline bool before(const Candidate& a, const Candidate& b) {
  return a.x > b.x || (a.x == b.x && a.id < b.id);
}

// top-p's cut: the end of the tokens, largest first, each kept while the weight before it is
// under `target`. A weighted quickselect (partition, sum the upper part's weight, go on in the
// side holding the cut) finds it in linear time where sorting 49152 tokens took most of a step.
std::vector<Candidate>::iterator top_p_end(std::vector<Candidate>::iterator lo,
                                           std::vector<Candidate>::iterator hi, double target) {
  double mass = 0;  // the weight of the tokens above [lo, hi)
  while (hi - lo > 32) {
    Candidate pivot = *(lo + (hi - lo) / 2);
    const auto mid = std::partition(lo, hi, [&](const Candidate& c) { return before(c, pivot); });
    double upper = 0;
    for (auto c = lo; c != mid; ++c) upper += c->e;
    if (mass + upper >= target) {
      hi = mid;
    } else {
      mass += upper;
      lo = mid;
      // The pivot itself is the lower part's first: its turn is next.
      std::iter_swap(lo, std::find_if(lo, hi, [&](const Candidate& c) { return c.id == pivot.id; }));
      if (mass >= target) return lo;
      mass += lo->e;
      ++lo;
    }
  }
  std::sort(lo, hi, before);
  for (; lo != hi && mass < target; ++lo) mass += lo->e;
  return lo;
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 lanes of hash32.
inline __m256i hash8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x45D9F3B));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x2C1B3C6D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x297A2D39));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// The race over a whole row, 8 tokens at a time (no top-k or top-p: every token takes part):
// weights e^(x - m), noise and its logarithm in vectors, the first largest score per lane.
int64_t race_row(const float* logits, int64_t V, float T, float m, float min_p, uint32_t key) {
  const __m256 t = _mm256_set1_ps(T), top = _mm256_set1_ps(m);
  __m256 best = _mm256_set1_ps(-1.0f);
  __m256i at = _mm256_setzero_si256();
  __m256i ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(logits + i), t);
    const __m256 e = exp8(_mm256_sub_ps(x, top));
    const __m256i bits = hash8(_mm256_add_epi32(
        _mm256_set1_epi32(static_cast<int>(key)),
        _mm256_mullo_epi32(ids, _mm256_set1_epi32(0x3C6EF372))));
    const __m256 u = _mm256_mul_ps(
        _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 9)), _mm256_set1_ps(0.5f)),
        _mm256_set1_ps(1.0f / (1 << 23)));
    __m256 score = _mm256_div_ps(e, _mm256_sub_ps(_mm256_setzero_ps(), log8(u)));
    score = _mm256_blendv_ps(score, _mm256_set1_ps(-1.0f),
                             _mm256_cmp_ps(e, _mm256_set1_ps(min_p), _CMP_LT_OQ));
    const __m256 up = _mm256_cmp_ps(score, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, score, up);
    at = _mm256_blendv_epi8(at, ids, _mm256_castps_si256(up));
    ids = _mm256_add_epi32(ids, _mm256_set1_epi32(8));
  }
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_at[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), at);
  float best_score = -1.0f;
  int64_t pick = -1;
  for (int lane = 0; lane < 8; ++lane)
    if (lane_best[lane] > best_score || (lane_best[lane] == best_score && lane_at[lane] < pick)) {
      best_score = lane_best[lane];
      pick = lane_at[lane];
    }
  for (; i < V; ++i) {  // the last few tokens
    const float e = std::exp(logits[i] / T - m);
    const float score = e < min_p ? -1.0f : e / -std::log(uniform(key, i));
    if (score > best_score) {
      best_score = score;
      pick = i;
    }
  }
  return pick;
}
#endif

// take(x, e^(x - m), id) for each token whose x = logit / T is at least `floor`.
template <typename Take>
void near_tokens(const float* logits, int64_t V, float T, float m, float floor, Take take) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= V; i += 8) {  // 8 tokens' test at once, and their weights in a vector
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(logits + i), _mm256_set1_ps(T));
    int near = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(floor), _CMP_GE_OQ));
    if (near == 0) continue;
    alignas(32) float xs[8], es[8];
    _mm256_store_ps(xs, x);
    _mm256_store_ps(es, exp8(_mm256_sub_ps(x, _mm256_set1_ps(m))));
    for (; near != 0; near &= near - 1) {
      const int lane = __builtin_ctz(near);
      take(xs[lane], es[lane], i + lane);
    }
  }
#endif
  for (; i < V; ++i) {
    const float x = logits[i] / T;
    if (x >= floor) take(x, std::exp(x - m), i);
  }
}

// The random pick of one row (see random_pick), -1 where it has none.
int64_t pick_row(const float* logits, int64_t V, float T, int64_t top_k, float top_p,
                 float min_p, uint32_t key, std::vector<Candidate>& cand,
                 std::vector<float>& scratch) {
  if (!(T > 0)) return -1;
  // Dividing by T > 0 keeps the order: the largest logits / T. Not finite (a NaN, every token
  // masked, or a logit past float's range once divided): no distribution, as the reference's
  // softmax gives none.
  const float m = logits[argmax_row(logits, V)] / T;
  if (!std::isfinite(m)) return -1;
#if defined(__AVX2__) && defined(__FMA__)
  if ((top_k <= 0 || top_k >= V) && !(top_p < 1)) return race_row(logits, V, T, m, min_p, key);
#endif
  float floor = m - kSpan;
  if (top_k > 0 && top_k < V) {
    // The k-th largest value stays, with every token equal to it (smaller ones are dropped):
    // found among the values alone, so that only the kept tokens become candidates.
    scratch.clear();
    near_tokens(logits, V, T, m, floor, [&](float x, float, int64_t) { scratch.push_back(x); });
    if (top_k < static_cast<int64_t>(scratch.size())) {
      std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(),
                       std::greater<float>());
      floor = scratch[top_k - 1];
    }
  }
  cand.clear();
  near_tokens(logits, V, T, m, floor,
              [&](float x, float e, int64_t id) { cand.push_back({x, e, id}); });
  auto end = cand.end();
  if (top_p < 1) {
    double total = 0;
    for (auto c = cand.begin(); c != end; ++c) total += c->e;
    end = top_p_end(cand.begin(), end, top_p * total);
  }
  // min_p against the top token, whose weight is e^0 = 1: the total cancels.
  int64_t best = -1;
  float best_score = -1;
  for (auto c = cand.begin(); c != end; ++c) {
    if (min_p > 0 && c->e < min_p) continue;
    // The exponential race: argmax of p / E, E = -log(u) ~ Exp(1), draws from p.
    const float score = c->e / -std::log(uniform(key, c->id));
    if (score > best_score || (score == best_score && c->id < best)) {
      best_score = score;
      best = c->id;
    }
  }
  return best;
}

}  // namespace

// The random pick of each row: temperature, top-k, top-p and min-p as gpu_workers/sampler.py
// filters the logits, then the exponential race on the same noise, over the tokens near the top
// only (a few hundred where the reference sorts and races all 49152); -1 where a row has no
// pick (temperature 0, NaN or fully masked logits). Tokens differ from the reference's only
// where two candidates' scores tie within float rounding.
at::Tensor random_pick(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p, const at::Tensor& seeds,
                       const at::Tensor& positions) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0 &&
                  logits.device().is_cpu(),
              "random_pick: float32 logits [B, V] on the CPU");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), V = x.size(1);
  auto t = temperature.to(at::kFloat).contiguous(), p = top_p.to(at::kFloat).contiguous();
  auto mp = min_p.to(at::kFloat).contiguous(), k = top_k.to(at::kLong).contiguous();
  auto s = seeds.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(t.numel() == rows && p.numel() == rows && mp.numel() == rows && k.numel() == rows &&
                  s.numel() == rows && pos.numel() == rows,
              "random_pick: one temperature, top_k, top_p, min_p, seed and position a row");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* lp = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> cand;
    std::vector<float> scratch;
    for (int64_t r = begin; r < end; ++r)
      o[r] = pick_row(lp + r * V, V, t.data_ptr<float>()[r], k.data_ptr<int64_t>()[r],
                      p.data_ptr<float>()[r], mp.data_ptr<float>()[r],
                      row_key(s.data_ptr<int64_t>()[r], pos.data_ptr<int64_t>()[r]), cand,
                      scratch);
  });
  return out;
}
