// Decode attention of generated tokens straight from the paged KV pool, each query row on its own.
//
// A row (one token, all heads) attends over its context: keys 0 .. context_len - 1 of its sequence,
// found through its block table (slot = block * block_size + offset), in order, with the online softmax
// of Milakov & Gimelshein 2018 (as FlashAttention uses it): per block of keys and query head, scores
// s = (q . k) * scale, m' = max(m, max s), alpha = e^(m - m'), p = e^(s - m'), l = alpha l + sum p,
// acc = alpha acc + sum p v. A context is split into segments of 1,024 keys at fixed positions
// (flash-decoding's split-K, so a long context's segments run on all threads), each segment's
// (acc, max, sum) kept in float32, then merged in segment order: out = sum_s w_s acc_s / sum_s w_s l_s
// with w_s = exp(max_s - max), as float32 element-wise sums in that order. Two forms:
//
// - AVX512-BF16 (bf16dp::, when the CPU has it and head_dim is a multiple of 32): keys in blocks of 32
//   at fixed positions (0-31, 32-63, ...), the 32 keys in the lanes of two vectors; q . k by vdpbf16ps
//   over head_dim pairs in order (bf16 q and k, float32 sums), p rounded to bf16 and p @ v by vdpbf16ps
//   over key pairs in order, l summing the rounded p. A block's K is transposed to [dim pair][key] and
//   its V interleaved by key pairs once per work item: rows whose contexts start with the same pool
//   blocks (decodes over one system prompt, an n > 1 request's samples) form one item (up to 16 rows)
//   and read the shared blocks' prepared K/V from cache, each row still doing its own arithmetic over
//   every one of its keys (FlashInfer's and vLLM's cascade attention instead attend to the shared part
//   once and merge by log-sum-exp, which changes a row's rounding with its batch).
// - float32 (elsewhere, and for rows whose context is longer than kBf16MaxContext = 4,096 keys: a lone long
//   context streams its K/V faster this way; the row's own length decides, never its batch): keys in pieces
//   of at most 16 that never cross a pool block, scores in float32 (bf16 K converted exactly) summed over 16
//   lanes then across them in a fixed pattern, p @ v in float32. Rows over the same pool blocks form one item
//   here too (make_items): each chunk of their shared keys is widened to float32 once and read from cache by every
//   row, which converts no key of it again. Its code is decode_attention_f32.h, torch-free and written against
//   vec16.h: the AVX-512, AVX2 and aarch64 NEON builds run it (neon_kernels.py builds the last on ARM; its bits are
//   checked under qemu with aarch64_check.cpp).
//
// The prompt kernel (prefill_attention.cpp) runs exactly where the first form does, so the model's cache
// key (layers/attention/numerics.py, kv_numerics) tells the two apart, and INT4_OUTPUT_KEY (layers/quant.py) names the form.
// A NaN or +inf score at one of a row's keys makes that row's output NaN, as float attention's would be.
//
// Every operation of a row depends only on its own query, its own keys and values at their absolute
// positions and the pool's block size, never on the other rows of the call, the rows it shares an item
// with or the split between threads: a row gets the same bits in a decode, in a recompute after
// preemption and in any batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__)  // the aarch64 build (neon_kernels.py) compiles the float32 form alone
#include <immintrin.h>
#endif

#include "decode_attention_f32.h"  // the float32 form (Args, attend_segment, merge_row, run_float32)
#include "isa_tier.h"
#include "vec16.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// Rows with a longer context take the float32 form also where the bf16 form runs: a lone long context gains
// nothing from sharing prepared blocks and streams its K/V faster through the float32 form (8,100 keys, 30
// layers out of cache: benchmarks/decode_attention.py --layers 30 compares the forms). By the row's own
// length only, so a row's form, and its bits, never depend on its batch.
constexpr int64_t kBf16MaxContext = 4096;

}  // namespace

// ---- The AVX512-BF16 form (header, second part): keys in lanes, bf16 dot products, shared key blocks prepared once.
// Only in the AVX-512 build (the AVX2 build runs the float32 form, decode_attention_f32.h, for every row).
#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,fma")

