// The kernels of this extension, as bindings.cpp exposes them and layer.cpp strings them
// together (each is defined in the file of its family).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_of, const torch::Tensor& visible,
                              double scale, int64_t window, double softcap, int64_t shared_rows,
                              int64_t shared_keys);
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& weight);
std::string gemv_isa();
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& weight);
bool amx_available();
torch::Tensor silu_mul(const torch::Tensor& x);
torch::Tensor argmax_rows(const torch::Tensor& logits);
torch::Tensor random_pick(const torch::Tensor& logits, const torch::Tensor& temperature,
                          const torch::Tensor& top_k, const torch::Tensor& top_p,
                          const torch::Tensor& min_p, const torch::Tensor& seeds,
                          const torch::Tensor& positions);
void rotate_and_store(torch::Tensor qk, const torch::Tensor& v, const torch::Tensor& cos,
                      const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                      const torch::Tensor& slots);
torch::Tensor int4_pack(const torch::Tensor& q, const torch::Tensor& scales,
                        const torch::Tensor& mins);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& blob);
bool rounds_activations();
torch::Tensor int8_pack(const torch::Tensor& q, const torch::Tensor& scales);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& blob);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const std::optional<torch::Tensor>& packed);
int64_t cpp_rows();
int64_t widen_rows();
std::vector<torch::Tensor> decoder_layer(
    const torch::Tensor& x, const std::optional<torch::Tensor>& residual,
    const torch::Tensor& input_norm, const std::vector<torch::Tensor>& qkv,
    const std::vector<torch::Tensor>& o, const torch::Tensor& mlp_norm,
    const std::vector<torch::Tensor>& gate_up, const std::vector<torch::Tensor>& down,
    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_cache,
    const torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& tables,
    const torch::Tensor& seq_of, const torch::Tensor& visible, int64_t shared_rows,
    int64_t shared_keys, int64_t heads, double eps, double scale, int64_t window, double softcap);
