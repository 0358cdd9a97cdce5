// The parts int8_gemm_avx2.cpp and int8_gemm_vnni.cpp share, templated on the micro-kernel's operation (a
// struct Op, below): the 6-row x 16-output register block over the packed weight's panels, its epilogue (int32,
// or the rescale to float32 / bfloat16), the task loop over (row chunk, panel), the per-row quantization of
// the activations that the fused call runs, and the argument checks. Each .cpp holds its Op (one input step's
// weight loads and products, and how an int8 or a quantized value is stored for it), its packing's checks and its
// bindings.
//
// Op provides:
//   using In = ...;                      element of the activations' copy (int16_t: x; uint8_t: x + 128)
//   kStep                                inputs per int32 lane (the packed weight's innermost group: 2 or 4)
//   kCompensated                         whether acc - comp[n] is the sum (the +128 offset's correction)
//   weights(w, q, w0, w1)                step q's weights of one 16-output panel: outputs 0..7, 8..15
//   dot(acc, s, w)                       acc + the products of s (one row's step, broadcast) and w, per lane
//   from_int8(v), kZeroQ                 how an int8 v is stored as In, and q = 0's byte (a NaN row's fill)
//   store_q8(q, dst)                     8 int32 q in -127..127 stored as In
//
// The target attribute: the VNNI file's functions alone are compiled for AVX-VNNI (the extension's flags are
// AVX2's), and a template instantiated from a header does not take the attribute of the function that
// instantiates it. So the including file defines PREFIXCACHE_INT8_TARGET before the include (empty for AVX2,
// target("avx2,fma,avxvnni") for VNNI) and every function of the product path carries it: GCC inlines an
// always_inline function only into one compiled for the same target, and the register block must inline. All of
// this header is in an anonymous namespace: the two files instantiate it for different targets, and each keeps
// its own copy (no inline definition shared between them under one name).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "vec16.h"  // its AVX2 backend here: load_bf16_8, to_bf16_bits_8

#ifndef PREFIXCACHE_INT8_TARGET
#define PREFIXCACHE_INT8_TARGET
#endif

