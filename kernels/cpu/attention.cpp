// Paged attention on the CPU, reading K/V rows where they lie in the cache (no gather copy).
// Every query row carries its own sequence (a block table row) and how many keys it sees, so one
// kernel serves decode rows and prefill chunks alike.
//
// Work is split into units of (query row, KV head, span): a span is up to kSpan keys starting at
// a multiple of kSpan, so a long context is shared out between threads, and a unit's scores fit
// in L1/L2. One pass over a unit's keys serves the whole group of query heads (grouped-query
// attention). Rows with several spans merge them in span order by their log-sum-exp. The span
// bounds are absolute positions, so a row's result does not depend on the batch around it.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_avx2.h"
#include "attention_bf16.h"
#include "vec_math.h"

namespace {

// Keys per unit of work: 512 keeps a group's scores (G x 512 floats) and the span's K/V rows of
// one head (128 KB at D=64 in bf16) in L2, and a 4K context still splits into 8 units.
constexpr int64_t kSpan = 512;
// Keys scored together: their 16 dot products are reduced into one vector at once.
constexpr int64_t kLanes = 16;

template <typename T>
struct Problem {
  const T* q;
  const T* k_cache;
  const T* v_cache;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* seq_of;
  const int64_t* visible;
  int64_t heads, kv_heads, dim, num_blocks, block_size, window;
  float scale, softcap;

  int64_t group() const { return heads / kv_heads; }
  // The first key row i sees: a sliding window hides every key more than `window` back.
  int64_t first(int64_t i) const {
    return window > 0 ? std::max<int64_t>(0, visible[i] - window) : 0;
  }
  int64_t spans(int64_t i) const { return (visible[i] - 1) / kSpan - first(i) / kSpan + 1; }
  // offsets[t]: where key lo + t of row i's sequence, head kh, lies in either cache (t < n).
  void row_offsets(int64_t i, int64_t kh, int64_t lo, int64_t n, int64_t* offsets) const {
    const int64_t* table = tables + seq_of[i] * table_stride;
    for (int64_t t = 0, slot = lo % block_size; t < n; slot = 0) {
      const int64_t base = (kh * num_blocks + table[(lo + t) / block_size]) * block_size * dim;
      for (; slot < block_size && t < n; ++slot, ++t) offsets[t] = base + slot * dim;
    }
  }
};

#if defined(__AVX512F__)
// 16 elements as float32; bfloat16 by a shift of its bits.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 lanes of partial sums of q . k (dim a multiple of 16).
template <typename T>
inline __m512 dot_lanes(const T* q, const T* k, int64_t dim) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) acc = _mm512_fmadd_ps(load16(q + d), load16(k + d), acc);
  return acc;
}
#endif

// s[t] = e^(s[t] - top); returns their sum.
inline float exps(float* s, int64_t n, float top) {
#if defined(__AVX512F__)
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 lanes = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, s + t);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(x, _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(s + t, lanes, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  if (t < n) {
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - t)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 x = _mm256_maskload_ps(s + t, lanes);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, shift)), _mm256_castsi256_ps(lanes));
    _mm256_maskstore_ps(s + t, lanes, e);
    total = _mm256_add_ps(total, e);
  }
  return sum8(total);
#else
  float sum = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  return sum;
#endif
}

