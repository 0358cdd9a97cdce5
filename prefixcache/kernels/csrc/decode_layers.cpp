// The decoder layers of generated tokens (quantization "int4"), all of a step's generated rows at once,
// each layer in one call from Python or all layers in one (a step with no prompt rows).
//
// Per layer and row, the Llama block (transformers' LlamaDecoderLayer order), the residual stream h
// kept in float32 from the embedding to the final norm:
//
//   x = rms_norm(h) * w_in                                     (float32; Qwen3: per-head rms_norm of q, k)
//   q, k, v = int4_mm(x, qkv) (+ bias)                         (qgemm.cpp, float32 out)
//   q, k = rope(q, k, position)                                (rotate-half; angle = float(pos) * inv_freq)
//   pool[slot(position)] = bf16(k), bf16(v)                    (every row written before any row attends)
//   h += int4_mm(paged_decode_attention(bf16(q)), o)           (paged_attention.cpp)
//   x = rms_norm(h) * w_post
//   h += int4_mm(silu(gate) * up, down), [gate | up] = int4_mm(x, gate_up)
//
// and at the end rms_norm(h) * w_final in bf16. Sums of squares run over 16 lanes in index order then
// across the lanes in a fixed pattern; every other step is element-wise or a kernel whose row result
// is row-invariant (qgemm.cpp, paged_attention.cpp): a row's bits depend only on its token, position
// and context, never on the other rows of the step or the number of threads. This replaces ~60 torch
// ops per layer (their dispatch was half of a one-row decode step's time).
//
// Built once per ISA like qgemm.cpp (AVX512-VNNI in cpu_kernels.py's extension, AVX2 + FMA + F16C in
// avx2_kernels.py's, aarch64 NEON in neon_kernels.py's), written against vec16.h: every build runs the same
// float operations per lane and the same reduction trees, so a generated row gets the same bits from any build
// wherever its attention takes the same form (the AVX2 and NEON builds have only the float32 form:
// paged_attention.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__)  // no intrinsic of its own: vec16.h holds each ISA's
#include <immintrin.h>
#endif

#include "vec16.h"

#include <cmath>
#include <vector>

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_slots, const at::Tensor& v_slots,
                                  const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                                  double scale);

namespace {

struct Int4Linear {  // an Int4Weight (prefixcache/layers/quant.py)
  at::Tensor packed, scale, min;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const { return int4_mm(x, packed, scale, min, bias, at::kFloat); }
};

struct Layer {
  at::Tensor input_norm, post_norm, q_norm, k_norm;  // float32 [hidden], [hidden], [head_dim] or empty
  Int4Linear qkv, o, gate_up, down;
};

at::Tensor float_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.numel() == n, name, " must have ", n, " elements");
  return t.to(at::kFloat).contiguous();
}

// packed, scale, min, bias (empty: none) of an [out_features, in_features] product; its shapes checked
// here, since the layer loop reads out_features floats per row of the product
Int4Linear int4_linear(const std::vector<at::Tensor>& w, size_t i, int64_t out_features, int64_t in_features,
                       const char* name) {
  const at::Tensor& packed = w[i];
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) * 16 == out_features && packed.size(1) * 8 == in_features,
              name, " must be an int4 weight of [", out_features, ", ", in_features, "]");
  TORCH_CHECK(w[i + 3].numel() == 0 || w[i + 3].numel() == out_features, name, "'s bias must have ", out_features,
              " elements");
  c10::optional<at::Tensor> bias;
  if (w[i + 3].numel() > 0) bias = w[i + 3].to(at::kFloat).contiguous();
  return Int4Linear{packed, w[i + 1], w[i + 2], bias};
}

