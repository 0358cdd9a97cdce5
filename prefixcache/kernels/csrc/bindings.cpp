// The CPU kernels' Python bindings (built by prefixcache/kernels/cpu_kernels.py).
#include <torch/extension.h>

#include "isa_tier.h"

int prefixcache_kernel_tier = kTierAmx;

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype);
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& corr,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype);
at::Tensor int4_mm_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& min, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype);
at::Tensor int8_mm_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                  const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                                  double scale);
at::Tensor paged_decode_attention_float32(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                          const at::Tensor& block_table, const at::Tensor& context_lens,
                                          int64_t block_size, double scale);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                   const at::Tensor& block_table, const at::Tensor& query_start,
                                   const at::Tensor& num_computed, int64_t block_size, double scale, bool amx);
bool amx_bf16_ready();
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N,
                      int64_t mode);

void bind_prompt_ops(pybind11::module& m);  // prompt_ops.cpp: the fused prompt-row ops
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x, const c10::optional<at::Tensor>& mul);
at::Tensor int8_rows_to_float(const at::Tensor& acc, const at::Tensor& x_scale, const at::Tensor& w_scale,
                              const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype);

void bind_decode_layers(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm, "x [M, K] @ int4 grouped weight^T (+ bias) -> [M, N] (qgemm.cpp)");
  m.def("int8_mm", &int8_mm, "x [M, K] @ int8 grouped weight^T (+ bias) -> [M, N] (qgemm.cpp)");
  m.def("int4_mm_reference", &int4_mm_reference, "int4_mm's rule in plain loops: its bits (qgemm.cpp)");
  m.def("int8_mm_reference", &int8_mm_reference, "int8_mm's rule in plain loops: its bits (qgemm.cpp)");
  m.def("set_kernel_tier", [](int64_t tier) { prefixcache_kernel_tier = static_cast<int>(tier); },
        "the highest tier (index in cpu_features.TIERS) any C++ dispatch may take (isa_tier.h)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "q [R, H, D] over each row's context in the paged pool -> [R, H, D] (paged_attention.cpp)");
  m.def("paged_decode_attention_float32", &paged_decode_attention_float32,
        "paged_decode_attention's float32 form, also where the CPU has AVX512-BF16 (paged_attention.cpp)");
  m.def("paged_prefill_attention", &paged_prefill_attention, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "causal q [T, H, D] of each sequence's new tokens over its context in the paged pool -> [T, H, D] "
        "(prefill_attention.cpp; needs AVX512-BF16; amx: the products on AMX tiles)");
  m.def("amx_bf16_ready", &amx_bf16_ready,
        "whether AMX-BF16 tiles run here: the CPU has them and Linux gave this process the tile state");
  m.def("amx_linear", &amx_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "bf16 x [M, K] @ packed W^T (+ bias) -> [M, N] bf16 on AMX tiles, a row's bits whatever M (amx_gemm.cpp)");
  bind_prompt_ops(m);  // a bf16 model's fused prompt-row ops (prompt_ops.cpp)
  m.def("quantize_rows_int8", &quantize_rows_int8, pybind11::arg("x"), pybind11::arg("mul") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x [M, K] (times mul [K] or None) -> (int8 [M, K], float32 scale [M, 1]), per row (int8_rows.cpp)");
  m.def("int8_rows_to_float", &int8_rows_to_float, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "int32 [M, N] * row scale * column scale (+ bias) -> [M, N] float32 or bfloat16 (int8_rows.cpp)");
  m.def("compiler", [] { return std::string(__VERSION__); },
        "the compiler that built these kernels (its choices, such as which products it fuses into an fma, "
        "decide bits: the cache key names it)");
  bind_decode_layers(m);  // generated tokens' decoder layers (decode_layers.cpp)
}
