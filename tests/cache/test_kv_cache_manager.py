"""Exact-value tests of KVCacheManager (vLLM v1 contract) and the field cases C3, C4, C8."""

from __future__ import annotations

import pytest
import xxhash
from cache_test_utils import admit, ids, make_manager, make_request

from prefixcache.cache import hashing
from prefixcache.cache.kv_cache_manager import CopyOp, KVCacheManager
from prefixcache.cache.hashing import BlockHasher, tenant_extra_key
from prefixcache.cache.metrics import PrefixCacheSnapshot, PrefixCacheStats
from prefixcache.request import Request

B = 4


def free_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.evictor.get_all_free_blocks())


def refs(manager: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in manager.block_pool.blocks]


def assert_exact_hits(request, blocks) -> None:
    """Blocks returned by a lookup hold exactly the request's tokens of those blocks."""
    for i, block in enumerate(blocks):
        assert block.token_ids == tuple(request.all_token_ids[i * B : (i + 1) * B])
        assert block.block_hash == request.block_hashes[i]


def test_constructor_validation():
    with pytest.raises(ValueError, match="block_size"):
        make_manager(4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        make_manager(0, 4)


def test_miss_then_full_prefix_hit():
    m = make_manager(10, B)
    a = make_request("a", list(range(10)), block_size=B)  # 2 full blocks + 2 tokens
    assert m.get_computed_blocks(a) == ([], 0)
    new_blocks, _ = admit(m, a)
    assert ids(new_blocks) == [0, 1, 2]
    assert m.get_block_ids("a") == [0, 1, 2]
    assert m.req_to_num_cached_blocks["a"] == 2
    assert m.num_cached_blocks == 2
    assert refs(m)[:4] == [1, 1, 1, 0]

    # While A runs, B with the same prompt shares A's two full blocks.
    b = make_request("b", list(range(10)), block_size=B)
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8
    assert refs(m)[:3] == [1, 1, 1]  # lookup has no side effect
    new_blocks, _ = admit(m, b)
    assert ids(new_blocks) == [3]  # only the new blocks are returned
    assert m.get_block_ids("b") == [0, 1, 3]
    table = m.get_blocks("b")
    assert table == [m.block_pool.blocks[i] for i in (0, 1, 3)] and table == m.req_to_blocks["b"]
    table.pop()  # a copy: the manager's table is untouched
    assert m.get_block_ids("b") == [0, 1, 3] and m.get_blocks("nobody") == []
    assert m.req_to_num_cached_blocks["b"] == 2
    assert refs(m)[:4] == [2, 2, 1, 1]
    assert free_ids(m) == [4, 5, 6, 7, 8, 9]

    # Freed tail first: A's blocks go to the queue as 2 (ref 0); 1 and 0 still held by B.
    m.free(a)
    assert refs(m)[:4] == [1, 1, 0, 1]
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 2]
    m.free(b)
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert m.usage == 0.0 and m.num_free_blocks == 10

    # A third request hits blocks that are free but still cached: they leave the free queue.
    c = make_request("c", list(range(10)), block_size=B)
    new_blocks, num_hit_tokens = admit(m, c)
    assert num_hit_tokens == 8
    assert ids(new_blocks) == [4]
    assert m.get_block_ids("c") == [0, 1, 4]
    assert free_ids(m) == [5, 6, 7, 8, 9, 2, 3]
    assert m.usage == pytest.approx(0.3)