namespace bf16dp {

constexpr int kKeys = 32;          // keys per softmax block, at absolute positions kKeys * i
constexpr int kChunkBlocks = 2;    // blocks prepared at once (64 keys: 16 KB for head_dim 64, inside L1)

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

struct KeyBlock {  // keys [start, start + n) of one block of kKeys
  int64_t start;
  int n;
};

// Up to `cap` key blocks of [begin, end) (each ending at the next multiple of kKeys or at `end`);
// returns the position after them.
int64_t next_blocks(int64_t begin, int64_t end, KeyBlock* out, int cap, int& count) {
  count = 0;
  int64_t x = begin;
  for (; x < end && count < cap; x += out[count++].n)
    out[count] = KeyBlock{x, static_cast<int>(std::min<int64_t>(end, (x / kKeys + 1) * kKeys) - x)};
  return x;
}

// The 16 x 16 dword matrix in r transposed in place: r[j] becomes column j (unpacks within 128-bit lanes,
// then lane shuffles).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), w1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(v0, w0, 0x88), t[4 + j] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(v1, w1, 0x88), t[12 + j] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}

// A key block's keys as [D / 2 pairs][32 keys] dwords (pair p of key t, 0 past n) and its values as
// [16 key pairs][D] dwords ((v_2i[d], v_2i+1[d]) with dims in pair order, see pair_dim; 0 past n), read
// through one row's block table (only the block's own n slots).
void prepare(const Args& a, const int32_t* table_row, int64_t kh, const KeyBlock& kb, uint32_t* kt, uint32_t* vp) {
  const int64_t D = a.D, P = D / 2, row_stride = a.KVH * D;
  const at::BFloat16* krow[kKeys];
  const at::BFloat16* vrow[kKeys];
  for (int t = 0; t < kb.n; ++t) {
    const int64_t pos = kb.start + t;
    const int64_t slot = static_cast<int64_t>(table_row[pos / a.block_size]) * a.block_size + pos % a.block_size;
    krow[t] = a.k + slot * row_stride + kh * D, vrow[t] = a.v + slot * row_stride + kh * D;
  }
  for (int h = 0; h < kKeys && h < kb.n; h += 16) {  // keys h .. h + 15
    for (int64_t p0 = 0; p0 < P; p0 += 16) {         // their dim pairs p0 .. p0 + 15
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = h + t < kb.n ? _mm512_loadu_si512(krow[h + t] + 2 * p0) : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(kt + (p0 + j) * kKeys + h, r[j]);
    }
  }
  if (kb.n <= 16)
    for (int64_t p = 0; p < P; ++p) _mm512_store_si512(kt + p * kKeys + 16, _mm512_setzero_si512());
  for (int64_t i = 0; 2 * i < kb.n; ++i) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const __m512i x = _mm512_loadu_si512(vrow[2 * i] + d0);
      const __m512i y = 2 * i + 1 < kb.n ? _mm512_loadu_si512(vrow[2 * i + 1] + d0) : _mm512_setzero_si512();
      _mm512_store_si512(vp + i * D + d0, _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(vp + i * D + d0 + 16, _mm512_unpackhi_epi16(x, y));
    }
  }
}

// Which dim of its 32-dim block the output accumulator's dword j holds: V pairs are interleaved within
// 128-bit lanes (vpunpckl/hwd), so dwords 0-15 hold dims 0-3, 8-11, 16-19, 24-27 and 16-31 the others;
// a row's output is put back in dim order once, after its last block.
inline int64_t pair_dim(int64_t j) { return 8 * (j % 16 / 4) + j % 4 + (j >= 16 ? 4 : 0); }

