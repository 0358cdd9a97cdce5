"""The scheduler's view of the paged KV cache (vLLM v1's ``KVCacheManager`` contract).

The scheduler admits a request in two calls, back to back::

    blocks, num_hit_tokens = manager.get_computed_blocks(request)      # lookup, no side effect
    new_blocks = manager.allocate_slots(request, num_new_tokens, blocks, num_hit_tokens)
    if new_blocks is None: ...                                          # wait or preempt

and each later step of a running request calls ``allocate_slots(request, num_new_tokens)``.
``free(request)`` releases everything when it finishes or is preempted.

Partial-block reuse adds one call between the two: ``get_partial_hit(request, blocks)`` finds a
cached full block whose first ``k < block_size`` tokens are the request's next tokens; passed to
``allocate_slots`` it pins that block and the caller copies its first ``k`` slots into the
request's first new block before the forward pass, then calls ``end_step()`` once the step ran::

    | full-block hits | k copied | computed now ... |
                      ^ first new block: slots [0, k) copied from the partial hit

Parallel sampling (``n > 1``) forks a request once its prompt is computed: ``fork(parent, child)``
gives the child the parent's whole block table by reference (``ref_cnt += 1``, zero copy). The
prompt's full blocks stay shared for good; the last, partial block is shared until a sequence
writes to it: ``allocate_slots`` then gives that sequence a fresh block and appends a
:class:`CopyOp` of the slots written so far (copy-on-write). The last holder writes in place.

Invariants:
- ``req_to_blocks[id]`` is the request's block table: block ``i`` holds the K/V of its tokens
  ``[i * block_size, (i + 1) * block_size)``, and it covers every token allocated so far.
- ``num_cached_block[id]`` blocks at the head of that table are in the prefix-cache map (or were
  hits); a block is cached once its tokens are all known (its hash exists on the request).
- A lookup never returns the block holding the request's last token, so at least one token is
  computed and yields logits.
- ``allocate_slots`` either allocates everything asked for or changes nothing.
- A partial hit's source is cached in an earlier step (its K/V is written) and stays pinned
  (``ref_cnt`` held) from ``allocate_slots`` until ``end_step``, so nothing evicts it before the
  copy. The copied tokens plus the full hits still leave the last prompt token to compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixcache.cache.block_pool import BlockPool, KVCacheBlock
from prefixcache.cache.eviction import EvictionOptions, EvictionPolicy
from prefixcache.cache.metrics import PrefixCacheStats
from prefixcache.engine.request import Request


@dataclass(frozen=True, slots=True)
class PartialHit:
    """A cached full block whose first ``num_tokens`` slots hold the request's next tokens' K/V."""

    block: KVCacheBlock
    num_tokens: int  # 1 <= num_tokens < block_size


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy slots ``[0, num_tokens)`` of ``src_block_id`` into ``dst_block_id``, all layers, K and V."""

    src_block_id: int
    dst_block_id: int
    num_tokens: int


