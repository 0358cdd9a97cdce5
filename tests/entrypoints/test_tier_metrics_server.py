"""The KV tiers' counters on ``/metrics``: a server with a disk tier, restarted over the same directory."""

from __future__ import annotations

import httpx

from tests.entrypoints.conftest import MODEL, start_server, stop_server

PROMPT = "Tiers keep the prefix cache across restarts: " * 6  # several full 16-token blocks


def scrape(server) -> str:
    return httpx.get(server.base_url + "/metrics").text


def value(text: str, series: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(series + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_tier_series_count_a_restart(smollm2, tmp_path):
    options = {"kv_disk_dir": str(tmp_path), "hash_seed": 7}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    first = start_server(smollm2, **options)
    try:
        out = httpx.post(first.base_url + "/v1/completions", json=body, timeout=60).json()
        prompt_tokens = out["usage"]["prompt_tokens"]
        first.engine.engine.close()  # the writer stores what is queued
        text = scrape(first)
    finally:
        stop_server(first)
    labels = f'{{model_name="{MODEL}",tier="disk"}}'
    full_blocks = prompt_tokens // 16
    assert value(text, f"prefixcache:kv_tier_stores_total{labels}") == full_blocks
    assert value(text, f"prefixcache:kv_tier_entries{labels}") == full_blocks
    assert not first.engine.engine.kv_tiers._writer.is_alive()  # shutdown closed the engine: writer done
    second = start_server(smollm2, **options)
    try:
        out = httpx.post(second.base_url + "/v1/completions", json=body, timeout=60).json()
        text = scrape(second)
    finally:
        stop_server(second)
    hit = (prompt_tokens - 1) // 16 * 16  # the last token is always computed
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert value(text, f"prefixcache:kv_tier_queries_total{labels}") == hit
    assert value(text, f"prefixcache:kv_tier_hits_total{labels}") == hit
    assert value(text, f"prefixcache:kv_tier_errors_total{labels}") == 0
    assert value(text, f"prefixcache:kv_tier_slow_skips_total{labels}") == 0  # one load: never skipped
    assert value(text, f'prefixcache:kv_tier_load_latency_seconds_count{labels}') == hit // 16
