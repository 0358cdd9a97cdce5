"""Exact eviction order per policy, partial-block hits and C3 under every policy (cache manager).

Setting of the hand-built cases (B = 4, 8 blocks): request ``a`` (9 tokens) takes blocks 0, 1, 2
and caches 0 <- 1; each ``b`` hits ``a``'s two blocks and takes one more block; then ``c`` (9
other tokens) takes the next three blocks and caches the first two. Requests free tail first.
"""

from __future__ import annotations

import pytest

from prefixcache.cache.eviction import EVICTION_POLICIES
from prefixcache.cache.kv_cache_manager import CopyOp, KVCacheManager, PartialHit
from prefixcache.config import EngineConfig
from tests.cache.cache_test_utils import make_manager, admit, ids, make_request

B = 4
A = list(range(9))
C = list(range(50, 59))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(m: KVCacheManager, rid: str, prompt: list[int]):
    """Admits a request for its whole prompt, then frees it; returns its hit tokens."""
    request = make_request(rid, prompt, block_size=B)
    _, num_hit = admit(m, request)
    m.free(request)
    return num_hit


def scenario(policy: str, clock: Clock, hit_times=(1.0,), c_time=10.0, **kw) -> KVCacheManager:
    m = make_manager(8, B, eviction_policy=policy, clock=clock, **kw)
    assert run(m, "a", A) == 0
    for i, t in enumerate(hit_times):
        clock.now = t
        assert run(m, f"b{i}", A[:8] + [100 + i]) == 8
    clock.now = c_time
    assert run(m, "c", C) == 0
    return m


def free_order(m: KVCacheManager) -> list[int]:
    return ids(m.block_pool.evictor.get_all_free_blocks())


def take_all(m: KVCacheManager) -> list[int]:
    """Allocates every block (the real eviction path) and returns the ids in order taken."""
    return ids(m.block_pool.get_new_blocks(8))


def test_registry_and_config_validation():
    assert sorted(EVICTION_POLICIES) == ["cost", "lfu", "lru", "ttl"]
    with pytest.raises(ValueError, match=r"\['cost', 'lfu', 'lru', 'ttl'\]"):
        EngineConfig.from_kwargs(eviction_policy="fifo")
    with pytest.raises(ValueError, match="cache_ttl_s"):
        EngineConfig.from_kwargs(cache_ttl_s=0)
    with pytest.raises(ValueError, match="eviction_policy"):
        make_manager(8, B, eviction_policy="nope")


def test_lru_order_unchanged_single_queue():
    m = scenario("lru", Clock())
    # One queue in free order: a's chain (refreshed by b) goes before c's more recent one.
    assert free_order(m) == [7, 2, 3, 1, 0, 6, 5, 4]
    assert take_all(m) == [7, 2, 3, 1, 0, 6, 5, 4]
    assert m.block_pool.eviction_stats.evictions_by_reason == {"lru": 4}


def test_lfu_evicts_unhit_chain_first_children_before_parents():
    m = scenario("lfu", Clock(), hit_times=(1.0, 2.0))
    # uncached first (FIFO), then c's chain 5 <- 6 (0 hits; leaf 6 first), then a's (2 hits).
    assert free_order(m) == [2, 3, 4, 7, 6, 5, 1, 0]
    assert take_all(m) == [2, 3, 4, 7, 6, 5, 1, 0]
    assert m.block_pool.eviction_stats.evictions_by_reason == {"lfu": 4}


def test_lfu_ties_go_to_the_least_recently_freed():
    m = scenario("lfu", Clock(), hit_times=())
    # a's chain 0 <- 1 and c's 3 <- 4 both have 0 hits: a's was freed first.
    assert free_order(m) == [6, 7, 2, 5, 1, 0, 4, 3]


