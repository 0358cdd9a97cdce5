// What AMX tile instructions cost on this CPU, data in L1: ns per TDPBF16PS alone (4 independent
// accumulators), per 1 KB TILELOADD alone, and per product in the 2 x 2 blocking of csrc/amx_gemm.cpp
// (two x tiles, two weight tiles, four products per 32 features). Standalone, Linux x86-64 with AMX-BF16:
//
//   g++ -O2 -o /tmp/amx_tile_rates scripts/amx_tile_rates.cpp && /tmp/amx_tile_rates
//
// (2026-12-02, the Intel Xeon of that day: 4.8-5.1 ns per product, 6.1 ns per load, 8.9 ns per product
// in the 2 x 2 blocking, 9.4 with x rows 1,152 bytes apart as at K = 576.)
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

#define LD(t, base, stride) asm volatile("tileloadd (%0,%1,1), %%tmm" #t : : "r"((const void*)(base)), "r"((long)(stride)) : "memory")
#define ST(t, base, stride) asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" : : "r"((void*)(base)), "r"((long)(stride)) : "memory")
#define ZERO(t) asm volatile("tilezero %%tmm" #t : :)
#define DP(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c : :)

struct alignas(64) TileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static uint16_t A[64 * 1024] __attribute__((aligned(64)));
static uint16_t B[64 * 1024] __attribute__((aligned(64)));
static float C[32 * 32] __attribute__((aligned(64)));

template <class F>
void report(const char* name, F body, long iters, int per_iter) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) body();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%-44s %.2f ns\n", name, ns / (iters * per_iter));
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::puts("no AMX tile state granted here");
    return 1;
  }
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
  for (int i = 0; i < 64 * 1024; ++i) A[i] = B[i] = 0x3f80;  // bf16 1.0
  const int KC = 18;  // 576 features
  report("per product, products alone", [&] {
    for (int k = 0; k < KC; ++k) { DP(0, 4, 6); DP(1, 4, 7); DP(2, 5, 6); DP(3, 5, 7); }
  }, 200000, 4 * KC);
  report("per 1 KB tile load, loads alone", [&] {
    for (int k = 0; k < KC; ++k) { LD(4, A + k * 512, 64); LD(6, B + k * 512, 64); LD(7, B + 9216 + k * 512, 64); LD(5, A + 9216 + k * 512, 64); }
  }, 100000, 4 * KC);
  report("per product, 2 x 2 blocking", [&] {
    ZERO(0); ZERO(1); ZERO(2); ZERO(3);
    for (int k = 0; k < KC; ++k) {
      LD(4, A + k * 512, 64); LD(6, B + k * 512, 64); DP(0, 4, 6); LD(7, B + 9216 + k * 512, 64); DP(1, 4, 7);
      LD(5, A + 9216 + k * 512, 64); DP(2, 5, 6); DP(3, 5, 7);
    }
    ST(0, C, 128); ST(1, C + 16, 128); ST(2, C + 512, 128); ST(3, C + 528, 128);
  }, 100000, 4 * KC);
  report("per product, 2 x 2, x rows 1,152 bytes apart", [&] {
    ZERO(0); ZERO(1); ZERO(2); ZERO(3);
    for (int k = 0; k < KC; ++k) {
      LD(4, A + k * 32, 1152); LD(6, B + k * 512, 64); DP(0, 4, 6); LD(7, B + 9216 + k * 512, 64); DP(1, 4, 7);
      LD(5, A + 16 * 576 + k * 32, 1152); DP(2, 5, 6); DP(3, 5, 7);
    }
    ST(0, C, 128); ST(1, C + 16, 128); ST(2, C + 512, 128); ST(3, C + 528, 128);
  }, 100000, 4 * KC);
  asm volatile("tilerelease");
  return 0;
}
