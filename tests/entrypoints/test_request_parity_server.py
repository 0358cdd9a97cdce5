"""Issue 13's request parity over HTTP: a list of prompts in one completion request, ``echo`` (with
``max_tokens: 0`` too), ``stream_options``, ``/tokenize`` and ``/detokenize`` (vLLM's shapes), against
the real server and the ``openai`` client."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import httpx
import pytest

from tests.entrypoints.conftest import MODEL

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "Three things every hiker should carry are"]
ABORTED = "prefixcache:request_success_total{abort}"


@contextlib.contextmanager
def engine_outputs(server):
    """Collects the final RequestOutput of every sample the engine finishes meanwhile (the server's
    own on_finish hook, still called)."""
    outs = []
    hook = server.engine.on_finish

    def collect(out, request_done):
        outs.append(out)
        hook(out, request_done)

    server.engine.on_finish = collect
    try:
        yield outs
    finally:
        server.engine.on_finish = hook


def assert_nothing_left(server):
    """No request queued, running or holding a block, in the engine or the async front."""
    m = server.wait_idle()
    assert m["prefixcache:kv_blocks_in_use"] == 0 and m["prefixcache:num_requests_running"] == 0
    assert m["prefixcache:num_requests_waiting"] == 0
    assert server.engine._queues == {} and not server.engine.engine.has_unfinished_requests()


def post(server, path, body, **kwargs):
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60, **kwargs)


def sse_json(r: httpx.Response) -> list[dict]:
    data = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---------------------------------------------------------------------------- a list of prompts
def test_prompt_list_equals_prompts_sent_one_by_one(server, client):
    server.engine.max_step_num_reqs = 0
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert server.engine.max_step_num_reqs == len(PROMPTS)  # submitted together: run in the same steps
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}) for p in PROMPTS]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [r.choices[0].text for r in alone]
    assert [c.finish_reason for c in batch.choices] == ["length"] * 3
    tok = server.engine.engine.tokenizer
    assert batch.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS) == sum(
        r.usage.prompt_tokens for r in alone)
    assert batch.usage.completion_tokens == 24 and batch.usage.total_tokens == batch.usage.prompt_tokens + 24

    # The same prompts as token-id lists: the same answers.
    by_ids = client.completions.create(model=MODEL, prompt=[tok.encode(p) for p in PROMPTS], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    assert by_ids.usage.prompt_tokens == batch.usage.prompt_tokens
    assert_nothing_left(server)


def test_prompt_list_with_n_numbers_choices_prompt_major(server):
    """Choice ``p * n + i`` is sample ``i`` of prompt ``p`` (vLLM's rule): each equals that prompt's
    own n = 3 request with the same seed."""
    body = {"max_tokens": 6, "temperature": 0.8, "seed": 11, "n": 3, "ignore_eos": True}
    batch = post(server, "/v1/completions", {"prompt": PROMPTS[:2], **body}).json()
    alone = [post(server, "/v1/completions", {"prompt": p, **body}).json() for p in PROMPTS[:2]]
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    assert [c["text"] for c in batch["choices"]] == [c["text"] for r in alone for c in r["choices"]]
    assert len({c["text"] for c in batch["choices"]}) > 2  # the samples differ: the order is checked
    assert batch["usage"]["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in alone)
    assert batch["usage"]["completion_tokens"] == 36


def test_prompt_list_streamed_equals_non_streamed(server):
    body = {"prompt": PROMPTS, "max_tokens": 10, "temperature": 0.7, "seed": 3, "n": 2, "ignore_eos": True}
    full = post(server, "/v1/completions", body).json()
    r = post(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_json(r)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["index"] not in finish
            finish[choice["index"]] = choice["finish_reason"]
    assert [texts[i] for i in range(6)] == [c["text"] for c in full["choices"]]
    assert finish == {i: "length" for i in range(6)}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert full["usage"]["completion_tokens"] == 60
    assert_nothing_left(server)


@pytest.mark.parametrize("prompt,param,where", [
    ([], "prompt", "must not be empty"),
    (["Hello", ""], "prompt", "prompt[1]: "),
    ([[1, 2], [3, 49152]], "prompt", "prompt[1]: "),
    (["Hello", [1, 2]], "prompt", ""),  # mixed kinds: a type error
    (["Hello"] * 1025, "prompt", "at most 1024"),
])
def test_invalid_prompt_in_list_refuses_the_whole_request(server, prompt, param, where):
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and where in r.json()["error"]["message"]
    assert_nothing_left(server)


def test_prompt_refused_by_the_engine_leaves_earlier_prompts_unqueued(server):
    """The second prompt fails the engine's own check (pool too small for it + max_tokens) after the
    first was added: the first is taken back in the same engine-thread call, before any step."""
    before = server.wait_idle()
    long_prompt = "word " * 2000
    r = post(server, "/v1/completions", {"prompt": ["Hello", long_prompt], "max_tokens": 600})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens"
    assert error["message"].startswith("prompt[1]: prompt + max_tokens (2601 tokens) needs 163 KV blocks")
    # Checked at once, no waiting: the refusal answered only after the abort ran on the engine thread.
    assert not server.engine.engine.has_unfinished_requests() and server.engine._queues == {}
    assert_nothing_left(server)
    for name in ("generation_tokens_total", "prompt_tokens_total"):  # "Hello" never ran
        assert server.metrics()["prefixcache:" + name] == before["prefixcache:" + name]


def test_disconnect_aborts_every_prompt(server):
    before = server.wait_idle()
    body = {"prompt": PROMPTS, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, **body},
                   timeout=httpx.Timeout(10, read=0.5))
    after = server.wait_idle()
    assert after[ABORTED] - before.get(ABORTED, 0) == len(PROMPTS)
    assert_nothing_left(server)

    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"model": MODEL, **body, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    after_stream = server.wait_idle()
    assert after_stream[ABORTED] - after[ABORTED] == len(PROMPTS)
    assert_nothing_left(server)


# ---------------------------------------------------------------------------- echo
def test_echo_prepends_each_prompt(server, client):
    tok = server.engine.engine.tokenizer
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in zip(PROMPTS, plain.choices)]
    assert echoed.usage == plain.usage  # the echoed prompt is not completion tokens

    # Token ids are echoed as their text (special tokens kept: what the model read).
    ids = [1, *tok.encode("Hello there")]  # 1 is <|im_start|>
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == "<|im_start|>Hello there" + alone.choices[0].text

    # Streaming: each choice's first chunk starts with its prompt.
    body = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0, "echo": True, "n": 2}
    full = post(server, "/v1/completions", body).json()
    firsts: dict[int, str] = {}
    texts: dict[int, str] = {}
    for chunk in sse_json(post(server, "/v1/completions", {**body, "stream": True})):
        (choice,) = chunk["choices"]
        firsts.setdefault(choice["index"], choice["text"])
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert all(firsts[i].startswith(PROMPTS[i // 2]) for i in range(4))
    assert [texts[i] for i in range(4)] == [c["text"] for c in full["choices"]]
    assert [c["text"] for c in full["choices"]] == [PROMPTS[i // 2] + plain.choices[i // 2].text for i in range(4)]


def test_echo_with_logprobs_covers_the_prompt_and_chat_echo_is_refused(server):
    prompt = "The capital of France is"
    ids = server.engine.engine.tokenizer(prompt).input_ids
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2, "prompt_logprobs": 2}
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    echoed = post(server, "/v1/completions", {**body, "echo": True}).json()["choices"][0]
    lps, prompt_lps = echoed["logprobs"], echoed["prompt_logprobs"]
    n = len(ids)
    assert len(lps["tokens"]) == n + 3 and lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for i in range(1, n):  # the prompt's tokens: their prompt logprobs
        assert lps["token_logprobs"][i] == prompt_lps[i][str(ids[i])]["logprob"]
        assert lps["top_logprobs"][i] == {e["decoded_token"]: e["logprob"] for e in list(prompt_lps[i].values())[:2]}
    assert lps["tokens"][n:] == plain["logprobs"]["tokens"]  # then the generated ones, as without echo
    assert lps["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    offsets = [0]
    for t in lps["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lps["text_offset"] == offsets and "".join(lps["tokens"]) == echoed["text"]
    r = post(server, "/v1/completions", {**body, "echo": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "echo": False}).status_code == 200
    assert_nothing_left(server)


def test_echo_with_max_tokens_zero_returns_the_prompt_only(server):
    """``echo`` + ``max_tokens: 0`` (lm-eval-harness's loglikelihood request): the prompt, its
    tokens' logprobs and nothing generated, as OpenAI's legacy API and vLLM answer it."""
    prompt = "The capital of France is"
    ids = server.engine.engine.tokenizer(prompt).input_ids
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (prompt, "length", None)
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    # The prompt's logprobs alone: those of an echo that generates, cut before its generated tokens.
    with_generation = post(server, "/v1/completions", {**body, "max_tokens": 2}).json()["choices"][0]["logprobs"]
    lps = choice["logprobs"]
    assert lps["tokens"] == [server.engine.engine.tokenizer.decode([t]) for t in ids]
    assert "".join(lps["tokens"]) == prompt and lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert lps[name] == with_generation[name][:len(ids)], name

    # A list of prompts with n = 2, streamed: each choice one chunk, its prompt, finished by length.
    body = {"prompt": PROMPTS[:2], "max_tokens": 0, "echo": True, "n": 2}
    full = post(server, "/v1/completions", body).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in full["choices"]] == [
        (i, PROMPTS[i // 2], "length") for i in range(4)]
    assert full["usage"]["completion_tokens"] == 0
    chunks = sse_json(post(server, "/v1/completions", {**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}))
    assert sorted((c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"])
                  for c in chunks[:-1]) == [(i, PROMPTS[i // 2], "length") for i in range(4)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]

    # Without echo max_tokens 0 stays refused, as min_tokens above it and a streamed echo with logprobs.
    for extra, param, message in (
        ({"echo": False}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"echo": True, "min_tokens": 1}, "min_tokens", "min_tokens must be in [0, max_tokens=0], got 1"),
        ({"echo": True, "logprobs": 1, "stream": True}, "echo", "echo with logprobs is not available with "
                                                                "stream: true"),
    ):
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, **extra})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)
    assert_nothing_left(server)


# ---------------------------------------------------------------------------- stream_options
def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    """vLLM's ``continuous_usage_stats``: each chunk carries its choice's usage so far (its prompt,
    its tokens generated yet); ``include_usage`` still adds the final usage-only chunk."""
    prompt = "The capital of France is"
    num_prompt = len(server.engine.engine.tokenizer(prompt).input_ids)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2, "stream": True}
    chunks = sse_json(post(server, "/v1/completions", {**body, "stream_options": {
        "continuous_usage_stats": True, "include_usage": True}}))
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        usage, index = chunk["usage"], chunk["choices"][0]["index"]
        assert (usage["prompt_tokens"], usage["total_tokens"]) == (num_prompt, num_prompt + usage["completion_tokens"])
        counts[index].append(usage["completion_tokens"])
    assert counts == {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 3, 4, 5, 6]}  # one token a chunk, greedy English text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": num_prompt, "completion_tokens": 12, "total_tokens": num_prompt + 12,
        "prompt_tokens_details": {"cached_tokens": 0}}

    # Chat: as in vLLM, continuous usage needs include_usage too (alone it adds nothing).
    messages = [{"role": "user", "content": "Name a good book for a long train ride."}]
    num_prompt = post(server, "/tokenize", {"messages": messages}).json()["count"]
    chat = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    alone = sse_json(post(server, "/v1/chat/completions", {**chat, "stream_options": {"continuous_usage_stats": True}}))
    assert len(alone) == 5 and all("usage" not in c for c in alone)  # one chunk per token, no usage
    chunks = sse_json(post(server, "/v1/chat/completions", {**chat, "stream_options": {
        "continuous_usage_stats": True, "include_usage": True}}))
    assert [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"], c["usage"]["total_tokens"])
            for c in chunks[:-1]] == [(num_prompt, k, num_prompt + k) for k in range(1, 6)]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert_nothing_left(server)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_stream_options_without_stream_is_400(server, path, body):
    for stream in ({}, {"stream": False}, {"stream": None}):
        for options in ({"include_usage": True}, {"continuous_usage_stats": True}, {}):
            r = post(server, path, {**body, **stream, "stream_options": options})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "stream_options"
            assert r.json()["error"]["message"] == "Stream options can only be defined when `stream=True`."
    assert post(server, path, {**body, "stream_options": None}).status_code == 200
    assert_nothing_left(server)


# ---------------------------------------------------------------------------- /tokenize, /detokenize
def test_tokenize_is_what_the_engine_is_fed(server, client):
    tok = server.engine.engine.tokenizer
    text = "Prefix caching reuses the KV blocks of a shared prompt head. " * 3
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}]
    as_text = post(server, "/tokenize", {"prompt": text}).json()
    as_ids = post(server, "/tokenize", {"prompt": as_text["tokens"]}).json()
    as_chat = post(server, "/tokenize", {"messages": messages}).json()
    with engine_outputs(server) as outs:
        completion = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
        by_ids = client.completions.create(model=MODEL, prompt=as_text["tokens"], max_tokens=1)
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    fed = [o.prompt_token_ids for o in outs]
    assert fed == [as_text["tokens"], as_ids["tokens"], as_chat["tokens"]]
    assert as_text["tokens"] == tok.encode(text) == as_ids["tokens"]  # an independent encoding agrees
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert as_chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    usage = [completion.usage.prompt_tokens, by_ids.usage.prompt_tokens, chat.usage.prompt_tokens]
    assert usage == [as_text["count"], as_ids["count"], as_chat["count"]] == [len(t) for t in fed]
    max_model_len = server.engine.engine.max_model_len
    for r in (as_text, as_chat):
        assert r["max_model_len"] == max_model_len and r["token_strs"] is None
        assert r["prefix_cache"] == {"block_size": 16, "num_full_blocks": r["count"] // 16}
    assert as_text["count"] >= 32  # spans full blocks

    # Options: the generation prompt off is a strict prefix; token strings are the vocabulary's.
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < as_chat["count"] and as_chat["tokens"][: bare["count"]] == bare["tokens"]
    strs = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == tok.convert_ids_to_tokens(strs["tokens"]) == ["Hello", "Ġworld"]
    plain = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("Hello world", add_special_tokens=False)


def test_detokenize_round_trip(server):
    tok = server.engine.engine.tokenizer
    text = "Blocks of 16 tokens: où sont les neiges d'antan? 🚀"
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": text}
    chat_ids = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert post(server, "/detokenize", {"tokens": chat_ids}).json()["prompt"] == rendered  # special tokens kept
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    r = httpx.post(server.base_url + "/detokenize", json={"model": MODEL, "tokens": [5, 49152]})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "tokens must be integers in [0, 49152), got '49152' (int)")


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": [5, 49152]}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"prompt": "a\ud800"}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
])
def test_tokenize_errors_name_the_field(server, path, body, status, param):
    content = json.dumps({"model": MODEL, **body})  # ASCII: a lone surrogate travels as "\ud800"
    r = httpx.post(server.base_url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_token_id_lists_past_twice_the_context_are_refused_by_their_length(server):
    """Found by a review (2026-12-02): three 5,000,000-id prompts (14 MiB, under the body limit)
    stalled every other client for 20 s: each id was visited (the lone-surrogate walk, the vocabulary
    check) before the prompt's length refused it, and /detokenize had no bound at all. A list is
    now refused by its length before any id is looked at, with this message."""
    engine = server.engine.engine
    limit, context = engine.input_processor.max_token_ids, engine.max_model_len
    assert limit == 2 * context + 1024
    ids = [28] * (limit + 1)
    why = f"has {limit + 1} token ids, more than {limit} (twice max_model_len {context}, plus 1024)"
    for path, body, param, message in (
        ("/v1/completions", {"prompt": ids, "max_tokens": 1}, "prompt", f"prompt {why}"),
        ("/v1/completions", {"prompt": [[5, 6], ids], "max_tokens": 1}, "prompt", f"prompt[1]: prompt {why}"),
        ("/tokenize", {"prompt": ids}, "prompt", f"prompt {why}"),
        ("/detokenize", {"tokens": ids}, "tokens", f"tokens {why}"),
    ):
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)
    assert post(server, "/detokenize", {"tokens": [28] * limit}).status_code == 200
    assert server.wait_idle()["prefixcache:kv_blocks_in_use"] == 0


def test_failed_prompt_fails_the_request_and_stops_the_others(server, monkeypatch):
    """Prompt 0's first output comes back as the engine reports a failed step ("error"): the
    answer is a 500 and prompt 1, which would run 400 tokens, is aborted."""
    real_generate = server.engine.generate_batch

    async def generate_batch(*args, **kwargs):
        stream = await real_generate(*args, **kwargs)

        async def outputs():
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if out.request_id.endswith("-0"):
                        out = dataclasses.replace(out, finished=True, finish_reason="error", error="test")
                    yield out

        return outputs()

    monkeypatch.setattr(server.engine, "generate_batch", generate_batch)
    before = server.wait_idle()
    body = {"prompt": ["Hello", "Write a long essay about libraries."], "max_tokens": 400, "ignore_eos": True}
    r = post(server, "/v1/completions", {**body, "stream": True})  # outputs every token: prompt 0 fails first
    assert r.status_code == 200 and sse_json(r)[-1]["error"]["code"] == "engine_error"
    after = server.wait_idle()
    assert after[ABORTED] - before.get(ABORTED, 0) == 2  # both prompts stopped early
    assert after["prefixcache:generation_tokens_total"] - before["prefixcache:generation_tokens_total"] < 400
    r = post(server, "/v1/completions", {**body, "max_tokens": 4})  # final outputs only
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    monkeypatch.undo()
    assert_nothing_left(server)
