"""The interface of one KV tier below the block pool (a local disk, a shared Redis, ...).

A tier is a dumb, possibly shared and possibly lossy store of named blobs: one entry per full
block, named by the block hash in hex (:attr:`~prefixcache.cache.tiers.entry.EntryKey.name`). It
knows nothing about requests or K/V layout: the entry's bytes carry their own header, verified by
:func:`~prefixcache.cache.tiers.entry.decode_entry` before any K/V is used, so a tier may lose,
truncate or mix up entries (a crash mid-write, an LRU eviction, another replica's bug) and the
worst outcome is a miss.

A backend raises on an unreachable store (any exception); :class:`~prefixcache.cache.tiers.stack.KVTierStack`
turns that into a miss, an error count and a warning, and rests the tier for a few seconds. Methods
may be called from the engine thread (lookups, loads, removals) and the writer thread (stores) at
once: backends are thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class KVTier(ABC):
    """One store of block entries (see the module docstring).

    Attributes:
        name: the tier's name in metrics and logs (``"disk"``, ``"redis"``).
    """

    name: str = "tier"

    @abstractmethod
    def lookup(self, names: Sequence[str]) -> int:
        """How many of ``names``, from the first, are present (a chain stops at its first miss)."""

    @abstractmethod
    def load(self, names: Sequence[str]) -> list[bytes | bytearray | None]:
        """The entries' bytes, ``None`` for each one missing now (lost since the lookup)."""

    @abstractmethod
    def store(self, name: str, blob: bytes, depth: int = 0) -> None:
        """Stores (or replaces) one entry; readers see the old entry, the new one or none, never a
        mix of both. ``depth``: the block's index in its chain (a size-capped tier may drop deeper
        entries first)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Removes an entry (a bad one); a missing entry is fine."""

    # Whether :meth:`retain` keeps anything (a tier with a size cap it can hold entries against).
    retains: bool = False

    def retain(self, names: Sequence[str], ttl_s: float, entry_bytes: Sequence[int]) -> int:
        """Keeps the entries ``names`` (a chain, head first; stored or still to be stored) for
        ``ttl_s`` seconds whatever the tier's own eviction, within its retention budget; returns
        how many from the head it keeps (``entry_bytes``: each entry's size). A tier without
        retention keeps none."""
        return 0

    def holds(self, names: Sequence[str]) -> list[bool]:
        """Whether the tier holds each entry, as far as it knows without reading it."""
        return [False] * len(names)

    def usage(self) -> dict[str, int]:
        """What the tier holds, where it knows (``{"entries": ..., "bytes": ...}``); else empty."""
        return {}

    def close(self) -> None:
        """Releases connections and files; the tier is not used afterwards."""
