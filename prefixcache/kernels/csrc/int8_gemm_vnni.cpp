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
// row chunks whose u8 copy fits L2, parallel over (row chunk, panel), as int8_gemm_avx2.cpp does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "vec16.h"  // its AVX2 backend here: load_bf16_8, to_bf16_bits_8

#define PREFIXCACHE_VNNI __attribute__((target("avx2,fma,avxvnni")))

namespace {

constexpr int64_t kPanel = 16;              // outputs per panel (two ymm of int32)
constexpr int64_t kQuad = 4;                // inputs per int32 lane (vpdpbusd)
constexpr int64_t kRows = 6;                // rows per micro-kernel
constexpr int64_t kChunkBytes = 256 << 10;  // a row chunk's u8 copy: L2-sized

// The panel's epilogue, int8_gemm_avx2.cpp's: int32 sums as they are, or y = float(acc) * x_scale[row] * w_scale[n]
// (+ bias[n]), rounded after each operation (the empty asm keeps the product out of an fma with the bias add).
struct Rescale {
  const float* x_scale;  // [M] (the call's rows), or nullptr: int32 out
  const float* w_scale;  // this panel's 16 (zero-padded past N)
  const float* bias;     // this panel's 16, or nullptr
  bool bf16_out;         // float32 out rounded to bfloat16 (2-byte elements)
};

// rows r < R (R <= 6) of one panel over all kq input quads; u: row r at u + r * ld; comp: this panel's 16; out:
// 4-byte elements (int32 or float32; 2-byte bfloat16 where e.bf16_out), row r at out + r * ldo, the first cols
// written. The 2 R accumulators are named variables, as in int8_gemm_avx2.cpp (GCC 12 leaves an unrolled array of
// 12 ymm partly on the stack): 12 accumulators, two weight vectors and one broadcast fill 15 of the 16 ymm.
template <int R>
PREFIXCACHE_VNNI __attribute__((always_inline)) inline void panel_rows(const uint8_t* u, int64_t ld, const int8_t* w,
                                                                       const int32_t* comp, int64_t kq,
                                                                       const Rescale& e, int64_t row0, void* out,
                                                                       int64_t ldo, int64_t cols) {
  static_assert(R >= 1 && R <= kRows, "rows per micro-kernel");
  const __m256i zero = _mm256_setzero_si256();
  __m256i a00 = zero, a01 = zero, a10 = zero, a11 = zero, a20 = zero, a21 = zero, a30 = zero, a31 = zero,
          a40 = zero, a41 = zero, a50 = zero, a51 = zero;
  // row r's quad q is the 4 bytes at u + r * ld + 4 q, read as one int32 (may_alias: the buffer is uint8)
  using Quad = int32_t __attribute__((may_alias));
  const Quad* u0 = reinterpret_cast<const Quad*>(u);
  const Quad* u1 = reinterpret_cast<const Quad*>(u + std::min(1, R - 1) * ld);
  const Quad* u2 = reinterpret_cast<const Quad*>(u + std::min(2, R - 1) * ld);
  const Quad* u3 = reinterpret_cast<const Quad*>(u + std::min(3, R - 1) * ld);
  const Quad* u4 = reinterpret_cast<const Quad*>(u + std::min(4, R - 1) * ld);
  const Quad* u5 = reinterpret_cast<const Quad*>(u + std::min(5, R - 1) * ld);
#define PREFIXCACHE_ROW(r)                                       \
  if constexpr (R > r) {                                         \
    const __m256i s = _mm256_set1_epi32(u##r[q]);                \
    a##r##0 = _mm256_dpbusd_avx_epi32(a##r##0, s, w0);           \
    a##r##1 = _mm256_dpbusd_avx_epi32(a##r##1, s, w1);           \
  }
#define PREFIXCACHE_QUAD                                                                    \
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64));      \
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64 + 32)); \
  PREFIXCACHE_ROW(0) PREFIXCACHE_ROW(1) PREFIXCACHE_ROW(2) PREFIXCACHE_ROW(3) PREFIXCACHE_ROW(4) PREFIXCACHE_ROW(5)
  if constexpr (R > 4) {
#pragma GCC unroll 2
    for (int64_t q = 0; q < kq; ++q) {  // two quads per iteration: the loop's counter and branch cost issue slots
      PREFIXCACHE_QUAD
    }
  } else {
    for (int64_t q = 0; q < kq; ++q) {
      PREFIXCACHE_QUAD
    }
  }
