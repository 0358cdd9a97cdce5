"""Eviction policies: which free block the pool hands out (and so evicts) next.

A policy holds the pool's free blocks (``ref_cnt == 0``) and picks the victim when the pool needs a
block. The pool tells it what happens to blocks through a few hooks::

    on_free(block)      ref_cnt reached 0: the block is free (cached or not)
    on_touch(block)     a free block got a reference again (cache hit): it is no longer free
    on_hit(block)       a cached block served a request (full-block or partial hit)
    on_cache(block)     a block in use got its hash (entered the prefix cache)
    on_leaf(block)      a free cached block lost its last cached child
    choose_victim()     remove and return the next block to reuse, with the reason

Registered policies (:data:`EVICTION_POLICIES`):

- ``lru``: vLLM's single free queue, least recently freed first, uncached blocks included; O(1).
  Kept exactly as before this module existed (the default).
- ``lfu``: fewest hits first, ties least recently freed first; O(log n).
- ``ttl``: cached blocks idle (free) longer than ``cache_ttl_s`` are expired: never hit again and
  evicted first; then least recently freed; O(1).
- ``cost``: lowest value first, ``value = reuse frequency (decayed) * prefill time saved / bytes``,
  where the time saved grows with the block's depth in its chain; O(log n).

Invariants:
- The policy holds exactly the pool's free blocks; ``len(policy)`` is the number of free blocks.
- Every policy but ``lru`` takes uncached free blocks (no hash: nothing to lose) before any cached
  one. ``lru`` keeps one queue, as vLLM does, so its order is unchanged from the original pool.
- Children before parents: a cached block with cached children is never chosen. ``lfu`` and
  ``cost`` only keep childless ("leaf") cached blocks in their heap; ``lru`` and ``ttl`` order by
  free time and a request frees its blocks tail first, so a child is always freed before (older
  than) its parent. ``tests/cache/test_eviction.py`` checks this under random operations.
- Heap keys never change while a block is in the heap: ``cost`` stores decayed frequencies as
  ``log(freq) + decay_rate * t``, which orders blocks as ``freq * exp(-decay_rate * (now - t))``
  would at any common ``now``. Stale heap entries (touched blocks) are skipped lazily.
"""

from __future__ import annotations

import heapq
import itertools
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import ClassVar

from prefixcache.cache.block import KVCacheBlock
from prefixcache.cache.config import CacheConfig
from prefixcache.errors import InvalidInputError


