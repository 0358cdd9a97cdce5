// Causal attention of a step's prompt rows straight from the paged KV pool, on AVX512-BF16 dot products.
//
// Each sequence of the step brings tokens num_computed .. num_computed + n - 1 (a prefill chunk after
// its cached prefix, or one decode token); the token at position t attends to keys 0 .. t of its
// sequence, found through its block table (slot = block * block_size + offset). A work item is one
// sequence, one KV head and up to 48 rows (token, query head of that KV head), laid across the lanes
// of up to three 16-lane vectors: scores, softmax and output are computed for 16 rows per instruction,
// over keys taken in blocks of 32 at fixed positions (0-31, 32-63, ...):
//   s = (q . k) * (scale log2(e))   q . k by vdpbf16ps over head_dim pairs in order (bf16 q and k, float32 sums)
//   m' = max(m, max_j s_j), alpha = 2^(m - m'), p_j = 2^(s_j - m'), l = alpha l + sum_j p_j (key order)
//   o = alpha o + sum_j bf16(p_j) v_j     by vdpbf16ps over key pairs (2i, 2i + 1) in order
// (the softmax in base 2 with log2(e) folded into the scale, as FlashAttention-2's kernels do; 2^x by
// exp2_512: 2^n times a degree-5 polynomial of the rest, ~3e-6 relative)
// (the online softmax of Milakov & Gimelshein 2018 as FlashAttention-2 uses it, Dao 2023; p in bf16
// for the second product as torch's CPU flash-attention kernel does), and out = bf16(o / l).
// Keys after a row's own position are masked to p = 0 (their product adds exact zeros while V is
// finite); a block past every key of a row leaves it unchanged (alpha = e^0 = 1), so it may be skipped
// or not. A NaN or +inf score at a visible key makes the row NaN (in the AMX form below, -inf as well). (An Inf/NaN in V after a row's
// position can still reach it as 0 * inf when another row of its work item sees that key: a model
// whose K/V overflow has already failed; torch's flash kernel does the same.)
//
// Batch invariance (finite K/V): every operation on a row's lane depends only on its own query, its keys and values
// at their absolute positions, the head shape and scale, never on the other rows of its vectors, the
// tiling of its sequence's tokens, the cached/new split, or the thread that runs it: a row gets the same
// bits in a prefill of any length after any cached prefix, in a decode, and in any batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512.h"
#include "isa_tier.h"
#include "prefill_attention_common.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,fma")

namespace {

constexpr int kKeys = 32;        // keys per softmax block, at absolute positions kKeys * i
constexpr int kLanes = 16;       // rows per vector
constexpr int kMaxVecs = 3;      // rows per work item: up to 48
constexpr int kMaxDim = 256;     // head_dim <= 256, a multiple of 32
constexpr int kDimChunk = 8;     // output dims per register block of the second product
static_assert(kMaxVecs * kLanes == prefill_attention::kMaxRows && kMaxDim == prefill_attention::kMaxDim);

using prefill_attention::Args;
using prefill_attention::Work;

struct Buffers {  // one work item's state, float32 unless said
  alignas(64) uint32_t qp[kMaxDim / 2][kMaxVecs * kLanes];  // q pairs by (dim pair, row)
  alignas(64) float s[kKeys][kMaxVecs * kLanes];            // scores by (key, row)
  alignas(64) uint32_t pp[kKeys / 2][kMaxVecs * kLanes];    // bf16 p pairs by (key pair, row)
  alignas(64) uint32_t vp[kKeys / 2][kMaxDim];              // bf16 v pairs by (key pair, dim)
  alignas(64) float o[kMaxDim][kMaxVecs * kLanes];          // unnormalized output by (dim, row)
};

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// 2^x for x <= 0 (x below -126, -inf and NaN give 2^-126, ~1e-38, where e^x gave e^-87 before; the caller
// masks the lanes of masked keys, s = -inf, to 0): n = round(x),
// f = x - n in [-0.5, 0.5], 2^f by its Taylor polynomial of degree 5 in f ln2 (relative error < 3e-6), then
// scaled by 2^n (vscalefps).
inline __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));  // a NaN x (-inf - -inf) gives -126: max returns its second operand
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Scores of keys j0 .. j0 + 7 of the block (kw: their K rows as dim pairs) for the NV row vectors from
// `base`: s = (q . k) * scale, -inf where the key lies after the row's position.
template <int NV>
void score_keys(Buffers& buf, int64_t base, const uint32_t* const* kw, int64_t P, const __m512i* pos,
                int64_t key0, int64_t j0, __m512 scale) {
  __m512 acc[8][NV];
  for (int j = 0; j < 8; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512i qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_si512(&buf.qp[p][base + v * kLanes]);
    for (int j = 0; j < 8; ++j) {
      const __m512i kb = _mm512_set1_epi32(static_cast<int>(kw[j][p]));
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], as_bh(qv[v]), as_bh(kb));
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < 8; ++j) {
    const __m512i key = _mm512_set1_epi32(static_cast<int>(key0 + j0 + j));
    for (int v = 0; v < NV; ++v)
      _mm512_store_ps(&buf.s[j0 + j][base + v * kLanes],
                      _mm512_mask_mov_ps(neg_inf, _mm512_cmpge_epi32_mask(pos[v], key), _mm512_mul_ps(acc[j][v], scale)));
  }
}

