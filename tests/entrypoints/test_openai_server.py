"""The OpenAI-compatible server, end to end: real model, real uvicorn, real `openai` client."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import MODEL, start_server, stop_server

B = 16  # block size of the test server
SYSTEM = (
    "You are the reference librarian of a small town library. The library opens at nine in the "
    "morning and closes at six in the evening, except on Sundays when it is closed all day. Members "
    "may borrow up to five books at a time for three weeks, renew them twice online, and reserve new "
    "titles at the front desk. Answer every question briefly and politely, in one sentence."
)
QUESTIONS = [
    "When does the library open?", "How many books can I borrow?", "Can I renew a book online?",
    "Is the library open on Sunday?", "How long is the loan period?", "Where do I reserve a title?",
    "What time does it close?", "How many renewals are allowed?", "Who should I ask for help?",
    "Can I borrow six books?", "Is there a front desk?", "Do you open on Saturday?",
    "How do I get a card?", "Can children borrow books?", "Are there late fees?", "What is a loan?",
]


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def chat_ids(server, messages) -> list[int]:
    tok = server.engine.engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def expected_cached(prefix_ids: list[int], prompt_ids: list[int]) -> int:
    """Full blocks of the shared prefix, never the block holding the prompt's last token."""
    n = 0
    while n < min(len(prefix_ids), len(prompt_ids)) and prefix_ids[n] == prompt_ids[n]:
        n += 1
    return min(n // B, (len(prompt_ids) - 1) // B) * B


def test_health_and_models(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_text_and_token_ids(server, client):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason in ("length", "stop")
    ids = server.engine.engine.tokenizer.encode(prompt)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == out.choices[0].text
    assert by_ids.usage.prompt_tokens_details.cached_tokens == expected_cached(ids, ids)


def test_chat_cached_tokens_and_salt(server, client):
    system = "Case C1 on the server. " + SYSTEM
    first = chat(system, QUESTIONS[0])
    second = chat(system, QUESTIONS[1])

    def run(messages, salt=None):
        extra = {"cache_salt": salt} if salt is not None else None
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body=extra)
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
        assert r.usage.prompt_tokens == len(chat_ids(server, messages))
        return r.usage.prompt_tokens_details.cached_tokens

    assert run(first, "alpha") == 0
    shared = expected_cached(chat_ids(server, first), chat_ids(server, second))
    assert shared >= 4 * B  # the system prompt spans several blocks
    assert run(second, "alpha") == shared  # same system prompt, same salt: full shared blocks hit
    assert run(second, "beta") == 0  # a different salt never shares
    assert run(second) == 0  # nor does no salt
    assert run(second, "alpha") == expected_cached(chat_ids(server, second), chat_ids(server, second))


def test_c1_salts_on_completions(server, client):
    tok = server.engine.engine.tokenizer
    ids = tok.encode("Salted prompt for case C1. " + SYSTEM)[: 3 * B + 5]

    def cached(salt):
        extra = {"cache_salt": salt} if salt is not None else None
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached("c1-alpha"), cached("c1-beta"), cached("c1-alpha"), cached(None)] == [0, 0, 3 * B, 0]


def test_streaming_equals_non_streaming(server, client):
    messages = chat(SYSTEM, "Describe the library in two sentences.")
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    # A stop string: the streamed text must not leak its start before the match.
    prompt = "Once upon a time, in a small village by the sea,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0).choices[0].text
    stop = plain[6:10]
    assert stop.strip()
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert stopped.choices[0].text == plain[: plain.index(stop)]
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                              stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text
    last = streamed[-1].choices[0]  # the final chunk says why it stopped, as the JSON answer does
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", stop) == (
        stopped.choices[0].finish_reason, stopped.choices[0].model_extra["stop_reason"])


def test_concurrent_requests_are_batched_and_equal_sequential(server, client):
    system = "Concurrency test. " + SYSTEM

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        async with aclient:
            rs = await asyncio.gather(*(
                aclient.chat.completions.create(model=MODEL, messages=chat(system, q), max_tokens=8, temperature=0)
                for q in QUESTIONS))
        return rs

    server.engine.max_step_num_reqs = 0
    concurrent = asyncio.run(run_all())
    assert server.engine.max_step_num_reqs > 1  # served together, not one at a time
    assert sum(r.usage.prompt_tokens_details.cached_tokens > 0 for r in concurrent) >= len(QUESTIONS) - 1
    sequential = [client.chat.completions.create(model=MODEL, messages=chat(system, q), max_tokens=8,
                                                 temperature=0) for q in QUESTIONS]
    assert [r.choices[0].message.content for r in concurrent] == [r.choices[0].message.content for r in sequential]
    assert server.wait_idle()["prefixcache:kv_blocks_in_use"] == 0


