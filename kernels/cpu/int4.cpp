// int4 weight products y = x W^T with W = q * scale + min per group of columns (GGUF Q4_1's
// grid), everything after the nibbles in fp32: the file's scales and minimums are fp16, which
// fp32 holds exactly, and the sums are fp32, so nothing of W is rounded between the file and y
// (x is, where the products sum in integers: integer_product.h). The weights are repacked
// once (int4_pack) in records.h's layout: a row's 16 bytes of nibbles, then scales and minimums.
// On AVX-512 BF16 with VBMI a bf16 x past a decode step at 16 bits takes quant_panels.cpp's
// product instead, from the same records, which rounds each fp32 weight once to bf16.
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstring>

#include "integer_product.h"
#include "kernels.h"
#include "records.h"

namespace {

// Q4_1's block: 32 columns in 16 bytes, byte i holding column i (low nibble) and column i + 16
// (high nibble), so a block's two halves widen to two contiguous vectors of 16 columns.
using records::kBlock;

// W in int4_pack's layout.
struct Int4W {
  const uint8_t* blob;
  records::Layout layout;

  const uint8_t* record(int64_t n, int64_t rows, int64_t k) const {
    return blob + layout.offset(n, rows, k);
  }
  void prefetch(int64_t, int64_t) const {}  // one stream: the hardware prefetcher follows it

  // integer_product.h's interface: the nibbles as they are, the steps and minimums beside.
  static constexpr bool kMins = true;
  static constexpr bool kSigned = false;
  const float* steps(int64_t n, int64_t rows, int64_t k) const {
    return reinterpret_cast<const float*>(record(n, rows, k) + rows * kBlock / 2);
  }
  const float* mins(int64_t n, int64_t rows, int64_t k) const { return steps(n, rows, k) + rows; }
#if defined(__AVX512BW__)
  __m512i widen32(int64_t n, int64_t rows, int64_t r, int64_t k) const {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(record(n, rows, k) + r * kBlock / 2)));
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(15))),
        _mm256_srli_epi16(bytes, 4), 1);
  }
  __m256i bytes32(int64_t n, int64_t rows, int64_t r, int64_t k) const {
    const __m128i bytes = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(record(n, rows, k) + r * kBlock / 2));
    const __m128i low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low),
                            _mm_and_si128(bytes, low));
  }
  // Rows [n, n + 16) (four whole records) at columns [k, k + 32) as bytes32 gives them, in
  // words[p] lane r word p of row r: p < 4 the low nibbles of its bytes 4p..4p+3, p >= 4 the
  // high ones of bytes 4(p - 4)..; then the rows' steps and minimums. A record's 64 bytes of
  // nibbles are one vector (row r' in 128-bit lane r'), so a permute a record and eight lane
  // shuffles do what transposing the 16 rows one at a time did (14% of a 64-row product).
  void whole(int64_t n, int64_t k, __m512i* words, float* steps, float* mins) const {
    // Lane p of t[j]: dword p of each of record j's four rows.
    const __m512i across = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i t[4];
    for (int64_t j = 0; j < 4; ++j) {
      const uint8_t* rec = record(n + 4 * j, 4, k);
      t[j] = _mm512_permutexvar_epi32(across, _mm512_loadu_si512(rec));
      std::memcpy(steps + 4 * j, rec + 4 * kBlock / 2, 4 * sizeof(float));
      std::memcpy(mins + 4 * j, rec + 4 * kBlock / 2 + 4 * sizeof(float), 4 * sizeof(float));
    }
    __m512i dwords[4];
    records::lanes_across(t, dwords);
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t p = 0; p < 4; ++p) {
      words[p] = _mm512_and_si512(dwords[p], low);
      words[4 + p] = _mm512_and_si512(_mm512_srli_epi16(dwords[p], 4), low);
    }
  }
#endif
#if defined(__AVX512F__)
  template <int64_t rows>
  void load(int64_t n, int64_t k, __m512* lo, __m512* hi) const {
    const uint8_t* rec = record(n, rows, k);
    const float* scales = reinterpret_cast<const float*>(rec + rows * kBlock / 2);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(rec + r * kBlock / 2)));
      // The block's 16 values q * scale + min, looked up by nibble (vpermps reads an index's
      // low 4 bits): one FMA for 32 columns, and the same fp32 values as converting each q.
      const __m512 values = _mm512_fmadd_ps(
          _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_ps(scales[r]), _mm512_set1_ps(scales[rows + r]));
      lo[r] = _mm512_permutexvar_ps(wide, values);
      hi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), values);
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  void load(int64_t n, int64_t rows, int64_t r, int64_t k, __m256 (&v)[4]) const {
    const uint8_t* rec = record(n, rows, k);
    const float* scales = reinterpret_cast<const float*>(rec + rows * kBlock / 2);
    const __m256 scale = _mm256_set1_ps(scales[r]), min = _mm256_set1_ps(scales[rows + r]);
    // Byte i holds columns i (low nibble) and i + 16 (high); q * scale + min in one rounding.
    for (int64_t e = 0; e < 2; ++e) {
      const __m256i bytes = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + r * kBlock / 2 + 8 * e)));
      v[e] = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))), scale, min);
      v[e + 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), scale, min);
    }
  }

  void widen16(int64_t n, int64_t rows, int64_t r, int64_t k, __m256i (&w)[2]) const {
    // Widened to 16 bits first: the high nibble is then a shift, the low one a mask.
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(record(n, rows, k) + r * kBlock / 2)));
    w[0] = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
    w[1] = _mm256_srli_epi16(bytes, 4);
  }
#else
  void load(int64_t n, int64_t rows, int64_t r, int64_t k, float* out) const {
    const uint8_t* rec = record(n, rows, k);
    const float* scales = reinterpret_cast<const float*>(rec + rows * kBlock / 2);
    const uint8_t* bytes = rec + r * kBlock / 2;
    for (int64_t i = 0; i < kBlock / 2; ++i) {
      out[i] = std::fma(static_cast<float>(bytes[i] & 15), scales[r], scales[rows + r]);
      out[i + 16] = std::fma(static_cast<float>(bytes[i] >> 4), scales[r], scales[rows + r]);
    }
  }
#endif
};

}  // namespace

at::Tensor int4_pack(const at::Tensor& q, const at::Tensor& scales,
                     const at::Tensor& mins) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.device().is_cpu(),
              "int4_pack: q uint8 [N, K / 2] on the CPU, in Q4_1 blocks");
  TORCH_CHECK(scales.dim() == 2 && scales.sizes() == mins.sizes() && scales.size(0) == q.size(0),
              "int4_pack: scales and mins [N, groups]");
  return records::pack(q, {scales, mins}, records::int4(q.size(1) * 2));
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& blob, int64_t activation_bits) {
  const records::Layout w =
      records::check("int4_linear", "int4_pack", x, blob, at::kByte, records::int4);
  if (quant_on_panels(x.scalar_type(), x.size(0), activation_bits))
    return quant_panel_linear(x, blob);
  return integer::linear(x, Int4W{blob.data_ptr<uint8_t>(), w}, blob.size(0), activation_bits);
}

int64_t activation_bits(int64_t rows, int64_t asked, bool bf16_x) {
  if (bf16_x && quant_on_panels(at::kBFloat16, rows, asked)) return 0;
  return integer::x_bits(rows, asked);
}