namespace {

constexpr int64_t kPanel = 16;              // outputs per panel (two ymm of int32)
constexpr int64_t kRows = 6;                // rows per micro-kernel
constexpr int64_t kChunkBytes = 256 << 10;  // a row chunk's copy of the activations: L2-sized

// The panel's epilogue: int32 sums as they are, or y = float(acc) * x_scale[row] * w_scale[n] (+ bias[n]),
// rounded after each operation (quant.int8_rows_to_float_torch's order: an empty asm on the product keeps the
// compiler, which contracts a product and a sum into one fma by default, from fusing it with the bias add, so the
// bits are that function's), then bfloat16 where bf16_out (rounded to nearest even, as avx512.h's to_bf16_bits).
struct Rescale {
  const float* x_scale;  // [M] (the call's rows), or nullptr: int32 out
  const float* w_scale;  // this panel's 16 (zero-padded past N)
  const float* bias;     // this panel's 16, or nullptr
  bool bf16_out;         // float32 out rounded to bfloat16 (2-byte elements)
};

// rows r < R (R <= 6) of one panel over all kq input steps; x: row r at x + r * ld (ld a multiple of Op::kStep);
// comp: this panel's 16 (read where Op::kCompensated); out: 4-byte elements (int32 or float32; 2-byte bfloat16
// where e.bf16_out), row r at out + r * ldo, the first cols written.
// The 2 R accumulators are named variables, not an array: GCC (12) leaves an unrolled array of 12 ymm partly on
// the stack, a load and a store per spilled accumulator per step on top of the vector operations. Per step: two
// weight loads, R broadcasts, 2 R products: 12 accumulators, the two weight vectors, one broadcast and (vpmaddwd's,
// before its add; vpdpbusd adds in place) one product fill the 16 ymm registers with nothing spilled.
template <class Op, int R>
PREFIXCACHE_INT8_TARGET __attribute__((always_inline)) inline void panel_rows(
    const typename Op::In* x, int64_t ld, const int8_t* w, const int32_t* comp, int64_t kq, const Rescale& e,
    int64_t row0, void* out, int64_t ldo, int64_t cols) {
  static_assert(R >= 1 && R <= kRows, "rows per micro-kernel");
  const __m256i zero = _mm256_setzero_si256();
  __m256i a00 = zero, a01 = zero, a10 = zero, a11 = zero, a20 = zero, a21 = zero, a30 = zero, a31 = zero,
          a40 = zero, a41 = zero, a50 = zero, a51 = zero;
  // row r's step q is the 4 bytes at x + r * ld + kStep q, read as one int32 (may_alias: the buffer is In)
  using Lane = int32_t __attribute__((may_alias));
  const Lane* x0 = reinterpret_cast<const Lane*>(x);
  const Lane* x1 = reinterpret_cast<const Lane*>(x + std::min(1, R - 1) * ld);
  const Lane* x2 = reinterpret_cast<const Lane*>(x + std::min(2, R - 1) * ld);
  const Lane* x3 = reinterpret_cast<const Lane*>(x + std::min(3, R - 1) * ld);
  const Lane* x4 = reinterpret_cast<const Lane*>(x + std::min(4, R - 1) * ld);
  const Lane* x5 = reinterpret_cast<const Lane*>(x + std::min(5, R - 1) * ld);
#define PREFIXCACHE_ROW(r)                     \
  if constexpr (R > r) {                       \
    const __m256i s = _mm256_set1_epi32(x##r[q]); \
    a##r##0 = Op::dot(a##r##0, s, w0);         \
    a##r##1 = Op::dot(a##r##1, s, w1);         \
  }
#define PREFIXCACHE_STEP \
  __m256i w0, w1;        \
  Op::weights(w, q, w0, w1); \
  PREFIXCACHE_ROW(0) PREFIXCACHE_ROW(1) PREFIXCACHE_ROW(2) PREFIXCACHE_ROW(3) PREFIXCACHE_ROW(4) PREFIXCACHE_ROW(5)
  if constexpr (R > 4) {
    // two steps per iteration: the loop's own counter and branch take issue slots from the vector ports
#pragma GCC unroll 2
    for (int64_t q = 0; q < kq; ++q) {
      PREFIXCACHE_STEP
    }
  } else {
    for (int64_t q = 0; q < kq; ++q) {  // <= 4 rows: fewer vector operations per weight load, not unrolled
      PREFIXCACHE_STEP
    }
  }
#undef PREFIXCACHE_STEP
#undef PREFIXCACHE_ROW
  __m256i c0 = zero, c1 = zero;
  if constexpr (Op::kCompensated) {
    c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp));
    c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp + 8));
  }
  auto emit = [&](int r, __m256i lo, __m256i hi) {  // row r's 16 sums (outputs 0..7, 8..15)
    __m256i v[2] = {lo, hi};
    for (int h = 0; h < 2; ++h) {
      if constexpr (Op::kCompensated) v[h] = _mm256_sub_epi32(v[h], h == 0 ? c0 : c1);
      if (e.x_scale != nullptr) {
        __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(v[h]), _mm256_set1_ps(e.x_scale[row0 + r]));
        y = _mm256_mul_ps(y, _mm256_loadu_ps(e.w_scale + 8 * h));
        asm("" : "+x"(y));  // y rounded before the bias add: never fused into one fma (see Rescale)
        if (e.bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(e.bias + 8 * h));
        v[h] = e.bf16_out ? _mm256_srli_epi32(vec16_detail::to_bf16_bits_8(y), 16) : _mm256_castps_si256(y);
      }
    }
    char* o = static_cast<char*>(out) + r * ldo * (e.bf16_out ? 2 : 4);
    if (cols == kPanel) {  // stored from the registers: a copy through a buffer stalls its load on the two stores
      if (e.bf16_out) {      // 16 bit patterns < 2^16: packus keeps them, then the 64-bit lanes back in order
        const __m256i b = _mm256_permute4x64_epi64(_mm256_packus_epi32(v[0], v[1]), 0b11011000);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), b);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), v[0]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32), v[1]);
      }
      return;
    }
    alignas(32) int32_t tmp[kPanel];  // the last panel's first cols < 16 outputs
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), v[0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8), v[1]);
    if (e.bf16_out) {
      for (int64_t c = 0; c < cols; ++c) reinterpret_cast<uint16_t*>(o)[c] = static_cast<uint16_t>(tmp[c]);
    } else {
      std::memcpy(o, tmp, cols * 4);
    }
  };
  emit(0, a00, a01);
  if constexpr (R > 1) emit(1, a10, a11);
  if constexpr (R > 2) emit(2, a20, a21);
  if constexpr (R > 3) emit(3, a30, a31);
  if constexpr (R > 4) emit(4, a40, a41);
  if constexpr (R > 5) emit(5, a50, a51);
}

