// The float32 form of paged_attention.cpp's decode attention (that file's header states it and why a row's bits
// never depend on its batch), torch-free so that one source serves the extensions (paged_attention.cpp, with
// ATen's parallel_for) and the standalone check driver (aarch64_check.cpp, built with PREFIXCACHE_NO_TORCH and
// cross-compiled for aarch64). Written against vec16.h, so the AVX-512, AVX2 and NEON builds run the same
// float operations per lane.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
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

inline vec16 load16(const bf16_t* p) { return v16_load_bf16(p); }  // exact
inline vec16 load16(const float* p) { return v16_load(p); }

template <typename T>
struct KVPiece {  // K and V rows of a piece's first key; the piece's next keys every `stride` elements
  const T* k;
  const T* v;
  int64_t stride;
};

// Where a row's keys are read: from the pool through the row's block table (bf16, widened to float32 exactly as
// they are read), or (WideKV) from a chunk of an item's shared keys widened to float32 once for all of its rows.
// Both give the same floats, so a row's bits do not depend on which one served it.
struct PoolKV {
  const Args& a;
  const int32_t* table_row;
  int64_t kh;

  KVPiece<bf16_t> at(int64_t start) const {
    const int64_t stride = a.KVH * a.D;
    const int64_t slot = static_cast<int64_t>(table_row[start / a.block_size]) * a.block_size + start % a.block_size;
    return {a.k + slot * stride + kh * a.D, a.v + slot * stride + kh * a.D, stride};
  }
  void prefetch(int64_t begin, int64_t end) const { prefetch_keys(a, table_row, kh, begin, end); }
};

struct WideKV {  // keys [base, base + kWideKeys) as float32 rows: key x at k + (x - base) * D
  const float* k;
  const float* v;
  int64_t base, D;

  KVPiece<float> at(int64_t start) const { return {k + (start - base) * D, v + (start - base) * D, D}; }
  void prefetch(int64_t, int64_t) const {}  // the chunk was just written: in cache
};