// o = alpha o + p v for the NV row vectors from `base`, over key pairs 0 .. num_pairs - 1 of the block:
// kDimChunk dims x NV row vectors per register block.
template <int NV>
void add_values(Buffers& buf, int64_t base, int64_t D, int64_t num_pairs, const __m512* alpha) {
  bool rescale = false;  // alpha = 1 in every lane (no new maximum): o * 1 = o, the products skipped
  for (int v = 0; v < NV; ++v) rescale |= _mm512_cmp_ps_mask(alpha[v], _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0;
  for (int64_t d0 = 0; d0 < D; d0 += kDimChunk) {
    __m512 acc[kDimChunk][NV];
    for (int d = 0; d < kDimChunk; ++d)
      for (int v = 0; v < NV; ++v) {
        acc[d][v] = _mm512_load_ps(&buf.o[d0 + d][base + v * kLanes]);
        if (rescale) acc[d][v] = _mm512_mul_ps(acc[d][v], alpha[v]);
      }
    for (int64_t i = 0; i < num_pairs; ++i) {
      __m512i pv[NV];
      for (int v = 0; v < NV; ++v) pv[v] = _mm512_load_si512(&buf.pp[i][base + v * kLanes]);
      for (int d = 0; d < kDimChunk; ++d) {
        const __m512i vb = _mm512_set1_epi32(static_cast<int>(buf.vp[i][d0 + d]));
        for (int v = 0; v < NV; ++v) acc[d][v] = _mm512_dpbf16_ps(acc[d][v], as_bh(pv[v]), as_bh(vb));
      }
    }
    for (int d = 0; d < kDimChunk; ++d)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(&buf.o[d0 + d][base + v * kLanes], acc[d][v]);
  }
}

template <int NV>  // all of a block's scores, 8 keys at a time
void block_scores(Buffers& buf, int v0, const uint32_t* const* kw, int64_t P, const __m512i* pos, int64_t key0,
                  __m512 scale) {
  for (int64_t j0 = 0; j0 < kKeys; j0 += 8) score_keys<NV>(buf, v0 * kLanes, kw + j0, P, pos + v0, key0, j0, scale);
}

// Softmax of the block for row vector v: running max m and sum l, bf16 p pairs; returns alpha. `bad`
// collects the lanes with a NaN or +inf score at a visible key (masked keys are -inf): their output is
// NaN, as float attention's would be, in every tiling.
inline __m512 softmax_block(Buffers& buf, int64_t base, int64_t nk, __m512& m, __m512& l, __mmask16& bad,
                            __m512i pair_idx) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 pos_inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 mb = neg_inf;
  for (int64_t j = 0; j < nk; ++j) {
    const __m512 sj = _mm512_load_ps(&buf.s[j][base]);
    bad |= _mm512_cmp_ps_mask(sj, sj, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(sj, pos_inf, _CMP_EQ_OQ);
    mb = _mm512_max_ps(mb, sj);
  }
  const __m512 m_new = _mm512_max_ps(m, mb);
  const __m512 alpha = exp2_512(_mm512_sub_ps(m, m_new));  // m = -inf (first block): 2^-126, times o = l = 0
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kKeys; j += 2) {
    __m512 pj[2];
    for (int t = 0; t < 2; ++t) {
      const __m512 sj = _mm512_load_ps(&buf.s[j + t][base]);
      pj[t] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sj, neg_inf, _CMP_NEQ_OQ), exp2_512(_mm512_sub_ps(sj, m_new)));
      if (j + t < nk) sum = _mm512_add_ps(sum, pj[t]);
    }
    __m512bh both = _mm512_cvtne2ps_pbh(pj[1], pj[0]);  // words 0-15: even keys, 16-31: odd keys
    _mm512_store_si512(&buf.pp[j / 2][base], _mm512_permutexvar_epi16(pair_idx, reinterpret_cast<__m512i&>(both)));
  }
  l = _mm512_add_ps(_mm512_mul_ps(l, alpha), sum);
  m = m_new;
  return alpha;
}