// Row r, kv head kh over `count` prepared key blocks (at prep, prep_stride dwords apart): its state (the
// unnormalized output [G][D] in pair order, maxima [G], sums [G], bad flags [G]) read from and written
// back to `part`.
template <int kV, int kG>
void run_blocks(const Args& a, int64_t r, int64_t kh, const KeyBlock* blocks, int count, const uint32_t* prep,
                int64_t prep_stride, float* part) {
  constexpr int kVN = kV ? kV : kMaxVec, kGN = kG ? kG : kMaxGroup;
  const int64_t V = kV ? kV : a.D / 16, G = kG ? kG : a.H / a.KVH, D = a.D, P = D / 2;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 acc[kGN][kVN];
  float m[kGN], l[kGN];
  float* bad = part + G * D + 2 * G;
  const uint32_t* q[kGN];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < V; ++i) acc[g][i] = _mm512_loadu_ps(part + g * D + 16 * i);
    m[g] = part[G * D + g], l[g] = part[G * D + G + g];
    q[g] = reinterpret_cast<const uint32_t*>(a.q + (r * a.H + kh * G + g) * D);
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512 minus_inf = _mm512_set1_ps(neg_inf);
  for (int c = 0; c < count; ++c) {
    const uint32_t* kt = prep + c * prep_stride;
    const uint32_t* vp = kt + P * kKeys;
    const int n = blocks[c].n;
    const __mmask16 valid0 = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    const __mmask16 valid1 = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0);
    __m512 s0[kGN], s1[kGN];  // scores of keys 0-15 and 16-31: q . k over dim pairs in order
    for (int64_t g = 0; g < G; ++g) s0[g] = _mm512_setzero_ps(), s1[g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      const __m512i k0 = _mm512_load_si512(kt + p * kKeys), k1 = _mm512_load_si512(kt + p * kKeys + 16);
      for (int64_t g = 0; g < G; ++g) {
        const __m512i qb = _mm512_set1_epi32(static_cast<int>(q[g][p]));
        s0[g] = _mm512_dpbf16_ps(s0[g], as_bh(k0), as_bh(qb));
        s1[g] = _mm512_dpbf16_ps(s1[g], as_bh(k1), as_bh(qb));
      }
    }
    alignas(64) uint32_t pw[kGN][kKeys / 2];  // bf16 p of key pairs (2i, 2i + 1)
    for (int64_t g = 0; g < G; ++g) {
      const __m512 a0 = _mm512_mask_mov_ps(minus_inf, valid0, _mm512_mul_ps(s0[g], scale));
      const __m512 a1 = _mm512_mask_mov_ps(minus_inf, valid1, _mm512_mul_ps(s1[g], scale));
      const __m512 pos_inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
      if (_mm512_mask_cmp_ps_mask(valid0, a0, a0, _CMP_UNORD_Q) | _mm512_mask_cmp_ps_mask(valid1, a1, a1, _CMP_UNORD_Q) |
          _mm512_mask_cmp_ps_mask(valid0, a0, pos_inf, _CMP_EQ_OQ) | _mm512_mask_cmp_ps_mask(valid1, a1, pos_inf, _CMP_EQ_OQ))
        bad[g] = 1.f;
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)));
      // e^(m - m_new) by the vector exp (a libm call would spill every live vector register)
      const float alpha = m[g] == neg_inf ? 0.f : _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[g] - m_new)));
      const __m512 mv = _mm512_set1_ps(m_new);
      const __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_maskz_mov_ps(valid1, exp512(_mm512_sub_ps(a1, mv))),
                                              _mm512_maskz_mov_ps(valid0, exp512(_mm512_sub_ps(a0, mv))));
      _mm512_store_si512(pw[g], reinterpret_cast<const __m512i&>(pb));
      const __m512i pi = reinterpret_cast<const __m512i&>(pb);  // the bf16 weights back in float32, summed
      const __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(pi)), 16));
      const __m512 r1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pi, 1)), 16));
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(r0, r1));
      m[g] = m_new;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int64_t i = 0; i < V; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], av);
    }
    for (int64_t i = 0; 2 * i < n; ++i) {
      for (int64_t dv = 0; dv < V; ++dv) {
        const __m512i vv = _mm512_load_si512(vp + i * D + 16 * dv);
        for (int64_t g = 0; g < G; ++g)
          acc[g][dv] = _mm512_dpbf16_ps(acc[g][dv], as_bh(vv), as_bh(_mm512_set1_epi32(static_cast<int>(pw[g][i]))));
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < V; ++i) _mm512_storeu_ps(part + g * D + 16 * i, acc[g][i]);
    part[G * D + g] = m[g], part[G * D + G + g] = l[g];
  }
}

using BlocksFn = void (*)(const Args&, int64_t, int64_t, const KeyBlock*, int, const uint32_t*, int64_t, float*);