def test_ttl_expired_blocks_miss_and_go_first():
    clock = Clock()
    m = scenario("ttl", clock, hit_times=(1.0,), c_time=100.0, cache_ttl_s=50.0)
    clock.now = 120.0  # a's blocks idle 119 s > 50 s: expired; c's idle 20 s
    assert m.get_computed_blocks(make_request("x", A[:8] + [7], block_size=B))[1] == 0
    assert m.get_computed_blocks(make_request("y", C[:8] + [7], block_size=B))[1] == 8
    assert free_order(m) == [7, 2, 3, 6, 1, 0, 5, 4]
    assert take_all(m) == [7, 2, 3, 6, 1, 0, 5, 4]
    assert m.block_pool.eviction_stats.evictions_by_reason == {"ttl": 2, "lru": 2}
    assert m.block_pool.eviction_stats.mean_evicted_age_s == pytest.approx((120 * 2 + 20 * 2) / 4)


def test_ttl_sweep_evicts_expired_blocks_without_waiting_for_a_victim():
    clock = Clock()
    m = scenario("ttl", clock, hit_times=(1.0,), c_time=100.0, cache_ttl_s=50.0)
    pool = m.block_pool
    assert pool.num_cached_blocks == 4
    # t=100: a's blocks 0 <- 1 are idle 99 s > 50 s; c's 5 <- 4 were just freed.
    assert pool.sweep_expired() == 2
    assert pool.num_cached_blocks == 2 and pool.eviction_stats.evictions_by_reason == {"ttl": 2}
    assert pool.blocks[0].block_hash is None and pool.blocks[1].block_hash is None
    assert pool.sweep_expired() == 0
    assert m.get_computed_blocks(make_request("y", C[:8] + [7], block_size=B))[1] == 8
    assert free_order(m) == [7, 2, 3, 6, 1, 0, 5, 4]  # the swept blocks are now plain free blocks
    clock.now = 151.0  # c's blocks idle 51 s
    assert pool.sweep_expired() == 2 and pool.num_cached_blocks == 0
    assert pool.eviction_stats.evictions_by_reason == {"ttl": 4}
    lru = make_manager(4, B)
    assert lru.block_pool.sweep_expired() == 0  # no other policy expires anything


def test_cost_keeps_frequent_chain_until_it_decays():
    clock = Clock()
    m = scenario("cost", clock, hit_times=(1.0, 2.0, 3.0), c_time=10.0)
    assert free_order(m) == [3, 4, 5, 2, 7, 6, 1, 0]  # a (0 <- 1): 4 uses; c (6 <- 7): 1, later
    clock2 = Clock()
    # Same history, but c comes 20 half-lives later: a's uses have decayed below c's one.
    m2 = scenario("cost", clock2, hit_times=(1.0, 2.0, 3.0), c_time=1200.0)
    assert free_order(m2) == [3, 4, 5, 2, 1, 0, 7, 6]
    assert take_all(m2) == [3, 4, 5, 2, 1, 0, 7, 6]
    assert m2.block_pool.eviction_stats.evictions_by_reason == {"cost": 4}


def test_cost_children_before_parent_even_when_deeper_is_worth_more():
    # One 3-block chain used once: depth makes block 2 the most valuable, yet it goes first.
    m = make_manager(8, B, eviction_policy="cost", clock=Clock())
    assert run(m, "a", list(range(13))) == 0  # blocks 0 <- 1 <- 2 cached, 3 uncached
    pool = m.block_pool
    cost = pool.evictor
    values = [cost.priority(pool.blocks[i])[0] for i in range(3)]
    assert values[0] < values[1] < values[2]
    assert free_order(m)[-3:] == [2, 1, 0]


def test_uncached_blocks_go_before_cached_ones_except_lru():
    for policy in ("lfu", "ttl", "cost"):
        m = scenario(policy, Clock())
        assert all(b.block_hash is None for b in m.block_pool.evictor.get_all_free_blocks()[:4])
        assert all(b.block_hash is not None for b in m.block_pool.evictor.get_all_free_blocks()[4:])


