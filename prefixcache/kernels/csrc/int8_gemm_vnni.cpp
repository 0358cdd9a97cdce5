// quantization="int8"'s product on CPUs with AVX-VNNI but neither AVX512-VNNI nor AMX-INT8 (Intel Alder Lake and
// later client cores, Sierra Forest): acc[m, n] = sum_k x[m, k] * w[k, n] in int32, exactly (built into the AVX2
// extension by prefixcache/kernels/avx2_kernels.py; these functions alone are compiled for AVX-VNNI, through the
// target attribute, and refuse to run on a CPU without it).
//
// Why our own: torch._int_mm reaches oneDNN's AVX-VNNI GEMM there, fast and exact at prompt sizes, but it reorders
// the weight on every call, so a call of a few rows (a generated token) costs several times float32's; this kernel
// reads a weight packed once, at quantization, at any number of rows.
//
// Exactness: vpdpbusd multiplies unsigned by signed bytes, so the activations enter as u = x + 128 (x XOR 0x80) and
//   acc = sum_k u[m, k] * w[k, n] - 128 * sum_k w[k, n]
// with the column sums (times 128) computed once at packing. vpdpbusd adds its four products into the int32 lane
// without saturating (wrapping, as the subtraction does), so the result is the exact sum modulo 2^32, which is the
// exact sum itself while |sum| <= K * 128 * 127 < 2^31 (K < 132,000): torch._int_mm's bits, any int8 values, in any
// batch (a row's sums read only that row).
//
// int8_product_vnni fuses the activations' quantization into the call (quant.quantize_activations' rule: x' = x
// (* mul), s = max(max|x'| / 127, 1e-12), q = round_half_even(x' / s), each an IEEE float32 operation, so the bits
// of int8_rows.cpp's quantize_rows_int8 and, for finite rows, of the torch ops; a row holding a NaN or an infinity
// gets a NaN scale and q = 0, as there) and writes float32 or bfloat16 (rounded to nearest even as avx512.h's
// to_bf16_bits): on a CPU without AVX-512 those halves would otherwise run as five to seven torch ops per layer.
//
// Layout (avx2_kernels.pack_weight_vnni): packed[p, q, 4 j + i] = w[4 q + i, 16 p + j], int8, shape = [ceil(N / 16),
// ceil(K / 4), 64], zero-padded: one 16-output panel's input quad is 64 bytes, two ymm (outputs 0..7, 8..15);
// comp[n] = 128 * sum_k w[k, n], int32, zero-padded to the panels. Rows go in blocks of 6 (12 accumulators), over
// row chunks whose u8 copy fits L2, parallel over (row chunk, panel): int8_gemm_common.h, with this file's Op, as
// int8_gemm_avx2.cpp does with its own.

// Every function of the product path compiled for AVX-VNNI (int8_gemm_common.h: the instantiated templates take it
// from this macro, not from their callers)
#define PREFIXCACHE_INT8_TARGET __attribute__((target("avx2,fma,avxvnni")))
#include "int8_gemm_common.h"

namespace {

// int8_gemm_common.h's micro-kernel operation: vpdpbusd on u8 quads (u = x + 128) and int8 weights
struct VnniOp {
  using In = uint8_t;                        // x + 128
  static constexpr int64_t kStep = 4;        // inputs per int32 lane
  static constexpr bool kCompensated = true;  // acc - 128 * sum_k w[k, n]
  static constexpr uint8_t kZeroQ = 0x80;
  // the panel's quad q: 64 bytes, outputs 0..7 and 8..15
  PREFIXCACHE_INT8_TARGET __attribute__((always_inline)) static inline void weights(const int8_t* w, int64_t q,
                                                                                    __m256i& w0, __m256i& w1) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64 + 32));
  }
  PREFIXCACHE_INT8_TARGET __attribute__((always_inline)) static inline __m256i dot(__m256i acc, __m256i s, __m256i w) {
    return _mm256_dpbusd_avx_epi32(acc, s, w);
  }
  static inline uint8_t from_int8(int8_t v) { return static_cast<uint8_t>(v) ^ 0x80; }
  static inline void store_q8(__m256i q, uint8_t* dst) {  // 8 int32 -> 8 bytes q + 128 (1..255)
    const __m256i order = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
    q = _mm256_add_epi32(q, _mm256_set1_epi32(128));
    q = _mm256_packus_epi32(q, q);  // per 128-bit half: its 4 values, twice
    q = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(q, q), order);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(q));
  }
};

