// Causal attention of a step's prompt rows straight from the paged KV pool, in float32 on AVX2 + FMA: the form
// of prefill_attention.cpp's kernel for CPUs without AVX512-BF16 (AMD Zen 2 and 3, Intel client cores from
// Alder Lake on, older Xeons), built into the AVX2 extension (avx2_kernels.py: -mavx2 -mfma -mf16c).
//
// The same work items (prefill_attention_common.h) and key blocks of 32 at fixed positions (0-31, 32-63, ...) as
// the AVX512-BF16 form; rows (token, query head of one KV head) lie across the 8 lanes of up to six vectors. The
// bf16 q, K and V are widened to float32 (exact) and every product is a float32 FMA:
//   s = (sum_d q_d k_d) * (scale log2(e))      one FMA per dim, in dim order
//   m' = max(m, max_j s_j), alpha = 2^(m - m'), p_j = 2^(s_j - m'), l = alpha l + sum_j p_j (key order)
//   o = alpha o + sum_j p_j v_j                one FMA per key, in key order; p stays float32
//   out = bf16(o * (1 / l))
// Two things only this form takes, so a float32 model (float32 + int8) and a model with sliding-window layers run it
// wherever torch's padded flash path gives a row other bits by batch (MKL's AVX2 path; models/llama.py, gemma3.py):
// - a float32 pool and q: the same arithmetic with nothing to widen, out = o * (1 / l) in float32;
// - a sliding window (window > 0): a row at position p masks keys before p - window + 1 as it masks keys after
//   p. An item's key blocks start at the one holding its first row's first key; keys of that block before it
//   are not read (zero K and V, masked): a sliding KV-cache group may have released their blocks
//   (layers/grouped_attention.py).
// 2^x by exp2_8: 2^n times the AVX-512 form's degree-5 polynomial of the rest. Masked keys, NaN or +inf scores
// and skipped blocks behave as that form's header says. No AVX2 instruction sums bf16 pairs as vdpbf16ps does,
// so the sums run in another order and the bits differ from the AVX-512 form's: the cache key names the form
// (layers/attention/numerics.py).
//
// Int8 products (int8 = true, the "avx2-int8" form a model runs with attention_dtype "int8"): q, K, p and V rounded
// to int8, each with a scale fixed by its own values, and both products as vpmaddubsw integer sums (the section
// "the int8 form" below says how); K and V rounded once per call for every item (QuantizedKV). The softmax, l and
// the output stay as above.
//
// Batch invariance, as in the AVX-512 form: every operation on a row's lane depends only on its own query, its
// keys and values at their absolute positions, the head shape, the scale and the window, so a row gets the same
// bits in a prefill of any length after any cached prefix, in a decode and in any batch (int8: every scale is a
// row's own, w's a row's own over its visible keys of one fixed 32-key block). Which blocks an item
// reads depends on its other rows; a block wholly masked for a row changes nothing in its lane: its scores are
// -inf, so m stays, alpha = 2^0 = 1 exactly, p = 0 and o + 0 v = o (K/V in the pool are finite), and before the
// row's first visible key its state stays o = l = 0.
#include <torch/extension.h>
#include <immintrin.h>

#include "isa_tier.h"
#include "prefetch.h"
#include "prefill_attention_common.h"
#include "vec16.h"  // its AVX2 form in this build: load_bf16_8, v16_store_bf16's rounding

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

