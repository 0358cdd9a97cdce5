// A 16-float vector for the kernels that are compiled once per ISA (qgemm.cpp, paged_attention.cpp's float32
// form, decode_layers.cpp, prompt_ops.cpp): one __m512 where the build has AVX-512 (cpu_kernels.py), two __m256
// (lanes 0-7, 8-15) where it has AVX2 + FMA + F16C only (avx2_kernels.py), four float32x4_t (lanes 0-3, ..., 12-15) on
// aarch64 NEON (neon_kernels.py, and the standalone check driver aarch64_check.cpp). The kernels are written once against
// it, as ggml writes its per-ISA forms against GGML_F32Cx* and at::vec against Vectorized<float>.
//
// Same bits in every build: every lane runs the same IEEE operation in each form (add, mul, div, fma,
// max, round-to-nearest, a float16 or bfloat16 conversion), and the reductions across lanes follow one
// fixed tree, written here for AVX2 and NEON as GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps compute it
// for AVX-512 (avx512fintrin.h's __MM512_REDUCE_OP: the 256-bit halves, then the 128-bit halves, then lanes
// (0, 2) and (1, 3), then the two), and hsum16 in its pattern (paged_attention.cpp's header). A kernel
// built for AVX2 or NEON therefore gives the bits of its AVX-512 build wherever the kernel's own integer sums
// agree (qgemm_core.h states why they do). x86's max takes the second operand where one is NaN or both are
// zeros, NEON's fmax does not: the NEON form selects as x86 does (neon_detail::max_x86).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "scalar16.h"  // half_t, bf16_t: at::Half, at::BFloat16 in the extensions

#if defined(__AVX512F__)
#include <immintrin.h>

#include "avx512.h"
#include "prefetch.h"

struct vec16 {
  __m512 v;
};

inline vec16 v16_zero() { return {_mm512_setzero_ps()}; }
inline vec16 v16_set1(float x) { return {_mm512_set1_ps(x)}; }
inline vec16 v16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void v16_store(float* p, vec16 x) { _mm512_storeu_ps(p, x.v); }
inline vec16 v16_load_bf16(const bf16_t* p) { return {load_bf16(p)}; }
inline void v16_store_bf16(bf16_t* p, vec16 x) { store_bf16(p, x.v); }
inline vec16 v16_load_half(const half_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline vec16 v16_add(vec16 a, vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vec16 v16_sub(vec16 a, vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vec16 v16_mul(vec16 a, vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vec16 v16_div(vec16 a, vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vec16 v16_fmadd(vec16 a, vec16 b, vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline vec16 v16_exp(vec16 x) { return {exp512(x.v)}; }
inline vec16 v16_round_bf16(vec16 x) { return {round_bf16(x.v)}; }  // x's value as bf16, in float32
inline float v16_reduce_add(vec16 x) { return _mm512_reduce_add_ps(x.v); }
inline float v16_reduce_max(vec16 x) { return _mm512_reduce_max_ps(x.v); }
inline void v16_store_aligned(float* p, vec16 x) { _mm512_store_ps(p, x.v); }
// lanes < n keep x, the others become fill (0 <= n <= 16)
inline vec16 v16_first_or(vec16 x, int n, float fill) {
  return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << n) - 1), x.v)};
}
// whether a lane < n is NaN or +inf
inline bool v16_first_nan_or_inf(vec16 x, int n) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  return (_mm512_mask_cmp_ps_mask(valid, x.v, x.v, _CMP_UNORD_Q) |
          _mm512_mask_cmp_ps_mask(valid, x.v, _mm512_set1_ps(__builtin_inff()), _CMP_EQ_OQ)) != 0;
}

// 16 vectors -> their 16 horizontal sums, in order: each vector's lanes ((l0 + l2) + (l1 + l3)) within each
// 128-bit quarter, then the quarters (q0 + q1) + (q2 + q3).
inline vec16 v16_hsum16(const vec16 (&x)[16]) {
  __m512 t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * j].v, x[2 * j + 1].v), _mm512_unpackhi_ps(x[2 * j].v, x[2 * j + 1].v));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88), _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD))};
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "prefetch.h"