struct ItemRows {
  int RV;                 // row vectors of 16
  int64_t num_keys;       // the last row's position + 1
  alignas(64) int32_t pos_rows[kMaxVecs * kLanes];  // each row's position
};

// Rows of item w: tokens w.begin .. w.end - 1, each with G query heads (row = token * G + g), padded to
// RV vectors of 16 with copies of the last row: their positions, q pairs into buf.qp, o zeroed.
ItemRows item_rows(const Args& a, const Work& w, Buffers& buf) {
  const int64_t D = a.D, G = a.G, P = D / 2, num_rows = (w.end - w.begin) * G;
  ItemRows rows;
  rows.RV = static_cast<int>((num_rows + kLanes - 1) / kLanes);
  const int64_t first_pos = a.num_computed[w.seq] + (w.begin - a.query_start[w.seq]);
  rows.num_keys = first_pos + (w.end - w.begin);
  for (int64_t r = 0; r < rows.RV * kLanes; ++r) {
    const int64_t rr = std::min(r, num_rows - 1);
    rows.pos_rows[r] = static_cast<int32_t>(first_pos + rr / G);
    const uint32_t* qrow = reinterpret_cast<const uint32_t*>(a.q_as<at::BFloat16>() + ((w.begin + rr / G) * a.H + w.kh * G + rr % G) * D);
    for (int64_t p = 0; p < P; ++p) buf.qp[p][r] = qrow[p];
  }
  for (int64_t d = 0; d < D; ++d)
    for (int v = 0; v < rows.RV; ++v) _mm512_store_ps(&buf.o[d][v * kLanes], _mm512_setzero_ps());
  return rows;
}

// out = bf16(o / l) for the item's rows (NaN for the rows in `bad`).
void store_rows(const Args& a, const Work& w, const Buffers& buf, int RV, const __m512* l, const __mmask16* bad) {
  const int64_t D = a.D, G = a.G, num_rows = (w.end - w.begin) * G;
  alignas(64) float inv_l[kMaxVecs * kLanes], row[kMaxDim];
  for (int v = 0; v < RV; ++v)
    _mm512_store_ps(inv_l + v * kLanes, _mm512_mask_mov_ps(_mm512_div_ps(_mm512_set1_ps(1.f), l[v]), bad[v],
                                                           _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t d = 0; d < D; ++d) row[d] = buf.o[d][r];
    at::BFloat16* orow = a.out_as<at::BFloat16>() + ((w.begin + r / G) * a.H + w.kh * G + r % G) * D;
    const __m512 inv = _mm512_set1_ps(inv_l[r]);
    for (int64_t d = 0; d < D; d += 16) store_bf16(orow + d, _mm512_mul_ps(_mm512_load_ps(row + d), inv));
  }
}

