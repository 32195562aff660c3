// RMSNorm, alone and fused with the residual add: one pass over each row, float32 sums.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>

namespace {

// With residual: h = x + residual is stored to residual_out (in the input dtype, as the
// reference rounds it) and normalised; without, x itself is.
template <typename T>
void norm_rows(const T* x, const T* residual, const T* weight, T* out, T* residual_out,
               int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      float sq = 0.0f;
      for (int64_t c = 0; c < width; ++c) {
        float v = static_cast<float>(xr[c]);
        if (residual != nullptr) {
          const T sum = static_cast<T>(v + static_cast<float>(residual[r * width + c]));
          residual_out[r * width + c] = sum;
          v = static_cast<float>(sum);
        }
        h[c] = v;
        sq += v * v;
      }
      const float inv = 1.0f / std::sqrt(sq / static_cast<float>(width) + eps);
      T* o = out + r * width;
      for (int64_t c = 0; c < width; ++c)
        o[c] = static_cast<T>(static_cast<T>(h[c] * inv) * static_cast<float>(weight[c]));
    }
  });
}

}  // namespace

std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps) {
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(xc), res = torch::empty_like(rc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "add_rms_norm",
                                  [&] {
    norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), rc.data_ptr<scalar_t>(),
                        w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                        res.data_ptr<scalar_t>(), xc.numel() / xc.size(-1), xc.size(-1),
                        static_cast<float>(eps));
  });
  return {out, res};
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto xc = x.contiguous();
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), nullptr, xc.numel() / xc.size(-1),
                        xc.size(-1), static_cast<float>(eps));
  });
  return out;
}