class EvictionPolicy(ABC):
    """The set of free blocks and the rule that picks the next victim.

    Args:
        blocks: the initial free blocks, in the order they should be taken (all uncached).
        clock: current time in seconds (``time.monotonic`` in the engine, virtual in simulations).
        config: the cache options (``block_size``, ``cache_ttl_s``, the ``cost_*`` knobs).
        bytes_per_block: KV bytes of one block over all layers; 0 = unknown (treated as 1).
    """

    name: ClassVar[str]

    def __init__(
        self,
        blocks: Iterable[KVCacheBlock],
        clock: Callable[[], float],
        config: CacheConfig,
        bytes_per_block: int = 0,
    ) -> None:
        self.clock = clock
        self.config = config
        self.bytes_per_block = bytes_per_block

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: KVCacheBlock) -> bool: ...

    @abstractmethod
    def on_free(self, block: KVCacheBlock) -> None:
        """Adds a block whose ``ref_cnt`` just reached 0.

        Raises:
            ValueError: the block is already free.
        """

    @abstractmethod
    def on_touch(self, block: KVCacheBlock) -> None:
        """Removes a free block that is being reused by reference (a cache hit).

        Raises:
            KeyError: the block is not free.
        """

    @abstractmethod
    def choose_victim(self) -> tuple[KVCacheBlock, str]:
        """Removes and returns the next block to hand out.

        Returns:
            ``(block, reason)``; ``reason`` names why a cached block goes (``"lru"``, ``"ttl"``...).

        Raises:
            ValueError: no free block.
        """

    @abstractmethod
    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in the order they would be taken now (for tests and debugging)."""

    def on_free_first(self, block: KVCacheBlock) -> None:
        """Adds a free *uncached* block to be handed out before every other free block.

        Used for blocks invalidated on purpose (their chain can never be hit again).

        Raises:
            ValueError: the block is already free or still cached.
        """
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is cached; only uncached blocks go first")
        self.on_free(block)
        self._move_to_front(block)

    @abstractmethod
    def _move_to_front(self, block: KVCacheBlock) -> None:
        """Makes a free uncached block the next victim."""

    def pop_expired(self) -> list[KVCacheBlock]:
        """Removes and returns the free cached blocks that may no longer be hit (``ttl``), children
        before parents; the caller evicts them and frees them again as uncached blocks."""
        return []

    def on_hit(self, block: KVCacheBlock) -> None:
        """A cached block served a request (called before it is touched)."""

    def on_cache(self, block: KVCacheBlock) -> None:
        """A block in use entered the prefix cache (its hash, depth and ``cached_s`` are set)."""

    def on_leaf(self, block: KVCacheBlock) -> None:
        """A free cached block lost its last cached child."""

    def is_hit_allowed(self, block: KVCacheBlock) -> bool:
        """Whether a cached block may still be served (``ttl`` refuses expired ones)."""
        return True

    @property
    def refuses_hits(self) -> bool:
        """Whether :meth:`is_hit_allowed` can ever say no (lookups skip the call when it can't)."""
        return type(self).is_hit_allowed is not EvictionPolicy.is_hit_allowed


class LRUPolicy(EvictionPolicy):
    """Least recently freed first, one queue for cached and uncached blocks (vLLM v1's free queue).

    An ``OrderedDict`` keyed by ``block_id`` plays the role of vLLM's doubly linked list: O(1)
    popleft, append and removal from the middle.
    """

    name = "lru"

    def __init__(
        self,
        blocks: Iterable[KVCacheBlock] = (),
        clock: Callable[[], float] | None = None,
        config: CacheConfig | None = None,
        bytes_per_block: int = 0,
    ) -> None:
        super().__init__(blocks, clock or (lambda: 0.0), config or CacheConfig(), bytes_per_block)
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

    on_free = append
    on_touch = remove

    def _move_to_front(self, block: KVCacheBlock) -> None:
        self._blocks.move_to_end(block.block_id, last=False)

    def choose_victim(self) -> tuple[KVCacheBlock, str]:
        return self.popleft(), self.name

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self._blocks.values())


class _UncachedFirstPolicy(EvictionPolicy):
    """Shared bookkeeping of the policies that hand out uncached free blocks before cached ones.

    Free blocks live in ``_uncached`` (FIFO) or ``_cached``; subclasses order the cached ones via
    :meth:`_on_free_cached` / :meth:`_on_touch_cached`.
    """

    def __init__(
        self, blocks: Iterable[KVCacheBlock], clock: Callable[[], float], config: CacheConfig, bytes_per_block: int = 0
    ) -> None:
        super().__init__(blocks, clock, config, bytes_per_block)
        self._uncached: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)
        self._cached: OrderedDict[int, KVCacheBlock] = OrderedDict()  # free cached blocks

    def __len__(self) -> int:
        return len(self._uncached) + len(self._cached)

    def __contains__(self, block: KVCacheBlock) -> bool:
        bid = block.block_id
        return self._uncached.get(bid) is block or self._cached.get(bid) is block

    def on_free(self, block: KVCacheBlock) -> None:
        if block in self:
            raise ValueError(f"block {block.block_id} is already free")
        if block.block_hash is None:
            self._uncached[block.block_id] = block
        else:
            self._cached[block.block_id] = block
            self._on_free_cached(block)

    def on_touch(self, block: KVCacheBlock) -> None:
        if self._uncached.pop(block.block_id, None) is None:
            del self._cached[block.block_id]
            self._on_touch_cached(block)

    def _move_to_front(self, block: KVCacheBlock) -> None:
        self._uncached.move_to_end(block.block_id, last=False)

    @abstractmethod
    def _on_free_cached(self, block: KVCacheBlock) -> None:
        """A cached block became free (it is already in ``_cached``)."""

    @abstractmethod
    def _on_touch_cached(self, block: KVCacheBlock) -> None:
        """A free cached block got a reference again (it has left ``_cached``)."""


