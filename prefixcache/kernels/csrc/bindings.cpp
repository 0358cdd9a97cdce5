// The AVX-512 build's Python bindings (built by prefixcache/kernels/cpu_kernels.py): what every build binds
// (shared_bindings.h), then this build's own AVX512-BF16 / AMX / int8-row kernels.
#include <torch/extension.h>

#include "shared_bindings.h"

int prefixcache_kernel_tier = kTierAmx;

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                   const at::Tensor& block_table, const at::Tensor& query_start,
                                   const at::Tensor& num_computed, int64_t block_size, double scale, bool amx);
bool amx_bf16_ready();
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N,
                      int64_t mode);

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x, const c10::optional<at::Tensor>& mul);
at::Tensor int8_rows_to_float(const at::Tensor& acc, const at::Tensor& x_scale, const at::Tensor& w_scale,
                              const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_shared_kernels(m, "AVX-512", "the AVX512-BF16 form where the CPU has it, else the float32 form",
                      "paged_decode_attention's float32 form, also where the CPU has AVX512-BF16 (paged_attention.cpp)");
  m.def("paged_prefill_attention", &paged_prefill_attention, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "causal q [T, H, D] of each sequence's new tokens over its context in the paged pool -> [T, H, D] "
        "(prefill_attention.cpp; needs AVX512-BF16; amx: the products on AMX tiles)");
  m.def("amx_bf16_ready", &amx_bf16_ready,
        "whether AMX-BF16 tiles run here: the CPU has them and Linux gave this process the tile state");
  m.def("amx_linear", &amx_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "bf16 x [M, K] @ packed W^T (+ bias) -> [M, N] bf16 on AMX tiles, a row's bits whatever M (amx_gemm.cpp)");
  m.def("quantize_rows_int8", &quantize_rows_int8, pybind11::arg("x"), pybind11::arg("mul") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x [M, K] (times mul [K] or None) -> (int8 [M, K], float32 scale [M, 1]), per row (int8_rows.cpp)");
  m.def("int8_rows_to_float", &int8_rows_to_float, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "int32 [M, N] * row scale * column scale (+ bias) -> [M, N] float32 or bfloat16 (int8_rows.cpp)");
}