def test_same_step_duplicates_are_cached_once():
    """Two requests computing one prompt in the same step (no lookup between): the second's equal
    blocks stay uncached, it holds the first's instead (one prefix, one cached copy, C12), and
    frees them right after its own, so the chain still goes tail first."""
    m = make_manager(8, B)
    r1 = make_request("r1", list(range(9)), block_size=B)
    r2 = make_request("r2", list(range(9)), block_size=B)
    assert m.get_computed_blocks(r1) == ([], 0) and m.get_computed_blocks(r2) == ([], 0)
    assert ids(m.allocate_slots(r1, 9)) == [0, 1, 2]
    assert ids(m.allocate_slots(r2, 9)) == [3, 4, 5]
    assert m.num_cached_blocks == 2
    assert ids(m.block_pool.cached_block_hash_to_block[r1.block_hashes[0]].values()) == [0]
    assert {i: b.block_id for i, b in m.req_to_pinned["r2"].items()} == {0: 0, 1: 1}
    assert refs(m) == [2, 2, 1, 1, 1, 1, 0, 0]
    m.free(r1)
    m.free(r2)
    assert free_ids(m) == [6, 7, 2, 5, 4, 1, 3, 0]
    assert refs(m) == [0] * 8 and m.req_to_pinned == {}
    x = make_request("x", list(range(100, 116)), block_size=B)
    assert ids(m.allocate_slots(x, 16)) == [6, 7, 2, 5]  # uncached blocks first: nothing evicted
    probe = make_request("p", list(range(9)), block_size=B)
    hits, num_hit_tokens = m.get_computed_blocks(probe)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8
    assert_exact_hits(probe, hits)


def test_recomputed_equal_block_replaces_the_own_copy_at_end_step():
    """After the step that wrote it, a recomputed block already cached is swapped for the cached
    one in the request's table and its own copy freed: no block is held twice past the step."""
    m = make_manager(8, B)
    r1 = make_request("r1", list(range(9)), block_size=B)
    r2 = make_request("r2", list(range(9)), block_size=B)
    m.allocate_slots(r1, 9)
    m.allocate_slots(r2, 9)
    m.end_step()
    assert m.get_block_ids("r2") == [0, 1, 5] and m.req_to_pinned == {}
    assert refs(m) == [2, 2, 1, 0, 0, 1, 0, 0]
    assert free_ids(m) == [6, 7, 4, 3]  # the own copies, freed tail first
    m.free(r2)
    m.free(r1)
    assert refs(m) == [0] * 8 and m.num_cached_blocks == 2


def test_miss_on_different_prompt():
    m = make_manager(10, B)
    admit(m, make_request("a", list(range(10)), block_size=B))
    b = make_request("b", list(range(100, 110)), block_size=B)
    assert m.get_computed_blocks(b) == ([], 0)


def test_partial_hit_shares_first_block_only():
    m = make_manager(10, B)
    a = make_request("a", list(range(12)), block_size=B)
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1, 2]
    b = make_request("b", [0, 1, 2, 3, 100, 101, 102, 103, 104], block_size=B)
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert ids(hits) == [0] and num_hit_tokens == 4
    new_blocks, _ = admit(m, b)
    assert ids(new_blocks) == [3, 4]
    assert m.get_block_ids("b") == [0, 3, 4]
    assert refs(m)[:5] == [2, 1, 1, 1, 1]


@pytest.mark.parametrize(("num_tokens", "expected_hit_tokens"), [(8, 4), (9, 8), (7, 4), (4, 0), (5, 4)])
def test_last_token_is_always_recomputed(num_tokens, expected_hit_tokens):
    m = make_manager(10, B)
    admit(m, make_request("a", list(range(12)), block_size=B))
    b = make_request("b", list(range(num_tokens)), block_size=B)
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert num_hit_tokens == expected_hit_tokens
    assert len(hits) * B == expected_hit_tokens


def test_exact_two_block_prompt_gets_one_cached_block():
    m = make_manager(10, B)
    a = make_request("a", list(range(2 * B)), block_size=B)
    admit(m, a)
    assert m.req_to_num_cached_blocks["a"] == 2
    assert m.get_computed_blocks(make_request("b", list(range(2 * B)), block_size=B))[1] == B
    assert m.get_computed_blocks(make_request("c", list(range(2 * B + 1)), block_size=B))[1] == 2 * B


def test_allocate_returns_none_when_pool_too_small_and_changes_nothing():
    m = make_manager(3, B)
    a = make_request("a", list(range(8)), block_size=B)
    admit(m, a)
    b = make_request("b", list(range(100, 108)), block_size=B)
    before = (free_ids(m), refs(m), m.num_cached_blocks, dict(m.req_to_blocks))
    assert m.allocate_slots(b, 8) is None
    assert (free_ids(m), refs(m), m.num_cached_blocks, dict(m.req_to_blocks)) == before
    assert "b" not in m.req_to_blocks and "b" not in m.req_to_num_cached_blocks
    assert m.get_block_ids("b") == []


