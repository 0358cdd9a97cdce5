// How fast this CPU runs 512-bit vdpbf16ps: with a broadcast operand from memory (the shape of the prompt
// attention's inner loops: 8 broadcast keys x 3 row vectors, or x 1) and register-only. One instruction per
// ~0.28 ns on the AMD EPYC of 2026-12-02 (~460 GFLOP/s for 2 cores) with -O3:
//
//     g++ -O3 -o /tmp/bf16_dot_rate scripts/bf16_dot_rate.cpp && /tmp/bf16_dot_rate
//
// The last line is the int8 dot product's rate (vpdpbusd, 64 products per instruction against
// vdpbf16ps's 32): about the same time per instruction there (0.36-0.45 ns vs 0.38-0.41 in one run
// beside other work), so int8 products could do twice the multiplies per second.
// (-O2 leaves the accumulators of the register-only loop in memory: slower, not the instruction's rate.)
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx512vnni")
alignas(64) uint32_t mem[4096];
alignas(64) uint32_t q[64][48];
template <int NB> __attribute__((noinline)) float run(long iters) {
  __m512 acc[8][3];
  for (int j = 0; j < 8; ++j) for (int v = 0; v < 3; ++v) acc[j][v] = _mm512_setzero_ps();
  for (long it = 0; it < iters; ++it) {
    const uint32_t* base = mem + (it & 63) * 8;
    for (int p = 0; p < 32; ++p) {
      __m512i qv[3];
      for (int v = 0; v < 3; ++v) qv[v] = _mm512_load_si512(&q[p][v * 16]);
      for (int j = 0; j < 8; ++j) {
        __m512i kb = _mm512_set1_epi32((int)base[j * 96 + p]);
        for (int v = 0; v < NB; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], (__m512bh)qv[v], (__m512bh)kb);
      }
    }
  }
  float s = 0; for (int j = 0; j < 8; ++j) for (int v = 0; v < 3; ++v) s += _mm512_reduce_add_ps(acc[j][v]);
  return s;
}
__attribute__((noinline)) float pure(long iters) {  // dpbf16 only, register operands
  __m512 acc[24]; for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
  __m512i a = _mm512_set1_epi32(0x3f803f80), b = _mm512_set1_epi32(0x3f803f80);
  for (long it = 0; it < iters * 32; ++it) {
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b);
    a = _mm512_add_epi32(a, b);
  }
  float s = 0; for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_ps(acc[i]); return s;
}
__attribute__((noinline)) float pure_vnni(long iters) {  // vpdpbusd (int8: 64 products each), register operands
  __m512i acc[24]; for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_si512();
  __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x01010101);
  for (long it = 0; it < iters * 32; ++it) {
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    a = _mm512_add_epi32(a, b);
  }
  int s = 0; for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_epi32(acc[i]); return (float)s;
}
int main() {
  long iters = 2000000;
  auto t = [&](auto f, const char* name, double dp) {
    f(1000); auto s = std::chrono::steady_clock::now(); volatile float r = f(iters);
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - s).count();
    printf("%s: %.3f ns per instruction\n", name, ns / (iters * dp)); };
  t(run<3>, "bcast+3 dp", 32 * 8 * 3); t(run<1>, "bcast+1 dp", 32 * 8 * 1); t(pure, "pure dp", 32 * 24);
  t(pure_vnni, "pure vpdpbusd", 32 * 24);
}
