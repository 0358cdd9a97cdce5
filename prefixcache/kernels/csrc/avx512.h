// bfloat16 <-> float32, e^x for 16 lanes, the K/V row prefetch and AMX tile instructions, shared by the CPU
// kernels (qgemm.cpp, paged_attention.cpp, prefill_attention.cpp, decode_layers.cpp, prompt_ops.cpp,
// amx_gemm.cpp).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include "prefetch.h"  // prefetch_t0, prefetch_kv_rows (ISA-neutral: also in the AVX2 build)

inline __m512 load_bf16(const at::BFloat16* p) {  // 16 bf16 -> float32, exact
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// float32 -> bfloat16 rounded to nearest even (torch's c10::BFloat16 rounding), the bf16 in each dword's
// high half, low half zero; NaN stays a quiet NaN. The one rounding every kernel's bf16 store uses.
inline __m512i to_bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                        _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000))), nan,
                               _mm512_set1_epi32(0x7FC00000));
}

inline __m512 round_bf16(__m512 x) { return _mm512_castsi512_ps(to_bf16_bits(x)); }  // x's value as bf16, in float32

inline void store_bf16(at::BFloat16* p, __m512 x) {  // 16 lanes, rounded as to_bf16_bits
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(to_bf16_bits(x), 16)));
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

// AMX tiles by inline asm rather than GCC's intrinsics, so that (1) the compiler sees each instruction's
// memory: GCC 12's _tile_loadconfig names only 8 bytes of its 64-byte operand (it dropped the stores that
// fill the struct as dead: tiles left unconfigured, SIGILL at the first tile instruction) and _tile_loadd
// names no memory input at all (stores to the buffer it reads may legally move after it); here a tile load
// and store are full compiler memory barriers; and (2) no "amx-tile" target is needed, which GCC learned only
// in version 11: the assembler (binutils 2.36+) is all these need. Run only where amx_bf16_ready().
struct alignas(64) TileConfig16x64 {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads palette 1 with tiles 0 .. num_tiles - 1 of 16 rows x 64 bytes, for the calling thread.
inline void load_tile_config_16x64(int num_tiles) {
  TileConfig16x64 cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < num_tiles; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

inline void release_tile_config() { asm volatile("tilerelease" : : : "memory"); }

// tile t = 16 rows of 64 bytes from base, rows stride bytes apart; and back
#define AMX_TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t : : "r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride)) : "memory")
#define AMX_TILE_STORE(t, base, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" : : "r"(static_cast<void*>(base)), "r"(static_cast<long>(stride)) : "memory")
#define AMX_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t : :)
// tile c (16 x 16 float32) += tile a (16 x 32 bf16) . tile b (16 rows of 16 bf16 pairs): TDPBF16PS c, a, b
#define AMX_TILE_DPBF16PS(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c : :)