def test_free_cached_hits_do_not_count_as_free_space():
    """Hits sitting in the free queue stop being allocatable once touched."""
    m = make_manager(3, B)
    a = make_request("a", list(range(8)), block_size=B)
    admit(m, a)
    m.free(a)
    assert free_ids(m) == [2, 1, 0]
    x = make_request("x", [50], block_size=B)
    admit(m, x)
    assert m.get_block_ids("x") == [2]
    # 13 tokens: 2 hits + 2 new blocks needed; 2 free blocks, but both are the hits.
    b = make_request("b", list(range(13)), block_size=B)
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8
    assert m.allocate_slots(b, 5, hits, num_hit_tokens) is None
    assert free_ids(m) == [1, 0] and refs(m) == [0, 0, 1]
    assert m.num_cached_blocks == 2
    # 12 tokens fit: 2 hits + 1 new block once x leaves.
    m.free(x)
    c = make_request("c", list(range(12)), block_size=B)
    new_blocks, num_hit_tokens = admit(m, c)
    assert num_hit_tokens == 8 and ids(new_blocks) == [2]
    assert m.get_block_ids("c") == [0, 1, 2] and free_ids(m) == []


def test_allocate_validation():
    m = make_manager(4, B)
    a = make_request("a", list(range(8)), block_size=B)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(a, -1)
    admit(m, a)
    b = make_request("b", list(range(9)), block_size=B)
    hits, n = m.get_computed_blocks(b)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        m.allocate_slots(b, 1, hits, n - 1)
    with pytest.raises(ValueError, match="without new_computed_blocks"):
        m.allocate_slots(b, 1, (), 4)
    with pytest.raises(ValueError, match="already has blocks"):
        m.allocate_slots(a, 1, hits, n)


def test_decode_tokens_filling_a_block_get_cached():
    m = make_manager(10, B)
    a = make_request("a", list(range(6)), block_size=B)
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1]
    assert m.req_to_num_cached_blocks["a"] == 1
    for token in (6, 7):  # decode: fills block 1
        a.append_output_token_ids(token)
        assert m.allocate_slots(a, 1) == []
        a.num_computed_tokens += 1
    assert m.req_to_num_cached_blocks["a"] == 2
    block1 = m.block_pool.blocks[1]
    assert block1.block_hash == a.block_hashes[1] and block1.token_ids == (4, 5, 6, 7)
    assert block1.token_bytes == a.token_bytes[16:] == hashing.pack_token_ids([4, 5, 6, 7])
    a.append_output_token_ids(8)  # starts block 2
    assert a.token_bytes == hashing.pack_token_ids(range(8))  # full blocks only
    assert ids(m.allocate_slots(a, 1)) == [2]
    a.num_computed_tokens += 1
    assert m.req_to_num_cached_blocks["a"] == 2
    m.free(a)
    # Next turn: prompt = earlier prompt + output + more.
    b = make_request("b", list(range(9)) + [50], block_size=B)
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8


def test_chunked_prefill_caches_as_blocks_fill():
    m = make_manager(10, B)
    a = make_request("a", list(range(10)), block_size=B)
    assert ids(m.allocate_slots(a, 3)) == [0]
    a.num_computed_tokens = 3
    assert m.req_to_num_cached_blocks["a"] == 0 and m.num_cached_blocks == 0
    assert ids(m.allocate_slots(a, 6)) == [1, 2]
    a.num_computed_tokens = 9
    assert m.req_to_num_cached_blocks["a"] == 2 and m.num_cached_blocks == 2


def test_free_order_and_idempotence():
    m = make_manager(6, B)
    a = make_request("a", list(range(12)), block_size=B)
    b = make_request("b", list(range(100, 105)), block_size=B)
    admit(m, a)
    admit(m, b)
    assert m.get_block_ids("b") == [3, 4]
    m.free(b)
    m.free(a)
    assert free_ids(m) == [5, 4, 3, 2, 1, 0]
    m.free(a)  # idempotent
    m.free(make_request("zzz", [1], block_size=B))  # unknown id
    assert free_ids(m) == [5, 4, 3, 2, 1, 0]
    assert refs(m) == [0] * 6
    assert m.req_to_blocks == {} and m.req_to_num_cached_blocks == {}


