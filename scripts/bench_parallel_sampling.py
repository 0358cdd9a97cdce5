"""Parallel sampling (n > 1, copy-on-write) vs n separate seeded requests, prefix caching on in both.

    .venv/bin/python scripts/bench_parallel_sampling.py --n 8 --max-tokens 16 --threads 2

Prints one JSON line per mode: prompt tokens computed, peak KV blocks, forks, copy-on-write copies,
wall seconds; and whether both modes produced the same samples (sample i uses seed + i).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from prefixcache.bench.texts import RAG_DOCUMENT
from prefixcache.llm import LLM
from prefixcache.sampling_params import SamplingParams


def run(mode: str, n: int, max_tokens: int, threads: int) -> tuple[dict, list[list[int]]]:
    llm = LLM("smollm2-135m", num_threads=threads)
    engine = llm.engine
    prompt = engine.tokenizer.encode(RAG_DOCUMENT[:2400] + "\nSummary:")

    def params(seed: int, k: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, seed=seed, n=k, max_tokens=max_tokens, ignore_eos=True)

    if mode == "fork":
        ids = [engine.add_request(prompt, params(1, n))]
    else:
        ids = [engine.add_request(prompt, params(1 + i, 1)) for i in range(n)]
    peak, finals, start = 0, {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id, out.index] = out.token_ids
        peak = max(peak, engine.num_blocks - engine.kv_cache_manager.num_free_blocks)
    wall = time.perf_counter() - start
    m = engine.get_metrics()
    row = {"mode": f"n={n} (fork + copy-on-write)" if mode == "fork" else f"{n} requests, seeds 1..{n}",
           "prompt_tokens": len(prompt), "prompt_tokens_computed": m.prompt_tokens_computed,
           "peak_kv_blocks": peak, "forks": m.num_forks, "cow_copies": m.num_cow_copies, "wall_s": round(wall, 2)}
    samples = [finals[k] for k in sorted(finals, key=lambda k: (ids.index(k[0]), k[1]))]
    return row, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    fork, fork_samples = run("fork", args.n, args.max_tokens, args.threads)
    separate, separate_samples = run("separate", args.n, args.max_tokens, args.threads)
    for row in (fork, separate):
        print(json.dumps(row))
    print(json.dumps({"samples_equal": fork_samples == separate_samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