// Attention of item w's rows (item_rows) over their keys, on AVX512-BF16 dot products.
void attend_item(const Args& a, const Work& w, Buffers& buf) {
  const int64_t D = a.D, P = D / 2;
  const ItemRows rows = item_rows(a, w, buf);
  const int RV = rows.RV;
  const int64_t num_keys = rows.num_keys;  // the last row's position + 1
  const int32_t* pos_rows = rows.pos_rows;
  __m512i pos[kMaxVecs];
  __m512 m[kMaxVecs], l[kMaxVecs], alpha[kMaxVecs];
  __mmask16 bad[kMaxVecs] = {};
  for (int v = 0; v < RV; ++v) {
    pos[v] = _mm512_load_si512(pos_rows + v * kLanes);
    m[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[v] = _mm512_setzero_ps();
  }
  const __m512 scale = _mm512_set1_ps(a.scale * 1.44269504088896341f);  // scores in base 2: * log2(e)
  const int64_t row_stride = a.KVH * D;
  const int32_t* table = a.table + w.seq * a.max_blocks;
  // vpermt2w indices: dword i of the result = (word i of x, word i of y), for dims 0-15 / 16-31 of 32
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i, hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  // vpermw indices: dword i = (word i, word 16 + i), the even and odd keys' p from cvtne2ps's [even | odd]
  alignas(64) int16_t p_idx[32];
  for (int i = 0; i < 16; ++i) p_idx[2 * i] = i, p_idx[2 * i + 1] = 16 + i;
  const __m512i pair_idx = _mm512_load_si512(p_idx);

  for (int64_t k0 = 0; k0 < num_keys; k0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, num_keys - k0);
    int v0 = 0;  // vectors whose rows all sit before this block skip it (no change, see the header)
    while (v0 < RV && pos_rows[v0 * kLanes + kLanes - 1] < k0) ++v0;
    const uint32_t* kw[kKeys];
    const at::BFloat16* vrow[kKeys];
    for (int64_t j = 0, block = k0 / a.block_size, offset = k0 % a.block_size; j < kKeys; ++j) {
      if (j < nk) {  // keys past num_keys: the last valid one again, masked
        const int64_t slot = static_cast<int64_t>(table[block]) * a.block_size + offset;
        kw[j] = reinterpret_cast<const uint32_t*>(a.k_as<at::BFloat16>() + slot * row_stride + w.kh * D);
        vrow[j] = a.v_as<at::BFloat16>() + slot * row_stride + w.kh * D;
        if (++offset == a.block_size) offset = 0, ++block;
      } else {
        kw[j] = kw[nk - 1], vrow[j] = vrow[nk - 1];
      }
    }
    // the next block's K and V rows asked for now, read by the time this block's products are done
    // (a long context's K/V is out of L2: each work item streams all of it)
    prefetch_kv_rows(a.k_as<at::BFloat16>(), a.v_as<at::BFloat16>(), table, a.block_size, row_stride, w.kh * D,
                     2 * D, k0 + kKeys, std::min<int64_t>(k0 + 2 * kKeys, num_keys));
    if (RV - v0 == 3) block_scores<3>(buf, v0, kw, P, pos, k0, scale);
    else if (RV - v0 == 2) block_scores<2>(buf, v0, kw, P, pos, k0, scale);
    else block_scores<1>(buf, v0, kw, P, pos, k0, scale);
    for (int v = v0; v < RV; ++v) alpha[v] = softmax_block(buf, v * kLanes, nk, m[v], l[v], bad[v], pair_idx);
    // v pairs: dword d of vp[i] = (v_{2i}[d], v_{2i+1}[d])
    for (int64_t i = 0; i < kKeys / 2; ++i) {
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const __m512i x = _mm512_loadu_si512(vrow[2 * i] + d0);
        const __m512i y = 2 * i + 1 < nk ? _mm512_loadu_si512(vrow[2 * i + 1] + d0) : _mm512_setzero_si512();
        _mm512_store_si512(&buf.vp[i][d0], _mm512_permutex2var_epi16(x, lo, y));
        _mm512_store_si512(&buf.vp[i][d0 + 16], _mm512_permutex2var_epi16(x, hi, y));
      }
    }
    const int64_t num_pairs = (nk + 1) / 2;
    if (RV - v0 == 3) add_values<3>(buf, v0 * kLanes, D, num_pairs, alpha + v0);
    else if (RV - v0 == 2) add_values<2>(buf, v0 * kLanes, D, num_pairs, alpha + v0);
    else add_values<1>(buf, v0 * kLanes, D, num_pairs, alpha + v0);
  }
  store_rows(a, w, buf, RV, l, bad);
}

}  // namespace

