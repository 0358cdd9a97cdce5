// The pointer-level core of qgemm.cpp's products, free of torch so that one source serves the extensions
// (qgemm.cpp: the torch entry points, with ATen's parallel_for over blocks) and the standalone check driver
// (aarch64_check.cpp, built with PREFIXCACHE_NO_TORCH and cross-compiled for aarch64): the activations'
// quantization, one form of the int4 / int8 blocks per ISA (AVX512-VNNI, AVX2 + FMA + F16C, aarch64 NEON with
// or without the dot product extension) and the plain-loop reference. qgemm.cpp's header states the rule and
// why every form's integer sums are exact.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "scalar16.h"
#include "vec16.h"

namespace {

constexpr int64_t kLanes = 16;  // outputs per block: one vec16
constexpr int64_t kGroup = 32;  // input features per scale
constexpr int kMaxRows = 4;     // rows per pass over a weight block

struct QuantRows {  // the activations, quantized per row and group
  std::vector<int8_t> q;   // [M, K]: q (int4_mm) or the bits of q + 128 as uint8 (int8_mm)
  std::vector<float> d;    // [M, K / 32]: the group's scale
  std::vector<float> sum;  // [M, K / 32]: d * the sum of the group's q
};

inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) { return bf16_to_float(v); }

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
  const half_t* scale;  // [N / 16, K / 32, 16]
  const half_t* min;    // int4: like scale; int8: nullptr
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
  v16_store_bf16(static_cast<bf16_t*>(a.out) + row * a.N + col, y);
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
  const half_t* sc = a.scale + nb * G * kLanes;
  const half_t* mn = a.min + nb * G * kLanes;
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
  const half_t* sc = a.scale + nb * G * kLanes;
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

#elif defined(__AVX2__)  // AVX2 + FMA + F16C: vpmaddubsw / vpmaddwd (the header says why no int16 sum saturates)

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
    const half_t* sc = a.scale + nb * G * kLanes + 8 * h;
    const half_t* mn = a.min + nb * G * kLanes + 8 * h;
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
    const half_t* sc = a.scale + nb * G * kLanes + 8 * h;
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

#elif defined(__ARM_NEON) && defined(__aarch64__)  // NEON: sdot (+dotprod) or smull + saddlp

constexpr bool kOffsetActivations = false;  // signed x signed bytes: qx stays signed and needs no ``corr``

inline int8x16_t bcast4(const int8_t* p) {  // 4 bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

// acc[lane] + sum_i a[4 lane + i] * b[4 lane + i] over signed bytes, exact in int32 in either form: sdot, or the
// int16 products (|a b| <= 128 * 128 fits int16) widened pairwise into int32 and the pairs added
inline int32x4_t dot4(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));  // lanes 0, 0, 1, 1
  const int32x4_t hi = vpaddlq_s16(vmull_high_s8(a, b));                      // lanes 2, 2, 3, 3
  return vaddq_s32(acc, vpaddq_s32(lo, hi));
#endif
}

inline float32x4_t load_half4(const half_t* p) {  // exact (fcvtl)
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}

