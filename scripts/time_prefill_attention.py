"""Medians of repeated passes of SmolLM2's prompt attention over 30 separate pools (one per layer, so the
K/V streams from out of cache as in a step), in the form this CPU runs (AMX where it has it): one
150-token suffix over 2,032 cached keys (the warm TTFT's step) and a cold 2,178-token prefill. Uses only
the Attention module, so a copy runs in an older checkout for a before / after pair (2026-12-02: fcd9d25,
the softmax before, vs 90c97b6).

    .venv/bin/python scripts/time_prefill_attention.py [--passes 7] [--num-threads 2]
"""

import argparse
import statistics
import time

import torch

from prefixcache.layers.attention import Attention, build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 9, 3, 64, 16, 600, 30
SHAPES = {"1 x 150 over 2,032 cached keys": (2032, 150), "cold 2,178": (0, 2178)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(LAYERS)]
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # scattered, as a busy pool's are
    for name, (cached, new) in SHAPES.items():
        q = torch.randn(new, HEADS, HEAD_DIM, generator=gen).bfloat16()
        k, v = (torch.randn(new, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
        md, _ = build_attention_metadata([(cached, new, blocks)], BLOCK, "cpu", batch_invariant=True,
                                         dtype=torch.bfloat16, num_pool_blocks=NUM_BLOCKS, paged_kernel=True)
        times = []
        for _ in range(args.passes + 1):  # the first pass warms up
            start = time.perf_counter()
            for pool in pools:
                attn(q, k, v, pool, md)
            times.append(time.perf_counter() - start)
        print(f"{name}: median {statistics.median(times[1:]) * 1e3:.2f} ms per {LAYERS} layers "
              f"(paged kernel: {md.paged is not None})")


if __name__ == "__main__":
    main()
