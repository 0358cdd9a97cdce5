"""``prefixcache bench --workload restart``: three real processes over a real disk directory and a real
redis-server (started by the bench), on short prompts; exact cached-token counts and exact tokens."""

from __future__ import annotations

import json

import pytest

from prefixcache.bench.accounting import common_prefix_len
from prefixcache.bench.restart import RestartOptions, restart_markdown, run_restart, write_restart_outputs
from prefixcache.bench.workloads import build_speed_prompts

B = 16


@pytest.mark.slow
def test_restart_workload_hits_disk_and_redis_with_exact_tokens(smollm2, tmp_path):
    tokenizer = smollm2.tokenizer
    opts = RestartOptions(model="smollm2-135m", num_threads=1, prefix_tokens=70, num_warm=2, max_tokens=4)
    s = run_restart(opts, tokenizer, log=lambda _: None)

    prompts = build_speed_prompts(tokenizer, opts.num_warm + 2, opts.prefix_tokens).shared
    stored, x = prompts[:-1], prompts[-1]
    # X's longest shared run with what A stored, in full blocks: what B and C take from the tiers.
    want_hit = max(common_prefix_len([x, p]) for p in stored) // B * B
    assert want_hit >= 4 * B
    assert s["cold_cached_tokens"] == 0 and s["reference_cached_tokens"] == 0
    assert s["restart_cached_tokens"] == want_hit
    assert s["replica_cached_tokens"] == want_hit
    assert s["tokens_match"] is True
    first, restart, replica = s["phases"]
    assert [p["phase"] for p in s["phases"]] == ["first", "restart", "replica"]
    # After X, B's requests take every full block but the last token's: X's prefix from B's pool,
    # the rest from disk (A computed those prompts whole).
    want_b = [want_hit] + [(len(p) - 1) // B * B for p in stored[1:]]
    assert [r["num_cached_tokens"] for r in restart["requests"]] == want_b
    assert restart["kv_tiers"]["disk"]["hits"] == want_hit + sum(c - want_hit for c in want_b[1:])
    assert "redis" not in restart["kv_tiers"]
    assert replica["kv_tiers"]["redis"]["hits"] == want_hit and "disk" not in replica["kv_tiers"]
    # A stored every full block it computed, prompt and generated tokens (all but the last sampled
    # one go through the model), in both tiers: the reference's salted ones too.
    computed_blocks = sum((len(p) + opts.max_tokens - 1) // B for p in prompts) - sum(
        r["num_cached_tokens"] // B for r in first["requests"])
    assert first["kv_tiers"]["disk"]["stores"] == computed_blocks
    assert first["kv_tiers"]["redis"]["stores"] == computed_blocks
    assert s["page_cache_dropped_files"] == computed_blocks
    assert s["goals"][0]["met"] is True
    assert s["disk_load_s_per_block"] > 0 and s["redis_load_s_per_block"] > 0

    paths = write_restart_outputs(s, tmp_path, plots=True)
    assert [p.name for p in paths] == ["restart.json", "restart.md", "restart.png"]
    assert json.loads(paths[0].read_text())["restart_cached_tokens"] == want_hit
    assert f"| restart: first request, prefix from the disk tier | {s['restart_ttft_s']:.3f} |" in restart_markdown(s)


def test_restart_options_are_checked():
    with pytest.raises(ValueError, match="restart num_warm must be an integer >= 2"):
        RestartOptions(model="m", num_threads=1, num_warm=1).validate()
    with pytest.raises(ValueError, match="restart prefix_tokens"):
        RestartOptions(model="m", num_threads=1, prefix_tokens=0).validate()