// rows [row0, row0 + rows) of one panel (cols outputs from n0). Inlined into run_tasks with the micro-kernels:
// compiled out of line, GCC 12 gives the same 6-row loop a layout that runs it measurably slower.
template <class Op>
PREFIXCACHE_INT8_TARGET __attribute__((always_inline)) inline void panel(
    const typename Op::In* x, int64_t ld, int64_t row0, int64_t rows, const int8_t* w, const int32_t* comp,
    int64_t kq, Rescale e, int64_t n0, void* out, int64_t ldo, int64_t cols) {
  alignas(32) float w_scale[kPanel] = {}, bias[kPanel] = {};
  if (e.x_scale != nullptr) {
    std::memcpy(w_scale, e.w_scale + n0, cols * 4);
    if (e.bias != nullptr) std::memcpy(bias, e.bias + n0, cols * 4);
    e.w_scale = w_scale, e.bias = e.bias == nullptr ? nullptr : bias;
  }
  const int64_t bytes = e.bf16_out ? 2 : 4;
  char* o = static_cast<char*>(out) + (row0 * ldo + n0) * bytes;
  x += row0 * ld;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    panel_rows<Op, kRows>(x + r * ld, ld, w, comp, kq, e, row0 + r, o + r * ldo * bytes, ldo, cols);
  }
  x += r * ld, o += r * ldo * bytes, row0 += r;
  switch (rows - r) {
    case 5: panel_rows<Op, 5>(x, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    case 4: panel_rows<Op, 4>(x, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    case 3: panel_rows<Op, 3>(x, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    case 2: panel_rows<Op, 2>(x, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    case 1: panel_rows<Op, 1>(x, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    default: break;
  }
}

// tasks [begin, end): task t is row chunk t / panels, panel t % panels (a thread's consecutive tasks reuse one
// chunk across panels). A function of its own, not the parallel_for lambda's body, so that it carries the target.
template <class Op>
PREFIXCACHE_INT8_TARGET void run_tasks(int64_t begin, int64_t end, const typename Op::In* x, int64_t M, int64_t ld,
                                       int64_t chunk, int64_t panels, const int8_t* w, const int32_t* comp,
                                       int64_t kq, const Rescale& e, void* out, int64_t N) {
  for (int64_t t = begin; t < end; ++t) {
    const int64_t ch = t / panels, p = t % panels, m0 = ch * chunk, n0 = p * kPanel;
    panel<Op>(x, ld, m0, std::min(chunk, M - m0), w + p * kq * kPanel * Op::kStep,
              Op::kCompensated ? comp + n0 : nullptr, kq, e, n0, out, N, std::min(kPanel, N - n0));
  }
}

// x [M, ld] (Op's copy of the activations) @ the packed weight [panels, kq, 16 kStep] into out [M, N] (int32, or
// float32 / bfloat16 through e); comp: Op::kCompensated's [16 panels] int32, else unread.
template <class Op>
void gemm_rows(const typename Op::In* x, int64_t M, int64_t ld, const at::Tensor& packed, const int32_t* comp,
               int64_t N, const Rescale& e, void* out) {
  const int64_t kq = packed.size(1), panels = packed.size(0);
  if (M == 0 || N == 0) return;
  const int64_t row_bytes = ld * static_cast<int64_t>(sizeof(typename Op::In));
  const int64_t chunk = std::clamp<int64_t>(kChunkBytes / row_bytes / kRows * kRows, kRows, 256);
  const int64_t chunks = (M + chunk - 1) / chunk;
  const int8_t* w = packed.data_ptr<int8_t>();
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    run_tasks<Op>(begin, end, x, M, ld, chunk, panels, w, comp, kq, e, out, N);
  });
}

// The packed weight's shape for a [K, N] weight (Op::kStep inputs per lane); returns kq (input steps). layout
// names the packing function in the message.
template <class Op>
int64_t check_packed_shape(int64_t K, const at::Tensor& packed, int64_t N, const char* layout) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kPanel * Op::kStep,
              "packed must be the contiguous [ceil(N / 16), ceil(K / ", Op::kStep, "), ", kPanel * Op::kStep,
              "] int8 of ", layout);
  const int64_t kq = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(kq == (K + Op::kStep - 1) / Op::kStep && panels == (N + kPanel - 1) / kPanel, "packed has shape ",
              packed.sizes(), ", which is not that of a [", K, ", ", N, "] weight");
  return kq;
}