// rms_norm of n floats (n % 16 == 0: hidden, head_dim) times a float32 weight: sum of squares in 16 lanes in index
// order, then v16_reduce_add (_mm512_reduce_add_ps's fixed pattern), then x * (1 / sqrt(mean + eps)) * w.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  vec16 acc = v16_zero();
  for (int64_t i = 0; i < n; i += 16) {
    const vec16 v = v16_load(x + i);
    acc = v16_fmadd(v, v, acc);
  }
  const vec16 r = v16_set1(1.f / std::sqrt(v16_reduce_add(acc) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) v16_store(y + i, v16_mul(v16_mul(v16_load(x + i), r), v16_load(w + i)));
}

void add_to(float* h, const float* d, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) v16_store(h + i, v16_add(v16_load(h + i), v16_load(d + i)));
}

class DecodeLayers {
 public:
  // layers: per layer [input_norm, post_norm, q_norm, k_norm, then packed, scale, min, bias of qkv, o,
  // gate_up, down] (an empty tensor: no q/k norm, no bias); inv_freq: float32 [head_dim / 2].
  DecodeLayers(const std::vector<std::vector<at::Tensor>>& layers, const at::Tensor& final_norm,
               const at::Tensor& inv_freq, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, int64_t intermediate, double eps, double scale)
      : hidden_(hidden), H_(num_heads), KVH_(num_kv_heads), D_(head_dim), I_(intermediate),
        eps_(static_cast<float>(eps)), scale_(scale) {
    TORCH_CHECK(hidden % 32 == 0 && intermediate % 32 == 0 && head_dim % 16 == 0 && head_dim <= 256,
                "hidden_size and intermediate_size must be multiples of 32, head_dim a multiple of 16 <= 256");
    TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 16,
                "num_heads must be a multiple of num_kv_heads, <= 16 per kv head (paged_decode_attention's)");
    final_norm_ = float_vector(final_norm, hidden, "final_norm");
    inv_freq_ = float_vector(inv_freq, head_dim / 2, "inv_freq");
    for (const auto& w : layers) {
      TORCH_CHECK(w.size() == 20, "each layer takes 20 tensors");
      const int64_t attn = num_heads * head_dim;
      Layer l{float_vector(w[0], hidden, "input_norm"), float_vector(w[1], hidden, "post_norm"), {}, {},
              int4_linear(w, 4, attn + 2 * num_kv_heads * head_dim, hidden, "qkv"), int4_linear(w, 8, hidden, attn, "o"),
              int4_linear(w, 12, 2 * intermediate, hidden, "gate_up"), int4_linear(w, 16, hidden, intermediate, "down")};
      if (w[2].numel() > 0) l.q_norm = float_vector(w[2], head_dim, "q_norm");
      if (w[3].numel() > 0) l.k_norm = float_vector(w[3], head_dim, "k_norm");
      layers_.push_back(std::move(l));
    }
  }

  // h: float32 [R, hidden], updated in place through layers [begin, end); block_table int32 [R, max_blocks]
  // and context_lens int32 [R] (a row's position is context_len - 1) as paged_decode_attention takes
  // them; kv_caches: every layer's pool, [2, num_blocks, block_size, num_kv_heads, head_dim] bf16.
  void run(const at::Tensor& h, const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
           const std::vector<at::Tensor>& kv_caches, int64_t begin, int64_t end) const {
    TORCH_CHECK(h.is_cpu() && h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2 && h.size(1) == hidden_,
                "h must be contiguous float32 [rows, hidden_size]");
    TORCH_CHECK(0 <= begin && begin <= end && end <= static_cast<int64_t>(layers_.size()) &&
                kv_caches.size() == layers_.size(), "layer range or kv_caches outside the model's layers");
    const int64_t R = h.size(0);
    TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == R && block_table.scalar_type() == at::kInt &&
                block_table.is_contiguous() && context_lens.numel() == R && context_lens.scalar_type() == at::kInt &&
                context_lens.is_contiguous() && block_size >= 1, "block_table / context_lens / block_size malformed");
    TORCH_CHECK(block_table.is_cpu() && context_lens.is_cpu(), "block_table and context_lens must be CPU tensors");
    if (R == 0 || begin == end) return;
    for (int64_t l = begin; l < end; ++l)
      TORCH_CHECK(kv_caches[l].is_cpu() && kv_caches[l].sizes() == kv_caches[begin].sizes(),
                  "kv_caches must be CPU tensors of one shape");
    const std::vector<int64_t> slots = write_slots(block_table, context_lens, block_size, kv_caches[begin]);
    const at::Tensor cos_sin = rope_table(context_lens);  // [R, 2, D / 2]
    for (int64_t l = begin; l < end; ++l) {
      const at::Tensor& kv = kv_caches[l];
      TORCH_CHECK(kv.scalar_type() == at::kBFloat16 && kv.is_contiguous() && kv.dim() == 5 && kv.size(2) == block_size &&
                  kv.size(3) == KVH_ && kv.size(4) == D_, "kv_caches must be contiguous bf16 [2, blocks, block_size, kv_heads, head_dim]");
      layer(layers_[l], h, kv, slots, cos_sin, block_table, context_lens, block_size);
    }
  }

  at::Tensor final_norm(const at::Tensor& h) const {  // float32 [R, hidden] -> bf16 [R, hidden]
    TORCH_CHECK(h.is_cpu() && h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2 && h.size(1) == hidden_,
                "h must be contiguous float32 [rows, hidden_size]");
    at::Tensor out = at::empty({h.size(0), hidden_}, at::TensorOptions().dtype(at::kBFloat16));
    std::vector<float> y(hidden_);
    for (int64_t r = 0; r < h.size(0); ++r) {
      rms_norm(h.data_ptr<float>() + r * hidden_, final_norm_.data_ptr<float>(), y.data(), hidden_, eps_);
      for (int64_t i = 0; i < hidden_; i += 16) v16_store_bf16(out.data_ptr<at::BFloat16>() + r * hidden_ + i, v16_load(y.data() + i));
    }
    return out;
  }

 private:
  std::vector<int64_t> write_slots(const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                                   const at::Tensor& kv) const {  // each row's pool slot, bounds-checked
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    const int32_t* table = block_table.data_ptr<int32_t>();
    const int64_t max_blocks = block_table.size(1), num_blocks = kv.size(1);
    std::vector<int64_t> slots(context_lens.numel());
    for (int64_t r = 0; r < context_lens.numel(); ++r) {
      TORCH_CHECK(lens[r] >= 1 && lens[r] <= max_blocks * block_size, "context_lens out of the block table's range");
      const int64_t pos = lens[r] - 1, block = table[r * max_blocks + pos / block_size];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_table holds a block outside the pool");
      slots[r] = block * block_size + pos % block_size;
    }
    return slots;
  }

  at::Tensor rope_table(const at::Tensor& context_lens) const {  // [R, 2, D / 2]: cos, sin of float(pos) * inv_freq
    const int64_t R = context_lens.numel(), half = D_ / 2;
    at::Tensor t = at::empty({R, 2, half}, at::TensorOptions().dtype(at::kFloat));
    float* p = t.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(context_lens.data_ptr<int32_t>()[r] - 1) * inv_freq_.data_ptr<float>()[i];
        p[(r * 2) * half + i] = std::cos(angle);
        p[(r * 2 + 1) * half + i] = std::sin(angle);
      }
    return t;
  }

  // One head's vector in place: optional per-head rms_norm, then rotate-half RoPE.
  void norm_and_rope(float* x, const at::Tensor& norm, const float* cs) const {
    if (norm.defined()) rms_norm(x, norm.data_ptr<float>(), x, D_, eps_);
    const int64_t half = D_ / 2;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half], c = cs[i], s = cs[half + i];
      x[i] = a * c - b * s;
      x[i + half] = b * c + a * s;
    }
  }

  void layer(const Layer& w, const at::Tensor& h, const at::Tensor& kv, const std::vector<int64_t>& slots,
             const at::Tensor& cos_sin, const at::Tensor& block_table, const at::Tensor& context_lens,
             int64_t block_size) const {
    const int64_t R = h.size(0), qkv_dim = (H_ + 2 * KVH_) * D_;
    float* hp = h.data_ptr<float>();
    const auto f32 = at::TensorOptions().dtype(at::kFloat), bf16 = at::TensorOptions().dtype(at::kBFloat16);
    at::Tensor x = at::empty({R, hidden_}, f32);
    for (int64_t r = 0; r < R; ++r)
      rms_norm(hp + r * hidden_, w.input_norm.data_ptr<float>(), x.data_ptr<float>() + r * hidden_, hidden_, eps_);
    at::Tensor qkv = w.qkv(x);  // [R, (H + 2 KVH) D]
    at::Tensor q = at::empty({R, H_, D_}, bf16);
    const at::Tensor k_slots = kv.select(0, 0).view({-1, KVH_, D_}), v_slots = kv.select(0, 1).view({-1, KVH_, D_});
    at::BFloat16 *kp = k_slots.data_ptr<at::BFloat16>(), *vp = v_slots.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < R; ++r) {
      float* row = qkv.data_ptr<float>() + r * qkv_dim;
      const float* cs = cos_sin.data_ptr<float>() + r * D_;
      for (int64_t j = 0; j < H_ + KVH_; ++j) norm_and_rope(row + j * D_, j < H_ ? w.q_norm : w.k_norm, cs);
      for (int64_t i = 0; i < H_ * D_; i += 16) v16_store_bf16(q.data_ptr<at::BFloat16>() + r * H_ * D_ + i, v16_load(row + i));
      for (int64_t i = 0; i < KVH_ * D_; i += 16) {
        v16_store_bf16(kp + slots[r] * KVH_ * D_ + i, v16_load(row + H_ * D_ + i));
        v16_store_bf16(vp + slots[r] * KVH_ * D_ + i, v16_load(row + (H_ + KVH_) * D_ + i));
      }
    }
    const at::Tensor attn = paged_decode_attention(q, k_slots, v_slots, block_table, context_lens, block_size, scale_);
    const at::Tensor o = w.o(attn.view({R, H_ * D_}));  // [R, hidden]
    for (int64_t r = 0; r < R; ++r) {
      add_to(hp + r * hidden_, o.data_ptr<float>() + r * hidden_, hidden_);
      rms_norm(hp + r * hidden_, w.post_norm.data_ptr<float>(), x.data_ptr<float>() + r * hidden_, hidden_, eps_);
    }
    const at::Tensor gate_up = w.gate_up(x);  // [R, 2 I]
    at::Tensor act = at::empty({R, I_}, f32);
    for (int64_t r = 0; r < R; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * 2 * I_;
      for (int64_t i = 0; i < I_; i += 16) {  // silu(gate) * up = gate / (1 + e^-gate) * up
        const vec16 gv = v16_load(g + i);
        const vec16 silu = v16_div(gv, v16_add(v16_set1(1.f), v16_exp(v16_sub(v16_zero(), gv))));
        v16_store(act.data_ptr<float>() + r * I_ + i, v16_mul(silu, v16_load(g + I_ + i)));
      }
    }
    const at::Tensor down = w.down(act);  // [R, hidden]
    for (int64_t r = 0; r < R; ++r) add_to(hp + r * hidden_, down.data_ptr<float>() + r * hidden_, hidden_);
  }

  int64_t hidden_, H_, KVH_, D_, I_;
  float eps_;
  double scale_;
  at::Tensor final_norm_, inv_freq_;
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decode_layers(pybind11::module& m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<const std::vector<std::vector<at::Tensor>>&, const at::Tensor&, const at::Tensor&, int64_t,
                          int64_t, int64_t, int64_t, int64_t, double, double>())
      // no Python object is touched inside: the GIL is released (the server's event loop runs meanwhile)
      .def("run", &DecodeLayers::run, "h [R, hidden] float32 through layers [begin, end), in place",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("final_norm", &DecodeLayers::final_norm, "h [R, hidden] float32 -> rms_norm(h) * w bf16",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
