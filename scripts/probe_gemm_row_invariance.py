"""Does a row of an fp32 linear layer get the same bits whatever the number of rows in the call?

For each SmolLM2 projection shape, computes rows of ``F.linear`` in calls of M rows and compares
them bit for bit with the same rows computed in a call of 64; prints the (M, offset) that differ.
(The answer on this project's machines: M = 1, 2, 3, 4, 7, 16, 500, 2048 differ for some shapes,
which is why fp32 is not batch-invariant and the int8 format is; README "Weight formats".)

    .venv/bin/python scripts/probe_gemm_row_invariance.py
"""

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
for k, n in ((576, 1152), (576, 3072), (1536, 576), (576, 49152)):
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(2100, k, generator=g)
    ref = F.linear(x[:64], w)
    bad = []
    for m in (1, 2, 3, 4, 7, 16, 64, 100, 500, 2048):
        for off in (0, 2048 - m if m < 2048 else 0):
            lo, hi = off, min(off + m, 64)
            if hi > lo and not torch.equal(F.linear(x[off:off + m], w)[: hi - lo], ref[lo:hi]):
                bad.append((m, off))
    print(f"[{k} -> {n}] rows whose bits depend on the call (M, offset): {bad}")
