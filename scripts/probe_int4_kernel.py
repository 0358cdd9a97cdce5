"""torch's 4-bit CPU kernel (``_weight_int4pack_mm_for_cpu``, what quantization="int4" runs for
generated tokens) vs oneDNN's prepacked bf16 product, over a whole SmolLM2 layer stack's projection
shapes (30 layers x q|k|v 576->960, o 576->576, gate|up 576->3072, down 1536->576; distinct random
weights, so they stream from memory as in a decode step), at 1 to 512 rows; and whether each row of
the int4 product has the bits of a one-row call.

Measured here (2026-12-01, 2 threads, idle): 1 row int4 6.1 ms vs bf16 25.6 ms for the stack; 10 rows
about equal (22.8 vs 22.1 ms); 512 rows int4 0.96 s vs bf16 0.08 s (why prompt tokens keep bf16);
every row count tested gives a row its one-row bits on every shape.

    .venv/bin/python scripts/probe_int4_kernel.py [--num-threads 2]
"""

import argparse
import timeit

import torch

from prefixcache.layers.quant import int4_linear, quantize_weight_int4

p = argparse.ArgumentParser()
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.num_threads)
g = torch.Generator().manual_seed(0)
shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))
int4, bf16 = [], []
for _ in range(30):
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        int4.append((k, quantize_weight_int4(w)))
        bf16.append((k, torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1)))


def best_ms(f, n=5) -> float:
    f()  # warm-up
    return min(timeit.repeat(f, number=1, repeat=n)) * 1e3


for m in (1, 4, 10, 64, 512):
    x = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
    t4 = best_ms(lambda: [int4_linear(x[k], w) for k, w in int4], 3 if m > 64 else 5)
    t16 = best_ms(lambda: [torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "") for k, w in bf16])
    print(f"{m:4d} rows, {len(int4)} projections: int4 {t4:8.1f} ms, bf16 prepacked {t16:7.1f} ms")
for n, k in shapes:
    w = quantize_weight_int4(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(40, k, generator=g).bfloat16()
    single = torch.cat([int4_linear(x[i : i + 1], w) for i in range(40)])
    bad = [m for m in (2, 3, 4, 5, 17, 33, 40) if not torch.equal(int4_linear(x[:m], w), single[:m])]
    print(f"[{k} -> {n}] row counts whose int4 bits differ from one row: {bad}")
