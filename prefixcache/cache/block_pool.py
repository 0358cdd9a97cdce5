"""The pool of KV-cache blocks: allocation, reference counts, eviction and the prefix-cache index.

The mechanics behind :class:`~prefixcache.cache.kv_cache_manager.KVCacheManager` (vLLM v1's
``block_pool.py``). A block holds the K/V of ``block_size`` consecutive tokens of one request.

Life of a block::

    free, uncached --get_new_blocks--> in use --cache_full_blocks--> in use, cached
          ^                                                              |
          |  (evicted lazily when popped)                     free_blocks (ref_cnt 0)
          |                                                              v
          +------------------- get_new_blocks <------------ free, cached (still hit-able)
                                                               | touch (cache hit)
                                                               v
                                                         in use, cached

Invariants (checked by ``tests/cache/test_state_machine.py`` after every step):
- ``ref_cnt >= 0``; a block is in the free queue (the eviction policy) iff its ``ref_cnt == 0``;
  ``num_free_blocks + num_blocks_in_use == num_blocks``.
- A block is in the hash map iff ``block_hash`` is set; then it is full and ``token_ids`` holds its
  ``block_size`` tokens. A block is evicted only when the policy chooses it (lazily, when a block
  is needed) or by :meth:`BlockPool.reset_prefix_cache`; eviction clears it and bumps
  ``generation``.
- A hit is exact whatever the hash function does: :meth:`BlockPool.get_cached_block` returns a block
  only if its stored tokens equal the request's tokens of that block *and* its predecessor is the
  block matched just before (same ``generation`` as when cached), or, for a first block, its
  ``root_key`` equals the request's; and its ``extra_key`` (tenant namespace) equals the request's
  for that block. By induction the whole prefix, and so the K/V, is the same, and a block beyond an
  approved shared prefix is only ever served within its tenant.
  Equal blocks may be cached more than once, each with its own parent chain.
- Children before parents: ``num_cached_children`` counts the cached blocks whose live parent is
  this block, and no policy evicts a block while it is non-zero, so every cached block's parent is
  cached at the recorded generation (no orphaned chains). ``cached_children`` indexes them by
  (parent, first token) for partial-block reuse.
- With ``lru`` (the default) the free queue is in LRU order: freed blocks go to the tail, eviction
  takes from the head. Callers free a request's blocks tail first, so a prefix's tail is evicted
  before its head. Other policies: see :mod:`prefixcache.cache.eviction`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.cache.eviction import EvictionOptions, EvictionPolicy, LRUPolicy, make_eviction_policy
from prefixcache.cache.hashing import BlockHash

if TYPE_CHECKING:
    from prefixcache.engine.request import Request


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV-cache block (the K/V itself lives in the runner's KV pool).

    Compared by identity (``eq=False``): two blocks are the same block only if they are the same
    object.

    Attributes:
        block_id: index of the block in the pool, ``0 <= block_id < num_blocks``.
        ref_cnt: number of running requests whose block table holds this block.
        block_hash: the chained hash of the block; set iff the block is full and cached.
        token_ids: the block's ``block_size`` tokens, stored when cached (verified on a hit).
        parent: the previous block of the chain when cached; ``None`` for a first block.
        parent_generation: ``parent.generation`` at caching time.
        root_key: for a chain's first block, the caching request's root key; else ``None``.
        extra_key: the caching request's extra key for this block (tenant namespace, or ``b""``).
        generation: bumped each time the block is evicted or reset, i.e. each time its content
            stops being what was cached.
        depth: blocks before this one in its chain when cached (0 for a first block).
        cached_s: when the block was cached (the pool's clock, seconds).
        num_cached_children: cached blocks whose live parent is this block.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    parent: KVCacheBlock | None = None
    parent_generation: int = 0
    root_key: bytes | None = None
    extra_key: bytes = b""
    generation: int = 0
    depth: int = 0
    cached_s: float = 0.0
    num_cached_children: int = 0

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}" if self.block_hash is not None else ""
        parent = f", parent={self.parent.block_id}" if self.parent is not None else ""
        return (
            f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}{cached}{parent}, "
            f"gen={self.generation})"
        )


# The LRU policy is vLLM's free queue; the old name is kept for callers and tests.
FreeKVCacheBlockQueue = LRUPolicy


class BlockPool:
    """Owns every KV-cache block, the free blocks (an eviction policy) and the prefix-cache map.

    Args:
        num_blocks: number of blocks in the pool, ``>= 1``.
        enable_caching: when ``False`` nothing is ever cached and every lookup misses.
        eviction_policy: a name registered in :data:`prefixcache.cache.eviction.EVICTION_POLICIES`,
            or an :class:`EvictionPolicy` subclass.
        eviction_options: the policies' knobs (``bytes_per_block`` also feeds ``cached_bytes``).
        clock: current time in seconds; ``time.monotonic`` by default, virtual in simulations.

    Raises:
        ValueError: ``num_blocks < 1`` or an unknown ``eviction_policy``.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction_policy: str | type[EvictionPolicy] = "lru",
        eviction_options: EvictionOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.eviction_policy = eviction_policy
        self.eviction_options = eviction_options or EvictionOptions()
        self.clock = clock
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # The free blocks, held by the eviction policy (name kept from vLLM's free queue).
        self.free_block_queue: EvictionPolicy = make_eviction_policy(
            eviction_policy, self.blocks, clock, self.eviction_options
        )
        # block hash -> {block_id: block}; several blocks may share a hash (two requests that
        # computed the same prefix in one step, or a hash collision).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # (parent block id, or root key for a first block; first token) -> {block_id: block}:
        # the cached children of a block, for partial-block reuse.
        self.cached_children: dict[tuple[int | bytes, int], dict[int, KVCacheBlock]] = {}
        self.num_cached_blocks = 0
        self.num_evictions = 0
        self.evictions_by_reason: dict[str, int] = {}
        self.evicted_age_s_total = 0.0  # sum over evictions of (eviction time - caching time)

    # -- lookup ---------------------------------------------------------------------------------

    def get_cached_block(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent: KVCacheBlock | None,
        root_key: bytes,
        extra_key: bytes = b"",
    ) -> KVCacheBlock | None:
        """Finds a cached block holding exactly ``token_ids`` after ``parent``'s prefix.

        Args:
            block_hash: the request's hash of this block.
            token_ids: the request's ``block_size`` tokens of this block.
            parent: the block matched for the previous block of the request; ``None`` for the
                first block.
            root_key: the request's root key (checked for a first block).
            extra_key: the request's extra key for this block (checked on every block).

        Returns:
            A verified block (see the module invariants), or ``None`` on a miss. Its ref count is
            not changed.
        """
        matches = self.find_cached_blocks(
            block_hash, token_ids, None if parent is None else [parent], root_key, extra_key
        )
        return matches[0] if matches else None

    def find_cached_blocks(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parents: Sequence[KVCacheBlock] | None,
        root_key: bytes,
        extra_key: bytes = b"",
    ) -> list[KVCacheBlock]:
        """Finds every cached block holding exactly ``token_ids`` after one of ``parents``.

        Equal blocks may be cached more than once (two requests that computed the same prefix in
        the same step); each copy has its own chain of parents, so a lookup keeps all the copies
        matched at one block as the candidate parents of the next, to find the longest prefix.

        Args:
            block_hash: the request's hash of this block.
            token_ids: the request's ``block_size`` tokens of this block.
            parents: the blocks matched for the previous block of the request; ``None`` for the
                first block.
            root_key: the request's root key (checked for a first block).
            extra_key: the request's extra key for this block (checked on every block).

        Returns:
            The verified blocks, in caching order; empty on a miss. Ref counts are not changed.
        """
        candidates = self.cached_block_hash_to_block.get(block_hash)
        if not candidates:
            return []
        token_ids = tuple(token_ids)
        allowed = self.free_block_queue.is_hit_allowed
        if parents is None:
            return [
                b
                for b in candidates.values()
                if b.token_ids == token_ids
                and b.parent is None
                and b.root_key == root_key
                and b.extra_key == extra_key
                and allowed(b)
            ]
        parent_by_id = {p.block_id: p for p in parents}
        return [
            b
            for b in candidates.values()
            if b.token_ids == token_ids
            and b.parent is not None
            and parent_by_id.get(b.parent.block_id) is b.parent
            and b.parent_generation == b.parent.generation
            and b.extra_key == extra_key
            and allowed(b)
        ]

    def find_partial_block(
        self,
        parent: KVCacheBlock | None,
        root_key: bytes,
        token_ids: Sequence[int],
        exclude: Callable[[KVCacheBlock], bool] = lambda block: False,
        extra_key: bytes = b"",
    ) -> tuple[KVCacheBlock, int] | None:
        """Finds the cached child of ``parent`` whose first tokens match ``token_ids`` the longest.

        The child is verified like a full hit (its parent is ``parent`` at the same generation,
        or, for a first block, it is a chain root with ``root_key``; its ``extra_key`` equals the
        request's for that block), then its stored token ids are compared with ``token_ids`` from
        the start.

        Args:
            parent: the last block of the request's verified prefix; ``None`` if there is none.
            root_key: the request's root key.
            token_ids: the request's next tokens after that prefix, ``len < block_size``.
            exclude: blocks not to use (e.g. cached this step, their K/V not yet written).
            extra_key: the request's extra key for the block (tenant namespace or ``b""``).

        Returns:
            ``(block, num_tokens)`` with ``1 <= num_tokens <= len(token_ids)`` matching tokens, or
            ``None`` when no cached child matches even one token.
        """
        if not token_ids:
            return None
        key = (root_key if parent is None else parent.block_id, token_ids[0])
        best: tuple[KVCacheBlock, int] | None = None
        for block in self.cached_children.get(key, {}).values():
            if parent is None:
                if block.parent is not None or block.root_key != root_key:
                    continue
            elif block.parent is not parent or block.parent_generation != parent.generation:
                continue
            if block.extra_key != extra_key or exclude(block) or not self.free_block_queue.is_hit_allowed(block):
                continue
            n = 0
            for a, b in zip(block.token_ids, token_ids):
                if a != b:
                    break
                n += 1
            if best is None or n > best[1]:
                best = (block, n)
        return best

    # -- allocation -----------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks from the head of the free queue, evicting cached ones.

        Args:
            num_blocks: number of blocks wanted, ``>= 0``.

        Returns:
            The blocks, each with ``ref_cnt == 1`` and no hash.

        Raises:
            ValueError: ``num_blocks`` is negative or exceeds the free blocks.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self.free_block_queue):
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {len(self.free_block_queue)} free"
            )
        blocks = []
        for _ in range(num_blocks):
            block, reason = self.free_block_queue.choose_victim()
            self._evict(block, reason)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (a cache hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.on_touch(block)
            block.ref_cnt += 1

    def record_hits(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Tells the eviction policy that these cached blocks served a request."""
        for block in blocks:
            self.free_block_queue.on_hit(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 go to the free-queue tail.

        Args:
            ordered_blocks: blocks in eviction order, i.e. a request's blocks tail first.

        Raises:
            ValueError: a block has no reference to drop.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.on_free(block)

    # -- caching --------------------------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Indexes the request's blocks ``[num_cached_blocks, num_full_blocks)`` in the hash map.

        Blocks already carrying a hash (not expected from the manager) are left as they are.

        Args:
            request: the request owning ``blocks``; supplies the hashes, tokens and root key.
            blocks: the request's block table.
            num_cached_blocks: blocks of ``blocks`` already cached (hits or cached earlier).
            num_full_blocks: blocks that are full; ``<= len(request.block_hashes)``.
            block_size: tokens per block.

        Raises:
            ValueError: ``num_full_blocks`` exceeds the request's hashes or its block table.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        if num_full_blocks > len(request.block_hashes) or num_full_blocks > len(blocks):
            raise ValueError(
                f"cannot cache {num_full_blocks} blocks: request {request.request_id!r} has "
                f"{len(request.block_hashes)} block hashes and {len(blocks)} blocks"
            )
        now = self.clock()
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:  # already cached (e.g. a hit): keep its chain
                continue
            block.block_hash = request.block_hashes[i]
            block.token_ids = tuple(request.all_token_ids[i * block_size : (i + 1) * block_size])
            block.cached_s = now
            block.extra_key = request.block_extra_key(i)
            if i == 0:
                block.parent, block.parent_generation, block.root_key = None, 0, request.root_key
                block.depth = 0
                key: int | bytes = request.root_key
            else:
                parent = blocks[i - 1]
                block.parent, block.parent_generation, block.root_key = parent, parent.generation, None
                block.depth = parent.depth + 1
                parent.num_cached_children += 1
                key = parent.block_id
            self.cached_block_hash_to_block.setdefault(block.block_hash, {})[block.block_id] = block
            self.cached_children.setdefault((key, block.token_ids[0]), {})[block.block_id] = block
            self.num_cached_blocks += 1
            self.free_block_queue.on_cache(block)

    def sweep_expired(self) -> int:
        """Evicts now the free cached blocks the policy has expired (``ttl``: idle longer than
        ``cache_ttl_s``), instead of when their memory is next needed, so ``cached_bytes`` and the
        eviction counters say what is really reusable. O(1) when nothing expired.

        Returns:
            The number of blocks evicted (reason ``"ttl"``).
        """
        expired = self.free_block_queue.pop_expired()
        for block in expired:  # children first: a parent is freed after its children
            self._evict(block, "ttl")
            self.free_block_queue.on_free(block)
        return len(expired)

    def invalidate_chains(self, is_stale_root: Callable[[bytes], bool]) -> int:
        """Evicts now every free cached block whose chain starts with a stale root key.

        For content new requests can't hit any more (an adapter reloaded with new weights; a request
        queued before the reload still carries the old adapter and recomputes): such blocks would
        otherwise wait for their LRU turn while useful blocks are evicted before them. The
        evicted blocks go to the front of the free queue (handed out first), counted as evictions
        with reason ``"invalidated"``. Blocks still in use, and the parents of blocks in use, stay
        cached until freed and evicted normally (nobody can hit them: the root key is stale).

        Args:
            is_stale_root: tells from a chain's ``root_key`` whether it is stale.

        Returns:
            The number of blocks evicted.
        """
        cached = [b for same in self.cached_block_hash_to_block.values() for b in same.values()]
        cached.sort(key=lambda b: b.depth)
        stale: set[int] = set()
        for block in cached:  # parents before children: a chain is stale iff its root is
            parent = block.parent
            if parent.block_id in stale if parent is not None else is_stale_root(block.root_key):
                stale.add(block.block_id)
        num_evicted = 0
        now = self.clock()
        for block in reversed(cached):  # children before parents
            if block.block_id in stale and block.ref_cnt == 0 and block.num_cached_children == 0:
                self.free_block_queue.on_touch(block)
                self.evicted_age_s_total += now - block.cached_s
                self._clear(block, notify=False)  # its parent is stale too and comes later
                self.free_block_queue.on_free_first(block)
                self.num_evictions += 1
                num_evicted += 1
        if num_evicted:
            self.evictions_by_reason["invalidated"] = self.evictions_by_reason.get("invalidated", 0) + num_evicted
        return num_evicted

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, unless a block is in use.

        Returns:
            ``True`` if the cache was reset; ``False`` (and nothing changed) if any block has
            ``ref_cnt > 0``, since a running request's blocks must keep their content.
        """
        if len(self.free_block_queue) != self.num_blocks:
            return False
        order = self.free_block_queue.get_all_free_blocks()
        for block in self.blocks:
            self._clear(block, notify=False)
        self.cached_block_hash_to_block.clear()
        self.cached_children.clear()
        # A fresh policy over the same blocks, in the order they would have been taken.
        self.free_block_queue = make_eviction_policy(
            self.eviction_policy, order, self.clock, self.eviction_options
        )
        return True

    def _evict(self, block: KVCacheBlock, reason: str) -> None:
        """Evicts a block popped for reuse, counting it (by reason and age) if it was cached."""
        if block.block_hash is not None:
            self.evicted_age_s_total += self.clock() - block.cached_s
            self._clear(block)
            self.num_evictions += 1
            self.evictions_by_reason[reason] = self.evictions_by_reason.get(reason, 0) + 1

    def _clear(self, block: KVCacheBlock, notify: bool = True) -> None:
        """Removes a cached block from the maps, forgets its content and bumps its generation.

        Args:
            block: the block; nothing happens if it is not cached.
            notify: tell the eviction policy when the parent becomes a free leaf.
        """
        if block.block_hash is None:
            return
        same_hash = self.cached_block_hash_to_block[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[block.block_hash]
        parent = block.parent
        key = (block.root_key if parent is None else parent.block_id, block.token_ids[0])
        siblings = self.cached_children.get(key)
        if siblings is not None and siblings.get(block.block_id) is block:
            del siblings[block.block_id]
            if not siblings:
                del self.cached_children[key]
        if parent is not None and block.parent_generation == parent.generation:
            parent.num_cached_children -= 1
            if notify and parent.num_cached_children == 0 and parent.ref_cnt == 0:
                self.free_block_queue.on_leaf(parent)
        block.num_cached_children = 0
        block.depth = 0
        block.block_hash = None
        block.token_ids = None
        block.parent = None
        block.parent_generation = 0
        block.root_key = None
        block.extra_key = b""
        block.generation += 1
        self.num_cached_blocks -= 1

    # -- accounting -----------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached or not (all can be allocated)."""
        return len(self.free_block_queue)

    @property
    def cached_bytes(self) -> int:
        """KV bytes held by cached blocks (in use or free)."""
        return self.num_cached_blocks * self.eviction_options.bytes_per_block

    @property
    def mean_evicted_age_s(self) -> float:
        """Mean time between caching and eviction of the evicted blocks, in seconds (0.0 if none)."""
        return self.evicted_age_s_total / self.num_evictions if self.num_evictions else 0.0

    def get_usage(self) -> float:
        """Fraction of blocks in use by requests, in ``[0, 1]``."""
        return (self.num_blocks - len(self.free_block_queue)) / self.num_blocks

    def dump(self) -> str:
        """A multi-line picture of the pool for debugging: free queue, in-use and cached blocks."""
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        lines = [
            f"BlockPool: {self.num_blocks} blocks, {len(in_use)} in use, "
            f"{len(self.free_block_queue)} free, {self.num_cached_blocks} cached, "
            f"{self.num_evictions} evictions",
            "  free (evict first -> last): "
            + " ".join(
                f"{b.block_id}{'*' if b.block_hash is not None else ''}"
                for b in self.free_block_queue.get_all_free_blocks()
            ),
            "  in use: " + " ".join(f"{b.block_id}(ref={b.ref_cnt})" for b in in_use),
            "  cached:",
        ]
        for block_hash, same_hash in self.cached_block_hash_to_block.items():
            for block in same_hash.values():
                parent = "root" if block.parent is None else f"<-{block.parent.block_id}"
                lines.append(f"    {block_hash.hex()[:12]} {block.block_id} {parent} {block.token_ids}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, free={len(self.free_block_queue)}, "
            f"cached={self.num_cached_blocks}, evictions={self.num_evictions})"
        )
