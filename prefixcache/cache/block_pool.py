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
- ``ref_cnt >= 0``; a block is among the free blocks (held by the eviction policy, ``evictor``) iff
  its ``ref_cnt == 0``; ``num_free_blocks + num_blocks_in_use == num_blocks``.
- A block is in the hash map iff ``block_hash`` is set; then it is full and ``token_ids`` holds its
  ``block_size`` tokens. A block is evicted only when the policy chooses it (lazily, when a block
  is needed, or when it expires), when its chain is invalidated, when the step meant to write it
  failed, or by :meth:`BlockPool.reset_prefix_cache`; eviction clears it and bumps ``generation``.
- A hit is exact whatever the hash function does: every lookup (full blocks, partial blocks, the
  cache manager's fast path) accepts a block only if its stored tokens equal the request's (whole,
  or as a prefix for a partial hit) and :func:`~prefixcache.cache.block.follows` holds: its
  predecessor is the block matched just before, at the same ``generation`` as when cached (or, for
  a first block, its ``root_key`` is the request's), and its ``extra_key`` (tenant namespace) is the
  request's for that block. By induction the whole prefix, and so the K/V, is the same, and a
  block beyond an approved shared prefix is only ever served within its tenant.
- One prefix, one cached copy: :meth:`BlockPool.cache_block` leaves a block uncached when a
  verified equal block is already cached at that place in the chain. (Equal blocks cached more
  than once are still handled by lookups: each copy keeps its own parent chain.)
- Children before parents: ``num_cached_children`` counts the cached blocks whose live parent is
  this block, and no policy evicts a block while it is non-zero, so every cached block's parent is
  cached at the recorded generation (no orphaned chains). ``cached_children`` indexes them by
  (parent, first token) for partial-block reuse.
- With KV events on (``kv_events``, :mod:`prefixcache.cache.kv_events`), the recorder hears of
  every hash entering the hash map (its first block cached) and leaving it (its last one cleared),
  and of each reset, so the events applied in order give exactly the map's set of hashes.
- With ``lru`` (the default) the free blocks are in LRU order: freed blocks go to the tail,
  eviction takes from the head. Callers free a request's blocks tail first, so a prefix's tail is
  evicted before its head. Other policies: see :mod:`prefixcache.cache.eviction`.

KV-cache groups (:mod:`prefixcache.cache.kv_cache_groups`; a one-group model never has a block of
another group, and everything below is then inert): a block of group ``g > 0`` is cached under
:func:`~prefixcache.cache.kv_cache_groups.group_block_hash` with ``parent`` = its *anchor*, the
cached group-0 block of the same position of the same prefix, so :func:`follows` verifies it against
the request's verified group-0 block there, and it needs no block of its own group before it (a
sliding group's early blocks are gone while its later ones are hit). Such a block is *attached* to
its anchor, not a child of it: it does not count in ``num_cached_children`` (it never keeps its
anchor from eviction), it is not in ``cached_children`` (a partial hit finds group 0's block, then
each other group's block attached to it, with :meth:`BlockPool.get_cached_block`) and KV events
and ``changed_hashes`` report group 0 only. When an anchor is evicted its attached blocks can never
be hit again (their parent's generation moved); those waiting in the retained queue are evicted with
it and handed out first.
- Retention: :meth:`BlockPool.free_blocks` with ``retain=True`` keeps free cached blocks (a sliding
  group's window at the end of a cached prefix) in a queue of their own, least recently freed first,
  evicted only when the eviction policy holds no free block any more. Free blocks = the policy's +
  the retained ones.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prefixcache.cache.block import KVCacheBlock, common_prefix_length, follows
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.eviction import EvictionPolicy, make_eviction_policy
from prefixcache.cache.hashing import BlockHash, pack_token_ids
from prefixcache.cache.metrics import EvictionStats

if TYPE_CHECKING:
    from prefixcache.cache.kv_events import KVEventRecorder

__all__ = ["BlockPool", "KVCacheBlock"]


class BlockPool:
    """Owns every KV-cache block, the free blocks (held by an eviction policy) and the cache index.

    Args:
        num_blocks: number of blocks in the pool, ``>= 1``.
        config: the cache options (``enable_prefix_caching`` off: nothing is ever cached and every
            lookup misses; ``eviction_policy``: a name registered in
            :data:`prefixcache.cache.eviction.EVICTION_POLICIES` or an :class:`EvictionPolicy`
            subclass).
        bytes_per_block: KV bytes of one block over all layers (``cached_bytes``, ``cost``).
        clock: current time in seconds; ``time.monotonic`` by default, virtual in simulations.

    Raises:
        ValueError: ``num_blocks < 1``; InvalidInputError: an unknown eviction policy.
    """

    def __init__(
        self,
        num_blocks: int,
        config: CacheConfig | None = None,
        *,
        bytes_per_block: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.config = config or CacheConfig()
        self.enable_caching = self.config.enable_prefix_caching
        self.bytes_per_block = bytes_per_block
        self.clock = clock
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # The free blocks (ref_cnt 0), in the order the eviction policy hands them out.
        self.evictor: EvictionPolicy = self._make_evictor(self.blocks)
        # block hash -> {block_id: block}; several blocks may share a hash (two requests that
        # computed the same prefix in one step, or a hash collision).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # block hash -> its cached block, for the hashes with exactly one cached copy: a lookup's
        # fast path takes a block with one dict get (vLLM v1's BlockHashToBlockMap keeps a lone
        # block out of a dict for the same reason).
        self.sole_cached_block: dict[BlockHash, KVCacheBlock] = {}
        # (parent block id, or root key for a first block; first token) -> {block_id: block}:
        # the cached children of a block, for partial-block reuse.
        self.cached_children: dict[tuple[int | bytes, int], dict[int, KVCacheBlock]] = {}
        self.num_cached_blocks = 0
        self.eviction_stats = EvictionStats()
        # Cached blocks evicted by get_new_blocks to make room (whatever the policy's reason): the
        # pool's memory pressure, as the cache-aware scheduler reads it. Expiry sweeps,
        # invalidations and failed steps are not counted here.
        self.num_allocation_evictions = 0
        # Told when a hash enters or leaves the hash map, and of resets (KV events); None: off.
        self.kv_events: KVEventRecorder | None = None
        # Hashes that entered or left the cache map since the last take_changed_hashes(); None until
        # a consumer (the cache-aware scheduler's match-length cache) calls track_changed_hashes().
        self.changed_hashes: set[BlockHash] | None = None
        # Free cached blocks freed with retention (block id -> block), least recently freed first:
        # evicted after every block the policy holds (KV-cache groups: a sliding window kept with
        # the end of its prefix). Always empty for a one-group model.
        self.retained: OrderedDict[int, KVCacheBlock] = OrderedDict()
        # Anchor block id -> {block id: block} of the blocks of other groups cached on it.
        self._attached: dict[int, dict[int, KVCacheBlock]] = {}

    def _make_evictor(self, free_blocks: Iterable[KVCacheBlock]) -> EvictionPolicy:
        return make_eviction_policy(self.config.eviction_policy, free_blocks, self.clock, self.config,
                                    self.bytes_per_block)

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
            A verified block (:func:`~prefixcache.cache.block.follows`, equal tokens, allowed by
            the policy), or ``None`` on a miss. Its ref count is not changed.
        """
        matches = self.find_cached_blocks(
            block_hash, token_ids, None if parent is None else (parent,), root_key, extra_key
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
        the same step, or a hash collision); each copy has its own chain of parents, so a lookup
        keeps all the copies matched at one block as the candidate parents of the next, to find
        the longest prefix.

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
        token_ids, allowed = tuple(token_ids), self.evictor.is_hit_allowed
        found = []
        for block in candidates.values():
            if block.token_ids != token_ids or not allowed(block):
                continue
            if parents is None:
                if follows(block, None, root_key, extra_key):
                    found.append(block)
            elif any(follows(block, parent, root_key, extra_key) for parent in parents):
                found.append(block)
        return found

    def find_partial_block(
        self,
        parent: KVCacheBlock | None,
        root_key: bytes,
        token_ids: Sequence[int],
        exclude: Callable[[KVCacheBlock], bool] = lambda block: False,
        extra_key: bytes = b"",
    ) -> tuple[KVCacheBlock, int] | None:
        """Finds the cached child of ``parent`` whose first tokens match ``token_ids`` the longest.

        The child is verified like a full hit (:func:`~prefixcache.cache.block.follows`, allowed by
        the policy), then its stored token ids are compared with ``token_ids`` from the start.

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
            if not follows(block, parent, root_key, extra_key) or exclude(block):
                continue
            if not self.evictor.is_hit_allowed(block):
                continue
            n = common_prefix_length(block.token_ids, token_ids)
            if best is None or n > best[1]:
                best = (block, n)
        return best

    # -- allocation -----------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int, group_id: int = 0) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` free blocks in the policy's order, evicting cached ones; the
        retained blocks only once the policy holds none.

        Args:
            num_blocks: number of blocks wanted, ``>= 0``.
            group_id: the KV-cache group whose K/V they will hold.

        Returns:
            The blocks, each with ``ref_cnt == 1``, no hash and ``group_id`` set.

        Raises:
            ValueError: ``num_blocks`` is negative or exceeds the free blocks.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num_blocks):
            if len(self.evictor):
                block, reason = self.evictor.choose_victim()
            else:
                block, reason = self.retained.popitem(last=False)[1], self.evictor.name
            self.num_allocation_evictions += block.block_hash is not None
            self._evict(block, reason)
            block.ref_cnt = 1
            block.group_id = group_id
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (a cache hit); a free block leaves the free blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._take_free(block)
            block.ref_cnt += 1

    def _take_free(self, block: KVCacheBlock) -> None:
        """Removes a free block from the retained queue or the policy, whichever holds it."""
        if self.retained.pop(block.block_id, None) is None:
            self.evictor.on_touch(block)

    def record_hits(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Tells the eviction policy that these cached blocks served a request."""
        for block in blocks:
            self.evictor.on_hit(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], retain: bool = False) -> None:
        """Drops one reference from each block; blocks reaching 0 become free, in this order.

        Args:
            ordered_blocks: blocks in eviction order, i.e. a request's blocks tail first.
            retain: the cached ones go to the retained queue (evicted after every other free
                block) instead of the eviction policy.

        Raises:
            ValueError: a block has no reference to drop.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if retain and block.block_hash is not None:
                    self.retained[block.block_id] = block
                else:
                    self.evictor.on_free(block)

    # -- caching --------------------------------------------------------------------------------

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent: KVCacheBlock | None,
        root_key: bytes,
        extra_key: bytes = b"",
    ) -> KVCacheBlock:
        """Indexes a full block in use, unless an equal block is already cached there.

        One prefix, one cached copy: when a verified cached block already holds
        the same tokens after the same ``parent`` (in the same namespace), ``block`` stays uncached
        and that block is returned; the caller chains the request's later blocks to it and holds a
        reference on it, so it stays cached at least as long as its new children.

        Args:
            block: a block in use, not cached yet.
            block_hash: the request's hash of this block.
            token_ids: its ``block_size`` tokens.
            parent: the cached block of the previous position (``None`` for a first block).
            root_key: the request's root key (stored on a first block).
            extra_key: the request's extra key for this block.

        Returns:
            The cached block that now stands for this prefix: ``block``, or the equal one found.

        Raises:
            ValueError: ``block`` is already cached or free, or caching is disabled.
        """
        if not self.enable_caching or block.block_hash is not None or block.ref_cnt <= 0:
            raise ValueError(f"cannot cache {block}: caching off, already cached or not in use")
        token_ids = tuple(token_ids)
        same = self.get_cached_block(block_hash, token_ids, parent, root_key, extra_key)
        if same is not None:
            return same
        block.block_hash, block.token_ids, block.extra_key = block_hash, token_ids, extra_key
        block.token_bytes = pack_token_ids(token_ids)
        block.cached_s = self.clock()
        if block.group_id:  # attached to its anchor (module docstring)
            if parent is None:
                raise ValueError(f"cannot cache {block}: a block of group {block.group_id} needs its anchor")
            block.parent, block.parent_generation, block.root_key = parent, parent.generation, None
            block.depth = parent.depth + 1  # after its anchor in every depth order
            self._attached.setdefault(parent.block_id, {})[block.block_id] = block
            same_hash = self.cached_block_hash_to_block.setdefault(block_hash, {})
            same_hash[block.block_id] = block
            self._index_sole_copy(block_hash, same_hash)
            self.num_cached_blocks += 1
            self.evictor.on_cache(block)
            return block
        if parent is None:
            block.parent, block.parent_generation, block.root_key, block.depth = None, 0, root_key, 0
            key: int | bytes = root_key
        else:
            block.parent, block.parent_generation, block.root_key = parent, parent.generation, None
            block.depth = parent.depth + 1
            parent.num_cached_children += 1
            key = parent.block_id
        same_hash = self.cached_block_hash_to_block.setdefault(block_hash, {})
        if not same_hash and self.kv_events is not None:
            self.kv_events.block_stored(block, parent, root_key)
        same_hash[block.block_id] = block
        self._index_sole_copy(block_hash, same_hash)
        self.cached_children.setdefault((key, token_ids[0]), {})[block.block_id] = block
        self.num_cached_blocks += 1
        if self.changed_hashes is not None:
            self.changed_hashes.add(block_hash)
        self.evictor.on_cache(block)
        return block

    def sweep_expired(self) -> int:
        """Evicts now the free cached blocks the policy has expired (``ttl``: idle longer than
        ``cache_ttl_s``), instead of when their memory is next needed, so ``cached_bytes`` and the
        eviction counters say what is really reusable. O(1) when nothing expired.

        Returns:
            The number of blocks evicted (reason ``"ttl"``).
        """
        expired = self.evictor.pop_expired()
        for block in expired:  # children first: a parent is freed after its children
            self._evict(block, "ttl")
            self.evictor.on_free(block)
        return len(expired)

    def invalidate_chains(self, is_stale_root: Callable[[bytes], bool]) -> int:
        """Evicts now every free cached block whose chain starts with a stale root key.

        For content new requests can't hit any more (an adapter reloaded with new weights; a request
        queued before the reload still carries the old adapter and recomputes): such blocks would
        otherwise wait for their turn while useful blocks are evicted before them. The evicted
        blocks are handed out before every other free block, counted as evictions with reason
        ``"invalidated"``. Blocks still in use, and the parents of blocks in use, stay cached until
        freed and evicted normally (nobody can hit them: the root key is stale).

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
        for block in reversed(cached):  # children before parents
            if (block.block_id in stale and block.ref_cnt == 0 and block.num_cached_children == 0
                    and block.block_hash is not None):  # (an attached block may have gone with its anchor)
                self._take_free(block)
                self._evict(block, "invalidated", notify=False)  # its parent is stale too, comes later
                self.evictor.on_free_first(block)
                num_evicted += 1
        return num_evicted

    def uncache(self, blocks: Iterable[KVCacheBlock], reason: str = "failed_step") -> int:
        """Drops cached blocks from the index now, in use or free: their K/V can't be trusted
        (the step that was to write it failed). Children go first, so pass whole chain tails.

        Returns:
            The number of blocks dropped (counted as evictions with ``reason``).
        """
        num = 0
        for block in sorted(blocks, key=lambda b: -b.depth):  # children before parents
            if block.block_hash is None:
                continue
            free = block.ref_cnt == 0
            if free:
                self._take_free(block)
            self._evict(block, reason)
            if free:
                self.evictor.on_free(block)
            num += 1
        return num

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, unless a block is in use.

        Returns:
            ``True`` if the cache was reset; ``False`` (and nothing changed) if any block has
            ``ref_cnt > 0``, since a running request's blocks must keep their content.
        """
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        order = self.evictor.get_all_free_blocks() + list(self.retained.values())
        self.retained.clear()
        for block in self.blocks:
            self._clear(block, notify=False, record=False)
        self._attached.clear()
        self.cached_block_hash_to_block.clear()
        self.sole_cached_block.clear()
        self.cached_children.clear()
        if self.kv_events is not None:
            self.kv_events.all_blocks_cleared()
        # A fresh policy over the same blocks, in the order they would have been taken.
        self.evictor = self._make_evictor(order)
        return True

    def _index_sole_copy(self, block_hash: BlockHash, same_hash: dict[int, KVCacheBlock]) -> None:
        """Keeps ``sole_cached_block[block_hash]`` right after ``block_hash``'s copies changed."""
        if len(same_hash) == 1:
            (self.sole_cached_block[block_hash],) = same_hash.values()
        else:
            self.sole_cached_block.pop(block_hash, None)

    def _evict(self, block: KVCacheBlock, reason: str, notify: bool = True) -> None:
        """Evicts a block leaving the cache for reuse, counting it (by reason and age) if cached.
        Its attached blocks in the retained queue (never hit-able again) go with it, to the front of
        the free blocks."""
        if block.block_hash is None:
            return
        self.eviction_stats.record(reason, self.clock() - block.cached_s)
        attached = self._attached.pop(block.block_id, None)
        self._clear(block, notify)
        for other in (attached or {}).values():
            if self.retained.pop(other.block_id, None) is not None:
                self._evict(other, reason)
                self.evictor.on_free_first(other)

    def _clear(self, block: KVCacheBlock, notify: bool = True, record: bool = True) -> None:
        """Removes a cached block from the maps, forgets its content and bumps its generation.

        Args:
            block: the block; nothing happens if it is not cached.
            notify: tell the eviction policy when the parent becomes a free leaf.
            record: tell the KV event recorder when the block's hash leaves the map (a reset
                reports one ``AllBlocksCleared`` instead).
        """
        if block.block_hash is None:
            return
        primary = block.group_id == 0
        if self.changed_hashes is not None and primary:
            self.changed_hashes.add(block.block_hash)
        same_hash = self.cached_block_hash_to_block[block.block_hash]
        del same_hash[block.block_id]
        self._index_sole_copy(block.block_hash, same_hash)
        if not same_hash:
            del self.cached_block_hash_to_block[block.block_hash]
            if record and self.kv_events is not None and primary:
                self.kv_events.block_removed(block.block_hash)
        parent = block.parent
        if not primary:  # attached to its anchor: no child of it
            attached = self._attached.get(parent.block_id) if block.parent_generation == parent.generation else None
            if attached is not None and attached.get(block.block_id) is block:
                del attached[block.block_id]
                if not attached:
                    del self._attached[parent.block_id]
        else:
            key = (block.root_key if parent is None else parent.block_id, block.token_ids[0])
            siblings = self.cached_children.get(key)
            if siblings is not None and siblings.get(block.block_id) is block:
                del siblings[block.block_id]
                if not siblings:
                    del self.cached_children[key]
            if parent is not None and block.parent_generation == parent.generation:
                parent.num_cached_children -= 1
                if notify and parent.num_cached_children == 0 and parent.ref_cnt == 0:
                    self.evictor.on_leaf(parent)
        block.num_cached_children = 0
        block.depth = 0
        block.block_hash = None
        block.token_ids = block.token_bytes = None
        block.parent = None
        block.parent_generation = 0
        block.root_key = None
        block.extra_key = b""
        block.prompt_logprobs = None
        block.generation += 1
        self.num_cached_blocks -= 1

    # -- change tracking ------------------------------------------------------------------------

    def track_changed_hashes(self) -> None:
        """Starts recording which block hashes enter or leave the cache map (for consumers that keep
        derived state, such as a waiting request's cached match length, and refresh it lazily)."""
        if self.changed_hashes is None:
            self.changed_hashes = set()

    def take_changed_hashes(self) -> set[BlockHash]:
        """The hashes cached or evicted since the last call (empty when not tracking); resets them."""
        changed = self.changed_hashes
        if not changed:
            return set()
        self.changed_hashes = set()
        return changed

    # -- accounting -----------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached or not, retained or not (all can be allocated)."""
        return len(self.evictor) + len(self.retained)

    @property
    def cached_bytes(self) -> int:
        """KV bytes held by cached blocks (in use or free)."""
        return self.num_cached_blocks * self.bytes_per_block

    def group_block_counts(self, num_groups: int) -> list[dict[str, int]]:
        """Per KV-cache group, the blocks holding its layers' K/V now: ``in_use`` (``ref_cnt > 0``),
        ``cached`` (in the hash map, in use or free), ``cached_free`` (cached with ``ref_cnt == 0``:
        hit-able until evicted) and ``retained`` (of those, freed with retention). A free block
        without a hash belongs to no group (its ``group_id`` is a leftover), so the ``in_use`` sum
        to the pool's blocks in use and the ``cached`` to ``num_cached_blocks``.

        One pass over the pool, ``O(num_blocks)``: for a status page, not for every step.

        Raises:
            ValueError: ``num_groups < 1``.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        counts = [{"in_use": 0, "cached": 0, "cached_free": 0, "retained": 0} for _ in range(num_groups)]
        for block in self.blocks:
            c = counts[block.group_id]
            if block.ref_cnt > 0:
                c["in_use"] += 1
            if block.block_hash is not None:
                c["cached"] += 1
                c["cached_free"] += block.ref_cnt == 0
        for block in self.retained.values():
            counts[block.group_id]["retained"] += 1
        return counts

    def get_usage(self) -> float:
        """Fraction of blocks in use by requests, in ``[0, 1]``."""
        return (self.num_blocks - self.get_num_free_blocks()) / self.num_blocks

    def dump(self) -> str:
        """A multi-line picture of the pool for debugging: free blocks, in-use and cached blocks."""
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        lines = [
            f"BlockPool: {self.num_blocks} blocks, {len(in_use)} in use, "
            f"{self.get_num_free_blocks()} free, {self.num_cached_blocks} cached, "
            f"{self.eviction_stats.num_evictions} evictions",
            "  free (evict first -> last): "
            + " ".join(
                f"{b.block_id}{'*' if b.block_hash is not None else ''}"
                for b in [*self.evictor.get_all_free_blocks(), *self.retained.values()]
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
            f"BlockPool(num_blocks={self.num_blocks}, free={self.get_num_free_blocks()}, "
            f"cached={self.num_cached_blocks}, evictions={self.eviction_stats.num_evictions})"
        )

