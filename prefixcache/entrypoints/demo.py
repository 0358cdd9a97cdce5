"""The seed demo: one shared system prompt, ten user questions, prefix caching off vs on.

Both runs use fresh engines on the same model, greedy decoding, 32 new tokens. The table shows
how many prompt tokens each run had to prefill and whether the answers are identical.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prefixcache.config import DEFAULT_MODEL
from prefixcache.llm import LLM
from prefixcache.models.loader import LoadedModel, load_model
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

MAX_TOKENS = 32


def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in QUESTIONS]


def run_demo(model: str = DEFAULT_MODEL, loaded: LoadedModel | None = None, **engine_options: Any) -> dict[str, Any]:
    """Runs the demo and returns its report (the keys of ``prefixcache demo --json``)."""
    loaded = loaded or load_model(model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    runs = {}
    for caching in (False, True):
        llm = LLM(model, loaded=loaded, enable_prefix_caching=caching, **engine_options)
        start = time.perf_counter()
        outputs = llm.chat(conversations(), params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        runs[caching] = (outputs, wall_s, llm.get_metrics())
    (off, wall_off, m_off), (on, wall_on, m_on) = runs[False], runs[True]
    report = {
        "num_requests": len(on),
        "prompt_tokens": sum(o.num_prompt_tokens for o in on),
        "prefill_tokens_no_cache": m_off.prompt_tokens_computed,
        "prefill_tokens_cache": m_on.prompt_tokens_computed,
        "saved_fraction": round(1 - m_on.prompt_tokens_computed / m_off.prompt_tokens_computed, 4),
        "hit_requests": m_on.num_hit_requests,
        "hit_rate": round(m_on.hit_rate, 4),
        "wall_s_no_cache": round(wall_off, 3),
        "wall_s_cache": round(wall_on, 3),
        "outputs_equal": [o.token_ids for o in off] == [o.token_ids for o in on],
        "answers": [{"question": q, "answer": o.text, "num_cached_tokens": o.num_cached_tokens}
                    for q, o in zip(QUESTIONS, on)],
    }
    return report


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    rows = [
        ("requests", report["num_requests"]),
        ("prompt tokens", report["prompt_tokens"]),
        ("prefill tokens computed, caching off", report["prefill_tokens_no_cache"]),
        ("prefill tokens computed, caching on", report["prefill_tokens_cache"]),
        ("prefill saved", f"{report['saved_fraction']:.1%}"),
        ("requests with a cache hit", f"{report['hit_requests']}/{report['num_requests']}"),
        ("wall time off / on (s)", f"{report['wall_s_no_cache']:.2f} / {report['wall_s_cache']:.2f}"),
        ("answers identical", "yes" if report["outputs_equal"] else "NO"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print()
    for i, a in enumerate(report["answers"], 1):
        print(f"{i:>2}. Q: {a['question']}\n    A: {a['answer'].strip()}  [cached {a['num_cached_tokens']} tokens]")
