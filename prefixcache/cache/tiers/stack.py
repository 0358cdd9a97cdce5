"""The tiers below the block pool, in lookup order, with their writer thread and counters.

Data path (the cache manager drives it, see ``KVCacheManager.admit``)::

    pool hits | disk hits ... | redis hits ... | computed
              ^ lookup continues past the pool's last hit, tier by tier, in chain order,
                stopping at the first block no tier holds

- Load (engine thread, at admission): :meth:`KVTierStack.load_chain` asks each tier in turn for
  the blocks after the previous one's last hit, verifies each entry against the request
  (:func:`~prefixcache.cache.tiers.entry.decode_entry`) and stops at the first miss or bad entry;
  a bad entry is removed from its tier. The payloads become ordinary cached pool blocks: the
  runner copies them into the pool before the forward pass (``LoadOp``).
- Store (write-through, off the engine loop): after each step the engine copies the K/V of the
  blocks computed in that step out of the pool and :meth:`KVTierStack.submit` queues them; a
  background thread encodes each entry and stores it in every tier. The queue is bounded
  (``max_queued_bytes``): when it is full a block is not stored (counted as a drop), the engine
  never waits for a tier.
- Promotion: blocks loaded from a lower tier (Redis) are queued for the tiers above it (the local
  disk) the same way, so the next restart of this replica finds them locally.
- Retention (OpenAI's ``prompt_cache_retention: "24h"``): once a request's prompt is computed,
  :meth:`KVTierStack.retain` marks its full blocks' entries in the tiers that retain (the disk
  tier) for ``ttl_s``, within their budget; blocks those tiers neither hold nor have queued (pool
  hits whose entries the size cap removed earlier) are returned for the engine to store again.
- A tier that raises (Redis stopped, a full disk) is counted (``errors``), logged once, and rested
  for ``retry_s`` seconds: lookups skip it and stores to it are dropped, so requests go on with the
  pool (and the other tiers) alone.

- Load or recompute: the stack keeps, per tier, a moving average of the seconds one block
  took to load (lookup + read + verify), and the engine reports what computing a block costs
  (:meth:`KVTierStack.observe_compute`: forward-pass seconds per token x block size over steps of
  at least a block of tokens, averaged the same way). A tier whose loads are slower than
  recomputing is not asked (the next tier goes on from the same block; ``slow_skips`` counts the
  lookups skipped), except once every ``probe_s`` seconds, which re-measures it.

- KV-cache groups: with several (a sliding-window model), each group's blocks are entries of their
  own, named by the group-keyed hash (``entry_keys(..., group_id)``), and the cache manager asks for
  each group's part of a hit (``KVCacheManager._load_hybrid_from_tiers``); ``queries`` and ``hits``
  count group 0's chain (the hit's tokens), the byte counters every group's entries.

Counters per tier (tokens in tokens): ``queries`` (tokens looked up in it at requests' first
admission), ``hits`` (of those, tokens loaded from it), ``bytes_loaded``, ``bytes_stored``,
``stores``, ``store_drops``, ``bad_entries`` (entries that failed verification and were removed),
``errors``, ``slow_skips``, and per-block load and store latency histograms.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.cache.kv_cache_groups import group_block_hash
from prefixcache.cache.tiers.base import KVTier
from prefixcache.errors import InvalidInputError
from prefixcache.cache.tiers.entry import (
    FORMAT_VERSION, EntryError, EntryKey, KVBlockLayout, decode_entry, encode_entry, entry_bytes, prefix_digests,
    sha256,
)

if TYPE_CHECKING:
    from prefixcache.cache.config import CacheConfig
    from prefixcache.request import Request

logger = logging.getLogger(__name__)

LATENCY_BOUNDS_S = (0.0005, 0.001, 0.005, 0.02, 0.1, 0.5)  # histogram bucket upper bounds; +inf last
DEFAULT_MAX_QUEUED_BYTES = 256 << 20
DEFAULT_RETRY_S = 5.0
DEFAULT_PROBE_S = 30.0
EMA_WEIGHT = 0.2  # weight of the newest sample in the per-block load and compute averages


@dataclass(slots=True)
class TierStats:
    """One tier's counters (see the module docstring)."""

    queries: int = 0
    hits: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    stores: int = 0
    store_drops: int = 0
    bad_entries: int = 0
    errors: int = 0
    load_latency: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_S) + 1))
    store_latency: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_S) + 1))
    load_seconds: float = 0.0  # the latencies' sums (a Prometheus histogram's _sum)
    store_seconds: float = 0.0
    slow_skips: int = 0  # lookups skipped: loading from this tier was slower than recomputing

    def as_dict(self) -> dict:
        return {name: (list(v) if isinstance(v, list) else v)
                for name in self.__slots__ for v in [getattr(self, name)]}


