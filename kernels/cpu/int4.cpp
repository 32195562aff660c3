// int4 weight products y = x W^T with W = q * scale + min per group of columns (GGUF Q4_1's
// grid), everything after the nibbles in fp32: the file's scales and minimums are fp16, which
// fp32 holds exactly, and the sums are fp32, so nothing is rounded between the file and y.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Q4_1's block: 32 columns in 16 bytes, byte i holding column i (low nibble) and column i + 16
// (high nibble), so a block's two halves widen to two contiguous vectors of 16 columns.
constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 4;  // W rows a task dequantizes at once (into a buffer L1 holds)
constexpr int64_t kTile = 4;  // x rows per pass over that buffer (16 accumulators)

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

// tile x rows (fp32) against `rows` dequantized W rows; K is a multiple of kBlock.
template <int64_t tile, typename T>
void dot_block(const float* x, int64_t K, const float* w, int64_t rows, T* out, int64_t ldo) {
#if defined(__AVX512F__)
  __m512 acc[tile][kRows];
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      wv[r] = r < rows ? _mm512_loadu_ps(w + r * K + k) : _mm512_setzero_ps();
    for (int64_t m = 0; m < tile; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < rows; ++r)
      out[m * ldo + r] = static_cast<T>(_mm512_reduce_add_ps(acc[m][r]));
#else
  for (int64_t m = 0; m < tile; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[r * K + k];
      out[m * ldo + r] = static_cast<T>(s);
    }
#endif
}

template <typename T>
void int4_rows(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scales,
               const float* mins, int64_t N, int64_t groups, T* out) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kRows * K);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kRows, rows = std::min(kRows, N - n);
      dequantize(q, scales, mins, n, rows, K, groups, buf.data());
      int64_t m = 0;
      for (; m + kTile <= M; m += kTile)
        dot_block<kTile>(x + m * K, K, buf.data(), rows, out + m * N + n, N);
      switch (M - m) {
        case 3: dot_block<3>(x + m * K, K, buf.data(), rows, out + m * N + n, N); break;
        case 2: dot_block<2>(x + m * K, K, buf.data(), rows, out + m * N + n, N); break;
        case 1: dot_block<1>(x + m * K, K, buf.data(), rows, out + m * N + n, N); break;
        default: break;
      }
    }
  });
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
    int4_rows<scalar_t>(xf.data_ptr<float>(), M, K, qc.data_ptr<uint8_t>(),
                        sc.data_ptr<float>(), mc.data_ptr<float>(), N, groups,
                        out.data_ptr<scalar_t>());
  });
  return out;
}
