"""The scheduler's view of the paged KV cache (vLLM v1's ``KVCacheManager`` contract).

The scheduler admits a waiting request with one call, and grows a running one with another::

    admission = manager.admit(request, token_budget)   # lookup, partial hit, allocate, stats
    if admission is None: ...                          # the pool can't hold it: wait
    new_blocks = manager.allocate_slots(request, num_new_tokens)
    if new_blocks is None: ...                         # preempt someone, then retry

``free(request)`` releases everything when it finishes or is preempted; ``end_step()`` after each
forward pass. ``admit`` is built from three calls that tests and tools may also use one by one:
``get_computed_blocks`` (the longest verified cached prefix, in full blocks), ``get_partial_hit``
(a cached full block whose first ``k < block_size`` tokens are the request's next tokens: its first
``k`` slots are copied into the request's first new block before the forward pass) and
``allocate_slots`` with those hits::

    | full-block hits | k copied | computed now ... |
                      ^ first new block: slots [0, k) copied from the partial hit

With KV tiers (``tiers``, :mod:`prefixcache.cache.tiers`), the lookup goes on past the pool's last
hit into the tiers, in chain order, up to the first miss; the loaded blocks are allocated and
cached like computed ones, and a :class:`LoadOp` per block has the runner write their K/V before
the forward pass (no partial hit then)::

    | pool hits | tier hits (LoadOp) | computed now ... |

Blocks computed in a step are stored to the tiers after it (:meth:`take_tier_stores`, write-through).

Parallel sampling (``n > 1``) forks a request once its prompt is computed: ``fork(parent, child)``
gives the child the parent's whole block table by reference (``ref_cnt += 1``, zero copy). The
prompt's full blocks stay shared for good; the last, partial block is shared until a sequence
writes to it: ``allocate_slots`` then gives that sequence a fresh block and appends a
:class:`CopyOp` of the slots written so far (copy-on-write). The last holder writes in place.

Invariants:
- ``req_to_blocks[id]`` is the request's block table: block ``i`` holds the K/V of its tokens
  ``[i * block_size, (i + 1) * block_size)``, and it covers every token allocated so far.
- ``req_to_num_cached_blocks[id]`` blocks at the head of that table have been through caching: each
  is in the prefix-cache map, or an equal block already was. Then (one prefix, one cached copy)
  the request chains its later blocks to that one and holds a reference on it
  (``req_to_pinned[id][i]``) until :meth:`end_step`, when it replaces the request's own copy in the
  table (the K/V of both is the same prefix's) and the copy is freed. A block is cached once its
  tokens are all known (its hash exists on the request).
- ``ref_cnt`` of a block = the block tables holding it + the requests pinning it (within a step)
  + a partial hit's pin of its source (until :meth:`end_step`).
- A lookup never returns the block holding the request's last token, so at least one token is
  computed and yields logits.
- ``admit`` and ``allocate_slots`` either do everything asked for or change nothing.
- A partial hit's sources (one block per KV-cache group) are cached in an earlier step (their K/V
  is written) and stay pinned (``ref_cnt`` held) from its admission until ``end_step``, so nothing
  evicts them before the copy.
  The copied tokens plus the full hits still leave the last prompt token to compute.

KV-cache groups (``kv_cache_groups``, :mod:`prefixcache.cache.kv_cache_groups`; vLLM v1's hybrid
allocator): with one group (every full-attention model) nothing below applies and every block id is
what it was before groups. With more, ``req_to_blocks`` is group 0's table (full attention) and
``req_to_group_blocks[id][g - 1]`` group ``g``'s, as long, block ``i`` of each holding the same tokens;
an entry is ``None`` (a null block: the runner passes block id 0, which no query reads) where a
sliding group no longer needs the block. One pool serves all groups (a block holds one group's
layers). Each group's full blocks are cached under
:func:`~prefixcache.cache.kv_cache_groups.group_block_hash` with group 0's block of the same position
as parent (its anchor, see :mod:`prefixcache.cache.block_pool`)::

    group 0 (full)     | b0 | b1 | b2 | b3 | b4 | b5 |    every block of the context
    group g (window 8) |null|null| s2 | s3 | s4 | s5 |    blocks 0-1 released: next token at 21,
                                                           block_size 4, reads keys 14..21

- Hit length (:meth:`_hybrid_hits`, vLLM's ``HybridKVCacheCoordinator``): the longest block-aligned
  ``L <= `` group 0's verified hit such that each full group has its blocks of ``[0, L)`` and each
  sliding group the blocks covering ``[L - window + 1, L)`` cached, each verified against group 0's
  hit block of its position; each group proposes its longest such ``L`` no longer than the current
  one (a sliding group scanning right to left for a run of ``ceil((window - 1) / block_size)``
  blocks, vLLM's ``SlidingWindowManager.find_longest_cache_hit``), until none lowers it.
- Release (:meth:`remove_skipped_blocks`, vLLM's ``remove_skipped_blocks``): a sliding group's
  blocks wholly before ``num_computed_tokens - window + 1`` are freed (still hit-able until evicted)
  and their entries become ``None``, after every step (the scheduler calls it, as it calls
  ``end_step``), so a running sequence holds at most ``window`` + 2 blocks' worth of tokens per
  sliding group between steps.
- Retention (so hits don't collapse when the pool fills; vLLM's hybrid-SWA hits fell to 0 % without
  it): a sliding group's block freed among the last ``ceil(window / block_size) + 1`` blocks before
  the end of a cached prefix of its request (the end of its sequence when it is freed, the end of its
  cache hit, the end of its prompt: where a later request's hit ends) goes to the pool's retained
  queue, evicted after every other free block; its other released blocks are freed as usual. The
  idea is SGLang's SWA radix cache's (a prefix's sliding-window part is evicted on its own, and a
  match needs the window before its end) kept within one pool and one eviction order.
- Partial hit (:meth:`get_partial_hit`): group 0's cached block after the full hits, as with one
  group, and each other group's cached block attached to it (a sliding group's too, which it holds
  there when that block was retained or not yet evicted); its first ``k`` slots are copied into each
  group's first new block. A group without such a block, or a full hit the rule above cut (the
  cutting group lacks that very block), means no partial hit.
- KV tiers (:meth:`_load_hybrid_from_tiers`): each group's blocks are stored and loaded as entries
  of their own, keyed by the group's ``group_block_hash``. The tiers go on from the pool hit the rule
  above gives (``n``) to the longest ``m`` the same rule allows over pool and tier together: a full
  group loads its blocks of ``[n, m)``, a sliding group those of ``[m - need, m)`` (its pool hits
  hold the rest of that window); its entries before the window at ``m`` stay ``None`` and take no
  pool block (no query reads them, nothing writes them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.cache.block import KVCacheBlock, matching_token_blocks, verified_chain_length
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.kv_cache_groups import KVCacheGroup, KVCacheGroups, group_block_hash, single_group
from prefixcache.cache.metrics import PrefixCacheSnapshot, PrefixCacheStats
from prefixcache.cache.pins import PinResult, PinTable, pinned_budget
from prefixcache.scheduler_output import CopyOp, LoadOp

if TYPE_CHECKING:
    from prefixcache.cache.tiers.entry import EntryKey
    from prefixcache.cache.tiers.stack import KVTierStack, TierLoad
    from prefixcache.prompt_logprobs import BlockPromptLogprobs
    from prefixcache.request import Request

__all__ = ["Admission", "CopyOp", "KVCacheManager", "NULL_BLOCK_ID", "PartialHit"]

# The block id the runner gets where a group's table entry is None (a released sliding-window block):
# the block tables' padding id; no query reads it (it lies outside every window).
NULL_BLOCK_ID = 0


@dataclass(frozen=True, slots=True)
class PartialHit:
    """A cached full block whose first ``num_tokens`` slots hold the request's next tokens' K/V.

    Attributes:
        block: group 0's cached block.
        num_tokens: ``1 <= num_tokens < block_size``.
        group_blocks: with several KV-cache groups, groups ``1..``'s cached blocks of the same
            position attached to ``block`` (one per group, in group order); ``()`` with one group.
    """

    block: KVCacheBlock
    num_tokens: int
    group_blocks: tuple[KVCacheBlock, ...] = ()

    @property
    def sources(self) -> tuple[KVCacheBlock, ...]:
        """The source block of every group, group 0's first."""
        return (self.block, *self.group_blocks)


