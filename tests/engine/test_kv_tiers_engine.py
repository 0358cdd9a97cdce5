"""KV tiers under the real engine (SmolLM2): a restart through the disk tier, replicas through
Redis (C15, a second process), namespaces through every tier (C16), bad entries (C17), a Redis
that goes down, and blocks evicted from the pool then served from a tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefixcache.cache.tiers.entry import decode_entry
from prefixcache.sampling_params import SamplingParams

B = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
P = [(1000 + 37 * i) % 40000 for i in range(3 * B + 5)]  # 3 full blocks + 5 tokens (C15-C17's prompt)
P4 = [(2000 + 53 * i) % 40000 for i in range(4 * B + 5)]  # 4 full blocks + 5
REPO = Path(__file__).resolve().parents[2]


def run(llm, prompt, **kwargs):
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False, **kwargs)
    return out


@pytest.fixture(scope="module")
def cold_ids(make_llm):
    """Greedy token ids of a cold engine (caching off), by prompt."""
    llm = make_llm(enable_prefix_caching=False)
    return {tuple(p): run(llm, p).token_ids for p in (P, P4)}


def tiered(make_llm, **options):
    options.setdefault("hash_seed", 1234)
    return make_llm(**options)


def flush(llm):
    llm.engine.kv_tiers.flush()


def tier_stats(llm, name):
    return llm.engine.get_metrics().kv_tiers[name]


def entry_path(llm, disk_dir, block_hash: bytes) -> Path:
    disk = llm.engine.kv_tiers.tiers[0]
    return disk._path(block_hash.hex())


def request_keys(llm, prompt, **kwargs):
    """The entry keys the engine expects for ``prompt``'s full blocks."""
    engine = llm.engine
    request = engine.input_processor.make_request("keys", engine.input_processor.tokenize(prompt), GREEDY, **kwargs)
    return engine.kv_tiers.entry_keys(request, 0, len(request.block_hashes))


def test_restart_reuses_the_disk_tier(make_llm, cold_ids, tmp_path):
    first = tiered(make_llm, kv_disk_dir=str(tmp_path))
    out = run(first, P)
    assert out.token_ids == cold_ids[tuple(P)] and out.num_cached_tokens == 0
    flush(first)
    assert tier_stats(first, "disk")["stores"] == 3  # write-through: every full block

    restarted = tiered(make_llm, kv_disk_dir=str(tmp_path))  # a new engine, empty pool, same directory
    out = run(restarted, P)
    assert out.token_ids == cold_ids[tuple(P)]
    assert out.num_cached_tokens == 3 * B
    metrics = restarted.engine.get_metrics()
    assert metrics.prompt_tokens_computed == len(P) - 3 * B  # C19: the tier hit is work not done
    assert metrics.prefix_cache_hits == metrics.prefix_cache_tier_hits == 3 * B  # a tier load is a hit
    assert metrics.kv_tiers["disk"]["hits"] == 3 * B and metrics.kv_tiers["disk"]["queries"] == 3 * B
    assert metrics.kv_tiers["disk"]["bytes_loaded"] == 3 * restarted.engine.kv_cache_bytes_per_block
    # Loaded blocks are ordinary cached pool blocks now: the next request hits the pool.
    out = run(restarted, P)
    metrics = restarted.engine.get_metrics()
    assert out.num_cached_tokens == 3 * B and (metrics.prefix_cache_hits, metrics.prefix_cache_tier_hits) == (6 * B, 3 * B)
    assert tier_stats(restarted, "disk")["stores"] == 0  # loaded blocks are not stored back


def test_another_hash_seed_or_model_key_never_hits(make_llm, cold_ids, tmp_path):
    run(tiered(make_llm, kv_disk_dir=str(tmp_path)), P)
    other_seed = tiered(make_llm, kv_disk_dir=str(tmp_path), hash_seed=99)
    out = run(other_seed, P)
    assert out.num_cached_tokens == 0 and out.token_ids == cold_ids[tuple(P)]


