"""The int4 format's kernels for generated tokens (``int4_mm`` / ``int8_mm`` of
``prefixcache/kernels/csrc/qgemm.cpp``: int8 activations, exact int32 group sums on AVX512-VNNI) vs
torch's own 4-bit CPU kernel (``_weight_int4pack_mm_for_cpu``, bf16 activations, what the format ran
before) vs oneDNN's prepacked bf16 product: over a whole SmolLM2 layer stack's projection shapes (30
layers x q|k|v 576->960, o 576->576, gate|up 576->3072, down 1536->576; distinct random weights, so
they stream from memory as in a decode step) and the 49152 x 576 lm_head, at 1 to 512 rows; and
whether each row of our products has the bits of a one-row call.

    .venv/bin/python benchmarks/int4_linear.py [--num-threads 2]
"""

import argparse
import timeit

import torch

from prefixcache.layers.quant import group_int8_linear, int4_linear, quantize_weight_group_int8, quantize_weight_int4

p = argparse.ArgumentParser()
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.num_threads)
g = torch.Generator().manual_seed(0)
shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def torch_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed layout and [groups, n, 2] bf16 scale/zero for the same Q4_1-style grid."""
    n, k = w.shape
    wg = w.reshape(n, k // 32, 32)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo) / 15
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1).to(torch.bfloat16).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


ours, theirs, bf16 = [], [], []
for _ in range(30):
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        ours.append((k, quantize_weight_int4(w)))
        theirs.append((k, torch_int4(w)))
        bf16.append((k, torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1)))
head = torch.randn(49152, 576, generator=g) * 0.05
head_q8, head_bf16 = quantize_weight_group_int8(head), torch.ops.mkldnn._reorder_linear_weight(head.bfloat16(), 1)


def best_ms(f, n=5) -> float:
    f()  # warm-up
    return min(timeit.repeat(f, number=1, repeat=n)) * 1e3


def dense(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


for m in (1, 4, 10, 64, 512):
    x = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
    rep = 3 if m > 64 else 5
    t_ours = best_ms(lambda: [int4_linear(x[k], w) for k, w in ours], rep)
    t_torch = best_ms(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x[k], w, 32, sz) for k, (w, sz) in theirs], rep)
    t16 = best_ms(lambda: [dense(x[k], w) for k, w in bf16], rep)
    h8, h16 = best_ms(lambda: group_int8_linear(x[576], head_q8, torch.float32), rep), best_ms(lambda: dense(x[576], head_bf16))
    print(f"{m:4d} rows: {len(ours)} projections int4 (ours) {t_ours:7.1f} ms, torch int4 {t_torch:7.1f} ms, "
          f"bf16 prepacked {t16:6.1f} ms | lm_head group int8 (ours) {h8:6.2f} ms, bf16 {h16:6.2f} ms")
for n, k in shapes + ((49152, 576),):
    w = torch.randn(n, k, generator=g) * 0.05
    w4, w8 = quantize_weight_int4(w), quantize_weight_group_int8(w)
    x = torch.randn(40, k, generator=g).bfloat16()
    for name, f in (("int4", lambda r: int4_linear(r, w4)), ("int8", lambda r: group_int8_linear(r, w8, torch.float32))):
        single = torch.cat([f(x[i : i + 1]) for i in range(40)])
        bad = [m for m in (2, 3, 4, 5, 17, 33, 40) if not torch.equal(f(x[:m]), single[:m])]
        print(f"[{k} -> {n}] {name}: row counts whose bits differ from one row: {bad}")
