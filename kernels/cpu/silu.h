// SiLU(gate) * up over one row's columns, shared by silu_mul (activation.cpp) and the gate_up
// panel product that applies it as it stores (panels.cpp): the same roundings in both.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <type_traits>

#include "vec_math.h"

template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* o, int64_t width) {
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