def test_stream_closed_early_aborts_and_frees_blocks(server, client):
    before = server.wait_idle()
    stream = client.chat.completions.create(
        model=MODEL, messages=chat(SYSTEM, "Tell me a very long story."), max_tokens=400, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    # While the request holds blocks the cache can't be reset: 409 with an error body.
    for path in ("/reset_prefix_cache", "/flush_cache"):  # vLLM's name, SGLang's
        r = httpx.post(server.base_url + path)
        assert r.status_code == 409 and r.json()["error"]["code"] == "requests_in_flight"
    stream.close()
    after = server.wait_idle()
    assert after["prefixcache:kv_blocks_in_use"] == 0 and after["prefixcache:num_requests_running"] == 0
    key = "prefixcache:request_success_total{abort}"
    assert after[key] - before.get(key, 0) == 1
    assert after["prefixcache:generation_tokens_total"] - before.get("prefixcache:generation_tokens_total", 0) < 400
    # Idle now: the reset succeeds and empties the cache.
    assert httpx.post(server.base_url + "/reset_prefix_cache").status_code == 200
    assert server.metrics()["prefixcache:kv_blocks_cached"] == 0


# Rows marked ENGINE are refused by the engine (InvalidInputError names the field); the others by
# the server's request models or SamplingParams.
ENGINE = "engine"
C10 = [
    ("completions", {"prompt": ""}, 400, "prompt", ENGINE),
    ("completions", {"prompt": []}, 400, "prompt", ENGINE),
    ("completions", {"prompt": "word " * 9000}, 400, "prompt", ENGINE),
    ("chat/completions", {"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages", ENGINE),
    ("chat/completions", {"messages": []}, 400, "messages", None),
    ("chat/completions", {}, 400, "messages", None),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens", None),
    ("completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens", ENGINE),  # can't fit in the pool
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", None),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p", None),
    ("completions", {"prompt": [1, 2, 49152]}, 400, "prompt", ENGINE),
    ("completions", {"prompt": [1, -1]}, 400, "prompt", ENGINE),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("completions", {"prompt": "hi", "n": "3"}, 400, "n", None),  # strict types: no quiet conversion
    ("completions", {"prompt": "hi", "n": True}, 400, "n", None),
    ("completions", {"prompt": "hi", "n": 2.0}, 400, "n", None),
    ("completions", {"prompt": "hi", "seed": "5"}, 400, "seed", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens", None),
    ("completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 65}, 400, "n", None),
    ("completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt", ENGINE),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "s" * 1025}, 400,
     "cache_salt", ENGINE),
    ("completions", {"prompt": "hi", "seed": 2**70}, 400, "seed", None),  # would overflow torch's generator
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", None),
    ("completions", b'{"prompt": "hi", ', 400, None, None),  # malformed JSON
]


@pytest.mark.parametrize("endpoint,body,status,param,source", C10,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(C10)])
def test_bad_requests_get_openai_errors(server, endpoint, body, status, param, source):
    url = f"{server.base_url}/v1/{endpoint}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json={"model": MODEL, "max_tokens": 2, **body} if "max_tokens" not in body
                       else {"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if param is not None:
        assert param in error["message"]
    # The server keeps serving and nothing leaked.
    good = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    assert server.wait_idle()["prefixcache:kv_blocks_in_use"] == 0


def test_metrics_counters_match_requests(server, client):
    before = server.wait_idle()
    system = "Metrics test. " + SYSTEM
    usages = [client.chat.completions.create(model=MODEL, messages=chat(system, q), max_tokens=3, temperature=0,
                                             extra_body={"ignore_eos": True}).usage for q in QUESTIONS[:3]]
    after = server.wait_idle()

    def delta(name):
        return after[name] - before.get(name, 0)

    assert delta("prefixcache:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert delta("prefixcache:prefix_cache_hits_total") == delta("vllm:prefix_cache_hits_total") == sum(
        u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta("prefixcache:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("prefixcache:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 9
    assert delta("prefixcache:request_success_total{length}") == 3
    assert delta("prefixcache:time_to_first_token_seconds_count") == 3
    assert delta("prefixcache:e2e_request_latency_seconds_count") == 3
    assert after["prefixcache:prefix_cache_hit_rate"] == pytest.approx(
        after["prefixcache:prefix_cache_hits_total"] / after["prefixcache:prefix_cache_queries_total"])
    assert after["prefixcache:kv_blocks_in_use"] + after["prefixcache:kv_blocks_free"] == after[
        "prefixcache:kv_blocks_total"]


def test_metrics_answer_while_the_engine_thread_is_busy(server):
    """Found by a review (2026-12-02): /metrics (and the dashboard's sampler) waited for the running
    engine step, 9 s behind a cold 2,000-token prefill, past a scraper's timeout. It answers from the
    counters of the last step; here the engine thread is held as a long step would hold it."""
    before = server.wait_idle()
    gate = threading.Event()
    busy = server.engine._executor.submit(gate.wait, 60)
    try:
        during = server.metrics()  # httpx's 5 s timeout: this raised ReadTimeout before
    finally:
        gate.set()
        busy.result(10)
    assert during == before
    assert server.metrics()["prefixcache:kv_blocks_total"] == before["prefixcache:kv_blocks_total"] == 160


def test_an_idle_server_reports_expired_ttl_blocks_evicted(smollm2):
    """Found by a review (2026-12-02): with --eviction-policy ttl, nothing swept expired blocks while
    the server was idle, so /metrics (and KV-event subscribers) showed them cached forever. A scrape
    of an idle server now takes the counters on the engine thread, which sweeps them."""
    import time

    s = start_server(smollm2, num_blocks=32, eviction_policy="ttl", cache_ttl_s=0.5)
    try:
        r = httpx.post(f"{s.base_url}/v1/completions", json={"model": MODEL, "prompt": list(range(300, 340)),
                                                                 "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        assert s.wait_idle()["prefixcache:kv_blocks_cached"] == 2  # 41 tokens: 2 full blocks
        time.sleep(1.0)
        after = s.metrics()
        assert (after["prefixcache:kv_blocks_cached"], after["prefixcache:kv_block_evictions_total"]) == (0, 2)
    finally:
        stop_server(s)


def test_api_key(smollm2):
    s = start_server(smollm2, api_key="sekret", num_blocks=16)
    try:
        url = s.base_url
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/reset_prefix_cache").status_code == 401
        assert httpx.post(url + "/flush_cache").status_code == 401
        assert httpx.head(url + "/v1/models").status_code == 401
        assert httpx.head(url + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(url + path, json=body).status_code == 401
            assert httpx.post(url + path, json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        stop_server(s)


def test_non_streaming_client_disconnect_aborts(server):
    before = server.wait_idle()
    body = {"model": MODEL, "prompt": "Write a long essay about libraries.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    after = server.wait_idle()
    assert after["prefixcache:kv_blocks_in_use"] == 0
    key = "prefixcache:request_success_total{abort}"
    assert after[key] - before.get(key, 0) == 1


def test_eviction_metrics_by_reason_render():
    from prefixcache.engine.async_engine import EngineStats
    from prefixcache.engine.llm_engine import EngineMetrics
    from prefixcache.entrypoints.openai.metrics import ServerMetrics

    m = EngineMetrics(num_requests=1, num_hit_requests=1, prefix_cache_queries=10, prefix_cache_hits=5,
                      num_evictions=3, num_blocks_total=8, num_blocks_in_use=2, num_blocks_cached=3,
                      num_blocks_free=6, evictions_by_reason={"lru": 2, "invalidated": 1},
                      cached_bytes=4096, mean_evicted_age_s=1.5, prompt_tokens_computed=5)
    text = ServerMetrics("m").render(EngineStats(m, 0, 0)).decode()
    samples = {(s.name, s.labels.get("reason")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("prefixcache:kv_block_evictions_by_reason_total", "lru")] == 2
    assert samples[("prefixcache:kv_block_evictions_by_reason_total", "invalidated")] == 1
    assert samples[("prefixcache:kv_cached_bytes", None)] == 4096
    assert samples[("prefixcache:kv_evicted_block_mean_age_seconds", None)] == 1.5
