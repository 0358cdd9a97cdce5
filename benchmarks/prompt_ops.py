"""Prompt rows with the fused element-wise ops (kernels/prompt_ops.py) vs torch's ops, in one process.

The speed bench's prompts on the default model: cold TTFT of the ~2,180-token first prompt, warm TTFT
of the others (the 2,032-token prefix cached), and the ten prompts' suffixes as one step (prefix
cached, 1 token each). The two forms alternate round by round (this machine's speed drifts); each
round starts from an empty cache, so every K/V a run reuses was computed in its own form. Medians.

    .venv/bin/python benchmarks/prompt_ops.py [--dtype bfloat16] [--quantization int4] [--rounds 4]
"""

import argparse
import statistics
import time

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts


def one_round(llm: LLM, shared: list[list[int]]) -> dict[str, float]:
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.reset_prefix_cache()
    cold = llm.generate([shared[0]], one, use_tqdm=False)[0].ttft_s
    warm = statistics.median(llm.generate([p], one, use_tqdm=False)[0].ttft_s for p in shared[1:6])
    llm.reset_prefix_cache()
    llm.generate([shared[0][:2032]], one, use_tqdm=False)  # the shared prefix, cached
    start = time.perf_counter()
    llm.generate(shared, one, use_tqdm=False)
    return {"cold TTFT": cold, "warm TTFT": warm, "10 suffixes": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, quantization=args.quantization, num_threads=args.num_threads)
    model = llm.engine.runner.model.model
    if not llm.engine.runner.model.paged_attention:
        raise SystemExit("this model does not run the fused ops here (needs bf16 on a CPU with AVX512-BF16)")
    shared = build_speed_prompts(llm.engine.tokenizer, 10).shared
    llm.generate([shared[0][:64]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    times: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for fused in ((True, False) if r % 2 == 0 else (False, True)):
            model.fused_prompt_ops = fused
            times[fused].append(one_round(llm, shared))
    model.fused_prompt_ops = True
    print(f"{'(s, median of ' + str(args.rounds) + ')':<24}{'fused ops':>11}{'torch ops':>11}{'ratio':>8}")
    for name in times[True][0]:
        a, b = (statistics.median(t[name] for t in times[f]) for f in (True, False))
        print(f"{name:<24}{a:>11.3f}{b:>11.3f}{b / a:>8.2f}")


if __name__ == "__main__":
    main()