// The packed weight's checks; returns kq (input quads).
int64_t check_packed(int64_t K, const at::Tensor& packed, const at::Tensor& comp, int64_t N) {
  TORCH_CHECK(__builtin_cpu_supports("avxvnni"), "int8_gemm_vnni needs a CPU with AVX-VNNI");
  const int64_t kq = check_packed_shape<VnniOp>(K, packed, N, "avx2_kernels.pack_weight_vnni");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == panels * kPanel,
              "comp must be pack_weight_vnni's ", panels * kPanel, " contiguous int32 column sums");
  return kq;
}

int64_t check_int8_call(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar, "x must be [M, K] int8");
  return check_packed(x.size(1), packed, comp, N);
}

}  // namespace

// x [M, K] int8 @ the packed [K, N] int8 weight -> [M, N] int32: torch._int_mm's exact sums.
at::Tensor int8_gemm_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp, int64_t N) {
  const int64_t kq = check_int8_call(x, packed, comp, N);
  return int8_gemm_call<VnniOp>(x, kq, packed, comp.data_ptr<int32_t>(), N);
}

// The same sums rescaled: float(acc) * x_scale [M, 1] * w_scale [N] (+ bias [N]) -> [M, N] float32, the bits of
// quant.int8_rows_to_float_torch(acc, x_scale, weight, torch.float32).
at::Tensor int8_linear_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp,
                            const at::Tensor& x_scale, const at::Tensor& w_scale,
                            const c10::optional<at::Tensor>& bias) {
  check_floats(w_scale, w_scale.numel(), "w_scale");
  const int64_t kq = check_int8_call(x, packed, comp, w_scale.numel());
  return int8_linear_call<VnniOp>(x, kq, packed, comp.data_ptr<int32_t>(), x_scale, w_scale, bias);
}

// quant.int8_product in one call: x [M, K] float32 or bfloat16 (times mul [K]) quantized per row, the exact
// product, float(acc) * s[m] * w_scale [N] (+ bias [N]) -> [M, N] out_dtype (float32 or bfloat16).
at::Tensor int8_product_vnni(const at::Tensor& x_in, const c10::optional<at::Tensor>& mul, const at::Tensor& packed,
                             const at::Tensor& comp, const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                             at::ScalarType out_dtype) {
  const at::Tensor x = check_product_args(x_in, out_dtype);
  check_floats(w_scale, w_scale.numel(), "w_scale");
  const int64_t kq = check_packed(x.size(1), packed, comp, w_scale.numel());
  return int8_product_call<VnniOp>(x, mul, kq, packed, comp.data_ptr<int32_t>(), w_scale, bias, out_dtype);
}

void bind_int8_vnni(pybind11::module& m) {
  m.def("int8_gemm_vnni", &int8_gemm_vnni, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x [M, K] int8 @ packed int8 weight [K, N] -> [M, N] int32, exact, on AVX-VNNI (int8_gemm_vnni.cpp)");
  m.def("int8_linear_vnni", &int8_linear_vnni, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "int8_gemm_vnni * x_scale [M, 1] * w_scale [N] (+ bias) -> [M, N] float32 (int8_rows_to_float_torch's bits)");
  m.def("int8_product_vnni", &int8_product_vnni, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x [M, K] float32/bf16 (* mul [K]) quantized per row, @ the packed weight, rescaled (+ bias) -> [M, N] "
        "out_dtype: quant.int8_product's bits (int8_gemm_vnni.cpp)");
  m.def("avx_vnni_ready", [] { return static_cast<bool>(__builtin_cpu_supports("avxvnni")); },
        "whether this CPU runs int8_gemm_vnni (AVX-VNNI)");
}
