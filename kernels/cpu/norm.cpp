// RMSNorm, alone and fused with the residual add: one pass over each row, float32 sums.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

// With residual: h = x + residual is stored to residual_out (in the input dtype, as the
// reference rounds it) and normalised; without, x itself is.
template <typename T>
void norm_rows(const T* x, const T* residual, const T* weight, T* out, T* residual_out,
               int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      float sq = 0.0f;
      int64_t c = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {  // 16 columns at a time, same roundings
        __m512 squares = _mm512_setzero_ps();
        for (; c + 16 <= width; c += 16) {
          __m512 v = load_bf16(xr + c);
          if (residual != nullptr) {
            const __m256i sum = to_bf16(_mm512_add_ps(v, load_bf16(residual + r * width + c)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(residual_out + r * width + c), sum);
            v = from_bf16(sum);
          }
          _mm512_storeu_ps(h.data() + c, v);
          squares = _mm512_fmadd_ps(v, v, squares);
        }
        sq = _mm512_reduce_add_ps(squares);
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (!std::is_same_v<T, double>) {  // 8 columns at a time, same roundings
        __m256 squares = _mm256_setzero_ps();
        for (; c + 8 <= width; c += 8) {
          __m256 v = load8(xr + c);
          if (residual != nullptr) {
            T* sum = residual_out + r * width + c;
            store8(sum, _mm256_add_ps(v, load8(residual + r * width + c)));
            v = load8(sum);  // as rounded to T
          }
          _mm256_storeu_ps(h.data() + c, v);
          squares = _mm256_fmadd_ps(v, v, squares);
        }
        sq = sum8(squares);
      }
#endif
      for (; c < width; ++c) {
        float v = static_cast<float>(xr[c]);
        if (residual != nullptr) {
          const T sum = static_cast<T>(v + static_cast<float>(residual[r * width + c]));
          residual_out[r * width + c] = sum;
          v = static_cast<float>(sum);
        }
        h[c] = v;
        sq += v * v;
      }
      const float inv = 1.0f / std::sqrt(sq / static_cast<float>(width) + eps);
      T* o = out + r * width;
      c = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        const __m512 scale = _mm512_set1_ps(inv);
        for (; c + 16 <= width; c += 16) {
          const __m512 normed = from_bf16(to_bf16(_mm512_mul_ps(_mm512_loadu_ps(h.data() + c),
                                                                scale)));
          store_bf16(o + c, _mm512_mul_ps(normed, load_bf16(weight + c)));
        }
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (!std::is_same_v<T, double>) {
        const __m256 scale = _mm256_set1_ps(inv);
        for (; c + 8 <= width; c += 8) {
          store8(o + c, _mm256_mul_ps(_mm256_loadu_ps(h.data() + c), scale));
          store8(o + c, _mm256_mul_ps(load8(o + c), load8(weight + c)));  // normed as rounded
        }
      }
#endif
      for (; c < width; ++c)
        o[c] = static_cast<T>(static_cast<T>(h[c] * inv) * static_cast<float>(weight[c]));
    }
  });
}

}  // namespace

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps) {
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = at::empty_like(xc), res = at::empty_like(rc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "add_rms_norm",
                                  [&] {
    norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), rc.data_ptr<scalar_t>(),
                        w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                        res.data_ptr<scalar_t>(), xc.numel() / xc.size(-1), xc.size(-1),
                        static_cast<float>(eps));
  });
  return {out, res};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto xc = x.contiguous();
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), nullptr, xc.numel() / xc.size(-1),
                        xc.size(-1), static_cast<float>(eps));
  });
  return out;
}
