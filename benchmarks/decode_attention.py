"""Generated rows' decode attention (``paged_decode_attention``), its two forms side by side, one layer.

The AVX512-BF16 form (keys in blocks of 32 in vector lanes, bf16 dot products, rows over the same
pool blocks in one work item that prepares each shared block once) against the float32 form (16-key
pieces, float32 products, shared blocks widened to float32 once per work item; what a CPU without AVX512-BF16 runs, and what every CPU ran before
2026-12-01), on SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64, 16-token blocks):

- ten decodes over a 2,032-token prefix in shared blocks with own tails of 70-169 tokens (the speed
  bench's 10 x 32 decode steps);
- one decode at a 100-, a 2,200- and an 8,100-token context (single-sequence and long-context decode).

The first column is ``paged_decode_attention`` as the model calls it: since 2026-12-01 a row past
4,096 keys takes the float32 form there too (the 8,100-token case's columns then agree bit for bit).
The forms alternate for ``--rounds`` rounds, each reports its median (this machine's speed drifts).
Needs a CPU with AVX512-BF16 for the first form (elsewhere both columns are the float32 form).
``--layers 30``: each timed pass calls it once per layer over 30 separate pools, as a decode step
does, so every layer's K/V comes from out of cache (the times are then per pass of all layers).

    .venv/bin/python benchmarks/decode_attention.py [--num-threads 2] [--rounds 7] [--layers 30]
"""

import argparse
import statistics
import time

import torch

from prefixcache.kernels.decode_attention import build_decode_rows, decode_attention

p = argparse.ArgumentParser()
p.add_argument("--num-threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=7)
p.add_argument("--layers", type=int, default=1, help="pools (layers) per timed pass: > 1 reads K/V out of cache")
args = p.parse_args()
torch.set_num_threads(args.num_threads)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
g = torch.Generator().manual_seed(0)
num_blocks = 2000 if args.layers == 1 else 600  # 600: the cases' highest block is 519
pools = [(torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16(),
          torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()) for _ in range(args.layers)]
calls_per_round = 100 if args.layers == 1 else 10
shared = list(range(127))  # 2,032 tokens
cases = {
    "10 decodes over a shared 2,032-token prefix": (
        [shared + list(range(200 + 20 * i, 220 + 20 * i)) for i in range(10)], [2032 + 70 + 11 * i for i in range(10)]),
    "1 decode, 100-token context": ([list(range(1, 8))], [100]),
    "1 decode, 2,200-token context": ([list(range(1, 150))], [2200]),
    "1 decode, 8,100-token context": ([list(range(1, 520))], [8100]),
}
for name, (tables, lens) in cases.items():
    width = max(len(t) for t in tables)
    rows = build_decode_rows(list(range(len(lens))), lens, torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             BLOCK, "cpu")
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g).bfloat16()
    times = {"bf16 form": [], "float32 form": []}
    outs = {}
    for _ in range(args.rounds):
        for form in times:
            def call():
                for k_slots, v_slots in pools:
                    out = decode_attention(q, k_slots, v_slots, rows, HEAD_DIM**-0.5, float32_form=form == "float32 form")
                return out
            for _ in range(2 if args.layers > 1 else 5):
                outs[form] = call()
            start = time.perf_counter()
            for _ in range(calls_per_round):
                call()
            times[form].append((time.perf_counter() - start) / calls_per_round * 1e3)
    b, f = statistics.median(times["bf16 form"]), statistics.median(times["float32 form"])
    diff = (outs["bf16 form"].float() - outs["float32 form"].float()).abs().max().item()
    per = "" if args.layers == 1 else f" per {args.layers} layers"
    print(f"{name}: bf16 form {b:.3f} ms, float32 form {f:.3f} ms{per} ({f / b:.2f}x); largest difference {diff:.4f}")
