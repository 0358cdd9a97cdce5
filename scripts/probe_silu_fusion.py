"""Warm TTFT in one process with the AMX gate|up product's fused silu(gate) * up store on and off
(``PrepackedWeight.silu_linear`` patched to None for "unfused", which then runs the product and
``prompt_ops.silu_mul`` separately: the same bits). The speed bench's warm-TTFT prompts (a 2,032-token
system prompt cached, then each of 9 prompts' ~150-token suffix, 1 token each), alternating rounds, the
prefix cache reset and the system prompt re-cached before each round; medians over the rounds.

    .venv/bin/python scripts/probe_silu_fusion.py [--rounds 4] [--num-threads 2]
"""

import argparse
import statistics
import time

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts
from prefixcache.layers.amx_gemm import amx_gemm_supported
from prefixcache.layers.lora import PrepackedWeight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    if not amx_gemm_supported():
        raise SystemExit("this CPU has no AMX-BF16 tiles (or PREFIXCACHE_AMX=0): no fused form to compare")
    fused = PrepackedWeight.silu_linear
    llm = LLM(quantization="int4", dtype="bfloat16", num_threads=args.num_threads)
    prompts = build_speed_prompts(llm.engine.tokenizer, 10).shared
    one = SamplingParams(temperature=0, max_tokens=1)
    times: dict[str, list[float]] = {"fused": [], "unfused": []}
    for _ in range(args.rounds):
        for mode in times:
            PrepackedWeight.silu_linear = fused if mode == "fused" else (lambda self, x: None)
            assert llm.engine.reset_prefix_cache()
            llm.generate(prompts[:1], one, use_tqdm=False)  # the system prompt cached
            for prompt in prompts[1:]:
                start = time.perf_counter()
                llm.generate([prompt], one, use_tqdm=False)
                times[mode].append(time.perf_counter() - start)
    for mode, ts in times.items():
        print(f"{mode:>8}: warm TTFT median {statistics.median(ts):.4f} s, min {min(ts):.4f} s ({len(ts)} requests)")


if __name__ == "__main__":
    main()