def test_c16_namespaces_survive_the_disk_tier(make_llm, cold_ids, tmp_path):
    """Process A caches P with salt s1 (and under tenant t1); process B (a new engine on the same
    directory) gets no hit without the salt, with another salt or under another tenant (a salted
    request shares no block across tenants, not even an approved prefix's)."""
    a = tiered(make_llm, kv_disk_dir=str(tmp_path))
    a.engine.add_approved_prefix(P[: 2 * B])  # two blocks every tenant may share, unsalted
    assert run(a, P, cache_salt="s1").num_cached_tokens == 0
    assert run(a, P, cache_salt="s1", tenant="t1").num_cached_tokens == 0  # salted: its tenant's blocks
    flush(a)

    b = tiered(make_llm, kv_disk_dir=str(tmp_path))
    b.engine.add_approved_prefix(P[: 2 * B])
    want = cold_ids[tuple(P)]
    for kwargs, cached in [
        ({}, 0), ({"tenant": "t2"}, 2 * B),  # unsalted: the approved prefix's blocks of the run before
        ({"cache_salt": "s2"}, 0), ({"cache_salt": "s1", "tenant": "t2"}, 0),
        ({"cache_salt": "s1"}, 3 * B), ({"cache_salt": "s1", "tenant": "t1"}, 3 * B),
    ]:
        out = run(b, P, **kwargs)
        assert (out.num_cached_tokens, out.token_ids) == (cached, want), kwargs


def test_c16_c3_blocks_evicted_from_the_pool_come_back_from_the_tier(make_llm, cold_ids, tmp_path):
    """One process, a small pool: P's blocks are evicted by other prompts, then served from the
    tier, still only within their namespace."""
    llm = tiered(make_llm, kv_disk_dir=str(tmp_path), num_blocks=8)
    assert run(llm, P, cache_salt="s1").num_cached_tokens == 0
    for i in range(3):  # 3 x 4 blocks through an 8-block pool: P's blocks are evicted
        run(llm, [(5000 + 101 * i + 7 * j) % 40000 for j in range(4 * B - 3)])
    flush(llm)
    pool = llm.engine.kv_cache_manager
    assert all(h not in pool.block_pool.cached_block_hash_to_block for h in request_keys_hashes(llm, "s1"))
    want = cold_ids[tuple(P)]
    assert (run(llm, P).num_cached_tokens, run(llm, P, cache_salt="s2").num_cached_tokens) == (0, 0)
    out = run(llm, P, cache_salt="s1")
    assert (out.num_cached_tokens, out.token_ids) == (3 * B, want)
    assert tier_stats(llm, "disk")["hits"] == 3 * B


def request_keys_hashes(llm, salt):
    return [k.block_hash for k in request_keys(llm, P, cache_salt=salt)]


