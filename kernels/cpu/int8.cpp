// int8 weight products y = x W^T with W = q * scale per output row (--quantization int8), the
// scales kept in fp32 and the sums fp32: the activations' bf16 rounds neither.
#include <torch/extension.h>

#include "integer_product.h"

namespace {

// W = q * scale, q int8 [N, K], scales [N] in fp32.
struct Int8W {
  const int8_t* q;
  const float* scales;
  int64_t K;

  // The cache line of W[n, k:k+32], once a line.
  void prefetch(int64_t n, int64_t k) const {
    if (k % 64 == 0) __builtin_prefetch(q + n * K + k);
  }
#if defined(__AVX512F__)
  template <int64_t rows>
  void load(int64_t n, int64_t k, __m512* lo, __m512* hi) const {
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* p = q + (n + r) * K + k;
      const __m512 s = _mm512_set1_ps(scales[n + r]);
      lo[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), s);
      hi[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))), s);
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  void load(int64_t n, int64_t, int64_t r, int64_t k, __m256 (&v)[4]) const {
    const int8_t* p = q + (n + r) * K + k;
    const __m256 s = _mm256_set1_ps(scales[n + r]);
    for (int64_t e = 0; e < 4; ++e)
      v[e] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * e)))), s);
  }

  // integer_product.h's interface: a row's scale serves each of its blocks.
  static constexpr bool kMins = false;
  void widen16(int64_t n, int64_t, int64_t r, int64_t k, __m256i (&w)[2]) const {
    const int8_t* p = q + (n + r) * K + k;
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  const float* steps(int64_t n, int64_t, int64_t) const { return scales + n; }
#else
  void load(int64_t n, int64_t, int64_t r, int64_t k, float* out) const {
    for (int64_t i = 0; i < 32; ++i)
      out[i] = static_cast<float>(q[(n + r) * K + k + i]) * scales[n + r];
  }
#endif
};

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.scalar_type() == at::kChar &&
                  x.size(1) == q.size(1),
              "int8_linear: x [M, K], q int8 [N, K]");
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scales.dim() == 1 &&
                  scales.size(0) == q.size(0),
              "int8_linear: CPU tensors, scales [N]");
  const int64_t K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % 32 == 0, "int8_linear: K a multiple of 32");
  auto qc = q.contiguous();
  auto sc = scales.to(at::kFloat).contiguous();
  return integer::linear(x, Int8W{qc.data_ptr<int8_t>(), sc.data_ptr<float>(), K}, N);
}
