// Decode attention of generated tokens straight from the paged KV pool, one query row at a time.
//
// A row (one token, all heads) attends over its context: keys 0 .. context_len - 1 of its sequence,
// found through its block table (slot = block * block_size + offset), in order. Keys are taken in
// pieces of at most 16 that never cross a pool block; for each piece and query head: scores
// ``q . k * scale`` in float32 (bf16 K converted exactly), the running max updated, the running sum
// and the output accumulator rescaled by exp(old max - new max), then ``p = exp(score - max)`` added
// to the sum and ``p * v`` to the accumulator (the online softmax of Milakov & Gimelshein 2018, as
// FlashAttention use it). A context is split into segments of 1,024 keys at fixed positions
// (flash-decoding's split-K, so a long context's segments run on all threads), each segment's
// (acc, max, sum) kept in float32, then merged in segment order: out = sum_s w_s acc_s / sum_s w_s sum_s
// with w_s = exp(max_s - max), as float32 element-wise sums in that order.
//
// A NaN or +inf score at one of a row's keys makes that row's output NaN, as float attention's would be.
//
// Every operation of a row depends only on its own query, its own keys and values, their order and
// the pool's block size, never on the other rows of the call or the split between threads: a row
// gets the same bits in a decode, in a recompute after preemption and in any batch. Work items are
// (kv head, segment, row), in that order, so rows that share prefix blocks read them one after
// another on the same thread, from cache after the first.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kMaxVec = 16;    // head_dim <= 256 (16 registers of 16 floats)
constexpr int kMaxGroup = 16;  // query heads per kv head
constexpr int kPiece = 16;     // keys per softmax piece
constexpr int64_t kSegment = 1024;  // keys per work item: a row's context is split at multiples of it

struct Args {
  const at::BFloat16* q;  // [R, H, D]
  const at::BFloat16* k;  // [S, KVH, D]
  const at::BFloat16* v;
  const int32_t* table;   // [R, max_blocks]
  const int32_t* lens;    // [R]
  at::BFloat16* out;      // [R, H, D]
  int64_t H, KVH, D, max_blocks, block_size;
  float scale;
};

// 16 vectors -> their 16 horizontal sums, in order. Every vector's lanes are added in the same
// pattern whatever its position: ((l0 + l2) + (l1 + l3)) within each 128-bit quarter, then the
// quarters (q0 + q1) + (q2 + q3).
inline __m512 hsum16(const __m512 (&x)[16]) {
  __m512 t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * j], x[2 * j + 1]), _mm512_unpackhi_ps(x[2 * j], x[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88), _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Keys [k_begin, k_end) of row r, kv head kh: the unnormalized output, the max and the sum to `part`
// ([G][D] accumulators, then [G] maxima, then [G] sums). kV = head_dim / 16 and kG = query heads per
// kv head as compile-time constants keep query and accumulators in registers (SmolLM2's shape and a
// few others, see row_function); 0 reads them from `a` at run time (the general path, same steps).
template <int kV, int kG>
void attend_segment(const Args& a, int64_t r, int64_t kh, int64_t k_begin, int64_t k_end, float* part) {
  constexpr int kVN = kV ? kV : kMaxVec, kGN = kG ? kG : kMaxGroup;
  const int64_t V = kV ? kV : a.D / 16, G = kG ? kG : a.H / a.KVH;
  __m512 q[kGN][kVN], acc[kGN][kVN];
  float m[kGN], l[kGN];
  bool bad[kGN] = {};  // a NaN or +inf score at one of the row's keys: its output is NaN (see below)
  for (int64_t g = 0; g < G; ++g) {
    const at::BFloat16* qp = a.q + (r * a.H + kh * G + g) * a.D;
    for (int64_t i = 0; i < V; ++i) q[g][i] = load_bf16(qp + 16 * i), acc[g][i] = _mm512_setzero_ps();
    m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
  }
  const int64_t row_stride = a.KVH * a.D;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t start = k_begin, n = 0; start < k_end; start += n) {  // pieces of <= 16 keys inside one pool block
    const int64_t block = start / a.block_size, offset = start % a.block_size;
    n = std::min<int64_t>({kPiece, k_end - start, a.block_size - offset});
    const int64_t slot = static_cast<int64_t>(a.table[r * a.max_blocks + block]) * a.block_size + offset;
    const at::BFloat16* kp = a.k + slot * row_stride + kh * a.D;
    const at::BFloat16* vp = a.v + slot * row_stride + kh * a.D;
    __m512 dots[kGN][kPiece];  // per head and key: the 16 lane partial sums of q . k
    for (int64_t t = 0; t < kPiece; ++t) {
      if (t < n) {
        __m512 kv[kVN];
        for (int64_t i = 0; i < V; ++i) kv[i] = load_bf16(kp + t * row_stride + 16 * i);
        for (int64_t g = 0; g < G; ++g) {
          __m512 d = _mm512_mul_ps(q[g][0], kv[0]);
          for (int64_t i = 1; i < V; ++i) d = _mm512_fmadd_ps(q[g][i], kv[i], d);
          dots[g][t] = d;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) dots[g][t] = _mm512_setzero_ps();
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    alignas(64) float p[kGN][kPiece];
    for (int64_t g = 0; g < G; ++g) {
      const __m512 sg = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                           _mm512_mul_ps(hsum16(dots[g]), scale));
      bad[g] |= (_mm512_mask_cmp_ps_mask(valid, sg, sg, _CMP_UNORD_Q) |
                 _mm512_mask_cmp_ps_mask(valid, sg, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ)) != 0;
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(sg));
      const float alpha = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[g] - m_new);
      const __m512 pg = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sg, _mm512_set1_ps(m_new))));
      _mm512_store_ps(p[g], pg);
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(pg);
      m[g] = m_new;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int64_t i = 0; i < V; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], av);
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 vv[kVN];
      for (int64_t i = 0; i < V; ++i) vv[i] = load_bf16(vp + t * row_stride + 16 * i);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 pt = _mm512_set1_ps(p[g][t]);
        for (int64_t i = 0; i < V; ++i) acc[g][i] = _mm512_fmadd_ps(pt, vv[i], acc[g][i]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < V; ++i) _mm512_storeu_ps(part + g * a.D + 16 * i, acc[g][i]);
    // a bad row's sum is NaN, so its merged output is NaN (the exp clamp would otherwise hide the NaN)
    part[G * a.D + g] = m[g], part[G * a.D + G + g] = bad[g] ? std::numeric_limits<float>::quiet_NaN() : l[g];
  }
}

