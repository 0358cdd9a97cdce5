"""OpenAI's prompt-caching hints on the OpenAI routes: ``prompt_cache_key`` and
``prompt_cache_retention``.

``prompt_cache_key`` is a routing hint only: a gateway in front of several replicas may send
requests with one key to one replica (where their prefix is cached); it never isolates anything.
Isolation stays ``cache_salt`` and the tenant (case C26: two keys under one tenant and salt share
their prefix; one key under two tenants shares nothing).

``prompt_cache_retention``: ``"in_memory"`` is what the server always does (the pool, then its
eviction policy). ``"24h"`` asks to keep the prefix for a day in a tier below the pool; keeping it
needs a disk tier (``--kv-disk-dir``) that holds entries against its size cap for 24 hours, which
the disk tier does not do yet, so ``"24h"`` is refused with a 400 that says so (accepting it and
keeping nothing would let a client believe its prefix is kept). Any other value is a 400.
"""

from __future__ import annotations

from prefixcache.entrypoints.api_errors import APIError, clip

PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")


def check_prompt_cache_retention(retention: str | None, has_disk_tier: bool) -> None:
    """Refuses a ``prompt_cache_retention`` the server can't honour.

    Args:
        retention: the request's value (None: ``"in_memory"``).
        has_disk_tier: whether the engine has a disk tier (``--kv-disk-dir``).

    Raises:
        APIError: 400 (``prompt_cache_retention``) for an unknown value, or ``"24h"``.
    """
    if retention is None or retention == "in_memory":
        return
    if retention not in PROMPT_CACHE_RETENTIONS:
        raise APIError(400, f"prompt_cache_retention must be 'in_memory' or '24h', got {clip(retention)}",
                       "prompt_cache_retention")
    if not has_disk_tier:
        raise APIError(400, "prompt_cache_retention '24h' keeps a prefix in the disk tier, and this server has "
                            "none (start it with --kv-disk-dir); use 'in_memory'", "prompt_cache_retention",
                       "unsupported_parameter")
    raise APIError(400, "prompt_cache_retention '24h' is not supported yet: the disk tier does not hold entries "
                        "against its size cap; use 'in_memory'", "prompt_cache_retention", "unsupported_parameter")
