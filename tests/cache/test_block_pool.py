"""Exact-value tests of BlockPool and LRUPolicy (the free queue) (block ids, ref counts, LRU order)."""

from __future__ import annotations

import pytest
from cache_test_utils import ids, make_request

from prefixcache.cache.block_pool import BlockPool, KVCacheBlock
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.eviction import LRUPolicy

B = 4


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.evictor.get_all_free_blocks())


def cache_request(pool: BlockPool, request, blocks, num_blocks: int | None = None) -> None:
    """Caches the request's first ``num_blocks`` (default: all full) blocks, chained."""
    parent = None
    for i in range(len(request.block_hashes) if num_blocks is None else num_blocks):
        tokens = request.all_token_ids[i * B : (i + 1) * B]
        parent = pool.cache_block(blocks[i], request.block_hashes[i], tokens, parent, request.root_key,
                                  request.block_extra_key(i))


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_initial_state():
    pool = BlockPool(5)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert [b.ref_cnt for b in pool.blocks] == [0] * 5
    assert pool.get_num_free_blocks() == 5
    assert pool.get_usage() == 0.0
    assert pool.num_cached_blocks == 0
    assert pool.eviction_stats.num_evictions == 0


def test_free_queue_o1_ops():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = LRUPolicy(blocks)
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3]
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 0]
    assert len(q) == 3
    assert blocks[2] not in q and blocks[3] in q
    with pytest.raises(ValueError):
        q.append(blocks[3])
    for _ in range(3):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_get_new_blocks_free_order_and_refs():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0, 0, 0]
    assert free_ids(pool) == [3, 4, 5]
    assert pool.get_usage() == 0.5
    b = pool.get_new_blocks(2)
    assert ids(b) == [3, 4]
    # Freed tail first: 2, 1, 0 go to the tail in that order.
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [5, 2, 1, 0]
    assert [blk.ref_cnt for blk in pool.blocks] == [0, 0, 0, 1, 1, 0]
    # Next allocation takes from the head: 5 then A's tail (2).
    assert ids(pool.get_new_blocks(2)) == [5, 2]
    assert free_ids(pool) == [1, 0]
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [1, 0]  # unchanged by the failed call
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)


def test_free_below_zero_raises():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(ValueError, match="ref_cnt 0"):
        pool.free_blocks([blk])


def test_touch_shared_block_and_free_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 3, 1, 0]
    pool.touch([blocks[0]])  # hit on a free block: leaves the queue from the middle
    assert free_ids(pool) == [2, 3, 1]
    assert blocks[0].ref_cnt == 1
    pool.touch([blocks[0]])  # a second request shares it
    assert blocks[0].ref_cnt == 2
    assert free_ids(pool) == [2, 3, 1]
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == [2, 3, 1]
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 0 and free_ids(pool) == [2, 3, 1, 0]


def test_cache_full_blocks_and_lookup():
    pool = BlockPool(6)
    req = make_request("a", list(range(10)), block_size=B)  # 2 full blocks + 2 tokens
    blocks = pool.get_new_blocks(3)
    cache_request(pool, req, blocks)
    assert pool.num_cached_blocks == 2
    b0, b1, b2 = blocks
    assert b0.block_hash == req.block_hashes[0] and b0.token_ids == (0, 1, 2, 3)
    assert b0.parent is None and b0.root_key == req.root_key
    assert b1.block_hash == req.block_hashes[1] and b1.token_ids == (4, 5, 6, 7)
    assert b1.parent is b0 and b1.parent_generation == 0 and b1.root_key is None
    assert b2.block_hash is None and b2.token_ids is None  # partial block: not cached
    h = req.block_hashes
    assert pool.get_cached_block(h[0], [0, 1, 2, 3], None, req.root_key) is b0
    assert pool.get_cached_block(h[1], [4, 5, 6, 7], b0, req.root_key) is b1
    # Wrong tokens, wrong parent, wrong root: all misses.
    assert pool.get_cached_block(h[0], [0, 1, 2, 9], None, req.root_key) is None
    assert pool.get_cached_block(h[1], [4, 5, 6, 7], b2, req.root_key) is None
    assert pool.get_cached_block(h[1], [4, 5, 6, 7], None, req.root_key) is None
    assert pool.get_cached_block(h[0], [0, 1, 2, 3], None, b"other") is None
    # Freeing keeps them cached and hit-able.
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert pool.get_cached_block(h[0], [0, 1, 2, 3], None, req.root_key) is b0


