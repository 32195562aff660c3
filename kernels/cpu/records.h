// Quantized weights repacked once (int4_pack, int8_pack) so that a product reads them in one
// stream: for each dequant::kRows W rows ("a row block", fewer in a matrix's last) and each
// block of 32 columns, a record of those rows' values (a row's `bytes` in turn), then each of
// their per-block floats (scales, then minimums where the format has them), `rows` floats
// each. With the values, scales and minimums in separate arrays, the kRows interleaved rows
// made six streams that the hardware prefetcher did not keep ahead of: from memory at one row,
// int4 in this layout is 1.6x (3072 x 576) and 2.5x (576 x 1536) faster, with the same bits.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "dequant_product.h"

namespace records {

constexpr int64_t kBlock = 32;

// A format's records over W [N, K]: `bytes` of values per row and block, then `floats` floats.
struct Layout {
  int64_t K, bytes, floats;

  int64_t row_bytes() const { return bytes + floats * int64_t{sizeof(float)}; }
  // The record of W rows [n, n + rows) (a row block) at columns [k, k + 32).
  int64_t offset(int64_t n, int64_t rows, int64_t k) const {
    return (n * (K / kBlock) + (k / kBlock) * rows) * row_bytes();
  }
};

// int4's records (int4.cpp): a row's 16 bytes of nibbles, then its scale and minimum a block.
inline Layout int4(int64_t K) { return {K, kBlock / 2, 2}; }

// int8's records (int8.cpp): a row's 32 values, then its scale a block.
inline Layout int8(int64_t K) { return {K, kBlock, 1}; }

// values [N, K / 32 * bytes] (uint8: each block's bytes in turn) and each of `per_block`
// [N, groups] (a group a multiple of 32 columns: its float serves each of its blocks) in the
// layout's records, one uint8 tensor [N, K / 32 * row_bytes].
inline at::Tensor pack(const at::Tensor& values, const std::vector<at::Tensor>& per_block,
                       const Layout& layout) {
  const int64_t N = values.size(0), K = layout.K, blocks = K / kBlock;
  TORCH_CHECK(values.size(1) == blocks * layout.bytes, "pack: ", layout.bytes,
              " bytes a block of 32 columns");
  auto data = values.contiguous();
  std::vector<at::Tensor> floats;
  for (const auto& f : per_block) {
    TORCH_CHECK(f.dim() == 2 && f.size(0) == N && f.size(1) > 0 && K % f.size(1) == 0 &&
                    (K / f.size(1)) % kBlock == 0,
                "pack: scales [N, groups], each group a multiple of 32 columns");
    floats.push_back(f.to(at::kFloat).contiguous());
  }
  auto blob = at::empty({N, blocks * layout.row_bytes()}, values.options());
  uint8_t* out = blob.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = n - n % dequant::kRows, r = n - first;
      const int64_t rows = std::min(dequant::kRows, N - first);
      uint8_t* rec = out + layout.offset(first, rows, b * kBlock);
      std::memcpy(rec + r * layout.bytes,
                  data.data_ptr<uint8_t>() + (n * blocks + b) * layout.bytes, layout.bytes);
      auto* slots = reinterpret_cast<float*>(rec + rows * layout.bytes);
      for (size_t j = 0; j < floats.size(); ++j) {
        const int64_t groups = floats[j].size(1);
        slots[j * rows + r] = floats[j].data_ptr<float>()[n * groups + b * groups / blocks];
      }
    }
  return blob;
}

#if defined(__AVX512F__)
// The 4 x 4 128-bit lanes of t transposed: out[p] is lane p of t[0], t[1], t[2] and t[3] in
// turn. The last step of putting 16 rows' words in lanes: four vectors whose lane p holds
// word p of four rows each (a record's, or a quad's) give word p of all 16.
inline void lanes_across(const __m512i (&t)[4], __m512i* out) {
  const __m512i a = _mm512_shuffle_i32x4(t[0], t[1], 0x44), b = _mm512_shuffle_i32x4(t[0], t[1], 0xEE);
  const __m512i c = _mm512_shuffle_i32x4(t[2], t[3], 0x44), d = _mm512_shuffle_i32x4(t[2], t[3], 0xEE);
  out[0] = _mm512_shuffle_i32x4(a, c, 0x88);
  out[1] = _mm512_shuffle_i32x4(a, c, 0xDD);
  out[2] = _mm512_shuffle_i32x4(b, d, 0x88);
  out[3] = _mm512_shuffle_i32x4(b, d, 0xDD);
}
#endif

// What a product over a packed blob checks before reading it: x [M, K] and the blob (of `type`,
// contiguous) on the CPU, the blob packed by `pack` for x's K columns (named, rather than read
// past); the format's layout (`layout(K)`) for x.
inline Layout check(const char* product, const char* pack, const at::Tensor& x,
                    const at::Tensor& blob, at::ScalarType type, Layout (*layout)(int64_t)) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && blob.dim() == 2 &&
                  blob.scalar_type() == type && blob.is_contiguous(),
              product, ": x [M, K] and ", pack, "'s weights, on the CPU");
  const int64_t K = x.size(1);
  const Layout w = layout(K);
  TORCH_CHECK(K % kBlock == 0 && blob.size(1) == K / kBlock * w.row_bytes(), product,
              ": the weights were packed for ", blob.size(1) / w.row_bytes() * kBlock,
              " columns, x has ", K);
  return w;
}

}  // namespace records