namespace {

using prefill_attention::Args;
using prefill_attention::Work;

constexpr int kKeys = 32;      // keys per softmax block, at absolute positions kKeys * i
constexpr int kLanes = 8;      // rows per vector
constexpr int kMaxVecs = 6;    // rows per work item: up to 48
constexpr int kRows = kMaxVecs * kLanes;
constexpr int kMaxDim = 256;
constexpr int kKeyGroup = 4;   // keys per register block of the scores (4 keys x 3 row vectors of sums)
constexpr int kDimChunk = 4;   // output dims per register block of the second product
constexpr int kMaxBlockVecs = 3;  // row vectors per register block: 12 sums + 3 operands + 1 broadcast = 16 ymm
static_assert(kRows == prefill_attention::kMaxRows && kMaxDim == prefill_attention::kMaxDim);

struct Buffers {  // one work item's state, float32
  alignas(32) float q[kMaxDim][kRows];  // q by (dim, row)
  alignas(32) float s[kKeys][kRows];    // scores, then p, by (key, row)
  alignas(32) float k[kKeys][kMaxDim];  // the block's K rows (rows past its keys zero)
  alignas(32) float v[kKeys][kMaxDim];  // its V rows
  alignas(32) float o[kMaxDim][kRows];  // unnormalized output by (dim, row)
  alignas(32) int32_t pos[kRows];       // each row's position
  // the int8 form's operands (Int8 below): 4 int8 values per int32, the byte order of dims or keys
  alignas(32) int32_t q8[kMaxDim / 4][kRows];  // q in [-63, 63] by (dims 4i .. 4i + 3, row)
  alignas(32) float q_scale[kRows];            // its scale, times the softmax scale and log2(e)
  alignas(32) int32_t q_corr[kRows];           // 128 * (sum of the row's q8): K is stored as k8 + 128
  const uint8_t* k8;                           // the block's K rows in QuantizedKV: k8 + 128 by (key, dim)
  const int8_t* v8;                            // its V rows there: v8 by (keys 4g .. 4g + 3, dim, key)
  alignas(32) float k_scale[kKeys];            // their scales, 0 for keys the item doesn't read
  alignas(32) float v_scale[kKeys];
  alignas(32) int32_t w8[kKeys / 4][kRows];    // p * v_scale in [0, 127] by (keys 4g .. 4g + 3, row)
};

// 2^x for x <= 0, as the AVX-512 form's exp2_512: x below -126, -inf and NaN give 2^-126; n = round(x),
// f = x - n in [-0.5, 0.5], 2^f by its Taylor polynomial of degree 5 in f ln2, times 2^n built from its
// exponent bits (n in [-126, 0], a normal float, so the product is one rounding, as vscalefps makes).
inline __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));  // a NaN x gives -126: max returns its second operand
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.3333558146e-3f);                  // ln2^5 / 120
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076e-3f));  // ln2^4 / 24
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108665e-2f));  // ln2^3 / 6
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650696e-1f));  // ln2^2 / 2
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718056e-1f));  // ln2
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Scores of keys j0 .. j0 + 3 of the block for the NV row vectors from `base`: s = (q . k) * scale, -inf where
// the key lies after the row's position or before its window's first key (`first`; INT32_MIN: no window).
template <int NV>
void score_keys(Buffers& b, int base, int64_t D, int j0, int64_t key0, const __m256i* pos, const __m256i* first,
                __m256 scale) {
  __m256 acc[kKeyGroup][NV];
  for (int j = 0; j < kKeyGroup; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm256_load_ps(&b.q[d][base + v * kLanes]);
    for (int j = 0; j < kKeyGroup; ++j) {
      const __m256 kb = _mm256_broadcast_ss(&b.k[j0 + j][d]);
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_fmadd_ps(qv[v], kb, acc[j][v]);
    }
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < kKeyGroup; ++j) {
    const __m256i key = _mm256_set1_epi32(static_cast<int>(key0 + j0 + j));
    for (int v = 0; v < NV; ++v) {
      const __m256 masked = _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(key, pos[v]),
                                                                _mm256_cmpgt_epi32(first[v], key)));
      _mm256_store_ps(&b.s[j0 + j][base + v * kLanes], _mm256_blendv_ps(_mm256_mul_ps(acc[j][v], scale), neg_inf, masked));
    }
  }
}

template <int NV>  // the block's scores of keys 0 .. nk - 1 (and up to the next multiple of 4, masked)
void block_scores(Buffers& b, int v0, int64_t D, int64_t nk, int64_t key0, const __m256i* pos, const __m256i* first,
                  __m256 scale) {
  for (int j0 = 0; j0 < nk; j0 += kKeyGroup)
    score_keys<NV>(b, v0 * kLanes, D, j0, key0, pos + v0, first + v0, scale);
}

// o = alpha o + p v for the NV row vectors from `base`, over keys 0 .. nk - 1 of the block: kDimChunk dims x NV
// row vectors per register block.
template <int NV>
void add_values(Buffers& b, int base, int64_t D, int64_t nk, const __m256* alpha) {
  bool rescale = false;  // alpha = 1 in every lane (no new maximum): o * 1 = o, the products skipped
  for (int v = 0; v < NV; ++v)
    rescale |= _mm256_movemask_ps(_mm256_cmp_ps(alpha[v], _mm256_set1_ps(1.f), _CMP_NEQ_UQ)) != 0;
  for (int64_t d0 = 0; d0 < D; d0 += kDimChunk) {
    __m256 acc[kDimChunk][NV];
    for (int d = 0; d < kDimChunk; ++d)
      for (int v = 0; v < NV; ++v) {
        acc[d][v] = _mm256_load_ps(&b.o[d0 + d][base + v * kLanes]);
        if (rescale) acc[d][v] = _mm256_mul_ps(acc[d][v], alpha[v]);
      }
    for (int64_t j = 0; j < nk; ++j) {
      __m256 pv[NV];
      for (int v = 0; v < NV; ++v) pv[v] = _mm256_load_ps(&b.s[j][base + v * kLanes]);
      for (int d = 0; d < kDimChunk; ++d) {
        const __m256 vb = _mm256_broadcast_ss(&b.v[j][d0 + d]);
        for (int v = 0; v < NV; ++v) acc[d][v] = _mm256_fmadd_ps(pv[v], vb, acc[d][v]);
      }
    }
    for (int d = 0; d < kDimChunk; ++d)
      for (int v = 0; v < NV; ++v) _mm256_store_ps(&b.o[d0 + d][base + v * kLanes], acc[d][v]);
  }
}

