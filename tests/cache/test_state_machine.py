"""Stateful property test of KVCacheManager + BlockPool against a model of the KV content.

The model records, for every block, which prefix (root key + tokens) its K/V was computed for when
a request wrote it. A lookup is correct iff every hit block's recorded prefix equals the request's
own prefix up to the end of that block; this oracle does not trust the hash map at all. The test
runs once with the real hash and once with a hash that maps every block to the same value (C4),
and once per non-default eviction policy with a virtual clock. Admissions also take partial-block
hits (the oracle checks the copied slots' prefix) and every step ends with ``end_step``. After every
step: children before parents (no cached block outlives its cached parent).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache.cache.hashing import BlockHasher, make_root_key, pack_token_ids, tenant_extra_key
from tests.cache.cache_test_utils import make_manager
from prefixcache.request import Request
from prefixcache.sampling_params import SamplingParams

B = 4
NUM_BLOCKS = 8
ALPHABET = st.integers(0, 1)  # tiny alphabet: shared prefixes and equal blocks are common
SALTS = st.sampled_from([None, None, None, "s"])
TENANTS = st.sampled_from([None, None, "t", "u"])  # with 0-2 leading blocks of an approved prefix
# Prompts built from a few whole blocks share prefixes and differ at later blocks very often.
_BLOCKS = st.sampled_from([(0, 0, 0, 0), (0, 0, 0, 1), (1, 1, 1, 1)])
PROMPTS = st.one_of(
    st.lists(ALPHABET, min_size=1, max_size=14),
    st.builds(
        lambda blocks, tail: [t for b in blocks for t in b] + tail,
        st.lists(_BLOCKS, max_size=3),
        st.lists(ALPHABET, min_size=1, max_size=3),
    ),
)


class CollidingHasher(BlockHasher):
    """Every root and every block hashes to the same value."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self._digest = lambda data: b"\0" * 8


