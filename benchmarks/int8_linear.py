"""Time one decode step's worth of int8 projections (30 SmolLM2 layers, weights too big for cache).

Compares ``torch._int_mm`` (what prefixcache uses), oneDNN's ``qlinear_pointwise`` with prepacked
weights (exact too: checked here bit for bit against ``_int_mm``) and ``_weight_int8pack_mm``
(weight-only int8), at one row; and the machine's read bandwidth (a 256 MB fp32 sum).

    .venv/bin/python benchmarks/int8_linear.py
"""

import timeit

import torch

from prefixcache.layers.quant import quantize_activations, quantize_weight

torch.set_num_threads(2)


def best_ms(f, n=10):
    for _ in range(3):  # warm-up
        f()
    return min(timeit.repeat(f, number=1, repeat=n)) * 1e3


layers = []
for _ in range(30):
    for n, k in ((1152, 576), (576, 576), (3072, 576), (576, 1536)):
        qw = quantize_weight(torch.randn(n, k) * 0.05)
        w_nk = qw.qweight.t().contiguous()
        layers.append((k, qw, w_nk, torch.ops.onednn.qlinear_prepack(w_nk, [1, k]), torch.zeros(n, dtype=torch.int64)))
x = {k: torch.randn(1, k) for k in (576, 1536)}


def int_mm():
    for k, qw, _, _, _ in layers:
        torch._int_mm(quantize_activations(x[k])[0], qw.qweight)


def qlinear():
    for k, qw, _, packed, zp in layers:
        xu = (quantize_activations(x[k])[0].to(torch.int16) + 128).to(torch.uint8)
        torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, packed, qw.scale, zp, None, 1.0, 0, torch.float32,
                                           "none", [], "")


def int8pack():
    for k, qw, w_nk, _, _ in layers:
        torch.ops.aten._weight_int8pack_mm(x[k], w_nk, qw.scale)


print(f"120 projections at 1 row: _int_mm {best_ms(int_mm):.1f} ms, qlinear_pointwise {best_ms(qlinear):.1f} ms, "
      f"_weight_int8pack_mm {best_ms(int8pack):.1f} ms")
k, qw, _, packed, zp = layers[2]
for m in (1, 3, 10, 300):
    xq, _ = quantize_activations(torch.randn(m, k))
    ref = torch._int_mm(xq, qw.qweight).float() * qw.scale
    got = torch.ops.onednn.qlinear_pointwise((xq.to(torch.int16) + 128).to(torch.uint8), 1.0, 128, packed, qw.scale,
                                             zp, None, 1.0, 0, torch.float32, "none", [], "")
    print(f"qlinear_pointwise == _int_mm at {m} rows: {torch.equal(got, ref)}")
a = torch.ones(64 * 1024 * 1024)
print(f"read bandwidth: {a.numel() * 4 / best_ms(a.sum, 5) / 1e6:.1f} GB/s")