// Row vectors v0 .. v1 - 1 in register blocks of up to three: f<NV>(first vector) for each block.
template <template <int> class Op, class... A>
void over_row_blocks(int v0, int v1, A&&... args) {
  for (int v = v0; v < v1; v += kMaxBlockVecs) {
    const int n = std::min(kMaxBlockVecs, v1 - v);
    if (n == 3) Op<3>::run(v, args...);
    else if (n == 2) Op<2>::run(v, args...);
    else Op<1>::run(v, args...);
  }
}

template <int NV>
struct Scores {
  static void run(int v, Buffers& b, int64_t D, int64_t nk, int64_t key0, const __m256i* pos, const __m256i* first,
                  __m256 scale) {
    block_scores<NV>(b, v, D, nk, key0, pos, first, scale);
  }
};

template <int NV>
struct Values {
  static void run(int v, Buffers& b, int64_t D, int64_t nk, const __m256* alpha) {
    add_values<NV>(b, v * kLanes, D, nk, alpha + v);
  }
};

// The pool's element types: bf16 widened (exact), float32 as it is.
inline float to_float(at::BFloat16 x) { return bf16_to_float(x); }
inline float to_float(float x) { return x; }
inline __m256 load_8(const at::BFloat16* p) { return vec16_detail::load_bf16_8(p); }
inline __m256 load_8(const float* p) { return _mm256_loadu_ps(p); }
inline void store_16(at::BFloat16* p, vec16 x) { v16_store_bf16(p, x); }
inline void store_16(float* p, vec16 x) { v16_store(p, x); }

// ---- the int8 form ("avx2-int8": Int8 = true). Each operand is rounded to integers with a scale of its own,
// fixed by its own values only, so a row's bits stay independent of the batch:
//   q row: q8 = round(q * 63 / max|q|) in [-63, 63]; a K row: k8 in [-127, 127] likewise, stored as k8 + 128, so
//   vpmaddubsw's unsigned operand is K and its pair sums stay below 2^15 (255 * 63 * 2 = 32130);
//   s = (sum_d k8u_d q8_d - 128 sum_d q8_d) * (q scale * scale * log2(e)) * k scale   (exact int32 sums)
//   a V row: v8 in [-127, 127] with its scale; w_j = p_j * v_scale_j, per row and block
//   w8 = round(w * 127 / max_j w) in [0, 127] (max over the row's own keys: masked ones have p = 0), and
//   o = alpha o + (sum_j w8_j v8_j) * (max_j w / 127)   (127 * 127 * 2 = 32258 < 2^15; exact int32 sums)
// l stays the float32 sum of p. Perplexity of the bench's RAG document on SmolLM2 moves by a few 1e-4
// (docs/benchmarks.md's quality table). A block wholly masked for a row has max w = 0 and leaves o's bits as
// they are (blended), as the float forms' argument needs.
// 2^-100: a row's (or w's) max |x| below it rounds against it, so qmax / max is finite (no / 0, no inf)
constexpr float kScaleFloor = 7.8886091e-31f;

// Rounds n floats (a multiple of 32) to int8 in [-qmax, qmax] with scale max(max|x|, kScaleFloor) / qmax (0 for an
// all-zero row; NaN for a row with a NaN or infinity, whose int8 values are then 0): out[i] = round(x[i] / scale),
// nearest even.
inline float quantize_row(const float* x, int64_t n, float qmax, int8_t* out) {
  __m256 amax = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_load_ps(x + i), abs_mask);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or infinity
    amax = _mm256_max_ps(amax, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = 0.f;
  for (float f : lanes) m = std::max(m, f);
  if (_mm256_movemask_ps(bad) != 0 || m == 0.f) {
    std::memset(out, 0, static_cast<size_t>(n));
    return m == 0.f && _mm256_movemask_ps(bad) == 0 ? 0.f : std::numeric_limits<float>::quiet_NaN();
  }
  m = std::max(m, kScaleFloor);  // a row below 2^-100 rounds against it: qmax / m stays finite
  const __m256 inv = _mm256_set1_ps(qmax / m);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < n; i += 32) {  // 4 x 8 int32 -> 32 int8 (packs work per 128-bit lane: reordered after)
    __m256i r[4];
    for (int t = 0; t < 4; ++t) r[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(x + i + 8 * t), inv));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permutevar8x32_epi32(p, order));
  }
  return m / qmax;
}

// Item rows' q into q8 / q_scale / q_corr (from the float q that item_rows wrote), for RV vectors of rows.
inline void quantize_q(Buffers& b, int64_t D, int RV, float scale_log2e) {
  alignas(32) float row[kMaxDim];
  alignas(32) int8_t q8[kMaxDim];
  for (int r = 0; r < RV * kLanes; ++r) {
    for (int64_t d = 0; d < D; ++d) row[d] = b.q[d][r];
    const float sq = quantize_row(row, D, 63.f, q8);
    int32_t sum = 0;
    for (int64_t d = 0; d < D; ++d) sum += q8[d];
    for (int64_t i = 0; i < D / 4; ++i) std::memcpy(&b.q8[i][r], q8 + 4 * i, 4);
    b.q_scale[r] = sq * scale_log2e;
    b.q_corr[r] = 128 * sum;
  }
}

