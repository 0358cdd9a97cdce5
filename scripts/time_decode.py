"""Single-sequence decode, timed in-process: tokens per second of a 128-token greedy run and the model's
forward pass per token (the rest is the engine: scheduling, logits, sampling).

    .venv/bin/python scripts/time_decode.py [--dtype bfloat16] [--quantization int4] [--runs 3]

Measured 2026-12-01 (AMD EPYC, 2 threads, int4): 71-74 tok/s with the forward 11.7-12.0 ms per token
before the generated tokens' C++ decoder (commit b86de2f), 140-147 tok/s with 4.6-4.8 ms after (2b3413b).
"""

import argparse
import time

from prefixcache import LLM, SamplingParams
from prefixcache.models.llama import LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--quantization", default="int4")
p.add_argument("--num-threads", type=int, default=2)
p.add_argument("--tokens", type=int, default=128)
p.add_argument("--runs", type=int, default=3)
args = p.parse_args()
llm = LLM(quantization=args.quantization, dtype=args.dtype, num_threads=args.num_threads)
llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
forward, spent = LlamaForCausalLM.forward, [0.0, 0]


def timed_forward(self, *a, **kw):
    start = time.perf_counter()
    out = forward(self, *a, **kw)
    spent[0] += time.perf_counter() - start
    spent[1] += 1
    return out


LlamaForCausalLM.forward = timed_forward
params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
for _ in range(args.runs):
    spent[:] = [0.0, 0]
    start = time.perf_counter()
    llm.generate(["The capital of France is"], params, use_tqdm=False)
    total = time.perf_counter() - start
    print(f"{args.tokens / total:.1f} tok/s; forward {spent[0] / spent[1] * 1e3:.2f} ms per call "
          f"({spent[1]} calls), {total / args.tokens * 1e3:.2f} ms per token in all")