#pragma GCC pop_options

// ---- The same attention on AMX tiles (Intel Sapphire Rapids and later) ----------------------------------
// Per key block and 16-row vector, the two products run as tile products (TDPBF16PS: C[16 x 16] fp32 +=
// A[16 x 32] bf16 . B[32 x 16] bf16 in pairs):
//   scores, transposed:  s^T[key][row] = K[key][:] . q[row][:]   A = 16 K rows straight from the pool
//                        (or copied, where 16 keys are not one pool block), B = the q pairs (qp)
//   output, transposed:  o^T[dim][row] = alpha o^T + V^T[dim][keys] . p^T[keys][row]   A = V^T (the v pairs
//                        transposed), B = the bf16 p pairs (pp)
// Between them the softmax is softmax_block_amx: the same online softmax in base 2 with fewer instructions
// (the max taken on the raw sums, p = 2^(s scale - m) by exp2_floor_512; a -inf score at a visible key
// makes its row NaN too, like NaN and +inf). A tile product's element depends only on its A row, its B
// column and its C value (the instruction's own sum order, fixed), so a row's bits depend only on its
// query, keys and values, as above; they differ from the AVX-512 form's (a different sum order and 2^x),
// so the cache key names the form (layers/attention/numerics.py, kv_numerics).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512bf16,fma")

namespace {

// Tiles 0-7, each 16 rows x 64 bytes (load_tile_config_16x64): 0, 6, 7 scores (C), 1 K (A), 2 q pairs (B),
// 3 output (C), 4 V^T (A), 5 p pairs (B).
struct AmxBuffers {
  alignas(64) uint32_t vt[kMaxDim][kKeys / 2];  // V^T: dword i of row d = (v_{2i}[d], v_{2i+1}[d])
  alignas(64) at::BFloat16 kc[kLanes][kMaxDim];  // 16 K rows copied, where they are not one pool block's
};

// rows[0..15] (16 dwords each) transposed in place: rows[n][i] = old rows[i][n]
inline void transpose_16x16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i)
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]), a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  for (int i = 0; i < 4; ++i) {  // b[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]), b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44), s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88), r[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88), r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// 2^x for the AMX form's p (x <= 0, finite): f = x - floor(x) in [0, 1) (vreduceps, exact), 2^f by a
// degree-4 polynomial fitted to the relative error on [0, 1] (< 3e-6, as exp2_512's), scaled by 2^floor(x)
// (vscalefps floors its exponent operand itself). Six instructions where exp2_512 takes nine; x = -inf or
// NaN gives NaN (the softmax below makes such a row NaN anyway, or masks the lane).
inline __m512 exp2_floor_512(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, 0x09);  // rounding down, precision exception suppressed
  __m512 p = _mm512_set1_ps(1.3426804915e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2242279053e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4128030241e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9304484129e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, x);
}

