"""Admission order of the waiting queue: which waiting request the scheduler tries next.

A policy is a small strategy object the :class:`~prefixcache.engine.scheduler.Scheduler` calls with
the waiting queue (an ``OrderedDict`` in arrival order, preempted requests at its head)::

    for request in policy.order(waiting):            # lazily, best first
        admission = kv.admit(request, budget) ...     # None: stop (head-of-line, as FCFS)
        policy.on_admit(request, waiting)

``priority`` (vLLM's: an int, lower = earlier, default 0) is the outer key of every policy.

``fcfs`` (vLLM's default): arrival order (within a priority). O(admitted) per step.

``lpm`` (longest prefix match, after SGLang's policy of that name) reorders only under memory
pressure, and is otherwise ``fcfs``:

    reorder in a step  <=>  the pool evicted a cached block to make room for an allocation
                            (``BlockPool.num_allocation_evictions`` grew) in this step or one of the
                            ``scheduling_pressure_steps - 1`` steps before it

where steps are those with a waiting queue (the calls of ``order``; evictions made while nothing
waited are seen at the next one). While nothing is evicted, every block a waiting request could hit
stays cached until it is admitted, whatever the order, and a request admitted after the one that
computes a shared prefix hits it in either order (blocks are cached when allocated): arrival order
computes the same prefill, and reordering would only cost the TTFT of the requests passed over.
One counter compared per step, O(1). The rule reacts to evictions instead of predicting them (the
queue's uncached need against the free uncached blocks: with ``lru``'s single free queue, cached
blocks are evicted while uncached ones wait further back, and the cheap bound, free minus cached
blocks, fired early in the queue replays and cost TTFT p99 there), so the first eviction of an
episode happens in arrival order. SGLang instead falls back to FCFS for queues over 128 requests,
for the cost of its per-step matching, which the cached match lengths below avoid. Without prefix
caching nothing cached is ever evicted, so ``lpm`` is then ``fcfs``.

Under pressure, within a priority:

1. preempted requests (they were admitted already), then
2. *starving* requests, oldest first: waiting longer than ``scheduling_max_wait_s``, or overtaken
   by ``scheduling_max_overtakes`` admissions of requests that arrived after them (of the same or a
   lower priority; 0 = arrival order). A step's admissions end as soon as one makes a request
   reach that count, and a starving request that does not fit blocks the queue as in FCFS, so the
   overtake bound is hard; the age bound says when a request stops yielding, not when memory
   frees up;
3. the rest by longest cached prefix (the pool's verified hit length, in blocks) first, then in
   groups: requests whose first uncached block is the same (they share an uncached prefix) are
   adjacent, the group ordered by its oldest member. The first is admitted and the rest hit its
   blocks: blocks are cached when allocated, so a later admission of the same step already hits
   them, and a first member whose prompt does not fit the step's token budget takes all of that
   budget (running requests go first, and an admission's chunk is ``min(rest, budget)``; the
   scheduler's reserve for short waiting requests trims only running chunks), so nobody is admitted
   before its whole prompt is allocated, and cached. No sibling computes the prefix again, without
   holding anyone back.

Cheap ordering: each waiting request's match length is cached and refreshed, in a step that
reorders, only when a block hash it depends on entered or left the pool's cache map (the pool
records them, see :meth:`BlockPool.track_changed_hashes`; an index maps each hash to the waiting
requests whose prompt contains it; a step that does not reorder only marks them). The sorted order
is cached too and rebuilt (O(W log W)) only when a match length or the starving set changed, or
reordering resumes; an arrival is inserted into it, admissions and aborts just drop out of it.
The hit length is the pool's only: the KV tiers can't tell how many further blocks of a request
they hold without I/O per waiting request per step (Redis answers over the network, the disk tier
stats files that other processes write too, and neither reports changes that would let a length
be cached). A policy that refuses hits over time (``ttl``) may leave a cached length stale until
the next change of its hashes.

Invariants: ``order`` yields each waiting request at most once per call and no other request; a
request arrived after ``R`` (same or lower priority) is admitted before ``R`` at most
``scheduling_max_overtakes`` times (a step that does not reorder admits in arrival order and
overtakes nobody); ``reordering`` is False in every step without evictions in its window.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prefixcache.cache.hashing import BlockHash
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.config import SchedulerConfig
from prefixcache.request import Request, RequestStatus

__all__ = ["FCFSPolicy", "LPMPolicy", "SchedulingPolicy", "make_scheduling_policy"]


class SchedulingPolicy:
    """FCFS within priorities; the base of the other policies (``fcfs``).

    Args:
        kv: the cache manager (for match lengths).
        config: the scheduler options.
        clock: current time in seconds, the clock of ``Request.arrival_s``.
    """

    name = "fcfs"
    reordering = False  # whether the last ``order`` departed from arrival order (lpm under pressure)

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.kv = kv
        self.config = config
        self.clock = clock
        self._num_prioritized = 0  # waiting requests with priority != 0

    def on_add(self, request: Request) -> None:
        """A request joined the waiting queue (new, or preempted)."""
        self._num_prioritized += request.priority != 0

    def on_remove(self, request: Request) -> None:
        """A request left the waiting queue (admitted, finished or aborted)."""
        self._num_prioritized -= request.priority != 0

    def order(self, waiting: OrderedDict[str, Request]) -> Iterator[Request]:
        """The waiting requests, best first (lazily: only as far as the caller reads)."""
        if not self._num_prioritized:
            return iter(waiting.values())
        return iter(sorted(waiting.values(), key=lambda r: r.priority))  # stable: FCFS within a priority

    def on_admit(self, request: Request, waiting: OrderedDict[str, Request]) -> None:
        """``request`` was admitted (it is still in ``waiting`` until the step's admissions end)."""


FCFSPolicy = SchedulingPolicy


@dataclass(slots=True)
class _Entry:
    """A waiting request's cached ordering state."""

    request: Request
    seq: int  # order of joining the queue (arrivals; a preempted request rejoins with a new one)
    hashes: list[BlockHash]  # the hashes its lookup may hit (indexed in _deps)
    match_blocks: int = 0  # cached verified hit length, in blocks
    num_overtakes: int = 0

    @property
    def next_hash(self) -> BlockHash | None:
        return self.hashes[self.match_blocks] if self.match_blocks < len(self.hashes) else None


class LPMPolicy(SchedulingPolicy):
    """Longest cached prefix first, shared uncached prefixes grouped, starvation bounded (``lpm``)."""

    name = "lpm"

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        super().__init__(kv, config, clock)
        kv.block_pool.track_changed_hashes()
        self._entries: dict[str, _Entry] = {}
        self._deps: dict[BlockHash, set[str]] = {}  # hash -> waiting requests whose lookup may hit it
        self._dirty: set[str] = set()  # match length to refresh
        self._overtaken: set[str] = set()  # overtaken max_overtakes times: not overtaken again
        self._num_arrivals = 0
        self._sorted: list[tuple[tuple, str]] = []  # cached order: (key, request id), may hold stale ids
        self._pending: list[_Entry] = []  # arrivals not in _sorted yet
        self._group_seq: dict[BlockHash, int] = {}  # first uncached block's hash -> its group's key
        self._starving: frozenset[str] = frozenset()
        self._stale = True
        self._num_steps = 0  # steps with a waiting queue (calls of order)
        self._num_evictions_seen = kv.block_pool.num_allocation_evictions
        self._pressure_step: int | None = None  # the last step that saw new evictions

    # -- bookkeeping ----------------------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        super().on_add(request)
        seq, self._num_arrivals = self._num_arrivals, self._num_arrivals + 1
        bs = self.kv.block_size
        num = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        entry = _Entry(request, seq, request.block_hashes[:num])
        self._entries[request.request_id] = entry
        if self.config.scheduling_max_overtakes == 0 and request.status == RequestStatus.WAITING:
            self._overtaken.add(request.request_id)  # never overtaken: arrival order
        for h in entry.hashes:
            self._deps.setdefault(h, set()).add(request.request_id)
        self._dirty.add(request.request_id)
        if request.status == RequestStatus.WAITING:
            self._pending.append(entry)

    def on_remove(self, request: Request) -> None:
        super().on_remove(request)
        entry = self._entries.pop(request.request_id, None)
        if entry is not None:
            self._unindex(entry)

    def _unindex(self, entry: _Entry) -> None:
        rid = entry.request.request_id
        for h in entry.hashes:
            deps = self._deps.get(h)
            if deps is not None:
                deps.discard(rid)
                if not deps:
                    del self._deps[h]
        self._dirty.discard(rid)
        self._overtaken.discard(rid)

    def _take_changed_hashes(self) -> None:
        """Marks for refresh the waiting requests whose hashes entered or left the cache (no lookup)."""
        for h in self.kv.block_pool.take_changed_hashes():
            deps = self._deps.get(h)
            if deps:
                self._dirty |= deps

    def _refresh(self) -> None:
        """Recomputes the match length of the requests marked for refresh."""
        bs = self.kv.block_size
        for rid in self._dirty:
            entry = self._entries.get(rid)
            if entry is None:
                continue
            match = self.kv.get_computed_blocks(entry.request)[1] // bs
            if match != entry.match_blocks:
                entry.match_blocks = match
                self._stale = True
        self._dirty.clear()

    # -- order ----------------------------------------------------------------------------------

    def _find_starving(self, waiting: OrderedDict[str, Request]) -> frozenset[str]:
        """Waiting requests over the age bound (from the queue's head, oldest first) or overtaken
        too often."""
        now, max_wait = self.clock(), self.config.scheduling_max_wait_s
        old = []
        for rid, request in waiting.items():
            if request.status == RequestStatus.PREEMPTED:
                continue
            if now - request.arrival_s <= max_wait:
                break
            old.append(rid)
        return frozenset(old).union(self._overtaken)

    def _key(self, entry: _Entry) -> tuple:
        h = entry.next_hash
        group = entry.seq if h is None else self._group_seq.setdefault(h, entry.seq)
        return (entry.request.priority, 2, -entry.match_blocks, group, entry.seq)

    def _update_sorted(self, waiting: OrderedDict[str, Request]) -> None:
        """Rebuilds the cached order of the waiting requests (priority, -match, group, seq) when a
        match length or the starving set changed; otherwise inserts the new arrivals."""
        pending, self._pending = self._pending, []
        if not self._stale:
            for entry in pending:
                if waiting.get(entry.request.request_id) is entry.request:
                    bisect.insort(self._sorted, (self._key(entry), entry.request.request_id))
            return
        entries = [self._entries[rid] for rid, r in waiting.items() if r.status == RequestStatus.WAITING]
        self._group_seq = {}
        for entry in entries:  # arrival order: a group's key is its oldest member's seq
            h = entry.next_hash
            if h is not None:
                self._group_seq.setdefault(h, entry.seq)
        self._sorted = sorted((self._key(e), e.request.request_id) for e in entries)
        self._stale = False

    def order(self, waiting: OrderedDict[str, Request]) -> Iterator[Request]:
        self._take_changed_hashes()
        if not self._under_pressure():
            self._pending.clear()
            self._stale = True  # rebuilt when reordering resumes
            return super().order(waiting)
        self._refresh()
        starving = self._find_starving(waiting)
        if starving != self._starving:
            self._starving, self._stale = starving, True
        self._update_sorted(waiting)
        first = []
        for i, (rid, r) in enumerate(waiting.items()):  # the preempted are the queue's head, newest first
            if r.status != RequestStatus.PREEMPTED:
                break
            first.append(((r.priority, 0, i), rid))
        first += [((waiting[rid].priority, 1, self._entries[rid].seq), rid) for rid in starving]
        first.sort()
        return self._stream(heapq.merge(first, self._sorted), waiting, starving)

    def _under_pressure(self) -> bool:
        """Counts this step (one with a waiting queue) and tells whether to reorder in it (see the
        module docstring); sets :attr:`reordering`. O(1)."""
        pool = self.kv.block_pool
        self._num_steps += 1
        if pool.num_allocation_evictions != self._num_evictions_seen:  # evicted since the last step
            self._num_evictions_seen, self._pressure_step = pool.num_allocation_evictions, self._num_steps
        self.reordering = (self._pressure_step is not None
                           and self._num_steps - self._pressure_step < self.config.scheduling_pressure_steps)
        return self.reordering

    def _stream(self, merged: Iterator[tuple[tuple, str]], waiting: OrderedDict[str, Request],
                starving: frozenset[str]) -> Iterator[Request]:
        """The merged order's requests still waiting, each once (the cached order may hold requests
        admitted, aborted, preempted or starving since; those come from ``first`` or not at all).
        Ends early once an admission of this step made a request reach the overtake bound, so that
        it is overtaken no more (it goes first from the next step)."""
        for key, rid in merged:
            request = waiting.get(rid)
            if request is None or request.status == RequestStatus.RUNNING:
                continue
            if key[1] == 2:
                if request.status != RequestStatus.WAITING or rid in starving:
                    continue
                if not self._overtaken <= starving:
                    return
            yield request

    def on_admit(self, request: Request, waiting: OrderedDict[str, Request]) -> None:
        """Counts an overtake for each earlier arrival (same or higher priority value) still waiting.
        Called before ``request``'s status becomes RUNNING."""
        if request.status == RequestStatus.PREEMPTED:
            return
        limit = self.config.scheduling_max_overtakes
        for rid, other in waiting.items():
            if other is request:
                break
            if other.status != RequestStatus.WAITING or other.priority > request.priority:
                continue
            entry = self._entries[rid]
            entry.num_overtakes += 1
            if entry.num_overtakes >= limit:
                self._overtaken.add(rid)

    def num_overtakes(self, request_id: str) -> int:
        """How many later arrivals were admitted before this waiting request (0 if unknown)."""
        entry = self._entries.get(request_id)
        return entry.num_overtakes if entry is not None else 0


# The classes of config.SCHEDULING_POLICIES' names (the names live low, for the flags; a test checks both agree).
SCHEDULING_POLICY_CLASSES: dict[str, type[SchedulingPolicy]] = {"fcfs": SchedulingPolicy, "lpm": LPMPolicy}


def make_scheduling_policy(kv: KVCacheManager, config: SchedulerConfig,
                           clock: Callable[[], float] = time.monotonic) -> SchedulingPolicy:
    """The policy named by ``config.scheduling_policy``.

    Raises:
        InvalidInputError: an unknown name (from ``config.validate``).
    """
    config.validate()
    return SCHEDULING_POLICY_CLASSES[config.scheduling_policy](kv, config, clock)