// The K and V rows of every (sequence, KV head) that the call's items read, in int8, each rounded once (an item would
// otherwise round a block again for every item after it): keys from the 32-key block holding the sequence's first
// row's first key (its window's) to its last, rounded up to 32 (zero rows, scale 0, past the last key).
struct QuantizedKV {
  int64_t D = 0;
  std::vector<int64_t> first;   // per sequence: its first key here, a multiple of kKeys
  std::vector<int64_t> offset;  // per (sequence, KV head): index of its first key in the arrays
  std::vector<uint8_t> k8;      // [key][D]: k8 + 128
  std::vector<int8_t> v8;       // [key / 4][D][4]
  std::vector<float> k_scale, v_scale;  // [key]
};

template <class T>
void quantize_keys(const Args& a, QuantizedKV& kv) {
  const int64_t B = static_cast<int64_t>(kv.first.size()), D = a.D, row_stride = a.KVH * D;
  struct Task { int64_t seq, kh, key0, num_keys; };
  std::vector<Task> tasks;
  int64_t total = 0;
  for (int64_t s = 0; s < B; ++s) {
    const int64_t num_keys = a.num_computed[s] + (a.query_start[s + 1] - a.query_start[s]);
    const int64_t first_key = a.window > 0 ? std::max<int64_t>(0, a.num_computed[s] - a.window + 1) : 0;
    kv.first[s] = first_key / kKeys * kKeys;
    const int64_t count = (num_keys - kv.first[s] + kKeys - 1) / kKeys * kKeys;
    for (int64_t kh = 0; kh < a.KVH; ++kh) {
      kv.offset[s * a.KVH + kh] = total;
      for (int64_t k0 = 0; k0 < count; k0 += kKeys) tasks.push_back(Task{s, kh, k0, num_keys});
      total += count;
    }
  }
  kv.D = D;
  kv.k8.resize(static_cast<size_t>(total * D));
  kv.v8.resize(static_cast<size_t>(total * D));
  kv.k_scale.resize(static_cast<size_t>(total));
  kv.v_scale.resize(static_cast<size_t>(total));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    alignas(32) float row[2][kMaxDim];
    alignas(32) int8_t v8[4][kMaxDim];
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // k8 + 128: the sign bit flipped
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      const int32_t* table = a.table + task.seq * a.max_blocks;
      const int64_t index0 = kv.offset[task.seq * a.KVH + task.kh] + task.key0;  // this block's first key's index
      for (int64_t j0 = 0; j0 < kKeys; j0 += 4) {
        for (int j = 0; j < 4; ++j) {
          const int64_t key = kv.first[task.seq] + task.key0 + j0 + j, index = index0 + j0 + j;
          uint8_t* k8 = kv.k8.data() + index * D;
          if (key < task.num_keys) {
            const int64_t slot = static_cast<int64_t>(table[key / a.block_size]) * a.block_size + key % a.block_size;
            const T* krow = a.k_as<T>() + slot * row_stride + task.kh * D;
            const T* vrow = a.v_as<T>() + slot * row_stride + task.kh * D;
            for (int64_t d = 0; d < D; d += 8) {
              _mm256_store_ps(row[0] + d, load_8(krow + d));
              _mm256_store_ps(row[1] + d, load_8(vrow + d));
            }
            kv.k_scale[index] = quantize_row(row[0], D, 127.f, reinterpret_cast<int8_t*>(k8));
            kv.v_scale[index] = quantize_row(row[1], D, 127.f, v8[j]);
          } else {
            std::memset(k8, 0, static_cast<size_t>(D));
            std::memset(v8[j], 0, static_cast<size_t>(D));
            kv.k_scale[index] = kv.v_scale[index] = 0.f;
          }
          for (int64_t d = 0; d < D; d += 32) {
            __m256i* kr = reinterpret_cast<__m256i*>(k8 + d);
            _mm256_storeu_si256(kr, _mm256_xor_si256(_mm256_loadu_si256(kr), flip));
          }
        }
        // V by (key group, dim, key): the 4 rows' bytes interleaved, 16 dims at a time
        int8_t* out_group = kv.v8.data() + (index0 + j0) * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v8[0] + d));
          const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v8[1] + d));
          const __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v8[2] + d));
          const __m128i a3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v8[3] + d));
          const __m128i lo01 = _mm_unpacklo_epi8(a0, a1), hi01 = _mm_unpackhi_epi8(a0, a1);
          const __m128i lo23 = _mm_unpacklo_epi8(a2, a3), hi23 = _mm_unpackhi_epi8(a2, a3);
          __m128i* out = reinterpret_cast<__m128i*>(out_group + 4 * d);
          _mm_storeu_si128(out + 0, _mm_unpacklo_epi16(lo01, lo23));
          _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(lo01, lo23));
          _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(hi01, hi23));
          _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(hi01, hi23));
        }
      }
    }
  });
}

