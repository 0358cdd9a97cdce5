// Products of a few activation rows with grouped low-bit weights (generated tokens), one source built per ISA:
// AVX512-VNNI (cpu_kernels.py's extension) and AVX2 + FMA + F16C (avx2_kernels.py's), with a scalar reference
// beside them (int4_mm_reference, int8_mm_reference: plain loops, the rule itself) that both builds carry.
//
//   int4_mm: w[n, k] = q[n, k] * scale[n, k / 32] + min[n, k / 32], q in 0..15   (llama.cpp's Q4_1 grid)
//   int8_mm: w[n, k] = q[n, k] * scale[n, k / 32],                   q in -127..127 (llama.cpp's Q8_0 grid)
//
// Activations are quantized per row and per group of 32 input features to int8 (``d = max|x| / 127``,
// ``q = round(x / d)``, so |q| <= 127: llama.cpp's Q8_1 / Q8_0 activation blocks), each group's products are
// summed exactly in int32, and the groups are added in float32 in ascending order, one fma per term:
//
//   int4: y = fma(float(sum_k qw * qx), scale * d, y); y = fma(min, d * sum_k qx, y)   (ggml_vec_dot_q4_1_q8_1)
//   int8: y = fma(float(sum_k qw * qx), scale * d, y)                                  (ggml_vec_dot_q8_0_q8_0)
//
// The integer sums are exact in every form, so every form gives the same int32 per group and, each output
// lane running the same float operations in the same order (vec16.h), the same bits:
// - AVX512-VNNI: ``vpdpbusd`` (unsigned x signed bytes, 4 per 32-bit lane, no saturation). int8 feeds
//   ``qx + 128`` as the unsigned operand and adds ``-128 * sum_k qw``, precomputed per group (``corr``).
// - AVX2: ``vpmaddubsw`` (unsigned x signed bytes, pairs summed into int16 with signed saturation) then
//   ``vpmaddwd`` with ones (int16 pairs into int32, exact). Operands are chosen so that no int16 saturates:
//   int4 multiplies the levels (0..15, unsigned) by qx (|qx| <= 127): a pair is at most 2 * 15 * 127 = 3,810,
//   so even the 8 pairs of a lane over a whole group (one int16 sum per 4 inputs x 8) stay within
//   8 * 3,810 = 30,480 < 32,767 and are added in int16 before one vpmaddwd per group; int8 uses ggml's
//   mul_sum_i8_pairs, vpmaddubsw(|qx|, sign(qw, qx)): |qx| <= 127 as the unsigned operand and qw's sign moved
//   onto it (|qw| <= 127), a pair at most 2 * 127 * 127 = 32,258 < 32,767, widened by vpmaddwd after every
//   4 inputs. (int8's vpdpbusd offset would put 255 in the unsigned operand and saturate: the AVX2 form keeps
//   qx signed and needs no ``corr``; its sum equals corr + sum (qx + 128) qw exactly.)
// Scales and mins are float16, as in the GGUF blocks. A block of 16 outputs is computed by one thread, its
// weights, scales and mins read as three sequential streams (the AVX2 form runs the block as two halves of 8
// lanes, the second reading the block's weights from L1); a row's arithmetic never depends on the other rows
// of the call or on the split between threads, so a row gets the same bits in any batch. Rows are processed
// 4 at a time (each weight load serves 4).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vec16.h"

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

// y (+ bias) to row `row`'s 16 outputs from `col`, float32 or bfloat16
inline void store_row(const Call& a, int64_t row, int64_t col, vec16 y) {
  if (a.bias) y = v16_add(y, v16_load(a.bias + col));
  if (!a.out_bf16) {
    v16_store(static_cast<float*>(a.out) + row * a.N + col, y);
    return;
  }
  v16_store_bf16(static_cast<at::BFloat16*>(a.out) + row * a.N + col, y);
}

#if defined(__AVX512F__)  // AVX512-VNNI: vpdpbusd

constexpr bool kOffsetActivations = true;  // vpdpbusd takes qx + 128 as its unsigned operand (int8_mm)

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
    const __m512 s = v16_load_half(sc + g * kLanes).v, m = v16_load_half(mn + g * kLanes).v;
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
  for (int r = 0; r < R; ++r) store_row(a, r0 + r, nb * kLanes, vec16{y[r]});
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
    const __m512 s = v16_load_half(sc + g * kLanes).v;
    const __m512i corr = _mm512_loadu_si512(co + g * kLanes);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.x->q.data() + (r0 + r) * a.K + g * kGroup;
      __m512i acc = corr;
      for (int c = 0; c < 8; ++c) acc = _mm512_dpbusd_epi32(acc, bcast4(x + 4 * c), wq[c]);
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, _mm512_set1_ps(a.x->d[(r0 + r) * G + g])), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(a, r0 + r, nb * kLanes, vec16{y[r]});
}

#else  // AVX2 + FMA + F16C: vpmaddubsw / vpmaddwd (the header says why no int16 sum saturates)

constexpr bool kOffsetActivations = false;  // qx stays signed: vpmaddubsw(|qx|, sign(qw, qx)) for int8