def test_c17_bad_disk_entries_are_misses_and_removed(make_llm, cold_ids, tmp_path):
    a = tiered(make_llm, kv_disk_dir=str(tmp_path))
    run(a, P4)
    flush(a)
    keys = request_keys(a, P4)
    paths = [entry_path(a, tmp_path, k.block_hash) for k in keys]
    layout = a.engine.kv_tiers.layout
    good = [p.read_bytes() for p in paths]
    want = cold_ids[tuple(P4)]

    paths[1].write_bytes(good[1][: len(good[1]) // 2])  # truncated
    b = tiered(make_llm, kv_disk_dir=str(tmp_path))
    out = run(b, P4)
    assert (out.num_cached_tokens, out.token_ids) == (B, want)  # stops at the first bad entry
    assert tier_stats(b, "disk")["bad_entries"] == 1
    flush(b)  # b recomputed blocks 1-3 and stored them again: a whole entry is back
    assert len(bytes(decode_entry(paths[1].read_bytes(), keys[1], layout))) == layout.payload_bytes

    paths[3].write_bytes(good[3][: -layout.payload_bytes] + bytes(layout.payload_bytes))  # zeroed K/V
    c = tiered(make_llm, kv_disk_dir=str(tmp_path))
    out = run(c, P4)
    assert (out.num_cached_tokens, out.token_ids) == (3 * B, want)
    assert tier_stats(c, "disk")["bad_entries"] == 1
    flush(c)
    assert bytes(decode_entry(paths[3].read_bytes(), keys[3], layout)) != bytes(layout.payload_bytes)  # c's entry


def test_c17_redis_blob_of_another_block_is_a_miss(make_llm, cold_ids, redis_server):
    a = tiered(make_llm, kv_redis_url=redis_server.url)
    run(a, P)
    flush(a)
    keys = request_keys(a, P)
    prefix = next(k.decode() for k in redis_server.client.keys("*")).rsplit(":", 1)[0]
    # Block 1's key now holds a valid entry whose token ids are block 2's.
    redis_server.client.set(f"{prefix}:{keys[1].name}", redis_server.client.get(f"{prefix}:{keys[2].name}"))
    b = tiered(make_llm, kv_redis_url=redis_server.url)
    out = run(b, P)
    assert (out.num_cached_tokens, out.token_ids) == (B, cold_ids[tuple(P)])
    assert tier_stats(b, "redis")["bad_entries"] == 1
    flush(b)
    layout = b.engine.kv_tiers.layout
    assert len(decode_entry(redis_server.client.get(f"{prefix}:{keys[1].name}"), keys[1], layout)) > 0


def test_redis_shared_by_replicas_and_going_down_mid_run(make_llm, cold_ids, redis_server, caplog):
    a = tiered(make_llm, kv_redis_url=redis_server.url)
    run(a, P)
    flush(a)
    b = tiered(make_llm, kv_redis_url=redis_server.url)  # a second replica
    out = run(b, P)
    assert (out.num_cached_tokens, out.token_ids) == (3 * B, cold_ids[tuple(P)])
    redis_server.stop()
    c = tiered(make_llm, kv_redis_url=redis_server.url)
    with caplog.at_level("WARNING"):
        outs = [run(c, P), run(c, P4)]
        flush(c)
    assert [o.token_ids for o in outs] == [cold_ids[tuple(P)], cold_ids[tuple(P4)]]
    assert outs[0].num_cached_tokens == 0 and outs[0].finish_reason == "length"
    assert run(c, P).num_cached_tokens == 3 * B  # the pool alone still serves
    assert tier_stats(c, "redis")["errors"] >= 1
    assert "kv tier redis unavailable" in caplog.text


def test_failed_step_stores_nothing(make_llm, tmp_path):
    llm = tiered(make_llm, kv_disk_dir=str(tmp_path))

    def boom(scheduler_output):
        raise RuntimeError("injected")

    llm.engine.runner.execute_model = boom
    llm.engine.add_request(P, GREEDY)
    (out,) = llm.engine.step()
    assert out.finish_reason == "error"
    flush(llm)
    assert tier_stats(llm, "disk")["stores"] == 0 and not list(tmp_path.rglob("*.kv"))


_REPLICA = textwrap.dedent("""
    import json, sys
    from prefixcache.llm import LLM
    from prefixcache.sampling_params import SamplingParams
    prompt, options = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    llm = LLM("smollm2-135m", num_threads=1, **options)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    llm.engine.close()
    print(json.dumps([out.token_ids, out.num_cached_tokens]))
""")


def replica(prompt, python_hash_seed, **options):
    env = {**os.environ, "PYTHONHASHSEED": python_hash_seed, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _REPLICA, json.dumps(prompt), json.dumps(options)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_c15_second_process_hits_the_first_ones_redis_entries(cold_ids, redis_server, tmp_path):
    """Two processes, different PYTHONHASHSEED, same hash seed (a key file) and Redis: the second
    hits what the first computed; another seed gets nothing."""
    key_file = tmp_path / "seed.key"
    key_file.write_text("a-deployment-secret-of-some-length")
    want = cold_ids[tuple(P)]
    assert replica(P, "1", kv_redis_url=redis_server.url, hash_seed_file=str(key_file)) == [want, 0]
    assert replica(P, "2", kv_redis_url=redis_server.url, hash_seed_file=str(key_file)) == [want, 3 * B]
    assert replica(P, "3", kv_redis_url=redis_server.url, hash_seed=5) == [want, 0]
