// bfloat16 <-> float32 and e^x for 16 lanes, shared by the CPU kernels (qgemm.cpp, paged_attention.cpp,
// generated_decoder.cpp).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

inline __m512 load_bf16(const at::BFloat16* p) {  // 16 bf16 -> float32, exact
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline void store_bf16(at::BFloat16* p, __m512 x) {  // float32 -> bfloat16, round to nearest even (torch's, finite x)
  __m512i b = _mm512_castps_si512(x);
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                           _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}

inline __m512 exp512(__m512 x) {  // e^x = 2^n e^r, |r| <= ln2 / 2, degree-6 Taylor polynomial (~1e-7 relative)
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
