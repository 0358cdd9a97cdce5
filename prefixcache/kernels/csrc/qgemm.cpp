// Products of a few activation rows with grouped low-bit weights (generated tokens), on AVX512-VNNI.
//
//   int4_mm: w[n, k] = q[n, k] * scale[n, k / 32] + min[n, k / 32], q in 0..15   (llama.cpp's Q4_1 grid)
//   int8_mm: w[n, k] = q[n, k] * scale[n, k / 32],                   q in -127..127 (llama.cpp's Q8_0 grid)
//
// Activations are quantized per row and per group of 32 input features to int8 (``d = max|x| / 127``,
// ``q = round(x / d)``: llama.cpp's Q8_1 / Q8_0 activation blocks), each group's products are summed
// exactly in int32 by ``vpdpbusd`` (unsigned x signed bytes, 4 per 32-bit lane), and the groups are
// added in float32 in ascending order:
//
//   int4: y += float(sum_k qw * qx) * (scale * d) + min * (d * sum_k qx)     (llama.cpp ggml_vec_dot_q4_1_q8_1)
//   int8: y += float(sum_k qw * qx) * (scale * d)                            (ggml_vec_dot_q8_0_q8_0)
//
// (int8 feeds ``qx + 128`` as the unsigned operand and adds ``-128 * sum_k qw``, precomputed per group.)
// Scales and mins are float16, as in the GGUF blocks. A block of 16 outputs (one AVX-512 register of
// lanes) is computed by one thread, its weights, scales and mins read as three sequential streams; a
// row's arithmetic never depends on the other rows of the call or on the split between threads, so
// a row gets the same bits in any batch. Rows are processed 4 at a time (each weight load serves 4).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // outputs per block: one __m512
constexpr int64_t kGroup = 32;  // input features per scale
constexpr int kMaxRows = 4;     // rows per pass over a weight block

struct QuantRows {  // the activations, quantized per row and group
  std::vector<int8_t> q;   // [M, K]: q (int4_mm) or the bits of q + 128 as uint8 (int8_mm)
  std::vector<float> d;    // [M, K / 32]: the group's scale
  std::vector<float> sum;  // [M, K / 32]: d * the sum of the group's q
};

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }
template <>
inline float to_float<at::BFloat16>(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T>
QuantRows quantize_rows(const T* x, int64_t M, int64_t K, bool offset) {
  const int64_t G = K / kGroup;
  QuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      float v[kGroup];
      float amax = 0.f;
      bool finite = true;
      for (int i = 0; i < kGroup; ++i) {
        v[i] = to_float(x[m * K + g * kGroup + i]);
        finite = finite && std::isfinite(v[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      if (!finite) {  // NaN / inf in the group: the row's outputs become NaN (q = 0, d = NaN)
        d = std::numeric_limits<float>::quiet_NaN(), inv = 0.f;
      } else if (!std::isfinite(inv)) {  // a group of subnormals (|x| < ~1e-36): zeros
        d = 0.f, inv = 0.f;
      }
      int sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const int q = static_cast<int>(std::nearbyint(v[i] * inv));
        sum += q;
        r.q[m * K + g * kGroup + i] = static_cast<int8_t>(offset ? q + 128 : q);
      }
      r.d[m * G + g] = d;
      r.sum[m * G + g] = d * static_cast<float>(sum);
    }
  }
  return r;
}

struct Call {
  const QuantRows* x;
  int64_t K, N;
  const at::Half* scale;  // [N / 16, K / 32, 16]
  const at::Half* min;    // int4: like scale; int8: nullptr
  const int32_t* corr;    // int8: [N / 16, K / 32, 16]; int4: nullptr
  const float* bias;      // [N] or nullptr
  void* out;              // [M, N] float32 or bfloat16
  bool out_bf16;
};

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i bcast4(const int8_t* p) {  // 4 bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline void store_row(const Call& a, int64_t row, int64_t nb, __m512 y) {
  if (a.bias) y = _mm512_add_ps(y, _mm512_loadu_ps(a.bias + nb * kLanes));
  if (!a.out_bf16) {
    _mm512_storeu_ps(static_cast<float*>(a.out) + row * a.N + nb * kLanes, y);
    return;
  }
  store_bf16(static_cast<at::BFloat16*>(a.out) + row * a.N + nb * kLanes, y);
}

// int4 packed: [N / 16, K / 8, 64] uint8: byte (b, c, 4 j + i) = q[16 b + j, 8 c + i] | q[16 b + j, 8 c + 4 + i] << 4
template <int R>
void int4_block(const Call& a, const uint8_t* packed, int64_t r0, int64_t nb) {
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t G = a.K / kGroup;
  const uint8_t* w = packed + nb * (a.K / 8) * 64;
  const at::Half* sc = a.scale + nb * G * kLanes;
  const at::Half* mn = a.min + nb * G * kLanes;
  for (int64_t g = 0; g < G; ++g) {
    __m512i wq[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(w + (g * 4 + c) * 64);
      wq[2 * c] = _mm512_and_si512(v, low);
      wq[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 s = load_half16(sc + g * kLanes), m = load_half16(mn + g * kLanes);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.x->q.data() + (r0 + r) * a.K + g * kGroup;
      __m512i acc = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        acc = _mm512_dpbusd_epi32(acc, wq[2 * c], bcast4(x + 8 * c));
        acc = _mm512_dpbusd_epi32(acc, wq[2 * c + 1], bcast4(x + 8 * c + 4));
      }
      const int64_t i = (r0 + r) * G + g;
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, _mm512_set1_ps(a.x->d[i])), y[r]);
      y[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.x->sum[i]), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(a, r0 + r, nb, y[r]);
}

// int8 packed: [N / 16, K / 4, 64] int8: element (b, c, 4 j + i) = q[16 b + j, 4 c + i]
template <int R>
void int8_block(const Call& a, const int8_t* packed, int64_t r0, int64_t nb) {
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const int64_t G = a.K / kGroup;
  const int8_t* w = packed + nb * (a.K / 4) * 64;
  const at::Half* sc = a.scale + nb * G * kLanes;
  const int32_t* co = a.corr + nb * G * kLanes;
  for (int64_t g = 0; g < G; ++g) {
    __m512i wq[8];
    for (int c = 0; c < 8; ++c) wq[c] = _mm512_loadu_si512(w + (g * 8 + c) * 64);
    const __m512 s = load_half16(sc + g * kLanes);
    const __m512i corr = _mm512_loadu_si512(co + g * kLanes);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.x->q.data() + (r0 + r) * a.K + g * kGroup;
      __m512i acc = corr;
      for (int c = 0; c < 8; ++c) acc = _mm512_dpbusd_epi32(acc, bcast4(x + 4 * c), wq[c]);
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, _mm512_set1_ps(a.x->d[(r0 + r) * G + g])), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(a, r0 + r, nb, y[r]);
}

// block(rows, r0, nb) for every block of 16 outputs and every pass of up to kMaxRows rows, the pass's
// row count as a compile-time constant (std::integral_constant<int, 1..4>)
template <typename Block>
void for_blocks(int64_t M, int64_t N, const Block& block) {
  at::parallel_for(0, N / kLanes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
        switch (std::min<int64_t>(kMaxRows, M - r0)) {
          case 1: block(std::integral_constant<int, 1>{}, r0, nb); break;
          case 2: block(std::integral_constant<int, 2>{}, r0, nb); break;
          case 3: block(std::integral_constant<int, 3>{}, r0, nb); break;
          default: block(std::integral_constant<int, 4>{}, r0, nb);
        }
      }
  });
}

