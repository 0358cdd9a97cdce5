"""C24, counted once: random schedules on a tiny random Llama (never the real model here).

Random arrivals sharing prefixes (so full-block and partial-block hits happen), aborts of waiting
and running requests, ``n > 1`` samples, failed steps, pool sizes small enough to make requests
wait for room and be preempted. After every drain, for our counters and the vLLM-named ones that
``/metrics`` exports:

    Δ queries == Σ prompt tokens of the requests admitted since the last drain
    Δ hits    == Σ cached_tokens their outputs reported (partial-block copies included)

A request aborted before its first admission is neither a query nor a hit (it reported 0).
"""

from __future__ import annotations

import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import EngineStats
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.openai.metrics import ServerMetrics
from prefixcache.models.fetch import default_model_dir
from prefixcache.models.loader import load_model
from prefixcache.sampling_params import SamplingParams
from tests.models.model_testlib import make_tiny_checkpoint

B = 4
BASES = [[10 + i for i in range(24)], [40 + i for i in range(24)]]  # two shared prefixes (ids < 256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (vocabulary 256) with the default model's tokenizer files beside it, so
    the engine can decode what it generates; built once per module."""
    out_dir = tmp_path_factory.mktemp("tiny-llama-c24")
    make_tiny_checkpoint(out_dir, "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, out_dir / name)
    return load_model(str(out_dir))


def vllm_and_ours(engine: LLMEngine) -> dict[str, float]:
    """The prefix-cache counters as ``/metrics`` renders them (ours and vLLM's names)."""
    text = ServerMetrics("tiny").render(EngineStats(engine.get_metrics(), 0, 0)).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.endswith(("prefix_cache_queries_total", "prefix_cache_hits_total"))}


arrival = st.fixed_dictionaries({
    "base": st.integers(0, len(BASES) - 1), "shared": st.sampled_from([0, 3, 4, 6, 8, 11, 12, 16, 20, 24]),
    "tail": st.integers(1, 6), "seed": st.integers(0, 255), "max_tokens": st.integers(1, 12),
    "n": st.sampled_from([1, 1, 1, 2]),
})
step_event = st.one_of(
    st.tuples(st.just("add"), arrival),
    st.tuples(st.just("add"), arrival),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("fail"), st.none()),
    st.tuples(st.just("drain"), st.none()),
)


def prompt_of(a: dict) -> list[int]:
    tail = [(a["seed"] * 7 + 13 * i) % 180 + 70 for i in range(a["tail"])]
    return BASES[a["base"]][: a["shared"]] + tail


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(num_blocks=st.integers(6, 16), max_num_seqs=st.integers(2, 4), budget=st.integers(6, 32),
       partial=st.booleans(), events=st.lists(step_event, min_size=4, max_size=24))
def test_c24_counted_once_under_waiting_preemption_abort_and_failure(tiny, num_blocks, max_num_seqs, budget, partial,
                                                                      events):
    engine = LLMEngine(EngineConfig(model=str(tiny.model_dir), block_size=B, num_blocks=num_blocks,
                                    max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                    enable_partial_block_reuse=partial, num_threads=1), loaded=tiny)
    requests = {}  # request id -> its engine Request (sample 0), to tell whether it was admitted
    reported: dict[str, int] = {}  # request id -> the cached_tokens its outputs reported
    drained: set[str] = set()  # requests accounted in an earlier drain
    fail_next = False
    real_execute = engine.runner.execute_model

    def execute(out):
        nonlocal fail_next
        if fail_next:
            fail_next = False
            raise RuntimeError("injected step failure")
        return real_execute(out)

    engine.runner.execute_model = execute
    last = {"queries": 0, "hits": 0, "vllm": vllm_and_ours(engine)}

    def collect(outputs) -> None:
        for out in outputs:
            if out.finished and out.index == 0:
                reported[out.request_id] = out.num_cached_tokens

    def drain() -> None:
        while engine.has_unfinished_requests():
            collect(engine.step())
        new = [rid for rid in requests if rid not in drained]
        admitted = [rid for rid in new if requests[rid].num_cached_tokens is not None]
        m = engine.get_metrics()
        assert m.prefix_cache_queries - last["queries"] == sum(requests[rid].num_prompt_tokens for rid in admitted)
        assert m.prefix_cache_hits - last["hits"] == sum(reported[rid] for rid in new)
        assert all(reported[rid] == 0 for rid in new if rid not in admitted)
        assert 0 <= m.prefix_cache_partial_hits <= m.prefix_cache_hits <= m.prefix_cache_queries
        named = vllm_and_ours(engine)
        for prefix in ("prefixcache:", "vllm:"):
            for counter, ours in (("queries", m.prefix_cache_queries), ("hits", m.prefix_cache_hits)):
                name = f"{prefix}prefix_cache_{counter}_total"
                assert named[name] == ours
                assert named[name] - last["vllm"][name] == ours - last[counter]
        drained.update(new)
        last.update(queries=m.prefix_cache_queries, hits=m.prefix_cache_hits, vllm=named)

    for kind, arg in events:
        if kind == "add":
            prompt = prompt_of(arg)
            if -(-(len(prompt) + arg["max_tokens"]) // B) * arg["n"] > num_blocks:
                continue  # refused at add: would never fit the pool
            rid = f"r{len(requests)}"
            params = SamplingParams(temperature=0, max_tokens=arg["max_tokens"], n=arg["n"], ignore_eos=True)
            engine.add_request(prompt, params, request_id=rid)
            requests[rid] = engine.scheduler.requests[rid]  # sample 0 (its samples fork from it)
        elif kind == "step":
            for _ in range(arg):
                if engine.has_unfinished_requests():
                    collect(engine.step())
        elif kind == "abort" and requests:
            rid = f"r{arg % len(requests)}"
            collect(engine.abort_request_samples(rid))
        elif kind == "fail":
            fail_next = True
        elif kind == "drain":
            drain()
    fail_next = False
    drain()
    assert engine.kv_cache_manager.num_free_blocks == num_blocks
    m = engine.get_metrics()  # what the schedule exercised (pytest --hypothesis-show-statistics)
    for name, happened in (("a preemption", m.num_preemptions), ("a partial-block hit", m.prefix_cache_partial_hits),
                           ("a full-block hit", m.prefix_cache_hits - m.prefix_cache_partial_hits),
                           ("an abort before admission", any(r.num_cached_tokens is None for r in requests.values())),
                           ("a failed request", any(r.status.name == "FINISHED_ERROR" for r in requests.values()))):
        if happened:
            note_event(name)


def test_the_tiny_engine_really_hits_and_copies(tiny):
    """The schedules above exercise every kind of hit: a full block and a partial-block copy."""
    engine = LLMEngine(EngineConfig(model=str(tiny.model_dir), block_size=B, num_blocks=16, num_threads=1),
                       loaded=tiny)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    outs = []
    for prompt in (BASES[0][:10], BASES[0][:7] + [200]):
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    assert [o.num_cached_tokens for o in outs] == [0, 7]  # 1 full block + 3 copied
    m = engine.get_metrics()
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.prefix_cache_partial_hits) == (18, 7, 3)
