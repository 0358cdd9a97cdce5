"""Cache breakpoints' pins (prefixcache/cache/pins.py) on the cache manager: exact block ids, ref
counts and free-queue order; the ttl boundary (C27, tested as C21 tests the cache ttl); the budget;
visibility (a pin never lets another salt or tenant hit).

Setting (B = 4, 8 blocks, budget 0.5 -> 4 blocks): request ``a`` (9 tokens) takes blocks 0, 1, 2,
caches 0 <- 1 and pins them with a breakpoint after its 8th token.
"""

from __future__ import annotations

import pytest

from prefixcache.cache.eviction import EVICTION_POLICIES
from prefixcache.bench.flood import run_flood
from prefixcache.cache.pins import CacheBreakpoint, PinResult, cache_usage, check_breakpoints
from prefixcache.config import EngineConfig
from prefixcache.errors import InvalidInputError
from tests.cache.cache_test_utils import admit, ids, make_manager, make_request

B = 4
A = list(range(9))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def computed(m, request):
    """Admits ``request`` for its whole prompt, ends the step; returns its hit tokens."""
    new_blocks, num_hit = admit(m, request)
    assert new_blocks is not None
    m.end_step()
    return num_hit


def pinned_run(m, rid, prompt, *breakpoints, **kw):
    """A request that computes its prompt, pins its breakpoints and finishes."""
    request = make_request(rid, prompt, block_size=B, **kw)
    request.cache_breakpoints = check_breakpoints(list(breakpoints), len(prompt))
    computed(m, request)
    result = m.pin_prefix(request)
    m.free(request)
    return result


def refs(m, *block_ids):
    return [m.block_pool.blocks[i].ref_cnt for i in block_ids]


def free_order(m):
    return ids(m.block_pool.evictor.get_all_free_blocks())


def test_pin_holds_one_reference_and_keeps_blocks_out_of_the_free_queue():
    m = make_manager(8, B, clock=Clock())
    bp = CacheBreakpoint(8, 50.0)
    assert pinned_run(m, "a", A, bp) == (PinResult(bp, 8),)
    assert refs(m, 0, 1, 2) == [1, 1, 0]
    assert free_order(m) == [3, 4, 5, 6, 7, 2]
    assert len(m.pins) == 2 and m.block_pool.get_num_free_blocks() == 6
    # Eviction pressure: a 6-block prompt takes every free block and leaves the pinned ones.
    flood = make_request("flood", list(range(100, 124)), block_size=B)
    assert computed(m, flood) == 0
    assert m.get_block_ids("flood") == [3, 4, 5, 6, 7, 2]
    assert m.allocate_slots(flood, 1) is None  # the pool is full; pins are not evicted for a running request
    m.free(flood)
    assert m.get_computed_blocks(make_request("probe", A[:8] + [77], block_size=B))[1] == 8


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_c27_pin_ends_at_ttl_plus_one_step(policy):
    """A pin idle exactly ttl still holds; idle longer, the next step's sweep releases it and the
    blocks are evictable (children first)."""
    clock = Clock()
    m = make_manager(8, B, clock=clock, eviction_policy=policy, cache_ttl_s=1000.0)
    pinned_run(m, "a", A, CacheBreakpoint(8, 50.0))
    clock.now = 50.0
    assert m.sweep_expired() == 0 and len(m.pins) == 2 and refs(m, 0, 1) == [1, 1]
    clock.now = 50.0 + 1e-6
    m.sweep_expired()
    assert len(m.pins) == 0 and refs(m, 0, 1) == [0, 0] and m.pins.num_released == 2
    assert m.num_cached_blocks == 2  # released, not evicted: still hit-able until evicted
    assert m.get_computed_blocks(make_request("probe", A[:8] + [77], block_size=B))[1] == 8
    taken = ids(m.block_pool.get_new_blocks(8))
    assert taken.index(1) < taken.index(0)  # children before parents
    assert m.num_cached_blocks == 0


