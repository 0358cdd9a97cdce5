// The element-wise halves of quantization="int8"'s linear layers (layers/quant.py), fused: one pass per
// row where torch's ops made five to seven (float copy, abs, amax, div, round, int8 copy; int32 -> float,
// two multiplies, bias, bf16 copy). torch._int_mm (oneDNN) still does the int8 x int8 -> int32 product.
//
//   quantize_rows_int8: x'[k] = x[k] * mul[k] when a column multiplier is given (float32; the smoothing of
//                       quant.smooth_factors), else x[k]
//                       s = max(max_k |x'[k]| / 127, 1e-12)   (float32, as quant.quantize_activations)
//                       q[k] = int8(round_half_even(x'[k] / s))
//   int8_rows_to_float: y[n] = float(acc[n]) * s * w_scale[n] (+ bias[n]), rounded once per operation in
//                       that order (as quant.int8_linear's torch ops), then bf16 (nearest even) or float32
//
// Bit for bit the torch ops' results for finite inputs (tests/layers/test_quant.py compares them). A row
// holding a NaN or an infinity gets a NaN scale (and q = 0): its outputs are NaN, as with torch's ops up to
// which non-finite value. Every value depends only on its own row: a row gets the same bits in any batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")  // masked 128/256-bit int8 and bf16 loads and stores

namespace {

constexpr int64_t kLanes = 16;

template <typename T>
inline __m512 load16(const T* p, __mmask16 m);
template <>
inline __m512 load16<float>(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// x[k..k+16) as float32, times mul[k..) when there is a multiplier (one rounding, as torch's mul)
template <typename T>
inline __m512 load_scaled(const T* x, const float* mul, int64_t k, __mmask16 m) {
  const __m512 v = load16(x + k, m);
  return mul == nullptr ? v : _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, mul + k));
}

template <typename T>
void quantize_row(const T* x, const float* mul, int64_t K, int8_t* q, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t k = 0; k < K; k += kLanes) {
    const __mmask16 m = tail_mask(K - k);
    const __m512 v = load_scaled(x, mul, k, m);
    const __m512 a = _mm512_abs_ps(v);
    bad |= _mm512_mask_cmp_ps_mask(m, a, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NLT_UQ);
    amax = _mm512_max_ps(amax, a);
  }
  float s = _mm512_reduce_max_ps(amax) / 127.f;
  if (!(s >= 1e-12f)) s = 1e-12f;  // torch's clamp_(min=1e-12) (s is not NaN here: bad rows are below)
  if (bad) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    std::memset(q, 0, K);
    return;
  }
  *scale = s;
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t k = 0; k < K; k += kLanes) {
    const __mmask16 m = tail_mask(K - k);
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load_scaled(x, mul, k, m), vs),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x_in, const c10::optional<at::Tensor>& mul_in) {
  TORCH_CHECK(x_in.is_cpu() && x_in.dim() == 2, "quantize_rows_int8: x must be a 2-D CPU tensor [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "quantize_rows_int8: x must be bfloat16 or float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!mul_in || (mul_in->is_cpu() && mul_in->scalar_type() == at::kFloat && mul_in->dim() == 1 &&
                          mul_in->size(0) == K && mul_in->is_contiguous()),
              "quantize_rows_int8: mul must be a contiguous float32 [K]");
  const float* mul = mul_in ? mul_in->data_ptr<float>() : nullptr;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, 1}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.data_ptr();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (bf16)
        quantize_row(static_cast<const at::BFloat16*>(xp) + m * K, mul, K, qp + m * K, sp + m);
      else
        quantize_row(static_cast<const float*>(xp) + m * K, mul, K, qp + m * K, sp + m);
    }
  });
  return {q, scale};
}

at::Tensor int8_rows_to_float(const at::Tensor& acc_in, const at::Tensor& x_scale, const at::Tensor& w_scale,
                              const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  TORCH_CHECK(acc_in.is_cpu() && acc_in.dim() == 2 && acc_in.scalar_type() == at::kInt,
              "int8_rows_to_float: acc must be int32 [M, N]");
  const at::Tensor acc = acc_in.contiguous();
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.dim() == 2 && x_scale.size(0) == M &&
                  x_scale.size(1) == 1 && x_scale.is_contiguous(),
              "int8_rows_to_float: x_scale must be a contiguous float32 [M, 1]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 1 && w_scale.size(0) == N &&
                  w_scale.is_contiguous(),
              "int8_rows_to_float: w_scale must be a contiguous float32 [N]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N &&
                        bias->is_contiguous()),
              "int8_rows_to_float: bias must be a contiguous float32 [N]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "int8_rows_to_float: out_dtype float32 or bfloat16");
  at::Tensor out = at::empty({M, N}, acc.options().dtype(out_dtype));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const bool to_bf16 = out_dtype == at::kBFloat16;
  void* op = out.data_ptr();
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const __m512 s = _mm512_set1_ps(xs[m]);
      for (int64_t n = 0; n < N; n += kLanes) {
        const __mmask16 k = tail_mask(N - n);
        const __m512 a = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(k, ap + m * N + n));  // exact below 2**24
        // Three separately rounded operations (the _round forms keep the compiler from fusing them).
        __m512 y = _mm512_mul_round_ps(_mm512_mul_round_ps(a, s, kRound), _mm512_maskz_loadu_ps(k, ws + n), kRound);
        if (bp) y = _mm512_add_round_ps(y, _mm512_maskz_loadu_ps(k, bp + n), kRound);
        if (to_bf16) {
          const __m512i b = _mm512_srli_epi32(to_bf16_bits(y), 16);
          _mm256_mask_storeu_epi16(static_cast<at::BFloat16*>(op) + m * N + n, k, _mm512_cvtepi32_epi16(b));
        } else {
          _mm512_mask_storeu_ps(static_cast<float*>(op) + m * N + n, k, y);
        }
      }
    }
  });
  return out;
}

#pragma GCC pop_options
