// The element-wise ops of a bf16 model's prompt rows between its GEMMs, fused: each reads the row tiles
// of the GEMM before it in place (layers/linear.py's row_tiles, instead of torch.cat of them) and makes one
// pass over its rows. Used wherever the paged prompt kernel runs (prefill_attention.cpp); per row:
//
//   add_rms_norm:  h = bf16(residual + x)       (x alone in the first layer)
//                  y = bf16(w * bf16(h * (1 / sqrt(mean(h^2) + eps))))
//                  sum of squares of h in float32 over 16 lanes in index order, then across the lanes in a
//                  fixed pattern (v16_reduce_add: _mm512_reduce_add_ps's); the rest torch's bf16 op order
//                  (RMSNorm in norm.py)
//   rope_write_kv: q, k (heads of one [q | k | v] row) rotated as bf16(bf16(x cos) + bf16(roll(x, D/2) sin_rot)),
//                  torch's bf16 ops' bits (layers/rotary.py's apply_rotary_emb); k and v written to the
//                  row's pool slot, q returned contiguous for the attention kernel
//   silu_mul:      a = bf16(bf16(g / (1 + e^-g)) * u) for the row's [g | u], e^x by v16_exp (exp512's bits)
//
// Every value depends only on its own row (and the weights), never on the other rows, the tiling or the
// threads: a row gets the same bits in any batch. Rounding to bf16 is to nearest even, as torch's
// (finite values; a NaN stays NaN).
//
// Built once per ISA like decode_layers.cpp (AVX-512 in cpu_kernels.py's extension, AVX2 + FMA + F16C in
// avx2_kernels.py's, aarch64 NEON in neon_kernels.py's), written against vec16.h: each build runs the same IEEE
// operation per lane and the same reduction tree, so the same bits. A row width that is not a multiple of 16
// (add_rms_norm's hidden size, silu_mul's intermediate size) ends in a partial vector whose missing lanes are
// +0.0f in every build (v16_load_bf16_n); only lanes < n are stored.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

// A GEMM's output as row tiles [rows_i, cols], tile i holding rows start[i] .. start[i + 1] - 1.
struct Tiles {
  std::vector<const at::BFloat16*> data;
  std::vector<int64_t> start;
  int64_t cols = 0;

  int64_t rows() const { return start.back(); }
  const at::BFloat16* row(int64_t t) const {
    const int64_t i = std::upper_bound(start.begin(), start.end(), t) - start.begin() - 1;
    return data[i] + (t - start[i]) * cols;
  }
};

Tiles make_tiles(const std::vector<at::Tensor>& tiles, const char* name) {
  TORCH_CHECK(!tiles.empty(), name, " needs at least one tile");
  Tiles out;
  out.cols = tiles[0].dim() == 2 ? tiles[0].size(1) : -1;
  out.start.push_back(0);
  for (const at::Tensor& t : tiles) {
    TORCH_CHECK(t.dim() == 2 && t.size(1) == out.cols && t.scalar_type() == at::kBFloat16 && t.is_cpu() &&
                    t.is_contiguous(),
                name, ": every tile must be a contiguous bf16 CPU tensor [rows, ", out.cols, "]");
    out.data.push_back(t.data_ptr<at::BFloat16>());
    out.start.push_back(out.start.back() + t.size(0));
  }
  return out;
}

constexpr int64_t kGrain = 8;  // rows per parallel_for grain

}  // namespace

// Returns (y, h): y the normed rows [T, n], h the new residual stream [T, n] (x itself when there is no
// residual and x is one tile).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const std::vector<at::Tensor>& x_tiles,
                                                const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                                                double eps) {
  const Tiles x = make_tiles(x_tiles, "add_rms_norm");
  const int64_t T = x.rows(), n = x.cols;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.is_cpu(),
              "add_rms_norm: weight must be contiguous bf16 [", n, "] on the CPU");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == T && residual->size(1) == n &&
                    residual->scalar_type() == at::kBFloat16 && residual->is_contiguous() && residual->is_cpu(),
                "add_rms_norm: residual must be contiguous bf16 [", T, ", ", n, "] on the CPU");
  const at::TensorOptions opts = at::TensorOptions().dtype(at::kBFloat16);
  at::Tensor h = !has_res && x_tiles.size() == 1 ? x_tiles[0] : at::empty({T, n}, opts);
  at::Tensor y = at::empty({T, n}, opts);
  const at::BFloat16* res = has_res ? residual->data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
  at::BFloat16* hp = h.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const bool copy = hp != x_tiles[0].data_ptr<at::BFloat16>() || x_tiles.size() > 1;
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* xr = x.row(t);
      at::BFloat16* hr = hp + t * n;
      vec16 acc = v16_zero();  // lanes past n add +0 * +0: a lane stays +0 or its sum (never -0: squares are >= +0)
      for (int64_t i = 0; i < n; i += 16) {
        vec16 v = v16_load_bf16_n(xr + i, n - i);
        if (res != nullptr) v = v16_round_bf16(v16_add(v16_load_bf16_n(res + t * n + i, n - i), v));
        if (copy) v16_store_bf16_n(hr + i, v, n - i);
        acc = v16_fmadd(v, v, acc);
      }
      const vec16 r = v16_set1(1.f / std::sqrt(v16_reduce_add(acc) / static_cast<float>(n) + static_cast<float>(eps)));
      for (int64_t i = 0; i < n; i += 16) {
        const vec16 normed = v16_round_bf16(v16_mul(v16_load_bf16_n(hr + i, n - i), r));
        v16_store_bf16_n(yp + t * n + i, v16_mul(v16_load_bf16_n(w + i, n - i), normed), n - i);
      }
    }
  });
  return {y, h};
}