struct vec16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

namespace vec16_detail {

inline __m256 load_bf16_8(const bf16_t* p) {  // exact
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// avx512.h's to_bf16_bits for 8 lanes: round to nearest even, NaN a quiet NaN; the bf16 in each dword's high half
inline __m256i to_bf16_bits_8(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                        _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))));
  const __m256i kept = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(kept), _mm256_set1_ps(__builtin_nanf("")), nan));
}

// avx512.h's exp512 for 8 lanes: the same clamp, reduction and polynomial; _mm512_scalef_ps(p, n) as p * 2^n with
// 2^n built from its exponent bits (n in [-126, 127] after the clamp, so 2^n is a normal float and the product
// is the one rounding of p 2^n that scalef makes)
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 first_mask(int n, int half) {  // lanes 8 half + i < n
  const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * half));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}

}  // namespace vec16_detail

inline vec16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vec16 v16_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vec16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v16_store(float* p, vec16 x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
inline void v16_store_aligned(float* p, vec16 x) { _mm256_store_ps(p, x.lo), _mm256_store_ps(p + 8, x.hi); }
inline vec16 v16_load_bf16(const bf16_t* p) {
  return {vec16_detail::load_bf16_8(p), vec16_detail::load_bf16_8(p + 8)};
}
inline void v16_store_bf16(bf16_t* p, vec16 x) {
  // packus within 128-bit lanes gives (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute puts them in order
  const __m256i w = _mm256_packus_epi32(_mm256_srli_epi32(vec16_detail::to_bf16_bits_8(x.lo), 16),
                                        _mm256_srli_epi32(vec16_detail::to_bf16_bits_8(x.hi), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(w, 0xD8));
}
inline vec16 v16_load_half(const half_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline vec16 v16_add(vec16 a, vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vec16 v16_sub(vec16 a, vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vec16 v16_mul(vec16 a, vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vec16 v16_div(vec16 a, vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vec16 v16_fmadd(vec16 a, vec16 b, vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vec16 v16_exp(vec16 x) { return {vec16_detail::exp8(x.lo), vec16_detail::exp8(x.hi)}; }
inline vec16 v16_round_bf16(vec16 x) {  // x's value as bf16 (to_bf16_bits_8's rounding), in float32
  return {_mm256_castsi256_ps(vec16_detail::to_bf16_bits_8(x.lo)), _mm256_castsi256_ps(vec16_detail::to_bf16_bits_8(x.hi))};
}

// _mm512_reduce_add_ps's tree (the header's): (hi + lo) per 256-bit half, its 128-bit halves, lanes (0, 2) and (1, 3)
inline float v16_reduce_add(vec16 x) {
  const __m256 t3 = _mm256_add_ps(x.hi, x.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
// _mm512_reduce_max_ps's tree, its operand order kept (max_ps returns the second operand where one is NaN)
inline float v16_reduce_max(vec16 x) {
  const __m256 t3 = _mm256_max_ps(x.hi, x.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
  return _mm_cvtss_f32(t10);
}
inline vec16 v16_first_or(vec16 x, int n, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, x.lo, vec16_detail::first_mask(n, 0)), _mm256_blendv_ps(f, x.hi, vec16_detail::first_mask(n, 1))};
}
inline bool v16_first_nan_or_inf(vec16 x, int n) {
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  const __m256 lo = _mm256_and_ps(vec16_detail::first_mask(n, 0),
                                  _mm256_or_ps(_mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q), _mm256_cmp_ps(x.lo, inf, _CMP_EQ_OQ)));
  const __m256 hi = _mm256_and_ps(vec16_detail::first_mask(n, 1),
                                  _mm256_or_ps(_mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q), _mm256_cmp_ps(x.hi, inf, _CMP_EQ_OQ)));
  return _mm256_movemask_ps(_mm256_or_ps(lo, hi)) != 0;
}

// The AVX-512 form's tree on two halves: the unpack steps act within 128-bit lanes alike, so lo's quarters are
// q0, q1 and hi's q2, q3 of the AVX-512 register; then (q0 + q1) + (q2 + q3) per vector.
inline vec16 v16_hsum16(const vec16 (&x)[16]) {
  __m128 r[4];  // vectors 4j .. 4j + 3
  for (int j = 0; j < 4; ++j) {
    __m256 ulo, uhi;
    for (int half = 0; half < 2; ++half) {
      __m256 t[2];
      for (int k = 0; k < 2; ++k) {
        const __m256 a = half ? x[4 * j + 2 * k].hi : x[4 * j + 2 * k].lo, b = half ? x[4 * j + 2 * k + 1].hi : x[4 * j + 2 * k + 1].lo;
        t[k] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
      }
      const __m256d a = _mm256_castps_pd(t[0]), b = _mm256_castps_pd(t[1]);
      const __m256 u = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
      (half ? uhi : ulo) = u;  // 128-bit lane L: quarter 2 half + L of the 4 vectors
    }
    const __m128 q01 = _mm_add_ps(_mm256_castps256_ps128(ulo), _mm256_extractf128_ps(ulo, 1));
    const __m128 q23 = _mm_add_ps(_mm256_castps256_ps128(uhi), _mm256_extractf128_ps(uhi, 1));
    r[j] = _mm_add_ps(q01, q23);
  }
  return {_mm256_set_m128(r[1], r[0]), _mm256_set_m128(r[3], r[2])};
}

#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>

struct vec16 {
  float32x4_t q[4];  // lanes 4 i .. 4 i + 3
};

namespace neon_detail {

// x86's maxps / minps: a > b ? a : b (a < b ? a : b), the second operand where one is NaN or both are zeros
inline float32x4_t max_x86(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
inline float32x4_t min_x86(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }

// avx512.h's exp512 for 4 lanes: the same clamp (x86's operand order), round to nearest even (frintn, as
// roundscale's _MM_FROUND_TO_NEAREST_INT), fused multiply-subtracts (fmls = fnmadd), polynomial and 2^n from its
// exponent bits, as the AVX2 form builds it
inline float32x4_t exp4(float32x4_t x) {
  x = min_x86(max_x86(x, vdupq_n_f32(-87.f)), vdupq_n_f32(88.f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.f / 720);
  p = vfmaq_f32(vdupq_n_f32(1.f / 120), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 24), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 6), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

// avx512.h's to_bf16_bits for 4 lanes: round to nearest even, NaN the quiet NaN 0x7FC0
inline uint16x4_t to_bf16_4(float32x4_t x) {
  const uint32x4_t b = vreinterpretq_u32_f32(x);
  const uint32x4_t r = vaddq_u32(b, vaddq_u32(vdupq_n_u32(0x7FFF), vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1))));
  const uint32x4_t kept = vbslq_u32(vceqq_f32(x, x), r, vdupq_n_u32(0x7FC00000));
  return vshrn_n_u32(kept, 16);
}

// to_bf16_4's rounding kept in float32: the bf16 in the high half, the low half zero (avx512.h's round_bf16)
inline float32x4_t round_bf16_4(float32x4_t x) {
  const uint32x4_t b = vreinterpretq_u32_f32(x);
  const uint32x4_t r = vaddq_u32(b, vaddq_u32(vdupq_n_u32(0x7FFF), vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1))));
  return vreinterpretq_f32_u32(vbslq_u32(vceqq_f32(x, x), vandq_u32(r, vdupq_n_u32(0xFFFF0000u)), vdupq_n_u32(0x7FC00000)));
}

inline uint32x4_t first_mask(int n, int quarter) {  // lanes 4 quarter + i < n
  const int32_t idx[4] = {0, 1, 2, 3};
  return vcltq_s32(vaddq_s32(vld1q_s32(idx), vdupq_n_s32(4 * quarter)), vdupq_n_s32(n));
}

// (l0 + l2, l1 + l3): lanes (0, 2) and (1, 3), the pairs _mm512_reduce_*_ps ends with
inline float32x4_t fold_pairs_add(float32x4_t t) { return vaddq_f32(t, vextq_f32(t, t, 2)); }

}  // namespace neon_detail

inline vec16 v16_zero() { return {{vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)}}; }
inline vec16 v16_set1(float x) { return {{vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x)}}; }
inline vec16 v16_load(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline void v16_store(float* p, vec16 x) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, x.q[i]);
}
inline void v16_store_aligned(float* p, vec16 x) { v16_store(p, x); }
inline vec16 v16_load_bf16(const bf16_t* p) {  // exact
  vec16 r;
  for (int i = 0; i < 4; ++i)
    r.q[i] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p) + 4 * i), 16));
  return r;
}
inline void v16_store_bf16(bf16_t* p, vec16 x) {
  for (int i = 0; i < 4; ++i) vst1_u16(reinterpret_cast<uint16_t*>(p) + 4 * i, neon_detail::to_bf16_4(x.q[i]));
}
inline vec16 v16_load_half(const half_t* p) {  // exact (fcvtl)
  vec16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p) + 4 * i)));
  return r;
}
#define PREFIXCACHE_V16_LANEWISE(name, op)                            \
  inline vec16 name(vec16 a, vec16 b) {                              \
    return {{op(a.q[0], b.q[0]), op(a.q[1], b.q[1]), op(a.q[2], b.q[2]), op(a.q[3], b.q[3])}}; \
  }
