// int8 weight products y = x W^T with W = q * scale per output row (--quantization int8), the
// scales kept in fp32 and the sums fp32: the activations' bf16 rounds neither.
#include <torch/extension.h>

#include "dequant_product.h"

namespace {

// W rows [n, n + rows) in fp32 into buf [rows][K]; K is a multiple of 16.
void dequantize(const int8_t* q, const float* scales, int64_t n, int64_t rows, int64_t K,
                float* buf) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* qr = q + (n + r) * K;
    const float s = scales[n + r];
    float* out = buf + r * K;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(s);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(qr + k)));
      _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), vs));
    }
#else
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<float>(qr[k]) * s;
#endif
  }
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.scalar_type() == at::kChar &&
                  x.size(1) == q.size(1),
              "int8_linear: x [M, K], q int8 [N, K]");
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scales.dim() == 1 &&
                  scales.size(0) == q.size(0),
              "int8_linear: CPU tensors, scales [N]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % 16 == 0, "int8_linear: K a multiple of 16");
  auto xf = x.to(at::kFloat).contiguous();
  auto qc = q.contiguous();
  auto sc = scales.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear",
                                  [&] {
    const int8_t* qp = qc.data_ptr<int8_t>();
    const float* sp = sc.data_ptr<float>();
    dequant::product(xf.data_ptr<float>(), M, K, N, out.data_ptr<scalar_t>(),
                     [&](int64_t n, int64_t rows, float* buf) {
                       dequantize(qp, sp, n, rows, K, buf);
                     });
  });
  return out;
}
