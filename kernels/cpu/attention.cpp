// Paged attention on the CPU, reading K/V blocks where they lie in the cache (no gather copy).
// Every query row carries its own sequence (a block table row) and how many keys it sees, so one
// kernel serves decode rows and prefill chunks alike. A (query, KV head) pair is one unit of work:
// one pass over its keys serves the whole group of query heads (grouped-query attention), with an
// online softmax in float32, in key order: a row's result does not depend on the batch.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

// To float32; bfloat16 by a shift of its bits, which the compiler vectorizes (the c10 type's
// own conversion it does not).
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t x = 0; x < n; ++x) dst[x] = static_cast<float>(src[x]);
}

template <>
inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t x = 0; x < n; ++x) out[x] = static_cast<uint32_t>(bits[x]) << 16;
}

// The three passes of a block of n keys for one query head, in float32. With AVX-512 each
// runs 16 lanes wide (dim a multiple of 16): the scores, their exponentials (the online
// softmax's weights) and the weighted sum of the values; plain loops otherwise.
inline void dots(const float* q, const float* k, int64_t n, int64_t dim, float* s) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t t = 0; t < n; ++t) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + t * dim + d), acc);
      s[t] = _mm512_reduce_add_ps(acc);
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[t * dim + d];
    s[t] = dot;
  }
}

// s[t] = e^(s[t] - top); returns their sum.
inline float exps(float* s, int64_t n, float top) {
  float sum = 0.0f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 total = _mm512_setzero_ps();
  for (; t < n; t += 16) {
    const __mmask16 lanes = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, s + t);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(x, _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(s + t, lanes, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  return sum;
}

// acc = acc * alpha + sum over t of p[t] v[t].
inline void weigh(float* acc, float alpha, const float* p, const float* v, int64_t n,
                  int64_t dim) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t d = 0; d < dim; d += 16) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(alpha));
      for (int64_t t = 0; t < n; ++t)
        a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(v + t * dim + d), a);
      _mm512_storeu_ps(acc + d, a);
    }
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) acc[d] *= alpha;
  for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += p[t] * v[t * dim + d];
  }
}

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
            int64_t table_stride, const int64_t* seq_of, const int64_t* visible, T* out,
            int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks,
            int64_t block_size, float scale, int64_t window, float softcap) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kf(block_size * dim),
        vf(block_size * dim), s(block_size), m(group), l(group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t i = work / kv_heads, kh = work % kv_heads;
      const int64_t* table = tables + seq_of[i] * table_stride;
      const int64_t context = visible[i];
      const T* qi = q + (i * heads + kh * group) * dim;
      widen(qi, qf.data(), group * dim);
      for (int64_t x = 0; x < group * dim; ++x) qf[x] *= scale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      // A sliding window hides every key more than `window` positions back.
      const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
      for (int64_t start = first / block_size * block_size; start < context;
           start += block_size) {
        const int64_t n = std::min(block_size, context - start);
        const int64_t offset = ((kh * num_blocks + table[start / block_size]) * block_size) * dim;
        // The block once in float32, shared by every head of the group.
        widen(k_cache + offset, kf.data(), n * dim);
        widen(v_cache + offset, vf.data(), n * dim);
        for (int64_t g = 0; g < group; ++g) {
          dots(qf.data() + g * dim, kf.data(), n, dim, s.data());
          float top = m[g];
          for (int64_t t = 0; t < n; ++t) {
            float dot = s[t];
            if (softcap > 0.0f) dot = softcap * std::tanh(dot / softcap);
            if (start + t < first) dot = -std::numeric_limits<float>::infinity();
            s[t] = dot;
            top = std::max(top, dot);
          }
          const float alpha = std::exp(m[g] - top);
          l[g] = l[g] * alpha + exps(s.data(), n, top);
          weigh(acc.data() + g * dim, alpha, s.data(), vf.data(), n, dim);
          m[g] = top;
        }
      }
      T* oi = out + (i * heads + kh * group) * dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d)
          oi[g * dim + d] = static_cast<T>(acc[g * dim + d] / l[g]);
    }
  });
}

}  // namespace

// q [rows, H, D]; k_cache, v_cache [KVH, num_blocks, block_size, D]; block_tables [S, max_blocks]
// (int64); seq_of [rows]: each row's table; visible [rows]: the keys it sees (>= 1); window: keys
// it sees at most (0: all); softcap: scores soft-capped to (-softcap, softcap) (0: not).
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_of, const torch::Tensor& visible,
                              double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [rows, H, D], caches [KVH, N, BS, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache differ in dtype");
  auto qc = q.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto seqs = seq_of.to(torch::kInt64).contiguous();
  auto seen = visible.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(qc);
  const int64_t rows = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_attention",
                                  [&] {
    attend<scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(), tables.size(1),
                     seqs.data_ptr<int64_t>(), seen.data_ptr<int64_t>(),
                     out.data_ptr<scalar_t>(), rows, heads, kv_heads, dim, num_blocks,
                     k_cache.size(2), static_cast<float>(scale), window,
                     static_cast<float>(softcap));
  });
  return out;
}