inline void check_floats(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, name, " must be ", n,
              " contiguous float32 values");
}

// x [M, K] int8 as Op's copy, rows ld apart, zero past K (the packed weight is zero there)
template <class Op>
void int8_rows_to_in(const at::Tensor& x, int64_t ld, typename Op::In* dst) {
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int8_t* src = xc.data_ptr<int8_t>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < K; ++k) dst[m * ld + k] = Op::from_int8(src[m * K + k]);
      for (int64_t k = K; k < ld; ++k) dst[m * ld + k] = 0;
    }
  });
}

// x [M, K] int8 @ the packed weight into out [M, N] (int32, or float32 / bfloat16 through e); kq from the checks
template <class Op>
void gemm_int8(const at::Tensor& x, int64_t kq, const at::Tensor& packed, const int32_t* comp, int64_t N,
               const Rescale& e, void* out) {
  const int64_t ld = kq * Op::kStep;
  const auto dtype = sizeof(typename Op::In) == 2 ? at::kShort : at::kByte;
  at::Tensor copy = at::empty({x.size(0), ld}, x.options().dtype(dtype));
  auto* buffer = static_cast<typename Op::In*>(copy.data_ptr());
  int8_rows_to_in<Op>(x, ld, buffer);
  gemm_rows<Op>(buffer, x.size(0), ld, packed, comp, N, e, out);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) { return vec16_detail::load_bf16_8(p); }
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }

// One row of quant.quantize_activations' rule: x' = x (* mul), s = max(max|x'| / 127, 1e-12), q =
// round_half_even(x' / s), each an IEEE float32 operation, so the bits of int8_rows.cpp's quantize_rows_int8
// and, for finite rows, of the torch ops; a row holding a NaN or an infinity gets a NaN scale and q = 0, as
// there. q goes to dst as Op stores it (K values, then zeros to ld); returns the row's scale.
template <class Op, typename T>
float quantize_row(const T* x, const float* mul, int64_t K, int64_t ld, typename Op::In* dst) {
  using In = typename Op::In;
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  float amax1 = 0.f;
  bool bad1 = false;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 v = load8(x + k);
    if (mul != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(mul + k));
    const __m256 a = _mm256_andnot_ps(sign, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or infinity
    amax = _mm256_max_ps(amax, a);
  }
  for (int64_t t = k; t < K; ++t) {
    const float v = mul != nullptr ? load1(x + t) * mul[t] : load1(x + t);
    const float a = std::fabs(v);
    bad1 |= !(a < std::numeric_limits<float>::infinity());
    amax1 = std::max(amax1, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  for (float a : lanes) amax1 = std::max(amax1, a);  // the maximum of non-negative finite values: any order
  if (bad1 || _mm256_movemask_ps(bad) != 0) {
    std::fill(dst, dst + K, Op::kZeroQ);  // q = 0
    std::fill(dst + K, dst + ld, In{0});
    return std::numeric_limits<float>::quiet_NaN();
  }
  float s = amax1 / 127.f;
  if (!(s >= 1e-12f)) s = 1e-12f;  // torch's clamp_(min=1e-12)
  const __m256 vs = _mm256_set1_ps(s);
  for (k = 0; k + 8 <= K; k += 8) {
    __m256 v = load8(x + k);
    if (mul != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(mul + k));
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Op::store_q8(_mm256_cvtps_epi32(r), dst + k);  // -127..127: |x' / s| <= 127 (1 + 2^-23)
  }
  for (; k < K; ++k) {
    const float v = mul != nullptr ? load1(x + k) * mul[k] : load1(x + k);
    dst[k] = Op::from_int8(static_cast<int8_t>(std::nearbyint(v / s)));  // round half to even
  }
  std::fill(dst + K, dst + ld, In{0});
  return s;
}

// int8 x [M, K] @ the packed weight -> [M, N] int32 (e: none) or float32 (x_scale [M], w_scale [N], bias [N])
template <class Op>
at::Tensor int8_gemm_call(const at::Tensor& x, int64_t kq, const at::Tensor& packed, const int32_t* comp, int64_t N) {
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kInt));
  gemm_int8<Op>(x, kq, packed, comp, N, Rescale{nullptr, nullptr, nullptr, false}, out.data_ptr());
  return out;
}

