"""int4's generated tokens with the chunked (shared-prefix) attention vs the one-call form, end to end.

The same int4 model in one process (and a bf16 one beside it), the forms in turn for ``--rounds``
rounds: the speed bench's 10 prompts over the 2,032-token system prompt, all prompts already cached
(so the 32 greedy decode steps dominate), then a short prompt's single-sequence decode. "one call"
builds the attention metadata without ``num_prompt_tokens``, so every row takes the one-call form
(the bits differ; both are batch-invariant forms); "512-key chunks" sets
``chunked_attention.CHUNK_KEYS`` to 512 (the chunk size before 2026-12-01's 256). Prints medians.

    .venv/bin/python scripts/bench_int4_chunked.py [--rounds 3] [--num-threads 2]
"""

import argparse
import statistics
import time

import prefixcache.layers.chunked_attention as chunked_attention
import prefixcache.runner.model_runner as model_runner
from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


chunked_metadata = model_runner.build_attention_metadata


def one_call_metadata(*a, **k):
    return chunked_metadata(*a, **{**k, "num_prompt_tokens": None})


llms = {q: LLM(dtype="bfloat16", quantization=q, num_threads=args.num_threads) for q in ("none", "int4")}
prompts = build_speed_prompts(llms["none"].engine.tokenizer, 10)
prefix = prompts.shared[0][: prompts.prefix_tokens]
CHUNK_KEYS = chunked_attention.CHUNK_KEYS
forms = [("bf16", "none", chunked_metadata, CHUNK_KEYS),
         (f"int4 chunked ({CHUNK_KEYS}-key chunks)", "int4", chunked_metadata, CHUNK_KEYS),
         ("int4 chunked (512-key chunks)", "int4", chunked_metadata, 512),
         ("int4 one call", "int4", one_call_metadata, CHUNK_KEYS)]
for llm in llms.values():
    llm.generate([prompts.short], greedy(2), use_tqdm=False)  # warm-up
batch_s = {name: [] for name, *_ in forms}
decode_ms = {name: [] for name, *_ in forms}
for _ in range(args.rounds):
    for name, quant, metadata, chunk_keys in forms:
        model_runner.build_attention_metadata = metadata
        chunked_attention.CHUNK_KEYS = chunk_keys
        llm = llms[quant]
        llm.reset_prefix_cache()
        llm.generate([prefix], greedy(1), use_tqdm=False)
        llm.generate(prompts.shared, greedy(1), use_tqdm=False)  # every prompt's full blocks cached
        start = time.perf_counter()
        llm.generate(prompts.shared, greedy(32), use_tqdm=False)
        batch_s[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate([prompts.short], greedy(65), use_tqdm=False)
        decode_ms[name].append((time.perf_counter() - start) / 65 * 1e3)
model_runner.build_attention_metadata, chunked_attention.CHUNK_KEYS = chunked_metadata, CHUNK_KEYS
for name, *_ in forms:
    s = statistics.median(batch_s[name])
    print(f"{name}: 10 x 32 with the prompts cached {s:.2f} s ({320 / s:.1f} tok/s; rounds "
          f"{', '.join(f'{x:.2f}' for x in batch_s[name])}); single-sequence decode "
          f"{statistics.median(decode_ms[name]):.1f} ms/token")
