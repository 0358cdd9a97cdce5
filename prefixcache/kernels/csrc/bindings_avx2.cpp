// The Python bindings of the AVX2 kernels (built by prefixcache/kernels/avx2_kernels.py with -mavx2 -mfma -mf16c
// only, so that every function runs on an AVX2 CPU without AVX-512) and of the aarch64 NEON ones (built by
// prefixcache/kernels/neon_kernels.py, -march=armv8.2-a+dotprod or armv8-a): the int4 formats' generated-token
// kernels (qgemm.cpp, paged_attention.cpp's float32 form, decode_layers.cpp) and a bf16 model's fused prompt-row ops
// (prompt_ops.cpp), the same names and bits as cpu_kernels.py's AVX-512 build, and on x86 int8's exact products
// (int8_gemm_avx2.cpp: AVX2 intrinsics; int8_gemm_vnni.cpp: its functions compiled for AVX-VNNI, refusing to run
// without it), which the NEON build neither compiles nor binds (there torch._int_mm serves int8).
#include <torch/extension.h>

#include "isa_tier.h"

#if defined(__x86_64__)
#define PREFIXCACHE_BUILD_ISA "AVX2"
#else
#define PREFIXCACHE_BUILD_ISA "NEON"
#endif

int prefixcache_kernel_tier = kTierAmx;

#if defined(__x86_64__)
void bind_int8_avx2(pybind11::module& m);  // int8_gemm_avx2.cpp: the exact product, rescaled and fused forms
void bind_int8_vnni(pybind11::module& m);  // int8_gemm_vnni.cpp: its functions compiled for AVX-VNNI
at::Tensor paged_prefill_attention_avx2(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                        const at::Tensor& block_table, const at::Tensor& query_start,
                                        const at::Tensor& num_computed, int64_t block_size, double scale);
#endif
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
void bind_decode_layers(pybind11::module& m);
void bind_prompt_ops(pybind11::module& m);  // prompt_ops.cpp: the fused prompt-row ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(__x86_64__)
  bind_int8_avx2(m);
  bind_int8_vnni(m);
  m.def("paged_prefill_attention_avx2", &paged_prefill_attention_avx2,
        "prompt rows' causal attention over the paged pool, float32 FMAs (prefill_attention_avx2.cpp)");
#endif
  m.def("int4_mm", &int4_mm, "x [M, K] @ int4 grouped weight^T (+ bias) -> [M, N] (qgemm.cpp, " PREFIXCACHE_BUILD_ISA ")");
  m.def("int8_mm", &int8_mm, "x [M, K] @ int8 grouped weight^T (+ bias) -> [M, N] (qgemm.cpp, " PREFIXCACHE_BUILD_ISA ")");
  m.def("int4_mm_reference", &int4_mm_reference, "int4_mm's rule in plain loops: its bits (qgemm.cpp)");
  m.def("int8_mm_reference", &int8_mm_reference, "int8_mm's rule in plain loops: its bits (qgemm.cpp)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "q [R, H, D] over each row's context in the paged pool -> [R, H, D] (paged_attention.cpp: its float32 form)");
  m.def("paged_decode_attention_float32", &paged_decode_attention_float32, "the same (the only form of this build)");
  m.def("set_kernel_tier", [](int64_t tier) { prefixcache_kernel_tier = static_cast<int>(tier); },
        "the highest tier (index in cpu_features.TIERS) any C++ dispatch may take (isa_tier.h)");
  m.def("compiler", [] { return std::string(__VERSION__); }, "the compiler that built these kernels");
  bind_decode_layers(m);  // generated tokens' decoder layers (decode_layers.cpp)
  bind_prompt_ops(m);  // a bf16 model's fused prompt-row ops (prompt_ops.cpp)
}
