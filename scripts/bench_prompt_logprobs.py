"""TTFT of a request with ``prompt_logprobs`` over a cached 2,032-token prefix: served from the
cache (the blocks' stored entries) vs cold (what skipping the cache, vLLM's choice, costs), and a
plain warm request for reference. The speed bench's prompts (system prompt + customer message).

    .venv/bin/python scripts/bench_prompt_logprobs.py [--dtype float32] [--num-threads 2]
"""

import argparse
import statistics

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="float32")
p.add_argument("--num-threads", type=int, default=2)
p.add_argument("--k", type=int, default=5)
args = p.parse_args()
llm = LLM(dtype=args.dtype, num_threads=args.num_threads)
prompts = build_speed_prompts(llm.engine.tokenizer, 10, 2032, None).shared
with_lps = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=args.k)
plain = SamplingParams(temperature=0, max_tokens=1)


def ttft(prompt, params):
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return out.ttft_s, out.num_cached_tokens, out.num_cached_prompt_logprobs


llm.generate([prompts[0][:64]], plain, use_tqdm=False)  # warm-up
cold = []
for prompt in prompts[1:4]:
    llm.reset_prefix_cache()
    cold.append(ttft(prompt, with_lps)[0])
llm.reset_prefix_cache()
ttft(prompts[0], plain)  # caches the prefix
warm_plain = [ttft(prompt, plain)[0] for prompt in prompts[1:]]
llm.reset_prefix_cache()
ttft(prompts[0], with_lps)  # caches the prefix with its entries
warm = [ttft(prompt, with_lps) for prompt in prompts[1:]]
print(f"prompt tokens {len(prompts[1])}-{max(map(len, prompts))}, k={args.k}, {args.dtype}")
print(f"cold (nothing reused), median of {len(cold)}: {statistics.median(cold):.3f} s")
print(f"warm, entries from the cache (cached tokens {warm[0][1]}, cached entries {warm[0][2]}), "
      f"median of {len(warm)}: {statistics.median(w[0] for w in warm):.3f} s")
print(f"warm without prompt_logprobs, median of {len(warm_plain)}: {statistics.median(warm_plain):.3f} s")
