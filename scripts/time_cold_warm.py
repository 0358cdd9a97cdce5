"""Cold prefill of the speed bench's 2,178-token prompt and one question's suffix over it (the warm
TTFT's prefill), four times each in one process, int4-int8 on bf16: for comparing commits in
alternating processes (a worktree of the other commit on PYTHONPATH), where the side-by-side bench's
runs minutes apart drift with the machine.

    PYTHONPATH=/path/to/worktree .venv/bin/python scripts/time_cold_warm.py

2026-12-03: 81ee28a cold 1.52-1.67 / 1.49-1.57 s, d9f3172 1.47-1.53 / 1.42-1.58 s; warm 0.18-0.23 s both.
"""

import time

import torch

import prefixcache
from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts

torch.set_num_threads(2)
llm = LLM(dtype="bfloat16", quantization="int4-int8", num_threads=2)
prompts = build_speed_prompts(llm.engine.tokenizer, 10).shared
one_token = SamplingParams(temperature=0, max_tokens=1)
llm.generate([prompts[0]], one_token, use_tqdm=False)  # warm-up
cold, warm = [], []
for i in range(4):
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate([prompts[0]], one_token, use_tqdm=False)
    cold.append(time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate([prompts[1 + i]], one_token, use_tqdm=False)  # its system prompt now cached
    warm.append(time.perf_counter() - start)
print(prefixcache.__file__, "cold", [round(x, 3) for x in cold], "warm", [round(x, 3) for x in warm], flush=True)