// Points b at the item's block k0 in kv; keys before j_first (not read) and from nk on get scale 0.
inline void use_block(Buffers& b, const QuantizedKV& kv, const Work& w, int64_t KVH, int64_t k0, int64_t j_first,
                      int64_t nk) {
  const int64_t index0 = kv.offset[w.seq * KVH + w.kh] + (k0 - kv.first[w.seq]);
  b.k8 = kv.k8.data() + index0 * kv.D;
  b.v8 = kv.v8.data() + index0 * kv.D;
  for (int64_t j = 0; j < kKeys; ++j) {
    const bool read = j >= j_first && j < nk;
    b.k_scale[j] = read ? kv.k_scale[index0 + j] : 0.f;
    b.v_scale[j] = read ? kv.v_scale[index0 + j] : 0.f;
  }
}

inline __m256i bcast4(const void* p) {  // 4 bytes to every 32-bit lane
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm256_set1_epi32(x);
}

// sum over 4-byte groups of u8 a times s8 b, per 32-bit lane (vpmaddubsw's pair sums fit int16: see above)
inline __m256i dot4(__m256i a_u8, __m256i b_s8, __m256i ones16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a_u8, b_s8), ones16);
}

// score_keys in int8: keys j0 .. j0 + 3 for the NV row vectors from `base` (2 at most: 8 sums + 2 q + k + tmp)
template <int NV>
void score_keys_i8(Buffers& b, int base, int64_t D, int j0, int64_t key0, const __m256i* pos, const __m256i* first) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[kKeyGroup][NV];
  for (int j = 0; j < kKeyGroup; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_setzero_si256();
  for (int64_t i = 0; i < D / 4; ++i) {
    __m256i qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(&b.q8[i][base + v * kLanes]));
    for (int j = 0; j < kKeyGroup; ++j) {
      const __m256i kb = bcast4(b.k8 + (j0 + j) * D + 4 * i);
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_add_epi32(acc[j][v], dot4(kb, qv[v], ones));
    }
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < NV; ++v) {
    const __m256i corr = _mm256_load_si256(reinterpret_cast<const __m256i*>(&b.q_corr[base + v * kLanes]));
    const __m256 qs = _mm256_load_ps(&b.q_scale[base + v * kLanes]);
    for (int j = 0; j < kKeyGroup; ++j) {
      const __m256i key = _mm256_set1_epi32(static_cast<int>(key0 + j0 + j));
      const __m256 masked = _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(key, pos[v]),
                                                                _mm256_cmpgt_epi32(first[v], key)));
      const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[j][v], corr)), qs),
                                     _mm256_set1_ps(b.k_scale[j0 + j]));
      _mm256_store_ps(&b.s[j0 + j][base + v * kLanes], _mm256_blendv_ps(s, neg_inf, masked));
    }
  }
}

template <int NV>
struct ScoresI8 {
  static void run(int v, Buffers& b, int64_t D, int64_t nk, int64_t key0, const __m256i* pos, const __m256i* first) {
    for (int j0 = 0; j0 < nk; j0 += kKeyGroup) score_keys_i8<NV>(b, v * kLanes, D, j0, key0, pos + v, first + v);
  }
};

// Softmax of the block for row vector v: running max m and sum l, p over the scores in place; returns alpha.
// `bad` collects the lanes with a NaN or +inf score at a visible key (masked keys are -inf): their output is
// NaN, as float attention's would be, in every tiling. W (the int8 form): stores w = p * v_scale instead of p,
// with its maximum over the block in *w_max, and lanes that see a key whose V row has a NaN or infinity into `bad`.
template <bool W = false>
inline __m256 softmax_block(Buffers& b, int base, int64_t nk, __m256& m, __m256& l, __m256& bad,
                            __m256* w_max = nullptr) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 pos_inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 mb = neg_inf;
  for (int64_t j = 0; j < nk; ++j) {
    const __m256 sj = _mm256_load_ps(&b.s[j][base]);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(sj, sj, _CMP_UNORD_Q), _mm256_cmp_ps(sj, pos_inf, _CMP_EQ_OQ)));
    mb = _mm256_max_ps(mb, sj);
  }
  const __m256 m_new = _mm256_max_ps(m, mb);
  const __m256 alpha = exp2_8(_mm256_sub_ps(m, m_new));  // m = -inf (first block): 2^-126, times o = l = 0
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < nk; ++j) {
    const __m256 sj = _mm256_load_ps(&b.s[j][base]);
    const __m256 pj = _mm256_and_ps(_mm256_cmp_ps(sj, neg_inf, _CMP_NEQ_OQ), exp2_8(_mm256_sub_ps(sj, m_new)));
    sum = _mm256_add_ps(sum, pj);
    if constexpr (W) {
      const __m256 w = _mm256_mul_ps(pj, _mm256_set1_ps(b.v_scale[j]));
      // p > 0 at a key whose V scale is NaN (a NaN or infinity in its V row); a key the row doesn't see (p = 0: a
      // later position, or before its window) changes nothing, so its bits don't depend on which later keys the
      // call holds (a NaN w rounds to w8 = 0 in quantize_w)
      bad = _mm256_or_ps(bad, _mm256_and_ps(_mm256_cmp_ps(w, w, _CMP_UNORD_Q),
                                            _mm256_cmp_ps(pj, _mm256_setzero_ps(), _CMP_GT_OQ)));
      *w_max = _mm256_max_ps(w, *w_max);  // a NaN w leaves it as it is (maxps returns its second operand then)
      _mm256_store_ps(&b.s[j][base], w);
    } else {
      _mm256_store_ps(&b.s[j][base], pj);
    }
  }
  l = _mm256_add_ps(_mm256_mul_ps(l, alpha), sum);
  m = m_new;
  return alpha;
}