def test_reset_prefix_cache():
    m = make_manager(6, B)
    a = make_request("a", list(range(9)), block_size=B)
    admit(m, a)
    assert m.reset_prefix_cache() is False
    assert m.num_cached_blocks == 2
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.num_cached_blocks == 0
    assert m.get_computed_blocks(make_request("b", list(range(9)), block_size=B)) == ([], 0)


def test_caching_disabled_never_hits():
    m = make_manager(6, B, enable_caching=False)
    a = make_request("a", list(range(9)), block_size=B)
    admit(m, a)
    assert m.num_cached_blocks == 0 and m.req_to_num_cached_blocks["a"] == 0
    b = make_request("b", list(range(9)), block_size=B)
    assert m.get_computed_blocks(b) == ([], 0)
    m.free(a)
    assert m.get_computed_blocks(b) == ([], 0)


def test_cache_salt_isolates_and_equal_salts_share():
    m = make_manager(20, B)
    prompt = list(range(3 * B + 1))
    admit(m, make_request("a", prompt, block_size=B, cache_salt="alpha"))
    assert m.get_computed_blocks(make_request("b", prompt, block_size=B, cache_salt="beta"))[1] == 0
    assert m.get_computed_blocks(make_request("c", prompt, block_size=B, cache_salt="alpha"))[1] == 3 * B
    assert m.get_computed_blocks(make_request("d", prompt, block_size=B))[1] == 0


# -- C4: a hash collision cannot serve wrong KV -------------------------------------------------



def test_c4_constant_hash_unrelated_prompts_and_shared_prefix(constant_hash):
    m = make_manager(40, B)
    for k in range(5):
        r = make_request(f"u{k}", [100 * (k + 1) + t for t in range(2 * B + 1)], block_size=B)
        assert len(set(r.block_hashes)) == 1  # the collision is in force
        hits, num_hit_tokens = m.get_computed_blocks(r)
        assert (hits, num_hit_tokens) == ([], 0)
        admit(m, r)
        m.free(r)
    shared = [7] * B + [8] * B
    p1 = make_request("p1", shared + [1, 2], block_size=B)
    p2 = make_request("p2", shared + [3], block_size=B)
    assert admit(m, p1)[1] == 0
    hits, num_hit_tokens = m.get_computed_blocks(p2)
    assert num_hit_tokens == 2 * B
    assert hits == m.req_to_blocks["p1"][:2]
    assert_exact_hits(p2, hits)


def test_c4_same_second_block_after_different_first_block(constant_hash):
    m = make_manager(20, B)
    x = [9] * B
    a = make_request("a", [1] * B + x + [0], block_size=B)
    admit(m, a)
    b = make_request("b", [2] * B + x + [0], block_size=B)
    assert m.get_computed_blocks(b) == ([], 0)


def test_c4_same_first_block_different_second_block(constant_hash):
    m = make_manager(20, B)
    a = [1] * B
    admit(m, make_request("ax", a + [9] * B + [0], block_size=B))
    hits, num_hit_tokens = m.get_computed_blocks(make_request("ay", a + [8] * B + [0], block_size=B))
    assert ids(hits) == [0] and num_hit_tokens == B


def test_c4_parent_check_picks_the_right_candidate(constant_hash):
    """Two cached X blocks (after P and after Q) collide; a Q X request must get Q's X block."""
    m = make_manager(20, B)
    x = [9] * B
    admit(m, make_request("px", [1] * B + x, block_size=B))
    admit(m, make_request("qx", [2] * B + x, block_size=B))
    assert m.get_block_ids("px") == [0, 1] and m.get_block_ids("qx") == [2, 3]
    hits, num_hit_tokens = m.get_computed_blocks(make_request("r", [2] * B + x + [5], block_size=B))
    assert ids(hits) == [2, 3] and num_hit_tokens == 2 * B


