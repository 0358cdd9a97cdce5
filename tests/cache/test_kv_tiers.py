"""KV tiers without a model: the entry format and its checks (C17), the disk tier (atomic writes,
LRU cap, restart, kill -9), the Redis tier against a real redis-server (TTL, a server that goes
down), the stack's chain loading, keys across processes (C15) and the tier options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prefixcache.cache.config import CacheConfig
from prefixcache.cache.hashing import BlockHasher, hash_seed_bytes, make_root_key, tenant_extra_key
from prefixcache.cache.kv_cache_groups import AttentionKind, LayerSpec, make_kv_cache_groups
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.cache.tiers.disk import DiskTier
from prefixcache.cache.tiers.entry import EntryError, KVBlockLayout, decode_entry, encode_entry, prefix_digests
from prefixcache.cache.tiers.redis_tier import RedisTier
from prefixcache.cache.tiers.stack import KVTierStack, make_kv_tiers, tier_namespace
from prefixcache.errors import InvalidInputError
from prefixcache.request import Request
from prefixcache.sampling_params import SamplingParams

BS = 4
LAYOUT = KVBlockLayout("float32", (2, 2, BS, 1, 2), 4)  # 2 layers, 1 KV head of dim 2: 64 payload bytes
BIG_LAYOUT = KVBlockLayout("float32", (2, 2, BS, 1, 128), 4)  # 4 KiB payloads (64 x LAYOUT's)
REPO = Path(__file__).resolve().parents[2]


def make_request(tokens, salt=None, tenant=None, num_shared_blocks=0, seed=7, rid="r"):
    root_key = make_root_key(b"model", salt, hash_seed_bytes(seed))
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), BlockHasher(BS), root_key,
                   tenant_key=tenant_extra_key(tenant), num_shared_blocks=num_shared_blocks)


def payload(i: int) -> bytes:
    """A distinct, recognisable payload for block ``i``."""
    return bytes((i * 7 + j) % 251 for j in range(LAYOUT.payload_bytes))


def stack_of(*tiers, **kwargs) -> KVTierStack:
    return KVTierStack(list(tiers), LAYOUT, **kwargs)


def store_chain(stack: KVTierStack, request: Request, num_blocks: int) -> list:
    keys = stack.entry_keys(request, 0, num_blocks)
    stack.submit([(k, payload(k.depth)) for k in keys])
    stack.flush()
    return keys


# ---------------------------------------------------------------------------- entry format
def test_entry_round_trip_and_every_bad_entry_is_refused():
    stack = stack_of()
    request = make_request(range(100, 113))  # 3 full blocks + 1 token
    k0, k1, k2 = stack.entry_keys(request, 0, 3)
    blob = encode_entry(k1, LAYOUT, payload(1))
    assert bytes(decode_entry(blob, k1, LAYOUT)) == payload(1)
    assert k1.parent_hash == request.block_hashes[0] and k0.parent_hash == BlockHasher(BS).root_hash(request.root_key)

    bad = {
        "truncated payload": blob[:-1],
        "truncated header": blob[:20],
        "empty": b"",
        "zeroed K/V, header kept": blob[: -LAYOUT.payload_bytes] + bytes(LAYOUT.payload_bytes),
        "one flipped payload bit": blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:],
        "another block's entry under this key": encode_entry(k2, LAYOUT, payload(2)),
        "not an entry": b"x" * len(blob),
    }
    for what, data in bad.items():
        with pytest.raises(EntryError):
            decode_entry(data, k1, LAYOUT)
    # The same block under another layout (dtype or shape) is refused too.
    with pytest.raises(EntryError, match="dtype"):
        decode_entry(blob, k1, KVBlockLayout("bfloat16", LAYOUT.shape, 2))
    with pytest.raises(EntryError, match="shape"):
        decode_entry(blob, k1, KVBlockLayout("float32", (1, 2, BS, 2, 2), 4))


def test_entry_of_another_namespace_is_refused_whatever_the_hash(constant_hash):
    """With every block hash equal (C4's forced collision), the prefix digest still tells the salt,
    the tenant and an earlier block's tokens apart (C16)."""
    stack = stack_of()
    base = make_request(range(100, 113), salt="s1", tenant="t1")
    (key,) = stack.entry_keys(base, 1, 2)
    blob = encode_entry(key, LAYOUT, payload(1))
    others = [
        make_request(range(100, 113), salt="s2", tenant="t1"),
        make_request(range(100, 113), salt=None, tenant="t1"),
        make_request(range(100, 113), salt="s1", tenant="t2"),
        make_request(range(100, 113), salt="s1", tenant=None),
        make_request([99, *range(101, 113)], salt="s1", tenant="t1"),  # first block differs
        make_request(range(100, 113), salt="s1", tenant="t1", seed=8),  # another hash seed
    ]
    for other in others:
        (other_key,) = stack.entry_keys(other, 1, 2)
        assert other_key.block_hash == key.block_hash  # the hash can't tell them apart
        with pytest.raises(EntryError):
            decode_entry(blob, other_key, LAYOUT)
    (same,) = stack.entry_keys(make_request(range(100, 113), salt="s1", tenant="t1", rid="other"), 1, 2)
    assert bytes(decode_entry(blob, same, LAYOUT)) == payload(1)


def test_prefix_digests_chain_over_root_tokens_and_extra_keys():
    tokens = list(range(12))
    d = prefix_digests(b"root", tokens, BS, lambda i: b"", 3)
    assert d == prefix_digests(b"root", tokens, BS, lambda i: b"", 3) and len(set(d)) == 3
    assert prefix_digests(b"root2", tokens, BS, lambda i: b"", 3)[2] != d[2]
    assert prefix_digests(b"root", [1] + tokens[1:], BS, lambda i: b"", 3)[2] != d[2]
    assert prefix_digests(b"root", tokens, BS, lambda i: b"t" if i == 0 else b"", 3)[2] != d[2]


# ---------------------------------------------------------------------------- disk tier
def test_disk_tier_stores_loads_and_survives_a_restart(tmp_path):
    disk = DiskTier(tmp_path, "ns", max_bytes=1 << 20)
    stack = stack_of(disk)
    request = make_request(range(200, 213))
    store_chain(stack, request, 3)
    assert disk.usage()["entries"] == 3
    assert sorted(p.name for p in (tmp_path / "ns").glob("*/*")) == sorted(
        f"{h.hex()}.kv" for h in request.block_hashes)

    restarted = stack_of(DiskTier(tmp_path, "ns", max_bytes=1 << 20))
    assert restarted.tiers[0].usage()["entries"] == 3
    load = restarted.load_chain(request, 0, 3)
    assert [bytes(p) for p in load.payloads] == [payload(0), payload(1), payload(2)]
    assert load.per_tier == [("disk", 3, 3)]
    restarted.record_admission(load)
    assert restarted.snapshot()["disk"]["hits"] == 3 * BS and restarted.snapshot()["disk"]["queries"] == 3 * BS
    # From block 1 on (the pool held block 0).
    assert [bytes(p) for p in restarted.load_chain(request, 1, 3).payloads] == [payload(1), payload(2)]


def test_disk_chain_stops_at_the_first_bad_file_which_is_removed(tmp_path):
    stack = stack_of(DiskTier(tmp_path, "ns", max_bytes=1 << 20))
    request = make_request(range(300, 317))  # 4 full blocks + 1
    keys = store_chain(stack, request, 4)
    path = lambda k: tmp_path / "ns" / k.name[:2] / f"{k.name}.kv"  # noqa: E731
    data = path(keys[1]).read_bytes()
    path(keys[1]).write_bytes(data[: len(data) // 2])  # truncated
    load = stack.load_chain(request, 0, 4)
    assert [bytes(p) for p in load.payloads] == [payload(0)]
    assert not path(keys[1]).exists() and path(keys[2]).exists()
    assert stack.snapshot()["disk"]["bad_entries"] == 1

    data = path(keys[3]).read_bytes()
    path(keys[3]).write_bytes(data[: -LAYOUT.payload_bytes] + bytes(LAYOUT.payload_bytes))  # zeroed K/V
    assert [bytes(p) for p in stack.load_chain(request, 2, 4).payloads] == [payload(2)]
    assert not path(keys[3]).exists()
    assert stack.snapshot()["disk"]["bad_entries"] == 2


def test_disk_cap_removes_least_recently_used_first(tmp_path):
    entry_bytes = len(encode_entry(stack_of().entry_keys(make_request(range(4 + 1)), 0, 1)[0], LAYOUT, payload(0)))
    disk = DiskTier(tmp_path, "ns", max_bytes=3 * entry_bytes)
    stack = stack_of(disk)
    requests = [make_request([i] * 5, rid=str(i)) for i in range(4)]  # one block each
    for r in requests[:3]:
        store_chain(stack, r, 1)
    assert stack.load_chain(requests[0], 0, 1).payloads  # a hit: request 0's entry is now the newest
    store_chain(stack, requests[3], 1)  # over the cap: the least recently used (request 1's) goes
    assert disk.usage() == {"entries": 3, "bytes": 3 * entry_bytes}
    assert [len(stack.load_chain(r, 0, 1).payloads) for r in requests] == [1, 0, 1, 1]


def test_disk_cap_drops_a_chains_end_before_its_start(tmp_path):
    """Found by a review (2026-12-02): a chain's head was stored first, so the cap evicted it first
    and the entries left could never be hit; an entry larger than the cap was kept anyway. (Storing
    tail first instead made a full writer queue drop the heads: the order stays head first.)"""
    request = make_request(list(range(17)))  # 4 full blocks
    keys = stack_of().entry_keys(request, 0, 4)
    sizes = [len(encode_entry(k, LAYOUT, payload(k.depth))) for k in keys]
    assert sizes == [572, 572, 574, 576]  # (the entry's header grows with the depth)
    disk = DiskTier(tmp_path, "ns", max_bytes=sum(sizes[:3]))
    stack = stack_of(disk)
    stack.submit([(key, payload(key.depth)) for key in keys])  # as the engine submits them: head first
    stack.flush()
    assert disk.usage() == {"entries": 3, "bytes": sum(sizes[:3])}
    assert len(stack.load_chain(request, 0, 4).payloads) == 3  # blocks 0-2 kept, block 3 went
    store_chain(stack, make_request([9] * 5, rid="other"), 1)  # a hit refreshed 2, 1, 0 in that order
    assert len(stack.load_chain(request, 0, 4).payloads) == 2
    tiny = DiskTier(tmp_path / "tiny", "ns", max_bytes=sizes[0] - 1)
    tiny.store(keys[0].name, encode_entry(keys[0], LAYOUT, payload(0)))
    assert tiny.usage() == {"entries": 0, "bytes": 0} and not list((tmp_path / "tiny").rglob("*.kv"))


def test_a_full_writer_queue_drops_a_chains_end_not_its_start(tmp_path):
    """The writer queue (``max_queued_bytes``) holds 3 blocks while the disk is busy: of an 8-block
    chain submitted head first, the busy store's block and the next 3 are kept, the end dropped, so
    a reload hits 4 blocks (a tail-first order tried on 2026-12-02 kept only unreachable ends)."""
    import threading

    gate = threading.Event()

    class BusyDisk(DiskTier):
        def store(self, name, blob, depth=0):
            gate.wait(10)
            super().store(name, blob, depth)

    disk = BusyDisk(tmp_path, "ns", max_bytes=1 << 20)
    stack = stack_of(disk, max_queued_bytes=3 * LAYOUT.payload_bytes)
    request = make_request(list(range(33)))  # 8 full blocks
    keys = stack.entry_keys(request, 0, 8)
    stack.submit([(keys[0], payload(0))])
    deadline = time.monotonic() + 10
    while stack._queue.qsize() and time.monotonic() < deadline:  # the writer took block 0 and waits
        time.sleep(0.01)
    stack.submit([(key, payload(key.depth)) for key in keys[1:]])
    gate.set()
    stack.flush()
    assert stack.snapshot()["disk"]["store_drops"] == 4
    assert [bytes(p) for p in stack.load_chain(request, 0, 8).payloads] == [payload(i) for i in range(4)]


def test_disk_tier_recovers_its_directory_and_serves_read_only_files(tmp_path, monkeypatch):
    """Found by a review (2026-12-02): ``rm -rf`` of the namespace while running stopped every
    later store (mkdir without parents), and a read-only directory served no hit (a failed mtime
    refresh failed the load)."""
    import shutil

    from prefixcache.cache.tiers import disk as disk_module

    disk = DiskTier(tmp_path, "ns", max_bytes=1 << 20)
    stack = stack_of(disk)
    first, second = make_request([1] * 9, rid="a"), make_request([2] * 9, rid="b")
    store_chain(stack, first, 2)
    shutil.rmtree(tmp_path / "ns")
    assert stack.load_chain(first, 0, 2).payloads == []
    store_chain(stack, second, 2)
    assert disk.usage()["entries"] == 2
    assert [bytes(p) for p in stack.load_chain(second, 0, 2).payloads] == [payload(0), payload(1)]

    def read_only(path, *args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(disk_module.os, "utime", read_only)
    assert [bytes(p) for p in stack.load_chain(second, 0, 2).payloads] == [payload(0), payload(1)]
    assert stack.snapshot()["disk"]["errors"] == 0


def test_kill_9_during_writes_leaves_only_whole_entries(tmp_path):
    """A process storing entries is killed with SIGKILL; every entry file left is whole and
    verifies against its block, and a new process loads them (the rest are misses)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_kv_tiers import BIG_LAYOUT, make_request, payload
        from prefixcache.cache.tiers.disk import DiskTier
        from prefixcache.cache.tiers.stack import KVTierStack
        stack = KVTierStack([DiskTier({str(tmp_path)!r}, "ns", 1 << 30)], BIG_LAYOUT)
        i = 0
        while True:
            r = make_request([i % 50000] * 4 * 8 + [1], rid=str(i))
            stack.submit([(k, payload(k.depth) * 64) for k in stack.entry_keys(r, 0, 8)])
            stack.flush()
            i += 1
            if i == 3:
                print("writing", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline() == b"writing\n"
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    files = list((tmp_path / "ns").glob("*/*.kv"))
    assert len(files) >= 3 * 8
    stack = KVTierStack([DiskTier(tmp_path, "ns", 1 << 30)], BIG_LAYOUT)
    num_written = len(files) // 8 + 2
    found = 0
    for i in range(num_written):
        r = make_request([i % 50000] * 4 * 8 + [1], rid=str(i))
        load = stack.load_chain(r, 0, 8)
        assert [bytes(p) for p in load.payloads] == [payload(d) * 64 for d in range(len(load.payloads))]
        found += len(load.payloads)
    assert found == len(files) and stack.snapshot()["disk"]["bad_entries"] == 0


# ---------------------------------------------------------------------------- redis tier
def test_redis_tier_set_with_ttl_load_and_remove(redis_server):
    redis_tier = RedisTier(redis_server.url, "ns", ttl_s=120)
    stack = stack_of(redis_tier)
    request = make_request(range(400, 413))
    keys = store_chain(stack, request, 3)
    names = sorted(k.decode() for k in redis_server.client.keys("*"))
    assert names == sorted(f"prefixcache:ns:{k.name}" for k in keys)
    assert 0 < redis_server.client.ttl(names[0]) <= 120
    assert [bytes(p) for p in stack.load_chain(request, 0, 3).payloads] == [payload(0), payload(1), payload(2)]
    # A valid key holding another block's entry is a miss, and is deleted.
    redis_server.client.set(f"prefixcache:ns:{keys[1].name}", encode_entry(keys[2], LAYOUT, payload(2)))
    assert [bytes(p) for p in stack.load_chain(request, 0, 3).payloads] == [payload(0)]
    assert not redis_server.client.exists(f"prefixcache:ns:{keys[1].name}")
    assert stack.snapshot()["redis"]["bad_entries"] == 1


def test_redis_down_is_a_miss_an_error_count_and_a_rest(redis_server, caplog):
    now = [0.0]
    stack = stack_of(RedisTier(redis_server.url, "ns", ttl_s=60), retry_s=5.0, clock=lambda: now[0])
    request = make_request(range(500, 513))
    store_chain(stack, request, 3)
    redis_server.stop()
    with caplog.at_level("WARNING"):
        assert stack.load_chain(request, 0, 3).payloads == []
    assert stack.snapshot()["redis"]["errors"] == 1
    assert "kv tier redis unavailable" in caplog.text
    # Resting: neither asked (no error, no timeout) nor written.
    assert stack.load_chain(request, 0, 3).per_tier == []
    store_chain(stack, make_request(range(600, 605)), 1)
    assert stack.snapshot()["redis"]["errors"] == 1 and stack.snapshot()["redis"]["store_drops"] == 1
    now[0] = 6.0  # rest over: tried again, still down
    assert stack.load_chain(request, 0, 3).payloads == []
    assert stack.snapshot()["redis"]["errors"] == 2


def test_tiers_are_asked_in_order_each_continuing_the_chain(tmp_path, redis_server):
    disk = DiskTier(tmp_path, "ns", max_bytes=1 << 20)
    redis_tier = RedisTier(redis_server.url, "ns", ttl_s=60)
    request = make_request(range(700, 717))  # 4 blocks
    keys = stack_of().entry_keys(request, 0, 4)
    disk.store(keys[0].name, encode_entry(keys[0], LAYOUT, payload(0)))
    for k in keys[1:3]:
        redis_tier.store(k.name, encode_entry(k, LAYOUT, payload(k.depth)))
    stack = stack_of(disk, redis_tier)
    load = stack.load_chain(request, 0, 4)
    assert [bytes(p) for p in load.payloads] == [payload(0), payload(1), payload(2)]
    assert load.per_tier == [("disk", 4, 1), ("redis", 3, 2)]


def test_blocks_loaded_from_redis_are_promoted_to_disk(tmp_path, redis_server):
    """A replica whose disk lacks what Redis holds copies the loaded blocks to its disk, so its
    next restart finds them locally (with Redis gone)."""
    writer = stack_of(RedisTier(redis_server.url, "ns", ttl_s=60))
    request = make_request(range(800, 813))  # 3 full blocks
    store_chain(writer, request, 3)
    stack = stack_of(DiskTier(tmp_path, "ns", 1 << 20), RedisTier(redis_server.url, "ns", ttl_s=60))
    load = stack.load_chain(request, 0, 3)
    assert load.per_tier == [("disk", 3, 0), ("redis", 3, 3)]
    stack.flush()
    assert stack.snapshot()["disk"]["stores"] == 3 and stack.snapshot()["redis"]["stores"] == 0
    redis_server.stop()
    restarted = stack_of(DiskTier(tmp_path, "ns", 1 << 20))
    again = restarted.load_chain(request, 0, 3)
    assert [bytes(p) for p in again.payloads] == [payload(0), payload(1), payload(2)]
    assert again.per_tier == [("disk", 3, 3)]


def test_a_tier_slower_than_recomputing_is_skipped_then_probed_again(tmp_path):
    """Load or recompute: after a load measured slower than computing a block, lookups skip the
    tier (counted) until ``probe_s`` has passed; a probe that measures it fast again restores it."""
    now = [0.0]
    stack = stack_of(DiskTier(tmp_path, "ns", 1 << 20), probe_s=30.0, clock=lambda: now[0])
    request = make_request(range(300, 313))  # 3 full blocks
    store_chain(stack, request, 3)
    stack.observe_compute(0.5, BS - 1)  # fewer tokens than a block (decode): not a prefill cost
    assert stack.compute_s_per_block is None
    assert len(stack.load_chain(request, 0, 3).payloads) == 3  # nothing known: load
    measured = stack.load_s_per_block["disk"]
    assert measured is not None and measured > 0
    stack.observe_compute(measured / 100 / BS * 2 * BS, 2 * BS)  # a block computes 100x faster
    assert stack.compute_s_per_block == pytest.approx(measured / 100)
    first = stack.load_chain(request, 0, 3)  # the first lookup after the estimate is the probe
    assert len(first.payloads) == 3
    stack.load_s_per_block["disk"] = 1.0  # the probe's load is slow again (pinned: timing-free)
    skipped = stack.load_chain(request, 0, 3)
    assert skipped.payloads == [] and skipped.per_tier == []
    assert stack.snapshot()["disk"]["slow_skips"] == 1
    now[0] = 29.9
    assert stack.load_chain(request, 0, 3).payloads == []
    now[0] = 30.0  # a probe is due: loaded (and re-measured)
    assert len(stack.load_chain(request, 0, 3).payloads) == 3
    assert stack.snapshot()["disk"]["slow_skips"] == 2
    stack.load_s_per_block["disk"] = stack.compute_s_per_block / 2  # as fast as its last probe says
    now[0] = 31.0
    assert len(stack.load_chain(request, 0, 3).payloads) == 3


# ---------------------------------------------------------------------------- keys across processes
@pytest.mark.slow  # two fresh interpreters import the package (seconds each)
def test_c15_block_hashes_are_the_same_in_every_process_only_with_the_same_seed(tmp_path):
    """Keys depend on the configured seed (or key file), never on PYTHONHASHSEED."""
    key_file = tmp_path / "seed.key"
    key_file.write_bytes(b"0123456789abcdef-deployment-secret")
    script = textwrap.dedent("""
        import json, sys
        from prefixcache.cache.hashing import BlockHasher, hash_seed_bytes, make_root_key
        out = {}
        for seed in ("7", "8", sys.argv[1]):
            for algo in ("xxh64", "sha256"):
                hashes = []
                seed_bytes = hash_seed_bytes(int(seed)) if seed.isdigit() else hash_seed_bytes(None, seed)
                root = make_root_key(b"fingerprint", "salt", seed_bytes)
                BlockHasher(16, algo).extend(hashes, list(range(53)), root, b"tenant", 1)
                out[f"{seed}|{algo}"] = [h.hex() for h in hashes]
        print(json.dumps(out))
    """)

    def run(python_hash_seed: str) -> dict:
        env = {**os.environ, "PYTHONHASHSEED": python_hash_seed, "PYTHONPATH": str(REPO)}
        return json.loads(subprocess.run([sys.executable, "-c", script, str(key_file)], env=env, check=True,
                                         capture_output=True, text=True).stdout)

    first, second = run("1"), run("2")
    assert first == second and len(first) == 6
    chains = [tuple(c) for c in first.values()]
    assert len(set(chains)) == 6 and all(len(c) == 3 for c in chains)  # seed, key file and algo all matter


def test_tier_options_are_checked():
    with pytest.raises(InvalidInputError) as e:
        CacheConfig(kv_disk_dir="/tmp/x").validate()
    assert e.value.field == "hash_seed"
    with pytest.raises(InvalidInputError) as e:
        CacheConfig(kv_redis_url="http://localhost", hash_seed=1).validate()
    assert e.value.field == "kv_redis_url"
    with pytest.raises(InvalidInputError) as e:
        CacheConfig(hash_seed=1, hash_seed_file="k").validate()
    assert e.value.field == "hash_seed_file"
    with pytest.raises(InvalidInputError) as e:
        CacheConfig(kv_disk_dir="/tmp/x", hash_seed=1, kv_disk_bytes=0).validate()
    assert e.value.field == "kv_disk_bytes"
    CacheConfig(kv_disk_dir="/tmp/x", kv_redis_url="redis://h:1/0", hash_seed=1).validate()


def test_a_disk_dir_that_cannot_be_made_names_the_field(tmp_path):
    """Found by a review (2026-12-02): a raw NotADirectoryError, after the model had loaded."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    for where in (afile, afile / "sub"):
        with pytest.raises(InvalidInputError) as e:
            make_kv_tiers(CacheConfig(kv_disk_dir=str(where), hash_seed=1), LAYOUT)
        assert e.value.field == "kv_disk_dir"
        assert str(e.value) == f"kv_disk_dir: cannot create or use the directory {str(where)!r} (Not a directory)"


def test_hash_seed_file_is_read_and_checked(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"tooshort")
    for path in (short, tmp_path / "missing"):
        with pytest.raises(InvalidInputError) as e:
            hash_seed_bytes(None, str(path))
        assert e.value.field == "hash_seed_file"
    good = tmp_path / "good"
    good.write_bytes(b"a-secret-of-enough-bytes\n")
    assert hash_seed_bytes(None, str(good)) == hash_seed_bytes(None, str(good)) != hash_seed_bytes(7)


def test_namespace_names_format_algo_dtype_and_shape():
    assert tier_namespace("xxh64", LAYOUT) == "v1-xxh64-float32-2x2x4x1x2"
    assert tier_namespace("sha256", LAYOUT) != tier_namespace("xxh64", LAYOUT)


# ---------------------------------------------------------------------------- several KV-cache groups
# 6 layers, full and sliding (window 8) alternating: group 0 = {0, 2, 4} (full), group 1 = {1, 3, 5}.
# A pool block (and so a tier entry) holds one group's 3 layers.
W = 8
HYBRID = make_kv_cache_groups([LayerSpec(AttentionKind.FULL), LayerSpec(AttentionKind.SLIDING, W)] * 3)


def group_payload(group_id: int, i: int) -> bytes:
    """A distinct payload for block ``i`` of group ``group_id``."""
    return bytes((i * 7 + group_id * 101 + j) % 251 for j in range(LAYOUT.payload_bytes))


def hybrid_tier_admission(tmp_path, stored: dict[int, range]):
    """A hybrid manager over a disk tier holding ``stored[g]``'s blocks of group ``g`` of a 10-block
    (+ 1 token) prompt; admits the prompt into an empty pool. Returns (manager, request, admission)."""
    disk = DiskTier(tmp_path, "ns", max_bytes=1 << 20)
    stack = stack_of(disk)
    request = make_request(range(300, 341), rid="hybrid")  # 41 tokens: 10 full blocks + 1
    for group_id, blocks in stored.items():
        keys = stack.entry_keys(request, 0, 10, group_id)
        stack.submit([(keys[i], group_payload(group_id, i)) for i in blocks])
    stack.flush()
    manager = KVCacheManager(64, CacheConfig(block_size=BS), tiers=stack, kv_cache_groups=HYBRID)
    admission = manager.admit(request, token_budget=100)
    return manager, request, admission


def loaded_payloads(manager: KVCacheManager, request) -> dict[tuple[int, int], bytes]:
    """(group, block index) -> the payload a load op writes into the request's block there."""
    by_id = {op.block_id: bytes(op.payload) for op in manager.pending_load_ops}
    tables = [manager.req_to_blocks[request.request_id], *manager.req_to_group_blocks[request.request_id]]
    return {(g, i): by_id[b.block_id] for g, table in enumerate(tables) for i, b in enumerate(table)
            if b is not None and b.block_id in by_id}


def test_hybrid_tier_hit_needs_every_block_of_a_full_group_and_the_window_of_a_sliding_one(tmp_path):
    # Group 1 holds only blocks 8-9: the window [40 - 8 + 1, 40) = 33..39 a hit at 40 needs.
    manager, request, admission = hybrid_tier_admission(tmp_path / "a", {0: range(10), 1: range(8, 10)})
    assert admission.num_tier_tokens == 40 and admission.num_new_tokens == 1
    assert request.num_cached_tokens == 40 and request.cached_tier_tokens == {"disk": 40}
    loaded = loaded_payloads(manager, request)
    assert sorted(loaded) == [(0, i) for i in range(10)] + [(1, 8), (1, 9)]  # the window only
    assert all(p == group_payload(g, i) for (g, i), p in loaded.items())
    # Group 1 takes no block before its window (no query reads it); block 10 is computed.
    assert [b is None for b in manager.req_to_group_blocks["hybrid"][0]] == [True] * 8 + [False] * 3
    assert manager.block_pool.get_num_free_blocks() == 64 - 11 - 3
    snapshot = manager.tiers.snapshot()["disk"]
    assert snapshot["hits"] == 40 and snapshot["queries"] == 40
    assert snapshot["bytes_loaded"] == 12 * LAYOUT.payload_bytes


def test_hybrid_tier_hit_ends_where_a_sliding_group_has_its_window(tmp_path):
    # Group 1 lacks block 9: a hit at 40 can't be served; at 36 its window (29..35) is blocks 7-8.
    manager, request, admission = hybrid_tier_admission(tmp_path / "b", {0: range(10), 1: range(0, 9)})
    assert admission.num_tier_tokens == 36 and admission.num_new_tokens == 5
    assert sorted(loaded_payloads(manager, request)) == [(0, i) for i in range(9)] + [(1, 7), (1, 8)]
    assert manager.tiers.snapshot()["disk"]["hits"] == 36
    # Read: group 0's blocks 0-9 (9 is cut), group 1's 8 (then 9 misses), then 7; never its 0-6.
    assert manager.tiers.snapshot()["disk"]["bytes_loaded"] == (10 + 2) * LAYOUT.payload_bytes


def test_hybrid_tier_hit_is_cut_to_the_full_groups_chain_and_zero_without_a_window(tmp_path):
    _, request, admission = hybrid_tier_admission(tmp_path / "c", {0: range(6), 1: range(10)})
    assert admission.num_tier_tokens == 24  # group 0 (full) needs every block: 0-5 only
    _, _, admission = hybrid_tier_admission(tmp_path / "d", {0: range(10)})
    assert admission.num_tier_tokens == 0 and admission.num_new_tokens == 41  # group 1 serves nothing
    # A group's entry never serves another group: group 0's entries alone, under group 1's keys, miss.
    stack = stack_of()
    assert {k.name for k in stack.entry_keys(request, 0, 10, 1)}.isdisjoint(
        k.name for k in stack.entry_keys(request, 0, 10, 0))
    assert [k.block_hash for k in stack.entry_keys(request, 0, 10, 0)] == list(request.block_hashes[:10])


def test_hybrid_blocks_computed_are_stored_per_group_and_loaded_back(tmp_path):
    """Write-through stores every group's computed blocks under its own key; a new manager over the
    same directory loads group 0's chain and group 1's window."""
    stack = stack_of(DiskTier(tmp_path, "ns", max_bytes=1 << 20))
    manager = KVCacheManager(64, CacheConfig(block_size=BS), tiers=stack, kv_cache_groups=HYBRID)
    request = make_request(range(300, 341), rid="first")
    assert manager.admit(request, token_budget=100).num_new_tokens == 41
    stores = manager.take_tier_stores()
    blocks = {b.block_id: (g, i) for g, table in enumerate([manager.req_to_blocks["first"],
                                                            *manager.req_to_group_blocks["first"]])
              for i, b in enumerate(table) if b is not None}
    assert sorted(blocks[block_id] for block_id, _ in stores) == [(g, i) for g in (0, 1) for i in range(10)]
    stack.submit([(key, group_payload(*blocks[block_id])) for block_id, key in stores])
    stack.flush()
    assert stack.snapshot()["disk"]["stores"] == 20

    again = KVCacheManager(64, CacheConfig(block_size=BS), tiers=KVTierStack(
        [DiskTier(tmp_path, "ns", max_bytes=1 << 20)], LAYOUT), kv_cache_groups=HYBRID)
    second = make_request(range(300, 341), rid="second")
    assert again.admit(second, token_budget=100).num_tier_tokens == 40
    loaded = loaded_payloads(again, second)
    assert sorted(loaded) == [(0, i) for i in range(10)] + [(1, 8), (1, 9)]
    assert all(p == group_payload(g, i) for (g, i), p in loaded.items())
    assert again.take_tier_stores() == []  # loaded blocks are not stored back


def test_hybrid_entries_are_verified_whatever_the_hash(constant_hash, tmp_path):
    """With every block hash equal (a forced collision), another prompt's entries and another
    group's entry are refused: only the prompt that stored them hits."""
    stack = stack_of(DiskTier(tmp_path, "ns", max_bytes=1 << 20))
    stored = make_request(range(500, 505), rid="a")  # 1 full block + 1 token
    for group_id in (0, 1):
        (key,) = stack.entry_keys(stored, 0, 1, group_id)
        stack.submit([(key, group_payload(group_id, 0))])
    stack.flush()
    g0, g1 = (stack.entry_keys(stored, 0, 1, g)[0] for g in (0, 1))
    assert g0.name != g1.name  # the group is in the key even when the hash collides
    with pytest.raises(EntryError, match="block_hash"):
        decode_entry(encode_entry(g1, LAYOUT, group_payload(1, 0)), g0, LAYOUT)

    def admit(tokens, rid):
        manager = KVCacheManager(16, CacheConfig(block_size=BS), tiers=stack, kv_cache_groups=HYBRID)
        return manager, manager.admit(make_request(tokens, rid=rid), token_budget=100)

    _, other = admit([499, 501, 502, 503, 504], "b")  # same hash, another first token
    assert other.num_tier_tokens == 0
    assert stack.snapshot()["disk"]["bad_entries"] == 1  # group 0's entry failed and was removed
    stack.submit([(g0, group_payload(0, 0))])
    stack.flush()
    manager, same = admit(range(500, 505), "c")
    assert same.num_tier_tokens == 4
    assert sorted(bytes(op.payload) for op in manager.pending_load_ops) == sorted(
        [group_payload(0, 0), group_payload(1, 0)])


@pytest.fixture
def digest_chains(monkeypatch):
    """Counts the prefix digest chains the stack computes (each a sha256 chain over a whole prefix)."""
    from prefixcache.cache.tiers import stack as stack_module

    calls = []
    compute = stack_module.prefix_digests

    def counting(root_key, tokens, block_size, extra_key, num_blocks):
        calls.append(num_blocks)
        return compute(root_key, tokens, block_size, extra_key, num_blocks)

    monkeypatch.setattr(stack_module, "prefix_digests", counting)
    return calls


def test_hybrid_lookup_and_stores_compute_the_digest_chain_once(tmp_path, digest_chains):
    """The lookup of test_hybrid_tier_hit_ends_where_a_sliding_group_has_its_window asks group 0 for
    [0, 10) and group 1 for [8, 10) then [7, 8): one chain of 10 digests serves all three, and the
    keys from a shared chain are the keys computed alone."""
    disk = DiskTier(tmp_path, "ns", max_bytes=1 << 20)
    stack = stack_of(disk)
    request = make_request(range(300, 341), rid="hybrid")
    for group_id, blocks in {0: range(10), 1: range(0, 9)}.items():
        keys = stack.entry_keys(request, 0, 10, group_id)
        stack.submit([(keys[i], group_payload(group_id, i)) for i in blocks])
    stack.flush()
    digest_chains.clear()
    manager = KVCacheManager(64, CacheConfig(block_size=BS), tiers=stack, kv_cache_groups=HYBRID)
    admission = manager.admit(request, token_budget=100)
    assert admission.num_tier_tokens == 36
    assert sorted(loaded_payloads(manager, request)) == [(0, i) for i in range(9)] + [(1, 7), (1, 8)]
    assert digest_chains == [10]

    digests = stack.prefix_digests(make_request(range(300, 341), rid="other"), 10)
    for group_id in (0, 1):
        alone = stack.entry_keys(request, 7, 10, group_id)
        assert stack.entry_keys(request, 7, 10, group_id, digests) == alone
        assert [k.prefix_digest for k in alone] == digests[7:10]
    with pytest.raises(ValueError, match=r"digests: 9 prefix digests given, blocks \[7, 10\) need 10"):
        stack.entry_keys(request, 7, 10, 0, digests[:9])

    # Write-through of a computed hybrid prompt: 10 blocks in each of 2 groups, one chain.
    fresh = KVCacheManager(64, CacheConfig(block_size=BS), tiers=stack_of(), kv_cache_groups=HYBRID)
    first = make_request(range(600, 641), rid="first")
    assert fresh.admit(first, token_budget=100).num_new_tokens == 41
    digest_chains.clear()
    stores = fresh.take_tier_stores()
    assert len(stores) == 20 and digest_chains == [10]
    assert sorted(key.name for _, key in stores) == sorted(
        k.name for g in (0, 1) for k in stack.entry_keys(first, 0, 10, g))


def test_hybrid_blocks_loaded_from_redis_are_promoted_to_disk_per_group(tmp_path, redis_server):
    writer = stack_of(RedisTier(redis_server.url, "ns", ttl_s=60))
    request = make_request(range(300, 341), rid="w")
    for group_id in (0, 1):
        keys = writer.entry_keys(request, 0, 10, group_id)
        writer.submit([(k, group_payload(group_id, k.depth)) for k in keys])
    writer.flush()
    stack = stack_of(DiskTier(tmp_path, "ns", 1 << 20), RedisTier(redis_server.url, "ns", ttl_s=60))
    manager = KVCacheManager(64, CacheConfig(block_size=BS), tiers=stack, kv_cache_groups=HYBRID)
    assert manager.admit(make_request(range(300, 341), rid="r"), token_budget=100).num_tier_tokens == 40
    stack.flush()
    assert stack.snapshot()["disk"]["stores"] == 10 + 2  # group 0's chain and group 1's window
    redis_server.stop()
    restarted = stack_of(DiskTier(tmp_path, "ns", 1 << 20))
    again = KVCacheManager(64, CacheConfig(block_size=BS), tiers=restarted, kv_cache_groups=HYBRID)
    second = make_request(range(300, 341), rid="s")
    assert again.admit(second, token_budget=100).num_tier_tokens == 40
    assert sorted(loaded_payloads(again, second)) == [(0, i) for i in range(10)] + [(1, 8), (1, 9)]
