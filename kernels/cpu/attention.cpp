// Paged attention on the CPU, reading K/V rows where they lie in the cache (no gather copy).
// Every query row carries its own sequence (a block table row) and how many keys it sees, so one
// kernel serves decode rows and prefill chunks alike.
//
// Work is split into units of (query rows, KV head, span): a span is up to kSpan keys starting
// at a multiple of kSpan, so a long context is shared out between threads, and a unit's scores
// fit in L2. One pass over a unit's keys serves all its query heads: the group of a KV head
// (grouped-query attention) for each of its rows, which are a prefill chunk's consecutive tokens
// (a tile: each key read once for all of them) or decode rows over the blocks they all begin
// with (cascade: a shared prompt read once). Rows with several parts merge them in key order by
// their log-sum-exp. Without cascade the parts are a row's spans, whose bounds are absolute
// positions, and a row's arithmetic is the same in any tile: its result does not depend on the
// batch around it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
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
// Query heads a unit takes at most (a prefill chunk's tokens, or decode rows sharing keys, times
// the heads of a KV head's group): their scores, 48 x kSpan floats (96 KB), stay in L2.
constexpr int64_t kTileHeads = 48;

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
  // How many of keys [lo, hi) row i sees (lo at or past its first).
  int64_t seen(int64_t i, int64_t lo, int64_t hi) const {
    return std::clamp<int64_t>(std::min(hi, visible[i]) - lo, 0, hi - lo);
  }
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

