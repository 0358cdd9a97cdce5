// Products of a few activation rows with grouped low-bit weights (generated tokens), on AVX512-VNNI.
//
//   int4_mm: w[n, k] = q[n, k] * scale[k / 32, n] + min[k / 32, n], q in 0..15   (llama.cpp's Q4_1 grid)
//   int8_mm: w[n, k] = q[n, k] * scale[k / 32, n],                   q in -127..127 (llama.cpp's Q8_0 grid)
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
// A block of 16 outputs (one AVX-512 register of lanes) is computed by one thread, and a row's
// arithmetic never depends on the other rows of the call or on the split between threads: a row gets
// the same bits in any batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace {

constexpr int64_t kLanes = 16;  // outputs per block: one __m512
constexpr int64_t kGroup = 32;  // input features per scale
constexpr int kMaxRows = 4;     // rows per pass over a weight block

struct QuantRows {  // the activations, quantized
  at::Tensor q;       // [M, K] int8 (int4_mm) or uint8 = q + 128 (int8_mm)
  at::Tensor d;       // [M, K / 32] float32: per-group scale
  at::Tensor sum_q;   // [M, K / 32] float32: d * sum of the group's q
};

QuantRows quantize_rows(const at::Tensor& x_in, bool offset) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  QuantRows r{at::empty({M, K}, x.options().dtype(offset ? at::kByte : at::kChar)), at::empty({M, G}, x.options()),
              at::empty({M, G}, x.options())};
  const float* xp = x.data_ptr<float>();
  auto* qp = static_cast<int8_t*>(r.q.data_ptr());
  float* dp = r.d.data_ptr<float>();
  float* sp = r.sum_q.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* v = xp + m * K + g * kGroup;
      float amax = 0.f;
      for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const int q = static_cast<int>(std::nearbyint(v[i] * inv));
        sum += q;
        qp[m * K + g * kGroup + i] = static_cast<int8_t>(offset ? q + 128 : q);  // uint8 bits when offset
      }
      dp[m * G + g] = d;
      sp[m * G + g] = d * static_cast<float>(sum);
    }
  }
  return r;
}

struct Call {
  const int8_t* q;  // quantized rows, [M, K]
  const float* d;
  const float* sum_q;
  int64_t K, N;
  const float* scale;  // [K / 32, N]
  const float* min;    // [K / 32, N] (int4) or nullptr
  const int32_t* corr; // [K / 32, N] (int8) or nullptr
  const float* bias;   // [N] or nullptr
  float* out;          // [M, N]
};

inline __m512i bcast4(const int8_t* p) {  // 4 bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// int4 packed: [N / 16, K / 8, 64] uint8: byte (b, c, 4 j + i) = q[16 b + j, 8 c + i] | q[16 b + j, 8 c + 4 + i] << 4
template <int R>
void int4_block(const Call& a, const uint8_t* packed, int64_t r0, int64_t nb) {
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* w = packed + nb * (a.K / 8) * 64;
  const int64_t G = a.K / kGroup;
  for (int64_t g = 0; g < G; ++g) {
    __m512i wq[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(w + (g * 4 + c) * 64);
      wq[2 * c] = _mm512_and_si512(v, low);
      wq[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 s = _mm512_loadu_ps(a.scale + g * a.N + nb * kLanes);
    const __m512 mn = _mm512_loadu_ps(a.min + g * a.N + nb * kLanes);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q + (r0 + r) * a.K + g * kGroup;
      __m512i acc = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        acc = _mm512_dpbusd_epi32(acc, wq[2 * c], bcast4(x + 8 * c));
        acc = _mm512_dpbusd_epi32(acc, wq[2 * c + 1], bcast4(x + 8 * c + 4));
      }
      const int64_t i = (r0 + r) * G + g;
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, _mm512_set1_ps(a.d[i])), y[r]);
      y[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sum_q[i]), y[r]);
    }
  }
  const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + nb * kLanes) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + (r0 + r) * a.N + nb * kLanes, _mm512_add_ps(y[r], b));
}

