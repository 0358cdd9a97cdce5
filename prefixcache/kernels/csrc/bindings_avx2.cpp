// The Python bindings of the AVX2 kernels (built by prefixcache/kernels/avx2_kernels.py with -mavx2 -mfma -mf16c
// only, so that every function runs on an AVX2 CPU without AVX-512) and of the aarch64 NEON ones (built by
// prefixcache/kernels/neon_kernels.py, -march=armv8.2-a+dotprod or armv8-a): the int4 formats' generated-token
// kernels (qgemm.cpp, paged_attention.cpp's float32 form, decode_layers.cpp) and a bf16 model's fused prompt-row ops
// (prompt_ops.cpp), the same names and bits as cpu_kernels.py's AVX-512 build, and on x86 int8's exact products
// (int8_gemm_avx2.cpp: AVX2 intrinsics; int8_gemm_vnni.cpp: its functions compiled for AVX-VNNI, refusing to run
// without it), which the NEON build neither compiles nor binds (there torch._int_mm serves int8).
#include <torch/extension.h>

#include "shared_bindings.h"

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
                                        const at::Tensor& num_computed, int64_t block_size, double scale,
                                        int64_t window, bool int8);
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(__x86_64__)
  bind_int8_avx2(m);
  bind_int8_vnni(m);
  m.def("paged_prefill_attention_avx2", &paged_prefill_attention_avx2,
        "prompt rows' causal attention over the paged pool, bf16 or float32, an optional sliding window; "
        "float32 FMAs, or int8 products where int8 (prefill_attention_avx2.cpp)");
#endif
  bind_shared_kernels(m, PREFIXCACHE_BUILD_ISA, "its float32 form", "the same (the only form of this build)");
}
