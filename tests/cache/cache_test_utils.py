"""Shared factories for the cache tests (vLLM's ``make_request`` style)."""

from __future__ import annotations

import dataclasses

from prefixcache.cache.config import CacheConfig
from prefixcache.cache.hashing import BlockHasher, make_root_key, tenant_extra_key
from prefixcache.cache.kv_cache_manager import KVCacheManager
from prefixcache.request import Request
from prefixcache.sampling_params import SamplingParams

MODEL_FINGERPRINT = b"test-model"


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    block_size: int = 4,
    cache_salt: str | None = None,
    max_tokens: int = 16,
    tenant: str | None = None,
    num_shared_blocks: int = 0,
) -> Request:
    """A real greedy :class:`Request` with chained block hashes over ``prompt_token_ids``.

    ``tenant`` keys every block from ``num_shared_blocks`` on (an approved shared prefix before).
    """
    return Request(
        request_id,
        prompt_token_ids,
        SamplingParams(max_tokens=max_tokens, temperature=0),
        BlockHasher(block_size),
        make_root_key(MODEL_FINGERPRINT, cache_salt),
        tenant_key=tenant_extra_key(tenant),
        num_shared_blocks=num_shared_blocks,
    )


def make_manager(num_blocks: int, block_size: int, *, clock=None, bytes_per_block: int = 0,
                 enable_caching: bool = True, **cache_options) -> KVCacheManager:
    """A manager over a ``CacheConfig(block_size=..., **cache_options)`` pool."""
    config = dataclasses.replace(CacheConfig(block_size=block_size, enable_prefix_caching=enable_caching),
                                 **cache_options)
    kwargs = {"clock": clock} if clock is not None else {}
    return KVCacheManager(num_blocks, config, bytes_per_block=bytes_per_block, **kwargs)


def admit(manager, request, num_new_tokens: int | None = None):
    """The scheduler's admission (``KVCacheManager.admit``) of up to ``num_new_tokens`` tokens
    (default: the rest of the prompt), then those tokens computed.

    Returns:
        ``(new_blocks, num_hit_tokens)``; ``new_blocks`` is ``None`` when the pool is too small.
    """
    admission = manager.admit(request, request.num_tokens if num_new_tokens is None else num_new_tokens)
    if admission is None:
        return None, 0
    request.num_computed_tokens += admission.num_new_tokens
    return admission.new_blocks, admission.num_hit_tokens


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]