PREFIXCACHE_V16_LANEWISE(v16_add, vaddq_f32)
PREFIXCACHE_V16_LANEWISE(v16_sub, vsubq_f32)
PREFIXCACHE_V16_LANEWISE(v16_mul, vmulq_f32)
PREFIXCACHE_V16_LANEWISE(v16_div, vdivq_f32)
#undef PREFIXCACHE_V16_LANEWISE
inline vec16 v16_fmadd(vec16 a, vec16 b, vec16 c) {  // a * b + c, one rounding
  return {{vfmaq_f32(c.q[0], a.q[0], b.q[0]), vfmaq_f32(c.q[1], a.q[1], b.q[1]), vfmaq_f32(c.q[2], a.q[2], b.q[2]),
           vfmaq_f32(c.q[3], a.q[3], b.q[3])}};
}
inline vec16 v16_exp(vec16 x) {
  return {{neon_detail::exp4(x.q[0]), neon_detail::exp4(x.q[1]), neon_detail::exp4(x.q[2]), neon_detail::exp4(x.q[3])}};
}
inline vec16 v16_round_bf16(vec16 x) {  // x's value as bf16, in float32
  return {{neon_detail::round_bf16_4(x.q[0]), neon_detail::round_bf16_4(x.q[1]), neon_detail::round_bf16_4(x.q[2]),
           neon_detail::round_bf16_4(x.q[3])}};
}

