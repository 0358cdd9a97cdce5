"""KV-cache groups: a synthetic hybrid model (full + sliding-window layers) driving the manager and
the scheduler directly, with hand-computed block ids, ref counts, hit lengths and eviction order."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_test_utils import make_request
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.kv_cache_groups import (AttentionKind, LayerSpec,
                                               group_block_hash, layer_specs_from_config, make_kv_cache_groups,
                                               single_group)
from prefixcache.cache.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from prefixcache.config import SchedulerConfig
from prefixcache.engine.scheduler import Scheduler
from prefixcache.request import RequestStatus
from prefixcache.runner.kv_pool import kv_cache_groups_of

B = 4  # block_size
W = 8  # sliding window: a query at p reads keys p - 7 .. p
FULL, SLIDING = LayerSpec(AttentionKind.FULL), LayerSpec(AttentionKind.SLIDING, W)
# 6 layers, full and sliding alternating: group 0 = {0, 2, 4} (full), group 1 = {1, 3, 5} (sliding)
HYBRID = make_kv_cache_groups([FULL, SLIDING] * 3)


def make_hybrid(num_blocks: int, groups=HYBRID, **options) -> KVCacheManager:
    config = dataclasses.replace(CacheConfig(block_size=B), **options)
    return KVCacheManager(num_blocks, config, kv_cache_groups=groups)


def step(kv: KVCacheManager, request, num_new_tokens: int, output_token: int | None = None):
    """One step of the request as the scheduler runs it: allocate, compute, end_step, advance, release."""
    new_blocks = kv.allocate_slots(request, num_new_tokens)
    assert new_blocks is not None
    kv.end_step()
    request.num_computed_tokens += num_new_tokens
    kv.remove_skipped_blocks(request)
    if output_token is not None:
        request.append_output_token_ids(output_token)
    return new_blocks


def prefill(kv: KVCacheManager, request):
    admission = kv.admit(request, request.num_tokens)
    assert admission is not None
    kv.end_step()
    request.num_computed_tokens += admission.num_new_tokens
    kv.remove_skipped_blocks(request)
    return admission


def sliding_table(kv, request):
    return kv.req_to_group_blocks[request.request_id][0]


# -- grouping -------------------------------------------------------------------------------------

def test_gemma3_270m_layers_form_one_full_group_and_five_sliding_groups_of_three():
    layer_types = ["full_attention" if i in (5, 11, 17) else "sliding_attention" for i in range(18)]
    config = SimpleNamespace(num_hidden_layers=18, layer_types=layer_types, sliding_window=512)
    groups = make_kv_cache_groups(layer_specs_from_config(config))
    assert groups.layers_per_group == 3
    assert [g.layer_ids for g in groups.groups] == [
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert [g.is_sliding for g in groups.groups] == [False] + [True] * 5
    assert groups.layer_to_group[11] == (0, 1) and groups.layer_to_group[6] == (2, 2)


def test_one_group_for_an_all_full_model_keeps_one_tensor_per_layer():
    for config in (SimpleNamespace(num_hidden_layers=4), SimpleNamespace(num_hidden_layers=4, layer_types=())):
        groups = make_kv_cache_groups(layer_specs_from_config(config))
        assert groups == single_group(4)
        assert not groups.is_hybrid and groups.layers_per_group == 4
        assert groups.layer_to_group == ((0, 0), (0, 1), (0, 2), (0, 3))
    assert group_block_hash(b"12345678", 0) == b"12345678" and group_block_hash(b"12345678", 1) != b"12345678"


def test_bad_layer_types_and_sliding_only_models_are_refused():
    with pytest.raises(ValueError, match="layer_types\\[1\\]"):
        layer_specs_from_config(SimpleNamespace(num_hidden_layers=2, layer_types=["full_attention", "local"]))
    with pytest.raises(ValueError, match="sliding_window"):
        layer_specs_from_config(SimpleNamespace(num_hidden_layers=1, layer_types=["sliding_attention"]))
    with pytest.raises(ValueError, match="full-attention"):
        make_kv_cache_groups([SLIDING, SLIDING])


def test_only_a_model_that_takes_group_metadata_gets_groups():
    config = SimpleNamespace(num_hidden_layers=6, layer_types=["full_attention", "sliding_attention"] * 3,
                             sliding_window=W)
    opted_in = torch.nn.Module()
    opted_in.uses_kv_cache_groups = True
    assert kv_cache_groups_of(opted_in, config) == HYBRID
    assert kv_cache_groups_of(torch.nn.Module(), config) == single_group(6)


# -- allocation and release -----------------------------------------------------------------------

def test_each_group_gets_its_own_blocks_from_one_pool():
    kv = make_hybrid(20)
    request = make_request("a", list(range(10)), B)  # 3 blocks
    admission = kv.admit(request, 10)
    assert [b.block_id for b in admission.new_blocks] == [0, 1, 2]
    assert kv.get_group_block_ids("a") == [[0, 1, 2], [3, 4, 5]]
    blocks = kv.block_pool.blocks
    assert [blocks[i].group_id for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert all(blocks[i].ref_cnt == 1 for i in range(6))
    # full blocks cached in both groups, group 1 under (hash, group) with group 0's block as anchor
    assert blocks[4].block_hash == group_block_hash(request.block_hashes[1], 1) and blocks[4].parent is blocks[1]
    assert blocks[0].num_cached_children == 1  # group 0's next block only: attached blocks are no children
    assert kv.block_pool.get_num_free_blocks() == 14


def test_blocks_outside_the_window_are_released_after_the_step_and_stay_hit_able():
    kv = make_hybrid(20)
    request = make_request("a", list(range(20)), B)  # 5 blocks, prefilled in one step
    prefill(kv, request)
    # next token at 20 reads keys 13..20: blocks 0-2 (tokens 0-11) are out of every window
    table = sliding_table(kv, request)
    assert [b is None for b in table] == [True, True, True, False, False]
    assert kv.get_group_block_ids("a")[1] == [NULL_BLOCK_ID] * 3 + [8, 9]
    released = kv.block_pool.blocks[5:8]
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in released)
    # retention: block 2 is among the last ceil(8/4)+1 = 3 before the prompt's end (block 5)
    assert list(kv.block_pool.retained) == [7]
    assert [b.block_id for b in kv.block_pool.evictor.get_all_free_blocks()][-2:] == [6, 5]  # tail first
    assert kv.block_pool.get_num_free_blocks() == 20 - 5 - 2


def test_local_kv_held_per_sequence_stays_within_window_plus_one_block():
    kv = make_hybrid(64)
    request = make_request("a", list(range(10)), B, max_tokens=64)
    prefill(kv, request)
    for t in range(40):
        step(kv, request, 1, output_token=100 + t)
        computed = request.num_computed_tokens
        held = sum(b is not None for b in sliding_table(kv, request))
        filling = B if computed % B else 0
        assert held * B <= W + B + filling, (computed, held)
        skipped = HYBRID.groups[1].num_skipped_blocks(computed, B)
        assert all(b is None for b in sliding_table(kv, request)[:skipped])
    assert len(kv.req_to_blocks["a"]) == -(-request.num_computed_tokens // B)  # the full group keeps all


# -- the hit rule ---------------------------------------------------------------------------------

def test_hit_length_is_what_every_group_serves():
    kv = make_hybrid(40)
    a = make_request("a", list(range(24)), B)  # 6 blocks
    prefill(kv, a)
    kv.free(a)
    b = make_request("b", list(range(28)), B)  # the same 24 tokens, then 4 more
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 24  # group 0 has every block
    full, tables = kv._hybrid_hits(b, hits)
    assert len(full) == 6 and [x is None for x in tables[0]] == [True] * 4 + [False] * 2  # window [17, 24)

    pool = kv.block_pool
    sliding = {i: pool.get_cached_block(group_block_hash(b.block_hashes[i], 1), b.all_token_ids[4 * i: 4 * i + 4],
                                        hits[i], b.root_key) for i in range(6)}
    assert all(block is not None for block in sliding.values())
    pool.uncache([sliding[5]], reason="test")  # the full chain is intact, the window at 24 is not
    full, tables = kv._hybrid_hits(b, hits)
    assert len(full) == 5  # blocks 3-4 cover [13, 20): a hit of 20 tokens
    assert tables[0] == [None, None, None, sliding[3], sliding[4]]
    pool.uncache([sliding[3]], reason="test")
    full, tables = kv._hybrid_hits(b, hits)
    assert len(full) == 3  # only blocks 1-2 form a window run: 12 tokens
    pool.uncache([sliding[1]], reason="test")
    assert len(kv._hybrid_hits(b, hits)[0]) == 1  # block 0 alone, from the start: all a 4-token hit needs

    admission = kv.admit(b, b.num_tokens)
    assert admission.num_hit_tokens == 4 == b.num_cached_tokens
    assert kv.stats.hits == 4


def test_a_second_request_takes_the_window_blocks_by_reference():
    kv = make_hybrid(40)
    a = make_request("a", list(range(24)), B)
    prefill(kv, a)
    b = make_request("b", list(range(24)) + [99, 98, 97], B)
    admission = kv.admit(b, b.num_tokens)
    assert admission.num_hit_tokens == 24
    a_ids, b_ids = kv.get_group_block_ids("a"), kv.get_group_block_ids("b")
    assert b_ids[0][:6] == a_ids[0]
    assert b_ids[1][:6] == [NULL_BLOCK_ID] * 4 + a_ids[1][4:6]
    assert all(kv.block_pool.blocks[i].ref_cnt == 2 for i in a_ids[1][4:6])


# -- retention ------------------------------------------------------------------------------------

def test_the_window_at_the_end_of_a_prefix_is_evicted_after_every_other_free_block():
    kv = make_hybrid(24)
    a = make_request("a", list(range(24)), B)  # group 0: blocks 0-5, group 1: blocks 6-11
    prefill(kv, a)  # sliding blocks 0-3 released: 6-8 as usual, 9 (near the prompt's end) retained
    kv.free(a)  # then 11, 10 retained, group 0's 5..0 tail first
    pool = kv.block_pool
    assert list(pool.retained) == [9, 11, 10]
    order = [b.block_id for b in pool.evictor.get_all_free_blocks()]
    assert order == list(range(12, 24)) + [8, 7, 6, 5, 4, 3, 2, 1, 0]
    taken = pool.get_new_blocks(15)  # the never-used blocks, then the sliding blocks released early
    assert sorted(b.block_id for b in taken) == list(range(6, 9)) + list(range(12, 24))
    b = make_request("b", list(range(24)) + [5], B)
    assert len(kv._hybrid_hits(b, kv.get_computed_blocks(b)[0])[0]) == 6  # still a 24-token hit
    (tail,) = pool.get_new_blocks(1)  # group 0's tail: its retained window block can't be hit any more
    assert tail.block_id == 5 and list(pool.retained) == [9, 10]
    assert pool.blocks[11].block_hash is None and pool.evictor.get_all_free_blocks()[0].block_id == 11
    assert len(kv._hybrid_hits(b, kv.get_computed_blocks(b)[0])[0]) == 5  # blocks 3-4 cover [13, 20)


def test_a_retained_window_keeps_its_prefix_hit_able_under_pressure():
    kv = make_hybrid(20)
    a = make_request("a", list(range(24)), B)
    prefill(kv, a)
    kv.free(a)
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == 20 and len(pool.retained) == 3
    # other traffic takes 10 of the 11 free blocks not of a's chain or window: 5 per group
    filler = make_request("f", [1000 + i for i in range(20)], B)
    prefill(kv, filler)
    assert pool.get_num_free_blocks() == 20 - 10 + 3  # its out-of-window blocks came back
    b = make_request("b", list(range(24)) + [7], B)
    assert kv.admit(b, b.num_tokens).num_hit_tokens == 24


# -- property test --------------------------------------------------------------------------------

def check_invariants(kv: KVCacheManager, scheduler: Scheduler) -> None:
    pool = kv.block_pool
    holders: dict[int, int] = {}
    for rid in kv.req_to_blocks:
        for table in [kv.req_to_blocks[rid], *kv.req_to_group_blocks.get(rid, [])]:
            for block in table:
                if block is not None:
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        free = block in pool.evictor or block.block_id in pool.retained
        assert free == (block.ref_cnt == 0), block
    assert pool.get_num_free_blocks() + sum(b.ref_cnt > 0 for b in pool.blocks) == pool.num_blocks
    for rid, request in scheduler.running.items():
        tables = kv.req_to_group_blocks[rid]
        assert len(tables[0]) == len(kv.req_to_blocks[rid])
        for group, table in zip(kv.kv_cache_groups.groups[1:], tables):
            skipped = group.num_skipped_blocks(request.num_computed_tokens, B)
            assert all(b is None for b in table[:skipped]), (rid, request.num_computed_tokens, table)
            for i, block in enumerate(table):
                if block is not None:
                    assert block.group_id == group.group_id
                    if block.block_hash is not None:  # cached: this request's tokens, on its group-0 block
                        assert list(block.token_ids) == request.all_token_ids[i * B: (i + 1) * B]
                        assert block.parent is kv.req_to_blocks[rid][i]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(12, 40),
    policy=st.sampled_from(["lru", "lfu", "ttl", "cost"]),
    prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=8),
    aborts=st.lists(st.integers(0, 40), max_size=4),
    two_sliding=st.booleans(),
)
def test_random_traffic_keeps_ref_counts_and_windows(num_blocks, policy, prompts, aborts, two_sliding):
    groups = make_kv_cache_groups([FULL, SLIDING, FULL, LayerSpec(AttentionKind.SLIDING, 6)] if two_sliding
                                  else [FULL, SLIDING] * 3)
    kv = make_hybrid(num_blocks, groups, eviction_policy=policy, cache_ttl_s=1.0)
    clock = [0.0]
    kv.block_pool.clock = kv.block_pool.evictor.clock = lambda: clock[0]
    scheduler = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    prefixes = [list(range(13)), list(range(50, 59)), []]
    for i, (prefix, length, max_tokens) in enumerate(prompts):
        tokens = (prefixes[prefix] + [200 + i * 7 + j for j in range(length)])[: min(40, num_blocks * B // 2)]
        scheduler.add_request(make_request(f"r{i}", tokens, B, max_tokens=max_tokens))
    for step_no in range(200):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        sampled = {s.request_id: 7 for s in out.seqs if s.sampling_params is not None}
        for request in scheduler.update_from_output(out, sampled):
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        if step_no in aborts and scheduler.running:
            scheduler.finish_request(next(iter(scheduler.running)), RequestStatus.FINISHED_ABORTED)
        clock[0] += 0.3
        kv.sweep_expired()
        check_invariants(kv, scheduler)
    for rid in list(scheduler.requests):
        scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    check_invariants(kv, scheduler)
    assert kv.block_pool.get_num_free_blocks() == num_blocks