def test_every_hit_refreshes_the_pin():
    clock = Clock()
    m = make_manager(8, B, clock=clock)
    pinned_run(m, "a", A, CacheBreakpoint(8, 50.0))
    clock.now = 40.0
    b = make_request("b", A[:8] + [99], block_size=B)
    assert computed(m, b) == 8  # a hit: both pins now expire at 90
    m.free(b)
    clock.now = 90.0
    m.sweep_expired()
    assert len(m.pins) == 2
    clock.now = 90.5
    m.sweep_expired()
    assert len(m.pins) == 0 and refs(m, 0, 1) == [0, 0]


def test_budget_pins_the_head_that_fits_and_never_more():
    m = make_manager(8, B, clock=Clock(), max_pinned_fraction=0.5)  # 4 blocks
    assert m.pins.max_blocks == 4
    long = list(range(200, 225))  # 25 tokens: 6 full blocks
    bp = CacheBreakpoint(24, 300.0)
    assert pinned_run(m, "long", long, bp) == (PinResult(bp, 16),)
    assert sorted(p.block.block_id for p in m.pins.pins.values()) == [0, 1, 2, 3]
    other = CacheBreakpoint(8, 300.0)
    assert pinned_run(m, "other", A, other) == (PinResult(other, 0),)  # the budget is spent
    assert len(m.pins) == 4
    # The same prefix again only refreshes: nothing more is pinned.
    assert pinned_run(m, "again", long, bp) == (PinResult(bp, 16),)
    assert len(m.pins) == 4 and refs(m, 0, 1, 2, 3) == [1, 1, 1, 1]


def test_pins_off_with_zero_fraction_or_caching_off():
    m = make_manager(8, B, clock=Clock(), max_pinned_fraction=0.0)
    bp = CacheBreakpoint(8, 300.0)
    assert pinned_run(m, "a", A, bp) == (PinResult(bp, 0),)
    off = make_manager(8, B, enable_caching=False)
    assert pinned_run(off, "a", A, bp) == (PinResult(bp, 0),) and len(off.pins) == 0


def test_breakpoint_inside_a_block_pins_the_blocks_before_it():
    m = make_manager(8, B, clock=Clock())
    bps = (CacheBreakpoint(3, 300.0), CacheBreakpoint(7, 3600.0))
    assert pinned_run(m, "a", A, *bps) == (PinResult(bps[0], 0), PinResult(bps[1], 4))
    assert [p.block.block_id for p in m.pins.pins.values()] == [0]
    assert m.pins.pins[0].ttl_s == 3600.0


def test_longer_breakpoint_extends_the_shorter_ones_ttl_along_the_chain():
    clock = Clock()
    m = make_manager(8, B, clock=clock)
    pinned_run(m, "a", A, CacheBreakpoint(4, 3600.0), CacheBreakpoint(8, 300.0))
    assert [(p.block.block_id, p.ttl_s) for p in m.pins.pins.values()] == [(0, 3600.0), (1, 300.0)]
    clock.now = 301.0
    m.sweep_expired()
    assert [p.block.block_id for p in m.pins.pins.values()] == [0]  # the child went, the parent stays
    assert refs(m, 0, 1) == [1, 0]


@pytest.mark.parametrize("kind", ["tenant", "salt"])
def test_a_pinned_block_stays_invisible_to_other_tenants_and_salts(kind):
    m = make_manager(8, B, clock=Clock())
    key = {"tenant": "tenant-a"} if kind == "tenant" else {"cache_salt": "salt-a"}
    other = {"tenant": "tenant-b"} if kind == "tenant" else {"cache_salt": "salt-b"}
    pinned_run(m, "a", A, CacheBreakpoint(8, 300.0), **key)
    assert len(m.pins) == 2
    assert m.get_computed_blocks(make_request("b", A[:8] + [5], block_size=B, **other)) == ([], 0)
    assert m.get_computed_blocks(make_request("n", A[:8] + [5], block_size=B)) == ([], 0)
    assert m.get_computed_blocks(make_request("a2", A[:8] + [5], block_size=B, **key))[1] == 8


def test_pins_yield_to_a_request_that_could_never_run_otherwise():
    m = make_manager(8, B, clock=Clock())
    pinned_run(m, "a", A, CacheBreakpoint(8, 300.0))
    big = make_request("big", list(range(300, 329)), block_size=B)  # 29 tokens: all 8 blocks
    new_blocks, _ = admit(m, big)
    assert new_blocks is not None and len(m.get_block_ids("big")) == 8
    assert len(m.pins) == 0 and m.pins.num_yielded == 2