class KVCacheManager:
    """Allocates KV-cache blocks to requests and finds their cached prefixes.

    Args:
        num_blocks: blocks in the pool, ``>= 1``.
        block_size: tokens per block, ``>= 1``; must match the requests' block hasher.
        enable_caching: automatic prefix caching on or off.
        eviction_policy: name of a registered eviction policy (``lru``, ``lfu``, ``ttl``, ``cost``),
            or an :class:`EvictionPolicy` subclass (simulations).
        cache_ttl_s: idle time after which ``ttl`` expires a free cached block, seconds.
        bytes_per_block: KV bytes of one block over all layers (for ``cost`` and ``cached_bytes``).
        enable_partial_block_reuse: let :meth:`get_partial_hit` find partial hits.
        clock: current time in seconds (``time.monotonic``; a virtual clock in simulations).
        eviction_options: overrides ``cache_ttl_s`` and ``bytes_per_block`` when given.

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1`` or an unknown eviction policy.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        eviction_policy: str | type[EvictionPolicy] = "lru",
        *,
        cache_ttl_s: float = 300.0,
        bytes_per_block: int = 0,
        enable_partial_block_reuse: bool = True,
        clock: Callable[[], float] = time.monotonic,
        eviction_options: EvictionOptions | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_partial_block_reuse = enable_partial_block_reuse
        options = eviction_options or EvictionOptions(
            block_size=block_size, bytes_per_block=bytes_per_block, cache_ttl_s=cache_ttl_s
        )
        self.block_pool = BlockPool(num_blocks, enable_caching, eviction_policy, options, clock)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # Blocks cached since the last end_step (block id -> generation): K/V not written yet.
        self._cached_this_step: dict[int, int] = {}
        # Partial-hit sources pinned until end_step, and the copies the runner must do.
        self._pinned_sources: list[KVCacheBlock] = []
        self.pending_copy_ops: list[CopyOp] = []
        self.num_cow_forks = 0  # fork() calls
        self.num_cow_copies = 0  # blocks copied on first write

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Finds the longest verified cached prefix of the request, in full blocks.

        The last token is never served from the cache, so at most
        ``(request.num_tokens - 1) // block_size`` blocks are returned. Neither ref counts nor
        stats change; the caller records stats once per admission with ``stats.record``.

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
        tokens = request.all_token_ids
        hashes, root_key = request.block_hashes, request.root_key
        tenant_key, num_shared = request.tenant_key, request.num_shared_blocks
        pool = self.block_pool
        table, allowed = pool.cached_block_hash_to_block, pool.free_block_queue.is_hit_allowed
        # Fast path, the usual case: one cached copy per hash, verified inline as
        # BlockPool.find_cached_blocks does (tokens, parent at its generation or root key, extra key).
        blocks: list[KVCacheBlock] = []
        parent: KVCacheBlock | None = None
        i = 0
        while i < max_blocks:
            candidates = table.get(hashes[i])
            if candidates is None or len(candidates) != 1:
                break
            (block,) = candidates.values()
            if not (
                (block.parent is None and block.root_key == root_key if parent is None
                 else block.parent is parent and block.parent_generation == parent.generation)
                and block.extra_key == (tenant_key if i >= num_shared else b"")  # request.block_extra_key(i)
                and block.token_ids == tuple(tokens[i * bs : (i + 1) * bs])
                and allowed(block)
            ):
                return blocks, len(blocks) * bs  # the only copy doesn't verify: a miss
            blocks.append(block)
            parent = block
            i += 1
        if i == max_blocks or not table.get(hashes[i]):
            return blocks, len(blocks) * bs
        # Several copies of a block: all verified copies matched at block i-1 are candidate
        # parents at block i (duplicates each carry their own chain); any block of the deepest
        # level, followed back along its parents, is a longest verified prefix.
        matches: list[KVCacheBlock] | None = [parent] if parent is not None else None
        for i in range(i, max_blocks):
            level = self.block_pool.find_cached_blocks(
                hashes[i],
                tokens[i * bs : (i + 1) * bs],
                matches,
                root_key,
                request.block_extra_key(i),
            )
            if not level:
                break
            matches = level
        blocks = []
        if matches:
            block: KVCacheBlock | None = matches[0]
            while block is not None:
                blocks.append(block)
                block = block.parent
            blocks.reverse()
        return blocks, len(blocks) * bs

    def get_partial_hit(
        self, request: Request, computed_blocks: Sequence[KVCacheBlock]
    ) -> PartialHit | None:
        """Finds a cached full block that starts with the request's tokens after its full hits.

        The block must be a verified child of ``computed_blocks[-1]`` (or a chain root with the
        request's root key), cached before this step, and leave the last token to compute. No side
        effect.

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
        found = self.block_pool.find_partial_block(
            computed_blocks[-1] if computed_blocks else None,
            request.root_key,
            request.all_token_ids[start:end],
            exclude=lambda b: self._cached_this_step.get(b.block_id) == b.generation,
            extra_key=request.block_extra_key(len(computed_blocks)),
        )
        return None if found is None else PartialHit(*found)

    def end_step(self) -> None:
        """Marks the step's K/V as written: unpins partial-hit sources, forgets pending copies."""
        sources, self._pinned_sources = self._pinned_sources, []
        self.block_pool.free_blocks(sources)
        self._cached_this_step.clear()
        self.pending_copy_ops = []

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
        for block in blocks:
            block.ref_cnt += 1
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_block[child.request_id] = self.num_cached_block[parent.request_id]
        self.num_cow_forks += 1

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        partial_hit: PartialHit | None = None,
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
                after the full hits and before ``num_new_tokens``; its block is pinned until
                :meth:`end_step` and a :class:`CopyOp` into the first new block is appended to
                ``pending_copy_ops``.

        A running request whose next token lands in a block it shares with a forked sequence
        (``ref_cnt > 1``) first gets a private copy of that block (copy-on-write: one more block,
        a :class:`CopyOp` of its written slots, one reference less on the source).

        Returns:
            The newly allocated blocks (not the hits, not a copy-on-write block), or ``None`` if the
            pool has too few free blocks, in which case nothing changed.

        Raises:
            ValueError: ``num_new_tokens < 0``, hits given for a request that already has
                blocks, or ``num_new_computed_tokens`` inconsistent with the hits.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
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
        num_partial = 0
        if partial_hit is not None:
            if req_blocks:
                raise ValueError(f"request {rid!r} already has blocks; partial hits are for admission")
            num_partial = partial_hit.num_tokens
            if not 1 <= num_partial < self.block_size or num_new_tokens < 1:
                raise ValueError(
                    f"partial hit of {num_partial} tokens needs 1 <= tokens < block_size "
                    f"{self.block_size} and num_new_tokens >= 1"
                )

        num_blocks_held = len(req_blocks) if req_blocks else 0
        num_total_tokens = (
            request.num_computed_tokens + num_new_computed_tokens + num_partial + num_new_tokens
        )
        num_required = -(-num_total_tokens // self.block_size)
        num_new_blocks = max(0, num_required - num_blocks_held - len(new_computed_blocks))
        # Hits (and a partial-hit source) that sit in the free queue stop being allocatable once
        # touched.
        pinned = [*new_computed_blocks, *([partial_hit.block] if partial_hit else [])]
        num_free_hits = sum(1 for b in pinned if b.ref_cnt == 0)
        # Copy-on-write: the block receiving this step's first token is shared with a fork.
        cow_index = request.num_computed_tokens // self.block_size
        cow = (
            req_blocks is not None
            and num_new_tokens > 0
            and cow_index < len(req_blocks)
            and req_blocks[cow_index].ref_cnt > 1
        )
        if num_new_blocks + cow > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        if cow:
            shared = req_blocks[cow_index]
            (copy,) = self.block_pool.get_new_blocks(1)
            req_blocks[cow_index] = copy
            # Drop this request's reference now, so the last holder writes in place. Even if the
            # source reaches ref_cnt 0 and is reallocated this step, its copy runs first: the
            # runner does the copies in order, before the forward pass writes any K/V.
            self.block_pool.free_blocks([shared])
            self.pending_copy_ops.append(
                CopyOp(shared.block_id, copy.block_id, request.num_computed_tokens % self.block_size)
            )
            self.num_cow_copies += 1

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.num_cached_block[rid] = len(new_computed_blocks)
        if pinned:
            self.block_pool.record_hits(pinned)
            self.block_pool.touch(pinned)  # before allocating: hits must not be evicted
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if partial_hit is not None:
            self._pinned_sources.append(partial_hit.block)
            self.pending_copy_ops.append(
                CopyOp(partial_hit.block.block_id, new_blocks[0].block_id, num_partial)
            )

        if self.enable_caching:
            num_full_blocks = min(num_total_tokens // self.block_size, len(request.block_hashes))
            num_cached = self.num_cached_block[rid]
            if num_full_blocks > num_cached:
                self.block_pool.cache_full_blocks(
                    request, req_blocks, num_cached, num_full_blocks, self.block_size
                )
                for block in req_blocks[num_cached:num_full_blocks]:
                    self._cached_this_step[block.block_id] = block.generation
                self.num_cached_block[rid] = num_full_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first (so tails are evicted before heads).

        Cached blocks stay hit-able until evicted. Unknown or already freed requests are ignored.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids; ``[]`` for an unknown request."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache; refused (``False``) while any block is in use."""
        if self.block_pool.reset_prefix_cache():
            self._cached_this_step.clear()
            return True
        return False

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