// A head's scores of the first `seen` of n keys soft-capped (softcap > 0), then s[t] =
// e^(s[t] - m) with m their largest, and 0 for the keys past `seen` (a prefill row's later
// neighbours, which the value pass still runs over); returns the sum (0, m = -inf: none seen).
inline float exponentiate(float* s, int64_t n, int64_t seen, float softcap, float* m) {
  std::fill(s + seen, s + n, 0.0f);
  if (seen == 0) {
    *m = -std::numeric_limits<float>::infinity();
    return 0.0f;
  }
  if (softcap > 0.0f)
    for (int64_t t = 0; t < seen; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  *m = largest(s, seen);
  return exps(s, seen, *m);
}

template <typename T>
float dot(const T* q, const T* k, int64_t dim) {
  float sum = 0.0f;
  for (int64_t d = 0; d < dim; ++d) sum += static_cast<float>(q[d]) * static_cast<float>(k[d]);
  return sum;
}

// One thread's scratch for a unit of up to `heads` query heads: a span's scores per head, its
// keys' offsets and how many each head sees, the heads' queries (gathered when the unit has
// several rows; in float32 for AVX2), and the value pass's rows and sums: widened V rows [16, D]
// (generic), or the bf16 pass's weight pairs [heads, kSpan / 2], interleaved rows [8, D / 32, 2]
// and sums [heads, D].
template <typename T>
struct Scratch {
  std::vector<float> scores, v_rows, sums, queries, acc;
  std::vector<int64_t> offsets, seen;
  // The key offsets of the unit this thread takes next (ahead_n of them), prefetched into L2
  // during this one's value pass: memory stays busy while the unit computes from its caches.
  std::vector<int64_t> ahead;
  int64_t ahead_n = 0;
  std::vector<T> rows;
  std::vector<uint32_t> pairs;
#if defined(__AVX512F__)
  std::vector<__m512i> interleaved;
#endif
  Scratch(int64_t heads, int64_t dim)
      : scores(heads * kSpan), v_rows(kLanes * dim), sums(heads * dim), queries(heads * dim),
        acc(heads * (dim + 2)), offsets(kSpan), seen(heads), ahead(kSpan), rows(heads * dim),
        pairs(heads * kSpan / 2)
#if defined(__AVX512F__)
        , interleaved(kLanes * dim / 32 + 1)
#endif
  {}
};

// Keys [t, t + count) of the unit this thread takes next into L2 (see Scratch::ahead); inlined,
// as prefetch_rows says why.
template <typename T>
[[gnu::always_inline]] inline void prefetch_ahead(const Problem<T>& p, const Scratch<T>& scratch,
                                                  int64_t t, int64_t count) {
  if (t < scratch.ahead_n)
    prefetch_kv<2>(p.k_cache, p.v_cache, scratch.ahead.data() + t,
                   std::min(count, scratch.ahead_n - t), p.dim * static_cast<int64_t>(sizeof(T)));
}

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
      // The last few keys too go through reduce16 (its lanes past them zeros): a key's score
      // then has the same bits wherever its row's keys end (a decode row alone, or a prefill
      // tile's longer row over the same span).
      for (; t < n; t += kLanes) {
        const int64_t keys = std::min(kLanes, n - t);
        __m512 parts[kLanes];
        for (int64_t j = 0; j < kLanes; ++j)
          parts[j] = j < keys ? dot_lanes(q, k_cache + offsets[t + j], dim) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(s + t, static_cast<__mmask16>((1u << keys) - 1),
                              _mm512_mul_ps(reduce16(parts), _mm512_set1_ps(scale)));
      }
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
// attend_span's passes for bf16 heads of kChunks x 32 dims, on pair dot products
// (attention_bf16.h): K and V read as the cache holds them, the weights rounded to bf16.
template <int kChunks>
void attend_span_bf16(const Problem<c10::BFloat16>& p, const c10::BFloat16* q, int64_t heads,
                      const int64_t* offsets, int64_t n, Scratch<c10::BFloat16>& scratch,
                      float* acc, float* m, float* l) {
  namespace span = bf16_span;
  const int64_t dim = 32 * kChunks;
  span::prefetch<kChunks>(p.k_cache, p.v_cache, offsets, 0, n);
  for (int64_t t = 16; t < span::kAhead; t += 16)
    span::prefetch<kChunks>(p.k_cache, p.v_cache, offsets, t, n);
  for (int64_t g = 0; g < heads; ++g) {
    float* s = scratch.scores.data() + g * kSpan;
    span::score<kChunks>(q + g * dim, p.k_cache, p.v_cache, offsets, n, p.scale, s,
                         g == 0 ? span::kAhead : 0);
    exponentiate(s, n, scratch.seen[g], p.softcap, m + g);
    l[g] = span::to_pairs(s, n, scratch.pairs.data() + g * kSpan / 2);
  }
  float* sums = scratch.sums.data();
  std::fill(sums, sums + heads * dim, 0.0f);
  for (int64_t t = 0; t < n; t += kLanes) {  // 16 keys' rows interleaved once for every head
    const int64_t count = (std::min(kLanes, n - t) + 1) / 2;
    prefetch_ahead(p, scratch, t, kLanes);
    span::interleave<kChunks>(p.v_cache, offsets, t, n, count, scratch.interleaved.data());
    for (int64_t g = 0; g < heads; ++g)
      span::weigh<kChunks>(sums + g * dim, scratch.pairs.data() + g * kSpan / 2 + t / 2,
                           scratch.interleaved.data(), count);
  }
  for (int64_t g = 0; g < heads; ++g) span::deinterleave(sums + g * dim, acc + g * dim, dim);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// pass(g, H) for the heads three at a time: g the first, H (a compile-time count) of them.
template <typename Pass>
void by_threes(int64_t heads, Pass&& pass) {
  for (int64_t g = 0; g < heads; g += 3) {
    switch (std::min<int64_t>(3, heads - g)) {
      case 3: pass(g, std::integral_constant<int, 3>{}); break;
      case 2: pass(g, std::integral_constant<int, 2>{}); break;
      default: pass(g, std::integral_constant<int, 1>{}); break;
    }
  }
}

// attend_span's passes on 8-lane vectors (attention_avx2.h): the scores of up to three heads
// per pass over the keys, then their values weighed the same way.
template <typename T>
void attend_span_avx2(const Problem<T>& p, const T* q, int64_t heads, const int64_t* offsets,
                      int64_t n, Scratch<T>& scratch, float* acc, float* m, float* l) {
  const int64_t dim = p.dim;
  float* queries = scratch.queries.data();
  float* s = scratch.scores.data();
  for (int64_t x = 0; x < heads * dim; x += 8) _mm256_storeu_ps(queries + x, load8(q + x));
  by_threes(heads, [&](int64_t g, auto three) {
    auto pass = [&](auto chunks) {
      avx2_span::score<three(), chunks()>(queries + g * dim, p.k_cache, p.v_cache, offsets, n,
                                          dim, p.scale, s + g * kSpan, kSpan, g == 0);
    };
    switch (dim) {
      case 64: return pass(std::integral_constant<int, 8>{});
      case 128: return pass(std::integral_constant<int, 16>{});
      default: return pass(std::integral_constant<int, 0>{});
    }
  });
  for (int64_t g = 0; g < heads; ++g)
    l[g] = exponentiate(s + g * kSpan, n, scratch.seen[g], p.softcap, m + g);
  std::fill(acc, acc + heads * dim, 0.0f);
  // 64 keys at a time (whole tiles of weigh's 32: the same sums in the same order), the next
  // unit's rows prefetched between them.
  for (int64_t t = 0; t < n; t += 64) {
    prefetch_ahead(p, scratch, t, 64);
    by_threes(heads, [&](int64_t g, auto three) {
      avx2_span::weigh<three()>(s + g * kSpan + t, kSpan, p.v_cache, offsets + t,
                                std::min<int64_t>(64, n - t), dim, acc + g * dim);
    });
  }
}
#endif

// A unit's `heads` query heads (q: [heads, D], one after another) over the n keys at these
// offsets, head x seeing the first scratch.seen[x] of them: acc [heads, D] = sum of e^(s - m) v,
// m [heads] = the largest score, l [heads] = sum of e^(s - m). Three passes: the scores of all
// the keys, their exponentials (contiguous, 16 lanes), then the values weighted by them.
template <typename T>
void attend_span(const Problem<T>& p, const T* q, int64_t heads, const int64_t* offsets,
                 int64_t n, Scratch<T>& scratch, float* acc, float* m, float* l) {
  const int64_t dim = p.dim;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    switch (dim) {
      case 64: return attend_span_bf16<2>(p, q, heads, offsets, n, scratch, acc, m, l);
      case 96: return attend_span_bf16<3>(p, q, heads, offsets, n, scratch, acc, m, l);
      case 128: return attend_span_bf16<4>(p, q, heads, offsets, n, scratch, acc, m, l);
      case 256: return attend_span_bf16<8>(p, q, heads, offsets, n, scratch, acc, m, l);
      default: break;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>)
    if (vectorized<T>(dim)) return attend_span_avx2(p, q, heads, offsets, n, scratch, acc, m, l);
#endif
  for (int64_t g = 0; g < heads; ++g) {
    float* s = scratch.scores.data() + g * kSpan;
    score(q + g * dim, p.k_cache, offsets, n, dim, p.scale, s);
    l[g] = exponentiate(s, n, scratch.seen[g], p.softcap, m + g);
    std::fill(acc + g * dim, acc + (g + 1) * dim, 0.0f);
  }
  // The values, a group of keys at a time: widened once, then weighed for every head.
  float* rows = scratch.v_rows.data();
  for (int64_t t = 0; t < n; t += kLanes) {
    prefetch_ahead(p, scratch, t, kLanes);
    const int64_t keys = std::min(kLanes, n - t);
    for (int64_t j = 0; j < keys; ++j) widen(p.v_cache + offsets[t + j], rows + j * dim, dim);
    for (int64_t g = 0; g < heads; ++g)
      weigh(acc + g * dim, scratch.scores.data() + g * kSpan + t, rows, keys, dim);
  }
}

// Query rows [r0, r1) over keys [lo, hi) of row r0's table, for each KV head: consecutive
// tokens of one prefill chunk, decode rows over the keys they all share (cascade), or one row.
struct Unit {
  int64_t r0, r1, lo, hi;
  int64_t slot;  // where row r0's partial sums go (row r's: slot + r - r0) if it has several
};

// The units of a call, and each row's slots in key order: row i's are slots[begin[i],
// begin[i + 1]). A row with one slot writes its result directly.
struct Plan {
  std::vector<Unit> units;
  std::vector<int64_t> order;  // the units by decreasing size: threads take the big ones first
  std::vector<int64_t> begin, slots;
  int64_t total = 0;  // slots of all units
  int64_t tile = 1;   // the most rows of a unit
};

template <typename T>
Plan plan_units(const Problem<T>& p, int64_t rows, int64_t shared_rows, int64_t shared_keys) {
  Plan plan;
  // Rows a unit takes: up to kTileHeads query heads (their scores stay in L2), but units enough
  // to keep every thread busy (four each).
  const int64_t busy = (rows * p.kv_heads + 4 * at::get_num_threads() - 1) /
                       (4 * at::get_num_threads());
  // A sliding window makes each row's first key its own: units of one row, and no cascade.
  const int64_t most = std::max<int64_t>(1, kTileHeads / p.group());
  plan.tile = p.window > 0 ? 1 : std::clamp<int64_t>(busy, 1, most);
  const int64_t shared = p.window > 0 ? 0 : shared_keys;
  auto cascade = [&](int64_t i) { return shared > 0 && i < shared_rows; };
  auto add = [&](int64_t r0, int64_t r1, int64_t from, int64_t to) {
    for (int64_t lo = from, hi; lo < to; lo = hi) {
      hi = std::min(to, (lo / kSpan + 1) * kSpan);  // spans at absolute positions
      plan.units.push_back({r0, r1, lo, hi, plan.total});
      plan.total += r1 - r0;
    }
  };
  if (shared > 0)
    for (int64_t r0 = 0; r0 < shared_rows; r0 += plan.tile)
      add(r0, std::min(r0 + plan.tile, shared_rows), 0, shared);
  for (int64_t i = 0, j; i < rows; i = j) {
    int64_t to = p.visible[i];
    for (j = i + 1; j < rows && j - i < plan.tile && p.seq_of[j] == p.seq_of[i] &&
                    cascade(j) == cascade(i);
         ++j)
      to = std::max(to, p.visible[j]);
    add(i, j, cascade(i) ? shared : p.first(i), to);
  }
  plan.begin.assign(rows + 1, 0);
  for (const Unit& u : plan.units)
    for (int64_t i = u.r0; i < u.r1; ++i) plan.begin[i + 1] += p.seen(i, u.lo, u.hi) > 0;
  for (int64_t i = 0; i < rows; ++i) plan.begin[i + 1] += plan.begin[i];
  plan.slots.resize(plan.begin[rows]);
  std::vector<int64_t> next(plan.begin.begin(), plan.begin.end() - 1);
  for (const Unit& u : plan.units)
    for (int64_t i = u.r0; i < u.r1; ++i)
      if (p.seen(i, u.lo, u.hi) > 0) plan.slots[next[i]++] = u.slot + i - u.r0;
  plan.order.resize(plan.units.size());
  std::iota(plan.order.begin(), plan.order.end(), 0);
  auto size = [&](int64_t u) {
    return (plan.units[u].r1 - plan.units[u].r0) * (plan.units[u].hi - plan.units[u].lo);
  };
  std::stable_sort(plan.order.begin(), plan.order.end(),
                   [&](int64_t a, int64_t b) { return size(a) > size(b); });
  return plan;
}

template <typename T>
void attend(const Problem<T>& p, T* out, int64_t rows, int64_t shared_rows,
            int64_t shared_keys) {
  const int64_t group = p.group(), dim = p.dim, kv_heads = p.kv_heads;
  const Plan plan = plan_units(p, rows, shared_rows, shared_keys);
  auto parts_of = [&](int64_t i) { return plan.begin[i + 1] - plan.begin[i]; };
  // Partial sums of rows with several parts, per slot and KV head: acc [G, D], m [G], l [G].
  const int64_t part = group * (dim + 2);
  const bool merge = static_cast<int64_t>(plan.slots.size()) > rows;
  std::vector<float> parts(merge ? plan.total * kv_heads * part : 0);
  const int64_t work = static_cast<int64_t>(plan.units.size()) * kv_heads;
  std::atomic<int64_t> next{0};
  // Units differ in size (a prefill tile, a short decode row): each thread takes the next one,
  // claimed a unit ahead so that its rows come into L2 while this one computes.
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch<T> scratch(plan.tile * group, dim);
    auto offsets_of = [&](int64_t w, int64_t* offsets) {
      const Unit& u = plan.units[plan.order[w / kv_heads]];
      p.row_offsets(u.r0, w % kv_heads, u.lo, u.hi - u.lo, offsets);
      return u.hi - u.lo;
    };
    int64_t w = next.fetch_add(1, std::memory_order_relaxed);
    if (w < work) offsets_of(w, scratch.offsets.data());
    for (int64_t claimed; w < work; w = claimed) {
      claimed = next.fetch_add(1, std::memory_order_relaxed);
      scratch.ahead_n = claimed < work ? offsets_of(claimed, scratch.ahead.data()) : 0;
      const Unit& u = plan.units[plan.order[w / kv_heads]];
      const int64_t kh = w % kv_heads, n = u.hi - u.lo, heads = (u.r1 - u.r0) * group;
      const T* q = p.q + (u.r0 * p.heads + kh * group) * dim;
      if (u.r1 - u.r0 > 1) {  // the rows' heads of this KV head, one after another
        for (int64_t r = 0; r < u.r1 - u.r0; ++r)
          std::copy_n(q + r * p.heads * dim, group * dim, scratch.rows.data() + r * group * dim);
        q = scratch.rows.data();
      }
      for (int64_t i = u.r0; i < u.r1; ++i)
        std::fill_n(scratch.seen.data() + (i - u.r0) * group, group, p.seen(i, u.lo, u.hi));
      float* acc = scratch.acc.data();
      float* m = acc + heads * dim;
      float* l = m + heads;
      attend_span(p, q, heads, scratch.offsets.data(), n, scratch, acc, m, l);
      for (int64_t i = u.r0; i < u.r1; ++i) {
        const int64_t x = (i - u.r0) * group;
        if (scratch.seen[x] == 0) continue;
        if (parts_of(i) == 1) {
          T* o = out + (i * p.heads + kh * group) * dim;
          for (int64_t g = 0; g < group; ++g)
            for (int64_t d = 0; d < dim; ++d)
              o[g * dim + d] = static_cast<T>(acc[(x + g) * dim + d] / l[x + g]);
          continue;
        }
        float* to = parts.data() + ((u.slot + i - u.r0) * kv_heads + kh) * part;
        std::copy_n(acc + x * dim, group * dim, to);
        std::copy_n(m + x, group, to + group * dim);
        std::copy_n(l + x, group, to + group * dim + group);
      }
      std::swap(scratch.offsets, scratch.ahead);  // the claimed unit's, worked out above
    }
  });
  if (!merge) return;
  // Rows of several parts: each head's parts rescaled to the largest maximum, in key order.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(dim);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / kv_heads, kh = job % kv_heads;
      if (parts_of(i) == 1) continue;
      const int64_t* slots = plan.slots.data() + plan.begin[i];
      auto slot = [&](int64_t k) { return parts.data() + (slots[k] * kv_heads + kh) * part; };
      T* o = out + (i * p.heads + kh * group) * dim;
      for (int64_t g = 0; g < group; ++g) {
        float top = -std::numeric_limits<float>::infinity(), total = 0.0f;
        for (int64_t k = 0; k < parts_of(i); ++k) top = std::max(top, slot(k)[group * dim + g]);
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int64_t k = 0; k < parts_of(i); ++k) {
          const float* u = slot(k);
          const float weight = std::exp(u[group * dim + g] - top);
          total += weight * u[group * dim + group + g];
          for (int64_t d = 0; d < dim; ++d) sum[d] += weight * u[g * dim + d];
        }
        for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = static_cast<T>(sum[d] / total);
      }
    }
  });
}

}  // namespace

