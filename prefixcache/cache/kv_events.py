"""KV cache events in vLLM's wire format: what the block pool cached, evicted or cleared.

Opt in with :class:`KVEventsConfig` (``--kv-events-config``, vLLM's flag and JSON keys). The block
pool then reports to a :class:`KVEventRecorder` (plain records); the engine takes them once per
step and hands them to the publisher (:mod:`prefixcache.engine.kv_event_publisher`), whose thread
builds the wire batch (:mod:`prefixcache.cache.kv_event_wire`, msgspec structs), encodes and sends
it. With events off, the pool holds no recorder and pays one ``is None`` test per hash entering or
leaving its map; msgspec and pyzmq are not even imported.

Wire format (vLLM's ``vllm/distributed/kv_events.py`` up to v0.25: msgspec msgpack, tagged
array-like structs; consumers such as llm-d's kv-cache indexer and Dynamo decode it)::

    KVEventBatch     = [ts, [event, ...], data_parallel_rank]
    BlockStored      = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                        lora_id, medium, lora_name, extra_keys]      (every field, None as nil)
    BlockRemoved     = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

Block hashes are the low 64 bits of our chained block hashes as unsigned ints (vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` default). Our hashes mix in the model, the hash seed, the
request's ``cache_salt``, LoRA adapter and tenant, so they are namespace-specific: two tenants'
identical text give different hashes (outside an approved shared prefix), and nobody outside the
process can recompute them from tokens. The namespace also travels in ``extra_keys`` (vLLM's
field for the non-token inputs of a block's hash), one entry per block, ``None`` for a block
without one, else a tuple of ``(name, value)`` pairs: ``("cache_salt_sha256", 16 hex digits of the
salt's sha256)`` (the salt itself is a tenant secret and is never sent), ``("lora", 16 hex digits
of the adapter's content digest)``, ``("tenant", name)``, and for a block holding generated tokens'
K/V in the int4 formats ``("generated_from_slot", num_prompt_tokens % block_size)``.

Models with several KV-cache groups (:mod:`prefixcache.cache.kv_cache_groups`: Gemma 3's full and
sliding-window layers): only group 0's blocks (the full-attention layers) are reported, with the
hashes a one-group model's blocks of the same tokens would have; the other groups' blocks of the same
positions (cached under their own keys, attached to group 0's) send neither ``BlockStored`` nor
``BlockRemoved``. A router should count as a request's hit the leading blocks of its hash chain that
were stored and not removed, as for any model. The engine serves that whole count where the chain
ends where an earlier request's prompt, cache hit or sequence ended: it keeps the sliding groups'
window before each such end with the prefix (retained, evicted only once no other free block is
left, and with its group-0 block when that one goes). The count is too high when a window the hit
needs was evicted while its group-0 block stays cached: a prefix ending mid-chain, whose window went
to the eviction policy like any free block, or a retained window taken under full pressure while a
running request holds its group-0 block. No event says so (the window's eviction is silent; ``BlockRemoved`` comes only when
the group-0 block goes); the engine serves the longest block-aligned prefix every group holds, and
the request's ``num_cached_tokens`` (``cached_tokens`` in the API's usage) is the exact number. A
partial hit adds up to ``block_size - 1`` tokens to the count, only where every group holds the
block. ``tests/models/test_gemma3_partial_and_events.py`` checks both cases.

Invariants (checked by ``tests/cache/test_kv_events.py`` and ``tests/engine/test_kv_events_engine.py``):
- Applying the events in order to an empty set (add on stored, discard on removed, empty on
  cleared) gives exactly the set of group 0's hashes in the pool's hash map, after every step: a
  hash is reported stored when its first cached block enters the map and removed when its last one
  leaves (several blocks may share a hash, see :mod:`prefixcache.cache.block_pool`).
- A stored event's ``parent_block_hash`` is the hash of the cached block before its first block,
  ``None`` for a chain's first block; consecutive stored blocks of one chain share one event.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.cache.hashing import output_slot_of_extra_key, tenant_of_extra_key
from prefixcache.errors import InvalidInputError

if TYPE_CHECKING:
    from prefixcache.cache.block import KVCacheBlock

MEDIUM_GPU = "GPU"  # vLLM's medium name of the accelerator's KV pool
MEDIUM_CPU = "CPU"  # vLLM's name of host memory (our pool on a CPU-only engine)
PUBLISHERS = ("null", "zmq")
_UINT64 = (1 << 64) - 1
_MAX_ROOT_KEYS = 4096  # namespace descriptions remembered per recorder before starting afresh


def external_block_hash(block_hash: bytes) -> int:
    """The published form of a block hash: its low 64 bits, big-endian, as an unsigned int
    (vLLM's ``maybe_convert_block_hash``). Exact for xxh64; sha256 hashes are truncated."""
    return int.from_bytes(block_hash[-8:], "big") & _UINT64


# ---------------------------------------------------------------------------- config
@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (same JSON keys, defaults and meaning; ``--kv-events-config``).

    Attributes:
        enable_kv_cache_events: publish events; off by default.
        publisher: ``"zmq"`` or ``"null"`` (record nothing, publish nothing).
        endpoint: the PUB socket: bound when it has ``*``, ``::``, or is ``ipc://``/``inproc://``
            (``tcp://*:5557``, ``tcp://127.0.0.1:*`` for a free port), else connected to a
            subscriber that binds (vLLM's rule).
        replay_endpoint: a ROUTER socket (always bound) answering replay requests, or ``None``.
        buffer_steps: batches kept for replay (the newest ones).
        hwm: ZeroMQ high-water mark of the PUB socket (messages).
        max_queue_size: batches waiting for the publisher thread; a batch past it is dropped and
            leaves a gap in the sequence numbers.
        topic: the first frame of every message (subscribers filter on it).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: KVEventsConfig | str | dict | None) -> KVEventsConfig | None:
        """A validated config from JSON text (the flag), a mapping or a config; ``None`` stays None.

        Raises:
            InvalidInputError: (field ``kv_events_config``) bad JSON, an unknown key or a bad value.
        """
        if value is None or isinstance(value, KVEventsConfig):
            config = value
        else:
            data = value
            if isinstance(value, str):
                try:
                    data = json.loads(value)
                except json.JSONDecodeError as e:
                    raise InvalidInputError("kv_events_config", f"kv_events_config is not valid JSON: {e}") from None
            if not isinstance(data, dict):
                raise InvalidInputError("kv_events_config", f"kv_events_config must be a JSON object, "
                                                            f"got {type(data).__name__}")
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data) - names)
            if unknown:
                raise InvalidInputError("kv_events_config", f"kv_events_config: unknown key(s) {unknown}; "
                                                            f"valid keys: {sorted(names)}")
            config = cls(**data)
        if config is not None:
            config.validate()
        return config

    def validate(self) -> None:
        """Raises :class:`InvalidInputError` (field ``kv_events_config``) naming the bad key."""
        def bad(key: str, why: str) -> InvalidInputError:
            return InvalidInputError("kv_events_config", f"kv_events_config.{key} {why}, got {getattr(self, key)!r}")

        if not isinstance(self.enable_kv_cache_events, bool):
            raise bad("enable_kv_cache_events", "must be true or false")
        if self.publisher not in PUBLISHERS:
            raise bad("publisher", f"must be one of {PUBLISHERS}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise bad("endpoint", "must be a ZeroMQ address such as tcp://*:5557")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or "://" not in self.replay_endpoint):
            raise bad("replay_endpoint", "must be null or a ZeroMQ address such as tcp://*:5558")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(key, "must be an integer >= 1")
        if not isinstance(self.topic, str):
            raise bad("topic", "must be a string")

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and published."""
        return self.enable_kv_cache_events and self.publisher != "null"


# ---------------------------------------------------------------------------- recorder
@dataclass(slots=True)
class StoredBlocks:
    """Consecutive blocks of one chain cached (becomes a ``BlockStored``; see its fields)."""

    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    lora: tuple[int | None, str | None]  # (lora_id, lora_name)
    extra_keys: list[tuple | None]


@dataclass(slots=True)
class RemovedBlocks:
    """Hashes that left the cache (becomes a ``BlockRemoved``)."""

    hashes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class AllCleared:
    """The prefix cache was reset (becomes an ``AllBlocksCleared``)."""


@dataclass(slots=True)
class RecordedEvents:
    """One step's records, stamped, for the publisher (which builds the wire batch off the engine's
    thread, :func:`prefixcache.cache.kv_event_wire.to_wire_batch`)."""

    ts: float  # wall-clock seconds (time.time())
    records: list[StoredBlocks | RemovedBlocks | AllCleared]
    block_size: int
    medium: str


class KVEventRecorder:
    """Collects the block pool's cache changes as event records, merging runs, until :meth:`take`.

    Plain records, no encoding: the engine's thread only appends. Called from that thread only (the
    pool's); :meth:`take_batch` hands a step's records over.

    Args:
        block_size: tokens per block.
        medium: ``"GPU"`` or ``"CPU"``.
    """

    def __init__(self, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.block_size = block_size
        self.medium = medium
        self._pending: list[StoredBlocks | RemovedBlocks | AllCleared] = []
        self._namespaces: dict[bytes, tuple[tuple[int | None, str | None], tuple]] = {}
        self._adapter_names: dict[bytes, str] = {}

    def note_adapter(self, digest: bytes, name: str) -> None:
        """Records the name requests use for the adapter with content ``digest`` (``lora_name``)."""
        if self._adapter_names.get(digest) != name:
            self._adapter_names[digest] = name
            self._namespaces.clear()

    def block_stored(self, block: KVCacheBlock, parent: KVCacheBlock | None, root_key: bytes) -> None:
        """A block's hash entered the pool's hash map (``block`` is cached, after ``parent``)."""
        block_hash = external_block_hash(block.block_hash)
        parent_hash = None if parent is None else external_block_hash(parent.block_hash)
        lora, keys = self._namespace(root_key)
        if (tenant := tenant_of_extra_key(block.extra_key)) is not None:  # not int4's output key after it
            keys = (*keys, ("tenant", tenant))
        if (slot := output_slot_of_extra_key(block.extra_key)) is not None:
            # int4(-int8): K/V of generated tokens, never served to a prompt holding the same tokens; a
            # router matching on tokens and extra keys must not count it as one
            keys = (*keys, ("generated_from_slot", slot))
        last = self._pending[-1] if self._pending else None
        if (isinstance(last, StoredBlocks) and parent_hash is not None and last.hashes[-1] == parent_hash
                and last.lora == lora):
            last.hashes.append(block_hash)
            last.token_ids.extend(block.token_ids)
            last.extra_keys.append(keys or None)
        else:
            self._pending.append(StoredBlocks([block_hash], parent_hash, list(block.token_ids), lora, [keys or None]))

    def block_removed(self, block_hash: bytes) -> None:
        """A hash left the pool's hash map (its last cached block was evicted)."""
        last = self._pending[-1] if self._pending else None
        if not isinstance(last, RemovedBlocks):
            last = RemovedBlocks()
            self._pending.append(last)
        last.hashes.append(external_block_hash(block_hash))

    def all_blocks_cleared(self) -> None:
        """The prefix cache was reset."""
        self._pending.append(AllCleared())

    def take(self) -> list[StoredBlocks | RemovedBlocks | AllCleared]:
        """The records since the last call, oldest first (empty if none)."""
        pending, self._pending = self._pending, []
        return pending

    def take_batch(self) -> RecordedEvents | None:
        """:meth:`take` stamped now; ``None`` when nothing happened."""
        records = self.take()
        return RecordedEvents(time.time(), records, self.block_size, self.medium) if records else None

    def _namespace(self, root_key: bytes) -> tuple[tuple[int | None, str | None], tuple]:
        """``((lora_id, lora_name), extra-key pairs)`` of a request's root key, memoised."""
        found = self._namespaces.get(root_key)
        if found is None:
            _, cache_salt, _, adapter_hex = json.loads(root_key)
            pairs: list[tuple[str, str]] = []
            if cache_salt is not None:
                pairs.append(("cache_salt_sha256", hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:16]))
            lora: tuple[int | None, str | None] = (None, None)
            if adapter_hex:
                digest = bytes.fromhex(adapter_hex)
                lora = ((int.from_bytes(digest[:4], "big") & 0x7FFFFFFF) or 1, self._adapter_names.get(digest))
                pairs.append(("lora", adapter_hex[:16]))
            if len(self._namespaces) >= _MAX_ROOT_KEYS:
                self._namespaces.clear()
            found = self._namespaces[root_key] = (lora, tuple(pairs))
        return found