// The largest of s[0, n), n >= 1.
inline float largest(const float* s, int64_t n) {
  float top = s[0];
  int64_t t = 1;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {  // 8-lane maxima also on AVX-512 CPUs: the scores are in L1, n at most kSpan
    __m256 a = _mm256_loadu_ps(s);
    for (t = 8; t + 8 <= n; t += 8) a = _mm256_max_ps(a, _mm256_loadu_ps(s + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  for (; t < n; ++t) top = std::max(top, s[t]);
  return top;
}

// A head's n scores soft-capped (softcap > 0), then s[t] = e^(s[t] - m) with m their largest;
// returns the sum.
inline float exponentiate(float* s, int64_t n, float softcap, float* m) {
  if (softcap > 0.0f)
    for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  *m = largest(s, n);
  return exps(s, n, *m);
}

template <typename T>
float dot(const T* q, const T* k, int64_t dim) {
  float sum = 0.0f;
  for (int64_t d = 0; d < dim; ++d) sum += static_cast<float>(q[d]) * static_cast<float>(k[d]);
  return sum;
}

// One thread's scratch: a span's scores per head, its keys' offsets, the group's queries in
// float32 (AVX2), and the value pass's rows and sums: widened V rows [16, D] (generic), or the
// bf16 pass's weight pairs [G, kSpan / 2], interleaved rows [8, D / 32, 2] and sums [G, D].
struct Scratch {
  std::vector<float> scores, v_rows, sums, queries;
  std::vector<int64_t> offsets;
  std::vector<uint32_t> pairs;
#if defined(__AVX512F__)
  std::vector<__m512i> interleaved;
#endif
  Scratch(int64_t group, int64_t dim)
      : scores(group * kSpan), v_rows(kLanes * dim), sums(group * dim), queries(group * dim),
        offsets(kSpan), pairs(group * kSpan / 2)
#if defined(__AVX512F__)
        , interleaved(kLanes * dim / 32 + 1)
#endif
  {}
};

// Vector paths need 16-lane rows on AVX-512, 8-lane ones on AVX2 (and not double, which only
// the scalar path takes).
template <typename T>
bool vectorized(int64_t dim) {
#if defined(__AVX512F__)
  return !std::is_same_v<T, double> && dim % 16 == 0;
#elif defined(__AVX2__) && defined(__FMA__)
  return !std::is_same_v<T, double> && dim % 8 == 0;
#else
  return false;
#endif
}

// s[t] = scale * q . k_t for the n keys at these offsets.
template <typename T>
void score(const T* q, const T* k_cache, const int64_t* offsets, int64_t n, int64_t dim,
           float scale, float* s) {
  int64_t t = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (vectorized<T>(dim)) {
      for (; t + kLanes <= n; t += kLanes) {
        __m512 parts[kLanes];
        for (int64_t j = 0; j < kLanes; ++j)
          parts[j] = dot_lanes(q, k_cache + offsets[t + j], dim);
        _mm512_storeu_ps(s + t, _mm512_mul_ps(reduce16(parts), _mm512_set1_ps(scale)));
      }
      for (; t < n; ++t)
        s[t] = _mm512_reduce_add_ps(dot_lanes(q, k_cache + offsets[t], dim)) * scale;
    }
  }
#endif
  for (; t < n; ++t) s[t] = dot(q, k_cache + offsets[t], dim) * scale;
}

// acc += sum over j < n of w[j] * v_j, the value rows already in float32 (stride dim).
inline void weigh(float* acc, const float* w, const float* rows, int64_t n, int64_t dim) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= dim; d += 16) {  // the 16 sums stay in a register over the keys
    __m512 a = _mm512_loadu_ps(acc + d);
    for (int64_t j = 0; j < n; ++j)
      a = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_loadu_ps(rows + j * dim + d), a);
    _mm512_storeu_ps(acc + d, a);
  }
#endif
  for (; d < dim; ++d)
    for (int64_t j = 0; j < n; ++j) acc[d] += w[j] * rows[j * dim + d];
}

// Value row v (dim elements) into float32.
template <typename T>
void widen(const T* v, float* out, int64_t dim) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (vectorized<T>(dim)) {
      for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(out + d, load16(v + d));
      return;
    }
  }
#endif
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(v[d]);
}