@dataclass(frozen=True, slots=True)
class TierLoad:
    """What :meth:`KVTierStack.load_chain` found.

    Attributes:
        payloads: verified K/V of consecutive blocks from the first asked (layout of the entries).
        num_queried_blocks: the blocks asked for.
        per_tier: ``(tier name, blocks asked of it, blocks loaded from it)`` for each tier asked.
    """

    payloads: list[memoryview]
    num_queried_blocks: int
    per_tier: list[tuple[str, int, int]]

    def cut(self, num_blocks: int) -> TierLoad:
        """The first ``num_blocks`` payloads only (a hybrid model's hit ends where every KV-cache
        group can serve), each tier credited with the loaded blocks it gave among those."""
        per_tier, left = [], num_blocks
        for name, asked, got in self.per_tier:
            per_tier.append((name, asked, min(got, left)))
            left -= min(got, left)
        return TierLoad(self.payloads[:num_blocks], self.num_queried_blocks, per_tier)


class KVTierStack:
    """The configured tiers in lookup order (fastest first), one writer thread for them all.

    Args:
        tiers: the backends, in lookup order.
        layout: this engine's K/V payload dtype and shape.
        max_queued_bytes: payload bytes waiting for the writer at most (more are dropped).
        retry_s: seconds a failing tier rests before it is tried again.
        probe_s: seconds between lookups in a tier skipped as slower than recomputing.
        clock: seconds (``time.monotonic``).
    """

    def __init__(
        self,
        tiers: list[KVTier],
        layout: KVBlockLayout,
        *,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        retry_s: float = DEFAULT_RETRY_S,
        probe_s: float = DEFAULT_PROBE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tiers = tiers
        self.layout = layout
        self.retry_s = retry_s
        self.probe_s = probe_s
        # Seconds per block: each tier's loads, and computing one (None: not measured yet).
        self.load_s_per_block: dict[str, float | None] = {t.name: None for t in tiers}
        self.compute_s_per_block: float | None = None
        self._last_probe = {t.name: float("-inf") for t in tiers}
        self.clock = clock
        self.stats = {t.name: TierStats() for t in tiers}
        self._resting_until = {t.name: None for t in tiers}  # None: healthy
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_queued_bytes // layout.payload_bytes))
        self._queued: dict[str, int] = {}  # entry name -> times it waits in the queue now
        self._writer = threading.Thread(target=self._write_loop, name="prefixcache-kv-tier-writer", daemon=True)
        self._writer.start()

    # -- keys -----------------------------------------------------------------------------------

    def prefix_digests(self, request: Request, num_blocks: int) -> list[bytes]:
        """The prefix digests of the request's first ``num_blocks`` blocks
        (:func:`~prefixcache.cache.tiers.entry.prefix_digests`). A sha256 chain over the whole
        prefix, the same for every KV-cache group: a lookup, store or retention that keys several
        groups' blocks of one request computes it once and passes it to :meth:`entry_keys`."""
        return prefix_digests(request.root_key, request.all_token_ids, self.layout.block_size,
                              request.block_extra_key, num_blocks)

    def entry_keys(self, request: Request, start: int, stop: int, group_id: int = 0,
                   digests: Sequence[bytes] | None = None) -> list[EntryKey]:
        """The request's expectations of the entries of its blocks ``[start, stop)`` (full blocks) of
        KV-cache group ``group_id``: keyed (and verified) by
        :func:`~prefixcache.cache.kv_cache_groups.group_block_hash`, so a group's entry never serves
        another group, and group 0's key is the block hash (one-group models' entries as before).

        ``digests``: the request's :meth:`prefix_digests` of at least ``stop`` blocks, computed by the
        caller once for several calls; computed here when None.

        Raises:
            ValueError: ``digests`` holds fewer than ``stop`` digests.
        """
        bs, hashes, tokens = self.layout.block_size, request.block_hashes, request.all_token_ids
        if digests is None:
            digests = self.prefix_digests(request, stop)
        elif len(digests) < stop:
            raise ValueError(f"digests: {len(digests)} prefix digests given, blocks [{start}, {stop}) need {stop}")
        root_hash = request.block_hasher.root_hash(request.root_key)
        root_digest = sha256(request.root_key)
        extra_digests: dict[bytes, bytes] = {}
        keys = []
        for i in range(start, stop):
            extra = request.block_extra_key(i)
            if extra not in extra_digests:
                extra_digests[extra] = sha256(extra)
            keys.append(EntryKey(
                group_block_hash(hashes[i], group_id), hashes[i - 1] if i else root_hash, digests[i], root_digest,
                extra_digests[extra], i, tuple(tokens[i * bs : (i + 1) * bs]),
            ))
        return keys

    # -- load -----------------------------------------------------------------------------------

    def load_chain(self, request: Request, start: int, stop: int, group_id: int = 0,
                   digests: Sequence[bytes] | None = None) -> TierLoad:
        """Loads the request's blocks ``[start, stop)`` of KV-cache group ``group_id`` that the tiers
        hold, in chain order (``digests``: as :meth:`entry_keys`).

        Each tier continues where the previous one stopped; the result ends at the first block
        no tier holds, or whose entry fails verification (that entry is removed). Never raises
        for a tier's fault (see the module docstring).
        """
        if stop <= start:
            return TierLoad([], 0, [])
        keys = self.entry_keys(request, start, stop, group_id, digests)
        payloads: list[memoryview] = []
        per_tier = []
        for tier in self.tiers:
            if len(payloads) == len(keys) or self._is_resting(tier):
                continue
            if self._slower_than_compute(tier):
                continue  # the next tier (or the forward pass) goes on from here
            asked = keys[len(payloads):]
            got = self._load_from(tier, asked)
            per_tier.append((tier.name, len(asked), len(got)))
            if got and self.tiers[0] is not tier:  # promotion: the faster tiers above get a copy
                self._enqueue(list(zip(asked, got)), self.tiers[: self.tiers.index(tier)])
            payloads += got
        return TierLoad(payloads, len(keys), per_tier)

    def observe_compute(self, seconds: float, num_tokens: int) -> None:
        """Records a forward pass: ``seconds`` for ``num_tokens`` tokens (the engine, per step).

        Steps of fewer tokens than a block (decode of a few sequences: a token there costs many
        times a prefill token) are ignored: the rule compares loading a block with prefilling it.
        """
        if num_tokens >= self.layout.block_size:
            self.compute_s_per_block = _ema(self.compute_s_per_block, seconds / num_tokens * self.layout.block_size)

    def _slower_than_compute(self, tier: KVTier) -> bool:
        """Whether to skip ``tier``: its loads measured slower than computing, and no probe is due."""
        load, compute = self.load_s_per_block[tier.name], self.compute_s_per_block
        if load is None or compute is None or load <= compute:
            return False
        now = self.clock()
        if now - self._last_probe[tier.name] >= self.probe_s:
            self._last_probe[tier.name] = now
            return False
        with self._lock:
            self.stats[tier.name].slow_skips += 1
        return True

    def _load_from(self, tier: KVTier, keys: list[EntryKey]) -> list[memoryview]:
        stats, t0 = self.stats[tier.name], time.perf_counter()
        try:
            n = tier.lookup([k.name for k in keys])
            blobs = tier.load([k.name for k in keys[:n]]) if n else []
        except Exception as e:  # a tier's fault is a miss, never the request's error
            self._fail(tier, "load", e)
            return []
        self._recovered(tier)
        out: list[memoryview] = []
        for key, blob in zip(keys, blobs):
            if blob is None:
                break
            try:
                out.append(decode_entry(blob, key, self.layout))
            except EntryError as e:
                logger.warning("kv tier %s: entry %s is bad (%s); removed", tier.name, key.name, e)
                with self._lock:
                    stats.bad_entries += 1
                self._remove(tier, key.name)
                break
        seconds = (time.perf_counter() - t0) / max(1, len(out))
        if out:
            self.load_s_per_block[tier.name] = _ema(self.load_s_per_block[tier.name], seconds)
        with self._lock:
            stats.bytes_loaded += len(out) * self.layout.payload_bytes
            for _ in out:
                stats.load_latency[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
                stats.load_seconds += seconds
        return out

    def _remove(self, tier: KVTier, name: str) -> None:
        try:
            tier.remove(name)
        except Exception as e:
            self._fail(tier, "remove", e)

    def record_admission(self, load: TierLoad) -> None:
        """Counts one request's first admission: tokens asked of each tier and loaded from it."""
        bs = self.layout.block_size
        with self._lock:
            for name, asked, got in load.per_tier:
                self.stats[name].queries += asked * bs
                self.stats[name].hits += got * bs

    # -- store ----------------------------------------------------------------------------------

    def submit(self, entries: list[tuple[EntryKey, bytes]], tiers: list[KVTier] | None = None) -> None:
        """Queues computed blocks (their keys and K/V payloads) for ``tiers`` (default: every
        tier); never blocks."""
        self._enqueue(entries, self.tiers if tiers is None else tiers)

    def _enqueue(self, entries: list[tuple[EntryKey, bytes]], tiers: list[KVTier]) -> None:
        for key, payload in entries:
            try:
                with self._lock:  # counted first: the writer may take the entry at once
                    self._queued[key.name] = self._queued.get(key.name, 0) + 1
                self._queue.put_nowait((key, payload, tiers))
            except queue.Full:
                with self._lock:
                    self._unqueued(key.name)
                    for tier in tiers:
                        self.stats[tier.name].store_drops += 1

    def _unqueued(self, name: str) -> None:
        """One queued copy of entry ``name`` is gone (stored or dropped). Under the lock."""
        left = self._queued.pop(name) - 1
        if left:
            self._queued[name] = left

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # never let one entry stop the writer
                logger.exception("kv tier writer: could not store an entry")
            finally:
                if item is not None:
                    with self._lock:
                        self._unqueued(item[0].name)
                self._queue.task_done()

    # -- retention ------------------------------------------------------------------------------

    @property
    def retaining_tiers(self) -> list[KVTier]:
        """The tiers that can keep entries against their own eviction (the disk tier)."""
        return [t for t in self.tiers if t.retains]

    def retain(self, request: Request, num_blocks: int, ttl_s: float, group_id: int = 0,
               start: int = 0, digests: Sequence[bytes] | None = None) -> tuple[int, list[int]]:
        """Keeps the entries of the request's blocks ``[start, num_blocks)`` of KV-cache group
        ``group_id`` (group 0: its computed prompt's full blocks from the head; a sliding group: the
        window before the end) in every retaining tier for ``ttl_s`` seconds, within their budgets
        (``digests``: as :meth:`entry_keys`).

        Returns:
            ``(end, missing)``: every retaining tier keeps the blocks ``[start, end)`` (``end`` is
            ``start`` without one, less than ``num_blocks`` where a budget ran out), and the indices
            among those of the blocks no retaining tier holds and none waits in the writer's queue
            for (their entries were removed before): the caller stores them again (:meth:`submit` to
            :attr:`retaining_tiers`). Never raises for a tier's fault (it then keeps nothing).
        """
        tiers = [t for t in self.retaining_tiers if not self._is_resting(t)]
        if num_blocks <= start or not tiers:
            return start, []
        keys = self.entry_keys(request, start, num_blocks, group_id, digests)
        names, sizes = [k.name for k in keys], [entry_bytes(k, self.layout) for k in keys]
        retained, held = len(names), [False] * len(names)
        for tier in tiers:
            try:
                retained = min(retained, tier.retain(names, ttl_s, sizes))
                held = [a or b for a, b in zip(held, tier.holds(names))]
            except Exception as e:
                self._fail(tier, "retain", e)
                return start, []
        with self._lock:
            missing = [start + i for i in range(retained) if not held[i] and names[i] not in self._queued]
        return start + retained, missing

    def _write(self, key: EntryKey, payload: bytes, tiers: list[KVTier]) -> None:
        blob = encode_entry(key, self.layout, payload)
        for tier in tiers:
            stats = self.stats[tier.name]
            if self._is_resting(tier):
                with self._lock:
                    stats.store_drops += 1
                continue
            t0 = time.perf_counter()
            try:
                tier.store(key.name, blob, key.depth)
            except Exception as e:
                self._fail(tier, "store", e)
                continue
            self._recovered(tier)
            seconds = time.perf_counter() - t0
            with self._lock:
                stats.stores += 1
                stats.bytes_stored += len(blob)
                stats.store_latency[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
                stats.store_seconds += seconds

    def flush(self) -> None:
        """Waits until every queued block has been stored (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        """Stores what is queued, stops the writer and closes the tiers."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as e:
                logger.warning("kv tier %s: close failed: %r", tier.name, e)

    # -- health ---------------------------------------------------------------------------------

    def _is_resting(self, tier: KVTier) -> bool:
        until = self._resting_until[tier.name]
        return until is not None and self.clock() < until

    def _fail(self, tier: KVTier, what: str, error: Exception) -> None:
        with self._lock:
            self.stats[tier.name].errors += 1
            was_healthy = self._resting_until[tier.name] is None
            self._resting_until[tier.name] = self.clock() + self.retry_s
        if was_healthy:
            logger.warning("kv tier %s unavailable (%s: %r); serving without it, retrying every %.0f s",
                           tier.name, what, error, self.retry_s)

    def _recovered(self, tier: KVTier) -> None:
        if self._resting_until[tier.name] is not None:
            with self._lock:
                self._resting_until[tier.name] = None
            logger.warning("kv tier %s is back", tier.name)

    def snapshot(self) -> dict[str, dict]:
        """Each tier's counters (and, where it knows, its entries and bytes held), by tier name."""
        with self._lock:
            out = {name: stats.as_dict() for name, stats in self.stats.items()}
        for tier in self.tiers:
            out[tier.name].update(tier.usage())
        return out


def _ema(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - EMA_WEIGHT) * average + EMA_WEIGHT * sample


def tier_namespace(hash_algo: str, layout: KVBlockLayout) -> str:
    """The part of every entry's location naming what kind of entries they are: entry format,
    hash algorithm, K/V dtype and payload shape (block size included)."""
    return f"v{FORMAT_VERSION}-{hash_algo}-{layout.dtype}-" + "x".join(str(d) for d in layout.shape)


def make_kv_tiers(config: CacheConfig, layout: KVBlockLayout) -> KVTierStack | None:
    """The stack of the tiers ``config`` names (disk first, then Redis), or ``None`` for none.

    Raises:
        InvalidInputError: (``kv_disk_dir``) the disk directory can't be created (a file in its
            path, no permission); ValueError: a malformed Redis URL.
    """
    namespace = tier_namespace(config.hash_algo, layout)
    tiers: list[KVTier] = []
    if config.kv_disk_dir is not None:
        from prefixcache.cache.tiers.disk import DiskTier

        try:
            retained = int(config.max_retained_disk_fraction * config.kv_disk_bytes)
            tiers.append(DiskTier(config.kv_disk_dir, namespace, config.kv_disk_bytes, retained))
        except OSError as e:
            raise InvalidInputError("kv_disk_dir", f"kv_disk_dir: cannot create or use the directory "
                                                   f"{config.kv_disk_dir!r} ({e.strerror or e})") from None
    if config.kv_redis_url is not None:
        from prefixcache.cache.tiers.redis_tier import RedisTier

        tiers.append(RedisTier(config.kv_redis_url, namespace, config.kv_redis_ttl_s))
    return KVTierStack(tiers, layout) if tiers else None