// Row r, kv head kh: its segments' parts merged in segment order, out = sum_s w_s acc_s / sum_s w_s l_s
// with w_s = exp(m_s - max_s m_s), written as bf16.
void merge_row(const Args& a, int64_t r, int64_t kh, const float* parts, int64_t num_segments, int64_t part_size) {
  const int64_t G = a.H / a.KVH, V = a.D / 16;
  for (int64_t g = 0; g < G; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < num_segments; ++s) top = std::max(top, parts[s * part_size + G * a.D + g]);
    __m512 out[kMaxVec];
    for (int64_t i = 0; i < V; ++i) out[i] = _mm512_setzero_ps();
    float den = 0.f;
    for (int64_t s = 0; s < num_segments; ++s) {
      const float* part = parts + s * part_size;
      const float w = std::exp(part[G * a.D + g] - top);
      den += w * part[G * a.D + G + g];
      const __m512 wv = _mm512_set1_ps(w);
      for (int64_t i = 0; i < V; ++i) out[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(part + g * a.D + 16 * i), out[i]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / den);
    at::BFloat16* op = a.out + (r * a.H + kh * G + g) * a.D;
    for (int64_t i = 0; i < V; ++i) store_bf16(op + 16 * i, _mm512_mul_ps(out[i], inv));
  }
}

using RowFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, float*);

RowFn row_function(int64_t V, int64_t G) {  // head shapes with a compiled fast path, else the general one
  if (V == 4 && G == 1) return attend_segment<4, 1>;
  if (V == 4 && G == 2) return attend_segment<4, 2>;
  if (V == 4 && G == 3) return attend_segment<4, 3>;  // SmolLM2-135M
  if (V == 4 && G == 4) return attend_segment<4, 4>;
  if (V == 8 && G == 1) return attend_segment<8, 1>;
  if (V == 8 && G == 2) return attend_segment<8, 2>;
  return attend_segment<0, 0>;
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                  const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                                  double scale) {
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
  const Args a{q.data_ptr<at::BFloat16>(), k_slots.data_ptr<at::BFloat16>(), v_slots.data_ptr<at::BFloat16>(),
               table, lens, out.data_ptr<at::BFloat16>(), H, KVH, D, block_table.size(1),
               block_size, static_cast<float>(scale)};
  // Work items (kv head, segment, row), in that order: rows over the same blocks run back to back.
  int64_t num_segments = 1;
  for (int64_t r = 0; r < R; ++r) num_segments = std::max<int64_t>(num_segments, (lens[r] + kSegment - 1) / kSegment);
  const int64_t G = H / KVH, part_size = G * D + 2 * G;
  std::vector<float> parts(R * KVH * num_segments * part_size);
  const auto part_of = [&](int64_t r, int64_t kh, int64_t s) { return parts.data() + ((r * KVH + kh) * num_segments + s) * part_size; };
  const RowFn attend = row_function(D / 16, G);
  at::parallel_for(0, KVH * num_segments * R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kh = i / (num_segments * R), s = i / R % num_segments, r = i % R;
      if (s * kSegment < lens[r]) attend(a, r, kh, s * kSegment, std::min<int64_t>(lens[r], (s + 1) * kSegment), part_of(r, kh, s));
    }
  });
  at::parallel_for(0, KVH * R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      merge_row(a, i % R, i / R, part_of(i % R, i / R, 0), (lens[i % R] + kSegment - 1) / kSegment, part_size);
  });
  return out;
}
