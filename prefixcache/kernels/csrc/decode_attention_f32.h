// The float32 form of paged_attention.cpp's decode attention (that file's header states it and why a row's bits
// never depend on its batch), torch-free so that one source serves the extensions (paged_attention.cpp, with
// ATen's parallel_for) and the standalone check driver (aarch64_check.cpp, built with PREFIXCACHE_NO_TORCH and
// cross-compiled for aarch64). Written against vec16.h, so the AVX-512, AVX2 and NEON builds run the same
// float operations per lane.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "prefetch.h"
#include "scalar16.h"
#include "vec16.h"

namespace {

constexpr int kMaxVec = 16;    // head_dim <= 256 (16 registers of 16 floats)
constexpr int kMaxGroup = 16;  // query heads per kv head
constexpr int kPiece = 16;     // keys per softmax piece
constexpr int64_t kSegment = 1024;  // keys per work item: a row's context is split at multiples of it
constexpr int64_t kAhead = 32;      // the float32 form asks for a piece's K/V rows this many keys before it reads them

struct Args {
  const bf16_t* q;       // [R, H, D]
  const bf16_t* k;       // [S, KVH, D]
  const bf16_t* v;
  const int32_t* table;  // [R, max_blocks]
  const int32_t* lens;   // [R]
  bf16_t* out;           // [R, H, D]
  int64_t H, KVH, D, max_blocks, block_size;
  float scale;
  const uint8_t* skip = nullptr;  // [R] or null: rows this launch leaves to the other form (1)

