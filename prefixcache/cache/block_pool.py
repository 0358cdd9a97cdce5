"""The pool of KV-cache blocks: allocation, reference counts, LRU eviction and the prefix-cache index.

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
- ``ref_cnt >= 0``; a block is in the free queue iff its ``ref_cnt == 0``;
  ``num_free_blocks + num_blocks_in_use == num_blocks``.
- A block is in the hash map iff ``block_hash`` is set; then it is full and ``token_ids`` holds its
  ``block_size`` tokens. A block is evicted only when it is popped from the free queue (lazily) or
  by :meth:`BlockPool.reset_prefix_cache`; eviction clears it and bumps ``generation``.
- A hit is exact whatever the hash function does: :meth:`BlockPool.get_cached_block` returns a block
  only if its stored tokens equal the request's tokens of that block *and* its predecessor is the
  block matched just before (same ``generation`` as when cached), or, for a first block, its
  ``root_key`` equals the request's. By induction the whole prefix, and so the K/V, is the same.
  Equal blocks may be cached more than once, each with its own parent chain.
  A cached block whose parent was evicted stays in the map until it is itself evicted, but can
  never be hit again (``generation`` only grows).
- The free queue is in LRU order: freed blocks go to the tail, eviction takes from the head.
  Callers free a request's blocks tail first, so a prefix's tail is evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
        generation: bumped each time the block is evicted or reset, i.e. each time its content
            stops being what was cached.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    parent: KVCacheBlock | None = None
    parent_generation: int = 0
    root_key: bytes | None = None
    generation: int = 0

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}" if self.block_hash is not None else ""
        parent = f", parent={self.parent.block_id}" if self.parent is not None else ""
        return (
            f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}{cached}{parent}, "
            f"gen={self.generation})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks in LRU order: O(1) popleft, append and removal from the middle.

    An ``OrderedDict`` keyed by ``block_id`` plays the role of vLLM's doubly linked list.

    Args:
        blocks: the initial free blocks, head (evicted first) to tail.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._blocks: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return self._blocks.get(block.block_id) is block

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the head (least recently freed) block.

        Raises:
            ValueError: the queue is empty.
        """
        if not self._blocks:
            raise ValueError("no free blocks")
        return self._blocks.popitem(last=False)[1]

    def remove(self, block: KVCacheBlock) -> None:
        """Removes ``block`` from anywhere in the queue in O(1).

        Raises:
            KeyError: ``block`` is not in the queue.
        """
        del self._blocks[block.block_id]

    def append(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the tail (evicted last).

        Raises:
            ValueError: ``block`` is already in the queue.
        """
        if block.block_id in self._blocks:
            raise ValueError(f"block {block.block_id} is already free")
        self._blocks[block.block_id] = block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Returns the free blocks head to tail (for tests and debugging)."""
        return list(self._blocks.values())


class BlockPool:
    """Owns every KV-cache block, the LRU free queue and the prefix-cache hash map.

    Args:
        num_blocks: number of blocks in the pool, ``>= 1``.
        enable_caching: when ``False`` nothing is ever cached and every lookup misses.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # block hash -> {block_id: block}; several blocks may share a hash (two requests that
        # computed the same prefix in one step, or a hash collision).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.num_cached_blocks = 0
        self.num_evictions = 0

    # -- lookup ---------------------------------------------------------------------------------

    def get_cached_block(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent: KVCacheBlock | None,
        root_key: bytes,
    ) -> KVCacheBlock | None:
        """Finds a cached block holding exactly ``token_ids`` after ``parent``'s prefix.

        Args:
            block_hash: the request's hash of this block.
            token_ids: the request's ``block_size`` tokens of this block.
            parent: the block matched for the previous block of the request; ``None`` for the
                first block.
            root_key: the request's root key (checked for a first block).

        Returns:
            A verified block (see the module invariants), or ``None`` on a miss. Its ref count is
            not changed.
        """
        matches = self.find_cached_blocks(
            block_hash, token_ids, None if parent is None else [parent], root_key
        )
        return matches[0] if matches else None

    def find_cached_blocks(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parents: Sequence[KVCacheBlock] | None,
        root_key: bytes,
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

        Returns:
            The verified blocks, in caching order; empty on a miss. Ref counts are not changed.
        """
        candidates = self.cached_block_hash_to_block.get(block_hash)
        if not candidates:
            return []
        token_ids = tuple(token_ids)
        if parents is None:
            return [
                b
                for b in candidates.values()
                if b.token_ids == token_ids and b.parent is None and b.root_key == root_key
            ]
        parent_by_id = {p.block_id: p for p in parents}
        return [
            b
            for b in candidates.values()
            if b.token_ids == token_ids
            and b.parent is not None
            and parent_by_id.get(b.parent.block_id) is b.parent
            and b.parent_generation == b.parent.generation
        ]

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
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (a cache hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

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
                self.free_block_queue.append(block)

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
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:  # already cached (e.g. a hit): keep its chain
                continue
            block.block_hash = request.block_hashes[i]
            block.token_ids = tuple(request.all_token_ids[i * block_size : (i + 1) * block_size])
            if i == 0:
                block.parent, block.parent_generation, block.root_key = None, 0, request.root_key
            else:
                parent = blocks[i - 1]
                block.parent, block.parent_generation, block.root_key = parent, parent.generation, None
            self.cached_block_hash_to_block.setdefault(block.block_hash, {})[block.block_id] = block
            self.num_cached_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, unless a block is in use.

        Returns:
            ``True`` if the cache was reset; ``False`` (and nothing changed) if any block has
            ``ref_cnt > 0``, since a running request's blocks must keep their content.
        """
        if len(self.free_block_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            self._clear(block)
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """Evicts a block popped for reuse, counting it if it was cached."""
        if block.block_hash is not None:
            self._clear(block)
            self.num_evictions += 1

    def _clear(self, block: KVCacheBlock) -> None:
        """Removes a cached block from the map, forgets its content and bumps its generation."""
        if block.block_hash is None:
            return
        same_hash = self.cached_block_hash_to_block[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        block.parent = None
        block.parent_generation = 0
        block.root_key = None
        block.generation += 1
        self.num_cached_blocks -= 1

    # -- accounting -----------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached or not (all can be allocated)."""
        return len(self.free_block_queue)

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