template <class Op>
at::Tensor int8_linear_call(const at::Tensor& x, int64_t kq, const at::Tensor& packed, const int32_t* comp,
                            const at::Tensor& x_scale, const at::Tensor& w_scale,
                            const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = w_scale.numel();
  check_floats(x_scale, M, "x_scale");
  if (bias.has_value()) check_floats(*bias, N, "bias");
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  gemm_int8<Op>(x, kq, packed, comp, N,
                Rescale{x_scale.data_ptr<float>(), w_scale.data_ptr<float>(),
                        bias.has_value() ? bias->data_ptr<float>() : nullptr, false},
                out.data_ptr());
  return out;
}

// The checks of a call's float x [M, K] and out_dtype (before the packed weight's, which need K)
inline at::Tensor check_product_args(const at::Tensor& x_in, at::ScalarType out_dtype) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  return x_in.contiguous();
}

// quant.int8_product in one call: x [M, K] float32 or bfloat16 (x from check_product_args, times mul [K])
// quantized per row (quantize_row), the exact product, float(acc) * s[m] * w_scale [N] (+ bias [N]) -> [M, N]
// out_dtype (float32 or bfloat16); kq from the packed weight's checks.
template <class Op>
at::Tensor int8_product_call(const at::Tensor& x, const c10::optional<at::Tensor>& mul_in, int64_t kq,
                             const at::Tensor& packed, const int32_t* comp, const at::Tensor& w_scale,
                             const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const int64_t M = x.size(0), K = x.size(1), N = w_scale.numel(), ld = kq * Op::kStep;
  if (bias.has_value()) check_floats(*bias, N, "bias");
  if (mul_in.has_value()) check_floats(*mul_in, K, "mul");
  at::Tensor copy = at::empty({M, ld}, x.options().dtype(sizeof(typename Op::In) == 2 ? at::kShort : at::kByte));
  at::Tensor x_scale = at::empty({M}, x.options().dtype(at::kFloat));
  auto* q = static_cast<typename Op::In*>(copy.data_ptr());
  float* s = x_scale.data_ptr<float>();
  const float* mul = mul_in.has_value() ? mul_in->data_ptr<float>() : nullptr;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      s[m] = bf16 ? quantize_row<Op>(x.data_ptr<at::BFloat16>() + m * K, mul, K, ld, q + m * ld)
                  : quantize_row<Op>(x.data_ptr<float>() + m * K, mul, K, ld, q + m * ld);
    }
  });
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_dtype));
  gemm_rows<Op>(q, M, ld, packed, comp, N,
                Rescale{s, w_scale.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                        out_dtype == at::kBFloat16},
                out.data_ptr());
  return out;
}

}  // namespace