def test_lazy_eviction_removes_hash_and_bumps_generation():
    pool = BlockPool(3)
    req = make_request("a", list(range(8)), block_size=B)
    blocks = pool.get_new_blocks(2)
    cache_request(pool, req, blocks)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 1, 0]
    assert pool.num_cached_blocks == 2
    # Popping 2 (uncached) evicts nothing; popping 1 evicts A's tail block.
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    b0, b1 = blocks
    assert pool.eviction_stats.num_evictions == 1
    assert pool.num_cached_blocks == 1
    assert b1.block_hash is None and b1.token_ids is None and b1.parent is None
    assert b1.generation == 1 and b1.ref_cnt == 1
    assert req.block_hashes[1] not in pool.cached_block_hash_to_block
    assert req.block_hashes[0] in pool.cached_block_hash_to_block
    assert b0.generation == 0
    assert pool.get_cached_block(req.block_hashes[0], [0, 1, 2, 3], None, req.root_key) is b0


def test_allocation_evictions_count_only_cached_blocks_taken_for_room():
    """num_allocation_evictions (the scheduler's pressure signal): cached blocks get_new_blocks
    evicted; uncached free blocks and a failed step's uncaching are not counted."""
    pool = BlockPool(4)
    req = make_request("a", list(range(12)), block_size=B)
    blocks = pool.get_new_blocks(3)
    cache_request(pool, req, blocks)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0] and pool.num_allocation_evictions == 0
    taken = pool.get_new_blocks(1)  # block 3: never cached
    assert ids(taken) == [3] and pool.num_allocation_evictions == 0
    assert pool.uncache([blocks[2]]) == 1  # a failed step: evicted, but not for room
    assert pool.eviction_stats.num_evictions == 1 and pool.num_allocation_evictions == 0
    assert free_ids(pool) == [1, 0, 2]  # the uncached block went back to the tail
    assert ids(pool.get_new_blocks(3)) == [1, 0, 2]  # 1 and 0 cached: two evictions for room
    assert pool.num_allocation_evictions == 2 and pool.eviction_stats.num_evictions == 3


def test_evicted_parent_invalidates_child():
    """A child whose parent was evicted and reused is never hit, even if re-cached identically."""
    pool = BlockPool(2)
    req = make_request("a", list(range(8)), block_size=B)
    b0, b1 = pool.get_new_blocks(2)
    cache_request(pool, req, [b0, b1])
    # Free head first, so the head is evicted before the tail (the unusual order).
    pool.free_blocks([b0, b1])
    (reused,) = pool.get_new_blocks(1)
    assert reused is b0 and b0.generation == 1
    assert b1.block_hash is not None  # still in the map ...
    # ... and even with the old parent object and matching tokens, the stale generation misses.
    assert pool.get_cached_block(req.block_hashes[1], [4, 5, 6, 7], b0, req.root_key) is None


def test_two_blocks_share_one_hash(constant_hash):
    """A hash collision: two blocks with different tokens under one hash; each found by its tokens."""
    pool = BlockPool(4)
    r1 = make_request("r1", list(range(4)), block_size=B)
    r2 = make_request("r2", list(range(4, 8)), block_size=B)
    assert r1.block_hashes == r2.block_hashes
    (x,) = pool.get_new_blocks(1)
    (y,) = pool.get_new_blocks(1)
    cache_request(pool, r1, [x])
    cache_request(pool, r2, [y])
    assert pool.num_cached_blocks == 2
    assert ids(pool.cached_block_hash_to_block[r1.block_hashes[0]].values()) == [0, 1]
    assert pool.get_cached_block(r1.block_hashes[0], [0, 1, 2, 3], None, r1.root_key) is x
    assert pool.get_cached_block(r1.block_hashes[0], [4, 5, 6, 7], None, r1.root_key) is y
    pool.free_blocks([x, y])
    pool.get_new_blocks(3)  # evicts 2, 3 (uncached) then x
    assert pool.get_cached_block(r1.block_hashes[0], [0, 1, 2, 3], None, r1.root_key) is None
    assert pool.get_cached_block(r1.block_hashes[0], [4, 5, 6, 7], None, r1.root_key) is y
    assert ids(pool.cached_block_hash_to_block[r1.block_hashes[0]].values()) == [1]