#if defined(__AVX512BF16__)
// attend_span's passes for a bf16 head of kChunks x 32 dims, on pair dot products
// (attention_bf16.h): K and V read as the cache holds them, the weights rounded to bf16.
template <int kChunks>
void attend_span_bf16(const Problem<c10::BFloat16>& p, const c10::BFloat16* q,
                      const int64_t* offsets, int64_t n, Scratch& scratch, float* acc, float* m,
                      float* l) {
  namespace span = bf16_span;
  const int64_t group = p.group(), dim = 32 * kChunks;
  span::prefetch<kChunks>(p.k_cache, p.v_cache, offsets, 0, n);
  for (int64_t t = 16; t < span::kAhead; t += 16)
    span::prefetch<kChunks>(p.k_cache, p.v_cache, offsets, t, n);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scratch.scores.data() + g * kSpan;
    span::score<kChunks>(q + g * dim, p.k_cache, p.v_cache, offsets, n, p.scale, s,
                         g == 0 ? span::kAhead : 0);
    exponentiate(s, n, p.softcap, m + g);
    l[g] = span::to_pairs(s, n, scratch.pairs.data() + g * kSpan / 2);
  }
  float* sums = scratch.sums.data();
  std::fill(sums, sums + group * dim, 0.0f);
  for (int64_t t = 0; t < n; t += kLanes) {  // 16 keys' rows interleaved once for every head
    const int64_t count = (std::min(kLanes, n - t) + 1) / 2;
    span::interleave<kChunks>(p.v_cache, offsets, t, n, count, scratch.interleaved.data());
    for (int64_t g = 0; g < group; ++g)
      span::weigh<kChunks>(sums + g * dim, scratch.pairs.data() + g * kSpan / 2 + t / 2,
                     scratch.interleaved.data(), count);
  }
  for (int64_t g = 0; g < group; ++g) span::deinterleave(sums + g * dim, acc + g * dim, dim);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// pass(g, H) for the group's heads three at a time: g the first, H (a compile-time count) of them.
template <typename Pass>
void by_threes(int64_t group, Pass&& pass) {
  for (int64_t g = 0; g < group; g += 3) {
    switch (std::min<int64_t>(3, group - g)) {
      case 3: pass(g, std::integral_constant<int, 3>{}); break;
      case 2: pass(g, std::integral_constant<int, 2>{}); break;
      default: pass(g, std::integral_constant<int, 1>{}); break;
    }
  }
}

// attend_span's passes on 8-lane vectors (attention_avx2.h): the scores of up to three heads
// per pass over the keys, then their values weighed the same way.
template <typename T>
void attend_span_avx2(const Problem<T>& p, const T* q, const int64_t* offsets, int64_t n,
                      Scratch& scratch, float* acc, float* m, float* l) {
  const int64_t group = p.group(), dim = p.dim;
  float* queries = scratch.queries.data();
  float* s = scratch.scores.data();
  for (int64_t x = 0; x < group * dim; x += 8) _mm256_storeu_ps(queries + x, load8(q + x));
  by_threes(group, [&](int64_t g, auto heads) {
    auto pass = [&](auto chunks) {
      avx2_span::score<heads(), chunks()>(queries + g * dim, p.k_cache, p.v_cache, offsets, n,
                                          dim, p.scale, s + g * kSpan, kSpan, g == 0);
    };
    switch (dim) {
      case 64: return pass(std::integral_constant<int, 8>{});
      case 128: return pass(std::integral_constant<int, 16>{});
      default: return pass(std::integral_constant<int, 0>{});
    }
  });
  for (int64_t g = 0; g < group; ++g) l[g] = exponentiate(s + g * kSpan, n, p.softcap, m + g);
  std::fill(acc, acc + group * dim, 0.0f);
  by_threes(group, [&](int64_t g, auto heads) {
    avx2_span::weigh<heads()>(s + g * kSpan, kSpan, p.v_cache, offsets, n, dim, acc + g * dim);
  });
}
#endif

// Unit (row i, head kh, keys [lo, hi)): acc[g] = sum of e^(s - m[g]) v, l[g] = sum of
// e^(s - m[g]), m[g] = the largest score. Three passes: the scores of all the span's keys,
// their exponentials (contiguous, 16 lanes), then the values weighted by them.
template <typename T>
void attend_span(const Problem<T>& p, int64_t i, int64_t kh, int64_t lo, int64_t hi,
                 Scratch& scratch, float* acc, float* m, float* l) {
  const int64_t group = p.group(), dim = p.dim, n = hi - lo;
  const T* q = p.q + (i * p.heads + kh * group) * dim;
  int64_t* offsets = scratch.offsets.data();
  p.row_offsets(i, kh, lo, n, offsets);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    switch (dim) {
      case 64: return attend_span_bf16<2>(p, q, offsets, n, scratch, acc, m, l);
      case 96: return attend_span_bf16<3>(p, q, offsets, n, scratch, acc, m, l);
      case 128: return attend_span_bf16<4>(p, q, offsets, n, scratch, acc, m, l);
      case 256: return attend_span_bf16<8>(p, q, offsets, n, scratch, acc, m, l);
      default: break;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>)
    if (vectorized<T>(dim)) return attend_span_avx2(p, q, offsets, n, scratch, acc, m, l);
#endif
  for (int64_t g = 0; g < group; ++g) {
    float* s = scratch.scores.data() + g * kSpan;
    score(q + g * dim, p.k_cache, offsets, n, dim, p.scale, s);
    l[g] = exponentiate(s, n, p.softcap, m + g);
    std::fill(acc + g * dim, acc + (g + 1) * dim, 0.0f);
  }
  // The values, a group of keys at a time: widened once, then weighed for every head.
  float* rows = scratch.v_rows.data();
  for (int64_t t = 0; t < n; t += kLanes) {
    const int64_t keys = std::min(kLanes, n - t);
    for (int64_t j = 0; j < keys; ++j) widen(p.v_cache + offsets[t + j], rows + j * dim, dim);
    for (int64_t g = 0; g < group; ++g)
      weigh(acc + g * dim, scratch.scores.data() + g * kSpan + t, rows, keys, dim);
  }
}

