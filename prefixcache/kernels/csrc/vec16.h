// A 16-float vector for the kernels that are compiled once per ISA (qgemm.cpp, paged_attention.cpp's float32
// form, decode_layers.cpp): one __m512 where the build has AVX-512 (cpu_kernels.py), two __m256 (lanes 0-7,
// 8-15) where it has AVX2 + FMA + F16C only (avx2_kernels.py). The kernels are written once against it, as
// ggml writes its per-ISA forms against GGML_F32Cx* and at::vec against Vectorized<float>.
//
// Same bits in both builds: every lane runs the same IEEE operation in either form (add, mul, div, fma,
// max, round-to-nearest, a float16 or bfloat16 conversion), and the reductions across lanes follow one
// fixed tree, written here for AVX2 as GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps compute it for
// AVX-512 (avx512fintrin.h's __MM512_REDUCE_OP: the 256-bit halves, then the 128-bit halves, then lanes
// (0, 2) and (1, 3), then the two), and hsum16 in its pattern (paged_attention.cpp's header). A kernel
// built for AVX2 therefore gives the bits of its AVX-512 build wherever the kernel's own integer sums agree
// (qgemm.cpp states why they do).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

#include "prefetch.h"

#if defined(__AVX512F__)
#include "avx512.h"

struct vec16 {
  __m512 v;
};

inline vec16 v16_zero() { return {_mm512_setzero_ps()}; }
inline vec16 v16_set1(float x) { return {_mm512_set1_ps(x)}; }
inline vec16 v16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void v16_store(float* p, vec16 x) { _mm512_storeu_ps(p, x.v); }
inline vec16 v16_load_bf16(const at::BFloat16* p) { return {load_bf16(p)}; }
inline void v16_store_bf16(at::BFloat16* p, vec16 x) { store_bf16(p, x.v); }
inline vec16 v16_load_half(const at::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline vec16 v16_add(vec16 a, vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vec16 v16_sub(vec16 a, vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vec16 v16_mul(vec16 a, vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vec16 v16_div(vec16 a, vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vec16 v16_fmadd(vec16 a, vec16 b, vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline vec16 v16_exp(vec16 x) { return {exp512(x.v)}; }
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

struct vec16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

namespace vec16_detail {

inline __m256 load_bf16_8(const at::BFloat16* p) {  // exact
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
inline vec16 v16_load_bf16(const at::BFloat16* p) {
  return {vec16_detail::load_bf16_8(p), vec16_detail::load_bf16_8(p + 8)};
}
inline void v16_store_bf16(at::BFloat16* p, vec16 x) {
  // packus within 128-bit lanes gives (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute puts them in order
  const __m256i w = _mm256_packus_epi32(_mm256_srli_epi32(vec16_detail::to_bf16_bits_8(x.lo), 16),
                                        _mm256_srli_epi32(vec16_detail::to_bf16_bits_8(x.hi), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(w, 0xD8));
}
inline vec16 v16_load_half(const at::Half* p) {
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

#else
#error "vec16.h needs AVX-512 (-mavx512f) or AVX2 + FMA + F16C (-mavx2 -mfma -mf16c)"
#endif