// qkv rows [T, (H + 2 KVH) D] -> q [T, H, D]; k, v of row t written to k_slots / v_slots [S, KVH, D] at
// slot_mapping[t]. cos, sin_rot: [T, D] (rotary.py's RotaryEmbedding.forward).
at::Tensor rope_write_kv(const std::vector<at::Tensor>& qkv_tiles, const at::Tensor& cos, const at::Tensor& sin_rot,
                         const at::Tensor& k_slots, const at::Tensor& v_slots, const at::Tensor& slot_mapping,
                         int64_t H, int64_t KVH) {
  const Tiles x = make_tiles(qkv_tiles, "rope_write_kv");
  const int64_t T = x.rows();
  TORCH_CHECK(H >= 1 && KVH >= 1 && x.cols % (H + 2 * KVH) == 0, "rope_write_kv: qkv rows must hold H + 2 KVH heads");
  const int64_t D = x.cols / (H + 2 * KVH), half = D / 2;
  TORCH_CHECK(D % 32 == 0, "rope_write_kv: head_dim must be a multiple of 32, got ", D);
  for (const at::Tensor* t : {&cos, &sin_rot})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->scalar_type() == at::kBFloat16 &&
                    t->is_contiguous() && t->is_cpu(),
                "rope_write_kv: cos and sin_rot must be contiguous bf16 [", T, ", ", D, "] on the CPU");
  TORCH_CHECK(k_slots.dim() == 3 && k_slots.size(1) == KVH && k_slots.size(2) == D && k_slots.is_contiguous() &&
                  k_slots.scalar_type() == at::kBFloat16 && v_slots.sizes() == k_slots.sizes() &&
                  v_slots.is_contiguous() && v_slots.scalar_type() == at::kBFloat16 && k_slots.is_cpu() && v_slots.is_cpu(),
              "rope_write_kv: k_slots and v_slots must be contiguous bf16 [S, ", KVH, ", ", D, "] on the CPU");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && slot_mapping.is_cpu(),
              "rope_write_kv: slot_mapping must be contiguous int64 [", T, "] on the CPU");
  const int64_t S = k_slots.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "rope_write_kv: slot ", slots[t], " outside the pool's ", S, " slots");
  at::Tensor q = at::empty({T, H, D}, at::TensorOptions().dtype(at::kBFloat16));
  const at::BFloat16 *cp = cos.data_ptr<at::BFloat16>(), *sp = sin_rot.data_ptr<at::BFloat16>();
  at::BFloat16 *qp = q.data_ptr<at::BFloat16>(), *kp = k_slots.data_ptr<at::BFloat16>(), *vp = v_slots.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* row = x.row(t);
      for (int64_t j = 0; j < H + KVH; ++j) {
        const at::BFloat16* src = row + j * D;
        at::BFloat16* dst = j < H ? qp + (t * H + j) * D : kp + (slots[t] * KVH + j - H) * D;
        for (int64_t d = 0; d < D; d += 16) {
          const vec16 a = v16_round_bf16(v16_mul(v16_load_bf16(src + d), v16_load_bf16(cp + t * D + d)));
          const vec16 b = v16_round_bf16(v16_mul(v16_load_bf16(src + (d + half) % D), v16_load_bf16(sp + t * D + d)));
          v16_store_bf16(dst + d, v16_add(a, b));
        }
      }
      std::copy(row + (H + KVH) * D, row + (H + 2 * KVH) * D, vp + slots[t] * KVH * D);
    }
  });
  return q;
}

// [g | u] rows [T, 2 I] -> [T, I].
at::Tensor silu_mul(const std::vector<at::Tensor>& gate_up_tiles) {
  const Tiles x = make_tiles(gate_up_tiles, "silu_mul");
  TORCH_CHECK(x.cols % 2 == 0, "silu_mul: rows must hold [gate | up], an even width");
  const int64_t T = x.rows(), I = x.cols / 2;
  at::Tensor out = at::empty({T, I}, at::TensorOptions().dtype(at::kBFloat16));
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* row = x.row(t);
      for (int64_t i = 0; i < I; i += 16) {
        const vec16 g = v16_load_bf16_n(row + i, I - i);
        // v16_exp ends in p * 2^n, a multiply in the AVX2 and NEON forms (scalef in AVX-512's) that GCC may fuse
        // with the 1 + into an fma: the same bits, as p * 2^n is exact wherever it is normal and 1 + a subnormal
        // rounds to 1 either way
        const vec16 silu = v16_round_bf16(v16_div(g, v16_add(v16_set1(1.f), v16_exp(v16_sub(v16_zero(), g)))));
        v16_store_bf16_n(op + t * I + i, v16_mul(silu, v16_load_bf16_n(row + I + i, I - i)), I - i);
      }
    }
  });
  return out;
}

// The three ops' Python bindings, one definition for every extension that builds this file (bindings.cpp,
// bindings_avx2.cpp).
void bind_prompt_ops(pybind11::module& m) {
  m.def("add_rms_norm", &add_rms_norm, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "row tiles x [T, n] (+ residual) -> (rms_norm(h) * w, h = residual + x), bf16 (prompt_ops.cpp)");
  m.def("rope_write_kv", &rope_write_kv, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "row tiles [T, (H + 2 KVH) D] -> q [T, H, D] rotated; k rotated and v written to the pool (prompt_ops.cpp)");
  m.def("silu_mul", &silu_mul, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "row tiles [T, 2 I] -> silu(gate) * up [T, I], bf16 (prompt_ops.cpp)");
}