// int4 packed: [N / 16, K / 8, 64] uint8: byte (b, c, 4 j + i) = q[16 b + j, 8 c + i] | q[16 b + j, 8 c + 4 + i] << 4;
// quarter Q of the block (outputs 4 Q .. 4 Q + 3) is bytes 16 Q .. 16 Q + 15 of each 64 (the levels 0..15 are
// signed bytes as they are)
template <int R>
void int4_block(const Call& a, const uint8_t* packed, int64_t r0, int64_t nb) {
  const uint8x16_t low = vdupq_n_u8(0x0F);
  const int64_t G = a.K / kGroup;
  float32x4_t y[4][R];
  for (int quarter = 0; quarter < 4; ++quarter) {
    for (int r = 0; r < R; ++r) y[quarter][r] = vdupq_n_f32(0.f);
    const uint8_t* w = packed + nb * (a.K / 8) * 64 + 16 * quarter;
    const half_t* sc = a.scale + nb * G * kLanes + 4 * quarter;
    const half_t* mn = a.min + nb * G * kLanes + 4 * quarter;
    for (int64_t g = 0; g < G; ++g) {
      int8x16_t wq[8];
      for (int c = 0; c < 4; ++c) {
        const uint8x16_t v = vld1q_u8(w + (g * 4 + c) * 64);
        wq[2 * c] = vreinterpretq_s8_u8(vandq_u8(v, low));
        wq[2 * c + 1] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
      }
      const float32x4_t s = load_half4(sc + g * kLanes), m = load_half4(mn + g * kLanes);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.x->q.data() + (r0 + r) * a.K + g * kGroup;
        int32x4_t acc = vdupq_n_s32(0);
        for (int c = 0; c < 4; ++c) {
          acc = dot4(acc, wq[2 * c], bcast4(x + 8 * c));
          acc = dot4(acc, wq[2 * c + 1], bcast4(x + 8 * c + 4));
        }
        const int64_t i = (r0 + r) * G + g;
        y[quarter][r] = vfmaq_f32(y[quarter][r], vcvtq_f32_s32(acc), vmulq_f32(s, vdupq_n_f32(a.x->d[i])));
        y[quarter][r] = vfmaq_f32(y[quarter][r], m, vdupq_n_f32(a.x->sum[i]));
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(a, r0 + r, nb * kLanes, vec16{{y[0][r], y[1][r], y[2][r], y[3][r]}});
}

// int8 packed: [N / 16, K / 4, 64] int8: element (b, c, 4 j + i) = q[16 b + j, 4 c + i]
template <int R>
void int8_block(const Call& a, const int8_t* packed, int64_t r0, int64_t nb) {
  const int64_t G = a.K / kGroup;
  float32x4_t y[4][R];
  for (int quarter = 0; quarter < 4; ++quarter) {
    for (int r = 0; r < R; ++r) y[quarter][r] = vdupq_n_f32(0.f);
    const int8_t* w = packed + nb * (a.K / 4) * 64 + 16 * quarter;
    const half_t* sc = a.scale + nb * G * kLanes + 4 * quarter;
    for (int64_t g = 0; g < G; ++g) {
      int8x16_t wq[8];
      for (int c = 0; c < 8; ++c) wq[c] = vld1q_s8(w + (g * 8 + c) * 64);
      const float32x4_t s = load_half4(sc + g * kLanes);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.x->q.data() + (r0 + r) * a.K + g * kGroup;
        int32x4_t acc = vdupq_n_s32(0);
        for (int c = 0; c < 8; ++c) acc = dot4(acc, wq[c], bcast4(x + 4 * c));
        y[quarter][r] = vfmaq_f32(y[quarter][r], vcvtq_f32_s32(acc), vmulq_f32(s, vdupq_n_f32(a.x->d[(r0 + r) * G + g])));
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(a, r0 + r, nb * kLanes, vec16{{y[0][r], y[1][r], y[2][r], y[3][r]}});
}

#endif

// block(rows, r0, nb) for the blocks [nb_begin, nb_end) of 16 outputs and every pass of up to kMaxRows rows, the
// pass's row count as a compile-time constant (std::integral_constant<int, 1..4>). A block's arithmetic is the
// same whichever caller (thread) runs it.
template <typename Block>
void run_blocks(int64_t M, int64_t nb_begin, int64_t nb_end, const Block& block) {
  for (int64_t nb = nb_begin; nb < nb_end; ++nb)
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      switch (std::min<int64_t>(kMaxRows, M - r0)) {
        case 1: block(std::integral_constant<int, 1>{}, r0, nb); break;
        case 2: block(std::integral_constant<int, 2>{}, r0, nb); break;
        case 3: block(std::integral_constant<int, 3>{}, r0, nb); break;
        default: block(std::integral_constant<int, 4>{}, r0, nb);
      }
    }
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
        y = std::fma(static_cast<float>(acc), half_to_float(a.scale[i]) * a.x->d[m * G + g], y);
        if (packed4) y = std::fma(half_to_float(a.min[i]), a.x->sum[m * G + g], y);
      }
      if (a.bias) y = y + a.bias[n];
      if (a.out_bf16) {
        static_cast<bf16_t*>(a.out)[m * a.N + n] = float_to_bf16(y);  // round to nearest even (c10's)
      } else {
        static_cast<float*>(a.out)[m * a.N + n] = y;
      }
    }
}

}  // namespace
