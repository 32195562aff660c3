// The kernels of this extension, as bindings.cpp exposes them and layer.cpp strings them
// together (each is defined in the file of its family).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_of, const at::Tensor& visible,
                           double scale, int64_t window, double softcap, int64_t shared_rows,
                           int64_t shared_keys);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight);
std::string gemv_isa();
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight);
bool panels_available();
at::Tensor panel_pack(const at::Tensor& weight);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n);
bool panel_silu_fits(const at::Tensor& panels, int64_t n);
at::Tensor panel_silu_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n);
bool amx_available();
at::Tensor silu_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& logits);
at::Tensor random_pick(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p, const at::Tensor& seeds,
                       const at::Tensor& positions);
void rotate_and_store(at::Tensor qk, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                      const at::Tensor& slots);
at::Tensor int4_pack(const at::Tensor& q, const at::Tensor& scales,
                     const at::Tensor& mins);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& blob,
                       int64_t activation_bits);
int64_t activation_bits(int64_t rows, int64_t asked, bool bf16_x);
bool quant_on_panels(at::ScalarType x, int64_t rows, int64_t activation_bits);
at::Tensor quant_panel_linear(const at::Tensor& x, const at::Tensor& blob);
at::Tensor int8_pack(const at::Tensor& q, const at::Tensor& scales);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& blob,
                       int64_t activation_bits);
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& packed);
int64_t cpp_rows();
int64_t widen_rows();
std::vector<at::Tensor> decoder_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const at::Tensor& input_norm, const std::vector<at::Tensor>& qkv,
    const std::vector<at::Tensor>& o, const at::Tensor& mlp_norm,
    const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
    int64_t activation_bits, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
    const at::Tensor& tables, const at::Tensor& seq_of, const at::Tensor& visible,
    int64_t shared_rows, int64_t shared_keys, int64_t heads, double eps, double scale,
    int64_t window, double softcap);
