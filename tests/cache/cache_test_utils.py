"""Shared factories for the cache tests (vLLM's ``make_request`` style)."""

from __future__ import annotations

from prefixcache.cache.hashing import BlockHasher, make_root_key, tenant_extra_key
from prefixcache.engine.request import Request
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


def admit(manager, request, num_new_tokens: int | None = None):
    """Scheduler-style admission: lookup, then allocate the hits plus the rest of the prompt.

    Returns:
        ``(new_blocks, num_hit_tokens)``; ``new_blocks`` is ``None`` when the pool is too small.
    """
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, hits, num_hit_tokens)
    if new_blocks is not None:
        request.num_computed_tokens = num_hit_tokens + num_new_tokens
    return new_blocks, num_hit_tokens


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]