// Keys [k_begin, k_end) of row r, kv head kh, read through `src`, onto the row's running (acc, max, sum, bad) in
// `part` ([G][D] accumulators, then [G] maxima, [G] sums and [G] flags: 1 where a NaN or +inf score was seen; see
// merge_row): started afresh, or resumed where an earlier call over the keys before k_begin left it. Calls start and
// end only where the row's own traversal of the segment ends a piece (a chunk's whole pieces; a shared range ends at a
// pool block's end or the segment's), so a row split into calls has the pieces, and so the bits, of one call. kV = head_dim / 16 and kG = query heads per kv head as compile-time constants keep query
// and accumulators in registers (SmolLM2's shape and a few others, see row_function); 0 reads them from `a` at run
// time (the general path, same steps).
template <int kV, int kG, typename Src>
void attend_segment(const Args& a, int64_t r, int64_t kh, int64_t k_begin, int64_t k_end, float* part, bool resume,
                    const Src& src) {
  constexpr int kVN = kV ? kV : kMaxVec, kGN = kG ? kG : kMaxGroup;
  const int64_t V = kV ? kV : a.D / 16, G = kG ? kG : a.H / a.KVH;
  vec16 q[kGN][kVN], acc[kGN][kVN];
  float m[kGN], l[kGN];
  bool bad[kGN];  // a NaN or +inf score at one of the row's keys: its output is NaN (see below)
  for (int64_t g = 0; g < G; ++g) {
    const bf16_t* qp = a.q + (r * a.H + kh * G + g) * a.D;
    for (int64_t i = 0; i < V; ++i) q[g][i] = v16_load_bf16(qp + 16 * i);
    if (resume) {
      for (int64_t i = 0; i < V; ++i) acc[g][i] = v16_load(part + g * a.D + 16 * i);
      m[g] = part[G * a.D + g], l[g] = part[G * a.D + G + g], bad[g] = part[G * a.D + 2 * G + g] != 0.f;
    } else {
      for (int64_t i = 0; i < V; ++i) acc[g][i] = v16_zero();
      m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f, bad[g] = false;
    }
  }
  const vec16 scale = v16_set1(a.scale);
  src.prefetch(k_begin, std::min(k_begin + kAhead, k_end));
  for (int64_t start = k_begin, n = 0; start < k_end; start += n) {  // pieces of <= 16 keys inside one pool block
    n = std::min<int64_t>({kPiece, k_end - start, a.block_size - start % a.block_size});
    src.prefetch(std::min(start + kAhead, k_end), std::min(start + n + kAhead, k_end));
    const auto kv_rows = src.at(start);
    vec16 dots[kGN][kPiece];  // per head and key: the 16 lane partial sums of q . k
    for (int64_t t = 0; t < kPiece; ++t) {
      if (t < n) {
        vec16 kv[kVN];
        for (int64_t i = 0; i < V; ++i) kv[i] = load16(kv_rows.k + t * kv_rows.stride + 16 * i);
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
    // p @ v, each accumulator over the piece's keys in order; 16 dims of every head at a time, so the G running
    // sums stay in registers (AVX2 has 16 of them: all G x V would spill to the stack on every key)
    for (int64_t i = 0; i < V; ++i) {
      vec16 sums[kGN];
      for (int64_t g = 0; g < G; ++g) sums[g] = acc[g][i];
      for (int64_t t = 0; t < n; ++t) {
        const vec16 vv = load16(kv_rows.v + t * kv_rows.stride + 16 * i);
        for (int64_t g = 0; g < G; ++g) sums[g] = v16_fmadd(v16_set1(p[g][t]), vv, sums[g]);
      }
      for (int64_t g = 0; g < G; ++g) acc[g][i] = sums[g];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < V; ++i) v16_store(part + g * a.D + 16 * i, acc[g][i]);
    part[G * a.D + g] = m[g], part[G * a.D + G + g] = l[g], part[G * a.D + 2 * G + g] = bad[g] ? 1.f : 0.f;
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

// Every row's partial results per kv head and segment: [R, KVH, num_segments, part_size] float32, part_size =
// G D + 3 G in attend_segment's layout (acc, max, sum, bad). Each work item writes only its own rows' parts.
struct Parts {
  int64_t KVH, num_segments, part_size;
  std::vector<float> data;
  Parts(const Args& a, int64_t R)
      : KVH(a.KVH), num_segments(1), part_size(a.H / a.KVH * (a.D + 3)) {
    for (int64_t r = 0; r < R; ++r) num_segments = std::max<int64_t>(num_segments, (a.lens[r] + kSegment - 1) / kSegment);
    data.resize(R * KVH * num_segments * part_size);
  }
  float* at(int64_t r, int64_t kh, int64_t s) { return data.data() + ((r * KVH + kh) * num_segments + s) * part_size; }
};

// Each running row's segments merged (merge_row) into a.out, the (kv head, row) pairs split by parallel_for.
template <typename ParallelFor>
void merge_rows(const Args& a, int64_t R, Parts& parts, const ParallelFor& parallel_for) {
  parallel_for(a.KVH * R, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i % R, kh = i / R;
      if (a.runs(r)) merge_row(a, r, kh, parts.at(r, kh, 0), (a.lens[r] + kSegment - 1) / kSegment, parts.part_size);
    }
  });
}

template <typename Src>
using RowFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, float*, bool, const Src&);

// The head shapes (head_dim / 16, query heads per kv head) both forms compile as fast paths, query and
// accumulators in registers (4, 3: SmolLM2-135M); any other shape runs the <0, 0> general path.
#define FOR_FAST_SHAPES(X) X(4, 1) X(4, 2) X(4, 3) X(4, 4) X(8, 1) X(8, 2)

template <typename Src>
RowFn<Src> row_function(int64_t V, int64_t G) {
#define PICK(v, g) if (V == v && G == g) return attend_segment<v, g, Src>;
  FOR_FAST_SHAPES(PICK)
#undef PICK
  return attend_segment<0, 0, Src>;
}

struct Item {  // one kv head, one segment, rows order[begin, end) sharing its keys [segment start, shared_end)
  int64_t kh, seg, shared_end, cost;
  int32_t begin, end;
};

// Work items of both forms: per kv head and segment, the rows whose context reaches the segment, grouped by the
// pool block holding the segment's first key (up to kMaxItemRows rows; a row with fewer than min_keys keys in the
// segment stays alone, it would cut the others' share); a group shares the keys up to
// shared_end(same_end, segment start, segment end), same_end being where the rows' pool blocks stop agreeing or
// the shortest row's context ends. Longest items first. Grouping changes what is read once, never a row's bits.
constexpr int kMaxItemRows = 16;

template <typename SharedEnd>
std::vector<Item> make_items(const Args& a, int64_t R, int64_t num_segments, int64_t min_keys,
                             const SharedEnd& shared_end_of, std::vector<int32_t>& order) {
  std::vector<Item> items;
  std::vector<std::tuple<int32_t, int64_t, int32_t>> rows;
  for (int64_t kh = 0; kh < a.KVH; ++kh) {
    for (int64_t s = 0; s < num_segments; ++s) {
      const int64_t seg_start = s * kSegment, seg_end = seg_start + kSegment, first = seg_start / a.block_size;
      rows.clear();  // (first block, -keys in the segment, row): a group's longest contexts first
      for (int64_t r = 0; r < R; ++r)
        if (a.lens[r] > seg_start && a.runs(r))
          rows.emplace_back(a.table[r * a.max_blocks + first], seg_start - std::min<int64_t>(a.lens[r], seg_end),
                            static_cast<int32_t>(r));
      std::sort(rows.begin(), rows.end());
      for (size_t i = 0; i < rows.size();) {
        size_t j = i + 1;
        while (j < rows.size() && j - i < static_cast<size_t>(kMaxItemRows) && std::get<0>(rows[j]) == std::get<0>(rows[i]) &&
               -std::get<1>(rows[j]) >= min_keys)
          ++j;
        int64_t cap = seg_end, same_end = seg_start;  // same_end: the rows' pool blocks agree before it
        for (size_t t = i; t < j; ++t) cap = std::min<int64_t>(cap, a.lens[std::get<2>(rows[t])]);
        for (int64_t b = first; j - i > 1 && same_end < cap; ++b) {
          bool same = true;
          for (size_t t = i + 1; same && t < j; ++t)
            same = a.table[std::get<2>(rows[t]) * a.max_blocks + b] == a.table[std::get<2>(rows[i]) * a.max_blocks + b];
          if (!same) break;
          same_end = std::min((b + 1) * a.block_size, cap);
        }
        const int64_t shared_end = shared_end_of(same_end, seg_start, seg_end);
        Item it{kh, s, shared_end, 2 * (shared_end - seg_start), static_cast<int32_t>(order.size()), 0};
        for (size_t t = i; t < j; ++t) {
          order.push_back(std::get<2>(rows[t]));
          it.cost += 2 * (std::min<int64_t>(a.lens[std::get<2>(rows[t])], seg_end) - shared_end) + (shared_end - seg_start);
        }
        it.end = static_cast<int32_t>(order.size());
        items.push_back(it);
        i = j;
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

// Keys a widened chunk holds: at most 64 (32 KB of K and V for head_dim 64, inside L2 and mostly L1).
constexpr int64_t kWideKeys = 64;

// Keys [begin, end) of kv head kh through `table_row`, widened to float32 into wide (K) and wide + kWideKeys D (V).
// A pool block's keys are one slot stride apart, so each block's run is located once.
inline void widen_keys(const Args& a, const int32_t* table_row, int64_t kh, int64_t begin, int64_t end, float* wide) {
  const PoolKV pool{a, table_row, kh};
  for (int64_t x = begin; x < end;) {
    const int64_t n = std::min(end - x, a.block_size - x % a.block_size);
    const KVPiece<bf16_t> run = pool.at(x);
    for (int64_t t = 0; t < n; ++t) {
      const bf16_t* k_in = run.k + t * run.stride;
      const bf16_t* v_in = run.v + t * run.stride;
      float* k = wide + (x + t - begin) * a.D;
      float* v = wide + (kWideKeys + x + t - begin) * a.D;
      for (int64_t i = 0; i < a.D; i += 16) v16_store(k + i, v16_load_bf16(k_in + i)), v16_store(v + i, v16_load_bf16(v_in + i));
    }
    x += n;
  }
}

// One float32 work item: the rows' shared keys in chunks of whole pieces (as every row's own traversal cuts them:
// shared_end is a pool block's end or the segment's), each chunk widened once and then run by every row; then each
// row's own keys straight from the pool; then a row whose scores saw a NaN or +inf gets a NaN sum (merge_row).
inline void run_item_float32(const Args& a, const Item& it, const int32_t* order, Parts& parts, float* wide,
                             RowFn<PoolKV> from_pool, RowFn<WideKV> from_wide) {
  const int64_t G = a.H / a.KVH, seg_start = it.seg * kSegment, seg_end = seg_start + kSegment;
  const auto part_of = [&](int64_t r) { return parts.at(r, it.kh, it.seg); };
  const bool shared = it.end - it.begin > 1 && it.shared_end > seg_start;
  const int32_t* first_table = a.table + order[it.begin] * a.max_blocks;
  for (int64_t x = seg_start; shared && x < it.shared_end;) {
    int64_t y = x;  // the chunk [x, y): whole pieces, at most kWideKeys keys (a piece is at most 16)
    while (y < it.shared_end) {
      const int64_t n = std::min<int64_t>({kPiece, it.shared_end - y, a.block_size - y % a.block_size});
      if (y + n - x > kWideKeys) break;
      y += n;
    }
    widen_keys(a, first_table, it.kh, x, y, wide);
    prefetch_keys(a, first_table, it.kh, y, std::min(y + kAhead, it.shared_end));
    const WideKV chunk{wide, wide + kWideKeys * a.D, x, a.D};
    for (int32_t j = it.begin; j < it.end; ++j) from_wide(a, order[j], it.kh, x, y, part_of(order[j]), x > seg_start, chunk);
    x = y;
  }
  const int64_t own_start = shared ? it.shared_end : seg_start;
  for (int32_t j = it.begin; j < it.end; ++j) {
    const int64_t r = order[j], end = std::min<int64_t>(a.lens[r], seg_end);
    float* part = part_of(r);
    if (end > own_start)
      from_pool(a, r, it.kh, own_start, end, part, own_start > seg_start, PoolKV{a, a.table + r * a.max_blocks, it.kh});
    for (int64_t g = 0; g < G; ++g)
      if (part[G * a.D + 2 * G + g] != 0.f) part[G * a.D + G + g] = std::numeric_limits<float>::quiet_NaN();
  }
}

// The float32 form over rows [0, R) of `a` (the rows a.runs): work items (make_items: rows over the same pool
// blocks share an item, whose shared keys are widened to float32 once), then each row's segments merged.
// parallel_for(n, fn) runs fn(begin, end) over a split of [0, n) (ATen's threads, or one call): each call takes
// items from a shared counter, longest first, until none is left; each item writes only its own rows' parts.
template <typename ParallelFor>
void run_float32(const Args& a, int64_t R, const ParallelFor& parallel_for) {
  const int64_t D = a.D, G = a.H / a.KVH;
  Parts parts(a, R);
  std::vector<int32_t> order;
  const int64_t block_size = a.block_size;
  // a shared range ends at a pool block's end (or the segment's), where every row's traversal ends a piece
  const std::vector<Item> items = make_items(a, R, parts.num_segments, kWideKeys, [block_size](int64_t same_end, int64_t seg_start, int64_t seg_end) {
    return same_end == seg_end ? seg_end : std::max(seg_start, same_end / block_size * block_size);
  }, order);
  const RowFn<PoolKV> from_pool = row_function<PoolKV>(D / 16, G);
  const RowFn<WideKV> from_wide = row_function<WideKV>(D / 16, G);
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  parallel_for(num_items, [&](int64_t, int64_t) {
    thread_local std::vector<float> wide;  // kept per thread across calls (every float read is written first)
    if (wide.size() < static_cast<size_t>(2 * kWideKeys * D)) wide.resize(2 * kWideKeys * D);
    for (int64_t i = next++; i < num_items; i = next++)
      run_item_float32(a, items[i], order.data(), parts, wide.data(), from_pool, from_wide);
  });
  merge_rows(a, R, parts, parallel_for);
}

}  // namespace