// After the block's softmax of row vector v (w = p * v_scale in b.s, its maximum w_max): w rounded to w8 (keys
// nk .. the next multiple of 4: 0); returns w's scale, max w / 127 (max floored at kScaleFloor); `zero`: lanes with
// max w = 0, whose o the products leave as it is.
inline __m256 quantize_w(Buffers& b, int base, int64_t nk, __m256 w_max, __m256& zero) {
  zero = _mm256_cmp_ps(w_max, _mm256_setzero_ps(), _CMP_EQ_OQ);
  const __m256 floor = _mm256_max_ps(w_max, _mm256_set1_ps(kScaleFloor));
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(127.f), floor);
  const __m256i zeros = _mm256_setzero_si256();
  for (int64_t g = 0; g < (nk + 3) / 4; ++g) {
    __m256i packed = zeros;
    for (int t = 0; t < 4; ++t) {
      const int64_t j = 4 * g + t;
      if (j >= nk) break;
      const __m256 w = _mm256_load_ps(&b.s[j][base]);
      const __m256i w8 = _mm256_max_epi32(zeros, _mm256_cvtps_epi32(_mm256_mul_ps(w, inv)));  // NaN lanes: 0
      packed = _mm256_or_si256(packed, _mm256_slli_epi32(_mm256_min_epi32(w8, _mm256_set1_epi32(127)), 8 * t));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(&b.w8[g][base]), packed);
  }
  return _mm256_div_ps(floor, _mm256_set1_ps(127.f));
}

// add_values in int8: o = alpha o + (sum_j w8_j v8_j) * w_scale for the NV row vectors from `base` (2 at most)
template <int NV>
void add_values_i8(Buffers& b, int base, int64_t D, int64_t nk, const __m256* alpha, const __m256* w_scale,
                   const __m256* zero) {
  bool rescale = false;
  for (int v = 0; v < NV; ++v)
    rescale |= _mm256_movemask_ps(_mm256_cmp_ps(alpha[v], _mm256_set1_ps(1.f), _CMP_NEQ_UQ)) != 0;
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t ng = (nk + 3) / 4;
  for (int64_t d0 = 0; d0 < D; d0 += kDimChunk) {
    __m256i acc[kDimChunk][NV];
    for (int d = 0; d < kDimChunk; ++d)
      for (int v = 0; v < NV; ++v) acc[d][v] = _mm256_setzero_si256();
    for (int64_t g = 0; g < ng; ++g) {
      __m256i wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(&b.w8[g][base + v * kLanes]));
      for (int d = 0; d < kDimChunk; ++d) {
        const __m256i vb = bcast4(b.v8 + (g * D + d0 + d) * 4);
        for (int v = 0; v < NV; ++v) acc[d][v] = _mm256_add_epi32(acc[d][v], dot4(wv[v], vb, ones));
      }
    }
    for (int d = 0; d < kDimChunk; ++d)
      for (int v = 0; v < NV; ++v) {
        float* op = &b.o[d0 + d][base + v * kLanes];
        __m256 o = _mm256_load_ps(op);
        if (rescale) o = _mm256_mul_ps(o, alpha[v]);
        const __m256 sum = _mm256_add_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[d][v]), w_scale[v]));
        _mm256_store_ps(op, _mm256_blendv_ps(sum, o, zero[v]));
      }
  }
}

template <int NV>
struct ValuesI8 {
  static void run(int v, Buffers& b, int64_t D, int64_t nk, const __m256* alpha, const __m256* w_scale,
                  const __m256* zero) {
    add_values_i8<NV>(b, v * kLanes, D, nk, alpha + v, w_scale + v, zero + v);
  }
};

// Row vectors v0 .. v1 - 1 in register blocks of up to two (the int8 products' registers).
template <template <int> class Op, class... A>
void over_row_pairs(int v0, int v1, A&&... args) {
  for (int v = v0; v < v1; v += 2) {
    if (v1 - v >= 2) Op<2>::run(v, args...);
    else Op<1>::run(v, args...);
  }
}