class TTLPolicy(_UncachedFirstPolicy):
    """Uncached blocks first, then cached blocks least recently freed first.

    A free cached block idle longer than ``cache_ttl_s`` is expired: lookups skip it and it is
    evicted with reason ``"ttl"``. Blocks enter the cached queue in free-time order, so the expired
    ones are always its head and ``ttl`` evicts them before any live block, in O(1).
    """

    name = "ttl"

    def __init__(
        self, blocks: Iterable[KVCacheBlock], clock: Callable[[], float], config: CacheConfig, bytes_per_block: int = 0
    ) -> None:
        super().__init__(blocks, clock, config, bytes_per_block)
        self._free_s: dict[int, float] = {}  # block id -> when it became free (cached blocks)

    def _on_free_cached(self, block: KVCacheBlock) -> None:
        self._free_s[block.block_id] = self.clock()

    def _on_touch_cached(self, block: KVCacheBlock) -> None:
        del self._free_s[block.block_id]

    def choose_victim(self) -> tuple[KVCacheBlock, str]:
        if self._uncached:
            return self._uncached.popitem(last=False)[1], self.name
        if not self._cached:
            raise ValueError("no free blocks")
        block = self._cached.popitem(last=False)[1]
        expired = self._is_expired(self._free_s.pop(block.block_id))
        return block, "ttl" if expired else "lru"

    def is_hit_allowed(self, block: KVCacheBlock) -> bool:
        free_s = self._free_s.get(block.block_id)
        return block.ref_cnt > 0 or free_s is None or not self._is_expired(free_s)

    def pop_expired(self) -> list[KVCacheBlock]:
        expired = []
        while self._cached:
            bid, block = next(iter(self._cached.items()))
            if not self._is_expired(self._free_s[bid]):
                break  # free-time order: everything after is younger
            del self._cached[bid], self._free_s[bid]
            expired.append(block)
        return expired

    def _is_expired(self, free_s: float) -> bool:
        return self.clock() - free_s > self.config.cache_ttl_s

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return [*self._uncached.values(), *self._cached.values()]


