// A decoder layer of the Llama shape in one call, for the cpu backend (kernels/layer_cpu.py):
// the same kernels the Python layer (gpu_workers/llama.py) calls one by one, without a return
// to Python between them. At one token a step, a small model's layer spends more time in those
// returns (module calls, views, argument checks) than in its products.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/linear.h>

#include "kernels.h"

// Up to this many rows the vector product (gemv.cpp), which reads W once at the memory's pace,
// beats oneDNN; past it oneDNN's blocked GEMM, which reuses each W tile over many rows, wins.
constexpr int64_t kSmallRows = 4;
// AMX tiles read W in its plain layout at any row count, but past this many rows each W tile
// passes over more of x than the cache holds, and oneDNN's blocking wins (prefill chunks). For
// one row the vector product is faster: a tile pass computes 16 rows, 15 of them zeros.
constexpr int64_t kAmxRows = 128;

namespace {

// x W^T by oneDNN on W's blocked copy (torch.ops.mkldnn._linear_pointwise, as
// gpu_workers/packed.py calls it from Python).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, c10::IValue(), std::string("none"),
                          c10::List<std::optional<c10::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Whether oneDNN multiplies bf16 on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT):
// without it PyTorch's bf16 GEMM is a slow fallback.
bool onednn_bf16() {
  static const bool has = [] {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
        "mkldnn::_is_mkldnn_bf16_supported", "");
    torch::jit::Stack stack;
    op.callBoxed(&stack);
    return stack[0].toBool();
  }();
  return has;
}

}  // namespace

// x W^T on the product that is fastest for its rows (bench.cpu_kernels_bench). Where the model
// keeps W's panels in `packed` (panel_pack, AVX-512 BF16 without AMX), panel_linear at every
// row count (one row streams W at the copy bandwidth, 1.25x the vector product), and `weight`
// may hold no data (only its shape is read). Else bf16 on AMX tiles from 2 to kAmxRows rows
// where the CPU has them, the vector product up to kSmallRows rows, and oneDNN past them: on
// its blocked copy of W where the model keeps one (1.2-1.3x the plain weight's product at
// 64-128 rows), or on the plain W (and for other dtypes). Where oneDNN has no bf16 path, the
// rows past kSmallRows take bf16_linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& packed) {
  if (packed && !packed->is_mkldnn()) return panel_linear(x, *packed, weight.size(0));
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) {
    static const bool amx = amx_available();
    const int64_t rows = x.size(0);
    if (amx && rows > 1 && rows <= kAmxRows && x.size(1) % 32 == 0) return amx_linear(x, weight);
    if (rows <= kSmallRows) return small_m_linear(x, weight);
    if (packed) return onednn_linear(x, *packed);
    if (!onednn_bf16() && x.size(1) % 32 == 0) return bf16_linear(x, weight);
  }
  return at::linear(x, weight);
}

// The most rows of x that linear() gives to the C++ products (-1: every row count).
int64_t cpp_rows() { return amx_available() ? kAmxRows : onednn_bf16() ? kSmallRows : -1; }

namespace {

// A projection's weights: [W] or [W, oneDNN's copy] (bf16), [int8_pack's int8 blob] or
// [int4_pack's uint8 blob] (their products rounding x to activation_bits).
at::Tensor project(const at::Tensor& x, const std::vector<at::Tensor>& w,
                   int64_t activation_bits) {
  TORCH_CHECK(w.size() == 1 || w.size() == 2, "a projection is [W], [W, packed W] or [blob]");
  if (w[0].scalar_type() == at::kChar) return int8_linear(x, w[0], activation_bits);
  if (w[0].scalar_type() == at::kByte) return int4_linear(x, w[0], activation_bits);
  return ::linear(x, w[0], w.size() == 2 ? std::optional<at::Tensor>(w[1]) : std::nullopt);
}

}  // namespace

// x [T, hidden], residual (None before the first layer) -> (x, residual) for the next layer:
// norm, qkv, rotary with the K/V store, paged attention over every row (rows: their tables
// row seq_of and visible keys, decode and prefill alike; the first shared_rows begin with
// shared_keys keys in common), o, norm, gate_up, SiLU * up, down (int4 and int8 projections
// rounding x to activation_bits).
std::vector<at::Tensor> decoder_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const at::Tensor& input_norm, const std::vector<at::Tensor>& qkv,
    const std::vector<at::Tensor>& o, const at::Tensor& mlp_norm,
    const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
    int64_t activation_bits, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
    const at::Tensor& tables, const at::Tensor& seq_of, const at::Tensor& visible,
    int64_t shared_rows, int64_t shared_keys, int64_t heads, double eps, double scale,
    int64_t window, double softcap) {
  at::Tensor h, res;
  if (residual) {
    auto normed = add_rms_norm(x, *residual, input_norm, eps);
    h = normed[0];
    res = normed[1];
  } else {
    h = rms_norm(x, input_norm, eps);
    res = x;
  }
  const int64_t t = x.size(0), kv_heads = k_cache.size(0), dim = k_cache.size(3);
  auto q_k_v = project(h, qkv, activation_bits).view({t, heads + 2 * kv_heads, dim});
  rotate_and_store(q_k_v.narrow(1, 0, heads + kv_heads),
                   q_k_v.narrow(1, heads + kv_heads, kv_heads), cos, sin, k_cache, v_cache,
                   slots);
  auto attended = paged_attention(q_k_v.narrow(1, 0, heads), k_cache, v_cache, tables, seq_of,
                                  visible, scale, window, softcap, shared_rows, shared_keys);
  auto normed = add_rms_norm(project(attended.view({t, heads * dim}), o, activation_bits), res,
                             mlp_norm, eps);
  // On W's panels, SiLU * up as gate_up's tiles are stored: no [t, 2F] pass between them and
  // one parallel region fewer a layer (~3% of a 64-sequence step).
  auto up = gate_up.size() == 2 && !gate_up[1].is_mkldnn() &&
                    panel_silu_fits(gate_up[1], gate_up[0].size(0))
                ? panel_silu_linear(normed[0], gate_up[1], gate_up[0].size(0))
                : silu_mul(project(normed[0], gate_up, activation_bits));
  return {project(up, down, activation_bits), normed[1]};
}
