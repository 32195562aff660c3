// int8 weight products y = x W^T with W = q * scale, the scales one per output row
// (--quantization int8) or one per block of 32 columns (a GGUF's Q8_0, whose fp16 scales fp32
// holds exactly), kept in fp32, and the sums fp32: the activations' bf16 rounds neither. The
// weights are repacked once (int8_pack) in records.h's layout: a row's 32 bytes, then its scale.
// On AVX-512 BF16 with VBMI a bf16 x past a decode step at 16 bits takes quant_panels.cpp's
// product instead, from the same records, which rounds each fp32 weight once to bf16.
#include <ATen/core/Tensor.h>

#include <cstring>

#include "integer_product.h"
#include "kernels.h"
#include "records.h"

namespace {

using records::kBlock;

// W in int8_pack's layout.
struct Int8W {
  const int8_t* blob;
  records::Layout layout;

  const int8_t* record(int64_t n, int64_t rows, int64_t k) const {
    return blob + layout.offset(n, rows, k);
  }
  const float* scales(int64_t n, int64_t rows, int64_t k) const {
    return reinterpret_cast<const float*>(record(n, rows, k) + rows * kBlock);
  }
  void prefetch(int64_t, int64_t) const {}  // one stream: the hardware prefetcher follows it

  // integer_product.h's interface: the values as they are, the scales beside.
  static constexpr bool kMins = false;
  static constexpr bool kSigned = true;
  const float* steps(int64_t n, int64_t rows, int64_t k) const { return scales(n, rows, k); }
#if defined(__AVX512BW__)
  __m512i widen32(int64_t n, int64_t rows, int64_t r, int64_t k) const {
    return _mm512_cvtepi8_epi16(bytes32(n, rows, r, k));
  }
  __m256i bytes32(int64_t n, int64_t rows, int64_t r, int64_t k) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record(n, rows, k) + r * kBlock));
  }
  // Rows [n, n + 16) (four whole records) at columns [k, k + 32), in words[p] lane r word p
  // (bytes 4p..4p+3) of row r, then the rows' scales: a record's 128 bytes are two vectors,
  // two permutes of the pair and records::lanes_across put each row's words in place.
  void whole(int64_t n, int64_t k, __m512i* words, float* steps, float*) const {
    // Lane p of t[j][h]: word 4h + p of each of record j's four rows.
    const __m512i across = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11,
                                             19, 27);
    __m512i t[2][4];
    for (int64_t j = 0; j < 4; ++j) {
      const int8_t* rec = record(n + 4 * j, 4, k);
      const __m512i front = _mm512_loadu_si512(rec), back = _mm512_loadu_si512(rec + 64);
      t[0][j] = _mm512_permutex2var_epi32(front, across, back);
      t[1][j] = _mm512_permutex2var_epi32(front, _mm512_add_epi32(across, _mm512_set1_epi32(4)),
                                          back);
      std::memcpy(steps + 4 * j, rec + 4 * kBlock, 4 * sizeof(float));
    }
    for (int64_t h = 0; h < 2; ++h)
      records::lanes_across(t[h], words + 4 * h);
  }
#endif
#if defined(__AVX512F__)
  template <int64_t rows>
  void load(int64_t n, int64_t k, __m512* lo, __m512* hi) const {
    const int8_t* rec = record(n, rows, k);
    const float* s = scales(n, rows, k);
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* p = rec + r * kBlock;
      const __m512 scale = _mm512_set1_ps(s[r]);
      lo[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), scale);
      hi[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))), scale);
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  void load(int64_t n, int64_t rows, int64_t r, int64_t k, __m256 (&v)[4]) const {
    const int8_t* p = record(n, rows, k) + r * kBlock;
    const __m256 scale = _mm256_set1_ps(scales(n, rows, k)[r]);
    for (int64_t e = 0; e < 4; ++e)
      v[e] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * e)))), scale);
  }

  void widen16(int64_t n, int64_t rows, int64_t r, int64_t k, __m256i (&w)[2]) const {
    const int8_t* p = record(n, rows, k) + r * kBlock;
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
#else
  void load(int64_t n, int64_t rows, int64_t r, int64_t k, float* out) const {
    const int8_t* p = record(n, rows, k) + r * kBlock;
    const float scale = scales(n, rows, k)[r];
    for (int64_t i = 0; i < kBlock; ++i) out[i] = static_cast<float>(p[i]) * scale;
  }
#endif
};

}  // namespace

at::Tensor int8_pack(const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.device().is_cpu(),
              "int8_pack: q int8 [N, K] on the CPU");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == q.size(0),
              "int8_pack: scales [N, groups] (one group: a scale per row)");
  const int64_t K = q.size(1);
  TORCH_CHECK(K % kBlock == 0, "int8_pack: K a multiple of 32, not ", K);
  return records::pack(q.view(at::kByte), {scales}, records::int8(K)).view(at::kChar);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& blob, int64_t activation_bits) {
  const records::Layout w =
      records::check("int8_linear", "int8_pack", x, blob, at::kChar, records::int8);
  if (quant_on_panels(x.scalar_type(), x.size(0), activation_bits))
    return quant_panel_linear(x, blob);
  return integer::linear(x, Int8W{blob.data_ptr<int8_t>(), w}, blob.size(0), activation_bits);
}
