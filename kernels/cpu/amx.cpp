// bf16 products y = x W^T on AMX tiles, reading W in its plain [N, K] layout: W is the A
// operand (16 of its rows by 32 columns form a tile, loaded with W's own row stride), and x is
// repacked once a call into the B operand's pair-interleaved layout, so no reorder of W is
// ever needed (oneDNN reorders a plain W on every call, or keeps a second, packed copy).
// The tiles compute y^T = W x^T, 16 features by 16 rows of x at a time, summed in fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SURGE_AMX 1
#endif

namespace {

#if defined(SURGE_AMX)
constexpr int64_t kN = 16;  // W rows per A tile (and C tile rows)
constexpr int64_t kK = 32;  // bf16 columns per A tile row (64 bytes)
constexpr int64_t kM = 16;  // x rows per B tile (C tile columns)

// The 64-byte tile configuration: tiles 0-3 are C (16 x 16 fp32: two W tiles by two x tiles),
// 4-5 are A (16 rows of W each), 6-7 are B (16 pairs of K by 16 rows of x, interleaved). Two
// of each, so every loaded tile serves two products and no product waits on a reused tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// x [M, K] -> B tiles [M / 16 (rounded up)][K / 32][16 pairs][16 rows][2]: element (m, k) at
// pair k / 2 of its tile, lane k % 2; rows past M are zero.
std::vector<at::BFloat16> pack_x(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t mtiles = (M + kM - 1) / kM, ktiles = K / kK;
  std::vector<at::BFloat16> packed(mtiles * ktiles * kK * kM, at::BFloat16(0.0f));
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x);  // K is even
  uint32_t* out = reinterpret_cast<uint32_t*>(packed.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kt = 0; kt < ktiles; ++kt)
      for (int64_t p = 0; p < kK / 2; ++p)
        out[((m / kM) * ktiles + kt) * (kK / 2) * kM + p * kM + m % kM] =
            pairs[(m * K + kt * kK) / 2 + p];
  return packed;
}

// y rows [m0, m0 + 16 * mtiles) (those below M) x features [n, n + 32) (those below N): W's
// 32 rows from w (row stride ldw elements); x's B tiles from xb, ktiles apart.
template <int mtiles>
void tile_block(const at::BFloat16* w, int64_t ldw, const at::BFloat16* xb, int64_t ktiles,
                int64_t m0, int64_t M, int64_t n, int64_t N, at::BFloat16* out) {
  constexpr int64_t tile = kK * kM;  // elements of one B tile
  _tile_zero(0);
  _tile_zero(1);
  if (mtiles > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    _tile_loadd(4, w + kt * kK, ldw * 2);
    _tile_loadd(5, w + kN * ldw + kt * kK, ldw * 2);
    _tile_loadd(6, xb + kt * tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (mtiles > 1) {
      _tile_loadd(7, xb + (ktiles + kt) * tile, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][kN][kM];  // [W tile + 2 * x tile][feature][row of x]
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (mtiles > 1) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  // C holds y^T: gather each row of x's 16 sums (a column of C) and round them to bf16 once,
  // from fp32, as oneDNN's product rounds them.
  const int64_t rows_m = std::min<int64_t>(mtiles * kM, M - m0);
  const int64_t rows_n = std::min<int64_t>(2 * kN, N - n);
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(kM),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                              10, 11, 12, 13, 14, 15));
  for (int64_t m = 0; m < rows_m; ++m)
    for (int64_t half = 0; half * kN < rows_n; ++half) {
      const float* base = &c[half + 2 * (m / kM)][0][m % kM];
      const __m256i sums = (__m256i)_mm512_cvtneps_pbh(_mm512_i32gather_ps(column, base, 4));
      const int64_t count = std::min<int64_t>(kN, rows_n - half * kN);
      _mm256_mask_storeu_epi16(out + (m0 + m) * N + n + half * kN,
                               static_cast<__mmask16>((1u << count) - 1), sums);
    }
}

// Linux hands out the AMX register state only to processes that ask (once, for all threads).
bool request_amx() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

}  // namespace

bool amx_available() {
#if defined(SURGE_AMX)
  static const bool granted = request_amx();
  return granted;
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(amx_available(), "amx_linear: this CPU (or kernel) gives no AMX tiles");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "amx_linear takes bfloat16 x and weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "amx_linear: x [M, K] and weight [N, K]");
#if defined(SURGE_AMX)
  auto xc = x.contiguous(), wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  TORCH_CHECK(K % kK == 0, "amx_linear: K a multiple of 32");
  auto out = at::empty({M, N}, x.options());
  const std::vector<at::BFloat16> xp = pack_x(xc.data_ptr<at::BFloat16>(), M, K);
  const at::BFloat16* wp = wc.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t ktiles = K / kK, blocks = (N + 2 * kN - 1) / (2 * kN);
  // Grain 2 blocks (64 features): the smallest projections still spread over every thread.
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    configure_tiles();  // per thread: the configuration is thread state
    std::vector<at::BFloat16> tail;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * 2 * kN;
      const at::BFloat16* w = wp + n * K;
      if (N - n < 2 * kN) {  // a last block short of 32 rows: padded with zero rows
        tail.assign(2 * kN * K, at::BFloat16(0.0f));
        std::memcpy(tail.data(), w, (N - n) * K * sizeof(at::BFloat16));
        w = tail.data();
      }
      // 32 rows of x a pass; past them the same 32 W rows are read again, from cache.
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kM) {
        const at::BFloat16* xb = xp.data() + (m0 / kM) * ktiles * kK * kM;
        if (M - m0 > kM)
          tile_block<2>(w, K, xb, ktiles, m0, M, n, N, op);
        else
          tile_block<1>(w, K, xb, ktiles, m0, M, n, N, op);
      }
    }
    _tile_release();
  });
  return out;
#else
  return at::Tensor();
#endif
}
