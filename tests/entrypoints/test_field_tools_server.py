"""What the field's load generators and probes send, answered as they expect (issue 44).

SGLang's ``bench_serving --flush-cache`` posts ``/flush_cache``; its ``--cache-report`` sends
``return_cached_tokens_details: true`` and sums ``sglext.cached_tokens_details`` {device, host,
storage} from whichever response chunk carries it (on the completions route it reads
``choices[0]`` of every chunk, so no chunk of that stream may have empty choices); Prometheus and
AIPerf probe with ``HEAD``. And every counter counts one thing: ``prefix_cache_hits`` (ours and
vLLM's name) grows by the ``cached_tokens`` the answers report, partial-block copies and tier loads
included (docs/metrics.md).
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.entrypoints.conftest import MODEL, start_server, stop_server

B = 16
READ_ONLY = ("/health", "/metrics", "/v1/models", "/v1/cache/stats", "/dashboard", "/server_info", "/model_info",
             "/dashboard/static/dashboard.js")


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def complete(url: str, prompt, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                  "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def sse(url: str, route: str, body: dict) -> list[dict]:
    """The JSON chunks of a stream, as SGLang's bench reads them (``data: `` lines, ``[DONE]`` last)."""
    chunks = []
    with httpx.stream("POST", url + route, json={"model": MODEL, "stream": True, "temperature": 0, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def sglang_cached_tokens(chunks: list[dict]) -> dict | None:
    """What SGLang's ``--cache-report`` keeps: the details of the last chunk that has them."""
    details = None
    for chunk in chunks:
        details = (chunk.get("sglext") or {}).get("cached_tokens_details") or details
    return details


def test_head_on_every_read_only_endpoint(server):
    for path in READ_ONLY:
        get = httpx.get(server.base_url + path)
        head = httpx.head(server.base_url + path)
        assert (head.status_code, head.content) == (200, b""), path
        assert head.headers.get("content-type") == get.headers.get("content-type"), path
    assert httpx.head(server.base_url + "/v1/completions").status_code == 405
    assert set(httpx.get(server.base_url + "/openapi.json").json()["paths"]["/metrics"]) == {"get"}  # not documented


def test_flush_cache_empties_the_cache_as_reset_prefix_cache_does(server):
    prompt = ids(1, 40)
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    assert complete(server.base_url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(server.base_url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    assert server.metrics()["prefixcache:kv_blocks_cached"] == 0
    assert complete(server.base_url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_sglext_cached_tokens_details_on_both_routes_streamed_or_not(server):
    url, prompt = server.base_url, ids(2, 40)  # 2 full blocks cached, the rest computed
    httpx.post(url + "/flush_cache")
    cold = complete(url, prompt, return_cached_tokens_details=True)
    assert cold["sglext"] == {"cached_tokens_details": {"device": 0, "host": 0, "storage": 0}}
    warm = complete(url, prompt, return_cached_tokens_details=True)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert warm["sglext"] == {"cached_tokens_details": {"device": 32, "host": 0, "storage": 0}}
    assert "sglext" not in complete(url, prompt)  # only when asked for
    assert "sglext" not in complete(url, prompt, return_cached_tokens_details=False)

    # Completions streamed without a usage chunk (SGLang's bench): every chunk has a choice, the
    # finish chunk carries the details.
    chunks = sse(url, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "return_cached_tokens_details": True})
    assert all(c["choices"] for c in chunks)
    assert [c.get("sglext") for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sglang_cached_tokens(chunks) == {"device": 32, "host": 0, "storage": 0}
    # With a usage chunk: the usage chunk has them too, equal to its cached_tokens.
    chunks = sse(url, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "return_cached_tokens_details": True,
                                          "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert chunks[-1]["sglext"] == {"cached_tokens_details": {"device": 32, "host": 0, "storage": 0}}

    messages = [{"role": "user", "content": "Name three colours of the rainbow, please. " * 3}]
    first = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                            "return_cached_tokens_details": True}).json()
    n = first["usage"]["prompt_tokens"]
    chunks = sse(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                               "return_cached_tokens_details": True})
    assert sglang_cached_tokens(chunks) == {"device": (n - 1) // B * B, "host": 0, "storage": 0}
    again = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                            "return_cached_tokens_details": True}).json()
    assert again["sglext"]["cached_tokens_details"]["device"] == again["usage"]["prompt_tokens_details"][
        "cached_tokens"] == (n - 1) // B * B


def test_several_prompts_and_samples_sum_each_prompt_once(server):
    url, a, b = server.base_url, ids(3, 40), ids(4, 20)
    complete(url, [a, b])
    body = {"prompt": [a, b], "n": 2, "max_tokens": 2, "return_cached_tokens_details": True}
    answer = complete(url, **body)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 32 + 16
    assert answer["sglext"]["cached_tokens_details"] == {"device": 48, "host": 0, "storage": 0}
    chunks = sse(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    finishes = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 4 and finishes[-1]["sglext"]["cached_tokens_details"]["device"] == 48
    assert chunks[-1]["sglext"]["cached_tokens_details"]["device"] == 48


def test_tier_loads_are_storage_and_hits(smollm2, tmp_path):
    s = start_server(smollm2, kv_disk_dir=str(tmp_path), hash_seed=44, enable_partial_block_reuse=False)
    try:
        url, prompt = s.base_url, ids(5, 56)  # 3 full blocks
        before = s.wait_idle()
        complete(url, prompt)
        s.engine.engine.kv_tiers.flush()  # the write-through stores are done
        assert httpx.post(url + "/flush_cache").status_code == 200  # the pool is empty, the disk is not
        loaded = complete(url, prompt, return_cached_tokens_details=True)
        assert loaded["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert loaded["sglext"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 48,
                                                             "storage_backend": "disk"}
        pooled = complete(url, prompt, return_cached_tokens_details=True)
        assert pooled["sglext"]["cached_tokens_details"] == {"device": 48, "host": 0, "storage": 0}
        after = s.wait_idle()
        for name in ("prefixcache:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"):
            assert after[name] - before.get(name, 0) == 96  # a tier load is a hit, as cached_tokens says
        assert after["prefixcache:kv_tier_hits_total"] == 48
    finally:
        stop_server(s)


def test_counters_agree_with_usage_on_every_route_partial_copies_included(smollm2):
    s = start_server(smollm2)  # partial-block reuse on (the default)
    try:
        url, a = s.base_url, ids(6, 40)
        before = s.wait_idle()
        cached = [complete(url, a)["usage"]["prompt_tokens_details"]["cached_tokens"]]
        # a's first 24 tokens: block 0 hit, then 8 tokens copied from a's cached block 1.
        usage = complete(url, a[:24] + ids(7, 10))["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 24
        cached.append(24)
        chunks = sse(url, "/v1/completions", {"prompt": a[:24] + ids(8, 10), "max_tokens": 2,
                                              "stream_options": {"include_usage": True}})
        cached.append(chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages = [{"role": "user", "content": "Count from one to ten in French. " * 2}]
        for stream in (False, True):
            if stream:
                chunks = sse(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                           "stream_options": {"include_usage": True}})
                cached.append(chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"])
            else:
                r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                    "max_tokens": 2}).json()
                cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        after = s.wait_idle()

        def delta(name):
            return after[name] - before.get(name, 0)

        assert cached[:3] == [0, 24, 24] and cached[4] > 0
        assert delta("prefixcache:prefix_cache_hits_total") == delta("vllm:prefix_cache_hits_total") == sum(cached)
        assert delta("prefixcache:prefix_cache_partial_hits_total") >= 16  # 8 + 8 copied above, kept visible
        assert after["prefixcache:prefix_cache_hit_rate"] == pytest.approx(
            after["prefixcache:prefix_cache_hits_total"] / after["prefixcache:prefix_cache_queries_total"])
        totals = httpx.get(url + "/v1/cache/stats").json()["totals"]
        assert totals["prefix_cache_hits"] == totals["prefill_tokens_saved"] == after[
            "prefixcache:prefix_cache_hits_total"]
        assert totals["hit_rate"] == after["prefixcache:prefix_cache_hit_rate"]
        assert totals["prefix_cache_partial_hits"] == after["prefixcache:prefix_cache_partial_hits_total"]
    finally:
        stop_server(s)


def test_c23_a_zero_says_why(smollm2):
    s = start_server(smollm2, enable_partial_block_reuse=False)
    try:
        url, salt, first = s.base_url, {"cache_salt": "c23"}, ids(9, 40)
        assert complete(url, first, **salt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        short = first[:12] + ids(10, 28)  # shares its first 12 tokens only
        assert complete(url, short, **salt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        zero = httpx.get(url + "/v1/cache/stats").json()["zero_hits"]
        assert zero["explanation"] == "shared prefix 12 tokens, shorter than one block (16)"
        assert zero["by_reason"] == {
            "no_earlier_prompt": {"count": 1, "prompt_tokens": 40,
                                  "latest": "nothing shared: no earlier prompt in its cache namespace"},
            "shorter_than_block": {"count": 1, "prompt_tokens": 40,
                                   "latest": "shared prefix 12 tokens, shorter than one block (16)"},
        }
        assert "shared prefix 12 tokens, shorter than one block (16)" in httpx.get(url + "/dashboard").text
        other = [first[0] + 1] + first[1:]  # differs in its first token only
        assert complete(url, other, **salt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        zero = httpx.get(url + "/v1/cache/stats").json()["zero_hits"]
        assert zero["explanation"] == "nothing shared: the first token differs from every earlier prompt"
        assert zero["by_reason"]["nothing_shared"] == {
            "count": 1, "prompt_tokens": 40, "latest": "nothing shared: the first token differs from every earlier prompt"}
        assert zero["count"] == 3
        m = s.metrics()
        assert (m["prefixcache:prefix_cache_queries_total"], m["prefixcache:prefix_cache_hits_total"]) == (120, 0)
        page = httpx.get(url + "/dashboard").text
        assert "nothing shared: the first token differs from every earlier prompt" in page
        assert "shorter_than_block" in page
    finally:
        stop_server(s)
