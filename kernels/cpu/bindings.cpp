#include <torch/python.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "paged attention, one row per query, shared leading blocks read once");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("small_m_linear", &small_m_linear, "x W^T for a few rows of x, bf16, fp32 sums");
  m.def("bf16_linear", &bf16_linear, "x W^T for any rows, bf16, W widened a task at a time");
  m.def("int4_pack", &int4_pack, "Q4_1 nibbles, scales and mins in int4_linear's layout");
  m.def("int4_linear", &int4_linear, "x W^T, W = q * scale + min per group (Q4_1), fp32 sums",
        pybind11::arg("x"), pybind11::arg("blob"), pybind11::arg("activation_bits") = 16);
  m.def("activation_bits", &activation_bits,
        "the bits int4_linear and int8_linear round x to a block (integer sums) at these rows, "
        "asked for 8 or 16 (their activation_bits), 0: none; bf16_x: on a bf16 x",
        pybind11::arg("rows"), pybind11::arg("asked") = 16, pybind11::arg("bf16_x") = false);
  m.def("int8_pack", &int8_pack, "int8 values and scales a row or a block in int8_linear's layout");
  m.def("int8_linear", &int8_linear, "x W^T, W = q * scale per row or block of 32, fp32 sums",
        pybind11::arg("x"), pybind11::arg("blob"), pybind11::arg("activation_bits") = 16);
  m.def("amx_linear", &amx_linear, "x W^T on AMX tiles from W's plain layout, bf16, fp32 sums");
  m.def("panels_available", &panels_available, "whether this build has panel_linear");
  m.def("panel_pack", &panel_pack, "W [N, K] in panel_linear's panels of 48 features");
  m.def("panel_linear", &panel_linear, "x W^T on W's panels (panel_pack), bf16, fp32 sums");
  m.def("panel_silu_linear", &panel_silu_linear,
        "SiLU(x G^T) * (x U^T) on gate_up's panels, as silu_mul(panel_linear(...))");
  m.def("amx_available", &amx_available, "whether this build and process have AMX tiles");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of x = [gate | up], one pass");
  m.def("rotate_and_store", &rotate_and_store, "rotary on q and k, then k and v into the cache");
  m.def("argmax_rows", &argmax_rows, "each row's first largest value's index, as torch.argmax");
  m.def("random_pick", &random_pick, "each row's seeded random pick, -1 where it has none");
  m.def("linear", &linear, "x W^T on the fastest product for its rows (C++ or oneDNN)",
        py::arg("x"), py::arg("weight"), py::arg("packed") = py::none());
  m.def("widen_rows", &widen_rows,
        "the most rows the bf16, int4 and int8 tiles take; past them W widened for MKL");
  m.def("cpp_rows", &cpp_rows, "the most rows of x that linear gives to the C++ products");
  m.def("decoder_layer", &decoder_layer, "a Llama-shaped decoder layer in one call");
  m.def("gemv_isa", &gemv_isa, "the instruction set small_m_linear was built for");
}