// int8 packed: [N / 16, K / 4, 64] int8: element (b, c, 4 j + i) = q[16 b + j, 4 c + i]
template <int R>
void int8_block(const Call& a, const int8_t* packed, int64_t r0, int64_t nb) {
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const int8_t* w = packed + nb * (a.K / 4) * 64;
  const int64_t G = a.K / kGroup;
  for (int64_t g = 0; g < G; ++g) {
    __m512i wq[8];
    for (int c = 0; c < 8; ++c) wq[c] = _mm512_loadu_si512(w + (g * 8 + c) * 64);
    const __m512 s = _mm512_loadu_ps(a.scale + g * a.N + nb * kLanes);
    const __m512i corr = _mm512_loadu_si512(a.corr + g * a.N + nb * kLanes);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q + (r0 + r) * a.K + g * kGroup;
      __m512i acc = corr;
      for (int c = 0; c < 8; ++c) acc = _mm512_dpbusd_epi32(acc, bcast4(x + 4 * c), wq[c]);
      const int64_t i = (r0 + r) * G + g;
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, _mm512_set1_ps(a.d[i])), y[r]);
    }
  }
  const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + nb * kLanes) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.out + (r0 + r) * a.N + nb * kLanes, _mm512_add_ps(y[r], b));
}

template <typename Block>
void for_blocks(int64_t M, int64_t N, const Block& block) {
  at::parallel_for(0, N / kLanes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) block(r0, std::min<int64_t>(kMaxRows, M - r0), nb);
  });
}

Call make_call(const QuantRows& xq, const at::Tensor& scale, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t K = xq.q.size(1), N = scale.size(1);
  TORCH_CHECK(N % kLanes == 0, "out_features must be a multiple of 16");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == K / kGroup,
              "scale must be contiguous float32 [K / 32, N]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bias must be contiguous float32 [N]");
  out = at::empty({xq.q.size(0), N}, scale.options());
  return Call{static_cast<const int8_t*>(xq.q.data_ptr()), xq.d.data_ptr<float>(), xq.sum_q.data_ptr<float>(), K, N,
              scale.data_ptr<float>(), nullptr, nullptr, bias ? bias->data_ptr<float>() : nullptr,
              out.data_ptr<float>()};
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0, "x must be [M, K] with K % 32 == 0");
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  check_x(x);
  TORCH_CHECK(min.sizes() == scale.sizes() && min.scalar_type() == at::kFloat && min.is_contiguous(),
              "min must be like scale");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == scale.size(1) * x.size(1) / 2,
              "packed must be contiguous uint8 [N / 16, K / 8, 64]");
  const QuantRows xq = quantize_rows(x, false);
  at::Tensor out;
  Call a = make_call(xq, scale, bias, out);
  a.min = min.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  for_blocks(x.size(0), a.N, [&](int64_t r0, int64_t rows, int64_t nb) {
    switch (rows) {
      case 1: int4_block<1>(a, w, r0, nb); break;
      case 2: int4_block<2>(a, w, r0, nb); break;
      case 3: int4_block<3>(a, w, r0, nb); break;
      default: int4_block<4>(a, w, r0, nb);
    }
  });
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& corr,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  check_x(x);
  TORCH_CHECK(corr.sizes() == scale.sizes() && corr.scalar_type() == at::kInt && corr.is_contiguous(),
              "corr must be int32 like scale");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.numel() == scale.size(1) * x.size(1),
              "packed must be contiguous int8 [N / 16, K / 4, 64]");
  const QuantRows xq = quantize_rows(x, true);
  at::Tensor out;
  Call a = make_call(xq, scale, bias, out);
  a.corr = corr.data_ptr<int32_t>();
  const int8_t* w = packed.data_ptr<int8_t>();
  for_blocks(x.size(0), a.N, [&](int64_t r0, int64_t rows, int64_t nb) {
    switch (rows) {
      case 1: int8_block<1>(a, w, r0, nb); break;
      case 2: int8_block<2>(a, w, r0, nb); break;
      case 3: int8_block<3>(a, w, r0, nb); break;
      default: int8_block<4>(a, w, r0, nb);
    }
  });
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm, "x [M, K] @ int4 grouped weight^T (+ bias) -> [M, N]");
  m.def("int8_mm", &int8_mm, "x [M, K] @ int8 grouped weight^T (+ bias) -> [M, N]");
}