#undef PREFIXCACHE_QUAD
#undef PREFIXCACHE_ROW
  const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp));
  const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp + 8));
  alignas(32) int32_t tmp[kPanel];
  auto emit = [&](int r, __m256i lo, __m256i hi) {  // row r's 16 sums (outputs 0..7, 8..15)
    for (int h = 0; h < 2; ++h) {
      __m256i v = _mm256_sub_epi32(h == 0 ? lo : hi, h == 0 ? c0 : c1);
      if (e.x_scale != nullptr) {
        __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(e.x_scale[row0 + r]));
        y = _mm256_mul_ps(y, _mm256_loadu_ps(e.w_scale + 8 * h));
        asm("" : "+x"(y));  // y rounded before the bias add: never fused into one fma (see Rescale)
        if (e.bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(e.bias + 8 * h));
        v = e.bf16_out ? _mm256_srli_epi32(vec16_detail::to_bf16_bits_8(y), 16) : _mm256_castps_si256(y);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8 * h), v);
    }
    if (e.bf16_out) {
      uint16_t* o = reinterpret_cast<uint16_t*>(static_cast<char*>(out) + r * ldo * 2);
      for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<uint16_t>(tmp[c]);
    } else {
      std::memcpy(static_cast<char*>(out) + r * ldo * 4, tmp, cols * 4);
    }
  };
  emit(0, a00, a01);
  if constexpr (R > 1) emit(1, a10, a11);
  if constexpr (R > 2) emit(2, a20, a21);
  if constexpr (R > 3) emit(3, a30, a31);
  if constexpr (R > 4) emit(4, a40, a41);
  if constexpr (R > 5) emit(5, a50, a51);
}

// rows [row0, row0 + rows) of one panel (cols outputs from n0), inlined into run_tasks with the micro-kernels
PREFIXCACHE_VNNI __attribute__((always_inline)) inline void panel(const uint8_t* u, int64_t ld, int64_t row0, int64_t rows, const int8_t* w,
                            const int32_t* comp, int64_t kq, Rescale e, int64_t n0, void* out, int64_t ldo,
                            int64_t cols) {
  alignas(32) float w_scale[kPanel] = {}, bias[kPanel] = {};
  if (e.x_scale != nullptr) {
    std::memcpy(w_scale, e.w_scale + n0, cols * 4);
    if (e.bias != nullptr) std::memcpy(bias, e.bias + n0, cols * 4);
    e.w_scale = w_scale, e.bias = e.bias == nullptr ? nullptr : bias;
  }
  const int64_t bytes = e.bf16_out ? 2 : 4;
  char* o = static_cast<char*>(out) + (row0 * ldo + n0) * bytes;
  u += row0 * ld;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    panel_rows<kRows>(u + r * ld, ld, w, comp, kq, e, row0 + r, o + r * ldo * bytes, ldo, cols);
  }
  u += r * ld, o += r * ldo * bytes, row0 += r;
  switch (rows - r) {
    case 5: panel_rows<5>(u, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    case 4: panel_rows<4>(u, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    case 3: panel_rows<3>(u, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    case 2: panel_rows<2>(u, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    case 1: panel_rows<1>(u, ld, w, comp, kq, e, row0, o, ldo, cols); break;
    default: break;
  }
}

// The packed weight's checks; returns kq (input quads).
int64_t check_packed(int64_t K, const at::Tensor& packed, const at::Tensor& comp, int64_t N) {
  TORCH_CHECK(__builtin_cpu_supports("avxvnni"), "int8_gemm_vnni needs a CPU with AVX-VNNI");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kPanel * kQuad,
              "packed must be the contiguous [ceil(N / 16), ceil(K / 4), 64] int8 of avx2_kernels.pack_weight_vnni");
  const int64_t kq = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(kq == (K + kQuad - 1) / kQuad && panels == (N + kPanel - 1) / kPanel, "packed has shape ",
              packed.sizes(), ", which is not that of a [", K, ", ", N, "] weight");
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == panels * kPanel,
              "comp must be pack_weight_vnni's ", panels * kPanel, " contiguous int32 column sums");
  return kq;
}

// x [M, K] int8 as u = x + 128, rows ld = 4 kq apart, zero past K (the packed weight is zero there)
void int8_to_u8(const at::Tensor& x, int64_t ld, uint8_t* u) {
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int8_t* src = xc.data_ptr<int8_t>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < K; ++k) u[m * ld + k] = static_cast<uint8_t>(src[m * K + k]) ^ 0x80;
      for (int64_t k = K; k < ld; ++k) u[m * ld + k] = 0;
    }
  });
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) { return vec16_detail::load_bf16_8(p); }
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }

