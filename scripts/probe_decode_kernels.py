"""Two kernel facts behind issue 12's decode notes (SmolLM2 shapes, bf16, ``--num-threads``):

1. torch's CPU flash-attention kernel per 512-key entry (3 KV heads, head_dim 64) for 3 to 90 query
   rows per KV head: the cost follows the entries (K/V handled per entry), hardly the rows;
2. the lm_head (49,152 x 576) as bf16 ``F.linear`` vs torch's int8 weight-only kernel
   (``_weight_int8pack_mm``) vs our int4 product (``int4_linear``, int8 activations; torch's
   ``_weight_int4pack_mm_for_cpu`` before 2026-12-01) for 1 to 32 rows.

    .venv/bin/python scripts/probe_decode_kernels.py [--num-threads 2]
"""

import argparse
import timeit

import torch
import torch.nn.functional as F

from prefixcache.layers.quant import int4_linear, quantize_weight_int4

p = argparse.ArgumentParser()
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.num_threads)
g = torch.Generator().manual_seed(0)


def best_us(f, n=30) -> float:
    f()  # warm-up
    return min(timeit.repeat(f, number=1, repeat=n)) * 1e6


for entries, rows in ((1, 3), (10, 3), (20, 3), (1, 30), (3, 30), (1, 90)):
    q, k, v = (torch.randn(entries, 3, n, 64, generator=g).bfloat16() for n in (rows, 512, 512))
    bias = torch.zeros(entries, 1, 1, 512, dtype=torch.bfloat16)
    us = best_us(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias,
                                                                                      scale=0.125))
    print(f"flash attention, {entries:2d} entries x 512 keys, {rows:2d} rows: {us:7.0f} us "
          f"({us / entries:4.0f} us per entry)")
w = (torch.randn(49152, 576, generator=g) * 0.05).bfloat16()
scales = w.float().abs().amax(1) / 127
w8, s8 = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8), scales.bfloat16()
w4 = quantize_weight_int4(w)
for m in (1, 3, 10, 32):
    x = torch.randn(m, 576, generator=g).bfloat16()
    t16, t8, t4 = (best_us(f) / 1e3 for f in (lambda: F.linear(x, w),
                                               lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8),
                                               lambda: int4_linear(x, w4)))
    print(f"lm_head, {m:2d} rows: bf16 {t16:.2f} ms, int8 weight-only {t8:.2f} ms, int4 {t4:.2f} ms")
