"""The ZeroMQ KV event publisher on loopback (vLLM's protocol): topic and sequence frames, the
bounded replay buffer, gaps on drops, bad replay requests, and the ``--kv-events-config`` flag."""

from __future__ import annotations

import time

import pytest

from prefixcache.cache.kv_event_wire import BlockRemoved, KVEventBatch
from prefixcache.cache.kv_events import KVEventsConfig
from prefixcache.engine.kv_event_publisher import ZmqEventPublisher
from tests.cache.kv_events_test_utils import DECODER, VBlockRemoved, ZmqSubscriber

zmq = pytest.importorskip("zmq")


def loopback_config(**options) -> KVEventsConfig:
    options.setdefault("replay_endpoint", "tcp://127.0.0.1:*")
    return KVEventsConfig(True, endpoint="tcp://127.0.0.1:*", **options)


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockRemoved([i], "CPU")])


def connected(publisher: ZmqEventPublisher, topic: str = "") -> ZmqSubscriber:
    """A subscriber that has provably joined (PUB drops messages until the subscription lands)."""
    sub = ZmqSubscriber(publisher.endpoint, publisher.replay_endpoint, topic)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        publisher.publish(KVEventBatch(0.0, []))  # an empty batch as a probe
        got = sub.recv(timeout_ms=100)
        if got is not None:
            while sub.recv(timeout_ms=50) is not None:  # probes still in flight
                pass
            return sub
    raise AssertionError("subscriber never joined")


def test_frames_sequence_numbers_and_bounded_replay():
    publisher = ZmqEventPublisher(loopback_config(topic="kv", buffer_steps=5))
    sub = connected(publisher, "kv")
    try:
        first = publisher.last_seq + 1
        for i in range(8):
            assert publisher.publish(batch(i)) == first + i
        received = [sub.recv() for _ in range(8)]
        assert [(t, s) for t, s, _ in received] == [(b"kv", first + i) for i in range(8)]
        assert [DECODER.decode(p).events for _, _, p in received] == [[VBlockRemoved([i], "CPU")] for i in range(8)]
        assert DECODER.decode(received[0][2]).data_parallel_rank == 0
        # Only the newest 5 batches are buffered; a replay from seq 0 starts at the oldest kept.
        replayed = sub.request_replay(0)
        assert [s for s, _ in replayed] == [first + i for i in range(3, 8)]
        assert [p for _, p in replayed] == [p for _, _, p in received[3:]]  # the very same bytes
        assert [s for s, _ in sub.request_replay(first + 6)] == [first + 6, first + 7]
        assert sub.request_replay(first + 100) == []  # only the end marker
    finally:
        sub.close()
        publisher.close()


def test_malformed_replay_request_is_ignored_and_the_socket_keeps_serving():
    publisher = ZmqEventPublisher(loopback_config())
    sub = connected(publisher)
    try:
        sub.replay.send_multipart((b"", b"short"))  # not 8 bytes: ignored, no answer
        assert publisher.publish(batch(1)) is not None
        assert sub.recv() is not None
        assert len(sub.request_replay(0)) >= 1
    finally:
        sub.close()
        publisher.close()


def test_a_full_queue_drops_the_batch_and_leaves_a_gap():
    publisher = ZmqEventPublisher(loopback_config(max_queue_size=1, replay_endpoint=None))
    try:
        publisher._queue.put(None)  # park the thread's queue: the thread exits on this sentinel
        publisher._thread.join(5)
        assert publisher.publish(batch(0)) == 0  # fills the queue (nobody drains it now)
        assert publisher.publish(batch(1)) is None and publisher.num_dropped == 1
        assert publisher.publish(batch(2)) is None and publisher.last_seq == 2  # seq 1, 2: gaps
    finally:
        publisher.close(timeout_s=0.1)


def test_closed_publisher_refuses_and_close_twice_is_fine():
    publisher = ZmqEventPublisher(loopback_config(replay_endpoint=None))
    publisher.close()
    publisher.close()
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish(batch(0))


def test_taken_port_is_an_error_naming_kv_events_config(make_llm):
    from prefixcache.errors import InvalidInputError

    publisher = ZmqEventPublisher(loopback_config(replay_endpoint=None))
    try:
        with pytest.raises(InvalidInputError, match="kv_events_config: cannot open") as info:
            make_llm(num_blocks=16, kv_events_config={"enable_kv_cache_events": True,
                                                      "endpoint": publisher.endpoint.replace("127.0.0.1", "*")})
        assert info.value.field == "kv_events_config"
    finally:
        publisher.close()


def test_cli_flag_parses_vllm_json():
    import argparse

    from prefixcache.entrypoints.cli.serve import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    add_engine_args(parser)
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}'])
    assert engine_config_from_args(args).kv_events_config == KVEventsConfig(True, endpoint="tcp://*:6000")
    assert engine_config_from_args(parser.parse_args([])).kv_events_config is None
    with pytest.raises(ValueError, match="--kv-events-config"):
        engine_config_from_args(parser.parse_args(["--kv-events-config", '{"hwm": -1}']))


@pytest.mark.slow  # a fresh interpreter imports torch
def test_events_off_imports_neither_msgspec_nor_zmq():
    import subprocess
    import sys

    code = ("import sys, prefixcache.config, prefixcache.engine.llm_engine, prefixcache.llm; "
            "print(sorted(m for m in ('msgspec', 'zmq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