// The AMX form's softmax of one block for one row vector, on the tile products' raw sums q . k (buf.s):
//   m' = max(m, scale * max_j visible s_j)   (scale > 0: the max of the scaled scores, bit for bit)
//   p_j = 2^(s_j * scale - m') (exp2_floor_512; s_j * scale rounded to float32 first, so the exponent is
//   <= 0 and exactly 0 at the max whatever the scores' size), 0 at masked keys; l = alpha l + sum_j p_j
// A first pass reads s for the max and the checks only (no store): a NaN or infinite score at a visible key
// marks its row bad (its output NaN, in every tiling). Masked keys (after a row's position, or past nk) are
// left out of the max by mask and set to p = 0, only in a block that reaches past some row's position.
inline __m512 softmax_block_amx(Buffers& buf, int64_t base, int64_t nk, __m512& m, __m512& l, __mmask16& bad,
                                __m512i pair_idx, __m512 scale, __m512i pos, int64_t key0) {
  const bool masked = nk < kKeys || _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(key0 + nk - 1))) != 0;
  const auto visible = [&](int64_t j) { return _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(key0 + j))); };
  __m512 mb = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  if (masked) {
    for (int64_t j = 0; j < nk; ++j) {
      const __m512 sj = _mm512_load_ps(&buf.s[j][base]);
      const __mmask16 vis = visible(j);
      bad |= _mm512_mask_fpclass_ps_mask(vis, sj, 0x99);  // QNaN, +inf, -inf, SNaN
      mb = _mm512_mask_max_ps(mb, vis, mb, sj);
    }
  } else {
    for (int64_t j = 0; j < kKeys; ++j) {
      const __m512 sj = _mm512_load_ps(&buf.s[j][base]);
      bad |= _mm512_fpclass_ps_mask(sj, 0x99);
      mb = _mm512_max_ps(mb, sj);
    }
  }
  const __m512 m_new = _mm512_max_ps(m, _mm512_mul_ps(mb, scale));
  const __m512 alpha = exp2_512(_mm512_sub_ps(m, m_new));  // m = -inf (first block): 2^-126, times o = l = 0
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kKeys; j += 2) {
    __m512 pj[2];
    for (int t = 0; t < 2; ++t) {
      if (j + t < nk) {
        // the product by vmulps with its rounding spelled out: GCC contracts a plain _mm512_mul_ps feeding
        // a subtraction into one fma (-ffp-contract=fast), whose unrounded product broke p = 1 at the max
        const __m512 sj = _mm512_mul_round_ps(_mm512_load_ps(&buf.s[j + t][base]), scale,
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        pj[t] = exp2_floor_512(_mm512_sub_ps(sj, m_new));
        if (masked) pj[t] = _mm512_maskz_mov_ps(visible(j + t), pj[t]);
        sum = _mm512_add_ps(sum, pj[t]);
      } else {
        pj[t] = _mm512_setzero_ps();
      }
    }
    __m512bh both = _mm512_cvtne2ps_pbh(pj[1], pj[0]);
    _mm512_store_si512(&buf.pp[j / 2][base], _mm512_permutexvar_epi16(pair_idx, reinterpret_cast<__m512i&>(both)));
  }
  l = _mm512_add_ps(_mm512_mul_ps(l, alpha), sum);
  m = m_new;
  return alpha;
}

// s^T of the block's keys (krow: their K rows) for row vectors v0 .. RV - 1 into buf.s, by halves of 16 keys
// that hold a key (a half past nk is masked by the softmax whatever s holds): one K tile per 32 dims for every
// row vector, the scores in tiles 0, 6, 7.
void scores_amx(Buffers& buf, AmxBuffers& ab, const at::BFloat16* const* krow, int64_t nk, int64_t D, int v0, int RV,
                int64_t row_bytes, bool whole_halves) {
  constexpr int64_t kRowsBytes = kMaxVecs * kLanes * 4;  // one (key or pair or dim) row of s, qp, pp, o
  const int nv = RV - v0;
  for (int64_t h = 0; h < kKeys && h < nk; h += kLanes) {
    const at::BFloat16* kbase = krow[h];
    int64_t kstride = row_bytes;
    if (!whole_halves) {  // the half's rows copied together (keys past nk: the last one again, masked)
      for (int64_t j = 0; j < kLanes; ++j) std::memcpy(ab.kc[j], krow[h + j], D * sizeof(at::BFloat16));
      kbase = ab.kc[0], kstride = kMaxDim * sizeof(at::BFloat16);
    }
    AMX_TILE_ZERO(0);
    if (nv > 1) AMX_TILE_ZERO(6);
    if (nv > 2) AMX_TILE_ZERO(7);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      AMX_TILE_LOAD(1, kbase + d0, kstride);
      AMX_TILE_LOAD(2, &buf.qp[d0 / 2][v0 * kLanes], kRowsBytes);
      AMX_TILE_DPBF16PS(0, 1, 2);
      if (nv > 1) {
        AMX_TILE_LOAD(2, &buf.qp[d0 / 2][(v0 + 1) * kLanes], kRowsBytes);
        AMX_TILE_DPBF16PS(6, 1, 2);
      }
      if (nv > 2) {
        AMX_TILE_LOAD(2, &buf.qp[d0 / 2][(v0 + 2) * kLanes], kRowsBytes);
        AMX_TILE_DPBF16PS(7, 1, 2);
      }
    }
    AMX_TILE_STORE(0, &buf.s[h][v0 * kLanes], kRowsBytes);
    if (nv > 1) AMX_TILE_STORE(6, &buf.s[h][(v0 + 1) * kLanes], kRowsBytes);
    if (nv > 2) AMX_TILE_STORE(7, &buf.s[h][(v0 + 2) * kLanes], kRowsBytes);
  }
}