// One row of quant.quantize_activations as u = q + 128 (the file's header); returns the row's scale.
template <typename T>
float quantize_row_u8(const T* x, const float* mul, int64_t K, int64_t ld, uint8_t* u) {
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
    std::memset(u, 0x80, K);  // q = 0
    std::memset(u + K, 0, ld - K);
    return std::numeric_limits<float>::quiet_NaN();
  }
  float s = amax1 / 127.f;
  if (!(s >= 1e-12f)) s = 1e-12f;  // torch's clamp_(min=1e-12)
  const __m256 vs = _mm256_set1_ps(s);
  const __m256i offset = _mm256_set1_epi32(128), order = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
  for (k = 0; k + 8 <= K; k += 8) {
    __m256 v = load8(x + k);
    if (mul != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(mul + k));
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(r), offset);  // 1..255: |x' / s| <= 127 (1 + 2^-23)
    q = _mm256_packus_epi32(q, q);                                 // per 128-bit half: its 4 values, twice
    q = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(q, q), order);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(u + k), _mm256_castsi256_si128(q));
  }
  for (; k < K; ++k) {
    const float v = mul != nullptr ? load1(x + k) * mul[k] : load1(x + k);
    u[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(v / s)) + 128);  // round half to even
  }
  std::memset(u + K, 0, ld - K);
  return s;
}

// tasks [begin, end): task t is row chunk t / panels, panel t % panels (a thread's consecutive tasks reuse one
// chunk across panels)
PREFIXCACHE_VNNI void run_tasks(int64_t begin, int64_t end, const uint8_t* u, int64_t M, int64_t ld, int64_t chunk,
                                int64_t panels, const int8_t* w, const int32_t* c, int64_t kq, const Rescale& e,
                                void* out, int64_t N) {
  for (int64_t t = begin; t < end; ++t) {
    const int64_t ch = t / panels, p = t % panels, m0 = ch * chunk, n0 = p * kPanel;
    panel(u, ld, m0, std::min(chunk, M - m0), w + p * kq * kPanel * kQuad, c + n0, kq, e, n0, out, N,
          std::min(kPanel, N - n0));
  }
}

// u [M, ld] (x + 128) @ the packed weight into out [M, N] (int32, or float32 / bfloat16 through e)
void gemm_u8(const uint8_t* u, int64_t M, int64_t ld, const at::Tensor& packed, const at::Tensor& comp, int64_t N,
             const Rescale& e, void* out) {
  const int64_t kq = packed.size(1), panels = packed.size(0);
  if (M == 0 || N == 0) return;
  const int64_t chunk = std::clamp<int64_t>(kChunkBytes / ld / kRows * kRows, kRows, 256);
  const int64_t chunks = (M + chunk - 1) / chunk;
  const int8_t* w = packed.data_ptr<int8_t>();
  const int32_t* c = comp.data_ptr<int32_t>();
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    run_tasks(begin, end, u, M, ld, chunk, panels, w, c, kq, e, out, N);
  });
}