BlocksFn blocks_function(int64_t V, int64_t G) {
#define PICK(v, g) if (V == v && G == g) return run_blocks<v, g>;
  FOR_FAST_SHAPES(PICK)
#undef PICK
  return run_blocks<0, 0>;
}

void run_item(const Args& a, const Item& it, const int32_t* order, Parts& parts, uint32_t* prep, BlocksFn fn) {
  const int64_t G = a.H / a.KVH, D = a.D, prep_stride = 32 * D, seg_start = it.seg * kSegment;
  const int64_t seg_end = seg_start + kSegment;
  const auto part_of = [&](int64_t r) { return parts.at(r, it.kh, it.seg); };
  for (int32_t j = it.begin; j < it.end; ++j) {
    float* part = part_of(order[j]);
    std::fill(part, part + G * D, 0.f);
    std::fill(part + G * D, part + G * D + G, -std::numeric_limits<float>::infinity());
    std::fill(part + G * D + G, part + G * D + 3 * G, 0.f);
  }
  KeyBlock blocks[kChunkBlocks];
  int count = 0;
  // the shared keys: each chunk of blocks prepared once (through the first row's table), then every row over it
  const int32_t* first_table = a.table + order[it.begin] * a.max_blocks;
  for (int64_t x = seg_start; x < it.shared_end;) {
    const int64_t next = next_blocks(x, it.shared_end, blocks, kChunkBlocks, count);
    for (int c = 0; c < count; ++c)
      prepare(a, first_table, it.kh, blocks[c], prep + c * prep_stride, prep + c * prep_stride + 16 * D);
    prefetch_keys(a, first_table, it.kh, next, std::min<int64_t>(next + kChunkBlocks * kKeys, it.shared_end));
    for (int32_t j = it.begin; j < it.end; ++j) fn(a, order[j], it.kh, blocks, count, prep, prep_stride, part_of(order[j]));
    x = next;
  }
  // each row's own keys after them
  for (int32_t j = it.begin; j < it.end; ++j) {
    const int64_t r = order[j], end = std::min<int64_t>(a.lens[r], seg_end);
    for (int64_t x = it.shared_end; x < end;) {
      const int64_t next = next_blocks(x, end, blocks, kChunkBlocks, count);
      for (int c = 0; c < count; ++c)
        prepare(a, a.table + r * a.max_blocks, it.kh, blocks[c], prep + c * prep_stride, prep + c * prep_stride + 16 * D);
      prefetch_keys(a, a.table + r * a.max_blocks, it.kh, next, std::min<int64_t>(next + kChunkBlocks * kKeys, end));
      fn(a, r, it.kh, blocks, count, prep, prep_stride, part_of(r));
      x = next;
    }
    float* part = part_of(r);
    float row[kMaxVec * 16];
    for (int64_t g = 0; g < G; ++g) {
      float* o = part + g * D;
      for (int64_t d = 0; d < D; ++d) row[d - d % 32 + pair_dim(d % 32)] = o[d];
      std::copy(row, row + D, o);
      if (part[G * D + 2 * G + g] != 0.f)  // a bad row's sum is NaN, so its merged output is NaN
        part[G * D + G + g] = std::numeric_limits<float>::quiet_NaN();
    }
  }
}

void launch(const Args& a, int64_t R) {
  const int64_t G = a.H / a.KVH;
  Parts parts(a, R);
  std::vector<int32_t> order;
  // (make_items, decode_attention_f32.h) a shared range ends at a multiple of kKeys past the segment's start, or
  // at its end: where every row's 32-key blocks end
  const std::vector<Item> items = make_items(a, R, parts.num_segments, 2 * kKeys, [](int64_t same_end, int64_t seg_start, int64_t seg_end) {
    return same_end == seg_end ? seg_end : seg_start + (same_end - seg_start) / kKeys * kKeys;
  }, order);
  const BlocksFn fn = blocks_function(a.D / 16, G);
  std::atomic<int64_t> next{0};  // longest items first, each thread taking the next when done
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    // kChunkBlocks x 32 D dwords, kept per thread across calls (every dword read is written first)
    thread_local std::vector<__m512i> prep;
    if (prep.size() < static_cast<size_t>(kChunkBlocks * 2 * a.D)) prep.resize(kChunkBlocks * 2 * a.D);
    for (int64_t i = next++; i < num_items; i = next++)
      run_item(a, items[i], order.data(), parts, reinterpret_cast<uint32_t*>(prep.data()), fn);
  });
  merge_rows(a, R, parts, [](int64_t n, const auto& f) { at::parallel_for(0, n, 1, f); });
}

}  // namespace bf16dp

