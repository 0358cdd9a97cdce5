"""KV cache events (case C18) at the cache level: the exact wire bytes, and a recorder on a real
KVCacheManager whose events rebuild exactly the pool's set of cached hashes."""

from __future__ import annotations

import hashlib
import random

import msgspec
import pytest

from prefixcache.cache.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, to_wire_batch
from prefixcache.cache.kv_events import KVEventRecorder, KVEventsConfig, external_block_hash
from prefixcache.config import EngineConfig
from prefixcache.errors import InvalidInputError
from tests.cache.cache_test_utils import admit, make_manager, make_request
from tests.cache.kv_events_test_utils import (
    DECODER,
    CachedHashes,
    VAllBlocksCleared,
    VBlockRemoved,
    VBlockStored,
    engine_hashes,
)

B = 4
U64_MAX = 2**64 - 1

# The batch below, as msgpack (annotated): vLLM's tagged array-like structs.
GOLDEN = bytes.fromhex(
    "93" "cb41d954fc40200000"  # [ts (float64 1700000000.5),
    "94"  # events: 4 of them
    "99" "ab426c6f636b53746f726564"  # ["BlockStored",
    "9201cfffffffffffffffff" "c0"  # block_hashes [1, 2**64-1], parent_block_hash nil,
    "980102030405060708" "04"  # token_ids [1..8], block_size 4,
    "c0" "a3475055" "c0" "c0"  # lora_id nil, medium "GPU", lora_name nil, extra_keys nil]
    "99" "ab426c6f636b53746f726564"  # ["BlockStored",
    "9107" "01"  # block_hashes [7], parent_block_hash 1,
    "94090a0bcd012c" "04"  # token_ids [9, 10, 11, 300 (uint16)], block_size 4,
    "05" "a3435055" "a178"  # lora_id 5, medium "CPU", lora_name "x",
    "919192a674656e616e74a161"  # extra_keys [[["tenant", "a"]]]]
    "93" "ac426c6f636b52656d6f766564" "91cfffffffffffffffff" "a3475055"  # ["BlockRemoved", [2**64-1], "GPU"]
    "91" "b0416c6c426c6f636b73436c6561726564"  # ["AllBlocksCleared"]]
    "00"  # data_parallel_rank 0]
)


def golden_batch() -> KVEventBatch:
    return KVEventBatch(1700000000.5, [
        BlockStored([1, U64_MAX], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None),
        BlockStored([7], 1, [9, 10, 11, 300], 4, 5, "CPU", "x", [(("tenant", "a"),)]),
        BlockRemoved([U64_MAX], "GPU"),
        AllBlocksCleared(),
    ], 0)