// Rows of item w: tokens w.begin .. w.end - 1, each with G query heads (row = token * G + g), padded to RV
// vectors of 8 with copies of the last row: their positions and q into b, o zeroed. Returns RV.
template <class T>
int item_rows(const Args& a, const Work& w, Buffers& b, int64_t& num_keys) {
  const int64_t D = a.D, G = a.G, num_rows = (w.end - w.begin) * G;
  const int RV = static_cast<int>((num_rows + kLanes - 1) / kLanes);
  const int64_t first_pos = a.num_computed[w.seq] + (w.begin - a.query_start[w.seq]);
  num_keys = first_pos + (w.end - w.begin);  // the last row's position + 1
  for (int64_t r = 0; r < RV * kLanes; ++r) {
    const int64_t rr = std::min(r, num_rows - 1);
    b.pos[r] = static_cast<int32_t>(first_pos + rr / G);
    const T* qrow = a.q_as<T>() + ((w.begin + rr / G) * a.H + w.kh * G + rr % G) * D;
    for (int64_t d = 0; d < D; ++d) b.q[d][r] = to_float(qrow[d]);
  }
  for (int64_t d = 0; d < D; ++d)
    for (int v = 0; v < RV; ++v) _mm256_store_ps(&b.o[d][v * kLanes], _mm256_setzero_ps());
  return RV;
}

// out = o * (1 / l) for the item's rows, rounded to T (NaN for the lanes in `bad`).
template <class T>
void store_rows(const Args& a, const Work& w, const Buffers& b, int RV, const __m256* l, const __m256* bad) {
  const int64_t D = a.D, G = a.G, num_rows = (w.end - w.begin) * G;
  alignas(32) float inv_l[kRows], row[kMaxDim];
  for (int v = 0; v < RV; ++v)
    _mm256_store_ps(inv_l + v * kLanes, _mm256_blendv_ps(_mm256_div_ps(_mm256_set1_ps(1.f), l[v]),
                                                         _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), bad[v]));
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t d = 0; d < D; ++d) row[d] = b.o[d][r];
    T* orow = a.out_as<T>() + ((w.begin + r / G) * a.H + w.kh * G + r % G) * D;
    const vec16 inv = v16_set1(inv_l[r]);
    for (int64_t d = 0; d < D; d += 16) store_16(orow + d, v16_mul(v16_load(row + d), inv));
  }
}