def test_reset_drops_pins_and_invalidation_releases_stale_chains():
    m = make_manager(8, B, clock=Clock())
    pinned_run(m, "a", A, CacheBreakpoint(8, 300.0))
    assert m.reset_prefix_cache() and len(m.pins) == 0 and m.num_cached_blocks == 0
    pinned_run(m, "s", A, CacheBreakpoint(8, 300.0), cache_salt="old")
    pinned_run(m, "k", list(range(40, 49)), CacheBreakpoint(8, 300.0), cache_salt="keep")
    assert len(m.pins) == 4
    assert m.invalidate_chains(lambda root_key: b'"old"' in root_key) == 2
    assert len(m.pins) == 2 and m.num_cached_blocks == 2


def test_cache_usage_adds_up_to_the_prompt():
    five, hour = CacheBreakpoint(100, 300.0), CacheBreakpoint(40, 3600.0)
    # 96 tokens pinned (6 blocks of 16), 32 read: 64 created; 32 of them under the 1h breakpoint.
    u = cache_usage(120, 32, [PinResult(hour, 32 + 0), PinResult(five, 96)])
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (24, 32, 64)
    assert (u.ephemeral_5m_input_tokens, u.ephemeral_1h_input_tokens) == (64, 0)
    u = cache_usage(120, 16, [PinResult(hour, 32), PinResult(five, 96)])
    assert (u.ephemeral_1h_input_tokens, u.ephemeral_5m_input_tokens, u.input_tokens) == (16, 64, 24)
    u = cache_usage(120, 112, [PinResult(five, 96)])  # read past the breakpoint: nothing created
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (8, 112, 0)
    assert cache_usage(50, 0, []).input_tokens == 50


@pytest.mark.parametrize("breakpoints, message", [
    ([CacheBreakpoint(1)] * 5, "at most 4 breakpoints per request, got 5"),
    ([CacheBreakpoint(0)], r"num_tokens must be in \[1, 9\]"),
    ([CacheBreakpoint(10)], r"num_tokens must be in \[1, 9\]"),
    ([CacheBreakpoint(3, 0.0)], "ttl_s must be a finite number > 0"),
    ([(3, 300.0)], "cache_control must be a CacheBreakpoint or a list of them"),
])
def test_bad_breakpoints_name_the_field(breakpoints, message):
    with pytest.raises(InvalidInputError, match=message) as e:
        check_breakpoints(breakpoints, 9)
    assert e.value.field == "cache_control"


def test_max_pinned_fraction_is_validated():
    assert EngineConfig.from_kwargs(max_pinned_fraction=0.25).max_pinned_fraction == 0.25
    for bad in (1.0, -0.1, True, "0.5"):
        with pytest.raises(InvalidInputError, match=r"max_pinned_fraction must be a number in \[0, 1\)"):
            EngineConfig.from_kwargs(max_pinned_fraction=bad)


def test_max_pinned_fraction_flag():
    import argparse

    from prefixcache.entrypoints.cli.serve import add_cli_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert engine_config_from_args(parser.parse_args([])).max_pinned_fraction == 0.5
    assert engine_config_from_args(parser.parse_args(["--max-pinned-fraction", "0.25"])).max_pinned_fraction == 0.25
    with pytest.raises(ValueError, match=r"^--max-pinned-fraction: max_pinned_fraction must be a number in \[0, 1\), "
                                         r"got 1.5$"):
        engine_config_from_args(parser.parse_args(["--max-pinned-fraction", "1.5"]))


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_agent_flood_breakpoint_keeps_the_system_prompt(policy):
    """prefixcache bench --workload flood (bench/flood.py): B = 16, a 400-block pool; each round an agent request
    (a 4096-token prefix + 20 new tokens), then three one-off 100-block prompts; the pool can't hold the prefix
    and a round's flood. With the breakpoint every later agent request hits the whole prefix (the maximum);
    without, LRU, LFU and TTL keep only its first 100 blocks (the cost policy keeps it all: deep,
    reused blocks are worth the most)."""
    assert run_flood(policy, True) == [0] + [4096] * 5
    without = 4096 if policy == "cost" else 1600
    assert run_flood(policy, False) == [0] + [without] * 5
