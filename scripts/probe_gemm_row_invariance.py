"""Does a row of a linear layer get the same bits whatever the number of rows in the call?

For each SmolLM2 projection shape (and the lm_head), computes every row of ``F.linear`` in calls of
M rows and compares them bit for bit with the same rows computed one at a time (M = 1); prints the
M that differ. Answers on this project's machines (2 threads):

- float32 (MKL): most M differ from M = 1 for some shape, which is why fp32 is not batch-invariant;
- bfloat16 (oneDNN): every M <= 32 gives the bits of M = 1 and every M > 32 tested differs for
  some shape, which is why a bf16 model runs its GEMMs in calls of <= 32 rows
  (``prefixcache.layers.lora.row_tiled_linear``; README "Weight formats").

    .venv/bin/python scripts/probe_gemm_row_invariance.py [--dtype bfloat16]
"""

import argparse

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()
dtype = getattr(torch, args.dtype)
torch.set_num_threads(args.num_threads)
g = torch.Generator().manual_seed(0)
for n, k in ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)):
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(300, k, generator=g).to(dtype)
    single = torch.cat([F.linear(x[i : i + 1], w) for i in range(300)])
    bad = [m for m in (2, 3, 4, 7, 16, 31, 32, 33, 47, 64, 65, 100, 128, 256, 300)
           if not torch.equal(F.linear(x[:m], w), single[:m])]
    print(f"[{k} -> {n}] {args.dtype}: calls of M rows whose bits differ from M = 1: {bad}")
