// bfloat16 <-> float32 for 16 lanes, shared by the CPU kernels (qgemm.cpp, paged_attention.cpp).
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