  bool runs(int64_t r) const { return skip == nullptr || skip[r] == 0; }
};

// K/V rows of keys [begin, end) of one row (its block table row), kv head kh, asked for ahead (prefetch.h); both forms.
void prefetch_keys(const Args& a, const int32_t* table_row, int64_t kh, int64_t begin, int64_t end) {
  prefetch_kv_rows(a.k, a.v, table_row, a.block_size, a.KVH * a.D, kh * a.D, a.D * 2, begin, end);
}

// Keys [k_begin, k_end) of row r, kv head kh: the unnormalized output, the max and the sum to `part`
// ([G][D] accumulators, then [G] maxima, then [G] sums). kV = head_dim / 16 and kG = query heads per
// kv head as compile-time constants keep query and accumulators in registers (SmolLM2's shape and a
// few others, see row_function); 0 reads them from `a` at run time (the general path, same steps).
template <int kV, int kG>
void attend_segment(const Args& a, int64_t r, int64_t kh, int64_t k_begin, int64_t k_end, float* part) {
  constexpr int kVN = kV ? kV : kMaxVec, kGN = kG ? kG : kMaxGroup;
  const int64_t V = kV ? kV : a.D / 16, G = kG ? kG : a.H / a.KVH;
  vec16 q[kGN][kVN], acc[kGN][kVN];
  float m[kGN], l[kGN];
  bool bad[kGN] = {};  // a NaN or +inf score at one of the row's keys: its output is NaN (see below)
  for (int64_t g = 0; g < G; ++g) {
    const bf16_t* qp = a.q + (r * a.H + kh * G + g) * a.D;
    for (int64_t i = 0; i < V; ++i) q[g][i] = v16_load_bf16(qp + 16 * i), acc[g][i] = v16_zero();
    m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
  }
  const int64_t row_stride = a.KVH * a.D;
  const vec16 scale = v16_set1(a.scale);
  const int32_t* table_row = a.table + r * a.max_blocks;
  prefetch_keys(a, table_row, kh, k_begin, std::min(k_begin + kAhead, k_end));
  for (int64_t start = k_begin, n = 0; start < k_end; start += n) {  // pieces of <= 16 keys inside one pool block
    const int64_t block = start / a.block_size, offset = start % a.block_size;
    n = std::min<int64_t>({kPiece, k_end - start, a.block_size - offset});
    prefetch_keys(a, table_row, kh, std::min(start + kAhead, k_end), std::min(start + n + kAhead, k_end));
    const int64_t slot = static_cast<int64_t>(table_row[block]) * a.block_size + offset;
    const bf16_t* kp = a.k + slot * row_stride + kh * a.D;
    const bf16_t* vp = a.v + slot * row_stride + kh * a.D;
    vec16 dots[kGN][kPiece];  // per head and key: the 16 lane partial sums of q . k
    for (int64_t t = 0; t < kPiece; ++t) {
      if (t < n) {
        vec16 kv[kVN];
        for (int64_t i = 0; i < V; ++i) kv[i] = v16_load_bf16(kp + t * row_stride + 16 * i);
        for (int64_t g = 0; g < G; ++g) {
          vec16 d = v16_mul(q[g][0], kv[0]);
          for (int64_t i = 1; i < V; ++i) d = v16_fmadd(q[g][i], kv[i], d);
          dots[g][t] = d;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) dots[g][t] = v16_zero();
      }
    }
    alignas(64) float p[kGN][kPiece];
    for (int64_t g = 0; g < G; ++g) {
      const vec16 sg = v16_first_or(v16_mul(v16_hsum16(dots[g]), scale), static_cast<int>(n),
                                    -std::numeric_limits<float>::infinity());
      bad[g] |= v16_first_nan_or_inf(sg, static_cast<int>(n));
      const float m_new = std::max(m[g], v16_reduce_max(sg));
      const float alpha = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[g] - m_new);
      const vec16 pg = v16_first_or(v16_exp(v16_sub(sg, v16_set1(m_new))), static_cast<int>(n), 0.f);
      v16_store_aligned(p[g], pg);
      l[g] = l[g] * alpha + v16_reduce_add(pg);
      m[g] = m_new;
      const vec16 av = v16_set1(alpha);
      for (int64_t i = 0; i < V; ++i) acc[g][i] = v16_mul(acc[g][i], av);
    }
    for (int64_t t = 0; t < n; ++t) {
      vec16 vv[kVN];
      for (int64_t i = 0; i < V; ++i) vv[i] = v16_load_bf16(vp + t * row_stride + 16 * i);
      for (int64_t g = 0; g < G; ++g) {
        const vec16 pt = v16_set1(p[g][t]);
        for (int64_t i = 0; i < V; ++i) acc[g][i] = v16_fmadd(pt, vv[i], acc[g][i]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < V; ++i) v16_store(part + g * a.D + 16 * i, acc[g][i]);
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
    vec16 out[kMaxVec];
    for (int64_t i = 0; i < V; ++i) out[i] = v16_zero();
    float den = 0.f;
    for (int64_t s = 0; s < num_segments; ++s) {
      const float* part = parts + s * part_size;
      const float w = std::exp(part[G * a.D + g] - top);
      den += w * part[G * a.D + G + g];
      const vec16 wv = v16_set1(w);
      for (int64_t i = 0; i < V; ++i) out[i] = v16_fmadd(wv, v16_load(part + g * a.D + 16 * i), out[i]);
    }
    const vec16 inv = v16_set1(1.f / den);
    bf16_t* op = a.out + (r * a.H + kh * G + g) * a.D;
    for (int64_t i = 0; i < V; ++i) v16_store_bf16(op + 16 * i, v16_mul(out[i], inv));
  }
}

using RowFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, float*);

// The head shapes (head_dim / 16, query heads per kv head) both forms compile as fast paths, query and
// accumulators in registers (4, 3: SmolLM2-135M); any other shape runs the <0, 0> general path.
#define FOR_FAST_SHAPES(X) X(4, 1) X(4, 2) X(4, 3) X(4, 4) X(8, 1) X(8, 2)

RowFn row_function(int64_t V, int64_t G) {
#define PICK(v, g) if (V == v && G == g) return attend_segment<v, g>;
  FOR_FAST_SHAPES(PICK)
#undef PICK
  return attend_segment<0, 0>;
}

// The float32 form over rows [0, R) of `a` (the rows a.runs): work items (kv head, segment, row), in that order so
// rows over the same blocks run back to back, then each row's segments merged. parallel_for(n, fn) runs
// fn(begin, end) over a split of [0, n) (ATen's threads, or one call): each item writes only its own part.
template <typename ParallelFor>
void run_float32(const Args& a, int64_t R, const ParallelFor& parallel_for) {
  const int32_t* lens = a.lens;
  int64_t num_segments = 1;
  for (int64_t r = 0; r < R; ++r) num_segments = std::max<int64_t>(num_segments, (lens[r] + kSegment - 1) / kSegment);
  const int64_t H = a.H, KVH = a.KVH, D = a.D, G = H / KVH, part_size = G * D + 2 * G;
  std::vector<float> parts(R * KVH * num_segments * part_size);
  const auto part_of = [&](int64_t r, int64_t kh, int64_t s) { return parts.data() + ((r * KVH + kh) * num_segments + s) * part_size; };
  const RowFn attend = row_function(D / 16, G);
  parallel_for(KVH * num_segments * R, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kh = i / (num_segments * R), s = i / R % num_segments, r = i % R;
      if (s * kSegment < lens[r] && a.runs(r)) attend(a, r, kh, s * kSegment, std::min<int64_t>(lens[r], (s + 1) * kSegment), part_of(r, kh, s));
    }
  });
  parallel_for(KVH * R, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      if (a.runs(i % R)) merge_row(a, i % R, i / R, part_of(i % R, i / R, 0), (lens[i % R] + kSegment - 1) / kSegment, part_size);
  });
}

}  // namespace
