// Products of a few activation rows with grouped low-bit weights (generated tokens), one source built per ISA:
// AVX512-VNNI (cpu_kernels.py's extension), AVX2 + FMA + F16C (avx2_kernels.py's) and aarch64 NEON
// (neon_kernels.py's), with a scalar reference beside them (int4_mm_reference, int8_mm_reference: plain loops,
// the rule itself) that every build carries. The quantization, the per-ISA blocks and the reference are
// qgemm_core.h, torch-free: its NEON form is also cross-built with the standalone driver aarch64_check.cpp and
// checked under qemu against the x86 builds' bits.
//
//   int4_mm: w[n, k] = q[n, k] * scale[n, k / 32] + min[n, k / 32], q in 0..15   (llama.cpp's Q4_1 grid)
//   int8_mm: w[n, k] = q[n, k] * scale[n, k / 32],                   q in -127..127 (llama.cpp's Q8_0 grid)
//
// Activations are quantized per row and per group of 32 input features to int8 (``d = max|x| / 127``,
// ``q = round(x / d)``, so |q| <= 127: llama.cpp's Q8_1 / Q8_0 activation blocks), each group's products are
// summed exactly in int32, and the groups are added in float32 in ascending order, one fma per term:
//
//   int4: y = fma(float(sum_k qw * qx), scale * d, y); y = fma(min, d * sum_k qx, y)   (ggml_vec_dot_q4_1_q8_1)
//   int8: y = fma(float(sum_k qw * qx), scale * d, y)                                  (ggml_vec_dot_q8_0_q8_0)
//
// The integer sums are exact in every form, so every form gives the same int32 per group and, each output
// lane running the same float operations in the same order (vec16.h), the same bits:
// - AVX512-VNNI: ``vpdpbusd`` (unsigned x signed bytes, 4 per 32-bit lane, no saturation). int8 feeds
//   ``qx + 128`` as the unsigned operand and adds ``-128 * sum_k qw``, precomputed per group (``corr``).
// - AVX2: ``vpmaddubsw`` (unsigned x signed bytes, pairs summed into int16 with signed saturation) then
//   ``vpmaddwd`` with ones (int16 pairs into int32, exact). Operands are chosen so that no int16 saturates:
//   int4 multiplies the levels (0..15, unsigned) by qx (|qx| <= 127): a pair is at most 2 * 15 * 127 = 3,810,
//   so even the 8 pairs of a lane over a whole group (one int16 sum per 4 inputs x 8) stay within
//   8 * 3,810 = 30,480 < 32,767 and are added in int16 before one vpmaddwd per group; int8 uses ggml's
//   mul_sum_i8_pairs, vpmaddubsw(|qx|, sign(qw, qx)): |qx| <= 127 as the unsigned operand and qw's sign moved
//   onto it (|qw| <= 127), a pair at most 2 * 127 * 127 = 32,258 < 32,767, widened by vpmaddwd after every
//   4 inputs. (int8's vpdpbusd offset would put 255 in the unsigned operand and saturate: the AVX2 form keeps
//   qx signed and needs no ``corr``; its sum equals corr + sum (qx + 128) qw exactly.)
// - aarch64 NEON: ``sdot`` where the build has the dot product extension (armv8.2-a+dotprod; signed x signed
//   bytes, 4 per 32-bit lane, no saturation), else ``smull`` (each byte product exact in int16) widened pairwise
//   into int32 (``saddlp``); qx stays signed, levels and qx both fit a signed byte, no ``corr``.
// Scales and mins are float16, as in the GGUF blocks. A block of 16 outputs is computed by one thread, its
// weights, scales and mins read as three sequential streams (the AVX2 form runs the block as two halves of 8
// lanes, the second reading the block's weights from L1); a row's arithmetic never depends on the other rows
// of the call or on the split between threads, so a row gets the same bits in any batch. Rows are processed
// 4 at a time (each weight load serves 4).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "qgemm_core.h"

