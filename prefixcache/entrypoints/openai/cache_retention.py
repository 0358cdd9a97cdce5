"""OpenAI's prompt-caching hints on the OpenAI routes: ``prompt_cache_key`` and
``prompt_cache_retention``.

``prompt_cache_key`` is a routing hint only: a gateway in front of several replicas may send
requests with one key to one replica (where their prefix is cached); it never isolates anything.
Isolation stays ``cache_salt`` and the tenant (case C26: two keys under one tenant and salt share
their prefix; one key under two tenants shares nothing).

``prompt_cache_retention``: ``"in_memory"`` is what the server always does (the pool, then its
eviction policy). ``"24h"`` keeps the prompt's full blocks for 24 hours in the disk tier
(``--kv-disk-dir``), out of its size-cap eviction, within ``--max-retained-disk-fraction`` of
``--kv-disk-bytes`` (:mod:`prefixcache.cache.tiers.disk`): after the pool evicted them, a later
request loads them from the disk. A request over the budget keeps the head that fits; a
non-streamed answer says how much in the header ``x-prefixcache-retained-tokens: KEPT/ASKED``
(tokens, whole blocks). Without a disk tier that retains, ``"24h"`` is refused with a 400 naming
the flag to start the server with (accepting it and keeping nothing would let a client believe its
prefix is kept). Any other value is a 400.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.entrypoints.openai.api_errors import APIError, clip
from prefixcache.outputs import RequestOutput

PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
RETENTION_S = {"24h": 24 * 3600.0}  # seconds a prefix is kept in the disk tier, per value
RETAINED_TOKENS_HEADER = "x-prefixcache-retained-tokens"


def check_prompt_cache_retention(retention: str | None, has_disk_tier: bool, retains: bool = True) -> float | None:
    """Refuses a ``prompt_cache_retention`` the server can't honour.

    Args:
        retention: the request's value (None: ``"in_memory"``).
        has_disk_tier: whether the engine has a disk tier (``--kv-disk-dir``).
        retains: whether that tier keeps retained entries (``--max-retained-disk-fraction`` > 0).

    Returns:
        Seconds to keep the prompt in the disk tier (``"24h"``), or None (``"in_memory"``).

    Raises:
        APIError: 400 (``prompt_cache_retention``) for an unknown value, or ``"24h"`` without a
            disk tier that retains.
    """
    if retention is None or retention == "in_memory":
        return None
    if retention not in PROMPT_CACHE_RETENTIONS:
        raise APIError(400, f"prompt_cache_retention must be 'in_memory' or '24h', got {clip(retention)}",
                       "prompt_cache_retention")
    if not has_disk_tier:
        raise APIError(400, "prompt_cache_retention '24h' keeps a prefix in the disk tier, and this server has "
                            "none (start it with --kv-disk-dir); use 'in_memory'", "prompt_cache_retention",
                       "unsupported_parameter")
    if not retains:
        raise APIError(400, "prompt_cache_retention '24h' keeps a prefix in the disk tier, and this server keeps "
                            "none there (it was started with --max-retained-disk-fraction 0); use 'in_memory'",
                       "prompt_cache_retention", "unsupported_parameter")
    return RETENTION_S[retention]


def retained_tokens_header(outs: Iterable[RequestOutput], block_size: int) -> dict[str, str]:
    """``{x-prefixcache-retained-tokens: KEPT/ASKED}`` of a request's final outputs (each prompt
    counted once: its first sample's), or ``{}`` when retention was not asked. ``ASKED``: the
    prompts' full blocks in tokens; ``KEPT`` less than it means the retention budget ran out."""
    prompts = {o.request_id: o for o in outs if o.num_retained_tokens is not None}
    if not prompts:
        return {}
    kept = sum(o.num_retained_tokens for o in prompts.values())
    asked = sum(o.num_prompt_tokens // block_size * block_size for o in prompts.values())
    return {RETAINED_TOKENS_HEADER: f"{kept}/{asked}"}
