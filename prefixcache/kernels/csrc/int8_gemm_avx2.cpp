// quantization="int8"'s product on AVX2 + FMA CPUs (no AVX512-VNNI, no AMX-INT8), where torch._int_mm has no
// fast kernel: acc[m, n] = sum_k x[m, k] * w[k, n] in int32, exactly (built by prefixcache/kernels/avx2_kernels.py; bound in bindings_avx2.cpp).
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
// Layout (avx2_kernels.pack_weight): packed[p, q, 2 j + i] = w[2 q + i, 16 p + j], int8, shape = [ceil(N / 16),
// ceil(K / 2), 32], zero-padded: one 16-output panel's input pair is 32 bytes, sign-extended into two ymm
// (outputs 0..7, 8..15). Rows go in blocks of 6 (12 int32 accumulators in registers, see panel_rows), over row
// chunks whose int16 copy fits L2, parallel over (row chunk, panel).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;              // outputs per panel (two ymm of int32)
constexpr int64_t kPair = 2;                // inputs per int32 lane
constexpr int64_t kRows = 6;                // rows per micro-kernel
constexpr int64_t kChunkBytes = 256 << 10;  // a row chunk's int16 copy: L2-sized

// The panel's epilogue: int32 sums as they are, or y = float(acc) * x_scale[row] * w_scale[n] (+ bias[n]),
// rounded after each operation (quant.int8_rows_to_float_torch's order: an empty asm on the product keeps the
// compiler, which contracts a product and a sum into one fma by default, from fusing it with the bias add, so the
// bits are that function's).
struct Rescale {
  const float* x_scale;  // [M] (the call's rows), or nullptr: int32 out
  const float* w_scale;  // this panel's 16 (zero-padded past N)
  const float* bias;     // this panel's 16, or nullptr
};

// rows r < R (R <= 6) of one panel over all kq input pairs; x: row r at x + r * ld (int16, 2 per pair); out: 4-byte
// elements (int32 or float32), row r at out + r * ldo, the first cols written.
// The 2 R accumulators are named variables, not an array: GCC (12) leaves an unrolled array of 12 ymm partly on
// the stack, a load and a store per spilled accumulator per pair on top of the 26 vector operations. Per pair: two
// weight loads (sign-extended), R broadcasts, 2 R vpmaddwd and 2 R vpaddd: 12 accumulators, the two weight
// vectors, one broadcast and one product fill the 16 ymm registers with nothing spilled.
template <int R>
__attribute__((always_inline)) inline void panel_rows(const int16_t* x, int64_t ld, const int8_t* w, int64_t kq,
                                                      const Rescale& e, int64_t row0, void* out, int64_t ldo,
                                                      int64_t cols) {
  static_assert(R >= 1 && R <= kRows, "rows per micro-kernel");
  const __m256i zero = _mm256_setzero_si256();
  __m256i a00 = zero, a01 = zero, a10 = zero, a11 = zero, a20 = zero, a21 = zero, a30 = zero, a31 = zero,
          a40 = zero, a41 = zero, a50 = zero, a51 = zero;
  // row r's pair q is the 4 bytes at x + r * ld + 2 q (ld even), read as one int32 (may_alias: the buffer is int16)
  using Pair = int32_t __attribute__((may_alias));
  const Pair* x0 = reinterpret_cast<const Pair*>(x);
  const Pair* x1 = reinterpret_cast<const Pair*>(x + std::min(1, R - 1) * ld);
  const Pair* x2 = reinterpret_cast<const Pair*>(x + std::min(2, R - 1) * ld);
  const Pair* x3 = reinterpret_cast<const Pair*>(x + std::min(3, R - 1) * ld);
  const Pair* x4 = reinterpret_cast<const Pair*>(x + std::min(4, R - 1) * ld);
  const Pair* x5 = reinterpret_cast<const Pair*>(x + std::min(5, R - 1) * ld);
#define PREFIXCACHE_ROW(r)                                           \
  if constexpr (R > r) {                                             \
    const __m256i s = _mm256_set1_epi32(x##r[q]);                    \
    a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(s, w0));   \
    a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(s, w1));   \
  }
#define PREFIXCACHE_PAIR                                                                                        \
  const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + q * 32)));      \
  const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + q * 32 + 16))); \
  PREFIXCACHE_ROW(0) PREFIXCACHE_ROW(1) PREFIXCACHE_ROW(2) PREFIXCACHE_ROW(3) PREFIXCACHE_ROW(4) PREFIXCACHE_ROW(5)
  if constexpr (R > 4) {
    // two pairs per iteration: the loop's own counter and branch take issue slots from the vector ports
#pragma GCC unroll 2
    for (int64_t q = 0; q < kq; ++q) {
      PREFIXCACHE_PAIR
    }
  } else {
    for (int64_t q = 0; q < kq; ++q) {  // <= 4 rows: fewer vector operations per weight load, not unrolled
      PREFIXCACHE_PAIR
    }
  }
