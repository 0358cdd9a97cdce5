"""Where the speed bench's 10 x 32 run spends its time: each engine step's wall time and size.

The speed workload's 10 prompts over the 2,032-token system prompt, 32 greedy tokens each, all
submitted at once on an empty cache (as the bench's row), then again with every prompt cached.
Prints the steps that prefill (more tokens than sequences) and the decode steps' total and mean.

    .venv/bin/python scripts/trace_batch_steps.py [--dtype bfloat16] [--quantization int4] [--num-threads 2]
"""

import argparse
import time

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--quantization", default="int4")
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()
llm = LLM(dtype=args.dtype, quantization=args.quantization, num_threads=args.num_threads)
prompts = build_speed_prompts(llm.engine.tokenizer, 10)
runner = llm.engine.runner
execute_model = runner.execute_model
steps: list[tuple[float, int, int]] = []  # (seconds, sequences, tokens)


def timed_execute_model(scheduler_output):
    start = time.perf_counter()
    out = execute_model(scheduler_output)
    steps.append((time.perf_counter() - start, len(scheduler_output.seqs), scheduler_output.num_scheduled_tokens))
    return out


runner.execute_model = timed_execute_model
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate([prompts.short], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
for label in ("empty cache (the bench's row)", "every prompt cached"):
    if label.startswith("empty"):
        llm.reset_prefix_cache()
    steps.clear()
    start = time.perf_counter()
    llm.generate(prompts.shared, params, use_tqdm=False)
    wall = time.perf_counter() - start
    prefill = [(round(s, 3), n, t) for s, n, t in steps if t > n]
    decode = [s for s, n, t in steps if t == n]
    print(f"{label}: {wall:.2f} s, {320 / wall:.1f} tok/s, {len(steps)} steps; prefill steps (s, sequences, "
          f"tokens): {prefill}; {len(decode)} decode steps, {sum(decode):.2f} s, "
          f"{sum(decode) / max(1, len(decode)) * 1e3:.1f} ms each")
