"""``prompt_cache_retention: "24h"`` on a real server with a disk tier, through the real ``openai``
client: the prompt's blocks are kept in the disk tier out of its size cap's eviction (within
``--max-retained-disk-fraction``), hit from there after the pool evicted them, and expire after 24
hours (on an injected clock)."""

from __future__ import annotations

import time

import openai
import pytest

from prefixcache.runner.kv_pool import kv_block_layout
from tests.entrypoints.conftest import MODEL, start_server, stop_server

B = 16
DAY_S = 24 * 3600.0
ENTRY_SLACK = 2000  # bytes over the payload an entry's header takes at most (it is ~700)
RETAINED_ENTRIES = 6  # the retention budget, in entries
SYSTEM = ("You are the night dispatcher of a mountain rescue team. Ask for the caller's position, the number of "
          "people involved and their injuries; keep every answer short and stay calm.")


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    cfg = smollm2.config
    layout = kv_block_layout(cfg.num_hidden_layers, B, cfg.num_key_value_heads, cfg.head_dim, smollm2.dtype)
    entry = layout.payload_bytes + ENTRY_SLACK
    s = start_server(smollm2, enable_partial_block_reuse=False, num_blocks=24, hash_seed=7,
                     kv_disk_dir=str(tmp_path_factory.mktemp("kv")), kv_disk_bytes=2 * RETAINED_ENTRIES * entry,
                     max_retained_disk_fraction=0.5)  # 12 entries on disk, 6 of them retained at most
    s.clock = Clock()
    s.disk = s.engine.engine.kv_tiers.tiers[0]
    s.disk.clock = s.clock
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, system, retention=None):
    """(usage, retained-tokens header, sglext cached-tokens details) of one chat completion."""
    extra = {"return_cached_tokens_details": True}
    if retention is not None:
        extra["prompt_cache_retention"] = retention
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, temperature=0, extra_body=extra,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Two hikers are lost."}])
    r = raw.parse()
    return r.usage, raw.headers.get("x-prefixcache-retained-tokens"), r.model_extra["sglext"]["cached_tokens_details"]


def flood(server, client, n=6):
    """One-off prompts of several blocks each: they evict the pool (24 blocks) and, past the disk cap, the
    disk tier's unretained entries."""
    for i in range(n):
        client.completions.create(model=MODEL, max_tokens=1, temperature=0,
                                  prompt=f"Flood {i}: " + " ".join(f"w{i}x{j}" for j in range(40)))
    server.engine.engine.kv_tiers.flush()


def test_24h_prefix_survives_pool_and_disk_eviction_then_expires(server, client):
    usage, header, _ = chat(client, SYSTEM, "24h")
    prompt = usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0 and prompt // B <= RETAINED_ENTRIES
    assert header == f"{prompt // B * B}/{prompt // B * B}"  # every full block kept
    other = "You are a librarian; answer questions about opening hours politely and briefly, in one sentence."
    usage, header, _ = chat(client, other)  # in_memory: no header, nothing retained
    assert header is None and usage.prompt_tokens_details.cached_tokens == 0
    flood(server, client)
    disk = server.disk.usage()
    assert disk["retained_entries"] == prompt // B and disk["entries"] <= 12
    hit = (prompt - 1) // B * B  # the last prompt token is always computed
    usage, header, details = chat(client, SYSTEM)
    assert usage.prompt_tokens_details.cached_tokens == hit
    assert details == {"device": 0, "host": 0, "storage": hit, "storage_backend": "disk"}  # the pool had evicted it
    usage, _, _ = chat(client, other)  # not retained: the pool evicted it and the size cap took its end
    assert usage.prompt_tokens_details.cached_tokens < (usage.prompt_tokens - 1) // B * B  # (a chain's end first)
    server.clock.now += DAY_S + 1  # a day later: the marks expire at the next store, then the cap takes them
    flood(server, client, 8)
    assert server.disk.usage()["retained_entries"] == 0
    usage, _, _ = chat(client, SYSTEM)
    assert usage.prompt_tokens_details.cached_tokens < hit


def test_24h_on_a_pool_hit_stores_again_what_the_disk_lost(server, client):
    system = "You answer questions about train timetables between Zurich and Geneva, briefly and exactly."
    before = {p.stem for p in server.disk.dir.glob("*/*.kv")}
    usage, _, _ = chat(client, system)
    server.engine.engine.kv_tiers.flush()
    names = sorted({p.stem for p in server.disk.dir.glob("*/*.kv")} - before)
    assert len(names) == usage.prompt_tokens // B
    for name in names:  # the size cap's work, while the pool still holds the blocks
        server.disk.remove(name)
    usage, header, details = chat(client, system, "24h")  # a pool hit: nothing is computed, so nothing stored
    full = usage.prompt_tokens // B * B
    assert details["device"] == (usage.prompt_tokens - 1) // B * B and header == f"{full}/{full}"
    server.engine.engine.kv_tiers.flush()
    assert server.disk.holds(names) == [True] * len(names)  # stored again from the pool, and kept
    assert all(server.disk.retained_until(n) == server.clock.now + DAY_S for n in names)


def test_24h_over_the_budget_keeps_the_head_that_fits(server, client):
    free = RETAINED_ENTRIES - server.disk.usage()["retained_entries"]  # the earlier tests' marks still hold
    first = client.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, temperature=0, prompt="Budget one: " + " ".join(f"a{j}" for j in range(6)),
        extra_body={"prompt_cache_retention": "24h"})
    kept, asked = map(int, first.headers["x-prefixcache-retained-tokens"].split("/"))
    assert kept == asked and 0 < kept // B < free
    room = free - kept // B
    second = client.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, temperature=0, prompt="Budget two: " + " ".join(f"b{j}" for j in range(60)),
        extra_body={"prompt_cache_retention": "24h"})
    kept2, asked2 = map(int, second.headers["x-prefixcache-retained-tokens"].split("/"))
    assert asked2 == second.parse().usage.prompt_tokens // B * B > room * B
    assert kept2 == room * B  # the head that fits the budget
    assert server.disk.usage()["retained_bytes"] <= server.disk.max_retained_bytes


def test_24h_refused_where_the_disk_tier_keeps_nothing(server, client):
    budget, server.disk.max_retained_bytes = server.disk.max_retained_bytes, 0
    try:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, SYSTEM, "24h")
    finally:
        server.disk.max_retained_bytes = budget
    assert e.value.body["param"] == "prompt_cache_retention"
    assert "--max-retained-disk-fraction 0" in e.value.body["message"]