// q [rows, H, D]; k_cache, v_cache [KVH, num_blocks, block_size, D]; block_tables [S, max_blocks]
// (int64); seq_of [rows]: each row's table; visible [rows]: the keys it sees (>= 1); window: keys
// it sees at most (0: all); softcap: scores soft-capped to (-softcap, softcap) (0: not);
// shared_keys: keys at the head of rows [0, shared_rows)'s tables that are the same blocks in
// each (a shared prompt), read once for all those rows (cascade; not with a window).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_of, const at::Tensor& visible,
                           double scale, int64_t window, double softcap, int64_t shared_rows,
                           int64_t shared_keys) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [rows, H, D], caches [KVH, N, BS, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache differ in dtype");
  TORCH_CHECK(shared_rows >= 0 && shared_rows <= q.size(0) && shared_keys >= 0,
              "shared_rows must be within the rows, shared_keys not negative");
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto seqs = seq_of.to(at::kLong).contiguous();
  auto seen = visible.to(at::kLong).contiguous();
  auto out = at::empty_like(qc);
  const int64_t heads = qc.size(1), kv_heads = k_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_attention",
                                  [&] {
    const Problem<scalar_t> problem{
        qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        tables.data_ptr<int64_t>(), tables.size(1), seqs.data_ptr<int64_t>(),
        seen.data_ptr<int64_t>(), heads, kv_heads, qc.size(2), k_cache.size(1),
        k_cache.size(2), window, static_cast<float>(scale), static_cast<float>(softcap)};
    attend<scalar_t>(problem, out.data_ptr<scalar_t>(), qc.size(0), shared_rows, shared_keys);
  });
  return out;
}
