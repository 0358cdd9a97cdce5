"""One layer's chunked decode attention (int4's generated tokens) for chunk sizes 128, 256 and 512.

SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64), bf16, 16-token blocks, three cases:
10 decodes over a shared 2,032-token prefix (consecutive blocks) with 70-180 tokens of their own
(scattered blocks), one decode over a short context (70-180 keys), one decode at an 8,000-token
context. ``chunked_attention.CHUNK_KEYS`` is set per size; the sizes run in turn, ``--rounds``
times, and each reports its median (this machine's speed drifts).

    .venv/bin/python scripts/bench_chunk_sizes.py [--num-threads 2] [--rounds 5]
"""

import argparse
import random
import statistics
import time

import torch

import prefixcache.layers.chunked_attention as chunked_attention
from prefixcache.layers.attention import Attention, build_attention_metadata

p = argparse.ArgumentParser()
p.add_argument("--num-threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--repeats", type=int, default=20)
args = p.parse_args()
torch.set_num_threads(args.num_threads)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SIZES = (128, 256, 512)
attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)


def case(decodes: int, shared_len: int):
    """(pool, q, k, {size: metadata}) for ``decodes`` generated tokens over a ``shared_len``-token prefix."""
    rng = random.Random(0)
    num_shared = shared_len // BLOCK
    num_blocks = num_shared + decodes * 13 + 80
    pool = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    shared, free = list(range(1, num_shared + 1)), list(range(num_shared + 1, num_blocks))
    rng.shuffle(free)
    seqs = []
    for _ in range(decodes):
        ctx = shared_len + rng.randint(70, 180)
        seqs.append((ctx - 1, 1, shared + [free.pop() for _ in range(-(-ctx // BLOCK) - num_shared)]))
    mds = {}
    for size in SIZES:
        chunked_attention.CHUNK_KEYS = size
        mds[size] = build_attention_metadata(seqs, BLOCK, "cpu", batch_invariant=True, dtype=torch.bfloat16,
                                             num_pool_blocks=num_blocks,
                                             num_prompt_tokens=[shared_len + 1] * decodes)[0]
    q, k = torch.randn(decodes, HEADS, HEAD_DIM).bfloat16(), torch.randn(decodes, KV_HEADS, HEAD_DIM).bfloat16()
    return pool, q, k, mds


default = chunked_attention.CHUNK_KEYS
cases = {"10 decodes over a shared 2,032-token prefix": case(10, 2032),
         "1 decode, 70-180 keys": case(1, 0), "1 decode, ~8,100 keys": case(1, 8000)}
with torch.inference_mode():
    for name, (pool, q, k, mds) in cases.items():
        times = {size: [] for size in SIZES}
        for _ in range(args.rounds):
            for size in SIZES:
                chunked_attention.CHUNK_KEYS = size
                attn(q, k, k, pool, mds[size])
                start = time.perf_counter()
                for _ in range(args.repeats):
                    attn(q, k, k, pool, mds[size])
                times[size].append((time.perf_counter() - start) / args.repeats * 1e3)
        print(f"{name}: " + ", ".join(
            f"{size}-key chunks {statistics.median(times[size]):.2f} ms ({mds[size].chunked.job_rows.numel()} own "
            f"chunks, {sum(g.num_chunks for g in mds[size].chunked.shared)} shared)" for size in SIZES))
chunked_attention.CHUNK_KEYS = default
