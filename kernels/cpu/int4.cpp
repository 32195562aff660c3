// int4 weight products y = x W^T with W = q * scale + min per group of columns (GGUF Q4_1's
// grid), everything after the nibbles in fp32: the file's scales and minimums are fp16, which
// fp32 holds exactly, and the sums are fp32, so nothing is rounded between the file and y.
#include <torch/extension.h>

#include "dequant_product.h"

namespace {

// Q4_1's block: 32 columns in 16 bytes, byte i holding column i (low nibble) and column i + 16
// (high nibble), so a block's two halves widen to two contiguous vectors of 16 columns.
constexpr int64_t kBlock = 32;

// W rows [n, n + rows) in fp32 into buf [rows][K].
void dequantize(const uint8_t* q, const float* scales, const float* mins, int64_t n,
                int64_t rows, int64_t K, int64_t groups, float* buf) {
  const int64_t per_group = K / groups;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* qr = q + (n + r) * (K / 2);
    const float* sr = scales + (n + r) * groups;
    const float* mr = mins + (n + r) * groups;
    float* out = buf + r * K;
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const int64_t g = b * kBlock / per_group;
      const float s = sr[g], m = mr[g];
      const uint8_t* bytes = qr + b * (kBlock / 2);
      float* o = out + b * kBlock;
#if defined(__AVX512F__)
      const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(bytes)));
      const __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
      _mm512_storeu_ps(o, _mm512_fmadd_ps(lo, vs, vm));
      _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(hi, vs, vm));
#else
      for (int64_t i = 0; i < kBlock / 2; ++i) {
        o[i] = static_cast<float>(bytes[i] & 15) * s + m;
        o[i + 16] = static_cast<float>(bytes[i] >> 4) * s + m;
      }
#endif
    }
  }
}

}  // namespace

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scales, const torch::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.scalar_type() == at::kByte,
              "int4_linear: x [M, K], q uint8 [N, K / 2]");
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scales.dim() == 2 &&
                  scales.sizes() == mins.sizes() && scales.size(1) > 0,
              "int4_linear: CPU tensors, scales and mins [N, groups]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), groups = scales.size(1);
  TORCH_CHECK(K % kBlock == 0 && q.size(1) * 2 == K, "int4_linear: K a multiple of 32, q [N, K/2]");
  TORCH_CHECK(scales.size(0) == N && K % groups == 0 && (K / groups) % kBlock == 0,
              "int4_linear: each of the groups a multiple of 32 columns");
  auto xf = x.to(at::kFloat).contiguous();  // M x K: a few rows, converted once
  auto qc = q.contiguous();
  auto sc = scales.to(at::kFloat).contiguous(), mc = mins.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_linear",
                                  [&] {
    const uint8_t* qp = qc.data_ptr<uint8_t>();
    const float *sp = sc.data_ptr<float>(), *mp = mc.data_ptr<float>();
    dequant::product(xf.data_ptr<float>(), M, K, N, out.data_ptr<scalar_t>(),
                     [&](int64_t n, int64_t rows, float* buf) {
                       dequantize(qp, sp, mp, n, rows, K, groups, buf);
                     });
  });
  return out;
}
