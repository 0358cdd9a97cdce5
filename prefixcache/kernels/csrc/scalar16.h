// The 16-bit floats the per-ISA kernels read and write (vec16.h, qgemm_core.h): torch's at::Half and
// at::BFloat16 in the extensions; where the cores are built without torch (PREFIXCACHE_NO_TORCH: the standalone
// check driver, cross-compiled for aarch64 where no aarch64 libtorch exists) two structs of the same layout, one
// uint16_t of IEEE binary16 / bfloat16 bits, so the same pointers and the same bits flow through either.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(PREFIXCACHE_NO_TORCH)
struct half_t {
  uint16_t x;
};
struct bf16_t {
  uint16_t x;
};
#else
#include <ATen/ATen.h>
using half_t = at::Half;
using bf16_t = at::BFloat16;
#endif

inline float bf16_to_float(bf16_t v) {  // exact: the bf16 bits are a float32's high half
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float32 -> bfloat16 rounded to nearest even, NaN a quiet NaN (0x7FC0): c10::BFloat16's rounding and
// avx512.h's to_bf16_bits, one rule for every store
inline bf16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bf16_t r;
  r.x = f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return r;
}

#if defined(PREFIXCACHE_NO_TORCH)
// binary16 -> float32, exact (every binary16 value is a float32): torch's static_cast<float>(at::Half) on every
// finite value and infinity; a NaN stays a NaN with its payload in the high mantissa bits
inline float half_to_float(half_t h) {
  const uint32_t sign = static_cast<uint32_t>(h.x & 0x8000u) << 16, exp = (h.x >> 10) & 0x1Fu, mant = h.x & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
  } else {
    float f = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24: zero or a subnormal, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
#else
inline float half_to_float(half_t h) { return static_cast<float>(h); }
#endif
