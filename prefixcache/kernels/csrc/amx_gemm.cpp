// A bfloat16 model's linear layers on AMX tiles: out[M, N] = bf16(x[M, K] . W[N, K]^T + bias), float32 sums.
//
// The weight is packed once (kernels/amx_gemm.py) into the tile layout TDPBF16PS reads as its B operand: for
// each block of 16 output columns and each 32 input features, a 16 x 16 tile of dwords whose row i, column n
// holds (W[n][2i], W[n][2i + 1]). A work item is up to 256 rows and 128 columns; in it, 32 rows x 32
// columns at a time run as four 16 x 16 float32 tiles, each summed over the input features in blocks of 32
// in order (C += A . B, one TDPBF16PS per block; a sum may rest in memory as float32 between blocks, see
// gemm_item), then the bias is added in float32 and the sum rounded to bf16 (to nearest even, torch's rule).
//
// Batch invariance: an output element is its row of x times its column of W, summed in an order fixed by K
// alone; a tile product's element depends only on its own A row and B column, so a row gets the same bits in
// a call of any number of rows, in any work item, on any thread. (oneDNN's bf16 GEMM does not promise that:
// its kernel and blocking follow M, hence layers/linear.py's row tiles where this kernel does not run.)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

bool amx_bf16_ready();  // prefill_attention.cpp

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")

