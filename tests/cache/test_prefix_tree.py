"""The cached-prefix tree over a real KVCacheManager (no model): segments, forks, hits, last use,
tenant visibility, and per-block use restarting when a block is evicted and reused."""

from __future__ import annotations

from cache_test_utils import admit, make_manager, make_request

from prefixcache.cache.hashing import tenant_extra_key
from prefixcache.cache.prefix_tree import BlockUsage, build_prefix_tree

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(manager, usage, clock, request) -> int:
    """Admits and computes a request, records it as the engine's finish hook does, frees it."""
    admit(manager, request)
    manager.end_step()
    usage.record(manager.req_to_blocks[request.request_id], request.num_cached_tokens // BS, clock())
    manager.free(request)
    return request.num_cached_tokens


def test_tree_segments_forks_hits_and_last_use():
    clock = Clock()
    m, usage = make_manager(32, BS, clock=clock), BlockUsage()
    shared = list(range(100, 108))  # 2 blocks
    assert run(m, usage, clock, make_request("a", shared + [1, 2, 3, 4, 9], BS)) == 0
    clock.now = 110.0
    assert run(m, usage, clock, make_request("b", shared + [1, 2, 3, 4, 8], BS)) == 12
    clock.now = 120.0
    assert run(m, usage, clock, make_request("c", shared + [5, 6, 7, 8, 9], BS)) == 8
    clock.now = 125.0

    (group,) = build_prefix_tree(m.block_pool, usage, clock(), decode=lambda ids: ",".join(map(str, ids)))
    assert group["namespace"] == {"tenant": None, "salt": None, "adapter": None}
    assert (group["blocks"], group["tokens"]) == (4, 16) == (m.block_pool.num_cached_blocks, 16)
    (root,) = group["chains"]
    # [0, 8): the shared 2 blocks, one segment, served to b and c; forks at 8.
    assert (root["start"], root["end"], root["blocks"], root["hits"]) == (0, 8, 2, 2)
    assert root["served_tokens"] == 2 * 8 and root["last_use_s_ago"] == 5.0
    assert root["preview"] == ",".join(map(str, shared))
    first, second = root["children"]  # most served first: [1, 2, 3, 4] served b
    assert (first["start"], first["end"], first["hits"], first["preview"]) == (8, 12, 1, "1,2,3,4")
    assert first["last_use_s_ago"] == 15.0
    assert (second["start"], second["hits"], second["preview"], second["last_use_s_ago"]) == (8, 0, "5,6,7,8", 5.0)
    assert usage.block_hits == 0 + 3 + 2 and usage.distinct_hit_blocks == 3
    assert "preview" not in build_prefix_tree(m.block_pool, usage, clock())[0]["chains"][0]  # no decode: no text


def test_tenants_see_their_own_chains_and_shared_ones():
    clock = Clock()
    m, usage = make_manager(32, BS, clock=clock), BlockUsage()
    public = [7, 7, 7, 7]
    run(m, usage, clock, make_request("a", public + [1, 1, 1, 1, 5], BS, tenant="acme", num_shared_blocks=1))
    run(m, usage, clock, make_request("g", public + [2, 2, 2, 2, 5], BS, tenant="globex", num_shared_blocks=1))
    run(m, usage, clock, make_request("g2", [3, 3, 3, 3, 3], BS, tenant="globex"))

    def view(tenant):
        return build_prefix_tree(m.block_pool, usage, clock(), decode=lambda ids: str(ids),
                                 visible_key=lambda k: k in (b"", tenant_extra_key(tenant)))

    (shared,) = view("acme")  # the public block and acme's child only
    assert shared["namespace"]["tenant"] is None and shared["tokens"] == 8
    (root,) = shared["chains"]
    assert [c["preview"] for c in root["children"]] == ["[1, 1, 1, 1]"]
    groups = view("globex")
    assert sorted(g["namespace"]["tenant"] or "" for g in groups) == ["", "globex"]
    assert "[1, 1, 1, 1]" not in str(groups)
    assert len(build_prefix_tree(m.block_pool, usage, clock())) == 2  # the operator sees both namespaces


def test_use_restarts_when_the_block_is_evicted():
    clock = Clock()
    m, usage = make_manager(3, BS, clock=clock), BlockUsage()
    run(m, usage, clock, make_request("a", [1, 2, 3, 4, 5], BS))
    run(m, usage, clock, make_request("b", [1, 2, 3, 4, 6], BS))
    block = next(iter(next(iter(m.block_pool.cached_block_hash_to_block.values())).values()))
    assert usage.get(block)[0] == 1
    run(m, usage, clock, make_request("c", [9, 9, 9, 9, 8, 8, 8, 8, 7], BS))  # needs all 3 blocks: evicts
    assert block.token_ids != (1, 2, 3, 4) and usage.get(block)[0] == 0  # another content: its own count
    (group,) = build_prefix_tree(m.block_pool, usage, clock(), decode=str)
    assert [(n["preview"], n["hits"]) for n in group["chains"]] == [("[9, 9, 9, 9, 8, 8, 8, 8]", 0)]
