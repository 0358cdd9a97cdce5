"""Where the speed bench's warm TTFT goes, by wall-clock wrappers (no profiler): the system prompt cached
by the first of the bench's prompts, then the other nine one at a time (1 token each, as the bench's
warm TTFT), bf16 + int4-int8 unless told. Prints per request: the whole ``generate``, the model's
forward, and inside it the prompt attention, ``torch._int_mm``, ``int8_linear`` (``_int_mm`` plus
the int32 -> float rescale), the row quantization and the fused element-wise ops.

    .venv/bin/python scripts/time_warm_split.py [--quantization int4-int8] [--num-threads 2]

2026-12-03 (AMD EPYC, 2 threads): generate ~205-215 ms, forward ~183-200 ms; attention 91.5 ms,
``_int_mm`` 57.7, ``int8_linear`` 68.0, quantization 4.6, norms / RoPE / SwiGLU ~12 (README, "The
floor of the two goals still missed on this CPU").
"""

import argparse
import collections
import statistics
import time

import torch

import prefixcache.layers.quant as quant
import prefixcache.models.llama as llama
from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--quantization", default="int4-int8")
p.add_argument("--num-threads", type=int, default=2)
args = p.parse_args()

spent: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str, label: str | None = None) -> None:
    """Replaces ``owner.name`` by a wrapper adding its wall time to ``spent[label or name]``."""
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[label or name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


for name in ("quantize_activations", "int8_linear"):
    timed(quant, name)
for name in ("paged_prefill_attention", "add_rms_norm", "rope_write_kv", "silu_mul"):
    timed(llama, name)
timed(torch, "_int_mm")
llm = LLM(dtype=args.dtype, quantization=args.quantization, num_threads=args.num_threads)
timed(llama.LlamaForCausalLM, "forward")
prompts = build_speed_prompts(llm.engine.tokenizer, 10).shared
one_token = SamplingParams(temperature=0, max_tokens=1)
llm.generate([prompts[0]], one_token, use_tqdm=False)  # warm-up, and the system prompt cached
spent.clear()
totals = []
for prompt in prompts[1:]:
    start = time.perf_counter()
    llm.generate([prompt], one_token, use_tqdm=False)
    totals.append(time.perf_counter() - start)
n = len(totals)
print(f"generate: median {statistics.median(totals) * 1e3:.1f} ms, mean {sum(totals) / n * 1e3:.1f} ms per request")
for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(f"{name:28s} {seconds / n * 1e3:7.1f} ms per request")
