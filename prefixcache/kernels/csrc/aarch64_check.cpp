// A standalone driver of the torch-free kernel cores (qgemm_core.h: the int4 / int8 products and their
// plain-loop reference; decode_attention_f32.h: the float32 paged decode attention) on inputs read from stdin,
// the outputs' bits written to stdout. It exists so the NEON forms, which no extension builds (there is no
// aarch64 libtorch here), are checked bit for bit against the x86 extensions' results:
// tests/kernels/test_aarch64_build.py cross-compiles it (aarch64-linux-gnu-g++, with and without +dotprod) and
// runs it under qemu-aarch64. Built with -DPREFIXCACHE_NO_TORCH; one thread.
//
// stdin, little-endian, any number of cases until end of input, each an int64 op, then:
//   op 0 (int4_mm) or 1 (int8_mm): int64 M, K, N, x_bf16 (0 float32, 1 bfloat16), out_bf16, has_bias, then
//     x       [M, K]                        float32 or bfloat16 bits
//     packed  int4: [N / 16, K / 8, 64] uint8; int8: [N / 16, K / 4, 64] int8   (qgemm.cpp's layouts)
//     scale   [N / 16, K / 32, 16] float16 bits
//     min     like scale (int4 only)
//     bias    [N] float32 (has_bias only)
//   stdout: the kernel's [M, N] output, then the reference's, float32 or bfloat16 bits.
//   op 2 (paged_decode_attention_float32): int64 R, H, KVH, D, num_slots, max_blocks, block_size, float32 scale,
//   then q [R, H, D] bf16, k and v [num_slots, KVH, D] bf16, block_table [R, max_blocks] int32, context_lens [R]
//   int32. stdout: out [R, H, D] bf16.
// `aarch64_check --form` prints which integer form was compiled in and exits.
// Exit status 2 with a message on stderr for malformed input.
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#if !defined(__aarch64__)
#error "aarch64_check.cpp checks the aarch64 forms (the x86 forms are checked through the extensions)"
#endif

#include "decode_attention_f32.h"
#include "qgemm_core.h"

// the kernel and the reference share one quantization of x: signed qx, no int8 offset (true of the NEON form)
static_assert(!kOffsetActivations, "aarch64_check.cpp needs a form that reads signed qx");

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "aarch64_check: %s\n", what);
  std::exit(2);
}

template <typename T>
std::vector<T> read_array(int64_t count, const char* what) {
  std::vector<T> v(static_cast<size_t>(count));
  if (count > 0 && std::fread(v.data(), sizeof(T), v.size(), stdin) != v.size()) fail(what);
  return v;
}

template <typename T>
void write_array(const std::vector<T>& v) {
  if (std::fwrite(v.data(), sizeof(T), v.size(), stdout) != v.size()) fail("short write to stdout");
}

const char* form() {
#if defined(__ARM_FEATURE_DOTPROD)
  return "neon+dotprod";
#else
  return "neon";
#endif
}

constexpr int64_t kMaxElements = int64_t{1} << 28;  // any one input array: far above what a test sends

