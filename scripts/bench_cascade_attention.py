"""One layer's decode attention for decodes sharing a prefix, every form side by side.

- fp32 (not batch-invariant): cascade (shared run attended once, merged by log-sum-exp) vs each
  decode over its whole context (``MIN_CASCADE_KEYS`` raised so no group forms);
- bf16 batch-invariant: the one-call form (each decode over its whole context padded to a multiple
  of 512 keys, torch's flash path, which prompt rows take where our prompt kernel doesn't run) vs int4's
  generated tokens' own kernel (``prefixcache.layers.generated_attention``: each row over its own
  blocks, shared blocks prepared once for the rows that share them).

SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64), 16-token blocks, a shared prefix of
2,032 tokens in consecutive blocks and per-decode tails of 70-180 tokens (the speed bench's shape).
The forms run in turn, ``--rounds`` times, and each reports its median (this machine's speed drifts).

    .venv/bin/python scripts/bench_cascade_attention.py [--decodes 10] [--num-threads 2]
"""

import argparse
import random
import statistics
import time

import torch

import prefixcache.layers.attention as attention
from prefixcache.layers.attention import Attention, build_attention_metadata
from prefixcache.layers.generated_attention import generated_attention

p = argparse.ArgumentParser()
p.add_argument("--decodes", type=int, default=10)
p.add_argument("--num-threads", type=int, default=2)
p.add_argument("--repeats", type=int, default=20)
p.add_argument("--rounds", type=int, default=5)
args = p.parse_args()
torch.set_num_threads(args.num_threads)
HEADS, KV_HEADS, HEAD_DIM, BLOCK, SHARED = 9, 3, 64, 16, 2032
rng = random.Random(0)
num_blocks = 127 + args.decodes * 13 + 40
cache32 = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
cache16 = cache32.to(torch.bfloat16)
shared = list(range(1, 128))  # 127 blocks = 2,032 tokens
free = list(range(128, num_blocks))
rng.shuffle(free)
seqs = []
for _ in range(args.decodes):
    ctx = SHARED + rng.randint(70, 180)
    own = [free.pop() for _ in range(-(-ctx // BLOCK) - len(shared))]
    seqs.append((ctx - 1, 1, shared + own))
q32, k32 = torch.randn(args.decodes, HEADS, HEAD_DIM), torch.randn(args.decodes, KV_HEADS, HEAD_DIM)
q16, k16 = q32.to(torch.bfloat16), k32.to(torch.bfloat16)
attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
prompt_lens = [SHARED + 1] * len(seqs)  # every decode a generated token


def metadata(form: str):
    if form == "fp32 whole contexts":
        saved, attention.MIN_CASCADE_KEYS = attention.MIN_CASCADE_KEYS, 10**9
        md = build_attention_metadata(seqs, BLOCK, "cpu")[0]
        attention.MIN_CASCADE_KEYS = saved
        return md
    if form == "fp32 cascade":
        return build_attention_metadata(seqs, BLOCK, "cpu")[0]
    return build_attention_metadata(seqs, BLOCK, "cpu", batch_invariant=True, dtype=torch.bfloat16,
                                    num_pool_blocks=num_blocks,
                                    num_prompt_tokens=prompt_lens if form == "bf16 generated (int4)" else None)[0]


def run(form: str, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """One layer's attention in ``form``: Attention (K/V write included), or for int4's generated rows
    the kernel as layers.generated_decoder calls it (its K/V write is in the decoder's C++)."""
    md = mds[form]
    if md.generated is None:
        return attn(q, k, k, cache, md)
    slots = (-1, KV_HEADS, HEAD_DIM)
    return generated_attention(q, cache[0].view(slots), cache[1].view(slots), md.generated, HEAD_DIM**-0.5)


FORMS = ["fp32 cascade", "fp32 whole contexts", "bf16 generated (int4)", "bf16 one call"]
mds = {form: metadata(form) for form in FORMS}
times: dict[str, list[float]] = {form: [] for form in FORMS}
with torch.inference_mode():
    for _ in range(args.rounds):
        for form in FORMS:
            q, k, cache = (q32, k32, cache32) if form.startswith("fp32") else (q16, k16, cache16)
            run(form, q, k, cache)
            start = time.perf_counter()
            for _ in range(args.repeats):
                run(form, q, k, cache)
            times[form].append((time.perf_counter() - start) / args.repeats * 1e3)
for form in FORMS:
    md = mds[form]
    shape = (f"{len(md.cascade_groups)} cascade group(s)" if md.generated is None else
             f"{md.generated.token_indices.numel()} generated rows, one kernel call")
    print(f"{form}: {shape}, {statistics.median(times[form]):.2f} ms per layer "
          f"(rounds: {', '.join(f'{t:.2f}' for t in times[form])})")