def test_metrics_cached_bytes_and_snapshot():
    m = make_manager(8, B, eviction_policy="cost", bytes_per_block=1000, clock=Clock())
    run(m, "a", A)
    assert m.block_pool.cached_bytes == 2000
    snap = m.make_snapshot()
    assert (snap.cached_bytes, snap.evictions_by_reason, snap.prefix_cache_partial_hits) == (2000, {}, 0)


# -- partial-block reuse ----------------------------------------------------------------------------


def test_partial_hit_exact_tokens_and_copy_op():
    m = make_manager(16, B)
    a = make_request("a", list(range(10)), block_size=B)  # blocks 0 <- 1 cached, 2 partial
    admit(m, a)
    m.end_step()
    b = make_request("b", list(range(7)) + [99, 98], block_size=B)  # shares 7 tokens: 1 block + 3
    hits, n = m.get_computed_blocks(b)
    partial = m.get_partial_hit(b, hits)
    assert (ids(hits), n, partial) == ([0], 4, PartialHit(m.block_pool.blocks[1], 3))
    new = m.allocate_slots(b, b.num_tokens - 7, hits, n, partial)
    assert ids(new) == [3, 4]
    assert m.pending_copy_ops == [CopyOp(1, 3, 3)]
    assert m.block_pool.blocks[1].ref_cnt == 2  # a + pinned for the copy
    m.end_step()
    assert m.block_pool.blocks[1].ref_cnt == 1 and m.pending_copy_ops == []


def test_partial_hit_leaves_last_token_and_skips_unwritten_blocks():
    m = make_manager(16, B)
    a = make_request("a", list(range(8)) + [50], block_size=B)
    admit(m, a)
    same = make_request("s", list(range(8)), block_size=B)  # 2 blocks: hit 1, copy 3, compute 1
    hits, n = m.get_computed_blocks(same)
    assert m.get_partial_hit(same, hits) is None  # block 1 cached this step: K/V not written yet
    m.end_step()
    assert m.get_partial_hit(same, hits) == PartialHit(m.block_pool.blocks[1], 3)
    off = make_manager(16, B, enable_partial_block_reuse=False)
    admit(off, make_request("a", list(range(9)), block_size=B))
    off.end_step()
    assert off.get_partial_hit(same, off.get_computed_blocks(same)[0]) is None


def test_partial_source_is_pinned_against_eviction():
    m = make_manager(4, B)  # a: blocks 0 <- 1 cached, 2 uncached; all freed
    run(m, "a", list(range(9)))
    m.end_step()
    b = make_request("b", list(range(6)) + [77, 78, 79, 80, 81, 82, 83], block_size=B)
    hits, n = m.get_computed_blocks(b)
    partial = m.get_partial_hit(b, hits)
    assert partial == PartialHit(m.block_pool.blocks[1], 2)
    # needs 4 blocks: 1 hit + 3 new, but block 1 is pinned: only 2 others are free.
    assert m.allocate_slots(b, b.num_tokens - 6, hits, n, partial) is None
    assert m.allocate_slots(b, 2, hits, n, partial) is not None  # 8 tokens: 1 hit + 1 new
    assert m.block_pool.blocks[1].ref_cnt == 1 and m.block_pool.blocks[1].block_hash is not None


def test_a_prompt_that_needs_the_whole_pool_is_admitted_without_its_partial_hit():
    """Found by a review (2026-12-02): the partial hit's pinned source is a block the allocation
    can't take, so a prompt needing every block was refused on every step and waited forever (the
    server stalled behind it). Admission now falls back to computing those tokens."""
    m = make_manager(4, B)
    run(m, "a", list(range(9)))  # blocks 0 <- 1 cached, 2 uncached; all freed
    m.end_step()
    b = make_request("b", list(range(6)) + [77, 78, 79, 80, 81, 82, 83], block_size=B)  # 13 tokens: 4 blocks
    assert m.get_partial_hit(b, m.get_computed_blocks(b)[0]) == PartialHit(m.block_pool.blocks[1], 2)
    admission = m.admit(b, token_budget=100)
    assert (admission.num_hit_tokens, admission.num_partial_tokens, admission.num_new_tokens) == (4, 0, 9)
    assert ids(m.req_to_blocks["b"])[0] == 0 and len(m.req_to_blocks["b"]) == 4 and m.pending_copy_ops == []
    assert m.block_pool.get_num_free_blocks() == 0 and b.num_computed_tokens == 4 and b.num_cached_tokens == 4
    roomy = make_manager(8, B)  # with a block to spare, the partial hit is still taken
    run(roomy, "a", list(range(9)))
    roomy.end_step()
    c = make_request("c", list(range(6)) + [77, 78, 79, 80, 81, 82, 83], block_size=B)
    assert (roomy.admit(c, token_budget=100).num_partial_tokens, c.num_cached_tokens) == (2, 6)


