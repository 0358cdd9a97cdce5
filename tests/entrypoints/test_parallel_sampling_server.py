"""n > 1 over HTTP: choices by index, each equal to the offline sample with seed + index."""

from __future__ import annotations

import httpx

from prefixcache.sampling_params import SamplingParams
from tests.entrypoints.conftest import MODEL, start_server, stop_server

PROMPT = "Three things every hiker should carry are"
EXTRA = {"ignore_eos": True}


def offline_texts(make_llm, prompt, seed, n, max_tokens):
    llm = make_llm(enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, seed=seed, n=n, max_tokens=max_tokens, ignore_eos=True)
    return [o.text for o in llm.generate(prompt, params, use_tqdm=False)]


def test_completions_n3(client, server, make_llm):
    before = server.wait_idle()
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, temperature=0.8, seed=5, max_tokens=8,
                                  extra_body=EXTRA)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == offline_texts(make_llm, PROMPT, 5, 3, 8)
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(
        server.engine.engine.tokenizer.encode(PROMPT))
    after = server.wait_idle()
    assert after["prefixcache:kv_blocks_in_use"] == 0
    assert r.usage.prompt_tokens % 16  # the prompt ends mid-block: two of the three samples copy it
    for name, expected in (("parallel_sampling_forks_total", 2), ("cow_block_copies_total", 2)):
        assert after["prefixcache:" + name] - before.get("prefixcache:" + name, 0) == expected


def test_chat_n2_stream_equals_non_stream(client, server):
    messages = [{"role": "user", "content": "Name a good book for a long train ride."}]
    kwargs = dict(model=MODEL, messages=messages, n=2, temperature=0.8, seed=9, max_tokens=10, extra_body=EXTRA)
    full = client.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    roles = []
    finish = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.append(c.index)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]
    assert sorted(roles) == [0, 1] and finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == full.usage.completion_tokens == 20
    # The streamed request hit every full prompt block the first one cached (partial reuse off).
    assert usage.prompt_tokens_details.cached_tokens == (full.usage.prompt_tokens - 1) // 16 * 16
    assert server.wait_idle()["prefixcache:kv_blocks_in_use"] == 0


def test_null_n_and_stream_mean_the_defaults(server):
    r = httpx.post(server.base_url + "/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": None, "stream": None, "ignore_eos": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_chat_default_max_tokens_is_sized_for_n_samples(smollm2):
    # 12 blocks of 16 tokens: the single-sample default (the rest of the pool) x 4 would not fit.
    s = start_server(smollm2, num_blocks=12)
    try:
        body = {"model": MODEL, "n": 4, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hello"}]}
        r = httpx.post(s.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usage, choices = r.json()["usage"], r.json()["choices"]
        p = usage["prompt_tokens"]
        full = p // 16
        room = (full + (12 - full) // 4) * 16 - p  # per sample: its share of the blocks after the prompt's
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        assert usage["completion_tokens"] == 4 * room
        assert s.wait_idle()["prefixcache:kv_blocks_in_use"] == 0
    finally:
        stop_server(s)


def test_chat_n_that_the_pool_cant_hold_names_n_without_max_tokens(smollm2):
    """Without max_tokens the refusal names n (the default shrinks to 1 token a sample, and still
    doesn't fit); with max_tokens it names that, as before; a prompt too long for the pool names
    messages. 24 blocks of 16 tokens."""
    s = start_server(smollm2, num_blocks=24)
    try:
        def post(path, body):
            return httpx.post(s.base_url + path, json={"model": MODEL, **body}, timeout=120)

        messages = [{"role": "user", "content": "Name a good book for a long train ride."}]
        p = post("/tokenize", {"messages": messages}).json()["count"]
        full, per_sample = p // 16, -(-(p + 1) // 16) - p // 16  # shared prompt blocks; each sample's own
        assert (full, per_sample) == (2, 1)
        for n, fitting in ((64, 22), (23, 22)):
            r = post("/v1/chat/completions", {"messages": messages, "n": n})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "n"
            assert r.json()["error"]["message"] == (
                f"n={n} samples don't fit the KV pool even with the smallest default max_tokens (1): the prompt "
                f"({p} tokens) plus 1 token for each of n={n} samples needs {full + n} KV blocks but the pool has "
                f"24 blocks; lower n to at most {fitting} or raise --num-blocks or --kv-cache-memory (num_blocks / kv_cache_memory_bytes offline)")
        r = post("/v1/chat/completions", {"messages": messages, "n": 22, "ignore_eos": True})  # the most that fit
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 22 * ((full + 1) * 16 - p)

        # max_tokens (or max_completion_tokens) sent: the error names it, in the message too.
        for field in ("max_tokens", "max_completion_tokens"):
            r = post("/v1/chat/completions", {"messages": messages, "n": 64, field: 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == field
            assert r.json()["error"]["message"] == (
                f"prompt + {field} ({p + 1} tokens x n=64 samples) needs 66 KV blocks but the pool has 24 "
                f"blocks; lower {field} or raise --num-blocks or --kv-cache-memory (num_blocks / kv_cache_memory_bytes offline)")

        # A prompt the pool can't hold even for one sample: no n would fit, the messages are at fault.
        long = [{"role": "user", "content": "word " * 400}]
        q = post("/tokenize", {"messages": long}).json()["count"]
        for n in (1, 3):
            r = post("/v1/chat/completions", {"messages": long, "n": n})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            assert r.json()["error"]["message"] == (
                f"messages: the prompt ({q} tokens) plus 1 token needs {-(-(q + 1) // 16)} KV blocks but the pool "
                "has 24 blocks; shorten the prompt or raise --num-blocks or --kv-cache-memory (num_blocks / "
                "kv_cache_memory_bytes offline)")
        assert s.wait_idle()["prefixcache:kv_blocks_in_use"] == 0
    finally:
        stop_server(s)
