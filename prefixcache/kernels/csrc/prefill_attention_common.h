// The host side shared by the paged prompt-attention kernel's forms (prefill_attention.cpp: AVX512-BF16 and
// AMX; prefill_attention_avx2.cpp: AVX2 + FMA): the arguments as the forms read them, the argument checks, and
// the work items with the order threads take them in. No vector instruction here, so each form's file includes
// it outside its target pragma.
//
// A work item is one sequence, one KV head and up to kMaxRows rows (token, query head of that KV head):
// floor(kMaxRows / G) tokens, G = query heads per KV head. With a sliding window (window > 0) a row at position
// p reads keys p - window + 1 .. p (transformers' sliding_window_overlay: the query itself counts). Items are taken longest first, each thread taking
// the next one when done; a row's result never depends on which thread runs it or what else its item holds.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace prefill_attention {

constexpr int64_t kMaxRows = 48;   // rows of one work item
constexpr int64_t kMaxDim = 256;   // head_dim <= 256, a multiple of 32

struct Args {
  const void* q;  // [T, H, D], the pool's element type (bf16, or float32 where the form takes it)
  const void* k;  // [S, KVH, D]
  const void* v;
  const int32_t* table;        // [B, max_blocks]
  const int32_t* query_start;  // [B + 1]: sequence b's tokens are rows query_start[b] .. query_start[b + 1] - 1
  const int32_t* num_computed; // [B]: position of sequence b's first token
  void* out;                   // [T, H, D], q's element type
  int64_t H, KVH, D, G, max_blocks, block_size;
  float scale;
  int64_t window;  // 0: causal only; else each row reads the last `window` positions, its own included

  template <class T> const T* q_as() const { return static_cast<const T*>(q); }
  template <class T> const T* k_as() const { return static_cast<const T*>(k); }
  template <class T> const T* v_as() const { return static_cast<const T*>(v); }
  template <class T> T* out_as() const { return static_cast<T*>(out); }
};

struct Work {
  int32_t seq, kh, begin, end;  // tokens [begin, end) of the batch (rows of q)
  int64_t cost;
};

// Checks the tensors (TORCH_CHECK: shapes, dtypes, a block id outside the pool, a negative window), fills `a`
// (out included) and returns the work items, longest first. cost_lanes: rows per vector of the form, for the
// cost estimate; float32_ok: the form also takes a float32 q and pool (its output then float32).
inline std::vector<Work> plan_work(const char* name, const at::Tensor& q, const at::Tensor& k_slots,
                                   const at::Tensor& v_slots, const at::Tensor& block_table,
                                   const at::Tensor& query_start, const at::Tensor& num_computed, int64_t block_size,
                                   double scale, int64_t window, bool float32_ok, at::Tensor& out, Args& a,
                                   int64_t cost_lanes) {
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && (dtype == at::kBFloat16 || (float32_ok && dtype == at::kFloat)) && q.is_contiguous(),
              name, float32_ok ? ": q must be contiguous bf16 or float32 [T, H, D]" : ": q must be contiguous bf16 [T, H, D]");
  TORCH_CHECK(k_slots.dim() == 3 && k_slots.scalar_type() == dtype && k_slots.is_contiguous() &&
              v_slots.sizes() == k_slots.sizes() && v_slots.scalar_type() == dtype && v_slots.is_contiguous(),
              name, ": k_slots and v_slots must be contiguous [num_slots, KVH, D] of q's dtype");
  TORCH_CHECK(window >= 0, name, ": window must be >= 0 (0: no window)");
  TORCH_CHECK(q.is_cpu() && k_slots.is_cpu() && v_slots.is_cpu() && block_table.is_cpu() && query_start.is_cpu() &&
              num_computed.is_cpu(), name, " runs on CPU tensors");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_slots.size(1), B = num_computed.numel();
  TORCH_CHECK(KVH >= 1 && H >= 1 && H % KVH == 0 && H / KVH <= kMaxRows, name,
              ": num_heads must be a multiple of num_kv_heads, <= 48 per kv head");
  TORCH_CHECK(k_slots.size(2) == D && D % 32 == 0 && D <= kMaxDim, name, ": head_dim must be a multiple of 32, <= 256");
  TORCH_CHECK(block_size >= 1 && k_slots.size(0) % block_size == 0, name, ": block_size must divide the pool's slots");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B && block_table.scalar_type() == at::kInt &&
              block_table.is_contiguous(), name, ": block_table must be contiguous int32 [B, max_blocks]");
  TORCH_CHECK(query_start.numel() == B + 1 && query_start.scalar_type() == at::kInt && query_start.is_contiguous() &&
              num_computed.scalar_type() == at::kInt && num_computed.is_contiguous(),
              name, ": query_start must be int32 [B + 1], num_computed int32 [B]");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* nc = num_computed.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1), num_pool_blocks = k_slots.size(0) / block_size;
  TORCH_CHECK(B >= 1 && qs[0] == 0 && qs[B] == T, name, ": query_start must run from 0 to num_tokens");
  const int64_t G = H / KVH, tokens_per_item = std::max<int64_t>(1, kMaxRows / G);
  std::vector<Work> work;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qs[b + 1] > qs[b] && nc[b] >= 0, name, ": every sequence needs >= 1 token and num_computed >= 0");
    const int64_t context_len = static_cast<int64_t>(nc[b]) + qs[b + 1] - qs[b];
    TORCH_CHECK(context_len <= max_blocks * block_size, name, ": a context is longer than its block table");
    for (int64_t i = 0; i < (context_len + block_size - 1) / block_size; ++i) {
      const int32_t id = table[b * max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_pool_blocks, name, ": block_table holds a block outside the pool");
    }
    for (int64_t kh = 0; kh < KVH; ++kh)
      for (int64_t t = qs[b]; t < qs[b + 1]; t += tokens_per_item) {
        const int64_t end = std::min<int64_t>(qs[b + 1], t + tokens_per_item);
        const int64_t last = nc[b] + end - qs[b];  // keys up to the item's last row, + 1
        const int64_t keys = window > 0 ? std::min(last, window + end - t) : last;
        work.push_back(Work{static_cast<int32_t>(b), static_cast<int32_t>(kh), static_cast<int32_t>(t),
                            static_cast<int32_t>(end), keys * ((end - t) * G + cost_lanes - 1) / cost_lanes});
      }
  }
  std::stable_sort(work.begin(), work.end(), [](const Work& x, const Work& y) { return x.cost > y.cost; });
  out = at::empty_like(q);
  a = Args{q.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), table, qs, nc, out.data_ptr(),
           H, KVH, D, G, max_blocks, block_size, static_cast<float>(scale), window};
  return work;
}

// Runs thread_body(next, num_items) on min(threads, items) threads; each takes items next++ until none is left.
template <class F>
void run_work(const std::vector<Work>& work, F thread_body) {
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(work.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1,
                   [&](int64_t, int64_t) { thread_body(next, num_items); });
}

}  // namespace prefill_attention
