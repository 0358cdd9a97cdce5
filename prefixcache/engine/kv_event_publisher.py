"""Publishes KV event batches over ZeroMQ, off the engine's thread (vLLM's ``ZmqEventPublisher``
protocol; the events themselves: :mod:`prefixcache.cache.kv_events`).

The engine hands each step's records (:class:`~prefixcache.cache.kv_events.RecordedEvents`) to
:meth:`ZmqEventPublisher.publish`, which only numbers them and queues them. A background thread
turns them into vLLM's ``KVEventBatch`` (:mod:`prefixcache.cache.kv_event_wire`), encodes it
(msgspec msgpack) and sends it, and answers replay requests:

- PUB socket (``endpoint``): one multipart message per batch, ``[topic, seq, payload]``; ``seq`` is
  the batch's sequence number, 8 bytes big-endian, counting from 0.
- ROUTER socket (``replay_endpoint``, optional): a client (REQ or DEALER) sends the first ``seq`` it
  wants as 8 bytes big-endian; it gets ``[seq, payload]`` for each batch still buffered from that
  one on (the newest ``buffer_steps``), then ``[-1 as 8 signed bytes, b""]``.

Invariants:
- Sequence numbers are given in :meth:`publish` order, one per batch, without reuse; a batch
  dropped (queue full, or a send that failed) leaves a gap a subscriber can see.
- The replay buffer holds exactly the sent batches' payloads, in ``seq`` order, the newest
  ``buffer_steps`` of them.
- Only the publisher thread touches the sockets after construction.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from prefixcache.cache.kv_event_wire import EventBatch, to_wire_batch
from prefixcache.cache.kv_events import KVEventsConfig, RecordedEvents

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker (vLLM's)
_POLL_S = 0.05  # the thread's wait for a batch before it looks at the replay socket again


def binds(endpoint: str) -> bool:
    """vLLM's rule: the PUB socket binds a wildcard, IPv6 any, ipc or inproc address; else it
    connects (to a subscriber that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB + replay ROUTER sockets fed by a queue and one daemon thread.

    Args:
        config: an enabled :class:`KVEventsConfig` with ``publisher == "zmq"``.
        data_parallel_rank: stamped on batches that carry none.

    Raises:
        zmq.ZMQError: an endpoint can't be bound or connected (e.g. the port is taken).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[int, EventBatch | RecordedEvents] | None] = queue.Queue(
            maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0  # batches given a seq but never sent
        self._closed = False
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            # The address really bound (a "tcp://host:*" endpoint gets a free port).
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int:
        """The sequence number given to the latest :meth:`publish` (``-1`` before the first)."""
        return self._next_seq - 1

    def publish(self, batch: RecordedEvents | EventBatch) -> int | None:
        """Numbers ``batch`` and queues it for the thread; never blocks.

        Args:
            batch: a step's records (made into a ``KVEventBatch`` by the thread), or a ready
                :class:`~prefixcache.cache.kv_event_wire.EventBatch` (vLLM's ``publish`` argument).

        Returns:
            Its sequence number, or ``None`` if the queue was full (the batch is dropped: a gap).

        Raises:
            RuntimeError: after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("KV event publisher is closed")
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV events: publisher queue full (%d batches); batch %d dropped",
                           self.config.max_queue_size, seq)
            return None
        return seq

    def close(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued (up to ``timeout_s``), stops the thread and closes the sockets.
        A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass  # the thread is still draining a full queue; the join below times out
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV events: publisher thread still sending after %.1fs; leaving it", timeout_s)
            return  # the daemon thread owns the sockets; it closes them when it ends
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                if isinstance(batch, RecordedEvents):
                    batch = to_wire_batch(batch, self.data_parallel_rank)
                elif batch.data_parallel_rank is None:
                    batch.data_parallel_rank = self.data_parallel_rank
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            except Exception:  # a send must never kill the thread: the batch becomes a gap
                self.num_dropped += 1
                logger.exception("KV events: batch %d not sent", seq)
                continue
            self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        """Answers every waiting replay request from the buffer."""
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: malformed replay request (%d frames) ignored", len(frames))
                continue
            client, delimiter, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, delimiter, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, delimiter, END_SEQ, b""))
