"""Retention in the disk tier (OpenAI's ``prompt_cache_retention: "24h"``): retained entries are
skipped by the size cap's eviction within their budget, and expire lazily, on an injected clock."""

from __future__ import annotations

from prefixcache.cache.tiers.disk import DiskTier
from prefixcache.cache.tiers.entry import encode_entry, entry_bytes
from tests.cache.test_kv_tiers import LAYOUT, make_request, payload, stack_of, store_chain

DAY_S = 24 * 3600.0


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def one_block_requests(n):
    return [make_request([i] * 5, rid=str(i)) for i in range(n)]  # one full block each


def test_entry_bytes_is_the_encoded_size():
    request = make_request(range(100, 117))
    for key in stack_of().entry_keys(request, 0, 4):
        assert entry_bytes(key, LAYOUT) == len(encode_entry(key, LAYOUT, payload(key.depth)))


def test_a_retained_entry_survives_the_size_cap_and_expires_lazily(tmp_path):
    clock = Clock()
    size = entry_bytes(stack_of().entry_keys(make_request([0] * 5), 0, 1)[0], LAYOUT)
    disk = DiskTier(tmp_path, "ns", max_bytes=3 * size, max_retained_bytes=size, clock=clock)
    stack = stack_of(disk)
    requests = one_block_requests(6)
    store_chain(stack, requests[0], 1)
    assert stack.retain(requests[0], 1, DAY_S) == (1, [])  # stored already: nothing to store again
    for r in requests[1:5]:  # four more through a 3-entry cap: plain LRU would drop request 0's first
        store_chain(stack, r, 1)
    assert [len(stack.load_chain(r, 0, 1).payloads) for r in requests[:5]] == [1, 0, 0, 1, 1]
    assert disk.usage() == {"entries": 3, "bytes": 3 * size, "retained_entries": 1, "retained_bytes": size}
    assert disk.retained_until(requests[0].block_hashes[0].hex()) == clock.now + DAY_S
    clock.now += DAY_S  # idle exactly the ttl: still kept
    store_chain(stack, requests[1], 1)
    assert len(stack.load_chain(requests[0], 0, 1).payloads) == 1
    clock.now += 0.001  # past it: the next store expires the mark, the entry is the least recently used
    store_chain(stack, requests[2], 1)
    assert disk.retained_until(requests[0].block_hashes[0].hex()) is None
    assert len(stack.load_chain(requests[0], 0, 1).payloads) == 0
    assert disk.usage() == {"entries": 3, "bytes": 3 * size, "retained_entries": 0, "retained_bytes": 0}


def test_retention_over_the_budget_keeps_the_head_that_fits(tmp_path):
    request = make_request(range(17))  # 4 full blocks
    sizes = [entry_bytes(k, LAYOUT) for k in stack_of().entry_keys(request, 0, 4)]
    disk = DiskTier(tmp_path, "ns", max_bytes=10 * sum(sizes), max_retained_bytes=sum(sizes[:2]) + 1)
    stack = stack_of(disk)
    assert stack.retain(request, 4, DAY_S) == (2, [0, 1])  # neither stored nor queued: store them
    other = make_request([7] * 5, rid="other")
    assert stack.retain(other, 1, DAY_S) == (0, [])  # the budget is spent
    store_chain(stack, request, 4)  # a mark made before the store keeps the entry once stored
    assert disk.usage()["retained_entries"] == 2 and disk.usage()["retained_bytes"] == sum(sizes[:2])
    assert stack.retain(request, 4, DAY_S) == (2, [])  # again: extends the same two, holds them


def test_a_mark_waits_for_its_queued_entry_and_a_lookup_miss_keeps_it(tmp_path):
    clock = Clock()
    request = make_request(range(9))  # 2 full blocks
    disk = DiskTier(tmp_path, "ns", max_bytes=1 << 20, max_retained_bytes=1 << 16, clock=clock)
    stack = stack_of(disk)
    keys = stack.entry_keys(request, 0, 2)
    assert disk.retain([k.name for k in keys], DAY_S, [entry_bytes(k, LAYOUT) for k in keys]) == 2
    assert stack.load_chain(request, 0, 2).payloads == []  # a miss before the store: the marks stay
    store_chain(stack, request, 2)
    assert disk.usage()["retained_entries"] == 2
    disk.remove(keys[1].name)  # a bad entry removed: its mark goes with it
    assert disk.usage()["retained_entries"] == 1 and disk.retained_until(keys[1].name) is None


def test_without_a_budget_nothing_is_retained(tmp_path):
    disk = DiskTier(tmp_path, "ns", max_bytes=1 << 20)
    stack = stack_of(disk)
    assert not disk.retains and stack.retaining_tiers == []
    assert stack.retain(make_request(range(9)), 2, DAY_S) == (0, [])
    assert disk.usage() == {"entries": 0, "bytes": 0}


def test_a_directory_removed_while_running_drops_the_marks_of_its_entries(tmp_path):
    # the marks of stored entries went with the directory: they must not hold the budget for 24 h
    import shutil
    requests = one_block_requests(3)
    size = entry_bytes(stack_of().entry_keys(requests[0], 0, 1)[0], LAYOUT)
    disk = DiskTier(tmp_path, "ns", max_bytes=10 * size, max_retained_bytes=2 * size)
    stack = stack_of(disk)
    for r in requests[:2]:
        store_chain(stack, r, 1)
        assert stack.retain(r, 1, DAY_S)[0] == 1
    assert disk.usage()["retained_bytes"] == 2 * size
    shutil.rmtree(tmp_path / "ns")
    store_chain(stack, requests[2], 1)  # the store finds the directory gone and starts a new index
    assert disk.usage() == {"entries": 1, "bytes": size, "retained_entries": 0, "retained_bytes": 0}
    assert disk.retained_until(requests[0].block_hashes[0].hex()) is None
    assert stack.retain(requests[2], 1, DAY_S)[0] == 1  # the budget is free again