// V^T of the block (vrow: its keys' V rows) into ab.vt: dword i of row d = (v_{2i}[d], v_{2i+1}[d]); keys from
// nk on read as zero V (the tile product multiplies every key: p = 0 times a copied inf would be NaN).
void transposed_values(AmxBuffers& ab, const at::BFloat16* const* vrow, int64_t nk, int64_t D, __m512i lo, __m512i hi) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m512i x_lo[16], x_hi[16];
    for (int64_t i = 0; i < kKeys / 2; ++i) {
      const __m512i x = 2 * i < nk ? _mm512_loadu_si512(vrow[2 * i] + d0) : _mm512_setzero_si512();
      const __m512i y = 2 * i + 1 < nk ? _mm512_loadu_si512(vrow[2 * i + 1] + d0) : _mm512_setzero_si512();
      x_lo[i] = _mm512_permutex2var_epi16(x, lo, y), x_hi[i] = _mm512_permutex2var_epi16(x, hi, y);
    }
    transpose_16x16(x_lo), transpose_16x16(x_hi);  // rows of key pairs -> rows of dims
    for (int n = 0; n < 16; ++n) {
      _mm512_store_si512(ab.vt[d0 + n], x_lo[n]);
      _mm512_store_si512(ab.vt[d0 + 16 + n], x_hi[n]);
    }
  }
}

// o^T = alpha o^T + V^T . p^T for row vectors v0 .. RV - 1 (tiles 3: o, 4: V^T, 5: p pairs).
void add_values_amx(Buffers& buf, const AmxBuffers& ab, int v0, int RV, int64_t D, const __m512* alpha) {
  constexpr int64_t kRowsBytes = kMaxVecs * kLanes * 4;
  for (int v = v0; v < RV; ++v) {
    if (_mm512_cmp_ps_mask(alpha[v], _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0)  // o * 1 = o: skipped
      for (int64_t d = 0; d < D; ++d)
        _mm512_store_ps(&buf.o[d][v * kLanes], _mm512_mul_ps(_mm512_load_ps(&buf.o[d][v * kLanes]), alpha[v]));
    AMX_TILE_LOAD(5, &buf.pp[0][v * kLanes], kRowsBytes);
    for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
      AMX_TILE_LOAD(3, &buf.o[d0][v * kLanes], kRowsBytes);
      AMX_TILE_LOAD(4, ab.vt[d0], kKeys / 2 * 4);
      AMX_TILE_DPBF16PS(3, 4, 5);
      AMX_TILE_STORE(3, &buf.o[d0][v * kLanes], kRowsBytes);
    }
  }
}

