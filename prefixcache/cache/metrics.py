"""Prefix-cache counters (vLLM's ``PrefixCacheStats``: requests, queries, hits).

Invariants: ``0 <= hits + partial_hits <= queries``; ``num_hit_requests <= num_requests``; every counter only
grows. The scheduler records a request once, at its first admission: a preempted request that
is admitted again may reuse its own still-cached blocks, but that recompute is neither a query nor
a hit (../shared/cases C5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.cache.block_pool import BlockPool


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache hit counters, in requests and tokens.

    Attributes:
        num_requests: admissions recorded.
        num_hit_requests: admissions with at least one cached token.
        queries: tokens looked up in the cache (the request's tokens at admission).
        hits: tokens served from the cache as full blocks.
        partial_hits: tokens copied from the first slots of a cached block (partial-block reuse).
    """

    num_requests: int = 0
    num_hit_requests: int = 0
    queries: int = 0
    hits: int = 0
    partial_hits: int = 0

    def record(self, num_query_tokens: int, num_hit_tokens: int, num_partial_hit_tokens: int = 0) -> None:
        """Records one request admission.

        Args:
            num_query_tokens: tokens the request had when looked up, ``>= 0``.
            num_hit_tokens: of those, tokens found in the cache as full blocks.
            num_partial_hit_tokens: tokens copied from a partial hit, after the full blocks;
                ``num_hit_tokens + num_partial_hit_tokens <= num_query_tokens``.

        Raises:
            ValueError: negative counts or more hits than queries.
        """
        if min(num_hit_tokens, num_partial_hit_tokens) < 0 or (
            num_hit_tokens + num_partial_hit_tokens > num_query_tokens
        ):
            raise ValueError(
                f"need 0 <= hits + partial hits <= num_query_tokens, got {num_hit_tokens} + "
                f"{num_partial_hit_tokens} hits for {num_query_tokens} queried tokens"
            )
        self.num_requests += 1
        self.num_hit_requests += num_hit_tokens + num_partial_hit_tokens > 0
        self.queries += num_query_tokens
        self.hits += num_hit_tokens
        self.partial_hits += num_partial_hit_tokens

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` in ``[0, 1]`` (full blocks only); 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0

    def snapshot(self, pool: BlockPool) -> PrefixCacheSnapshot:
        """Freezes these counters together with the pool's state."""
        num_free = pool.get_num_free_blocks()
        return PrefixCacheSnapshot(
            num_requests=self.num_requests,
            num_hit_requests=self.num_hit_requests,
            queries=self.queries,
            hits=self.hits,
            hit_rate=self.hit_rate,
            num_evictions=pool.num_evictions,
            num_blocks_in_use=pool.num_blocks - num_free,
            num_blocks_cached=pool.num_cached_blocks,
            num_blocks_free=num_free,
            partial_hits=self.partial_hits,
            evictions_by_reason=dict(pool.evictions_by_reason),
            cached_bytes=pool.cached_bytes,
            mean_evicted_age_s=pool.mean_evicted_age_s,
        )


@dataclass(frozen=True, slots=True)
class PrefixCacheSnapshot:
    """A point-in-time copy of :class:`PrefixCacheStats` and the block pool's state.

    Attributes:
        num_requests: admissions recorded.
        num_hit_requests: admissions with at least one cached token.
        queries: tokens looked up.
        hits: tokens served from the cache.
        hit_rate: ``hits / queries`` (0.0 before any query).
        num_evictions: cached blocks evicted for reuse (a reset is not counted).
        num_blocks_in_use: blocks with ``ref_cnt > 0``.
        num_blocks_cached: blocks in the hash map (in use or free).
        num_blocks_free: blocks that can be allocated (cached ones included).
        partial_hits: tokens copied from partial hits.
        evictions_by_reason: evictions per policy reason (``"lru"``, ``"ttl"``, ``"cost"``, ...).
        cached_bytes: KV bytes held by cached blocks.
        mean_evicted_age_s: mean seconds between caching and eviction of evicted blocks.
    """

    num_requests: int
    num_hit_requests: int
    queries: int
    hits: int
    hit_rate: float
    num_evictions: int
    num_blocks_in_use: int
    num_blocks_cached: int
    num_blocks_free: int
    partial_hits: int = 0
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    cached_bytes: int = 0
    mean_evicted_age_s: float = 0.0