def test_equal_block_is_cached_once():
    """One prefix, one cached copy (C12): caching an equal block at the same place in the chain
    returns the block already cached and leaves the new one uncached."""
    pool = BlockPool(4)
    r1 = make_request("r1", list(range(8)), block_size=B)
    r2 = make_request("r2", list(range(8)), block_size=B)
    a0, a1, b1 = pool.get_new_blocks(3)
    cache_request(pool, r1, [a0, a1])
    assert pool.cache_block(b1, r2.block_hashes[1], list(range(4, 8)), a0, r2.root_key) is a1
    assert b1.block_hash is None and pool.num_cached_blocks == 2
    # Under another parent (here: as a chain root) the same tokens are another prefix.
    assert pool.cache_block(b1, r2.block_hashes[1], list(range(4, 8)), None, r2.root_key) is b1
    assert pool.num_cached_blocks == 3


def test_caching_disabled_refuses_to_cache():
    pool = BlockPool(2, CacheConfig(enable_prefix_caching=False))
    req = make_request("a", list(range(8)), block_size=B)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="caching off"):
        cache_request(pool, req, blocks)
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in blocks)


def test_reset_prefix_cache():
    pool = BlockPool(3)
    req = make_request("a", list(range(8)), block_size=B)
    blocks = pool.get_new_blocks(2)
    cache_request(pool, req, blocks)
    assert pool.reset_prefix_cache() is False  # in use: refused, nothing changed
    assert pool.num_cached_blocks == 2 and blocks[0].generation == 0
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert pool.cached_block_hash_to_block == {}
    assert [b.block_hash for b in pool.blocks] == [None, None, None]
    assert [b.generation for b in pool.blocks] == [1, 1, 0]
    assert pool.eviction_stats.num_evictions == 0  # a reset is not an eviction
    assert free_ids(pool) == [2, 1, 0]  # LRU order kept


def test_dump_and_repr():
    pool = BlockPool(3)
    req = make_request("a", list(range(4)), block_size=B)
    blocks = pool.get_new_blocks(1)
    cache_request(pool, req, blocks)
    text = pool.dump()
    assert "3 blocks, 1 in use, 2 free, 1 cached" in text
    assert "(0, 1, 2, 3)" in text
    assert repr(pool) == "BlockPool(num_blocks=3, free=2, cached=1, evictions=0)"


def test_child_of_reused_parent_is_not_hit():
    """Parent evicted and re-cached for other tokens ("B"); its old child (for "A X") must miss."""
    pool = BlockPool(2)
    x = [9, 9, 9, 9]
    ax = make_request("ax", [1, 1, 1, 1] + x, block_size=B)
    p, c = pool.get_new_blocks(2)
    cache_request(pool, ax, [p, c])
    pool.free_blocks([p, c])  # head first: the parent is evicted before the child
    bx = make_request("bx", [2, 2, 2, 2] + x + [0], block_size=B)
    (reused,) = pool.get_new_blocks(1)
    assert reused is p
    cache_request(pool, bx, [reused], 1)
    hit0 = pool.get_cached_block(bx.block_hashes[0], [2, 2, 2, 2], None, bx.root_key)
    assert hit0 is p
    # c still sits in the map with parent p, tokens X, but its K/V is for "A X".
    assert c.block_hash == ax.block_hashes[1] and c.parent is p
    assert pool.get_cached_block(ax.block_hashes[1], x, hit0, bx.root_key) is None


def test_c21_stale_chain_is_never_a_partial_hit_source():
    """A cached block whose parent was evicted and re-cached since (generation changed) is indexed
    under the parent's block id still; neither a full nor a partial lookup may use it."""
    pool = BlockPool(4)
    a = make_request("a", list(range(8)) + [50], block_size=B)
    parent, child = pool.get_new_blocks(2)
    cache_request(pool, a, [parent, child])
    pool.uncache([parent])  # forced: the parent alone leaves the cache (its generation bumps)
    assert child.block_hash is not None and child.parent_generation != parent.generation
    cache_request(pool, a, [parent], 1)  # the same block re-cached for the same tokens
    assert pool.get_cached_block(a.block_hashes[0], range(4), None, a.root_key) is parent
    assert pool.find_partial_block(parent, a.root_key, [4, 5, 6]) is None
    assert pool.get_cached_block(a.block_hashes[1], range(4, 8), parent, a.root_key) is None
    # A live child under the re-cached parent is found again (the lookup itself works).
    (fresh,) = pool.get_new_blocks(1)
    assert pool.cache_block(fresh, a.block_hashes[1], range(4, 8), parent, a.root_key) is fresh
    assert pool.find_partial_block(parent, a.root_key, [4, 5, 6]) == (fresh, 3)
