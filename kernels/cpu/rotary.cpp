// Rotary embedding of the queries and keys, fused with the KV-cache store: one pass over each
// token's heads, where the reference makes a float copy, rolls, multiplies, adds, copies back,
// then scatters keys and values in two more passes.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

// Token t's heads rotated in place: x d -> x[d] cos[d] + x[(d + D/2) % D] sin[d] (the tables
// hold the signs, as kernels/rotary.py builds them), in float32, rounded once; the key heads
// (those from `heads` on) and the value heads then go to their cache slot.
template <typename T, typename A>
void rotate_rows(T* qk, int64_t qk_stride, const T* v, int64_t v_stride, const A* cos,
                 const A* sin, T* k_cache, T* v_cache, const int64_t* slots, int64_t tokens,
                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_slots) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim), c(dim), s(dim);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t d = 0; d < dim; ++d) {
        c[d] = static_cast<float>(cos[t * dim + d]);
        s[d] = static_cast<float>(sin[t * dim + d]);
      }
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* row = qk + t * qk_stride + h * dim;
        int64_t d = 0;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, at::BFloat16>) {  // 16 pairs at a time
          for (; half % 16 == 0 && d < half; d += 16) {
            const __m512 a = load_bf16(row + d), b = load_bf16(row + d + half);
            store_bf16(row + d, _mm512_fmadd_ps(a, _mm512_loadu_ps(c.data() + d),
                                                _mm512_mul_ps(b, _mm512_loadu_ps(s.data() + d))));
            store_bf16(row + d + half,
                       _mm512_fmadd_ps(b, _mm512_loadu_ps(c.data() + d + half),
                                       _mm512_mul_ps(a, _mm512_loadu_ps(s.data() + d + half))));
          }
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (!std::is_same_v<T, double>) {  // 8 pairs at a time
          for (; half % 8 == 0 && d < half; d += 8) {
            const __m256 a = load8(row + d), b = load8(row + d + half);
            store8(row + d, _mm256_fmadd_ps(a, _mm256_loadu_ps(c.data() + d),
                                            _mm256_mul_ps(b, _mm256_loadu_ps(s.data() + d))));
            store8(row + d + half,
                   _mm256_fmadd_ps(b, _mm256_loadu_ps(c.data() + d + half),
                                   _mm256_mul_ps(a, _mm256_loadu_ps(s.data() + d + half))));
          }
        }
#endif
        if (d < half) {
          for (int64_t e = 0; e < dim; ++e) x[e] = static_cast<float>(row[e]);
          for (; d < half; ++d) {
            row[d] = static_cast<T>(x[d] * c[d] + x[d + half] * s[d]);
            row[d + half] = static_cast<T>(x[d + half] * c[d + half] + x[d] * s[d + half]);
          }
        }
        if (h >= heads)
          std::copy(row, row + dim, k_cache + ((h - heads) * cache_slots + slot) * dim);
      }
      for (int64_t h = 0; h < kv_heads; ++h)
        std::copy(v + t * v_stride + h * dim, v + t * v_stride + (h + 1) * dim,
                  v_cache + (h * cache_slots + slot) * dim);
    }
  });
}

}  // namespace

// qk [T, H + KVH, D] (a view of the qkv projection: rows strided, heads contiguous), v [T, KVH,
// D] likewise; cos, sin [T, 1, D]; caches [KVH, num_blocks, block_size, D]; slots [T].
void rotate_and_store(at::Tensor qk, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                      const at::Tensor& slots) {
  const int64_t tokens = qk.size(0), dim = qk.size(2), kv_heads = k_cache.size(0);
  const int64_t heads = qk.size(1) - kv_heads;
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == dim && v.stride(2) == 1 &&
                  v.stride(1) == dim && v.size(1) == kv_heads && dim % 2 == 0,
              "rotate_and_store: heads contiguous in qk and v, KVH key and value heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == qk.scalar_type() && k_cache.size(3) == dim,
              "rotate_and_store: contiguous caches [KVH, N, BS, D] of qk's dtype");
  auto c = cos.contiguous(), s = sin.contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  const int64_t cache_slots = k_cache.size(1) * k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotate", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.scalar_type(), "rotate", [&] {
      rotate_rows<T, scalar_t>(qk.data_ptr<T>(), qk.stride(0), v.data_ptr<T>(), v.stride(0),
                               c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                               k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                               sl.data_ptr<int64_t>(), tokens, heads, kv_heads, dim,
                               cache_slots);
    });
  });
}
