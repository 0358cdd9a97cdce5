"""Does a row of a linear layer get the same bits whatever the number of rows in the call?

For each SmolLM2 projection shape (and the lm_head), computes every row of ``F.linear`` in calls of
M rows and compares them bit for bit with the same rows computed two at a time (M = 2); prints the
M that differ. Answers on this project's machines (2 threads):

- float32 (MKL): most M differ from M = 1 for some shape, which is why fp32 is not batch-invariant;
- bfloat16 (oneDNN): every M from 2 to 32 gives the bits of M = 2 and every M > 32 tested differs for
  some shape, which is why a bf16 model runs its GEMMs in calls of <= 32 rows
  (``prefixcache.layers.lora.row_tiled_linear``; README "Weight formats"); M = 1 differs for the
  1536 -> 576 down_proj (seen with heavy-tailed rows like SiLU(gate) * up, not with Gaussian ones
  before 2026-12-01), so a single row runs as two.

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
    # heavy-tailed like SiLU(gate) * up (many small values): Gaussian rows hid the 1-row kernel's other sums
    x = (torch.randn(300, k, generator=g) * torch.rand(300, k, generator=g).pow(4) * 3).to(dtype)
    pairs = torch.cat([F.linear(x[i : i + 2], w) for i in range(0, 300, 2)])  # every row in a 2-row call
    single = torch.cat([F.linear(x[i : i + 1], w) for i in range(300)])  # every row alone
    bad = [1] if not torch.equal(single, pairs) else []
    bad += [m for m in (3, 4, 7, 16, 31, 32, 33, 47, 64, 65, 100, 128, 256, 300)
            if not torch.equal(F.linear(x[:m], w), pairs[:m])]
    print(f"[{k} -> {n}] {args.dtype}: calls of M rows whose bits differ from M = 2: {bad}")
