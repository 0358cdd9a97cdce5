"""oneDNN's prepacked bf16 linear (the weight reordered once, as torch.compile's CPU path does) vs the
plain one: same bits? invariant in the number of rows? faster at one row (a decode step)?

Measured here (2 threads, 2026-11-30): the prepacked product gives the bits of the plain one at one
row and the same bits for every call of 1..32 rows on every SmolLM2 shape (1536 -> 576 differs at
256 rows). 2026-12-01, 1 and 2 threads, with the fused shapes (q|k|v 576 -> 960, gate|up 576 -> 3072)
and every row count up to 128: the same bits as one row for 1..128 rows on every shape, and the
1536 -> 576 down_proj differs from 160 rows on: prefixcache calls it with at most 128 rows
(PREPACKED_ROW_TILE). 2026-12-01 later, with heavy-tailed activations (SiLU(gate) * up has many small
values; Gaussian ones hid it): a 1-row call of the 1536 -> 576 down_proj gets other bits than 2..128
rows for ~1 row in 10 (another kernel, other fp32 sums, seen where a sum sits near a bf16 rounding
midpoint), so row_tiled_linear never makes a 1-row call. This script now compares with 2-row calls. One idle run: ~1.6x faster at one row (0.065 vs 0.107 ms for
576 -> 1536; the plain bf16 path reorders the weight on every call, a likely reason why bf16 decode
loses to fp32 today); a rerun under load was inconclusive. Used since by the bf16 row-tiled path
(prefixcache.layers.lora.PrepackedWeight): whole-model prefill ~18 % faster, decode unchanged.

    .venv/bin/python scripts/probe_bf16_prepacked_linear.py
"""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
for n, k in ((576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576)):
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    # heavy-tailed like SiLU(gate) * up (many small values): Gaussian rows hid the 1-row kernel's other sums
    x = (torch.randn(300, k, generator=g) * torch.rand(300, k, generator=g).pow(4) * 3).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)

    def prepacked(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")

    single = torch.cat([prepacked(x[i : i + 1]) for i in range(300)])
    same_as_plain = torch.equal(single, torch.cat([F.linear(x[i : i + 1], w) for i in range(300)]))
    pairs = torch.cat([prepacked(x[i : i + 2]) for i in range(0, 300, 2)])  # every row in a 2-row call
    bad = [1] if not torch.equal(single, pairs) else []
    bad += [m for m in [*range(3, 129), 160, 256, 300] if not torch.equal(prepacked(x[:m]), pairs[:m])]
    times = {}
    for name, f in (("prepacked", lambda: prepacked(x[:1])), ("plain", lambda: F.linear(x[:1], w))):
        f()
        start = time.perf_counter()
        for _ in range(50):
            f()
        times[name] = (time.perf_counter() - start) / 50 * 1e3
    print(f"[{k} -> {n}] same bits as plain at 1 row: {same_as_plain}; row counts whose bits differ from 2 rows: "
          f"{bad}; 1 row: prepacked {times['prepacked']:.3f} ms, plain {times['plain']:.3f} ms")