#pragma GCC pop_options
#endif  // __AVX512F__

namespace {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                            const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                            double scale, bool allow_bf16) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "q must be contiguous bf16 [R, H, D]");
  TORCH_CHECK(k_slots.dim() == 3 && k_slots.scalar_type() == at::kBFloat16 && k_slots.is_contiguous() &&
              v_slots.sizes() == k_slots.sizes() && v_slots.scalar_type() == at::kBFloat16 && v_slots.is_contiguous(),
              "k_slots and v_slots must be contiguous bf16 [num_slots, KVH, D]");
  TORCH_CHECK(q.is_cpu() && k_slots.is_cpu() && v_slots.is_cpu() && block_table.is_cpu() && context_lens.is_cpu(),
              "paged_decode_attention runs on CPU tensors");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KVH = k_slots.size(1);
  TORCH_CHECK(KVH >= 1 && H >= 1, "num_heads and num_kv_heads must be >= 1");
  TORCH_CHECK(k_slots.size(2) == D && D % 16 == 0 && D <= 16 * kMaxVec, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup, "num_heads must be a multiple of num_kv_heads, <= 16 per kv head");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == R && block_table.scalar_type() == at::kInt &&
              block_table.is_contiguous(), "block_table must be contiguous int32 [R, max_blocks]");
  TORCH_CHECK(context_lens.numel() == R && context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
              "context_lens must be contiguous int32 [R]");
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t num_pool_blocks = k_slots.size(0) / block_size;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= block_table.size(1) * block_size, "context_lens out of the block table's range");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      const int32_t id = table[r * block_table.size(1) + b];
      TORCH_CHECK(id >= 0 && id < num_pool_blocks, "block_table holds a block outside the pool");
    }
  }
  at::Tensor out = at::empty_like(q);
  Args a{q.data_ptr<at::BFloat16>(), k_slots.data_ptr<at::BFloat16>(), v_slots.data_ptr<at::BFloat16>(),
         table, lens, out.data_ptr<at::BFloat16>(), H, KVH, D, block_table.size(1),
         block_size, static_cast<float>(scale)};
  std::vector<uint8_t> is_long, is_short;  // which form each row takes (kBf16MaxContext); sized only for the bf16 form
#if defined(__AVX512F__)
  // the CPU's AVX512-BF16 as PREFIXCACHE_KERNELS caps it (isa_tier.h); the model key names this form (header)
  if (allow_bf16 && __builtin_cpu_supports("avx512bf16") && tier_allows(kTierAvx512Bf16) && D % 32 == 0) {
    is_long.resize(R), is_short.resize(R);
    int64_t num_long = 0;
    for (int64_t r = 0; r < R; ++r) is_long[r] = lens[r] > kBf16MaxContext, is_short[r] = !is_long[r], num_long += is_long[r];
    if (num_long < R) {
      a.skip = num_long > 0 ? is_long.data() : nullptr;
      bf16dp::launch(a, R);
    }
    if (num_long == 0) return out;
    a.skip = is_short.data();  // the long rows: the float32 form below
  }
#else
  (void)allow_bf16;
#endif
  run_float32(a, R, [](int64_t n, const auto& fn) { at::parallel_for(0, n, 1, fn); });
  return out;
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                  const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                                  double scale) {
  return decode_attention(q, k_slots, v_slots, block_table, context_lens, block_size, scale, true);
}

// The float32 form on any CPU (what a CPU without AVX512-BF16 runs): for its tests and side-by-side timing.
at::Tensor paged_decode_attention_float32(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                          const at::Tensor& block_table, const at::Tensor& context_lens,
                                          int64_t block_size, double scale) {
  return decode_attention(q, k_slots, v_slots, block_table, context_lens, block_size, scale, false);
}