def test_c4_a_sole_cached_copy_with_other_tokens_ends_the_hit(monkeypatch):
    """Hashes that depend only on the position (the digest ignores tokens): every hash has one
    cached copy, so the lookup's fast path takes them; the first block whose stored tokens differ
    ends the hit, and nothing after it is served."""
    for algo in hashing.HASH_ALGOS:
        monkeypatch.setitem(hashing._DIGESTS, algo, lambda data: xxhash.xxh64_digest(data[:8]))
    m = make_manager(20, B)
    cached = [[1] * B, [2] * B, [3] * B, [4] * B]
    a = make_request("a", [t for block in cached for t in block] + [0], block_size=B)
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1, 2, 3, 4]
    for differs_at in range(4):
        blocks = [list(b) for b in cached]
        blocks[differs_at][B - 1] = 99  # one token of one block
        probe = make_request(f"p{differs_at}", [t for block in blocks for t in block] + [0], block_size=B)
        assert probe.block_hashes == a.block_hashes  # collides with a at every block
        hits, num_hit_tokens = m.get_computed_blocks(probe)
        assert ids(hits) == [0, 1, 2, 3][:differs_at] and num_hit_tokens == differs_at * B
        assert_exact_hits(probe, hits)
    assert m.block_pool.sole_cached_block == {h: m.block_pool.blocks[i] for i, h in enumerate(a.block_hashes)}


def test_c4_root_key_checked_under_collision(constant_hash):
    m = make_manager(20, B)
    prompt = list(range(2 * B + 1))
    admit(m, make_request("a", prompt, block_size=B, cache_salt="alpha"))
    assert m.get_computed_blocks(make_request("b", prompt, block_size=B, cache_salt="beta")) == ([], 0)
    assert m.get_computed_blocks(make_request("c", prompt, block_size=B, cache_salt="alpha"))[1] == 2 * B


# -- C3: an evicted block is gone from the index ------------------------------------------------


def test_c3_evicted_blocks_are_never_hit():
    m = make_manager(8, B)
    prompt_a = list(range(3 * B + 1))  # 3 full blocks + 1 token
    a = make_request("a", prompt_a, block_size=B)
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1, 2, 3]
    m.free(a)
    assert free_ids(m) == [4, 5, 6, 7, 3, 2, 1, 0]
    lookup = lambda rid: m.get_computed_blocks(make_request(rid, prompt_a, block_size=B))  # noqa: E731

    o1 = make_request("o1", list(range(100, 120)), block_size=B)  # 5 blocks: 4, 5, 6, 7, 3
    admit(m, o1)
    assert m.get_block_ids("o1") == [4, 5, 6, 7, 3]
    assert m.block_pool.eviction_stats.num_evictions == 0
    assert lookup("a1")[1] == 3 * B
    m.free(o1)

    o2 = make_request("o2", list(range(200, 208)), block_size=B)  # takes A's tail blocks 2, 1
    admit(m, o2)
    assert m.get_block_ids("o2") == [2, 1]
    assert m.block_pool.eviction_stats.num_evictions == 2
    hits, num_hit_tokens = lookup("a2")
    assert ids(hits) == [0] and num_hit_tokens == B
    assert_exact_hits(a, hits)

    assert free_ids(m) == [0, 3, 7, 6, 5, 4]
    o3 = make_request("o3", list(range(300, 304)), block_size=B)  # takes A's head block 0
    admit(m, o3)
    assert m.get_block_ids("o3") == [0]
    assert m.block_pool.eviction_stats.num_evictions == 3
    assert lookup("a3") == ([], 0)
    # Every block A used now holds other requests' tokens, and lookups return exactly those.
    for req in (o2, o3):
        probe = make_request(req.request_id + "'", req.all_token_ids + [1], block_size=B)
        hits, _ = m.get_computed_blocks(probe)
        assert ids(hits) == m.get_block_ids(req.request_id)
        assert_exact_hits(req, hits)
    # A runs again cold and caches its blocks anew.
    a_again = make_request("a-again", prompt_a, block_size=B)
    assert admit(m, a_again)[1] == 0
    assert m.get_block_ids("a-again") == [3, 7, 6, 5]


# -- C8: a shared partial block is not a shared prefix ------------------------------------------


