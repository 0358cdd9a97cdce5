"""Which query rows of torch's CPU flash attention get other bits depending on their call?

On SmolLM2's head shape (9 query heads, 3 KV heads, head_dim 64), with keys padded to a multiple of 512
as the batch-invariant formats do: (1) for calls of M = 1..40 distinct query rows, how many rows differ
from the same query computed in a 16-row call; (2) over random prefill chunks (start, length), how many
rows differ from their 16-row bits when the chunk's rows are padded by the rule before 2026-12-01
(at least 3 rows, no 1- or 2-row block of 32) and by today's rule (``padded_num_queries``: 4..16 rows
or a multiple of 16). Measured here: calls of 2 and 3 rows, and 2- or 3-row tails after 16-row
sub-blocks, differ; today's rule leaves none.

    .venv/bin/python scripts/probe_attention_rows.py [--dtype float32]
"""

import argparse
import random

import torch
import torch.nn.functional as F

from prefixcache.layers.attention import padded_num_queries

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()
dtype = getattr(torch, args.dtype)
torch.set_num_threads(args.num_threads)
g = torch.Generator().manual_seed(0)
HEADS, KV_HEADS, HEAD_DIM, KEYS = 9, 3, 64, 1024
q = torch.randn(1, HEADS, 1000, HEAD_DIM, generator=g).to(dtype)
k = torch.randn(1, KV_HEADS, KEYS, HEAD_DIM, generator=g).to(dtype)
v = torch.randn(1, KV_HEADS, KEYS, HEAD_DIM, generator=g).to(dtype)


def attend(positions: list[int]) -> torch.Tensor:
    """Each position's query over keys 0..position (causal, keys padded to 1,024): [rows, heads, hd]."""
    pos = torch.tensor(positions)
    mask = torch.zeros(len(positions), KEYS, dtype=dtype).masked_fill_(torch.arange(KEYS)[None] > pos[:, None],
                                                                        float("-inf"))
    out = F.scaled_dot_product_attention(q[:, :, pos], k, v, attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True)
    return out[0].transpose(0, 1)


reference: dict[int, torch.Tensor] = {}


def differing(positions: list[int], num_real: int) -> int:
    out = attend(positions)
    for p in positions[:num_real]:
        if p not in reference:
            reference[p] = attend([p] * 16)[0]
    return sum(not torch.equal(out[i], reference[p]) for i, p in enumerate(positions[:num_real]))


rng = random.Random(0)
by_size = {}
for m in range(1, 41):
    rows = [differing(rng.sample(range(1000), m), m) for _ in range(6)]
    by_size[m] = sum(rows)
print("(1) rows differing from their 16-row bits, by call size (6 calls each):",
      {m: n for m, n in by_size.items() if n} or "none")


def old_rule(n: int) -> int:
    n = max(n, 3)
    rest = n % 32
    return n + 3 - rest if n > 32 and 0 < rest < 3 else n


for name, rule in (("before 2026-12-01", old_rule), ("padded_num_queries", padded_num_queries)):
    rng, bad, total = random.Random(1), 0, 0
    for _ in range(60):
        start, n = rng.randrange(0, 900), rng.choice([1, 2, 3, 5, 17, 18, 19, 33, 34, 35, 66, 99, 130, 200])
        n = min(n, 1000 - start)
        positions = list(range(start, start + n))
        positions += [positions[-1]] * (rule(n) - n)  # padding rows repeat the last query
        bad, total = bad + differing(positions, n), total + n
    print(f"(2) prefill chunks padded by the rule {name}: {bad} of {total} rows differ from their 16-row bits")
