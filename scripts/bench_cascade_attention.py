"""One layer's decode attention for decodes sharing a prefix: cascade (shared run attended once) vs
each decode over its whole context (``MIN_CASCADE_KEYS`` raised so no group forms).

SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64), 16-token blocks, a shared prefix of
2,032 tokens in consecutive blocks and per-decode tails of 70-180 tokens (the speed bench's shape).

    .venv/bin/python scripts/bench_cascade_attention.py [--decodes 10] [--num-threads 2]
"""

import argparse
import random
import time

import torch

import prefixcache.layers.attention as attention
from prefixcache.layers.attention import Attention, build_attention_metadata

p = argparse.ArgumentParser()
p.add_argument("--decodes", type=int, default=10)
p.add_argument("--num-threads", type=int, default=2)
p.add_argument("--repeats", type=int, default=30)
args = p.parse_args()
torch.set_num_threads(args.num_threads)
HEADS, KV_HEADS, HEAD_DIM, BLOCK, SHARED = 9, 3, 64, 16, 2032
rng = random.Random(0)
num_blocks = 127 + args.decodes * 13 + 1
cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
shared = list(range(1, 128))  # 127 blocks = 2,032 tokens
free = list(range(128, num_blocks))
rng.shuffle(free)
seqs = []
for _ in range(args.decodes):
    ctx = SHARED + rng.randint(70, 180)
    own = [free.pop() for _ in range(-(-ctx // BLOCK) - len(shared))]
    seqs.append((ctx - 1, 1, shared + own))
q = torch.randn(args.decodes, HEADS, HEAD_DIM)
k = torch.randn(args.decodes, KV_HEADS, HEAD_DIM)
attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)


def timed(label: str) -> None:
    md, _ = build_attention_metadata(seqs, BLOCK, "cpu")
    with torch.inference_mode():
        attn(q, k, k, cache, md)
        start = time.perf_counter()
        for _ in range(args.repeats):
            attn(q, k, k, cache, md)
    ms = (time.perf_counter() - start) / args.repeats * 1e3
    print(f"{label}: {len(md.cascade_groups)} cascade group(s), {ms:.2f} ms per layer")


timed("cascade")
saved, attention.MIN_CASCADE_KEYS = attention.MIN_CASCADE_KEYS, 10**9
timed("whole contexts")
attention.MIN_CASCADE_KEYS = saved
