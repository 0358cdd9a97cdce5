// Software prefetch of K/V rows, shared by the attention kernels of every ISA build (avx512.h and vec16.h
// include it): plain prefetcht0, no vector instruction.
#pragma once
#include <cstdint>

#include "scalar16.h"  // bf16_t: at::BFloat16 in the extensions

// prefetcht0 that the compiler keeps: GCC deletes a loop whose only effects are _mm_prefetch calls once
// nothing in it can trap (found when this loop lost its per-key division: no prefetch left in the build).
// aarch64 (the NEON check build): prfm pldl1keep, the same request.
#if defined(__aarch64__)
inline void prefetch_t0(const char* p) { asm volatile("prfm pldl1keep, %0" : : "Q"(*p)); }
#else
inline void prefetch_t0(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }
#endif

// Asks for the K and V rows of keys [begin, end) of one sequence (its block table row `table`, kv head at
// element offset head_offset within a slot's row of row_stride elements) to be brought into L1 ahead of
// their use: a long context's K/V is out of cache (a decode step ran every other layer since; a prompt item
// streams all of it), and one kv head's rows lie row_stride elements apart, a stride the hardware
// prefetcher follows poorly. row_bytes: bytes of one head's row (D sizeof(T)); T: the pool's element type.
template <class T>
inline void prefetch_kv_rows(const T* k, const T* v, const int32_t* table, int64_t block_size,
                             int64_t row_stride, int64_t head_offset, int64_t row_bytes, int64_t begin, int64_t end) {
  if (begin >= end) return;
  for (int64_t pos = begin, block = begin / block_size, offset = begin % block_size; pos < end; ++pos) {
    const int64_t slot = static_cast<int64_t>(table[block]) * block_size + offset;  // one division, not one per key
    const char* kr = reinterpret_cast<const char*>(k + slot * row_stride + head_offset);
    const char* vr = reinterpret_cast<const char*>(v + slot * row_stride + head_offset);
    for (int64_t b = 0; b < row_bytes; b += 64) prefetch_t0(kr + b), prefetch_t0(vr + b);
    if (++offset == block_size) offset = 0, ++block;
  }
}