@pytest.mark.parametrize("suffix_len", [1, 3, 5])
def test_c8_shared_partial_block(suffix_len):
    m = make_manager(20, B)
    s = list(range(B + B // 2))  # 1.5 blocks
    a = make_request("a", s + [1000] + [1] * (suffix_len - 1), block_size=B)
    b = make_request("b", s + [2000] + [1] * (suffix_len - 1), block_size=B)
    admit(m, a)
    hits, num_hit_tokens = m.get_computed_blocks(b)
    assert num_hit_tokens == B and ids(hits) == [0]


# -- stats ----------------------------------------------------------------------------------------


def test_stats_record_and_snapshot():
    m = make_manager(10, B)
    assert m.stats.hit_rate == 0.0
    a = make_request("a", list(range(10)), block_size=B)
    admit(m, a)  # the admission records each request's stats once
    b = make_request("b", list(range(10)), block_size=B)
    admit(m, b)
    assert m.stats == PrefixCacheStats(num_requests=2, num_hit_requests=1, queries=20, hits=8)
    assert m.stats.hit_rate == 0.4
    assert m.stats.queries - m.stats.hits == 12
    snapshot = m.make_snapshot()
    assert snapshot == PrefixCacheSnapshot(
        num_requests=2, num_hit_requests=1, prefix_cache_queries=20, prefix_cache_hits=8,
        num_evictions=0, num_blocks_total=10, num_blocks_in_use=4, num_blocks_cached=2, num_blocks_free=6,
    )
    assert snapshot.hit_rate == 0.4
    with pytest.raises(ValueError):
        m.stats.record(4, 5)
    with pytest.raises(ValueError):
        m.stats.record(-1, 0)


# -- parallel sampling: fork and copy-on-write ------------------------------------------------


def test_fork_shares_every_block_and_copies_the_partial_one_on_first_write():
    m = make_manager(20, B)
    parent = make_request("p", list(range(10)), block_size=B)  # blocks 0, 1 full; block 2 holds 2
    admit(m, parent)
    m.end_step()
    kids = [parent.fork(f"p#{i}", parent.sampling_params, i) for i in (1, 2)]
    for kid in kids:
        m.fork(parent, kid)
    assert [m.get_block_ids(r) for r in ("p", "p#1", "p#2")] == [[0, 1, 2]] * 3
    assert [b.ref_cnt for b in m.block_pool.blocks[:3]] == [3, 3, 3]
    for i, r in enumerate([parent, *kids]):
        r.append_output_token_ids(100 + i)
    # First writer: a private copy of block 2 (slots 0..1), one reference less on the original.
    assert m.allocate_slots(kids[0], 1) == []
    assert m.pending_copy_ops == [CopyOp(2, 3, 2)] and m.get_block_ids("p#1") == [0, 1, 3]
    assert [b.ref_cnt for b in m.block_pool.blocks[:4]] == [3, 3, 2, 1]
    assert m.allocate_slots(kids[1], 1) == []
    assert m.pending_copy_ops[-1] == CopyOp(2, 4, 2) and m.get_block_ids("p#2") == [0, 1, 4]
    # The last holder writes in place: no copy.
    assert m.allocate_slots(parent, 1) == [] and len(m.pending_copy_ops) == 2
    assert m.get_block_ids("p") == [0, 1, 2] and m.block_pool.blocks[2].ref_cnt == 1
    assert (m.num_cow_forks, m.num_cow_copies) == (2, 2)
    m.end_step()
    for r in (parent, *kids):
        r.num_computed_tokens += 1
    # Once private, later writes copy nothing; full blocks stay shared until all three finish.
    kids[0].append_output_token_ids(7)
    assert m.allocate_slots(kids[0], 1) == [] and m.pending_copy_ops == []
    for r in (parent, *kids):
        m.free(r)
    assert m.usage == 0.0


def test_copy_on_write_needs_a_free_block():
    m = make_manager(3, B)
    parent = make_request("p", list(range(10)), block_size=B)
    admit(m, parent)
    kid = parent.fork("p#1", parent.sampling_params, 1)
    m.fork(parent, kid)
    kid.append_output_token_ids(5)
    assert m.allocate_slots(kid, 1) is None  # the pool is full: nothing changes
    assert m.get_block_ids("p#1") == [0, 1, 2] and m.block_pool.blocks[2].ref_cnt == 2
    assert m.pending_copy_ops == []


# -- the lookup's one-candidate fast path verifies everything the general path does -------------


@pytest.fixture
def parent_blind_hash(monkeypatch):
    """Block hashes ignore the parent: equal blocks after different prefixes collide."""
    import xxhash

    from prefixcache.cache import hashing

    monkeypatch.setitem(hashing._DIGESTS, "xxh64", lambda data: xxhash.xxh64_digest(data[8:]))


def test_fast_path_checks_the_parent(parent_blind_hash):
    m = make_manager(20, B)
    p, q, x, y = [1] * B, [2] * B, [3] * B, [4] * B
    admit(m, make_request("qx", q + x, block_size=B))  # blocks 0 <- 1 (X after Q)
    admit(m, make_request("py", p + y, block_size=B))  # blocks 2 <- 3
    probe = make_request("px", p + x + [0], block_size=B)
    assert probe.block_hashes[1] == make_request("r", q + x, block_size=B).block_hashes[1]  # X collides
    hits, num_hit = m.get_computed_blocks(probe)
    assert (ids(hits), num_hit) == ([2], B)  # P hits; Q's X block is refused (wrong parent)


@pytest.mark.parametrize("field", ["root_key", "tenant", "tokens"])
def test_fast_path_checks_root_tenant_and_tokens(constant_hash, field):
    m = make_manager(20, B)
    admit(m, make_request("a", [1, 2, 3, 4, 0], block_size=B, cache_salt="alpha", tenant="acme"))
    assert m.block_pool.num_cached_blocks == 1  # one candidate: the fast path decides
    other = {"root_key": dict(cache_salt="beta", tenant="acme"), "tenant": dict(cache_salt="alpha", tenant="globex"),
             "tokens": dict(cache_salt="alpha", tenant="acme")}[field]
    prompt = [1, 2, 3, 5, 0] if field == "tokens" else [1, 2, 3, 4, 0]
    assert m.get_computed_blocks(make_request("b", prompt, block_size=B, **other)) == ([], 0)
    same = make_request("c", [1, 2, 3, 4, 0], block_size=B, cache_salt="alpha", tenant="acme")
    assert ids(m.get_computed_blocks(same)[0]) == [0]


@pytest.mark.parametrize("tenant", [None, "acme"])
def test_int4_readmitted_request_hits_its_own_output_keyed_blocks(tenant):
    """A preempted int4 request, re-admitted, takes back all its cached blocks, those holding
    generated tokens (keyed with the hasher's output key) included: its positions past the prompt are
    computed by the generated-token kernels again, so the K/V is the same. The lookup's fast path
    compared those blocks' keys with the tenant key alone and stopped at the first of them."""
    m = make_manager(8, B)
    base = make_request("a", list(range(100, 106)), block_size=B, tenant=tenant)
    req = Request("a", base.prompt_token_ids, base.sampling_params, BlockHasher(B, output_block_key=b"int4"),
                  base.root_key, tenant_key=tenant_extra_key(tenant))
    admit(m, req)
    for token in range(200, 206):  # decode 6 tokens: positions 6..11 computed, blocks 1 and 2 fill
        req.append_output_token_ids(token)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    req.append_output_token_ids(206)  # sampled, not computed yet
    assert req.num_computed_tokens == 12 and m.req_to_num_cached_blocks["a"] == 3
    first_output = req.block_hasher.first_output_block(req.num_prompt_tokens)
    assert first_output == 1 and m.get_blocks("a")[1].extra_key == req.block_extra_key(1) != tenant_extra_key(tenant)
    table = m.get_block_ids("a")
    m.free(req)  # preempted
    req.num_computed_tokens = 0
    blocks, num_hit_tokens = m.get_computed_blocks(req)
    assert ids(blocks) == table[:3] and num_hit_tokens == 12
    # Another request with the same tokens as its prompt is computed by the prompt kernels: no hit
    # past block 0 (it holds prompt tokens for both).
    other = Request("b", req.all_token_ids, req.sampling_params, BlockHasher(B, output_block_key=b"int4"),
                    req.root_key, tenant_key=tenant_extra_key(tenant))
    assert m.get_computed_blocks(other) == (blocks[:1], 4)
