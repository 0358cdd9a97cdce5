"""Whether int8's SmoothQuant smoothing costs time: one process, an int4-int8 engine with the smoothing
and one without (``model.int8_smoothing = False``), alternating: a cold prefill of the speed bench's
2,178-token prompt, then one question's suffix over it (warm TTFT's prefill), six times each.

    .venv/bin/python scripts/time_int8_smoothing.py

Measured 2026-12-03 (AMD EPYC, 2 threads): cold medians 1.536 s smoothed vs 1.518 s plain, warm 0.199 s
vs 0.200 s.
"""

import statistics
import time

import torch

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts
from prefixcache.models.loader import load_model

torch.set_num_threads(2)
eng = {}
for on in (True, False):
    loaded = load_model("smollm2-135m", dtype=torch.bfloat16, quantization="none")
    loaded.model.int8_smoothing = on
    loaded.model.quantize("int4-int8")
    eng[on] = LLM("smollm2-135m", loaded=loaded, dtype="bfloat16", quantization="int4-int8", num_threads=2)
sp = build_speed_prompts(eng[True].engine.tokenizer, 10)
cold = sp.shared[0]; p1 = SamplingParams(temperature=0, max_tokens=1)
cold_t, warm_t = {True: [], False: []}, {True: [], False: []}
for on in (True, False): eng[on].generate([cold], p1, use_tqdm=False)
for i in range(6):
    for on in ((True, False) if i % 2 == 0 else (False, True)):
        e = eng[on]
        e.reset_prefix_cache()
        t = time.perf_counter(); e.generate([cold], p1, use_tqdm=False); cold_t[on].append(time.perf_counter() - t)
        q = sp.shared[1 + i % 9]
        t = time.perf_counter(); e.generate([q], p1, use_tqdm=False); warm_t[on].append(time.perf_counter() - t)
for on in (True, False):
    print("smooth" if on else "plain", "cold median", round(statistics.median(cold_t[on]), 3), "warm median", round(statistics.median(warm_t[on]), 4), [round(x, 3) for x in warm_t[on]])