def test_golden_bytes_of_a_fixed_batch():
    assert msgspec.msgpack.encode(golden_batch()) == GOLDEN
    # Decoded against vLLM's struct definitions (the test's own), every field comes back.
    decoded = DECODER.decode(GOLDEN)
    assert decoded.ts == 1700000000.5 and decoded.data_parallel_rank == 0
    assert decoded.events == [
        VBlockStored([1, U64_MAX], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None, None),
        VBlockStored([7], 1, [9, 10, 11, 300], 4, 5, "CPU", "x", [(["tenant", "a"],)]),  # inner: Any
        VBlockRemoved([U64_MAX], "GPU"),
        VAllBlocksCleared(),
    ]
    # A positional consumer (llm-d, Dynamo) sees plain arrays led by the tag.
    plain = msgspec.msgpack.decode(GOLDEN)
    assert plain[1][0][:7] == ["BlockStored", [1, U64_MAX], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"]
    assert plain[1][2] == ["BlockRemoved", [U64_MAX], "GPU"] and plain[1][3] == ["AllBlocksCleared"]


def test_external_hash_is_the_low_64_bits_big_endian():
    assert external_block_hash(bytes.fromhex("0102030405060708")) == 0x0102030405060708
    assert external_block_hash(bytes(24) + b"\xff" * 8) == U64_MAX  # sha256: the last 8 bytes


def recorded_manager(num_blocks: int) -> tuple:
    m = make_manager(num_blocks, B)
    recorder = KVEventRecorder(B, "CPU")
    m.block_pool.kv_events = recorder
    return m, recorder


def drain(recorder: KVEventRecorder, view: CachedHashes) -> list:
    """Round-trips the recorded events through the wire and applies them to ``view``."""
    recorded = recorder.take_batch()
    if recorded is None:
        return []
    events = DECODER.decode(msgspec.msgpack.encode(to_wire_batch(recorded))).events
    view.apply(events)
    return events


def test_chain_namespace_eviction_and_reset():
    m, recorder = recorded_manager(6)
    view = CachedHashes()
    a = make_request("a", list(range(10)), block_size=B)  # 2 full blocks + 2 tokens
    admit(m, a)
    (stored,) = drain(recorder, view)
    assert stored == VBlockStored([external_block_hash(h) for h in a.block_hashes], None, list(range(8)), B,
                                  None, "CPU", None, None)
    # Same tokens, another salt and tenant: new hashes, and each block carries its namespace.
    b = make_request("b", list(range(10)), block_size=B, cache_salt="s", tenant="t")
    admit(m, b)
    (stored_b,) = drain(recorder, view)
    salt = ["cache_salt_sha256", hashlib.sha256(b"s").hexdigest()[:16]]
    assert stored_b.extra_keys == [(salt, ["tenant", "t"]), (salt, ["tenant", "t"])]
    assert not set(stored_b.block_hashes) & set(stored.block_hashes)
    assert view.hashes == engine_hashes(m.block_pool) and len(view.hashes) == 4
    m.free(a)
    m.free(b)
    assert drain(recorder, view) == []  # freed blocks stay cached: nothing to say
    # A 5-block request in a 6-block pool takes blocks 2, 1, 0, 5, 4 (LRU, tails freed first):
    # a's two cached blocks and b's second one are evicted; b's first survives.
    c = make_request("c", list(range(100, 120)), block_size=B)
    admit(m, c)
    assert m.get_block_ids("c") == [2, 1, 0, 5, 4]
    events = drain(recorder, view)
    assert [type(e) for e in events] == [VBlockRemoved, VBlockStored]
    assert events[0].block_hashes == [external_block_hash(h) for h in (a.block_hashes[1], a.block_hashes[0],
                                                                         b.block_hashes[1])]
    assert events[1].block_hashes == [external_block_hash(h) for h in c.block_hashes]
    assert view.hashes == engine_hashes(m.block_pool) == set(events[1].block_hashes) | {stored_b.block_hashes[0]}
    m.free(c)
    assert m.reset_prefix_cache()
    assert drain(recorder, view) == [VAllBlocksCleared()]
    assert view.hashes == set() == engine_hashes(m.block_pool)


@pytest.mark.parametrize("tenant", [None, "t"])
def test_int4_output_blocks_carry_their_tenant_name_alone(tenant):
    """An int4 block holding generated tokens keys the tenant's key plus the output key: the event
    names the tenant (it used to send the output key's bytes inside the name, or as a tenant's name
    for a request without one) and, since 2026-12-03, ``("generated_from_slot", slot)`` (before, a
    router matching tokens and extra keys would count it as a prompt's reusable block)."""
    from prefixcache.cache.hashing import BlockHasher, tenant_extra_key
    from prefixcache.layers.quant import INT4_OUTPUT_KEY
    from prefixcache.request import Request

    m, recorder = recorded_manager(6)
    view = CachedHashes()
    base = make_request("a", [1, 2], block_size=B)
    a = Request("a", [1, 2], base.sampling_params, BlockHasher(B, output_block_key=INT4_OUTPUT_KEY), base.root_key,
                tenant_key=tenant_extra_key(tenant))
    admit(m, a)
    for token in (3, 4):  # block 0 fills with 2 prompt and 2 generated tokens
        a.append_output_token_ids(token)
        m.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    (stored,) = drain(recorder, view)
    assert m.get_blocks("a")[0].extra_key == a.block_extra_key(0) != tenant_extra_key(tenant)
    assert stored.block_hashes == [external_block_hash(a.block_hashes[0])] and stored.token_ids == [1, 2, 3, 4]
    # ... and marks the block as generated tokens' K/V (from slot 2 on), which no prompt is served
    generated = ["generated_from_slot", 2]
    assert stored.extra_keys == ([(generated,)] if tenant is None else [(["tenant", "t"], generated)])


def test_forced_collision_reports_a_hash_once_while_any_copy_is_cached(constant_hash):
    m, recorder = recorded_manager(12)
    view = CachedHashes()
    a = make_request("a", [1] * B + [2] * B + [3], block_size=B)
    b = make_request("b", [5] * B + [6] * B + [7], block_size=B)
    admit(m, a)
    admit(m, b)  # two more cached blocks under the very same hash
    events = drain(recorder, view)
    assert len(events) == 1 and events[0].block_hashes == [external_block_hash(b"\0" * 8)]
    assert len(m.block_pool.cached_block_hash_to_block[b"\0" * 8]) == 4
    m.free(a)
    m.block_pool.uncache(m.req_to_blocks["b"][:2])  # b's copies go, a's stay: still cached
    assert drain(recorder, view) == [] and view.hashes == engine_hashes(m.block_pool) != set()
    m.free(b)
    m.block_pool.uncache(m.block_pool.blocks)  # the last copies go: now removed
    assert drain(recorder, view) == [VBlockRemoved([external_block_hash(b"\0" * 8)], "CPU")]
    assert view.hashes == set() == engine_hashes(m.block_pool)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_events_rebuild_the_pool_hash_set(seed):
    rng = random.Random(seed)
    m, recorder = recorded_manager(24)
    view = CachedHashes()
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(3)]
    running = []
    for i in range(300):
        op = rng.random()
        if op < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            r = make_request(f"r{i}", prompt, block_size=B, cache_salt=rng.choice((None, "s")),
                             tenant=rng.choice((None, "t1", "t2")))
            if admit(m, r)[0] is not None:
                running.append(r)
        elif op < 0.95 and running:
            m.free(running.pop(rng.randrange(len(running))))
        elif not running:
            assert m.reset_prefix_cache()
        m.end_step()
        drain(recorder, view)
        assert view.hashes == engine_hashes(m.block_pool)
    assert any(isinstance(e, VBlockStored) and e.parent_block_hash is not None for e in view.stored)


def test_config_parse_and_errors_name_the_field():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv", "replay_endpoint": "tcp://*:5558"}')
    assert config == KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5558", 10_000, 100_000, 100_000, "kv")
    assert KVEventsConfig.parse(None) is None and not KVEventsConfig().enabled
    assert EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True}).kv_events_config.enabled
    for bad, key in (("{", "not valid JSON"), ('{"nope": 1}', "unknown key"), ('{"publisher": "kafka"}', "publisher"),
                     ('{"buffer_steps": 0}', "buffer_steps"), ('{"endpoint": "nowhere"}', "endpoint"), ("[]", "JSON object")):
        with pytest.raises(InvalidInputError, match=key) as info:
            EngineConfig.from_kwargs(kv_events_config=bad)
        assert info.value.field == "kv_events_config"
