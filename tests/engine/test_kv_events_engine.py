"""KV cache events from the real engine (case C18): a ZeroMQ subscriber on loopback that applies the
stream holds exactly the engine's set of cached block hashes after random traffic (shared
prefixes, evictions under a small pool, an adapter reload, reset_prefix_cache); a late joiner gets
there through the replay socket; two tenants' identical text never share a hash."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from prefixcache import LoRARequest, SamplingParams
from tests.cache.kv_events_test_utils import Follower, engine_hashes

pytest.importorskip("zmq")

BS = 4  # small blocks: short prompts still fill several, and a small pool evicts often
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def events_llm(make_llm, num_blocks: int, **options):
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}
    return make_llm(num_blocks=num_blocks, block_size=BS, kv_events_config=json.dumps(config), **options)


def write_adapter(path, seed: int) -> None:
    """A small PEFT-format LoRA adapter on layer 0's q_proj (random weights from ``seed``)."""
    from safetensors.torch import save_file

    path.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.randn(2, 576, generator=g) * 0.05,
               f"{prefix}.lora_B.weight": torch.randn(576, 2, generator=g) * 0.05},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"], "seed": seed}))


def random_round(llm, rng: random.Random, prefixes: list[list[int]], lora: LoRARequest | None) -> None:
    prompts = []
    for _ in range(rng.randrange(2, 5)):
        prompts.append(rng.choice(prefixes)[: rng.choice((BS, 2 * BS, 3 * BS))]
                       + [rng.randrange(300, 40000) for _ in range(rng.randrange(1, 2 * BS))])
    llm.generate(prompts, GREEDY, use_tqdm=False, cache_salt=rng.choice((None, "salt-1")),
                 tenant=rng.choice((None, "acme", "globex")), lora=lora if rng.random() < 0.3 else None)


def test_subscriber_and_late_joiner_rebuild_the_engine_hash_set(make_llm, tmp_path):
    llm = events_llm(make_llm, num_blocks=20)
    pool = llm.engine.kv_cache_manager.block_pool
    rng = random.Random(0)
    prefixes = [[rng.randrange(300, 40000) for _ in range(3 * BS)] for _ in range(3)]
    adapter = tmp_path / "adapter"
    write_adapter(adapter, seed=1)
    lora = LoRARequest("ad", str(adapter))
    live = Follower(llm.engine.kv_event_publisher, "kv")
    late = None
    try:
        live.join_live()
        for round_ in range(6):
            random_round(llm, rng, prefixes, lora)
            if round_ == 2:  # the adapter's files change: its old chains are invalidated on next use
                llm.generate(prefixes[0][:2 * BS] + [5], GREEDY, use_tqdm=False, lora=lora)
                time.sleep(0.01)
                write_adapter(adapter, seed=2)
                llm.generate(prefixes[1][:BS] + [7], GREEDY, use_tqdm=False, lora=lora)
            if round_ == 4:
                assert llm.reset_prefix_cache()
            live.catch_up()
            assert live.view.hashes == engine_hashes(pool), f"round {round_}"
            if round_ == 3:  # a subscriber joins late and replays from the first batch
                late = Follower(llm.engine.kv_event_publisher, "kv")
                late.join_live()
                joined_at = late.next_seq
                late.next_seq = None
                for seq, payload in late.sub.request_replay(0):
                    late.apply(seq, payload)
                assert late.next_seq == joined_at  # the replay reached the join point
            if late is not None:
                late.catch_up()
                assert late.view.hashes == engine_hashes(pool), f"late joiner, round {round_}"
        stored = live.view.stored
        assert any(e.parent_block_hash is not None for e in stored)  # chains continued across steps
        assert any(e.lora_name == "ad" and e.lora_id for e in stored)
        # The traffic did what it was meant to: LRU evictions in the small pool, and the
        # adapter's old chains invalidated by its reload.
        reasons = pool.eviction_stats.evictions_by_reason
        assert reasons.get("lru", 0) > 0 and reasons.get("invalidated", 0) > 0, reasons
    finally:
        live.close()
        if late is not None:
            late.close()
        llm.engine.close()


def test_two_tenants_same_text_never_share_a_hash(make_llm):
    llm = events_llm(make_llm, num_blocks=64)
    follower = Follower(llm.engine.kv_event_publisher, "kv")
    try:
        follower.join_live()
        text = list(range(1000, 1000 + 3 * BS + 5))
        shared = text[:BS]
        llm.engine.add_approved_prefix(shared)  # one public block every tenant may share
        for tenant in ("acme", "globex"):
            llm.generate(text, GREEDY, use_tqdm=False, tenant=tenant)
        llm.generate(text, GREEDY, use_tqdm=False, cache_salt="s")
        follower.catch_up()
        by_namespace: dict[str, list[int]] = {}  # namespace -> stored hashes
        for event in follower.view.stored:
            for i, h in enumerate(event.block_hashes):
                keys = dict(map(tuple, event.extra_keys[i])) if event.extra_keys and event.extra_keys[i] else {}
                name = keys.get("tenant") or ("salted" if "cache_salt_sha256" in keys else "public")
                by_namespace.setdefault(name, []).append(h)
        # The approved first block is stored once, unkeyed; each tenant's later blocks are its own.
        # 17 prompt + 2 output tokens: 4 full blocks per request.
        assert len(by_namespace["public"]) == 1
        assert len(by_namespace["acme"]) == len(by_namespace["globex"]) == 3
        assert len(by_namespace["salted"]) == 4  # another root key: even the first block differs
        everything = [h for hashes in by_namespace.values() for h in hashes]
        assert len(set(everything)) == len(everything) == 11
        assert follower.view.hashes == engine_hashes(llm.engine.kv_cache_manager.block_pool)
    finally:
        follower.close()
        llm.engine.close()


def test_events_are_off_by_default(make_llm):
    llm = make_llm(num_blocks=16)
    assert llm.engine.kv_event_publisher is None and llm.engine.kv_cache_manager.block_pool.kv_events is None
    llm.generate(list(range(100, 140)), GREEDY, use_tqdm=False)
    assert llm.engine.kv_event_recorder is None