inline __m256i bcast4(const int8_t* p) {  // 4 bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// int4 packed: [N / 16, K / 8, 64] uint8: byte (b, c, 4 j + i) = q[16 b + j, 8 c + i] | q[16 b + j, 8 c + 4 + i] << 4;
// half h of the block (outputs 8 h .. 8 h + 7) is bytes 32 h .. 32 h + 31 of each 64
template <int R>
void int4_block(const Call& a, const uint8_t* packed, int64_t r0, int64_t nb) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t G = a.K / kGroup;
  __m256 y[2][R];
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < R; ++r) y[h][r] = _mm256_setzero_ps();
    const uint8_t* w = packed + nb * (a.K / 8) * 64 + 32 * h;
    const at::Half* sc = a.scale + nb * G * kLanes + 8 * h;
    const at::Half* mn = a.min + nb * G * kLanes + 8 * h;
    for (int64_t g = 0; g < G; ++g) {
      __m256i wq[8];
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 4 + c) * 64));
        wq[2 * c] = _mm256_and_si256(v, low);
        wq[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * kLanes)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g * kLanes)));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.x->q.data() + (r0 + r) * a.K + g * kGroup;
        __m256i acc16 = _mm256_setzero_si256();  // |lane| <= 8 * 3,810: no int16 overflow (header)
        for (int c = 0; c < 4; ++c) {
          acc16 = _mm256_add_epi16(acc16, _mm256_maddubs_epi16(wq[2 * c], bcast4(x + 8 * c)));
          acc16 = _mm256_add_epi16(acc16, _mm256_maddubs_epi16(wq[2 * c + 1], bcast4(x + 8 * c + 4)));
        }
        const __m256i acc = _mm256_madd_epi16(acc16, ones);
        const int64_t i = (r0 + r) * G + g;
        y[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(s, _mm256_set1_ps(a.x->d[i])), y[h][r]);
        y[h][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.x->sum[i]), y[h][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(a, r0 + r, nb * kLanes, vec16{y[0][r], y[1][r]});
}

// int8 packed: [N / 16, K / 4, 64] int8: element (b, c, 4 j + i) = q[16 b + j, 4 c + i]
template <int R>
void int8_block(const Call& a, const int8_t* packed, int64_t r0, int64_t nb) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t G = a.K / kGroup;
  __m256 y[2][R];
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < R; ++r) y[h][r] = _mm256_setzero_ps();
    const int8_t* w = packed + nb * (a.K / 4) * 64 + 32 * h;
    const at::Half* sc = a.scale + nb * G * kLanes + 8 * h;
    for (int64_t g = 0; g < G; ++g) {
      __m256i wq[8];
      for (int c = 0; c < 8; ++c) wq[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 8 + c) * 64));
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * kLanes)));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.x->q.data() + (r0 + r) * a.K + g * kGroup;
        __m256i acc = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i xb = bcast4(x + 4 * c);
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb), _mm256_sign_epi8(wq[c], xb));  // <= 32,258
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
        }
        y[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(s, _mm256_set1_ps(a.x->d[(r0 + r) * G + g])), y[h][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(a, r0 + r, nb * kLanes, vec16{y[0][r], y[1][r]});
}

#endif

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

// The rule itself (the header's formulas), one output at a time in plain loops over the signed qx: the bits
// every form above gives (tests compare them). The compiler may vectorize the loops; the operations stay these.
void reference_rows(const Call& a, const uint8_t* packed4, const int8_t* packed8, int64_t M) {
  const int64_t G = a.K / kGroup;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < a.N; ++n) {
      const int64_t b = n / kLanes, j = n % kLanes;
      float y = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t acc = 0;
        for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
          int32_t q;
          if (packed4) {
            const uint8_t byte = packed4[(b * (a.K / 8) + k / 8) * 64 + 4 * j + k % 4];
            q = k % 8 < 4 ? byte & 0x0F : byte >> 4;
          } else {
            q = packed8[(b * (a.K / 4) + k / 4) * 64 + 4 * j + k % 4];
          }
          acc += q * a.x->q[m * a.K + k];
        }
        const int64_t i = (b * G + g) * kLanes + j;
        y = std::fma(static_cast<float>(acc), static_cast<float>(a.scale[i]) * a.x->d[m * G + g], y);
        if (packed4) y = std::fma(static_cast<float>(a.min[i]), a.x->sum[m * G + g], y);
      }
      if (a.bias) y = y + a.bias[n];
      if (a.out_bf16) {
        static_cast<at::BFloat16*>(a.out)[m * a.N + n] = at::BFloat16(y);  // round to nearest even (c10's)
      } else {
        static_cast<float*>(a.out)[m * a.N + n] = y;
      }
    }
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
  const QuantRows xq = quantize(x, kOffsetActivations);
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

at::Tensor int4_mm_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& min, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const QuantRows xq = quantize(x, false);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kLanes;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(1) == K / 8 && packed.size(2) == 64, "packed must be contiguous uint8 [N / 16, K / 8, 64]");
  check_grouped(min, at::kHalf, N, K, "min");
  at::Tensor out;
  Call a = make_call(xq, M, K, N, scale, bias, out_dtype, out);
  a.min = min.data_ptr<at::Half>();
  reference_rows(a, packed.data_ptr<uint8_t>(), nullptr, M);
  return out;
}

at::Tensor int8_mm_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const QuantRows xq = quantize(x, false);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kLanes;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(1) == K / 4 && packed.size(2) == 64, "packed must be contiguous int8 [N / 16, K / 4, 64]");
  at::Tensor out;
  Call a = make_call(xq, M, K, N, scale, bias, out_dtype, out);
  reference_rows(a, nullptr, packed.data_ptr<int8_t>(), M);
  return out;
}