// Attention of item w's rows over their keys (Int8: the int8 form's products).
template <class T, bool Int8>
void attend_item(const Args& a, const Work& w, Buffers& b, const QuantizedKV* kv) {
  const int64_t D = a.D;
  int64_t num_keys = 0;
  const int RV = item_rows<T>(a, w, b, num_keys);
  const float scale_log2e = a.scale * 1.44269504088896341f;  // scores in base 2: * log2(e)
  if constexpr (Int8) quantize_q(b, D, RV, scale_log2e);
  // with a window, row r's first key is pos - window + 1 (lane 0 of a vector holds its least), else none
  const int32_t window = static_cast<int32_t>(a.window);
  const auto first_key = [&](int r) { return window > 0 ? b.pos[r] - window + 1 : std::numeric_limits<int32_t>::min(); };
  __m256i pos[kMaxVecs], first[kMaxVecs];
  __m256 m[kMaxVecs], l[kMaxVecs], alpha[kMaxVecs], bad[kMaxVecs];
  for (int v = 0; v < RV; ++v) {
    pos[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(b.pos + v * kLanes));
    first[v] = window > 0 ? _mm256_sub_epi32(pos[v], _mm256_set1_epi32(window - 1))
                          : _mm256_set1_epi32(std::numeric_limits<int32_t>::min());
    m[v] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    l[v] = _mm256_setzero_ps();
    bad[v] = _mm256_setzero_ps();
  }
  const __m256 scale = _mm256_set1_ps(scale_log2e);
  const int64_t row_stride = a.KVH * D;
  const int32_t* table = a.table + w.seq * a.max_blocks;
  const int64_t item_first = std::max<int64_t>(0, first_key(0));  // the first key any row of the item reads
  for (int64_t k0 = item_first / kKeys * kKeys; k0 < num_keys; k0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, num_keys - k0);
    // vectors whose rows all sit before this block, or whose windows all start after it, skip it (no change in
    // their lanes: the header); rows lie in position order, lane 0 of a vector first
    int v0 = 0, v1 = RV;
    while (v0 < RV && b.pos[v0 * kLanes + kLanes - 1] < k0) ++v0;
    while (v1 > v0 && first_key((v1 - 1) * kLanes) >= k0 + nk) --v1;
    const int64_t j_first = std::max<int64_t>(0, item_first - k0);  // keys before it: not read, zero, masked
    if constexpr (Int8) {
      use_block(b, *kv, w, a.KVH, k0, j_first, nk);
    } else {
      for (int64_t j = 0; j < j_first; ++j)
        for (int64_t d = 0; d < D; d += 8) {
          _mm256_store_ps(&b.k[j][d], _mm256_setzero_ps());
          _mm256_store_ps(&b.v[j][d], _mm256_setzero_ps());
        }
      for (int64_t j = j_first, block = (k0 + j_first) / a.block_size, offset = (k0 + j_first) % a.block_size; j < nk;
           ++j) {
        const int64_t slot = static_cast<int64_t>(table[block]) * a.block_size + offset;
        const T* krow = a.k_as<T>() + slot * row_stride + w.kh * D;
        const T* vrow = a.v_as<T>() + slot * row_stride + w.kh * D;
        for (int64_t d = 0; d < D; d += 8) {
          _mm256_store_ps(&b.k[j][d], load_8(krow + d));
          _mm256_store_ps(&b.v[j][d], load_8(vrow + d));
        }
        if (++offset == a.block_size) offset = 0, ++block;
      }
      for (int64_t j = nk; j < (nk + kKeyGroup - 1) / kKeyGroup * kKeyGroup; ++j)  // masked, but finite
        for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(&b.k[j][d], _mm256_setzero_ps());
    }
    // the next block's K and V rows asked for now, read by the time this block's products are done (int8: read
    // from QuantizedKV, in order)
    if constexpr (!Int8)
      prefetch_kv_rows(a.k_as<T>(), a.v_as<T>(), table, a.block_size, row_stride, w.kh * D,
                       static_cast<int64_t>(sizeof(T)) * D, k0 + kKeys, std::min<int64_t>(k0 + 2 * kKeys, num_keys));
    if constexpr (Int8) {
      over_row_pairs<ScoresI8>(v0, v1, b, D, nk, k0, static_cast<const __m256i*>(pos), static_cast<const __m256i*>(first));
      __m256 w_scale[kMaxVecs], zero[kMaxVecs];
      for (int v = v0; v < v1; ++v) {
        __m256 w_max = _mm256_setzero_ps();
        alpha[v] = softmax_block<true>(b, v * kLanes, nk, m[v], l[v], bad[v], &w_max);
        w_scale[v] = quantize_w(b, v * kLanes, nk, w_max, zero[v]);
      }
      over_row_pairs<ValuesI8>(v0, v1, b, D, nk, static_cast<const __m256*>(alpha), static_cast<const __m256*>(w_scale),
                               static_cast<const __m256*>(zero));
    } else {
      over_row_blocks<Scores>(v0, v1, b, D, nk, k0, static_cast<const __m256i*>(pos),
                              static_cast<const __m256i*>(first), scale);
      for (int v = v0; v < v1; ++v) alpha[v] = softmax_block(b, v * kLanes, nk, m[v], l[v], bad[v]);
      over_row_blocks<Values>(v0, v1, b, D, nk, static_cast<const __m256*>(alpha));
    }
  }
  store_rows<T>(a, w, b, RV, l, bad);
}

}  // namespace

// Checked without needing AVX2 itself (the CPU is checked first); the kernel's code is AVX2 + FMA. q and the pool
// bf16 or float32 (out: q's dtype); window 0: causal only; int8: the int8 form's products.
at::Tensor paged_prefill_attention_avx2(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                        const at::Tensor& block_table, const at::Tensor& query_start,
                                        const at::Tensor& num_computed, int64_t block_size, double scale,
                                        int64_t window, bool int8) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && tier_allows(kTierAvx2),
              "paged_prefill_attention_avx2 needs a CPU with AVX2 and FMA (and PREFIXCACHE_KERNELS allowing it)");
  at::Tensor out;
  Args a;
  const std::vector<Work> work = prefill_attention::plan_work("paged_prefill_attention_avx2", q, k_slots, v_slots,
                                                              block_table, query_start, num_computed, block_size,
                                                              scale, window, /*float32_ok=*/true, out, a, kLanes);
  const Work* items = work.data();
  const bool float32 = q.scalar_type() == at::kFloat;
  QuantizedKV kv;
  if (int8) {
    kv.first.resize(static_cast<size_t>(num_computed.numel()));
    kv.offset.resize(static_cast<size_t>(num_computed.numel() * a.KVH));
    if (float32) quantize_keys<float>(a, kv);
    else quantize_keys<at::BFloat16>(a, kv);
  }
  prefill_attention::run_work(work, [&](std::atomic<int64_t>& next, int64_t num_items) {
    auto buf = std::make_unique<Buffers>();
    for (int64_t i = next++; i < num_items; i = next++) {
      if (float32) int8 ? attend_item<float, true>(a, items[i], *buf, &kv) : attend_item<float, false>(a, items[i], *buf, nullptr);
      else int8 ? attend_item<at::BFloat16, true>(a, items[i], *buf, &kv)
                : attend_item<at::BFloat16, false>(a, items[i], *buf, nullptr);
    }
  });
  return out;
}