# -- C3 under every policy --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_c3_evicted_blocks_are_gone_under_every_policy(policy):
    clock = Clock()
    m = make_manager(8, B, eviction_policy=policy, clock=clock)
    a = list(range(13))  # 3 full blocks + 1 token
    run(m, "a", a)
    m.end_step()
    a_blocks = [b for b in m.block_pool.blocks if b.block_hash is not None]
    assert len(a_blocks) == 3
    for i in range(3):  # others fill the pool until all of a's blocks are evicted and reused
        clock.now += 1
        run(m, f"o{i}", list(range(100 * (i + 1), 100 * (i + 1) + 29)))
        m.end_step()
    assert all(b.block_hash is None or b.token_ids[0] >= 100 for b in m.block_pool.blocks)
    again = make_request("a2", a, block_size=B)
    hits, n = m.get_computed_blocks(again)
    assert (hits, n, m.get_partial_hit(again, hits)) == ([], 0, None)


# -- invalidation: stale chains are evicted at once and their blocks handed out first -----------


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl", "cost"])
def test_invalidate_chains_evicts_stale_free_blocks_first(policy):
    m = make_manager(12, 4, eviction_policy=policy)
    old = make_request("old", list(range(13)), cache_salt="old")  # blocks 0-3 (3 full + tail)
    keep = make_request("keep", list(range(100, 109)), cache_salt="keep")  # blocks 4-6
    running = make_request("run", list(range(200, 209)), cache_salt="old")  # blocks 7-9, stays in use
    for r in (old, keep, running):
        admit(m, r)
    m.free(old)
    m.free(keep)
    pool = m.block_pool
    evicted = pool.invalidate_chains(lambda root_key: b'"old"' in root_key)
    assert evicted == 3  # old's 3 cached blocks; run's blocks are in use and stay
    assert pool.eviction_stats.evictions_by_reason == {"invalidated": 3}
    assert [b.block_hash for b in pool.blocks[:3]] == [None, None, None]
    # Handed out first: the invalidated blocks (children first), before anything else.
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert m.get_computed_blocks(make_request("k2", list(range(100, 109)), cache_salt="keep"))[1] == 8
    m.free(running)
    assert pool.invalidate_chains(lambda root_key: b'"old"' in root_key) == 2  # now free: evicted


# -- C21: documented boundaries tested at the boundary ---------------------------------------------


def test_c21_ttl_boundary_idle_exactly_ttl_still_hits():
    """README: a free cached block idle *longer than* cache_ttl_s expires; exactly cache_ttl_s hits."""
    clock = Clock()
    m = make_manager(8, B, eviction_policy="ttl", cache_ttl_s=50.0, clock=clock)
    run(m, "a", A)  # blocks 0 <- 1 cached, freed at t=0
    m.end_step()
    probe = make_request("p", A[:8] + [7], block_size=B)
    clock.now = 50.0
    assert m.get_computed_blocks(probe)[1] == 8
    assert m.sweep_expired() == 0 and m.num_cached_blocks == 2
    clock.now = 50.0 + 1e-6
    assert m.get_computed_blocks(probe) == ([], 0)
    assert m.sweep_expired() == 2 and m.block_pool.eviction_stats.evictions_by_reason == {"ttl": 2}
