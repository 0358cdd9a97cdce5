"""What the operator dashboard reads from the engine: per-block use, cache breakers, the prefix tree.

:class:`CacheInsight` hooks the engine's request finish (``LLMEngine.finish_hooks``): on the engine
thread, before the request's blocks are freed, it records which of its blocks served it
(:class:`~prefixcache.cache.prefix_tree.BlockUsage`) and compares its prompt with the earlier prompts
of its namespace (:class:`~prefixcache.cache.breakers.BreakerTracker`; a request that served no
cached token is explained, :class:`~prefixcache.cache.breakers.ZeroHits`). :meth:`CacheInsight.report`
builds the tree and the breakers for one viewer, also on the engine thread (the async engine's
:meth:`~prefixcache.engine.async_engine.AsyncLLMEngine.inspect`).

Namespaces: a request's is ``(root_key, tenant_key)`` (model, cache_salt, adapter, tenant). A viewer
with a tenant sees only blocks and breakers keyed with that tenant, plus approved shared prefixes
(keyed with none); text (previews, breaker spans) only when the caller allows it.

Never raises into the engine: a failure in the hook is counted (``num_errors``) and swallowed.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import TYPE_CHECKING

from prefixcache.cache.breakers import BreakerTracker, ZeroHits
from prefixcache.cache.hashing import tenant_extra_key, tenant_of_extra_key
from prefixcache.cache.prefix_tree import BlockUsage, build_prefix_tree, namespace_of

if TYPE_CHECKING:
    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.request import Request


def empty_report() -> dict:
    """A :meth:`CacheInsight.report` with no prefix and no breaker, taken at no time (``time_s``
    None): the dashboard's tree while a long step holds the engine thread and none was taken yet."""
    return {"prefixes": [], "breakers": {"observed": 0, "by_kind": {}, "top": [], "count": 0, "tokens_lost": 0},
            "zero_hits": ZeroHits().report(), "pins": {"budget_blocks": None, "blocks": []}, "block_hits": 0, "distinct_hit_blocks": 0, "errors": 0, "time_s": None}


class CacheInsight:
    """Per-block use and cache breakers of one engine (see the module docstring).

    Args:
        engine: the engine to observe; the hook is added to its ``finish_hooks``.
        max_breaker_chains: prompts remembered per namespace to find breakers against.
    """

    def __init__(self, engine: LLMEngine, max_breaker_chains: int = 64) -> None:
        self.engine = engine
        self.block_size = engine.config.block_size
        self.usage = BlockUsage()
        self.breakers = BreakerTracker(self.block_size, self._decode, max_chains=max_breaker_chains)
        self.zero_hits = ZeroHits()  # requests that served no cached token, and why
        self.num_errors = 0
        engine.finish_hooks.append(self.on_finish)

    def _decode(self, token_ids) -> str:
        return self.engine.tokenizer.decode(list(token_ids))

    def on_finish(self, request: Request) -> None:
        """Records a finishing request (engine thread; its blocks are still held)."""
        if request.request_id != request.group_id or request.num_cached_tokens is None:
            return  # a forked sample (its parent counts) or never admitted
        try:
            kv = self.engine.kv_cache_manager
            blocks = kv.get_blocks(request.request_id)
            self.usage.record(blocks, request.num_cached_tokens // self.block_size, kv.block_pool.clock())
            if kv.enable_caching:
                namespace = (request.root_key, request.tenant_key)
                self.breakers.observe(namespace, request.prompt_token_ids)
                if request.num_cached_tokens == 0:
                    self.zero_hits.record(namespace, self.breakers.last_shared_tokens, request.num_prompt_tokens,
                                          self.block_size)
        except Exception:  # the dashboard must never fail a request
            self.num_errors += 1

    def report(self, tenant: str | None, previews: bool, max_breakers: int = 10) -> dict:
        """The prefix tree and the breakers one viewer may see (engine thread).

        Args:
            tenant: the viewer's tenant under tenant isolation; ``None``: the operator, sees all.
            previews: include decoded text (tree previews, breaker spans).
            max_breakers: breaker groups listed.

        Returns:
            ``{"prefixes": [...], "breakers": {...}, "zero_hits": {...}, "pins": {...}, "block_hits",
            "distinct_hit_blocks"}`` (``zero_hits``: :meth:`ZeroHits.report`).
        """
        mine = tenant_extra_key(tenant)

        def visible_key(extra_key: bytes) -> bool:  # its tenant's own blocks, int4's output-keyed ones too
            return tenant is None or extra_key == b"" or tenant_of_extra_key(extra_key) == tenant

        def visible(namespace: Hashable) -> bool:
            return tenant is None or namespace[1] == mine

        pool = self.engine.kv_cache_manager.block_pool
        prefixes = build_prefix_tree(pool, self.usage, pool.clock(), decode=self._decode if previews else None,
                                     visible_key=visible_key)
        tracker = self.breakers
        top = []
        for group in tracker.top(max_breakers, visible):
            entry = group.to_dict(previews)
            entry["namespace"] = namespace_of(*group.namespace)
            top.append(entry)
        return {
            "prefixes": prefixes,
            "breakers": {"observed": tracker.num_observed, "by_kind": tracker.by_kind(visible), "top": top,
                         "count": sum(v["count"] for v in tracker.by_kind(visible).values()),
                         "tokens_lost": sum(v["tokens_lost"] for v in tracker.by_kind(visible).values())},
            "zero_hits": self.zero_hits.report(visible),
            # cache breakpoints' pinned blocks (cache/pins.py) the viewer may see, and the pool's pin budget
            "pins": {"budget_blocks": self.engine.kv_cache_manager.pins.max_blocks,
                     "blocks": self.engine.kv_cache_manager.pins.snapshot(lambda b: visible_key(b.extra_key))},
            "block_hits": self.usage.block_hits,
            "distinct_hit_blocks": self.usage.distinct_hit_blocks,
            "errors": self.num_errors,
            "time_s": time.time(),
        }