// x [M, K] int8 @ the packed weight into out [M, N] (int32, or float32 through e)
void gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp, int64_t N, const Rescale& e,
          void* out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar, "x must be [M, K] int8");
  const int64_t ld = check_packed(x.size(1), packed, comp, N) * kQuad;
  at::Tensor u8 = at::empty({x.size(0), ld}, x.options().dtype(at::kByte));
  int8_to_u8(x, ld, u8.data_ptr<uint8_t>());
  gemm_u8(u8.data_ptr<uint8_t>(), x.size(0), ld, packed, comp, N, e, out);
}

}  // namespace

// x [M, K] int8 @ the packed [K, N] int8 weight -> [M, N] int32: torch._int_mm's exact sums.
at::Tensor int8_gemm_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp, int64_t N) {
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kInt));
  gemm(x, packed, comp, N, Rescale{nullptr, nullptr, nullptr, false}, out.data_ptr());
  return out;
}

// The same sums rescaled: float(acc) * x_scale [M, 1] * w_scale [N] (+ bias [N]) -> [M, N] float32, the bits of
// quant.int8_rows_to_float_torch(acc, x_scale, weight, torch.float32).
at::Tensor int8_linear_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp,
                            const at::Tensor& x_scale, const at::Tensor& w_scale,
                            const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = w_scale.numel();
  auto check = [](const at::Tensor& t, int64_t n, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, name, " must be ", n,
                " contiguous float32 values");
  };
  check(x_scale, M, "x_scale");
  check(w_scale, N, "w_scale");
  if (bias.has_value()) check(*bias, N, "bias");
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  gemm(x, packed, comp, N, Rescale{x_scale.data_ptr<float>(), w_scale.data_ptr<float>(),
                                   bias.has_value() ? bias->data_ptr<float>() : nullptr, false}, out.data_ptr());
  return out;
}

// quant.int8_product in one call: x [M, K] float32 or bfloat16 (times mul [K]) quantized per row, the exact
// product, float(acc) * s[m] * w_scale [N] (+ bias [N]) -> [M, N] out_dtype (float32 or bfloat16).
at::Tensor int8_product_vnni(const at::Tensor& x_in, const c10::optional<at::Tensor>& mul_in, const at::Tensor& packed,
                             const at::Tensor& comp, const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                             at::ScalarType out_dtype) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w_scale.numel();
  auto check = [](const at::Tensor& t, int64_t n, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, name, " must be ", n,
                " contiguous float32 values");
  };
  check(w_scale, N, "w_scale");
  if (bias.has_value()) check(*bias, N, "bias");
  if (mul_in.has_value()) check(*mul_in, K, "mul");
  const int64_t ld = check_packed(K, packed, comp, N) * kQuad;
  at::Tensor u8 = at::empty({M, ld}, x.options().dtype(at::kByte));
  at::Tensor x_scale = at::empty({M}, x.options().dtype(at::kFloat));
  uint8_t* u = u8.data_ptr<uint8_t>();
  float* s = x_scale.data_ptr<float>();
  const float* mul = mul_in.has_value() ? mul_in->data_ptr<float>() : nullptr;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      s[m] = bf16 ? quantize_row_u8(x.data_ptr<at::BFloat16>() + m * K, mul, K, ld, u + m * ld)
                  : quantize_row_u8(x.data_ptr<float>() + m * K, mul, K, ld, u + m * ld);
    }
  });
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_dtype));
  gemm_u8(u, M, ld, packed, comp, N,
          Rescale{s, w_scale.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                  out_dtype == at::kBFloat16},
          out.data_ptr());
  return out;
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
