"""The Redis tier: entries shared by every replica of a deployment.

One key per full block, ``prefixcache:<namespace>:<block hash hex>``, written with ``SET key blob
EX ttl`` (so it works under ``maxmemory-policy allkeys-lru`` or ``volatile-*`` alike); a hit
refreshes the TTL (``GETEX``). A lookup is one round trip (pipelined ``EXISTS``), a load another
(pipelined ``GETEX``). Entries are verified by the stack like any tier's, so a key holding another
block's bytes (a bug elsewhere, a collision) is a miss and is deleted.

Errors (refused connection, timeout, server gone) propagate: the stack counts them, logs a warning
and rests the tier, and requests go on with the pool alone. Short socket timeouts keep a dead
server from stalling the engine loop for long.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prefixcache.cache.tiers.base import KVTier

CONNECT_TIMEOUT_S = 0.5
SOCKET_TIMEOUT_S = 2.0


class RedisTier(KVTier):
    """Entries as Redis strings (see the module docstring).

    Args:
        url: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS, ``unix://`` for a socket).
        namespace: part of every key; engines whose entries can never match use different ones.
        ttl_s: seconds an entry lives after its last store or hit.

    Raises:
        ValueError: a malformed URL (the ``redis`` client's message). Nothing is contacted here.
    """

    name = "redis"

    def __init__(self, url: str, namespace: str, ttl_s: float) -> None:
        import redis  # only deployments that use this tier need the client imported

        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S
        )
        self._prefix = f"prefixcache:{namespace}:"
        self.ttl_s = max(1, math.ceil(ttl_s))

    def _key(self, name: str) -> str:
        return self._prefix + name

    def lookup(self, names: Sequence[str]) -> int:
        if not names:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.exists(self._key(name))
        present = pipe.execute()
        return next((i for i, p in enumerate(present) if not p), len(names))

    def load(self, names: Sequence[str]) -> list[bytes | bytearray | None]:
        if not names:
            return []
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.getex(self._key(name), ex=self.ttl_s)
        return list(pipe.execute())

    def store(self, name: str, blob: bytes, depth: int = 0) -> None:
        self._client.set(self._key(name), blob, ex=self.ttl_s)

    def remove(self, name: str) -> None:
        self._client.delete(self._key(name))

    def close(self) -> None:
        self._client.close()
