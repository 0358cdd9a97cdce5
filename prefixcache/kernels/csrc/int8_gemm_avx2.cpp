// quantization="int8"'s product on AVX2 + FMA CPUs (no AVX512-VNNI, no AMX-INT8), where torch._int_mm has no
// fast kernel: acc[m, n] = sum_k x[m, k] * w[k, n] in int32, exactly (built by prefixcache/kernels/avx2_kernels.py;
// bind_int8_avx2 binds it, called from bindings_avx2.cpp).
//
// Exactness: the int8 operands are widened to int16 (x once per call, w as a panel is read) and multiplied by
//   vpmaddwd(x[k, k+1], w[k..k+1, n])   int16 x int16, a pair summed into one int32 lane: |sum| <= 2 * 128^2
// then added in int32. Integer sums are exact whatever their order (|acc| <= K * 128^2 < 2^31 for K < 131,072),
// so every acc equals torch._int_mm's bit for bit, and a row's sums read only that row: a row gets the same bits
// in any batch. Any int8 values are exact, -128 included, so the kernel needs no precondition on its operands.
//
// Cost per 32 products: 2 vpmaddwd (multiply ports) + 2 vpaddd, plus per 6 rows x 16 outputs two sign-extending
// weight loads. ggml's AVX2 Q8_0 form, vpmaddubsw(|x|, sign(w, x)) then vpmaddwd with ones, is exact too for
// |w| <= 127 (quantize_weight's range: |pair| <= 2 * 128 * 127 < 2^15), but per 32 products it issues vpsignb,
// vpmaddubsw, vpmaddwd and vpaddd: as many vector operations, three of them on Intel's two multiply ports
// (p0, p1) where this form has two, and no fewer multiply uops on a Zen 3 (its two multiply pipes). Weights
// pre-widened to int16 at pack time save the two sign extensions but double the packed weight's bytes, which a
// single-row (generated-token) call streams. So the bound of this form is its multiply ports: 16 products per
// vpmaddwd, two per cycle on a Zen 3 (32 products a cycle, against 16 multiply-adds a cycle of float32 FMA).
//
// int8_product_avx2 fuses the activations' quantization into the call and writes float32 or bfloat16, as
// int8_gemm_vnni.cpp's int8_product_vnni does, with the same bits (int8_gemm_common.h's quantize_row and
// epilogue; here q is stored as int16).
//
// Layout (avx2_kernels.pack_weight): packed[p, q, 2 j + i] = w[2 q + i, 16 p + j], int8, shape = [ceil(N / 16),
// ceil(K / 2), 32], zero-padded: one 16-output panel's input pair is 32 bytes, sign-extended into two ymm
// (outputs 0..7, 8..15). Rows go in blocks of 6 (12 int32 accumulators in registers), over row chunks whose int16
// copy fits L2, parallel over (row chunk, panel): int8_gemm_common.h, with this file's Op.
#include "int8_gemm_common.h"  // PREFIXCACHE_INT8_TARGET left empty: the extension's own AVX2 flags

namespace {

// int8_gemm_common.h's micro-kernel operation: vpmaddwd on int16 pairs
struct Avx2Op {
  using In = int16_t;                         // x widened once per call
  static constexpr int64_t kStep = 2;         // inputs per int32 lane
  static constexpr bool kCompensated = false;
  static constexpr int16_t kZeroQ = 0;
  // the panel's pair q: 32 bytes, sign-extended into outputs 0..7 and 8..15
  __attribute__((always_inline)) static inline void weights(const int8_t* w, int64_t q, __m256i& w0, __m256i& w1) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + q * 32)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + q * 32 + 16)));
  }
  __attribute__((always_inline)) static inline __m256i dot(__m256i acc, __m256i s, __m256i w) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s, w));
  }
  static inline int16_t from_int8(int8_t v) { return v; }
  static inline void store_q8(__m256i q, int16_t* dst) {  // 8 int32 -> 8 int16 (no saturation: |q| <= 127)
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q, q), 0b1000);  // 64-bit lanes 0, 2
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(p));
  }
};

int64_t check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar, "x must be [M, K] int8");
  return check_packed_shape<Avx2Op>(x.size(1), packed, N, "avx2_kernels.pack_weight");
}

}  // namespace

// x [M, K] int8 @ the packed [K, N] int8 weight -> [M, N] int32: torch._int_mm's exact sums.
at::Tensor int8_gemm_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t kq = check_packed(x, packed, N);
  return int8_gemm_call<Avx2Op>(x, kq, packed, nullptr, N);
}

// The same sums rescaled: float(acc) * x_scale [M, 1] * w_scale [N] (+ bias [N]) -> [M, N] float32, the bits of
// quant.int8_rows_to_float_torch(acc, x_scale, weight, torch.float32).
at::Tensor int8_linear_avx2(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& x_scale,
                            const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias) {
  check_floats(w_scale, w_scale.numel(), "w_scale");
  const int64_t kq = check_packed(x, packed, w_scale.numel());
  return int8_linear_call<Avx2Op>(x, kq, packed, nullptr, x_scale, w_scale, bias);
}

// quant.int8_product in one call: x [M, K] float32 or bfloat16 (times mul [K]) quantized per row, the exact
// product, float(acc) * s[m] * w_scale [N] (+ bias [N]) -> [M, N] out_dtype (float32 or bfloat16): the bits of
// int8_product_vnni and of the unfused halves.
at::Tensor int8_product_avx2(const at::Tensor& x_in, const c10::optional<at::Tensor>& mul, const at::Tensor& packed,
                             const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                             at::ScalarType out_dtype) {
  const at::Tensor x = check_product_args(x_in, out_dtype);
  check_floats(w_scale, w_scale.numel(), "w_scale");
  const int64_t kq = check_packed_shape<Avx2Op>(x.size(1), packed, w_scale.numel(), "avx2_kernels.pack_weight");
  return int8_product_call<Avx2Op>(x, mul, kq, packed, nullptr, w_scale, bias, out_dtype);
}

void bind_int8_avx2(pybind11::module& m) {
  m.def("int8_gemm_avx2", &int8_gemm_avx2, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x [M, K] int8 @ packed int8 weight [K, N] -> [M, N] int32, exact (int8_gemm_avx2.cpp)");
  m.def("int8_linear_avx2", &int8_linear_avx2, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "int8_gemm_avx2 * x_scale [M, 1] * w_scale [N] (+ bias) -> [M, N] float32 (int8_rows_to_float_torch's bits)");
  m.def("int8_product_avx2", &int8_product_avx2, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x [M, K] float32/bf16 (* mul [K]) quantized per row, @ the packed weight, rescaled (+ bias) -> [M, N] "
        "out_dtype: quant.int8_product's bits (int8_gemm_avx2.cpp)");
}