namespace {

// run_blocks over every block of 16 outputs, the blocks split between ATen's threads
template <typename Block>
void for_blocks(int64_t M, int64_t N, const Block& block) {
  at::parallel_for(0, N / kLanes, 1, [&](int64_t begin, int64_t end) { run_blocks(M, begin, end, block); });
}

QuantRows quantize(const at::Tensor& x_in, bool offset) {
  TORCH_CHECK(x_in.is_cpu(), "the int4 / int8 kernels run on CPU tensors");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kGroup == 0, "x must be [M, K] with K % 32 == 0");
  const at::Tensor x = x_in.contiguous();
  if (x.scalar_type() == at::kBFloat16)
    return quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), offset);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  return quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), offset);
}

void check_grouped(const at::Tensor& t, at::ScalarType dtype, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 3 && t.size(0) == N / kLanes &&
              t.size(1) == K / kGroup && t.size(2) == kLanes, name, " must be contiguous [N / 16, K / 32, 16]");
}

Call make_call(const QuantRows& xq, int64_t M, int64_t K, int64_t N, const at::Tensor& scale,
               const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, at::Tensor& out) {
  TORCH_CHECK(N % kLanes == 0, "out_features must be a multiple of 16");
  check_grouped(scale, at::kHalf, N, K, "scale");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bias must be contiguous float32 [N]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  out = at::empty({M, N}, at::TensorOptions().dtype(out_dtype));
  return Call{&xq, K, N, scale.data_ptr<at::Half>(), nullptr, nullptr, bias ? bias->data_ptr<float>() : nullptr,
              out.data_ptr(), out_dtype == at::kBFloat16};
}

// int4_mm's and its reference's checks and call (xq: x quantized; out: made here)
Call int4_call(const QuantRows& xq, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               const at::Tensor& min, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kLanes;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(1) == K / 8 && packed.size(2) == 64, "packed must be contiguous uint8 [N / 16, K / 8, 64]");
  check_grouped(min, at::kHalf, N, K, "min");
  Call a = make_call(xq, M, K, N, scale, bias, out_dtype, out);
  a.min = min.data_ptr<at::Half>();
  return a;
}

// int8_mm's and its reference's (int8_mm adds its corr)
Call int8_call(const QuantRows& xq, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kLanes;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(1) == K / 4 && packed.size(2) == 64, "packed must be contiguous int8 [N / 16, K / 4, 64]");
  return make_call(xq, M, K, N, scale, bias, out_dtype, out);
}

}  // namespace

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const QuantRows xq = quantize(x, false);
  at::Tensor out;
  const Call a = int4_call(xq, x, packed, scale, min, bias, out_dtype, out);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  for_blocks(x.size(0), a.N, [&](auto rows, int64_t r0, int64_t nb) { int4_block<decltype(rows)::value>(a, w, r0, nb); });
  return out;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& corr,
                   const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const QuantRows xq = quantize(x, kOffsetActivations);
  at::Tensor out;
  Call a = int8_call(xq, x, packed, scale, bias, out_dtype, out);
  check_grouped(corr, at::kInt, a.N, a.K, "corr");
  a.corr = corr.data_ptr<int32_t>();
  const int8_t* w = packed.data_ptr<int8_t>();
  for_blocks(x.size(0), a.N, [&](auto rows, int64_t r0, int64_t nb) { int8_block<decltype(rows)::value>(a, w, r0, nb); });
  return out;
}

at::Tensor int4_mm_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& min, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const QuantRows xq = quantize(x, false);
  at::Tensor out;
  const Call a = int4_call(xq, x, packed, scale, min, bias, out_dtype, out);  // checks before any data_ptr
  reference_rows(a, packed.data_ptr<uint8_t>(), nullptr, x.size(0));
  return out;
}

at::Tensor int8_mm_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const QuantRows xq = quantize(x, false);
  at::Tensor out;
  const Call a = int8_call(xq, x, packed, scale, bias, out_dtype, out);  // checks before any data_ptr
  reference_rows(a, nullptr, packed.data_ptr<int8_t>(), x.size(0));
  return out;
}
