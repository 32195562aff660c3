// The gated MLP's activation, SiLU(gate) * up, in one pass over the gate_up projection's output
// (the reference splits it, applies SiLU, multiplies: three passes and two roundings).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>

#include "vec_math.h"

namespace {

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      int64_t c = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        for (; c + 16 <= width; c += 16) {
          const __m512 g = load_bf16(gate + c), u = load_bf16(up + c);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
          store_bf16(o + c, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(e, _mm512_set1_ps(1.0f))),
                                          u));
        }
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (!std::is_same_v<T, double>) {  // bf16 too: the default dtype on AVX2 CPUs
        for (; c + 8 <= width; c += 8) {
          const __m256 g = load8(gate + c), u = load8(up + c);
          const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
          const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
          store8(o + c, _mm256_mul_ps(silu, u));
        }
      }
#endif
      for (; c < width; ++c) {
        const float g = static_cast<float>(gate[c]);
        o[c] = static_cast<T>(g / (1.0f + std::exp(-g)) * static_cast<float>(up[c]));
      }
    }
  });
}

}  // namespace

// x [T, 2F] (gate columns, then up columns) -> [T, F].
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: x [T, 2F]");
  auto xc = x.contiguous();
  const int64_t rows = xc.size(0), width = xc.size(1) / 2;
  auto out = at::empty({rows, width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width);
  });
  return out;
}
