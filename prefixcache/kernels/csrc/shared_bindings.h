// The bindings both extension modules share (bindings.cpp: the AVX-512 build; bindings_avx2.cpp: the AVX2 and NEON
// builds): the int4 formats' products and their references (qgemm.cpp), the decode attention (paged_attention.cpp),
// the generated tokens' decoder (decode_layers.cpp), a bf16 model's fused prompt ops (prompt_ops.cpp), the kernel
// tier (isa_tier.h) and the compiler's name. Each build compiles these sources with its own flags; the names, the
// arguments and (where the forms agree) the bits are the same in every build.
#pragma once
#include <torch/extension.h>

#include <string>

#include "isa_tier.h"

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
void bind_decode_layers(pybind11::module& m);  // decode_layers.cpp
void bind_prompt_ops(pybind11::module& m);     // prompt_ops.cpp

// build: the build's name in the products' docstrings ("AVX-512", "AVX2", "NEON"); decode_forms, float32_form:
// which forms its paged_decode_attention runs, and what its paged_decode_attention_float32 is, in words.
inline void bind_shared_kernels(pybind11::module& m, const std::string& build, const std::string& decode_forms,
                                const std::string& float32_form) {
  m.def("int4_mm", &int4_mm, ("x [M, K] @ int4 grouped weight^T (+ bias) -> [M, N] (qgemm.cpp, " + build + ")").c_str());
  m.def("int8_mm", &int8_mm, ("x [M, K] @ int8 grouped weight^T (+ bias) -> [M, N] (qgemm.cpp, " + build + ")").c_str());
  m.def("int4_mm_reference", &int4_mm_reference, "int4_mm's rule in plain loops: its bits (qgemm.cpp)");
  m.def("int8_mm_reference", &int8_mm_reference, "int8_mm's rule in plain loops: its bits (qgemm.cpp)");
  m.def("paged_decode_attention", &paged_decode_attention,
        ("q [R, H, D] over each row's context in the paged pool -> [R, H, D] (paged_attention.cpp: " + decode_forms +
         ")").c_str());
  m.def("paged_decode_attention_float32", &paged_decode_attention_float32, float32_form.c_str());
  m.def("set_kernel_tier", [](int64_t tier) { prefixcache_kernel_tier = static_cast<int>(tier); },
        "the highest tier (index in cpu_features.TIERS) any C++ dispatch may take (isa_tier.h)");
  m.def("compiler", [] { return std::string(__VERSION__); },
        "the compiler that built these kernels (its choices, such as which products it fuses into an fma, "
        "decide bits: the cache key names it)");
  bind_decode_layers(m);  // generated tokens' decoder layers
  bind_prompt_ops(m);     // a bf16 model's fused prompt-row ops
}