class LeafHeapPolicy(_UncachedFirstPolicy):
    """Uncached blocks first (FIFO), then childless cached blocks by a key from :meth:`priority`.

    Only free cached blocks without cached children are in the heap; a parent enters it when its
    last child is evicted (:meth:`on_leaf`). Touched blocks leave stale heap entries, skipped when
    popped and dropped when the heap grows past twice the live entries.
    """

    def __init__(
        self, blocks: Iterable[KVCacheBlock], clock: Callable[[], float], config: CacheConfig, bytes_per_block: int = 0
    ) -> None:
        super().__init__(blocks, clock, config, bytes_per_block)
        self._free_seq: dict[int, int] = {}  # block id -> free order (ties: least recent first)
        self._heap: list[tuple] = []  # (*priority, free_seq, stamp, block_id)
        self._stamp: dict[int, int] = {}  # block id -> stamp of its live heap entry
        self._counter = itertools.count()

    @abstractmethod
    def priority(self, block: KVCacheBlock) -> tuple:
        """Heap key of a free cached block: the lowest is evicted first. Fixed while free."""

    def _on_free_cached(self, block: KVCacheBlock) -> None:
        self._free_seq[block.block_id] = next(self._counter)
        if block.num_cached_children == 0:
            self._push(block)

    def _on_touch_cached(self, block: KVCacheBlock) -> None:
        del self._free_seq[block.block_id]
        self._stamp.pop(block.block_id, None)

    def on_leaf(self, block: KVCacheBlock) -> None:
        if self._cached.get(block.block_id) is block and block.block_id not in self._stamp:
            self._push(block)

    def choose_victim(self) -> tuple[KVCacheBlock, str]:
        if self._uncached:
            return self._uncached.popitem(last=False)[1], self.name
        while self._heap:
            *_, stamp, bid = heapq.heappop(self._heap)
            if self._stamp.get(bid) == stamp:
                del self._stamp[bid], self._free_seq[bid]
                return self._cached.pop(bid), self.name
        if self._cached:  # only reachable if a cached child outlived its free parent
            raise RuntimeError("free cached blocks exist but none is a leaf (children invariant broken)")
        raise ValueError("no free blocks")

    def _push(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        stamp = next(self._counter)
        self._stamp[bid] = stamp
        heapq.heappush(self._heap, (*self.priority(block), self._free_seq[bid], stamp, bid))
        if len(self._heap) > 2 * len(self._stamp) + 64:
            self._heap = [e for e in self._heap if self._stamp.get(e[-1]) == e[-2]]
            heapq.heapify(self._heap)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        order = list(self._uncached.values())
        heap = [e for e in self._heap if self._stamp.get(e[-1]) == e[-2]]
        heapq.heapify(heap)
        children = {bid: b.num_cached_children for bid, b in self._cached.items()}
        while heap:
            block = self._cached[heapq.heappop(heap)[-1]]
            order.append(block)
            parent = block.parent
            if parent is not None and parent.block_id in children and self._cached[parent.block_id] is parent:
                children[parent.block_id] -= 1
                if children[parent.block_id] == 0:
                    pid = parent.block_id
                    heapq.heappush(heap, (*self.priority(parent), self._free_seq[pid], -1, pid))
        return order


class LFUPolicy(LeafHeapPolicy):
    """Fewest hits since the block was cached first; ties least recently freed first."""

    name = "lfu"

    def __init__(
        self, blocks: Iterable[KVCacheBlock], clock: Callable[[], float], config: CacheConfig, bytes_per_block: int = 0
    ) -> None:
        super().__init__(blocks, clock, config, bytes_per_block)
        self._hits: dict[int, int] = {}

    def on_cache(self, block: KVCacheBlock) -> None:
        self._hits[block.block_id] = 0

    def on_hit(self, block: KVCacheBlock) -> None:
        self._hits[block.block_id] = self._hits.get(block.block_id, 0) + 1

    def priority(self, block: KVCacheBlock) -> tuple:
        return (self._hits.get(block.block_id, 0),)


class CostPolicy(LeafHeapPolicy):
    """Lowest ``reuse frequency * prefill time saved / bytes`` first.

    - Frequency: every use (the computation that cached the block, then each hit) adds 1 and
      decays with half-life ``cost_half_life_s``.
    - Time saved, in token-equivalents of the linear layers: a block at depth ``d`` (``d`` blocks
      before it) saves ``block_size * (1 + (d + 0.5) * block_size / cost_attention_tokens)``, since
      its tokens attend over everything before them.
    - Bytes: ``bytes_per_block`` (equal for all blocks today; kept so mixed layouts compare right).

    Stored as ``log(value) + decay_rate * t_last_use`` (see the module invariants). A parent's
    value may be below its children's; the leaf heap still evicts the children first.
    """

    name = "cost"

    def __init__(
        self, blocks: Iterable[KVCacheBlock], clock: Callable[[], float], config: CacheConfig, bytes_per_block: int = 0
    ) -> None:
        super().__init__(blocks, clock, config, bytes_per_block)
        self._decay_rate = math.log(2) / config.cost_half_life_s  # [1/s]
        self._log_freq_t: dict[int, float] = {}  # block id -> log(freq at t) + decay_rate * t

    def _add_use(self, block: KVCacheBlock) -> None:
        now_term = self._decay_rate * self.clock()
        old = self._log_freq_t.get(block.block_id)
        # log(exp(old) + exp(now_term)) without overflow
        if old is None:
            self._log_freq_t[block.block_id] = now_term
        else:
            hi, lo = max(old, now_term), min(old, now_term)
            self._log_freq_t[block.block_id] = hi + math.log1p(math.exp(lo - hi))

    def on_cache(self, block: KVCacheBlock) -> None:
        self._log_freq_t.pop(block.block_id, None)
        self._add_use(block)

    def on_hit(self, block: KVCacheBlock) -> None:
        self._add_use(block)

    def priority(self, block: KVCacheBlock) -> tuple:
        cfg = self.config
        saved = cfg.block_size * (1.0 + (block.depth + 0.5) * cfg.block_size / cfg.cost_attention_tokens)
        value = self._log_freq_t.get(block.block_id, 0.0) + math.log(saved) - math.log(max(1, self.bytes_per_block))
        return (value,)


EVICTION_POLICIES: MappingProxyType[str, type[EvictionPolicy]] = MappingProxyType(
    {cls.name: cls for cls in (LRUPolicy, LFUPolicy, TTLPolicy, CostPolicy)}
)


def make_eviction_policy(
    name: str | type[EvictionPolicy],
    blocks: Iterable[KVCacheBlock],
    clock: Callable[[], float],
    config: CacheConfig,
    bytes_per_block: int = 0,
) -> EvictionPolicy:
    """Builds the registered policy ``name`` (or an :class:`EvictionPolicy` subclass, as the trace
    benchmark's offline reference) holding ``blocks`` (head first).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if isinstance(name, type) and issubclass(name, EvictionPolicy):
        return name(blocks, clock, config, bytes_per_block)
    cls = EVICTION_POLICIES.get(name)
    if cls is None:
        raise InvalidInputError("eviction_policy", f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, "
                                                   f"got {name!r}")
    return cls(blocks, clock, config, bytes_per_block)
