"""Prefix-cache counters (vLLM's ``PrefixCacheStats``: requests, queries, hits) and evictions.

Two mutable records, each updated in one place: :class:`PrefixCacheStats` by the cache manager's
admission (once per request, at its first admission: a preempted request that is admitted again
may reuse its own still-cached blocks, but that recompute is neither a query nor a hit), and
:class:`EvictionStats` by the block pool's one eviction path (whatever the reason). A
:class:`PrefixCacheSnapshot` freezes both with the pool's state; the engine's metrics extend it.

A hit is a prompt token not computed because the cache served it, whichever way: a cached full
block, a partial-block copy (the first slots of a cached block) or a block loaded from a KV tier.
So ``hits`` counts what ``usage.prompt_tokens_details.cached_tokens`` reports (vLLM's rule: its
``prefix_cache_hits`` counter and ``cached_tokens`` agree); ``partial_hits`` and ``tier_hits`` are
the parts of it that came from partial-block copies and from the tiers.

Invariants: ``0 <= partial_hits + tier_hits <= hits <= queries``; ``num_hit_requests <=
num_requests``; every counter only grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache hit counters, in requests and tokens.

    Attributes:
        num_requests: admissions recorded.
        num_hit_requests: admissions with at least one cached token.
        queries: tokens looked up in the cache (the request's tokens at admission).
        hits: of those, tokens served from the cache (full blocks, partial copies, tier loads).
        partial_hits: of the hits, tokens copied from the first slots of a cached block.
        tier_hits: of the hits, tokens loaded from a KV tier (disk, Redis).
    """

    num_requests: int = 0
    num_hit_requests: int = 0
    queries: int = 0
    hits: int = 0
    partial_hits: int = 0
    tier_hits: int = 0

    def record(self, num_query_tokens: int, num_full_block_tokens: int, num_partial_tokens: int = 0,
               num_tier_tokens: int = 0) -> None:
        """Records one request admission.

        Args:
            num_query_tokens: tokens the request had when looked up, ``>= 0``.
            num_full_block_tokens: of those, tokens served by cached full blocks of the pool.
            num_partial_tokens: tokens copied from a partial hit, after the full blocks.
            num_tier_tokens: tokens loaded from the KV tiers, after the pool's full blocks. The
                three together (the request's ``num_cached_tokens``) are ``<= num_query_tokens``.

        Raises:
            ValueError: negative counts or more hits than queries.
        """
        num_hit_tokens = num_full_block_tokens + num_partial_tokens + num_tier_tokens
        if min(num_full_block_tokens, num_partial_tokens, num_tier_tokens) < 0 or num_hit_tokens > num_query_tokens:
            raise ValueError(
                f"need 0 <= hits <= num_query_tokens, got {num_full_block_tokens} full-block + "
                f"{num_partial_tokens} partial + {num_tier_tokens} tier hits for {num_query_tokens} queried tokens"
            )
        self.num_requests += 1
        self.num_hit_requests += num_hit_tokens > 0
        self.queries += num_query_tokens
        self.hits += num_hit_tokens
        self.partial_hits += num_partial_tokens
        self.tier_hits += num_tier_tokens

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` in ``[0, 1]`` (every kind of hit); 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class EvictionStats:
    """Cached blocks evicted (for reuse, expiry or invalidation; a reset is not counted).

    Attributes:
        num_evictions: blocks evicted.
        evictions_by_reason: the same, per reason (``"lru"``, ``"ttl"``, ``"invalidated"``, ...).
        evicted_age_s_total: sum over evictions of (eviction time - caching time), seconds.
    """

    num_evictions: int = 0
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    evicted_age_s_total: float = 0.0

    def record(self, reason: str, age_s: float) -> None:
        """Counts one eviction of a block cached ``age_s`` seconds ago."""
        self.num_evictions += 1
        self.evictions_by_reason[reason] = self.evictions_by_reason.get(reason, 0) + 1
        self.evicted_age_s_total += age_s

    @property
    def mean_evicted_age_s(self) -> float:
        """Mean time between caching and eviction of the evicted blocks, in seconds (0.0 if none)."""
        return self.evicted_age_s_total / self.num_evictions if self.num_evictions else 0.0


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    """A point-in-time copy of the cache's counters and the block pool's state (vLLM's metric names).

    Attributes:
        num_requests: admissions recorded.
        num_hit_requests: admissions with at least one cached token.
        prefix_cache_queries: prompt tokens looked up.
        prefix_cache_hits: of those, tokens served from the cache: full blocks, partial-block
            copies and KV-tier loads (``cached_tokens``, summed).
        num_evictions: cached blocks evicted (a reset is not counted).
        num_blocks_total: blocks in the pool.
        num_blocks_in_use: blocks with ``ref_cnt > 0``.
        num_blocks_cached: blocks in the hash map (in use or free).
        num_blocks_free: blocks that can be allocated (cached ones included).
        prefix_cache_partial_hits: of the hits, tokens copied from partial-block hits.
        prefix_cache_tier_hits: of the hits, tokens loaded from the KV tiers.
        evictions_by_reason: evictions per reason (``"lru"``, ``"ttl"``, ``"cost"``, ...).
        cached_bytes: KV bytes held by cached blocks.
        mean_evicted_age_s: mean seconds between caching and eviction of evicted blocks.
        num_forks: samples forked from an ``n > 1`` request (sharing its blocks).
        num_cow_copies: shared blocks copied on a sample's first write (copy-on-write).
    """

    num_requests: int
    num_hit_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_blocks_cached: int
    num_blocks_free: int
    prefix_cache_partial_hits: int = 0
    prefix_cache_tier_hits: int = 0
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    cached_bytes: int = 0
    mean_evicted_age_s: float = 0.0
    num_forks: int = 0
    num_cow_copies: int = 0

    @property
    def hit_rate(self) -> float:
        """``prefix_cache_hits / prefix_cache_queries`` (every kind of hit); 0.0 before any query."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
