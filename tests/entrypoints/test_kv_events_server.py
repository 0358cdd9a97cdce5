"""KV cache events from the real server (``--kv-events-config``): completions and
``/reset_prefix_cache`` show up on a loopback subscriber, and shutdown closes the publisher."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.cache.kv_events_test_utils import DECODER, Follower, VAllBlocksCleared, VBlockStored, engine_hashes
from tests.entrypoints.conftest import MODEL, start_server, stop_server

pytest.importorskip("zmq")


def test_server_publishes_the_cache_and_its_reset(smollm2):
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": "replica-0"}
    server = start_server(smollm2, block_size=4, num_blocks=32, kv_events_config=json.dumps(config))
    engine = server.engine.engine
    publisher = engine.kv_event_publisher
    follower = Follower(publisher, "replica-0")
    try:
        follower.join_live()
        prompt = list(range(2000, 2021))  # 21 tokens: 5 full blocks, the last token computed
        for _ in range(2):
            r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 20
        server.wait_idle()
        follower.catch_up()
        pool = engine.kv_cache_manager.block_pool
        assert follower.view.hashes == engine_hashes(pool) and len(follower.view.hashes) == 5
        (stored,) = follower.view.stored  # the second request hit: nothing new was cached
        assert isinstance(stored, VBlockStored) and stored.token_ids == prompt[:20] and stored.block_size == 4
        assert httpx.post(server.base_url + "/reset_prefix_cache", timeout=10).status_code == 200
        follower.catch_up()
        assert follower.view.hashes == set() == engine_hashes(pool)
        last = follower.sub.request_replay(follower.next_seq - 1)
        assert [DECODER.decode(payload).events for _, payload in last] == [[VAllBlocksCleared()]]
    finally:
        follower.close()
        stop_server(server)
    assert engine.kv_event_publisher is None and publisher._closed  # shutdown closed it