namespace {

constexpr int64_t kItemRows = 256, kItemBlocks = 8;  // a work item: rows x (16-column blocks), at most
constexpr int64_t kKcBlock = 6;  // feature blocks of 32 per pass over a work item's row chunks

// Output modes. kPlain: column block b is out's columns 16 b ... kGateUp: blocks alternate gate block j,
// up block j (kernels/amx_gemm.py's interleave_gate_up), written to out [M, 2 I] at 16 j and I + 16 j. kSiluMul: the same
// pairs, out [M, I] = bf16(bf16(silu(bf16 gate)) * bf16 up), prompt_ops.cpp's silu_mul on the bf16 values the
// kGateUp mode writes: the same bits as that mode followed by silu_mul.
enum OutMode : int64_t { kPlain = 0, kGateUp = 1, kSiluMul = 2 };

struct GemmArgs {
  const at::BFloat16* x;   // [M, K]
  const uint32_t* w;       // [NB, K / 32, 16, 16] packed pairs
  const float* bias;       // [NB * 16] float32 in the packed column order, or nullptr
  at::BFloat16* out;       // [M, N], N per the mode
  int64_t M, K, N, NB;
  int64_t mode;            // OutMode
};

struct Scratch {  // per thread, kept across calls
  std::vector<at::BFloat16> pad;  // [32, K]: a tail of fewer than 32 rows, zero below
  alignas(64) float c[32][32];
  alignas(64) float acc[kItemRows / 32][32][32];  // each row chunk's sums between feature blocks
};

// kSiluMul's store of a gate/up block pair (nb even: gate block nb / 2 in sc.c's columns 0-15, up in 16-31).
void store_silu_mul(const GemmArgs& g, const Scratch& sc, int64_t mb, int64_t rows, int64_t nb) {
  for (int64_t r = 0; r < rows; ++r) {  // no bias: no add (-0 + 0 would be +0, another bit)
    __m512 gate = _mm512_load_ps(&sc.c[r][0]), up = _mm512_load_ps(&sc.c[r][16]);
    if (g.bias) {
      gate = _mm512_add_ps(gate, _mm512_loadu_ps(g.bias + nb * 16));
      up = _mm512_add_ps(up, _mm512_loadu_ps(g.bias + nb * 16 + 16));
    }
    gate = round_bf16(gate), up = round_bf16(up);
    const __m512 silu = round_bf16(
        _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
    store_bf16(g.out + (mb + r) * g.N + nb / 2 * 16, _mm512_mul_ps(silu, up));
  }
}

// kPlain's and kGateUp's store of block nb (and nb + 1 where two_cols) for rows mb .. mb + rows - 1.
void store_pair(const GemmArgs& g, const Scratch& sc, int64_t mb, int64_t rows, int64_t nb, bool two_cols) {
  for (int64_t h = 0; h < (two_cols ? 2 : 1); ++h) {
    const int64_t n0 = (nb + h) * 16, valid = g.mode == kGateUp ? 16 : std::min<int64_t>(16, g.N - n0);
    if (valid <= 0) break;
    const int64_t col = g.mode == kGateUp ? (nb + h) % 2 * (g.N / 2) + (nb + h) / 2 * 16 : n0;
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bias = g.bias ? _mm512_maskz_loadu_ps(keep, g.bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 y = g.bias ? _mm512_add_ps(_mm512_load_ps(&sc.c[r][h * 16]), bias) : _mm512_load_ps(&sc.c[r][h * 16]);
      const __m256i b16 = _mm512_cvtepi32_epi16(_mm512_srli_epi32(to_bf16_bits(y), 16));
      _mm256_mask_storeu_epi16(g.out + (mb + r) * g.N + col, keep, b16);
    }
  }
}

// One 32-row chunk (x rows at a, x_stride bytes apart) times column blocks w0 (and w1) over feature blocks
// [k0, k1), summed onto tiles 0-3 (0: rows 0-15 x w0, 1: rows 0-15 x w1, 2 and 3: rows 16-31), in feature
// order; meanwhile up to lines_per_kc lines per feature block of [pf, pf_end) are asked for to L2.
inline void chunk_products(const at::BFloat16* a, int64_t x_stride, int64_t K, const uint32_t* w0, const uint32_t* w1,
                           int64_t k0, int64_t k1, bool two_rows, bool two_cols, const char*& pf, const char* pf_end,
                           int64_t lines_per_kc) {
  for (int64_t kc = k0; kc < k1; ++kc) {
    for (int64_t i = 0; i < lines_per_kc && pf < pf_end; ++i, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    AMX_TILE_LOAD(4, a + kc * 32, x_stride);
    AMX_TILE_LOAD(6, w0 + kc * 256, 64);
    AMX_TILE_DPBF16PS(0, 4, 6);
    if (two_cols) {
      AMX_TILE_LOAD(7, w1 + kc * 256, 64);
      AMX_TILE_DPBF16PS(1, 4, 7);
    }
    if (two_rows) {
      AMX_TILE_LOAD(5, a + 16 * K + kc * 32, x_stride);
      AMX_TILE_DPBF16PS(2, 5, 6);
      if (two_cols) AMX_TILE_DPBF16PS(3, 5, 7);
    }
  }
}

// Tiles 0-3 to or from a 32 x 32 float32 block (rows 128 bytes apart).
inline void store_sums(float* c) {
  AMX_TILE_STORE(0, c, 128);
  AMX_TILE_STORE(1, c + 16, 128);
  AMX_TILE_STORE(2, c + 512, 128);
  AMX_TILE_STORE(3, c + 528, 128);
}

inline void load_sums(const float* c) {
  AMX_TILE_LOAD(0, c, 128);
  AMX_TILE_LOAD(1, c + 16, 128);
  AMX_TILE_LOAD(2, c + 512, 128);
  AMX_TILE_LOAD(3, c + 528, 128);
}

// Rows [m0, m1) x column blocks [b0, b1). Column pairs outside; inside, kKcBlock feature blocks at a time
// over every 32-row chunk, each chunk's sums kept in sc.acc between them (stored and loaded as float32,
// exact: each sum still adds its feature blocks in order). So a pair's weights for kKcBlock feature blocks
// (12 KB) stay in L1 while the row chunks pass, where a whole pair (36 KB at K = 576) and a chunk's rows
// would not fit together. The next pair's weights are asked for (to L2) evenly over this pair's chunks, so
// the weight stream from memory runs beside the products.
void gemm_item(const GemmArgs& g, int64_t m0, int64_t m1, int64_t b0, int64_t b1, Scratch& sc) {
  const int64_t KC = g.K / 32, x_stride = g.K * 2;
  const int64_t tail = (m1 - m0) % 32, tail_mb = m1 - tail;
  if (tail > 0) {  // a tile reads 16 whole rows: the tail chunk copied once, zero rows after it
    std::memset(sc.pad.data(), 0, 32 * g.K * sizeof(at::BFloat16));
    std::memcpy(sc.pad.data(), g.x + tail_mb * g.K, tail * g.K * sizeof(at::BFloat16));
  }
  const int64_t chunks = (m1 - m0 + 31) / 32, lines_per_kc = (32 + chunks - 1) / chunks;
  const int64_t kc_block = chunks > 1 ? kKcBlock : KC;  // one chunk: nothing to keep in L1 between chunks
  for (int64_t nb = b0; nb < b1; nb += 2) {
    const bool two_cols = nb + 1 < b1;
    const uint32_t* w0 = g.w + nb * KC * 256;
    const uint32_t* w1 = w0 + KC * 256;
    const char* pf = reinterpret_cast<const char*>(w0 + 2 * KC * 256);  // the item's next pair
    const char* pf_end = reinterpret_cast<const char*>(g.w + std::min<int64_t>(nb + 4, b1) * KC * 256);
    for (int64_t k0 = 0; k0 < KC; k0 += kc_block) {
      const int64_t k1 = std::min<int64_t>(KC, k0 + kc_block);
      for (int64_t mb = m0; mb < m1; mb += 32) {
        const int64_t rows = std::min<int64_t>(32, m1 - mb);
        float* acc = &sc.acc[(mb - m0) / 32][0][0];
        if (k0 == 0) {
          AMX_TILE_ZERO(0);
          AMX_TILE_ZERO(1);
          AMX_TILE_ZERO(2);
          AMX_TILE_ZERO(3);
        } else {
          load_sums(acc);
        }
        chunk_products(rows < 32 ? sc.pad.data() : g.x + mb * g.K, x_stride, g.K, w0, w1, k0, k1, rows > 16, two_cols,
                       pf, pf_end, lines_per_kc);
        if (k1 < KC) {
          store_sums(acc);
        } else {
          store_sums(&sc.c[0][0]);
          if (g.mode == kSiluMul)
            store_silu_mul(g, sc, mb, rows, nb);
          else
            store_pair(g, sc, mb, rows, nb, two_cols);
        }
      }
    }
  }
}

}  // namespace

#pragma GCC pop_options

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N,
                      int64_t mode) {
  TORCH_CHECK(amx_bf16_ready(), "amx_linear needs AMX-BF16 tiles (amx_bf16_ready())");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_cpu(), "x must be bf16 [M, K] on the CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.size(2) == 16 &&
              packed.size(3) == 16, "packed must be contiguous int32 [N / 16, K / 32, 16, 16] (amx_gemm.pack_weight)");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), NB = packed.size(0);
  TORCH_CHECK(K % 32 == 0 && packed.size(1) == K / 32, "x's K must be a multiple of 32 and match packed");
  TORCH_CHECK(mode == kPlain || mode == kGateUp || mode == kSiluMul, "mode must be 0, 1 or 2");
  TORCH_CHECK(mode == kPlain || (NB % 2 == 0 && N == NB * 16), "gate/up modes need whole gate and up block pairs");
  TORCH_CHECK(N >= 1 && N <= NB * 16 && N > (NB - 1) * 16, "N must fit packed's column blocks");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == N, "bias must be [N]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const int64_t out_cols = mode == kSiluMul ? N / 2 : N;
  at::Tensor out = at::empty({M, out_cols}, xc.options());
  if (M == 0) return out;
  const GemmArgs g{xc.data_ptr<at::BFloat16>(), reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                   bias.has_value() ? bias32.data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(), M, K,
                   out_cols, NB, mode};
  // column items: a multiple of the threads (a 576-column product in 5 items of 8 blocks left one thread
  // idle a fifth of the time), each an even number of blocks (pairs run together); rows do not depend on it
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t target = threads * ((NB + threads * kItemBlocks - 1) / (threads * kItemBlocks));
  const int64_t item_blocks = std::max<int64_t>(2, 2 * ((NB + 2 * target - 1) / (2 * target)));
  const int64_t row_items = (M + kItemRows - 1) / kItemRows, col_items = (NB + item_blocks - 1) / item_blocks;
  const int64_t num_items = row_items * col_items;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    load_tile_config_16x64(8);
    thread_local Scratch scr;  // kept across calls (every float read is written first; pad is zeroed where used)
    if (scr.pad.size() < static_cast<size_t>(32 * K)) scr.pad.resize(32 * K);
    for (int64_t i = next++; i < num_items; i = next++) {  // column items of one row chunk first: its x stays in cache
      const int64_t mi = i / col_items, ci = i % col_items;
      gemm_item(g, mi * kItemRows, std::min(M, (mi + 1) * kItemRows), ci * item_blocks,
                std::min(NB, (ci + 1) * item_blocks), scr);
    }
    release_tile_config();
  });
  return out;
}