#undef PREFIXCACHE_PAIR
#undef PREFIXCACHE_ROW
  alignas(32) int32_t tmp[kPanel];
  auto emit = [&](int r, __m256i lo, __m256i hi) {  // row r's 16 sums (outputs 0..7, 8..15)
    for (int h = 0; h < 2; ++h) {
      __m256i v = h == 0 ? lo : hi;
      if (e.x_scale != nullptr) {
        __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(e.x_scale[row0 + r]));
        y = _mm256_mul_ps(y, _mm256_loadu_ps(e.w_scale + 8 * h));
        asm("" : "+x"(y));  // y rounded before the bias add: never fused into one fma (see Rescale)
        if (e.bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(e.bias + 8 * h));
        v = _mm256_castps_si256(y);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8 * h), v);
    }
    std::memcpy(static_cast<char*>(out) + r * ldo * 4, tmp, cols * 4);
  };
  emit(0, a00, a01);
  if constexpr (R > 1) emit(1, a10, a11);
  if constexpr (R > 2) emit(2, a20, a21);
  if constexpr (R > 3) emit(3, a30, a31);
  if constexpr (R > 4) emit(4, a40, a41);
  if constexpr (R > 5) emit(5, a50, a51);
}

// rows [row0, row0 + rows) of one panel (cols outputs from n0). Inlined into gemm's task loop with the
// micro-kernels: compiled out of line, GCC 12 gives the same 6-row loop a layout that runs it measurably slower.
__attribute__((always_inline)) inline void panel(const int16_t* x, int64_t ld, int64_t row0, int64_t rows,
                                                 const int8_t* w, int64_t kq, Rescale e, int64_t n0, void* out,
                                                 int64_t ldo, int64_t cols) {
  alignas(32) float w_scale[kPanel] = {}, bias[kPanel] = {};
  if (e.x_scale != nullptr) {
    std::memcpy(w_scale, e.w_scale + n0, cols * 4);
    if (e.bias != nullptr) std::memcpy(bias, e.bias + n0, cols * 4);
    e.w_scale = w_scale, e.bias = e.bias == nullptr ? nullptr : bias;
  }
  char* o = static_cast<char*>(out) + (row0 * ldo + n0) * 4;
  x += row0 * ld;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    panel_rows<kRows>(x + r * ld, ld, w, kq, e, row0 + r, o + r * ldo * 4, ldo, cols);
  }
  x += r * ld, o += r * ldo * 4, row0 += r;
  switch (rows - r) {
    case 5: panel_rows<5>(x, ld, w, kq, e, row0, o, ldo, cols); break;
    case 4: panel_rows<4>(x, ld, w, kq, e, row0, o, ldo, cols); break;
    case 3: panel_rows<3>(x, ld, w, kq, e, row0, o, ldo, cols); break;
    case 2: panel_rows<2>(x, ld, w, kq, e, row0, o, ldo, cols); break;
    case 1: panel_rows<1>(x, ld, w, kq, e, row0, o, ldo, cols); break;
    default: break;
  }
}

// x [M, K] int8 @ the packed weight into out [M, N] (int32, or float32 through e)
void gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const Rescale& e, void* out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar, "x must be [M, K] int8");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kPanel * kPair,
              "packed must be the contiguous [ceil(N / 16), ceil(K / 2), 32] int8 of avx2_kernels.pack_weight");
  const int64_t M = x.size(0), K = x.size(1), kq = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(kq == (K + kPair - 1) / kPair && panels == (N + kPanel - 1) / kPanel, "packed has shape ",
              packed.sizes(), ", which is not that of a [", K, ", ", N, "] weight");
  if (M == 0 || N == 0) return;
  // x as int16, rows ld = 2 kq apart, zero past K
  const int64_t ld = kq * kPair;
  at::Tensor x16 = at::empty({M, ld}, x.options().dtype(at::kShort));
  const at::Tensor xc = x.contiguous();
  const int8_t* src = xc.data_ptr<int8_t>();
  int16_t* x16_p = x16.data_ptr<int16_t>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < K; ++k) x16_p[m * ld + k] = src[m * K + k];
      for (int64_t k = K; k < ld; ++k) x16_p[m * ld + k] = 0;
    }
  });
  const int64_t chunk = std::clamp<int64_t>(kChunkBytes / (2 * ld) / kRows * kRows, kRows, 256);
  const int64_t chunks = (M + chunk - 1) / chunk;
  const int8_t* w = packed.data_ptr<int8_t>();
  // task t: row chunk t / panels, panel t % panels; a thread's consecutive tasks reuse one chunk across panels
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t / panels, p = t % panels, m0 = c * chunk, n0 = p * kPanel;
      panel(x16_p, ld, m0, std::min(chunk, M - m0), w + p * kq * kPanel * kPair, kq, e, n0, out, N,
            std::min(kPanel, N - n0));
    }
  });
}

}  // namespace

// x [M, K] int8 @ the packed [K, N] int8 weight -> [M, N] int32: torch._int_mm's exact sums.
at::Tensor int8_gemm_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kInt));
  gemm(x, packed, N, Rescale{nullptr, nullptr, nullptr}, out.data_ptr());
  return out;
}

// The same sums rescaled: float(acc) * x_scale [M, 1] * w_scale [N] (+ bias [N]) -> [M, N] float32, the bits of
// quant.int8_rows_to_float_torch(acc, x_scale, weight, torch.float32).
at::Tensor int8_linear_avx2(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& x_scale,
                            const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = w_scale.numel();
  auto check = [](const at::Tensor& t, int64_t n, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, name, " must be ", n,
                " contiguous float32 values");
  };
  check(x_scale, M, "x_scale");
  check(w_scale, N, "w_scale");
  if (bias.has_value()) check(*bias, N, "bias");
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  gemm(x, packed, N, Rescale{x_scale.data_ptr<float>(), w_scale.data_ptr<float>(),
                             bias.has_value() ? bias->data_ptr<float>() : nullptr}, out.data_ptr());
  return out;
}
