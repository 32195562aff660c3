// int4 weight products y = x W^T with W = q * scale + min per group of columns (GGUF Q4_1's
// grid), everything after the nibbles in fp32: the file's scales and minimums are fp16, which
// fp32 holds exactly, and the sums are fp32, so nothing is rounded between the file and y.
#include <torch/extension.h>

#include <cmath>

#include "dequant_product.h"

namespace {

// Q4_1's block: 32 columns in 16 bytes, byte i holding column i (low nibble) and column i + 16
// (high nibble), so a block's two halves widen to two contiguous vectors of 16 columns.
constexpr int64_t kBlock = 32;
// W = q * scale + min, scales and mins [N, groups] in fp32, q [N, K / 2] in Q4_1 blocks.
struct Int4W {
  const uint8_t* q;
  const float *scales, *mins;
  int64_t K, groups;

  // Q4_1's groups are one block: a shift, where a division per block cost a fifth of the
  // product's time at one row.
  int64_t group(int64_t k) const { return K == groups * kBlock ? k / kBlock : k / (K / groups); }
  // The cache lines of W[n, k:k+32] and its scale and minimum, once a line.
  void prefetch(int64_t n, int64_t k) const {
    if (k % 128 == 0) __builtin_prefetch(q + n * (K / 2) + k / 2);
    if (k % 512 == 0) {
      __builtin_prefetch(scales + n * groups + group(k));
      __builtin_prefetch(mins + n * groups + group(k));
    }
  }
#if defined(__AVX512F__)
  void load32(int64_t n, int64_t k, __m512& lo, __m512& hi) const {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q + n * (K / 2) + k / 2)));
    const int64_t g = n * groups + group(k);
    // The block's 16 values q * scale + min, looked up by nibble (vpermps reads an index's
    // low 4 bits): one FMA for 32 columns, and the same fp32 values as converting each q.
    const __m512 values = _mm512_fmadd_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_ps(scales[g]), _mm512_set1_ps(mins[g]));
    lo = _mm512_permutexvar_ps(wide, values);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), values);
  }
#else
  void load32(int64_t n, int64_t k, float* out) const {
    const uint8_t* bytes = q + n * (K / 2) + k / 2;
    const int64_t g = n * groups + group(k);
    for (int64_t i = 0; i < kBlock / 2; ++i) {
      out[i] = std::fma(static_cast<float>(bytes[i] & 15), scales[g], mins[g]);
      out[i + 16] = std::fma(static_cast<float>(bytes[i] >> 4), scales[g], mins[g]);
    }
  }
#endif
};

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
                     Int4W{qp, sp, mp, K, groups});
  });
  return out;
}
