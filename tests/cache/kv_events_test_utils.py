"""A KV event consumer written against vLLM's wire format, independent of prefixcache's structs.

``V*`` are vLLM's event structs as consumers declare them (``vllm/distributed/kv_events.py``, the
array-like tagged form); :class:`CachedHashes` applies decoded batches to a set of hashes the way a
router's index does; :class:`ZmqSubscriber` is a real SUB socket (plus a DEALER for replays).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from prefixcache.cache.kv_event_wire import KVEventBatch


class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VKVEventBatch)


def engine_hashes(block_pool) -> set[int]:
    """The pool's cached block hashes, in the published (uint64) form."""
    return {int.from_bytes(h[-8:], "big") for h in block_pool.cached_block_hash_to_block}


class CachedHashes:
    """A consumer's view: the set of hashes stored and not yet removed, and every stored event."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.stored: list[VBlockStored] = []

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, VBlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in self.hashes
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                assert not self.hashes & set(event.block_hashes), "stored twice without a removal"
                self.hashes.update(event.block_hashes)
                self.stored.append(event)
            elif isinstance(event, VBlockRemoved):
                assert set(event.block_hashes) <= self.hashes, "removed a hash never stored"
                self.hashes.difference_update(event.block_hashes)
            else:
                self.hashes.clear()

    def apply_payload(self, payload: bytes) -> None:
        self.apply(DECODER.decode(payload).events)


class ZmqSubscriber:
    """A live SUB socket on ``endpoint`` (topic filter ``topic``) and a DEALER on ``replay_endpoint``."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(replay_endpoint)

    def recv(self, timeout_ms: int = 2000) -> tuple[bytes, int, bytes] | None:
        """One live message ``(topic, seq, payload)``, or None after ``timeout_ms``."""
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), payload

    def request_replay(self, start_seq: int, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
        """Asks for every buffered batch from ``start_seq`` on; returns ``[(seq, payload), ...]``."""
        self.replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while True:
            assert self.replay.poll(timeout_ms), "replay: no answer"
            empty, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return out
            out.append((seq, payload))

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class Follower:
    """A subscriber that applies every batch in sequence order (no gaps allowed)."""

    def __init__(self, publisher, topic: str = "") -> None:
        self.publisher = publisher
        self.topic = topic.encode()
        self.sub = ZmqSubscriber(publisher.endpoint, publisher.replay_endpoint, topic)
        self.view = CachedHashes()
        self.next_seq: int | None = None

    def join_live(self) -> None:
        """Waits until the subscription is live: publishes empty batches until one arrives."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            self.publisher.publish(KVEventBatch(time.time(), []))  # an empty batch: a valid no-op
            got = self.sub.recv(timeout_ms=100)
            if got is not None:
                self.next_seq = got[1] + 1
                return
        raise AssertionError("subscriber never joined")

    def apply(self, seq: int, payload: bytes) -> None:
        if self.next_seq is not None and seq < self.next_seq:
            return  # already applied (seen in a replay and live)
        assert self.next_seq is None or seq == self.next_seq, f"gap: expected {self.next_seq}, got {seq}"
        self.view.apply_payload(payload)
        self.next_seq = seq + 1

    def catch_up(self) -> None:
        """Applies live batches until the last one the engine published."""
        last = self.publisher.last_seq
        while self.next_seq is None or self.next_seq <= last:
            got = self.sub.recv()
            assert got is not None, f"batch {self.next_seq} never arrived (last {last})"
            topic, seq, payload = got
            assert topic == self.topic
            self.apply(seq, payload)

    def close(self) -> None:
        self.sub.close()
