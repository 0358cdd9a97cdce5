"""The seed demo: one shared system prompt, ten user questions, prefix caching off vs on.

Both runs use fresh engines on the same model, greedy decoding, 32 new tokens. The table shows
how many prompt tokens each run had to prefill and whether the answers are identical. With
``progress``, a tqdm bar per run counts generated tokens on stderr (stdout stays the report).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tqdm.auto import tqdm

from prefixcache.config import DEFAULT_MODEL, EngineConfig
from prefixcache.kernels.cpu_features import describe_cpu
from prefixcache.llm import LLM
from prefixcache.outputs import RequestOutput
from prefixcache.models.loader import LoadedModel, check_model_arg, load_model
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

MAX_TOKENS = 32


def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in QUESTIONS]


def generate_with_progress(llm: LLM, prompts: list[list[int]], params: SamplingParams, desc: str,
                           progress: bool) -> list[RequestOutput]:
    """``llm.generate(prompts, params)`` driven step by step, a tqdm bar on stderr counting the
    generated tokens (``len(prompts) * max_tokens`` at most; a request that stops early fills its
    share). The bar is off when ``progress`` is False or stderr is not a terminal."""
    engine = llm.engine
    ids = [engine.add_request(p, params, stream=True) for p in prompts]
    done: dict[str, RequestOutput] = {}
    counted = dict.fromkeys(ids, 0)
    with tqdm(total=len(ids) * params.max_tokens, desc=desc, unit="tok", file=sys.stderr,
              disable=None if progress else True, leave=True) as bar:
        while len(done) < len(ids):
            for out in engine.step():
                if out.finish_reason == "error":
                    raise RuntimeError(out.error)
                now = params.max_tokens if out.finished else len(out.token_ids)
                bar.update(now - counted[out.request_id])
                counted[out.request_id] = now
                if out.finished:
                    done[out.request_id] = out
    return [done[i] for i in ids]


def run_demo(model: str = DEFAULT_MODEL, loaded: LoadedModel | None = None, progress: bool = False,
             **engine_options: Any) -> dict[str, Any]:
    """Runs the demo and returns its report (the keys of ``prefixcache demo --json``).

    Args:
        model: built-in name, local HF directory or .gguf file (loaded unless ``loaded`` is given).
        loaded: an already loaded model.
        progress: tqdm bars on stderr (model load, then generated tokens of each run).
        engine_options: more :class:`~prefixcache.config.EngineConfig` fields (``num_threads``...).

    Raises:
        InvalidInputError: a bad engine option, naming it (before the model loads).
        ValueError: a missing model path or a Hub id (before anything loads).
    """
    config = EngineConfig.from_kwargs(model=model, **engine_options)  # every option checked before the load
    fmt = f"dtype {config.dtype}, quantization {config.quantization}"
    if loaded is None:
        check_model_arg(model)  # a missing path or a Hub id: one clear error before anything loads
        if progress:
            print(f"prefixcache demo: loading {model} ({fmt}; {describe_cpu()}) ...", file=sys.stderr, flush=True)
        loaded = load_model(model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    runs = {}
    for caching in (False, True):
        llm = LLM(model, loaded=loaded, enable_prefix_caching=caching, **engine_options)
        prompts = [llm.apply_chat_template(c) for c in conversations()]
        start = time.perf_counter()
        outputs = generate_with_progress(llm, prompts, params, f"caching {'on' if caching else 'off'}", progress)
        wall_s = time.perf_counter() - start
        runs[caching] = (outputs, wall_s, llm.get_metrics())
    (off, wall_off, m_off), (on, wall_on, m_on) = runs[False], runs[True]
    report = {
        "format": fmt,
        "cpu": describe_cpu(),
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
        ("format", f"{report['format']} ({report['cpu']})"),
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
