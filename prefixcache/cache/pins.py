"""Pinned prefixes: cache breakpoints that keep a prefix's blocks in the pool for a while.

A client marks a breakpoint (Anthropic's ``cache_control: {"type": "ephemeral", "ttl": "5m"}``,
or :class:`CacheBreakpoint` offline): the prompt's prefix up to it is kept for ``ttl_s`` seconds,
whatever the eviction policy would do, and every hit on it starts the time again. Mapped onto
blocks, the prefix's *full* blocks are pinned (a breakpoint inside a block pins the blocks before
it); a pin holds one reference on each block (``ref_cnt += 1``), so a pinned block is not among
the free blocks and no policy can choose it::

    | block 0 | block 1 | block 2 | blo^ck 3 ...        breakpoint at token 3.5 * B
    |<------- pinned -------------->|                   3 full blocks pinned

Invariants:
- A pinned block is cached (``block_hash`` set) and holds exactly one reference of the table's;
  its content can't change while pinned (it is never free, so never evicted).
- Pins are prefix-closed: a block is pinned only with every block before it in its chain, and
  ``ttl_s`` and ``expires_s`` never grow along a chain (a block is covered by every breakpoint
  that covers its children). So parents never expire before their children, and a release frees
  children first: the children-before-parents rule of every eviction policy holds.
- At most ``max_blocks`` blocks are pinned (the budget: ``max_pinned_fraction`` of the pool); a
  prefix over the budget gets the longest head that fits, and the caller is told how much.
- Expiry is lazy: :meth:`PinTable.release_expired` runs once per scheduler step; a pin idle
  exactly ``ttl_s`` still holds, one idle longer is released at the next step's sweep (C27).
- Pinning never changes visibility: lookups verify a pinned block like any other (root key,
  tenant extra key), so another salt or tenant can't hit it.
- One exception to "never evicted while the pin lives": when no request holds a block and the
  next request can't be admitted, the pins yield (:meth:`PinTable.yield_all`), so that pins can
  never stall an otherwise idle engine until they expire.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prefixcache.cache.block import KVCacheBlock
from prefixcache.errors import InvalidInputError

MAX_CACHE_BREAKPOINTS = 4  # per request, as Anthropic allows
CACHE_TTLS_S = {"5m": 300.0, "1h": 3600.0}  # Anthropic's ttl values


@dataclass(frozen=True, slots=True)
class CacheBreakpoint:
    """Keep the prompt's first ``num_tokens`` tokens cached for ``ttl_s`` seconds after last use.

    Attributes:
        num_tokens: the prefix's length in tokens, ``>= 1`` and at most the prompt's.
        ttl_s: how long the prefix stays pinned after its last use, in seconds, ``> 0``.
    """

    num_tokens: int
    ttl_s: float = CACHE_TTLS_S["5m"]


@dataclass(frozen=True, slots=True)
class PinResult:
    """What one breakpoint of a request got: its prefix's full blocks pinned, within the budget.

    Attributes:
        breakpoint: the breakpoint asked for.
        num_pinned_tokens: tokens pinned (whole blocks, ``<= breakpoint.num_tokens``); less than
            ``breakpoint.num_tokens // block_size * block_size`` when the budget ran out.
    """

    breakpoint: CacheBreakpoint
    num_pinned_tokens: int


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """A request's prompt tokens split as Anthropic's usage reports them (they add up to the prompt).

    Attributes:
        input_tokens: prompt tokens neither read from the cache nor written under a breakpoint.
        cache_read_input_tokens: prompt tokens served from the prefix cache (``num_cached_tokens``).
        cache_creation_input_tokens: tokens computed now and pinned under a breakpoint.
        ephemeral_5m_input_tokens: of those, the ones whose longest covering ttl is under an hour.
        ephemeral_1h_input_tokens: the others.
    """

    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


def cache_usage(num_prompt_tokens: int, num_cached_tokens: int, pins: Sequence[PinResult]) -> CacheUsage:
    """Splits a prompt into read, created (pinned now) and other tokens.

    The pinned prefixes are nested (each is the head of the prompt), so the tokens written under
    breakpoints are ``[num_cached_tokens, longest pinned prefix)``; each is attributed to the
    longest ttl among the breakpoints whose pinned prefix covers it.
    """
    num_read = num_cached_tokens
    num_5m = num_1h = 0
    start = num_read
    for pin in sorted(pins, key=lambda p: p.num_pinned_tokens):
        end = pin.num_pinned_tokens
        if end > start:
            ttl_s = max(p.breakpoint.ttl_s for p in pins if p.num_pinned_tokens >= end)
            if ttl_s >= CACHE_TTLS_S["1h"]:
                num_1h += end - start
            else:
                num_5m += end - start
            start = end
    created = num_5m + num_1h
    return CacheUsage(num_prompt_tokens - num_read - created, num_read, created, num_5m, num_1h)


def check_breakpoints(breakpoints: object, num_prompt_tokens: int) -> tuple[CacheBreakpoint, ...]:
    """A request's breakpoints, checked, ordered by position.

    Raises:
        InvalidInputError: (field ``cache_control``) not a sequence of :class:`CacheBreakpoint`,
            more than :data:`MAX_CACHE_BREAKPOINTS`, a position outside ``[1, num_prompt_tokens]``
            or a ttl that is not a finite number > 0.
    """
    if isinstance(breakpoints, CacheBreakpoint):
        breakpoints = (breakpoints,)
    if not isinstance(breakpoints, (list, tuple)) or not all(isinstance(b, CacheBreakpoint) for b in breakpoints):
        raise InvalidInputError("cache_control", f"cache_control must be a CacheBreakpoint or a list of them, "
                                                 f"got {breakpoints!r:.80}")
    if len(breakpoints) > MAX_CACHE_BREAKPOINTS:
        raise InvalidInputError("cache_control", f"cache_control: at most {MAX_CACHE_BREAKPOINTS} breakpoints per "
                                                 f"request, got {len(breakpoints)}")
    for b in breakpoints:
        if isinstance(b.num_tokens, bool) or not isinstance(b.num_tokens, int) \
                or not 1 <= b.num_tokens <= num_prompt_tokens:
            raise InvalidInputError("cache_control", f"cache_control: a breakpoint's num_tokens must be in "
                                                     f"[1, {num_prompt_tokens}] (the prompt's length), "
                                                     f"got {b.num_tokens!r}")
        if isinstance(b.ttl_s, bool) or not isinstance(b.ttl_s, (int, float)) or not 0 < b.ttl_s < math.inf:
            raise InvalidInputError("cache_control", f"cache_control: ttl_s must be a finite number > 0, "
                                                     f"got {b.ttl_s!r}")
    return tuple(sorted(breakpoints, key=lambda b: b.num_tokens))


@dataclass(slots=True)
class Pin:
    """One pinned block: its reference is held until ``expires_s`` (refreshed by hits)."""

    block: KVCacheBlock
    ttl_s: float  # the longest ttl of the breakpoints covering it
    expires_s: float  # released at the first sweep after this time


class PinTable:
    """The pool's pinned blocks, their expiry and the budget.

    Args:
        take_refs: adds one reference to each block (``BlockPool.touch``).
        drop_refs: drops one reference from each block, in eviction order (``BlockPool.free_blocks``).
        max_blocks: the budget, ``>= 0`` (0: nothing is ever pinned).
        clock: current time in seconds (the pool's).
    """

    def __init__(self, take_refs: Callable[[Iterable[KVCacheBlock]], None],
                 drop_refs: Callable[[Iterable[KVCacheBlock]], None], max_blocks: int,
                 clock: Callable[[], float]) -> None:
        self._take_refs = take_refs
        self._drop_refs = drop_refs
        self.max_blocks = max_blocks
        self.clock = clock
        self.pins: dict[int, Pin] = {}  # block id -> its pin
        # (expires_s, seq, block id); an entry is stale when the pin's expires_s moved on
        self._heap: list[tuple[float, int, int]] = []
        self._seq = itertools.count()
        self.num_released = 0  # blocks released at expiry
        self.num_yielded = 0  # blocks released early for a request that could not run otherwise

    def __len__(self) -> int:
        return len(self.pins)

    def __contains__(self, block: KVCacheBlock) -> bool:
        pin = self.pins.get(block.block_id)
        return pin is not None and pin.block is block

    def pin(self, chain: Sequence[KVCacheBlock], ttl_s: float) -> int:
        """Pins the head of ``chain`` (or extends its pins) for ``ttl_s`` from now.

        Args:
            chain: a request's cached blocks, head first (its block table's first blocks).
            ttl_s: seconds, ``> 0``.

        Returns:
            How many blocks from the head are pinned now: ``len(chain)`` unless a block is not
            cached or the budget ran out there.
        """
        expires_s = self.clock() + ttl_s
        for i, block in enumerate(chain):
            pin = self.pins.get(block.block_id)
            if pin is not None and pin.block is block:
                pin.ttl_s = max(pin.ttl_s, ttl_s)
                self._extend(pin, expires_s)
                continue
            if block.block_hash is None or len(self.pins) >= self.max_blocks:
                return i
            self._take_refs([block])
            pin = self.pins[block.block_id] = Pin(block, ttl_s, expires_s)
            heapq.heappush(self._heap, (expires_s, next(self._seq), block.block_id))
        return len(chain)

    def refresh(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A hit on these blocks: each pinned one holds for its ttl from now again."""
        if not self.pins:
            return
        now = self.clock()
        for block in blocks:
            pin = self.pins.get(block.block_id)
            if pin is not None and pin.block is block:
                self._extend(pin, now + pin.ttl_s)

    def _extend(self, pin: Pin, expires_s: float) -> None:
        if expires_s > pin.expires_s:
            pin.expires_s = expires_s
            heapq.heappush(self._heap, (expires_s, next(self._seq), pin.block.block_id))

    def release_expired(self) -> int:
        """Releases the pins idle longer than their ttl (``now > expires_s``), children first; the
        blocks become free cached blocks, evictable as any other. O(1) when none expired.

        Returns:
            The number of blocks released.
        """
        now, expired = self.clock(), []
        while self._heap and self._heap[0][0] < now:
            expires_s, _, block_id = heapq.heappop(self._heap)
            pin = self.pins.get(block_id)
            if pin is not None and pin.expires_s == expires_s:
                expired.append(self.pins.pop(block_id))
        self._release(expired)
        self.num_released += len(expired)
        return len(expired)

    def yield_all(self) -> int:
        """Releases every pin now (see the module docstring); returns how many blocks."""
        released = list(self.pins.values())
        self.pins.clear()
        self._heap.clear()
        self._release(released)
        self.num_yielded += len(released)
        return len(released)

    def release_where(self, stale: Callable[[KVCacheBlock], bool]) -> int:
        """Releases the pins of the blocks ``stale`` selects and of their descendants (pins stay
        prefix-closed); returns how many blocks."""
        gone = {bid for bid, pin in self.pins.items() if stale(pin.block)}
        if not gone:
            return 0
        for pin in sorted(self.pins.values(), key=lambda p: p.block.depth):  # parents first
            parent = pin.block.parent
            if parent is not None and parent.block_id in gone and parent.block_id in self.pins:
                gone.add(pin.block.block_id)
        released = [self.pins.pop(bid) for bid in gone]
        self._release(released)
        return len(released)

    def _release(self, pins: list[Pin]) -> None:
        pins.sort(key=lambda p: -p.block.depth)  # children before parents
        self._drop_refs([p.block for p in pins])
        if len(self._heap) > 2 * len(self.pins) + 64:  # drop the stale entries
            self._heap = [e for e in self._heap if (p := self.pins.get(e[2])) is not None and p.expires_s == e[0]]
            heapq.heapify(self._heap)

    def snapshot(self, visible: Callable[[KVCacheBlock], bool] = lambda block: True) -> list[dict]:
        """The pinned blocks ``visible`` lets a viewer see, for display: ``block_id``, ``depth``,
        ``ttl_s``, ``expires_in_s`` (seconds left now), soonest expiry first."""
        now = self.clock()
        return [{"block_id": p.block.block_id, "depth": p.block.depth, "ttl_s": p.ttl_s,
                 "expires_in_s": round(p.expires_s - now, 3)}
                for p in sorted(self.pins.values(), key=lambda p: (p.expires_s, -p.block.depth)) if visible(p.block)]


def pinned_budget(max_pinned_fraction: float, num_blocks: int) -> int:
    """The most blocks pins may hold: ``floor(max_pinned_fraction * num_blocks)``."""
    return int(max_pinned_fraction * num_blocks)
