"""vLLM's KV cache event structs (msgspec, tagged array-like) and the conversion of a step's
records into one :class:`KVEventBatch`; the layout is described in :mod:`prefixcache.cache.kv_events`.

Imported by the publisher only (events on), so msgspec is loaded only then.
"""

from __future__ import annotations

from typing import Any

import msgspec

from prefixcache.cache.kv_events import AllCleared, RecordedEvents, StoredBlocks

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events: ``ts`` (wall-clock seconds), ``events``, ``data_parallel_rank``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events; encoded as ``[ClassName, field, ...]``."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one chain were cached.

    Attributes:
        block_hashes: their hashes, chain order (uint64).
        parent_block_hash: hash of the block before the first one; ``None`` for a chain's first.
        token_ids: their tokens, ``len == len(block_hashes) * block_size``.
        block_size: tokens per block.
        lora_id: a stable id of the LoRA adapter's content (31 bits, never 0); ``None``: base model.
        medium: ``"GPU"`` or ``"CPU"``, where the pool lives.
        lora_name: the adapter's name as last requested; ``None``: base model.
        extra_keys: per block, its namespace (module docstring) or ``None``; ``None`` if no block
            has one.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache (evicted, expired, invalidated or dropped after a failed step)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was emptied (``reset_prefix_cache``)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire_batch(recorded: RecordedEvents, data_parallel_rank: int | None = 0) -> KVEventBatch:
    """The :class:`KVEventBatch` of one step's records (same order)."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    bs, medium = recorded.block_size, recorded.medium
    for item in recorded.records:
        if isinstance(item, StoredBlocks):
            extra = item.extra_keys if any(k is not None for k in item.extra_keys) else None
            events.append(BlockStored(item.hashes, item.parent, item.token_ids, bs, item.lora[0], medium,
                                      item.lora[1], extra))
        elif isinstance(item, AllCleared):
            events.append(AllBlocksCleared())
        else:
            events.append(BlockRemoved(item.hashes, medium))
    return KVEventBatch(recorded.ts, events, data_parallel_rank)