template <typename T>
void attend(const Problem<T>& p, T* out, int64_t rows) {
  const int64_t group = p.group(), dim = p.dim, kv_heads = p.kv_heads;
  // start[i]: row i's first unit, counted in (row, span) pairs; each has one unit per KV head.
  std::vector<int64_t> start(rows + 1, 0);
  for (int64_t i = 0; i < rows; ++i) start[i + 1] = start[i] + p.spans(i);
  // Partial sums of rows with several spans: per unit, acc [G, D], then m [G] and l [G].
  const int64_t part = group * (dim + 2);
  std::vector<float> parts(start[rows] > rows ? start[rows] * kv_heads * part : 0);
  at::parallel_for(0, start[rows] * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(group, dim);
    std::vector<float> own(part);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t pair = unit / kv_heads, kh = unit % kv_heads;
      const int64_t i = std::upper_bound(start.begin(), start.end(), pair) - start.begin() - 1;
      const int64_t span = p.first(i) / kSpan + pair - start[i];
      const int64_t lo = std::max(span * kSpan, p.first(i));
      const int64_t hi = std::min((span + 1) * kSpan, p.visible[i]);
      const bool alone = start[i + 1] - start[i] == 1;
      float* acc = alone ? own.data() : parts.data() + unit * part;
      float* m = acc + group * dim;
      float* l = m + group;
      attend_span(p, i, kh, lo, hi, scratch, acc, m, l);
      if (!alone) continue;
      T* o = out + (i * p.heads + kh * group) * dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = static_cast<T>(acc[g * dim + d] / l[g]);
    }
  });
  if (parts.empty()) return;
  // Rows of several spans: each head's spans rescaled to the largest maximum, in span order.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(dim);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t i = work / kv_heads, kh = work % kv_heads;
      if (start[i + 1] - start[i] == 1) continue;
      T* o = out + (i * p.heads + kh * group) * dim;
      for (int64_t g = 0; g < group; ++g) {
        auto unit = [&](int64_t pair) { return parts.data() + (pair * kv_heads + kh) * part; };
        float top = -std::numeric_limits<float>::infinity(), total = 0.0f;
        for (int64_t pair = start[i]; pair < start[i + 1]; ++pair)
          top = std::max(top, unit(pair)[group * dim + g]);
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int64_t pair = start[i]; pair < start[i + 1]; ++pair) {
          const float* u = unit(pair);
          const float w = std::exp(u[group * dim + g] - top);
          total += w * u[group * dim + group + g];
          for (int64_t d = 0; d < dim; ++d) sum[d] += w * u[g * dim + d];
        }
        for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = static_cast<T>(sum[d] / total);
      }
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
  const int64_t heads = qc.size(1), kv_heads = k_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_attention",
                                  [&] {
    const Problem<scalar_t> problem{
        qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        tables.data_ptr<int64_t>(), tables.size(1), seqs.data_ptr<int64_t>(),
        seen.data_ptr<int64_t>(), heads, kv_heads, qc.size(2), k_cache.size(1),
        k_cache.size(2), window, static_cast<float>(scale), static_cast<float>(softcap)};
    attend<scalar_t>(problem, out.data_ptr<scalar_t>(), qc.size(0));
  });
  return out;
}