QuantRows quantize(const at::Tensor& x_in, bool offset) {
  TORCH_CHECK(x_in.is_cpu(), "the int4 / int8 kernels run on CPU tensors");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kGroup == 0, "x must be [M, K] with K % 32 == 0");
  const at::Tensor x = x_in.contiguous();
  if (x.scalar_type() == at::kBFloat16)
    return quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), offset);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  return quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), offset);
}

void check_grouped(const at::Tensor& t, at::ScalarType dtype, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 3 && t.size(0) == N / kLanes &&
              t.size(1) == K / kGroup && t.size(2) == kLanes, name, " must be contiguous [N / 16, K / 32, 16]");
}

Call make_call(const QuantRows& xq, int64_t M, int64_t K, int64_t N, const at::Tensor& scale,
               const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, at::Tensor& out) {
  TORCH_CHECK(N % kLanes == 0, "out_features must be a multiple of 16");
  check_grouped(scale, at::kHalf, N, K, "scale");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bias must be contiguous float32 [N]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  out = at::empty({M, N}, at::TensorOptions().dtype(out_dtype));
  return Call{&xq, K, N, scale.data_ptr<at::Half>(), nullptr, nullptr, bias ? bias->data_ptr<float>() : nullptr,
              out.data_ptr(), out_dtype == at::kBFloat16};
}

}  // namespace

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const QuantRows xq = quantize(x, false);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kLanes;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(1) == K / 8 && packed.size(2) == 64, "packed must be contiguous uint8 [N / 16, K / 8, 64]");
  check_grouped(min, at::kHalf, N, K, "min");
  at::Tensor out;
  Call a = make_call(xq, M, K, N, scale, bias, out_dtype, out);
  a.min = min.data_ptr<at::Half>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  for_blocks(M, N, [&](auto rows, int64_t r0, int64_t nb) { int4_block<decltype(rows)::value>(a, w, r0, nb); });
  return out;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& corr,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const QuantRows xq = quantize(x, true);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kLanes;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(1) == K / 4 && packed.size(2) == 64, "packed must be contiguous int8 [N / 16, K / 4, 64]");
  check_grouped(corr, at::kInt, N, K, "corr");
  at::Tensor out;
  Call a = make_call(xq, M, K, N, scale, bias, out_dtype, out);
  a.corr = corr.data_ptr<int32_t>();
  const int8_t* w = packed.data_ptr<int8_t>();
  for_blocks(M, N, [&](auto rows, int64_t r0, int64_t nb) { int8_block<decltype(rows)::value>(a, w, r0, nb); });
  return out;
}