// _mm512_reduce_add_ps's tree: the 256-bit halves (q2 + q0, q3 + q1), their 128-bit halves, lanes (0, 2) and (1, 3)
inline float v16_reduce_add(vec16 x) {
  const float32x4_t t6 = vaddq_f32(vaddq_f32(x.q[3], x.q[1]), vaddq_f32(x.q[2], x.q[0]));
  const float32x4_t t8 = neon_detail::fold_pairs_add(t6);
  return vgetq_lane_f32(t8, 0) + vgetq_lane_f32(t8, 1);
}
// _mm512_reduce_max_ps's tree, its operand order kept (x86's max: the second operand where one is NaN)
inline float v16_reduce_max(vec16 x) {
  using neon_detail::max_x86;
  const float32x4_t t6 = max_x86(max_x86(x.q[3], x.q[1]), max_x86(x.q[2], x.q[0]));
  const float32x4_t t8 = max_x86(t6, vextq_f32(t6, t6, 2));                       // (2, 3, 0, 1) as _MM_SHUFFLE(1, 0, 3, 2)
  const float32x4_t t10 = max_x86(t8, vrev64q_f32(t8));                           // (1, 0, 3, 2) as _MM_SHUFFLE(0, 1, 0, 1)
  return vgetq_lane_f32(t10, 0);
}
inline vec16 v16_first_or(vec16 x, int n, float fill) {
  vec16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vbslq_f32(neon_detail::first_mask(n, i), x.q[i], vdupq_n_f32(fill));
  return r;
}
inline bool v16_first_nan_or_inf(vec16 x, int n) {
  uint32x4_t any = vdupq_n_u32(0);
  for (int i = 0; i < 4; ++i) {
    const uint32x4_t bad = vorrq_u32(vmvnq_u32(vceqq_f32(x.q[i], x.q[i])), vceqq_f32(x.q[i], vdupq_n_f32(__builtin_inff())));
    any = vorrq_u32(any, vandq_u32(bad, neon_detail::first_mask(n, i)));
  }
  return vmaxvq_u32(any) != 0;
}

