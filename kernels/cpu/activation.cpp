// The gated MLP's activation, SiLU(gate) * up, in one pass over the gate_up projection's output
// (the reference splits it, applies SiLU, multiplies: three passes and two roundings).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "silu.h"

namespace {

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_mul_row(x + r * 2 * width, x + r * 2 * width + width, out + r * width, width);
  });
}

}  // namespace

// x [T, 2F] (gate columns, then up columns) -> [T, F].
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: x [T, 2F]");
  auto xc = x.contiguous();
  const int64_t rows = xc.size(0), width = xc.size(1) / 2;
  auto out = at::empty({rows, width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width);
  });
  return out;
}
