"""The operator dashboard over HTTP: /v1/cache/stats equals /metrics after a known sequence of requests,
the prefix tree and a breaker match the requests' tokens, auth is enforced (header and cookie), and a
tenant never sees another tenant's text.

Real server (tests/entrypoints/conftest.py), full-block sharing only so the cached counts are exact.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

import prefixcache.entrypoints.dashboard.state as dashboard
from prefixcache.entrypoints.dashboard.state import DashboardOptions
from tests.entrypoints.conftest import MODEL, start_server, stop_server

SYSTEM = ("You are the support assistant of the ACME online store. Answer in two sentences, politely, and only "
          "about orders, shipping, returns and our product catalogue. Never invent prices or delivery dates.")


def complete(base_url: str, prompt: str, headers: dict | None = None) -> dict:
    r = httpx.post(base_url + "/v1/completions", headers=headers, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(base_url: str, prompt: str, headers: dict | None = None) -> list[int]:
    r = httpx.post(base_url + "/tokenize", headers=headers, json={"model": MODEL, "prompt": prompt})
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def board_server(smollm2):
    s = start_server(smollm2, enable_partial_block_reuse=False,
                     app_options={"dashboard_options": DashboardOptions(interval_s=0.05)})
    yield s
    stop_server(s)


def test_stats_equal_metrics_tree_and_breaker(board_server):
    s = board_server
    prompts = [SYSTEM + " Q: where is my order 1?", SYSTEM + " Q: can I return shoes?",
               SYSTEM + " Q: do you ship to Norway?"]
    stamped = ["Time: 2026-11-30 10:04. " + SYSTEM + " Q: hello", "Time: 2026-12-01 08:15. " + SYSTEM + " Q: hello"]
    cached = [complete(s.base_url, p)["usage"]["prompt_tokens_details"]["cached_tokens"] for p in prompts + stamped]
    ids = [tokenize(s.base_url, p) for p in prompts + stamped]
    shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b)
    assert cached[:3] == [0, shared // 16 * 16, shared // 16 * 16]
    m = s.wait_idle()
    doc = httpx.get(s.base_url + "/v1/cache/stats").json()

    t = doc["totals"]
    assert t["prefix_cache_queries"] == m["prefixcache:prefix_cache_queries_total"] == sum(len(x) for x in ids)
    assert t["prefix_cache_hits"] == m["prefixcache:prefix_cache_hits_total"] == sum(cached)
    assert t["prefix_cache_partial_hits"] == m["prefixcache:prefix_cache_partial_hits_total"] == 0
    assert t["prefill_tokens_saved"] == sum(cached)
    assert t["hit_requests"] == m["prefixcache:prefix_cache_hit_requests_total"]
    assert t["prompt_tokens_computed"] == m["prefixcache:prompt_tokens_computed_total"]
    assert t["hit_rate"] == pytest.approx(m["prefixcache:prefix_cache_hit_rate"], abs=0)
    assert t["finished_requests"] == m["prefixcache:request_success_total{length}"] == 5
    p = doc["pool"]
    for key, name in (("blocks_total", "kv_blocks_total"), ("blocks_in_use", "kv_blocks_in_use"),
                      ("blocks_cached", "kv_blocks_cached"), ("blocks_free", "kv_blocks_free"),
                      ("cached_bytes", "kv_cached_bytes"), ("evictions", "kv_block_evictions_total")):
        assert p[key] == m["prefixcache:" + name], key
    assert doc["requests"] == {"running": m["prefixcache:num_requests_running"],
                               "waiting": m["prefixcache:num_requests_waiting"]}
    ttft = doc["ttft"]
    assert (ttft["cold"]["count"], ttft["warm"]["count"]) == (3, 2)  # 1st and both stamped prompts are cold
    assert ttft["cold"]["count"] + ttft["warm"]["count"] == m["prefixcache:time_to_first_token_seconds_count"]
    assert ttft["cold"]["sum_s"] + ttft["warm"]["sum_s"] == pytest.approx(
        m["prefixcache:time_to_first_token_seconds_sum"], rel=1e-9)
    assert ttft["warm"]["p50_s"] <= ttft["warm"]["p99_s"]

    # The tree: one namespace; the system prompt's full blocks are one segment served to requests 2 and 3.
    (ns,) = doc["prefixes"]
    assert ns["namespace"] == {"tenant": None, "salt": None, "adapter": None}
    assert ns["blocks"] == m["prefixcache:kv_blocks_cached"]
    top = ns["chains"][0]
    assert (top["start"], top["end"], top["hits"]) == (0, shared // 16 * 16, 2)
    assert top["served_tokens"] == 2 * (shared // 16 * 16)
    assert top["preview"] == httpx.post(s.base_url + "/detokenize", json={"model": MODEL,
                                                                           "tokens": ids[0][:32]}).json()["prompt"]
    # The breakers: the first stamped prompt left the system prompt's chain at token 0 (a date put in
    # front); the second left the first stamped one at their first differing token (a date too).
    diverge = next(i for i, (a, b) in enumerate(zip(ids[3], ids[4])) if a != b)
    front, b = sorted(doc["breakers"]["top"], key=lambda g: g["position"])
    assert (front["position"], front["kind"], front["count"]) == (0, "datetime", 1)
    assert front["examples"][0]["request"].startswith("Time: 2026-11-30 10:04.")
    assert (b["position"], b["block"], b["kind"], b["count"]) == (diverge, diverge // 16, "datetime", 1)
    assert b["tokens_lost"] == len(ids[4]) - diverge - len("2-01 08:15")  # digits are one token each
    assert b["examples"] == [{"request": "2-01 08:15", "chain": "1-30 10:04"}]
    assert doc["breakers"]["by_kind"]["datetime"] == {"count": 2, "tokens_lost": b["tokens_lost"] + front["tokens_lost"]}
    # History: interval samples whose deltas add up to the totals (all requests came after the baseline).
    assert doc["history"], "no history sample"
    assert sum(x["queries"] for x in doc["history"]) <= t["prefix_cache_queries"]
    assert doc["worth"]["verdict"] in ("worth it", "marginal", "not worth it")
    assert doc["worth"]["inputs"]["hit_tokens"] == sum(cached)


def test_stats_answer_while_a_step_holds_the_engine_thread(board_server, monkeypatch):
    """A long step (here the engine thread held by a call waiting on an event) doesn't hold up
    /v1/cache/stats: it answers with the last step's counters and the tree taken before, marked
    tree_stale with its tree_as_of_s; once the thread is free, one snapshot again. It used to wait
    for the step (seconds in an 8k-token prefill on a CPU)."""
    s = board_server
    monkeypatch.setattr(dashboard, "STATS_WAIT_S", 0.2)
    complete(s.base_url, SYSTEM + " Q: where is my order 7?")
    s.wait_idle()
    fresh = httpx.get(s.base_url + "/v1/cache/stats").json()
    assert fresh["tree_stale"] is False and fresh["tree_as_of_s"] <= fresh["time_s"] and fresh["prefixes"]
    release = threading.Event()
    held = s.engine._executor.submit(release.wait)  # the engine thread is busy, as in a long prefill
    try:
        r = httpx.get(s.base_url + "/v1/cache/stats", timeout=10)
    finally:
        release.set()
    held.result(timeout=30)
    assert r.status_code == 200
    stale = r.json()
    assert stale["tree_stale"] is True and stale["tree_as_of_s"] == fresh["tree_as_of_s"]
    assert stale["prefixes"] == fresh["prefixes"] and stale["breakers"] == fresh["breakers"]
    assert stale["totals"] == fresh["totals"]
    later = httpx.get(s.base_url + "/v1/cache/stats").json()
    assert later["tree_stale"] is False and later["tree_as_of_s"] > fresh["tree_as_of_s"]
    assert later["totals"] == fresh["totals"]
    assert [ns["blocks"] for ns in later["prefixes"]] == [ns["blocks"] for ns in fresh["prefixes"]]


def test_dashboard_page_server_rendered(board_server):
    r = httpx.get(board_server.base_url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    doc = httpx.get(board_server.base_url + "/v1/cache/stats").json()
    queries = doc["totals"]["prefix_cache_queries"]
    assert f'id="queries" data-stat="totals.prefix_cache_queries" data-fmt="int">{queries}<' in r.text
    for name in ("uPlot.iife.min.js", "dashboard.js", "uPlot.min.css", "LICENSE-uPlot"):
        static = httpx.get(board_server.base_url + "/dashboard/static/" + name)
        assert static.status_code == 200 and len(static.content) > 100, name
    assert httpx.get(board_server.base_url + "/dashboard/static/..%2Fauth.py").status_code == 404


def test_auth_header_and_cookie(smollm2):
    s = start_server(smollm2, api_key="sk-operator")
    try:
        url = s.base_url
        r = httpx.get(url + "/v1/cache/stats")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        page = httpx.get(url + "/dashboard")
        assert page.status_code == 401 and '<form id="login">' in page.text and "Prefix" not in page.text
        assert httpx.get(url + "/dashboard", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(url + "/dashboard", headers={"Authorization": "Bearer sk-operator"}).status_code == 200
        assert httpx.get(url + "/v1/cache/stats", cookies={"prefixcache_key": "sk-operator"}).status_code == 200
        assert httpx.get(url + "/dashboard", cookies={"prefixcache_key": "sk-wrong"}).status_code == 401
        # The cookie opens the dashboard's GETs only, never the API.
        post = httpx.post(url + "/v1/completions", cookies={"prefixcache_key": "sk-operator"},
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert post.status_code == 401
        assert httpx.get(url + "/v1/models", cookies={"prefixcache_key": "sk-operator"}).status_code == 401
        assert httpx.get(url + "/dashboard/static/dashboard.js").status_code == 200  # code, no data
    finally:
        stop_server(s)


TENANTS = {"key-acme": "acme", "key-globex": "globex"}
SECRETS = {"acme": "Acme internal codename BLUEHERON", "globex": "Globex internal codename REDFALCON"}


def _tenant_traffic(s) -> None:
    for key, tenant in TENANTS.items():
        for q in ("first question", "second question"):
            complete(s.base_url, f"{SECRETS[tenant]}. {SYSTEM} {q}", {"Authorization": f"Bearer {key}"})
    s.wait_idle()


@pytest.mark.parametrize("previews", [None, True])
def test_tenant_never_sees_another_tenants_text(smollm2, previews):
    s = start_server(smollm2, enable_partial_block_reuse=False, app_options={
        "api_keys": TENANTS, "tenant_isolation": True, "dashboard_options": DashboardOptions(previews=previews)})
    try:
        _tenant_traffic(s)
        for key, tenant in TENANTS.items():
            other = next(t for t in TENANTS.values() if t != tenant)
            headers = {"Authorization": f"Bearer {key}"}
            raw = httpx.get(s.base_url + "/v1/cache/stats", headers=headers).text
            page = httpx.get(s.base_url + "/dashboard", headers=headers).text
            doc = json.loads(raw)
            assert doc["previews"] is bool(previews)
            (ns,) = doc["prefixes"]  # its own namespace only
            assert ns["namespace"]["tenant"] == tenant
            assert ns["chains"][0]["hits"] == 1
            for text in (raw, page):
                assert other not in text and SECRETS[other].split()[-1] not in text
                assert (SECRETS[tenant][:20] in text) is bool(previews), tenant
    finally:
        stop_server(s)


def _evictions_by_reason(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "prefixcache:kv_block_evictions_by_reason_total":
                out[sample.labels["reason"]] = sample.value
    return out


def test_evictions_by_reason_equal_metrics_and_history(smollm2):
    # 12 blocks of 16 tokens: four ~85-token prompts that differ from their first block can't all stay cached.
    s = start_server(smollm2, num_blocks=12, enable_partial_block_reuse=False,
                     app_options={"dashboard_options": DashboardOptions(interval_s=0.05)})
    try:
        httpx.get(s.base_url + "/v1/cache/stats")  # the history's baseline: before any request
        for i in range(4):
            complete(s.base_url, f"Customer {i}: {SYSTEM} {SYSTEM}")
        m = s.wait_idle()
        doc = httpx.get(s.base_url + "/v1/cache/stats").json()
        by_reason = _evictions_by_reason(s.base_url)
        assert by_reason and sum(by_reason.values()) == m["prefixcache:kv_block_evictions_total"] > 0
        assert doc["pool"]["evictions_by_reason"] == by_reason
        assert doc["pool"]["evictions"] == m["prefixcache:kv_block_evictions_total"]
        summed: dict[str, float] = {}
        for sample in doc["history"]:
            for reason, n in sample["evictions_by_reason"].items():
                summed[reason] = summed.get(reason, 0) + n
        assert summed == by_reason  # every eviction falls in exactly one interval
        assert sum(x["queries"] for x in doc["history"]) == doc["totals"]["prefix_cache_queries"]
        assert sum(x["requests"] for x in doc["history"]) == doc["totals"]["requests"] == 4
    finally:
        stop_server(s)


def test_serve_flag_dashboard_previews():
    import argparse

    from prefixcache.entrypoints.cli.serve import _PREVIEWS, add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args([]).dashboard_previews == "auto"
    assert {v: _PREVIEWS[parser.parse_args(["--dashboard-previews", v]).dashboard_previews]
            for v in ("auto", "on", "off")} == {"auto": None, "on": True, "off": False}
    with pytest.raises(SystemExit):
        parser.parse_args(["--dashboard-previews", "maybe"])


def test_tier_numbers_equal_metrics(smollm2, tmp_path):
    s = start_server(smollm2, kv_disk_dir=str(tmp_path), hash_seed=7)
    try:
        complete(s.base_url, SYSTEM + " " + SYSTEM)
        s.engine.engine.kv_tiers.close()  # the writer stores what is queued
        text = httpx.get(s.base_url + "/metrics").text
        doc = httpx.get(s.base_url + "/v1/cache/stats").json()
        page = httpx.get(s.base_url + "/dashboard").text
    finally:
        stop_server(s)
    labels = f'{{model_name="{MODEL}",tier="disk"}}'
    disk = doc["tiers"]["disk"]
    for key, series in (("queries", "kv_tier_queries_total"), ("hits", "kv_tier_hits_total"),
                        ("stores", "kv_tier_stores_total"), ("bytes_stored", "kv_tier_stored_bytes_total"),
                        ("entries", "kv_tier_entries"), ("errors", "kv_tier_errors_total")):
        (line,) = [x for x in text.splitlines() if x.startswith(f"prefixcache:{series}{labels} ")]
        assert disk[key] == float(line.rsplit(" ", 1)[1]), key
    assert disk["stores"] > 0 and "load_latency" not in disk
    assert f"<td>disk</td><td>{disk['queries']}</td><td>{disk['hits']}</td>" in page


def test_a_preview_renders_its_characters_escaped_for_html_not_as_json_escapes():
    """The first render showed "\\ud83d\\ude00" for an emoji (json.dumps' ASCII escapes) until the
    page's first poll redrew it; markup stays escaped."""
    from prefixcache.entrypoints.dashboard.routes import _node

    node = {"start": 0, "end": 16, "tokens": 16, "hits": 1, "served_tokens": 16, "last_use_s_ago": 0.5,
            "preview": 'Hi 😀 <script>alert("x")</script>', "children": []}
    html_text = _node(node)
    assert '<code class="preview">&quot;Hi 😀 &lt;script&gt;alert(\\&quot;x\\&quot;)&lt;/script&gt;&quot;</code>' in html_text