// attend_item's loop with the products on tiles (the tile configuration is loaded by the caller's thread).
void attend_item_amx(const Args& a, const Work& w, Buffers& buf, AmxBuffers& ab) {
  const int64_t D = a.D, P = D / 2;
  const ItemRows rows = item_rows(a, w, buf);
  const int RV = rows.RV;
  const int64_t num_keys = rows.num_keys;  // the last row's position + 1
  const int32_t* pos_rows = rows.pos_rows;
  __m512i pos[kMaxVecs];
  __m512 m[kMaxVecs], l[kMaxVecs], alpha[kMaxVecs];
  __mmask16 bad[kMaxVecs] = {};
  for (int v = 0; v < RV; ++v) {
    pos[v] = _mm512_load_si512(pos_rows + v * kLanes);
    m[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[v] = _mm512_setzero_ps();
  }
  const __m512 scale = _mm512_set1_ps(a.scale * 1.44269504088896341f);
  const int64_t row_stride = a.KVH * D, row_bytes = row_stride * static_cast<int64_t>(sizeof(at::BFloat16));
  const bool whole_halves = a.block_size % kLanes == 0;  // 16 keys at 16 i are one pool block's rows
  const int32_t* table = a.table + w.seq * a.max_blocks;
  alignas(64) int16_t lo_idx[32], hi_idx[32], p_idx[32];
  for (int i = 0; i < 16; ++i) lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i, hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
  for (int i = 0; i < 16; ++i) p_idx[2 * i] = i, p_idx[2 * i + 1] = 16 + i;
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx), pair_idx = _mm512_load_si512(p_idx);

  for (int64_t k0 = 0; k0 < num_keys; k0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, num_keys - k0);
    int v0 = 0;  // vectors whose rows all sit before this block skip it
    while (v0 < RV && pos_rows[v0 * kLanes + kLanes - 1] < k0) ++v0;
    const at::BFloat16* krow[kKeys];
    const at::BFloat16* vrow[kKeys];
    for (int64_t j = 0, block = k0 / a.block_size, offset = k0 % a.block_size; j < kKeys; ++j) {
      if (j < nk) {
        const int64_t slot = static_cast<int64_t>(table[block]) * a.block_size + offset;
        krow[j] = a.k_as<at::BFloat16>() + slot * row_stride + w.kh * D;
        vrow[j] = a.v_as<at::BFloat16>() + slot * row_stride + w.kh * D;
        if (++offset == a.block_size) offset = 0, ++block;
      } else {
        krow[j] = krow[nk - 1], vrow[j] = vrow[nk - 1];
      }
    }
    prefetch_kv_rows(a.k_as<at::BFloat16>(), a.v_as<at::BFloat16>(), table, a.block_size, row_stride, w.kh * D,
                     2 * D, k0 + kKeys, std::min<int64_t>(k0 + 2 * kKeys, num_keys));
    scores_amx(buf, ab, krow, nk, D, v0, RV, row_bytes, whole_halves);
    for (int v = v0; v < RV; ++v)
      alpha[v] = softmax_block_amx(buf, v * kLanes, nk, m[v], l[v], bad[v], pair_idx, scale, pos[v], k0);
    transposed_values(ab, vrow, nk, D, lo, hi);
    add_values_amx(buf, ab, v0, RV, D, alpha);
  }
  store_rows(a, w, buf, RV, l, bad);
}

void run_items_amx(const Args& a, const Work* work, std::atomic<int64_t>& next, int64_t num_items) {
  load_tile_config_16x64(8);
  auto buf = std::make_unique<Buffers>();
  auto ab = std::make_unique<AmxBuffers>();
  for (int64_t i = next++; i < num_items; i = next++) attend_item_amx(a, work[i], *buf, *ab);
  release_tile_config();
}

}  // namespace

#pragma GCC pop_options

// Whether this CPU and kernel run AMX-BF16 tiles: CPUID leaf 7's AMX-TILE and AMX-BF16 bits, and Linux's
// permission for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process; Linux 5.16+).
bool amx_bf16_ready() {
  static const bool ready = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_tile = (edx >> 24) & 1, amx_bf16 = (edx >> 22) & 1;
    if (!amx_tile || !amx_bf16 || !__builtin_cpu_supports("avx512bf16") || !tier_allows(kTierAmx)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Checked and launched without the avx512bf16 target (the CPU is checked first).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                   const at::Tensor& block_table, const at::Tensor& query_start,
                                   const at::Tensor& num_computed, int64_t block_size, double scale, bool amx) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16") && tier_allows(kTierAvx512Bf16),
              "paged_prefill_attention needs a CPU with AVX512-BF16 (and PREFIXCACHE_KERNELS allowing it)");
  TORCH_CHECK(!amx || amx_bf16_ready(), "paged_prefill_attention(amx=True) needs AMX-BF16 tiles (amx_bf16_ready())");
  at::Tensor out;
  Args a;
  const std::vector<Work> work = prefill_attention::plan_work("paged_prefill_attention", q, k_slots, v_slots,
                                                              block_table, query_start, num_computed, block_size,
                                                              scale, /*window=*/0, /*float32_ok=*/false, out, a,
                                                              kLanes);
  const Work* items = work.data();
  prefill_attention::run_work(work, [&](std::atomic<int64_t>& next, int64_t num_items) {
    if (amx) return run_items_amx(a, items, next, num_items);
    auto buf = std::make_unique<Buffers>();
    for (int64_t i = next++; i < num_items; i = next++) attend_item(a, items[i], *buf);
  });
  return out;
}