void run_product(int64_t op) {
  const std::vector<int64_t> h = read_array<int64_t>(6, "truncated product header");
  const int64_t M = h[0], K = h[1], N = h[2];
  const bool x_bf16 = h[3] != 0, out_bf16 = h[4] != 0, has_bias = h[5] != 0;
  if (M < 1 || K < kGroup || K % kGroup != 0 || N < kLanes || N % kLanes != 0 || M * K > kMaxElements ||
      N * K > kMaxElements)
    fail("shape must be M >= 1, K a positive multiple of 32, N a positive multiple of 16 (and not huge)");
  const int64_t G = K / kGroup;
  QuantRows xq;
  if (x_bf16) {
    xq = quantize_rows(read_array<bf16_t>(M * K, "truncated x").data(), M, K, false);
  } else {
    xq = quantize_rows(read_array<float>(M * K, "truncated x").data(), M, K, false);
  }
  const std::vector<uint8_t> packed = read_array<uint8_t>(N / kLanes * K / (op == 0 ? 8 : 4) * 64, "truncated packed");
  const std::vector<half_t> scale = read_array<half_t>(N * G, "truncated scale");
  const std::vector<half_t> min = op == 0 ? read_array<half_t>(N * G, "truncated min") : std::vector<half_t>();
  const std::vector<float> bias = has_bias ? read_array<float>(N, "truncated bias") : std::vector<float>();
  const size_t out_bytes = static_cast<size_t>(M * N) * (out_bf16 ? 2 : 4);
  std::vector<uint8_t> out(out_bytes), ref(out_bytes);
  Call a{&xq, K, N, scale.data(), op == 0 ? min.data() : nullptr, nullptr, has_bias ? bias.data() : nullptr,
         out.data(), out_bf16};
  const uint8_t* w4 = op == 0 ? packed.data() : nullptr;
  const int8_t* w8 = op == 1 ? reinterpret_cast<const int8_t*>(packed.data()) : nullptr;
  if (op == 0) {
    run_blocks(M, 0, N / kLanes, [&](auto rows, int64_t r0, int64_t nb) { int4_block<decltype(rows)::value>(a, w4, r0, nb); });
  } else {
    run_blocks(M, 0, N / kLanes, [&](auto rows, int64_t r0, int64_t nb) { int8_block<decltype(rows)::value>(a, w8, r0, nb); });
  }
  write_array(out);
  a.out = ref.data();
  reference_rows(a, w4, w8, M);
  write_array(ref);
}

void run_attention() {
  const std::vector<int64_t> h = read_array<int64_t>(7, "truncated attention header");
  const int64_t R = h[0], H = h[1], KVH = h[2], D = h[3], S = h[4], max_blocks = h[5], block_size = h[6];
  const float scale = read_array<float>(1, "truncated scale")[0];
  if (R < 1 || KVH < 1 || H < 1 || H % KVH != 0 || H / KVH > kMaxGroup || D < 16 || D % 16 != 0 || D > 16 * kMaxVec ||
      S < 1 || max_blocks < 1 || block_size < 1 || R * H * D > kMaxElements || S * KVH * D > kMaxElements ||
      R * max_blocks > kMaxElements)
    fail("attention shape must have H a multiple of KVH (<= 16 per kv head), D a multiple of 16 <= 256, sizes >= 1");
  const std::vector<bf16_t> q = read_array<bf16_t>(R * H * D, "truncated q");
  const std::vector<bf16_t> k = read_array<bf16_t>(S * KVH * D, "truncated k");
  const std::vector<bf16_t> v = read_array<bf16_t>(S * KVH * D, "truncated v");
  const std::vector<int32_t> table = read_array<int32_t>(R * max_blocks, "truncated block_table");
  const std::vector<int32_t> lens = read_array<int32_t>(R, "truncated context_lens");
  for (int64_t r = 0; r < R; ++r) {  // paged_attention.cpp's checks
    if (lens[r] < 1 || lens[r] > max_blocks * block_size) fail("context_lens out of the block table's range");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b)
      if (table[r * max_blocks + b] < 0 || table[r * max_blocks + b] >= S / block_size) fail("block_table holds a block outside the pool");
  }
  std::vector<bf16_t> out(static_cast<size_t>(R * H * D));
  const Args a{q.data(), k.data(), v.data(), table.data(), lens.data(), out.data(), H, KVH, D, max_blocks, block_size, scale};
  run_float32(a, R, [](int64_t n, const auto& fn) { fn(int64_t{0}, n); });
  write_array(out);
}

// One case from stdin to stdout; false at a clean end of input.
bool run_case() {
  int64_t op;
  if (std::fread(&op, sizeof(op), 1, stdin) != 1) {
    if (std::feof(stdin)) return false;
    fail("reading the op");
  }
  if (op == 0 || op == 1) {
    run_product(op);
  } else if (op == 2) {
    run_attention();
  } else {
    fail("op must be 0 (int4_mm), 1 (int8_mm) or 2 (paged_decode_attention_float32)");
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string_view(argv[1]) == "--form") {
    std::printf("%s\n", form());
    return 0;
  }
  while (run_case()) {
  }
  return 0;
}