@dataclass(frozen=True, slots=True)
class Admission:
    """What :meth:`KVCacheManager.admit` did.

    Attributes:
        num_hit_tokens: tokens served from cached full blocks (``len * block_size``).
        num_partial_tokens: tokens copied from a partial hit, after the full blocks.
        num_new_tokens: tokens to compute in this step, after those.
        new_blocks: the blocks allocated for the tier hits and the new tokens (not the pool hits).
        num_tier_tokens: tokens loaded from KV tiers, after the pool hits (then no partial hit).
    """

    num_hit_tokens: int
    num_partial_tokens: int
    num_new_tokens: int
    new_blocks: list[KVCacheBlock]
    num_tier_tokens: int = 0


def _held(tables: Sequence[Sequence[KVCacheBlock | None]] | None) -> list[KVCacheBlock]:
    """The blocks of some groups' tables, without the released (``None``) entries."""
    return [b for table in tables or () for b in table if b is not None]


class KVCacheManager:
    """Allocates KV-cache blocks to requests and finds their cached prefixes.

    Args:
        num_blocks: blocks in the pool, ``>= 1``.
        config: the cache options, taken whole (``block_size`` must match the requests' hasher).
        bytes_per_block: KV bytes of one block over all layers (for ``cost`` and ``cached_bytes``).
        clock: current time in seconds (``time.monotonic``; a virtual clock in simulations).
        tiers: KV tiers below the pool, or ``None``.
        kv_cache_groups: the model's KV-cache groups; ``None``: one group of full attention.

    Raises:
        ValueError: ``num_blocks < 1``; InvalidInputError: a bad config field.
    """

    def __init__(
        self,
        num_blocks: int,
        config: CacheConfig | None = None,
        *,
        bytes_per_block: int = 0,
        clock: Callable[[], float] = time.monotonic,
        tiers: KVTierStack | None = None,
        kv_cache_groups: KVCacheGroups | None = None,
    ) -> None:
        config = config or CacheConfig()
        config.validate()
        self.kv_cache_groups = kv_cache_groups or single_group(1)
        self.is_hybrid = self.kv_cache_groups.is_hybrid
        self._extra_groups: tuple[KVCacheGroup, ...] = self.kv_cache_groups.groups[1:]
        # Groups 1.. (hybrid models only): request id -> one table per group, as long as
        # req_to_blocks[id]; None where a sliding group released the block.
        self.req_to_group_blocks: dict[str, list[list[KVCacheBlock | None]]] = {}
        # (group id, block index) -> the cached block the request holds in place of its own copy
        # until end_step (req_to_pinned's rule, per group).
        self.req_to_group_pinned: dict[str, dict[tuple[int, int], KVCacheBlock]] = {}
        # request id -> (its cache hit's end, its prompt's end), in full blocks: retention points.
        self._retain_points: dict[str, tuple[int, int]] = {}
        self.config = config
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.enable_partial_block_reuse = config.enable_partial_block_reuse
        self.block_pool = BlockPool(num_blocks, config, bytes_per_block=bytes_per_block, clock=clock)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_num_cached_blocks: dict[str, int] = {}
        # Equal blocks cached before the request's own, found this step (one prefix, one cached
        # copy): block index -> the cached block the request holds and chains its later blocks to;
        # it replaces the request's own copy at end_step.
        self.req_to_pinned: dict[str, dict[int, KVCacheBlock]] = {}
        self.stats = PrefixCacheStats()
        # Blocks cached since the last end_step (block id -> generation): K/V not written yet.
        self._cached_this_step: dict[int, int] = {}
        # Partial-hit sources pinned until end_step, and the copies the runner must do.
        self._pinned_sources: list[KVCacheBlock] = []
        self.pending_copy_ops: list[CopyOp] = []
        self.num_cow_forks = 0  # fork() calls
        self.num_cow_copies = 0  # blocks copied on first write
        self.tiers = tiers
        # Tier loads for the runner, and blocks cached this step by computing them (request, block
        # index, block, generation, group id): stored to the tiers once the step has written their K/V.
        self.pending_load_ops: list[LoadOp] = []
        self._tier_stores: list[tuple[Request, int, KVCacheBlock, int, int]] = []
        # Cache breakpoints' pins (cache/pins.py): one reference each, at most the budget's blocks.
        self.pins = PinTable(self.block_pool.touch, self.block_pool.free_blocks,
                             pinned_budget(config.max_pinned_fraction, num_blocks) if self.enable_caching else 0,
                             clock)

    # -- admission ------------------------------------------------------------------------------

    def admit(self, request: Request, token_budget: int, num_lookahead_tokens: int = 0) -> Admission | None:
        """Admits a waiting request: takes its longest cached prefix and allocates for the rest.

        The one admission sequence: :meth:`get_computed_blocks` → :meth:`get_partial_hit` →
        :meth:`allocate_slots` with both → on the request's first admission, the stats are recorded
        and ``request.num_cached_tokens`` is set (a readmission after preemption may reuse its own
        still-cached blocks, but that recompute is neither a query nor a hit). Sets
        ``request.num_computed_tokens`` to the tokens served from the cache.

        Args:
            request: a request with no blocks (new, or preempted and freed).
            token_budget: tokens it may compute in this step, ``>= 1``.
            num_lookahead_tokens: slots to allocate beyond those (a simulation allocating a
                known reply at once), ``>= 0``.

        Returns:
            What was done, or ``None`` when the pool can't hold it now (nothing changed).
        """
        hits, num_hit = self.get_computed_blocks(request)
        tier_load = None
        if request.sampling_params.prompt_logprobs is None:
            tier_load = self._load_from_tiers(request, len(hits))
            partial = None if tier_load is not None and tier_load.payloads else self.get_partial_hit(request, hits)
        else:  # a hit must also serve the block's prompt logprobs (prefixcache/prompt_logprobs.py)
            n = next((i for i, b in enumerate(hits) if b.prompt_logprobs is None), len(hits))
            hits, num_hit, partial = hits[:n], n * self.block_size, None
        group_hits, group_loads = None, []
        if self.is_hybrid:  # what every group serves
            num_group0_hits = len(hits)
            hits, group_hits = self._hybrid_hits(request, hits)
            num_hit = len(hits) * self.block_size
            if len(hits) < num_group0_hits:
                # The partial hit was found after group 0's hits. Where a group cut the hit, that group
                # lacks block len(hits) itself (else its hit would reach one block further), so no
                # partial hit can start there either.
                partial = None
            if request.sampling_params.prompt_logprobs is None:  # the tiers go on from what every group serves
                tier_load, group_hits, group_loads = self._load_hybrid_from_tiers(request, hits, group_hits)
                if tier_load is not None and tier_load.payloads:
                    partial = None
        num_tier = len(tier_load.payloads) * self.block_size if tier_load is not None else 0
        num_partial = partial.num_tokens if partial is not None else 0
        num_new = min(request.num_tokens - num_hit - num_tier - num_partial, token_budget)
        new_blocks = self.allocate_slots(request, num_tier + num_new + num_lookahead_tokens, hits, num_hit, partial,
                                         group_hits, num_loaded_tokens=num_tier)
        if new_blocks is None and partial is not None:
            # The partial hit's source is pinned while its tokens are copied, so it is one block the
            # allocation can't take: a prompt that needs the whole pool never fit with it (and waited
            # forever). Without it the tokens are computed instead.
            partial, num_partial = None, 0
            num_new = min(request.num_tokens - num_hit - num_tier, token_budget)
            new_blocks = self.allocate_slots(request, num_tier + num_new + num_lookahead_tokens, hits, num_hit,
                                             new_group_blocks=group_hits, num_loaded_tokens=num_tier)
        if new_blocks is None and not self.req_to_blocks and self.pins.yield_all():
            # Nothing runs and pins hold the room this request needs: they yield (cache/pins.py).
            partial, num_partial = None, 0
            num_new = min(request.num_tokens - num_hit - num_tier, token_budget)
            new_blocks = self.allocate_slots(request, num_tier + num_new + num_lookahead_tokens, hits, num_hit,
                                             new_group_blocks=group_hits, num_loaded_tokens=num_tier)
        if new_blocks is None:
            return None
        if self.is_hybrid:
            # a later request's hit ends where this one's did, tier blocks included
            self._retain_points[request.request_id] = ((num_hit + num_tier) // self.block_size,
                                                       request.num_prompt_tokens // self.block_size)
        self.pins.refresh(hits)
        if num_tier:
            self._add_load_ops(new_blocks, tier_load.payloads, request, group_loads)
        if request.num_cached_tokens is None:  # first admission
            request.num_cached_tokens = num_hit + num_tier + num_partial
            self.stats.record(request.num_tokens, num_hit, num_partial, num_tier)
            if tier_load is not None:
                self.tiers.record_admission(tier_load)
                request.cached_tier_tokens = {name: got * self.block_size for name, _, got in tier_load.per_tier if got}
        request.num_computed_tokens = num_hit + num_tier + num_partial
        return Admission(num_hit, num_partial, num_new, new_blocks, num_tier)

    def _load_from_tiers(self, request: Request, num_hit_blocks: int):
        """The request's blocks after its pool hits that the KV tiers hold (verified), as many as
        the free blocks can take; ``None`` without tiers or caching."""
        if self.tiers is None or not self.enable_caching or self.is_hybrid:  # hybrid: _load_hybrid_from_tiers
            return None
        max_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        stop = min(max_blocks, num_hit_blocks + self.block_pool.get_num_free_blocks() - 1)
        return self.tiers.load_chain(request, num_hit_blocks, stop)

    def _load_hybrid_from_tiers(
        self, request: Request, hits: list[KVCacheBlock], group_hits: list[list[KVCacheBlock | None]]
    ) -> tuple[TierLoad | None, list[list[KVCacheBlock | None]], list[tuple[int, int, memoryview]]]:
        """The KV tiers' part of a hybrid model's hit: blocks ``[n, m)`` after the pool's ``n`` hits
        (:meth:`_hybrid_hits`), each group's entries keyed by its own
        :func:`~prefixcache.cache.kv_cache_groups.group_block_hash`.

        The tier hit ends at the largest ``m`` every group serves, the pool hit's rule: a full group
        loads every block of ``[n, m)``; a sliding group only those of ``[m - need, m)`` (``need =
        num_window_blocks``), its pool hits covering the rest of that window (they cover ``[n - need,
        n)``). Group 0's chain is loaded first; then each group lowers ``m`` to its first missing (or
        unverifiable) block of what it needs, until none does. Entries are loaded once each.

        Returns:
            ``(load, tables, group_loads)``: ``load`` group 0's payloads of ``[n, m)`` (``None``
            without tiers or caching), ``tables`` the pool hits with a sliding group's entries before
            its window at ``m`` set to ``None`` (released: no query reads them), ``group_loads``
            ``(group id, block index, payload)`` of groups 1.. to write once their blocks are
            allocated.
        """
        if self.tiers is None or not self.enable_caching:
            return None, group_hits, []
        bs, n = self.block_size, len(hits)
        max_blocks = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        # every group may take a new block per loaded position; one position's worth stays for the compute
        stop = min(max_blocks, n + self.block_pool.get_num_free_blocks() // self.kv_cache_groups.num_groups - 1)
        # every group's keys share the prefix digests of blocks [0, stop): one sha256 chain per lookup
        digests = self.tiers.prefix_digests(request, stop) if stop > n else None
        load = self.tiers.load_chain(request, n, stop, digests=digests)
        m = n + len(load.payloads)
        got: dict[tuple[int, int], memoryview | None] = {}  # (group id, block index) -> payload, None: a miss

        def first_missing(group_id: int, lo: int, hi: int) -> int | None:
            i = lo
            while i < hi:
                if (group_id, i) in got:
                    if got[(group_id, i)] is None:
                        return i
                    i += 1
                    continue
                j = i
                while j < hi and (group_id, j) not in got:
                    j += 1
                found = self.tiers.load_chain(request, i, j, group_id, digests).payloads
                got.update(((group_id, i + k), p) for k, p in enumerate(found))
                if i + len(found) < j:
                    got[(group_id, i + len(found))] = None
                    return i + len(found)
                i = j
            return None

        def window_start(group: KVCacheGroup, end: int) -> int:
            need = group.num_window_blocks(bs)
            return n if need is None else max(n, end - need)

        changed = True
        while changed and m > n:  # to the fixed point: each group's answer only lowers m
            changed = False
            for group in self._extra_groups:
                miss = first_missing(group.group_id, window_start(group, m), m)
                if miss is not None:
                    m, changed = miss, True
        if m <= n:
            return load.cut(0), group_hits, []
        tables = []
        for group, table in zip(self._extra_groups, group_hits):
            start = group.num_skipped_blocks(m * bs, bs)
            tables.append([None if i < start else b for i, b in enumerate(table)])
        group_loads = [(group.group_id, i, got[(group.group_id, i)])
                       for group in self._extra_groups for i in range(window_start(group, m), m)]
        return load.cut(m - n), tables, group_loads

    def _add_load_ops(
        self, new_blocks: list[KVCacheBlock], payloads: list, request: Request | None = None,
        group_loads: Sequence[tuple[int, int, memoryview]] = (),
    ) -> None:
        """Has the runner write the loaded K/V into the first new blocks (cached by allocation) and,
        for groups 1.., into the request's blocks ``group_loads`` name; they are not stored back to
        the tiers."""
        loaded = new_blocks[: len(payloads)]
        ops = [LoadOp(b.block_id, p) for b, p in zip(loaded, payloads)]
        if group_loads:
            tables = self.req_to_group_blocks[request.request_id]
            ops += [LoadOp(tables[g - 1][i].block_id, p) for g, i, p in group_loads]
        self.pending_load_ops += ops
        ids = {op.block_id for op in ops}
        self._tier_stores = [s for s in self._tier_stores if s[2].block_id not in ids]

    def take_tier_stores(self) -> list[tuple[int, EntryKey]]:
        """The blocks this step computed and cached, to store to the KV tiers now that the step
        has written their K/V: ``(block id, entry key)`` each. Call after the forward pass, before
        :meth:`end_step`; empty without tiers."""
        stores, self._tier_stores = self._tier_stores, []
        by_request: dict[tuple[str, int], list[tuple[int, KVCacheBlock]]] = {}  # (request, group) -> blocks
        requests, ends = {}, {}  # request id -> the request, the end of its blocks stored (any group)
        for request, index, block, generation, group_id in stores:
            if block.generation == generation and block.block_hash is not None:  # still cached
                by_request.setdefault((request.request_id, group_id), []).append((index, block))
                requests[request.request_id] = request
                ends[request.request_id] = max(ends.get(request.request_id, 0), index + 1)
        # a request's groups share its prefix digests: one sha256 chain per request
        digests = {rid: self.tiers.prefix_digests(request, ends[rid]) for rid, request in requests.items()}
        out = []
        for (rid, group_id), items in by_request.items():
            first = min(i for i, _ in items)
            keys = self.tiers.entry_keys(requests[rid], first, max(i for i, _ in items) + 1, group_id, digests[rid])
            out += [(block.block_id, keys[index - first]) for index, block in items]
        return out

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Finds the longest verified cached prefix of the request, in full blocks.

        The last token is never served from the cache, so at most
        ``(request.num_tokens - 1) // block_size`` blocks are returned. Neither ref counts nor
        stats change.

        Args:
            request: a request with no blocks allocated yet.

        Returns:
            ``(blocks, num_computed_tokens)`` with ``num_computed_tokens = len(blocks) *
            block_size``; ``([], 0)`` when caching is disabled.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        # Fast path, the usual case: one cached copy per hash. Collect those blocks, then verify
        # their tokens (one bytes compare), the eviction policy's veto and their chain.
        pool = self.block_pool
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        for block in map(pool.sole_cached_block.get, request.block_hashes[:max_blocks]):
            if block is None:
                break
            append(block)
        # Stopped at a hash with several cached copies, not at a miss or the end.
        several = len(blocks) < max_blocks and request.block_hashes[len(blocks)] in pool.cached_block_hash_to_block
        n = matching_token_blocks(blocks, request.token_bytes, bs)
        if pool.evictor.refuses_hits:
            n = next((i for i, block in enumerate(blocks[:n]) if not pool.evictor.is_hit_allowed(block)), n)
        if n < len(blocks):  # the only copy of block n doesn't verify: a miss there
            del blocks[n:]
            several = False
        # int4: blocks holding a generated token carry the output key too (a re-admitted request's own)
        hasher = request.block_hasher
        first_output = hasher.first_output_block(request.num_prompt_tokens)
        output_key = b"" if first_output is None else hasher.output_key(request.num_prompt_tokens)
        n = verified_chain_length(blocks, None, request.root_key, request.tenant_key, request.num_shared_blocks,
                                  first_output, output_key)
        if n < len(blocks) or not several:
            return blocks[:n], n * bs
        return self._find_longest_chain(request, blocks, max_blocks)

    def _find_longest_chain(
        self, request: Request, blocks: list[KVCacheBlock], max_blocks: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The lookup's general path, from where the fast path stopped at several copies of a block.

        All verified copies matched at block ``i - 1`` are candidate parents at block ``i``
        (duplicates each carry their own chain); any block of the deepest level, followed back
        along its parents, is a longest verified prefix.
        """
        bs = self.block_size
        tokens = request.all_token_ids
        matches: list[KVCacheBlock] | None = blocks[-1:] or None
        for i in range(len(blocks), max_blocks):
            level = self.block_pool.find_cached_blocks(
                request.block_hashes[i], tokens[i * bs : (i + 1) * bs], matches, request.root_key,
                request.block_extra_key(i),
            )
            if not level:
                break
            matches = level
        chain: list[KVCacheBlock] = []
        block = matches[0] if matches else None
        while block is not None:
            chain.append(block)
            block = block.parent
        chain.reverse()
        return chain, len(chain) * bs

    def _hybrid_hits(
        self, request: Request, hits: list[KVCacheBlock]
    ) -> tuple[list[KVCacheBlock], list[list[KVCacheBlock | None]]]:
        """Cuts group 0's verified hits to what every group serves (the module docstring's hit rule).

        Args:
            request: the request being admitted.
            hits: group 0's verified hit blocks (any head of them is a hit too).

        Returns:
            ``(hits[:n], tables)``: ``tables[g - 1]`` is group ``g``'s ``n`` entries, ``None`` before
            the window a sliding group needs at ``n * block_size``. No ref count changes.
        """
        bs, pool = self.block_size, self.block_pool
        found: dict[tuple[int, int], KVCacheBlock | None] = {}

        def cached(group: KVCacheGroup, i: int) -> KVCacheBlock | None:
            key = (group.group_id, i)
            if key not in found:  # verified against group 0's hit of the same position, its anchor
                found[key] = pool.get_cached_block(
                    group_block_hash(request.block_hashes[i], group.group_id),
                    request.all_token_ids[i * bs : (i + 1) * bs], hits[i], request.root_key,
                    request.block_extra_key(i))
            return found[key]

        n, changed = len(hits), True
        while changed:  # to the fixed point: each group's answer only lowers n
            changed = False
            for group in self._extra_groups:
                m = self._group_hit_length(group, n, cached)
                if m < n:
                    n, changed = m, True
        tables = []
        for group in self._extra_groups:
            start = group.num_skipped_blocks(n * bs, bs)
            tables.append([None] * start + [cached(group, i) for i in range(start, n)])
        return hits[:n], tables

    def _group_hit_length(
        self, group: KVCacheGroup, n: int, cached: Callable[[KVCacheGroup, int], KVCacheBlock | None]
    ) -> int:
        """The longest ``m <= n`` (in blocks) that ``group`` serves: a full group, every block of
        ``[0, m)`` cached; a sliding one, the ``num_window_blocks`` before ``m`` (or all of ``[0, m)``
        when fewer), found right to left as vLLM's ``SlidingWindowManager`` does."""
        need = group.num_window_blocks(self.block_size)
        if need is None:
            m = 0
            while m < n and cached(group, m) is not None:
                m += 1
            return m
        if need == 0:
            return n
        run = 0
        for i in range(n - 1, -1, -1):
            if cached(group, i) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                return i + run
        return run  # a run from block 0, shorter than the window: all it needs

    def get_partial_hit(
        self, request: Request, computed_blocks: Sequence[KVCacheBlock]
    ) -> PartialHit | None:
        """Finds a cached full block that starts with the request's tokens after its full hits.

        The block must be a verified child of ``computed_blocks[-1]`` (or a chain root with the
        request's root key), cached before this step, and leave the last token to compute. With
        several KV-cache groups, every other group must also hold a cached block at that position,
        attached to it and cached before this step (a sliding group's too: the first token computed
        reads the copied slots within its window); a candidate lacking one is skipped, and with none
        left there is no partial hit. The sliding groups' windows before the position are the full
        hits' (:meth:`_hybrid_hits`): pass ``computed_blocks`` uncut, and drop the partial hit if
        that rule cuts them. No side effect.

        Args:
            request: a request with no blocks allocated yet.
            computed_blocks: its hits from :meth:`get_computed_blocks`.

        Returns:
            The partial hit, or ``None`` (also when caching or partial reuse is off).
        """
        if not (self.enable_caching and self.enable_partial_block_reuse):
            return None
        start = len(computed_blocks) * self.block_size
        end = min(start + self.block_size - 1, request.num_tokens - 1)
        if end <= start:
            return None
        extra_key = request.block_extra_key(len(computed_blocks))

        def unusable(block: KVCacheBlock) -> bool:
            if self._cached_this_step.get(block.block_id) == block.generation:  # K/V not written yet
                return True
            return self.is_hybrid and self._partial_group_blocks(request, block, extra_key) is None

        found = self.block_pool.find_partial_block(
            computed_blocks[-1] if computed_blocks else None,
            request.root_key,
            request.all_token_ids[start:end],
            exclude=unusable,
            extra_key=extra_key,
        )
        if found is None:
            return None
        block, num_tokens = found
        group_blocks = self._partial_group_blocks(request, block, extra_key) if self.is_hybrid else ()
        return PartialHit(block, num_tokens, group_blocks)

    def _partial_group_blocks(
        self, request: Request, anchor: KVCacheBlock, extra_key: bytes
    ) -> tuple[KVCacheBlock, ...] | None:
        """Groups 1..'s cached blocks attached to group 0's cached block ``anchor`` (verified as a
        full hit's are, against ``anchor``), one per group, each cached before this step; ``None``
        when a group has none."""
        out = []
        for group in self._extra_groups:
            block = self.block_pool.get_cached_block(
                group_block_hash(anchor.block_hash, group.group_id), anchor.token_ids, anchor, request.root_key,
                extra_key)
            if block is None or self._cached_this_step.get(block.block_id) == block.generation:
                return None
            out.append(block)
        return tuple(out)

    # -- allocation -----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        partial_hit: PartialHit | None = None,
        new_group_blocks: Sequence[Sequence[KVCacheBlock | None]] | None = None, *, num_loaded_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Adds blocks for ``num_new_tokens`` more tokens, taking the cache hits first.

        Token ranges of the request::

            | num_computed_tokens | new computed (hits) | num_new_tokens (computed now) |
            |<------------------ covered by the block table afterwards -------------->|

        Full blocks are cached as soon as they are allocated, before the forward pass writes
        their K/V: the engine writes all K/V of a step before any attention reads, so a request
        scheduled later in the same step may already hit them (as in vLLM v1).

        Args:
            request: the request; ``request.num_computed_tokens`` is not changed here.
            num_new_tokens: tokens to compute in this step, ``>= 0``.
            new_computed_blocks: hits from :meth:`get_computed_blocks`, only for a request with
                no blocks yet, passed right after the lookup.
            num_new_computed_tokens: tokens those hits cover (``len * block_size``).
            partial_hit: from :meth:`get_partial_hit`, right after the lookup. Its tokens come
                after the full hits and before ``num_new_tokens``; its blocks (one per group) are
                pinned until :meth:`end_step` and a :class:`CopyOp` per group, into that group's
                first new block, is appended to ``pending_copy_ops``.
            new_group_blocks: groups ``1..``'s hits (:meth:`_hybrid_hits`); each gets as many new blocks.
            num_loaded_tokens: the first of ``num_new_tokens`` KV tiers load (:meth:`_loaded_null_blocks`).

        A running request whose next token lands in a block it shares with a forked sequence
        (``ref_cnt > 1``) first gets a private copy of that block (copy-on-write: one more block,
        a :class:`CopyOp` of its written slots, one reference less on the source).

        Returns:
            The newly allocated blocks (not the hits, not a copy-on-write block), or ``None`` if the
            pool has too few free blocks, in which case nothing changed.

        Raises:
            ValueError: ``num_new_tokens < 0``, hits given for a request that already has blocks,
                ``num_new_computed_tokens`` inconsistent with the hits, or a bad ``partial_hit``.
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_partial = self._check_allocation(request, req_blocks, num_new_tokens, new_computed_blocks,
                                             num_new_computed_tokens, partial_hit, new_group_blocks)
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_partial + num_new_tokens
        num_required = -(-num_total_tokens // self.block_size)
        num_held = len(req_blocks) if req_blocks else 0
        num_new_blocks = max(0, num_required - num_held - len(new_computed_blocks))
        # Hits (and a partial-hit source) among the free blocks stop being allocatable once touched.
        pinned = [*new_computed_blocks, *(partial_hit.sources if partial_hit else ()), *_held(new_group_blocks)]
        num_free_hits = sum(1 for b in pinned if b.ref_cnt == 0)
        # Copy-on-write: the block receiving this step's first token is shared with a fork.
        cow_index = request.num_computed_tokens // self.block_size
        cow = bool(req_blocks) and num_new_tokens > 0 and cow_index < num_held and req_blocks[cow_index].ref_cnt > 1
        num_null = self._loaded_null_blocks(request, len(new_computed_blocks), num_loaded_tokens)
        num_group_blocks = self._num_group_blocks_needed(request, num_new_blocks, num_new_tokens > 0) - sum(num_null)
        if num_new_blocks + cow + num_group_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        if cow:
            self._copy_on_write(request, req_blocks, cow_index)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.req_to_num_cached_blocks[request.request_id] = len(new_computed_blocks)
        if pinned:
            self.block_pool.record_hits(pinned)
            self.block_pool.touch(pinned)  # before allocating: hits must not be evicted
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        self._allocate_group_blocks(request, num_new_blocks, new_group_blocks, num_new_tokens > 0, num_null)
        if partial_hit is not None:
            self._copy_partial_hit(request, partial_hit, len(new_computed_blocks))
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_total_tokens)
        return new_blocks

    def _copy_partial_hit(self, request: Request, partial_hit: PartialHit, index: int) -> None:
        """Pins the partial hit's sources until :meth:`end_step` and has the runner copy each group's
        first ``num_tokens`` slots into that group's block ``index`` (its first new block)."""
        # Unpinned other groups first, as free() orders a position (evicted no later than group 0's).
        self._pinned_sources += [*partial_hit.group_blocks, partial_hit.block]
        dsts = [self.req_to_blocks[request.request_id][index],
                *(table[index] for table in self.req_to_group_blocks.get(request.request_id, ()))]
        self.pending_copy_ops += [CopyOp(src.block_id, dst.block_id, partial_hit.num_tokens)
                                  for src, dst in zip(partial_hit.sources, dsts)]

    def _check_allocation(
        self,
        request: Request,
        req_blocks: list[KVCacheBlock] | None,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_new_computed_tokens: int,
        partial_hit: PartialHit | None,
        new_group_blocks: Sequence[Sequence[KVCacheBlock | None]] | None = None,
    ) -> int:
        """Validates :meth:`allocate_slots`' arguments; returns the partial hit's token count."""
        rid = request.request_id
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if self.is_hybrid and new_computed_blocks and new_group_blocks is None:
            raise ValueError("new_group_blocks are needed with cache hits when there are several KV-cache groups")
        if new_group_blocks is not None and (len(new_group_blocks) != len(self._extra_groups) or any(
                len(hits) != len(new_computed_blocks) for hits in new_group_blocks)):
            raise ValueError(f"new_group_blocks must hold {len(self._extra_groups)} lists of "
                             f"{len(new_computed_blocks)} entries (one per KV-cache group after group 0)")
        if new_computed_blocks:
            if req_blocks:
                raise ValueError(f"request {rid!r} already has blocks; cache hits are for admission")
            if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
                raise ValueError(
                    f"num_new_computed_tokens ({num_new_computed_tokens}) must equal "
                    f"{len(new_computed_blocks)} hit blocks * block_size {self.block_size}"
                )
        elif num_new_computed_tokens != 0:
            raise ValueError("num_new_computed_tokens given without new_computed_blocks")
        if partial_hit is None:
            return 0
        if req_blocks:
            raise ValueError(f"request {rid!r} already has blocks; partial hits are for admission")
        if len(partial_hit.group_blocks) != len(self._extra_groups):
            raise ValueError(f"partial_hit.group_blocks must hold {len(self._extra_groups)} blocks (one per "
                             f"KV-cache group after group 0), got {len(partial_hit.group_blocks)}")
        if not 1 <= partial_hit.num_tokens < self.block_size or num_new_tokens < 1:
            raise ValueError(
                f"partial hit of {partial_hit.num_tokens} tokens needs 1 <= tokens < block_size "
                f"{self.block_size} and num_new_tokens >= 1"
            )
        return partial_hit.num_tokens

    def _num_group_blocks_needed(self, request: Request, num_new_blocks: int, writes: bool) -> int:
        """Free blocks groups 1.. take besides their hits: ``num_new_blocks`` each, and (``writes``) a
        copy-on-write of the block receiving the next token where it is shared; 0 with one group."""
        if not self.is_hybrid:
            return 0
        num = num_new_blocks * len(self._extra_groups)  # (their hits are counted with group 0's)
        cow_index = request.num_computed_tokens // self.block_size
        for table in self.req_to_group_blocks.get(request.request_id, []) if writes else []:
            if cow_index < len(table) and table[cow_index] is not None and table[cow_index].ref_cnt > 1:
                num += 1
        return num

    def _loaded_null_blocks(self, request: Request, num_hit_blocks: int, num_loaded_tokens: int) -> list[int]:
        """Per group 1.., how many of an admission's first new blocks (KV tier loads, from block
        ``num_hit_blocks`` on) lie wholly before the group's window at the loads' end: a sliding
        group gets no block there (``None``), as no query reads them and nothing would write them.
        All 0 without loads or with one group.

        Raises:
            ValueError: ``num_loaded_tokens`` is negative or not whole blocks.
        """
        bs = self.block_size
        if num_loaded_tokens < 0 or num_loaded_tokens % bs:
            raise ValueError(f"num_loaded_tokens must be whole blocks (a multiple of {bs}), got {num_loaded_tokens}")
        if not (self.is_hybrid and num_loaded_tokens):
            return [0] * len(self._extra_groups)
        end = request.num_computed_tokens + (num_hit_blocks * bs) + num_loaded_tokens
        return [max(0, min(num_loaded_tokens // bs, group.num_skipped_blocks(end, bs) - num_hit_blocks))
                for group in self._extra_groups]

    def _allocate_group_blocks(
        self, request: Request, num_new_blocks: int, hits: Sequence[Sequence[KVCacheBlock | None]] | None,
        writes: bool, num_null: Sequence[int] = (),
    ) -> None:
        """Groups 1..'s part of :meth:`allocate_slots` once it is known to fit and their hits are
        touched (with group 0's, before any block is allocated: a hit among the free blocks must not
        be handed out): copy-on-write of the block receiving the next token, the hits, ``num_new_blocks``
        new blocks each, the first ``num_null[g - 1]`` of them ``None`` (see :meth:`_loaded_null_blocks`).
        No-op with one group."""
        if not self.is_hybrid:
            return
        hits = hits if hits is not None else [() for _ in self._extra_groups]
        rid = request.request_id
        tables = self.req_to_group_blocks.get(rid)
        if tables is None:
            tables = self.req_to_group_blocks[rid] = [[] for _ in self._extra_groups]
        cow_index = request.num_computed_tokens // self.block_size
        num_null = num_null or [0] * len(self._extra_groups)
        for group, table, group_hits, null in zip(self._extra_groups, tables, hits, num_null):
            if writes and cow_index < len(table) and table[cow_index] is not None and table[cow_index].ref_cnt > 1:
                self._copy_on_write(request, table, cow_index, group.group_id)
            table.extend(group_hits)
            table.extend([None] * null)
            table.extend(self.block_pool.get_new_blocks(num_new_blocks - null, group.group_id))

    def _copy_on_write(self, request: Request, req_blocks: list[KVCacheBlock], index: int, group_id: int = 0) -> None:
        """Gives the request a private copy of its shared block ``index`` of group ``group_id``'s
        table ``req_blocks`` (written slots copied)."""
        shared = req_blocks[index]
        (copy,) = self.block_pool.get_new_blocks(1, group_id)
        req_blocks[index] = copy
        # Drop this request's reference now, so the last holder writes in place. Even if the
        # source reaches ref_cnt 0 and is reallocated this step, its copy runs first: the runner
        # does the copies in order, before the forward pass writes any K/V.
        self.block_pool.free_blocks([shared])
        self.pending_copy_ops.append(
            CopyOp(shared.block_id, copy.block_id, request.num_computed_tokens % self.block_size)
        )
        self.num_cow_copies += 1

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_total_tokens: int) -> None:
        """Caches the request's blocks that became full, chaining each to the previous one's
        cached block; an equal block cached before stands for the request's own (pinned)."""
        rid, bs = request.request_id, self.block_size
        num_full = min(num_total_tokens // bs, len(request.block_hashes))
        num_cached = self.req_to_num_cached_blocks[rid]
        if num_full <= num_cached:
            return
        pinned = self.req_to_pinned.get(rid, {})
        parent = None if num_cached == 0 else pinned.get(num_cached - 1, req_blocks[num_cached - 1])
        anchors = [] if self.is_hybrid else None
        for i in range(num_cached, num_full):
            block = req_blocks[i]
            if block.block_hash is None:
                cached = self.block_pool.cache_block(
                    block, request.block_hashes[i], request.all_token_ids[i * bs : (i + 1) * bs], parent,
                    request.root_key, request.block_extra_key(i),
                )
                if cached is block:
                    self._cached_this_step[block.block_id] = block.generation
                    if self.tiers is not None:
                        self._tier_stores.append((request, i, block, block.generation, 0))
                else:  # held until end_step, then it replaces the request's own copy
                    self.block_pool.record_hits([cached])
                    self.block_pool.touch([cached])
                    pinned = self.req_to_pinned.setdefault(rid, pinned)
                    pinned[i] = cached
                    block = cached
            parent = block
            if anchors is not None:
                anchors.append(block)
        self.req_to_num_cached_blocks[rid] = num_full
        if anchors:
            self._cache_group_blocks(request, num_cached, anchors)

    def _cache_group_blocks(self, request: Request, first: int, anchors: list[KVCacheBlock]) -> None:
        """Caches groups 1..'s blocks ``first ..`` that became full, each on group 0's cached block of
        its position (``anchors``); an equal block cached before stands for the request's own until
        :meth:`end_step`, as in group 0."""
        rid, bs = request.request_id, self.block_size
        for group, table in zip(self._extra_groups, self.req_to_group_blocks[rid]):
            for i, anchor in enumerate(anchors, start=first):
                block = table[i]
                if block is None or block.block_hash is not None:  # released, or a hit
                    continue
                cached = self.block_pool.cache_block(
                    block, group_block_hash(request.block_hashes[i], group.group_id),
                    request.all_token_ids[i * bs : (i + 1) * bs], anchor, request.root_key, request.block_extra_key(i))
                if cached is block:
                    self._cached_this_step[block.block_id] = block.generation
                    if self.tiers is not None:  # each group's entry under its own key
                        self._tier_stores.append((request, i, block, block.generation, group.group_id))
                else:
                    self.block_pool.record_hits([cached])
                    self.block_pool.touch([cached])
                    self.req_to_group_pinned.setdefault(rid, {})[(group.group_id, i)] = cached

    # -- step and request lifecycle -------------------------------------------------------------

    def end_step(self) -> None:
        """Marks the step's K/V as written.

        A request that recomputed a block already cached at the same place in the chain now takes
        the cached block into its table in place of its own copy, which is freed (one prefix, one
        cached copy, and no block held twice past the step). Partial-hit sources are unpinned and
        the pending copies forgotten.
        """
        for rid, pinned in self.req_to_pinned.items():
            table = self.req_to_blocks[rid]
            own = [table[i] for i in sorted(pinned, reverse=True)]  # tail first, as free() does
            for i, cached in pinned.items():
                table[i] = cached
            self.block_pool.free_blocks(own)
        self.req_to_pinned.clear()
        for rid, group_pinned in self.req_to_group_pinned.items():
            tables = self.req_to_group_blocks[rid]
            own = []
            for (group_id, i), cached in sorted(group_pinned.items(), key=lambda item: -item[0][1]):
                own.append(tables[group_id - 1][i])
                tables[group_id - 1][i] = cached
            self.block_pool.free_blocks(own)
        self.req_to_group_pinned.clear()
        sources, self._pinned_sources = self._pinned_sources, []
        self.block_pool.free_blocks(sources)
        self._cached_this_step.clear()
        self.pending_copy_ops = []
        self.pending_load_ops = []
        self._tier_stores = []

    def forget_step(self) -> None:
        """After a failed step: evicts the blocks cached in it (their K/V was never written, or only
        partly) and unpins partial-hit sources. The step's requests are failed and freed next
        (which releases the cached blocks they hold in place of their own copies)."""
        blocks = self.block_pool.blocks
        self.block_pool.uncache(
            blocks[i] for i, generation in self._cached_this_step.items() if blocks[i].generation == generation
        )
        sources, self._pinned_sources = self._pinned_sources, []
        self.block_pool.free_blocks(sources)
        self._cached_this_step.clear()
        self.pending_copy_ops = []
        self.pending_load_ops = []
        self._tier_stores = []

    def fork(self, parent: Request, child: Request) -> None:
        """Gives ``child`` the parent's block table by reference (parallel sampling).

        Every block gets one more reference; nothing is copied. The first write into a shared,
        not-yet-full block copies it (see :meth:`allocate_slots`).

        Raises:
            ValueError: the parent has no blocks or the child already has some.
        """
        blocks = self.req_to_blocks.get(parent.request_id)
        if not blocks:
            raise ValueError(f"request {parent.request_id!r} has no blocks to fork")
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"request {child.request_id!r} already has blocks")
        pinned = self.req_to_pinned.get(parent.request_id)
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        if pinned:
            self.block_pool.touch(pinned.values())
            self.req_to_pinned[child.request_id] = dict(pinned)
        self.req_to_num_cached_blocks[child.request_id] = self.req_to_num_cached_blocks[parent.request_id]
        if self.is_hybrid:
            tables = self.req_to_group_blocks.get(parent.request_id, [])
            self.block_pool.touch(b for table in tables for b in table if b is not None)
            self.req_to_group_blocks[child.request_id] = [list(table) for table in tables]
            group_pinned = self.req_to_group_pinned.get(parent.request_id)
            if group_pinned:
                self.block_pool.touch(group_pinned.values())
                self.req_to_group_pinned[child.request_id] = dict(group_pinned)
            if parent.request_id in self._retain_points:
                self._retain_points[child.request_id] = self._retain_points[parent.request_id]
        self.num_cow_forks += 1

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first (so tails are evicted before heads); a block
        it pinned in place of its own goes right after its own. Cached blocks stay hit-able until
        evicted. Unknown or already freed requests are ignored."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_num_cached_blocks.pop(request.request_id, None)
        pinned = self.req_to_pinned.pop(request.request_id, None)
        if self.is_hybrid:
            self._free_hybrid(request.request_id, blocks or [], pinned or {})
            return
        if not blocks:
            return
        if pinned:
            ordered = []
            for i in range(len(blocks) - 1, -1, -1):
                ordered.append(blocks[i])
                if i in pinned:
                    ordered.append(pinned[i])
            self.block_pool.free_blocks(ordered)
        else:
            self.block_pool.free_blocks(reversed(blocks))

    def _free_hybrid(self, rid: str, blocks: list[KVCacheBlock], pinned: dict[int, KVCacheBlock]) -> None:
        """free() with several groups: tail first, each position's blocks of the other groups right
        before group 0's (evicted no later than their anchor); a sliding group's blocks still held (the
        window at the end of the request's cached prefix) go to the retained queue."""
        tables = self.req_to_group_blocks.pop(rid, None) or [[] for _ in self._extra_groups]
        group_pinned = self.req_to_group_pinned.pop(rid, {})
        self._retain_points.pop(rid, None)
        ordered, retained = [], []
        for i in range(len(blocks) - 1, -1, -1):
            for group, table in zip(self._extra_groups, tables):
                block = table[i] if i < len(table) else None
                if block is None:
                    continue
                out = retained if group.is_sliding else ordered
                out.append(block)
                if (group.group_id, i) in group_pinned:
                    out.append(group_pinned[(group.group_id, i)])
            ordered.append(blocks[i])
            if i in pinned:
                ordered.append(pinned[i])
        self.block_pool.free_blocks(ordered)
        self.block_pool.free_blocks(retained, retain=True)

    def remove_skipped_blocks(self, request: Request) -> int:
        """Releases the sliding groups' blocks no query of the request reads again: those wholly
        before ``request.num_computed_tokens - window + 1`` (their entries become ``None``). A block
        among the last ``ceil(window / block_size) + 1`` before the request's cache-hit end or prompt
        end goes to the retained queue (see the module docstring), the others are freed as usual,
        tail first. Call after each step; no-op with one group.

        Returns:
            The number of blocks released.
        """
        tables = self.req_to_group_blocks.get(request.request_id)
        if not tables:
            return 0
        hit_end, prompt_end = self._retain_points.get(request.request_id, (0, 0))
        group_pinned = self.req_to_group_pinned.get(request.request_id, {})
        num_released = 0
        for group, table in zip(self._extra_groups, tables):
            num_skipped = min(group.num_skipped_blocks(request.num_computed_tokens, self.block_size), len(table))
            keep = group.num_retained_blocks(self.block_size)
            normal, retained = [], []
            for i in range(num_skipped - 1, -1, -1):
                block = table[i]
                if block is None:  # released before, with everything before it
                    break
                table[i] = None
                out = retained if hit_end - keep <= i < hit_end or prompt_end - keep <= i < prompt_end else normal
                out.append(block)
                pinned = group_pinned.pop((group.group_id, i), None)
                if pinned is not None:
                    out.append(pinned)
            self.block_pool.free_blocks(normal)
            self.block_pool.free_blocks(retained, retain=True)
            num_released += len(normal) + len(retained)
        return num_released

    def store_prompt_logprobs(self, request: Request, block_index: int, data: BlockPromptLogprobs) -> bool:
        """Keeps a prompt block's prompt logprobs with the cached block that now holds its K/V.

        Args:
            request: a running request whose block ``block_index`` is a full prompt block.
            block_index: the block's index in the request's block table.
            data: the entries of its tokens and its last hidden state.

        Returns:
            Whether they were stored: False when the block is not cached (caching off, or it was
            dropped) or already has some (a hit, or another request's identical block).
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        if block_index >= len(blocks):
            return False
        block = blocks[block_index]
        if block.block_hash is None or block.prompt_logprobs is not None:
            return False
        block.prompt_logprobs = data
        return True

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (a copy; the blocks themselves are shared, read them only);
        ``[]`` for an unknown request. Named as vLLM v1's ``KVCacheManager.get_blocks``."""
        return list(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (group 0's); ``[]`` for an unknown request."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of every KV-cache group, group 0 first, each as long as group 0's,
        :data:`NULL_BLOCK_ID` where a sliding group released the block; ``[[]]`` (one group) or ``[]``
        entries for an unknown request."""
        out = [self.get_block_ids(request_id)]
        for table in self.req_to_group_blocks.get(request_id, [[] for _ in self._extra_groups]):
            out.append([NULL_BLOCK_ID if b is None else b.block_id for b in table])
        return out

    # -- cache control --------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (pins included); refused (``False``) while a request holds a block."""
        if not self.req_to_blocks and not self._pinned_sources:
            self.pins.yield_all()
        if self.block_pool.reset_prefix_cache():
            self._cached_this_step.clear()
            return True
        return False

    def sweep_expired(self) -> int:
        """Releases the pins idle longer than their ttl, then evicts the free cached blocks the
        policy has expired; returns how many blocks were evicted. Once per step (lazy expiry)."""
        self.pins.release_expired()
        return self.block_pool.sweep_expired()

    def invalidate_chains(self, is_stale_root: Callable[[bytes], bool]) -> int:
        """Evicts the free cached blocks of chains whose root key is stale (their pins released
        first: nobody can hit them); returns how many."""
        def stale(block: KVCacheBlock) -> bool:
            while block.parent is not None:
                block = block.parent
            return is_stale_root(block.root_key)

        self.pins.release_where(stale)
        return self.block_pool.invalidate_chains(is_stale_root)

    def pin_prefix(self, request: Request) -> tuple[PinResult, ...]:
        """Pins the prefixes of the request's cache breakpoints (``request.cache_breakpoints``):
        for each, the full blocks before its position, for its ttl (:mod:`prefixcache.cache.pins`).
        Call once its prompt is computed (the blocks are cached and their K/V written).

        Returns:
            One result per breakpoint (in position order): the tokens pinned within the budget.
            Sets ``request.pinned`` to them.
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_cached = self.req_to_num_cached_blocks.get(request.request_id, 0)
        results = []
        for bp in request.cache_breakpoints:
            num_blocks = min(bp.num_tokens // self.block_size, num_cached, len(blocks))
            num_pinned = self.pins.pin(blocks[:num_blocks], bp.ttl_s) if self.enable_caching else 0
            if self.is_hybrid and num_pinned:
                num_pinned = self._pin_group_blocks(request.request_id, num_pinned, bp.ttl_s)
            results.append(PinResult(bp, num_pinned * self.block_size))
        request.pinned = tuple(results)
        return request.pinned

    def _pin_group_blocks(self, rid: str, num_blocks: int, ttl_s: float) -> int:
        """Pins, beside group 0's first ``num_blocks``, what the other groups need for a hit there: a
        full group's blocks of ``[0, num_blocks)``, a sliding group's window before it, if the request
        still holds them (cached). Returns how many leading blocks are hit-able with the pins: those of
        group 0, or 0 when a group's part could not be pinned (a window released, or the budget)."""
        bs = self.block_size
        for group, table in zip(self._extra_groups, self.req_to_group_blocks.get(rid, [])):
            start = group.num_skipped_blocks(num_blocks * bs, bs)
            needed = table[start:num_blocks]
            if any(b is None or b.block_hash is None for b in needed) or self.pins.pin(needed, ttl_s) < len(needed):
                return 0
        return num_blocks

    def make_snapshot(self) -> PrefixCacheSnapshot:
        """The cache's counters and the pool's state, frozen."""
        pool, stats, evictions = self.block_pool, self.stats, self.block_pool.eviction_stats
        num_free = pool.get_num_free_blocks()
        return PrefixCacheSnapshot(
            num_requests=stats.num_requests,
            num_hit_requests=stats.num_hit_requests,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_evictions=evictions.num_evictions,
            num_blocks_total=pool.num_blocks,
            num_blocks_in_use=pool.num_blocks - num_free,
            num_blocks_cached=pool.num_cached_blocks,
            num_blocks_free=num_free,
            prefix_cache_partial_hits=stats.partial_hits,
            prefix_cache_tier_hits=stats.tier_hits,
            evictions_by_reason=dict(evictions.evictions_by_reason),
            cached_bytes=pool.cached_bytes,
            mean_evicted_age_s=evictions.mean_evicted_age_s,
            num_forks=self.num_cow_forks,
            num_cow_copies=self.num_cow_copies,
        )

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in ``[0, 1]``."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated (free cached blocks included)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently in the prefix-cache map."""
        return self.block_pool.num_cached_blocks

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(block_size={self.block_size}, requests={len(self.req_to_blocks)}, "
            f"{self.block_pool!r})"
        )