class KVCacheMachine(RuleBasedStateMachine):
    hasher_cls: type[BlockHasher] = BlockHasher
    policy: str = "lru"

    @initialize()
    def setup(self) -> None:
        self.hasher = self.hasher_cls(B)
        self.now = 0.0
        self.manager = make_manager(
            NUM_BLOCKS, B, eviction_policy=self.policy, cache_ttl_s=5.0, clock=lambda: self.now
        )
        self.running: dict[str, Request] = {}
        # block id -> (root key, computed prefix, writer's extra key for that block)
        self.content: dict[int, tuple[bytes, tuple[int, ...], bytes]] = {}
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------------------------

    def make_request(self, prompt: list[int], salt: str | None, tenant: str | None, shared: int) -> Request:
        self.next_id += 1
        return Request(
            f"r{self.next_id}", prompt, SamplingParams(max_tokens=64, temperature=0),
            self.hasher, make_root_key(b"test-model", salt),
            tenant_key=tenant_extra_key(tenant), num_shared_blocks=shared,
        )

    def write(self, request: Request, num_new_tokens: int) -> None:
        """The forward pass: the step's slot copies, then K/V for the request's next tokens, then
        the step's end (``end_step``), in the engine's order.

        A block the request already wrote part of (its own earlier tokens, a partial-hit copy or
        a copy-on-write copy) must hold exactly the request's tokens before ``start``: a sibling
        sample writing into a shared block without copying it first is caught here.
        """
        for op in self.manager.pending_copy_ops:
            root, prefix, extra = self.content[op.src_block_id]
            block_start = (len(prefix) - 1) // B * B
            self.content[op.dst_block_id] = (root, prefix[: block_start + op.num_tokens], extra)
        start = request.num_computed_tokens
        end = start + num_new_tokens
        table = self.manager.req_to_blocks[request.request_id]
        if start % B:
            j = start // B
            expected = (request.root_key, tuple(request.all_token_ids[:start]), request.block_extra_key(j))
            assert self.content[table[j].block_id] == expected, "a write lands in a block holding other K/V"
        for j in range(start // B, -(-end // B)):
            prefix = tuple(request.all_token_ids[: min(end, (j + 1) * B)])
            self.content[table[j].block_id] = (request.root_key, prefix, request.block_extra_key(j))
        request.num_computed_tokens = end
        self.manager.end_step()

    def check_hits(self, request: Request, hits, num_hit_tokens: int) -> None:
        assert num_hit_tokens == len(hits) * B
        assert num_hit_tokens <= request.num_tokens - 1
        for i, block in enumerate(hits):
            expected = (request.root_key, tuple(request.all_token_ids[: (i + 1) * B]), request.block_extra_key(i))
            assert self.content[block.block_id] == expected, f"hit {i} serves wrong K/V or crosses a tenant"

    def pick(self, index: int) -> Request:
        return list(self.running.values())[index % len(self.running)]

    # -- rules ------------------------------------------------------------------------------------

    @rule(prompt=PROMPTS, salt=SALTS, tenant=TENANTS, shared=st.integers(0, 2), chunk=st.integers(1, 16))
    def admit(self, prompt, salt, tenant, shared, chunk) -> None:
        """The scheduler's admission (``KVCacheManager.admit``); its hits checked by the oracle."""
        request = self.make_request(prompt, salt, tenant, shared)
        # The lookup alone has no side effect and finds what the admission takes.
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        self.check_hits(request, hits, num_hit_tokens)
        before = [b.ref_cnt for b in self.manager.block_pool.blocks]
        admission = self.manager.admit(request, chunk)
        if admission is None:
            assert [b.ref_cnt for b in self.manager.block_pool.blocks] == before
            assert request.request_id not in self.manager.req_to_blocks
            assert request.num_cached_tokens is None
            return
        assert admission.num_hit_tokens == num_hit_tokens
        assert self.manager.req_to_blocks[request.request_id][: len(hits)] == hits
        k = admission.num_partial_tokens
        if k:
            (op,) = [op for op in self.manager.pending_copy_ops if op.dst_block_id == admission.new_blocks[0].block_id]
            assert 1 <= k < B and num_hit_tokens + k <= request.num_tokens - 1 and op.num_tokens == k
            root, prefix, extra = self.content[op.src_block_id]
            end = num_hit_tokens + k
            assert root == request.root_key and prefix[:end] == tuple(request.all_token_ids[:end])
            assert extra == request.block_extra_key(num_hit_tokens // B), "partial hit crosses a tenant"
        assert request.num_cached_tokens == num_hit_tokens + k == request.num_computed_tokens
        assert admission.num_new_tokens == min(chunk, request.num_tokens - num_hit_tokens - k)
        self.write(request, admission.num_new_tokens)
        self.running[request.request_id] = request

    @rule(prompts=st.lists(PROMPTS, min_size=1, max_size=3), salt=SALTS, chunk=st.integers(1, 16),
          index=st.integers(0, 50), cont=st.booleans())
    def failed_step(self, prompts, salt, chunk, index, cont) -> None:
        """A step whose forward pass raises: what LLMEngine does (forget_step, then its requests are
        failed and freed). Nothing it cached may be hit afterwards (the oracle checks every hit)."""
        batch = []
        prefilling = [r for r in self.running.values() if r.num_computed_tokens < r.num_tokens]
        if cont and prefilling:
            r = prefilling[index % len(prefilling)]
            if self.manager.allocate_slots(r, min(chunk, r.num_tokens - r.num_computed_tokens)) is not None:
                batch.append(r)
        for prompt in prompts:
            request = self.make_request(prompt, salt, None, 0)
            if self.manager.admit(request, chunk) is not None:
                batch.append(request)
        self.manager.forget_step()
        for r in batch:
            self.manager.free(r)
            self.running.pop(r.request_id, None)

    @rule(prompt=PROMPTS, salt=SALTS, k=st.integers(2, 3))
    def same_step_batch(self, prompt, salt, k) -> None:
        """k equal prompts admitted in one step (each after the others' blocks were cached), written,
        then the step ends: recomputed equal blocks are swapped for the cached ones."""
        admitted = []
        for _ in range(k):
            request = self.make_request(prompt, salt, None, 0)
            admission = self.manager.admit(request, request.num_tokens)
            if admission is None:
                break
            admitted.append((request, admission.num_new_tokens))
        for op in self.manager.pending_copy_ops:
            root, prefix, extra = self.content[op.src_block_id]
            block_start = (len(prefix) - 1) // B * B
            self.content[op.dst_block_id] = (root, prefix[: block_start + op.num_tokens], extra)
        for request, num_new_tokens in admitted:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
            table = self.manager.req_to_blocks[request.request_id]
            for j in range(start // B, -(-end // B)):
                prefix = tuple(request.all_token_ids[: min(end, (j + 1) * B)])
                self.content[table[j].block_id] = (request.root_key, prefix, request.block_extra_key(j))
            request.num_computed_tokens = end
            self.running[request.request_id] = request
        self.manager.end_step()

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running.values()))
    @rule(index=st.integers(0, 50), chunk=st.integers(1, 16))
    def continue_prefill(self, index, chunk) -> None:
        prefilling = [r for r in self.running.values() if r.num_computed_tokens < r.num_tokens]
        request = prefilling[index % len(prefilling)]
        num_new_tokens = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self.manager.allocate_slots(request, num_new_tokens) is not None:
            self.write(request, num_new_tokens)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running.values()))
    @rule(index=st.integers(0, 50), token=ALPHABET)
    def decode(self, index, token) -> None:
        decoding = [r for r in self.running.values() if r.num_computed_tokens == r.num_tokens]
        request = decoding[index % len(decoding)]
        # The sampled token of the last step is appended, then one slot is allocated for it.
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1) is None:  # preempted by the scheduler
            self.manager.free(request)
            del self.running[request.request_id]
            return
        self.write(request, 1)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running.values()))
    @rule(index=st.integers(0, 50), n=st.integers(1, 3))
    def fork(self, index, n) -> None:
        """Parallel sampling: n more samples share the request's blocks (copy-on-write)."""
        done = [r for r in self.running.values() if r.num_computed_tokens == r.num_tokens]
        parent = done[index % len(done)]
        before = [b.ref_cnt for b in self.manager.req_to_blocks[parent.request_id]]
        for i in range(n):
            self.next_id += 1
            child = parent.fork(f"r{self.next_id}", parent.sampling_params, i + 1)
            self.manager.fork(parent, child)
            self.running[child.request_id] = child
        after = [b.ref_cnt for b in self.manager.req_to_blocks[parent.request_id]]
        assert after == [c + n for c in before]

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 50))
    def free(self, index) -> None:
        request = self.pick(index)
        self.manager.free(request)
        del self.running[request.request_id]
        self.manager.free(request)  # idempotent

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 50), extra=st.lists(ALPHABET, min_size=1, max_size=3))
    def probe_running_prefix(self, index, extra) -> None:
        """A running request's cached blocks are pinned, so its own prefix must be found."""
        owner = self.pick(index)
        probe = Request("probe", owner.all_token_ids[: owner.num_computed_tokens] + extra,
                        SamplingParams(temperature=0), self.hasher, owner.root_key,
                        tenant_key=owner.tenant_key, num_shared_blocks=owner.num_shared_blocks)
        hits, num_hit_tokens = self.manager.get_computed_blocks(probe)
        self.check_hits(probe, hits, num_hit_tokens)
        num_cached = self.manager.req_to_num_cached_blocks[owner.request_id]
        assert len(hits) >= min(num_cached, (probe.num_tokens - 1) // B)

    @rule(dt=st.sampled_from([0.5, 1.0, 10.0]))
    def advance_clock(self, dt) -> None:
        self.now += dt

    @rule()
    def sweep_expired(self) -> None:
        """The engine's per-step TTL sweep: expired blocks leave the cache, live ones stay."""
        pool = self.manager.block_pool
        before = pool.num_cached_blocks
        assert pool.sweep_expired() == before - pool.num_cached_blocks

    @rule(salt=SALTS, roll=st.integers(0, 4))
    def invalidate(self, salt, roll) -> None:
        """Invalidates every chain of one salt (as an adapter reload does for its digest)."""
        if roll != 0:
            return
        root = make_root_key(b"test-model", salt)
        pool = self.manager.block_pool
        pool.invalidate_chains(lambda root_key: root_key == root)
        for block in pool.blocks:
            if block.block_hash is not None and block.ref_cnt == 0 and block.num_cached_children == 0:
                chain_root = block
                while chain_root.parent is not None:
                    chain_root = chain_root.parent
                assert chain_root.root_key != root, f"{block} of a stale chain is still cached"

    @rule(roll=st.integers(0, 9))
    def reset(self, roll) -> None:
        if roll != 5:  # reset rarely, so the cache fills up and evicts
            return
        in_use = any(self.manager.req_to_blocks.values())
        assert self.manager.reset_prefix_cache() is (not in_use)
        if not in_use:
            assert self.manager.num_cached_blocks == 0

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def accounting(self) -> None:
        pool = self.manager.block_pool
        free = pool.evictor.get_all_free_blocks()
        in_use = [b for b in pool.blocks if b.ref_cnt > 0]
        assert len(free) + len(in_use) == NUM_BLOCKS == pool.get_num_free_blocks() + len(in_use)
        free_set = {b.block_id for b in free}
        assert len(free_set) == len(free)
        expected_refs = [0] * NUM_BLOCKS
        for table in self.manager.req_to_blocks.values():
            for block in table:
                expected_refs[block.block_id] += 1
        for pinned in self.manager.req_to_pinned.values():  # equal blocks held in place of their own
            for block in pinned.values():
                expected_refs[block.block_id] += 1
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == expected_refs[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in free_set)
        assert self.manager.usage == len(in_use) / NUM_BLOCKS

    @invariant()
    def hash_map(self) -> None:
        pool = self.manager.block_pool
        mapped = [(h, b) for h, same in pool.cached_block_hash_to_block.items() for b in same.values()]
        assert all(same for same in pool.cached_block_hash_to_block.values())
        assert len(mapped) == pool.num_cached_blocks
        # the lookup's fast-path index: exactly the hashes with one copy, mapped to that copy
        assert pool.sole_cached_block == {h: next(iter(same.values()))
                                          for h, same in pool.cached_block_hash_to_block.items() if len(same) == 1}
        assert {b.block_id for _, b in mapped} == {b.block_id for b in pool.blocks if b.block_hash is not None}
        for key, block in mapped:
            assert block.block_hash == key
            assert block.token_ids is not None and len(block.token_ids) == B
            assert block.token_bytes == pack_token_ids(block.token_ids)
            chain = [block]
            while chain[-1].parent is not None:
                chain.append(chain[-1].parent)
            chain.reverse()
            live = all(c.parent_generation == c.parent.generation for c in chain[1:])
            if not live:
                continue  # a stale chain can never be hit (generations only grow)
            assert chain[0].root_key is not None
            h = self.hasher.root_hash(chain[0].root_key)
            for c in chain:
                h = self.hasher.hash_block(h, c.token_ids, c.extra_key)
                assert c.block_hash == h
            # A live cached block holds the K/V of exactly its chain's tokens.
            tokens = tuple(t for c in chain for t in c.token_ids)
            assert self.content[block.block_id] == (chain[0].root_key, tokens, block.extra_key)

    @invariant()
    def block_tables(self) -> None:
        for rid, request in self.running.items():
            table = self.manager.req_to_blocks[rid]
            assert len(table) == -(-request.num_computed_tokens // B)
            num_cached = self.manager.req_to_num_cached_blocks[rid]
            assert num_cached == min(request.num_computed_tokens // B, len(request.block_hashes))
            pinned = self.manager.req_to_pinned.get(rid, {})
            for j, block in enumerate(table):
                end = min(request.num_computed_tokens, (j + 1) * B)
                assert self.content[block.block_id] == (
                    request.root_key, tuple(request.all_token_ids[:end]), request.block_extra_key(j))
                if j < num_cached:  # cached, or an equal block cached before stands for it (C12)
                    cached = pinned.get(j, block)
                    assert cached.block_hash == request.block_hashes[j]
                    assert j not in pinned or block.block_hash is None
                    assert self.content[cached.block_id] == self.content[block.block_id]
        assert set(self.manager.req_to_blocks) == set(self.running)

    @invariant()
    def children_before_parents(self) -> None:
        pool = self.manager.block_pool
        children = [0] * NUM_BLOCKS
        for block in pool.blocks:
            if block.block_hash is not None and block.parent is not None:
                assert block.parent.block_hash is not None, f"{block} outlived its parent"
                assert block.parent_generation == block.parent.generation, f"{block} is orphaned"
                children[block.parent.block_id] += 1
        assert [b.num_cached_children for b in pool.blocks] == children
        assert len(pool.evictor.get_all_free_blocks()) == pool.get_num_free_blocks()

    @invariant()
    def stats(self) -> None:
        s = self.manager.stats
        assert 0 <= s.hits <= s.queries and s.num_hit_requests <= s.num_requests


class CollidingKVCacheMachine(KVCacheMachine):
    hasher_cls = CollidingHasher


_settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = _settings
TestCollidingKVCacheMachine = CollidingKVCacheMachine.TestCase
TestCollidingKVCacheMachine.settings = _settings

_policy_settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
for _policy in ("lfu", "ttl", "cost"):
    _machine = type(f"{_policy.upper()}KVCacheMachine", (KVCacheMachine,), {"policy": _policy})
    _case = _machine.TestCase
    _case.settings = _policy_settings
    globals()[f"Test{_policy.upper()}KVCacheMachine"] = _case
del _policy, _machine, _case