// The AVX-512 form's tree: per 4 vectors a, b, c, d and quarter Q, zip1 + zip2 (unpacklo + unpackhi) gives
// (a0 + a2, b0 + b2, a1 + a3, b1 + b3), the 64-bit zips then ((l0 + l2) + (l1 + l3)) of a, b, c, d; then
// (Q0 + Q1) + (Q2 + Q3) per vector.
inline vec16 v16_hsum16(const vec16 (&x)[16]) {
  vec16 r;
  for (int j = 0; j < 4; ++j) {  // vectors 4 j .. 4 j + 3
    float32x4_t u[4];
    for (int quarter = 0; quarter < 4; ++quarter) {
      float32x4_t t[2];
      for (int k = 0; k < 2; ++k) {
        const float32x4_t a = x[4 * j + 2 * k].q[quarter], b = x[4 * j + 2 * k + 1].q[quarter];
        t[k] = vaddq_f32(vzip1q_f32(a, b), vzip2q_f32(a, b));
      }
      const float64x2_t a = vreinterpretq_f64_f32(t[0]), b = vreinterpretq_f64_f32(t[1]);
      u[quarter] = vaddq_f32(vreinterpretq_f32_f64(vzip1q_f64(a, b)), vreinterpretq_f32_f64(vzip2q_f64(a, b)));
    }
    r.q[j] = vaddq_f32(vaddq_f32(u[0], u[1]), vaddq_f32(u[2], u[3]));
  }
  return r;
}

#else
#error "vec16.h needs AVX-512 (-mavx512f), AVX2 + FMA + F16C (-mavx2 -mfma -mf16c) or aarch64 NEON"
#endif

// Rows whose width is not a multiple of 16, in every form alike: the first n bf16 at p (all 16 where n >= 16), lanes
// n .. 15 +0.0f, the lanes an AVX-512 masked load (maskz) gives; through a zero-filled 16-element copy, so no element
// past p + n is read. A kernel's tail lanes thus hold the same values in each build as in a masked AVX-512 form, not
// merely values whose sum agrees (padding with -0, or summing fewer lanes, can turn a sum's -0 into +0 or back).
inline vec16 v16_load_bf16_n(const bf16_t* p, int64_t n) {
  if (n >= 16) return v16_load_bf16(p);
  bf16_t buf[16];
  std::memset(static_cast<void*>(buf), 0, sizeof buf);
  std::memcpy(static_cast<void*>(buf), p, static_cast<size_t>(n) * sizeof(bf16_t));
  return v16_load_bf16(buf);
}
// the first n lanes (all 16 where n >= 16), rounded as v16_store_bf16; nothing past p + n written
inline void v16_store_bf16_n(bf16_t* p, vec16 x, int64_t n) {
  if (n >= 16) return v16_store_bf16(p, x);
  bf16_t buf[16];
  v16_store_bf16(buf, x);
  std::memcpy(static_cast<void*>(p), buf, static_cast<size_t>(n) * sizeof(bf16_t));
}
