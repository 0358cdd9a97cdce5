"""``POST /v1/messages`` end to end: real model, real uvicorn, the real ``anthropic`` client.

Usage is checked exactly against the tokenizer's own rendering and the engine's counters
(``/metrics``); cache breakpoints against the engine's pin table. Partial-block reuse is off so
that cached counts are whole blocks (its accounting is the same path as the OpenAI routes').
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.entrypoints.conftest import MODEL, start_server, stop_server

B = 16
SYSTEM = (
    "You are the archivist of the Harbor Museum. The museum opens at ten and closes at five, every day "
    "but Monday. Guided tours start on the hour and last forty minutes; the lighthouse gallery is closed "
    "for repairs until spring. Tickets are free for children under twelve. Answer in one short sentence."
)
KEYS = {"key-acme": "acme", "key-globex": "globex"}


def ids_of(server, conversation, generation_prompt=True):
    return server.engine.engine.apply_chat_template(conversation, add_generation_prompt=generation_prompt)


def common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def create(api, helper=False, **kwargs):
    """``messages.create`` (``messages.stream`` with ``helper``), greedy: the SDK has no
    ``temperature`` argument any more, so it goes in the body."""
    kwargs["extra_body"] = {"temperature": 0, **(kwargs.get("extra_body") or {})}
    messages = api.messages if isinstance(api, anthropic.Anthropic) else api
    return messages.stream(**kwargs) if helper else messages.create(**kwargs)


def pinned_blocks(server):
    return len(server.engine.engine.kv_cache_manager.pins)


def usage_tuple(u):
    return u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens, u.output_tokens


def system_blocks(text, ttl=None):
    control = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    return [{"type": "text", "text": text, "cache_control": control}]


def test_message_equals_the_chat_route_and_usage_adds_up(anthropic_server, anthropic_client):
    question = "When does the museum open?"
    msg = create(anthropic_client, model=MODEL, max_tokens=8, system="First test. " + SYSTEM,
                                 messages=[{"role": "user", "content": question}], extra_body={"cache_salt": "t1"})
    chat_client = openai.OpenAI(base_url=anthropic_server.base_url + "/v1", api_key="unused", max_retries=0)
    chat = chat_client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, extra_body={"cache_salt": "t1-chat"},
        messages=[{"role": "system", "content": "First test. " + SYSTEM}, {"role": "user", "content": question}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    n = len(ids_of(anthropic_server, [{"role": "system", "content": "First test. " + SYSTEM},
                                      {"role": "user", "content": question}]))
    assert n == chat.usage.prompt_tokens
    assert usage_tuple(msg.usage) == (n, 0, 0, chat.usage.completion_tokens)
    # content as text blocks renders the same prompt: a hit on every full block but the last token's
    again = create(anthropic_client, model=MODEL, max_tokens=8,
                                   system=[{"type": "text", "text": "First test. "}, {"type": "text", "text": SYSTEM}],
                                   messages=[{"role": "user", "content": [{"type": "text", "text": question}]}],
                                   extra_body={"cache_salt": "t1"})
    assert again.content[0].text == msg.content[0].text
    assert usage_tuple(again.usage) == (n - (n - 1) // B * B, (n - 1) // B * B, 0, msg.usage.output_tokens)


def test_stream_events_and_final_usage(anthropic_server, anthropic_client):
    kwargs = dict(model=MODEL, max_tokens=12, system="Stream test. " + SYSTEM,
                  messages=[{"role": "user", "content": "Is the lighthouse gallery open?"}])
    whole = create(anthropic_client, **kwargs, extra_body={"cache_salt": "s1"})
    events = list(create(anthropic_client, **kwargs, stream=True, extra_body={"cache_salt": "s2"}))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    start_usage = events[0].message.usage
    assert (start_usage.input_tokens, start_usage.cache_read_input_tokens) == (whole.usage.input_tokens, 0)
    with create(anthropic_client, **kwargs, helper=True, extra_body={"cache_salt": "s1"}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    n = whole.usage.input_tokens
    assert usage_tuple(final.usage) == (n - (n - 1) // B * B, (n - 1) // B * B, 0, whole.usage.output_tokens)


def test_stop_sequences_at_the_start_and_max_tokens(anthropic_server, anthropic_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}])
    free = create(anthropic_client, **kwargs, max_tokens=10)
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 10
    stop = free.content[0].text[:3]
    for stream in (False, True):
        if stream:
            with create(anthropic_client, **kwargs, helper=True, max_tokens=10, stop_sequences=[stop]) as s:
                out = s.get_final_message()
        else:
            out = create(anthropic_client, **kwargs, max_tokens=10, stop_sequences=[stop])
        assert (out.content[0].text, out.stop_reason, out.stop_sequence) == ("", "stop_sequence", stop)


def test_breakpoint_pins_the_prefix_and_reports_creation_then_reads(anthropic_server, anthropic_client):
    system = "Breakpoint test. " + SYSTEM
    q1, q2 = "When do tours start?", "Are tickets free for children?"
    full1 = ids_of(anthropic_server, [{"role": "system", "content": system}, {"role": "user", "content": q1}])
    full2 = ids_of(anthropic_server, [{"role": "system", "content": system}, {"role": "user", "content": q2}])
    cut = ids_of(anthropic_server, [{"role": "system", "content": system}], generation_prompt=False)
    pinned = common(cut, full1) // B * B
    assert pinned >= 4 * B
    before = pinned_blocks(anthropic_server)
    raw = create(anthropic_client.messages.with_raw_response,
        model=MODEL, max_tokens=4, system=system_blocks(system, "1h"),
        messages=[{"role": "user", "content": q1}], extra_body={"cache_salt": "bp"})
    first = raw.parse()
    assert raw.headers["x-prefixcache-pinned-tokens"] == f"{pinned}/{pinned}"
    assert usage_tuple(first.usage)[:3] == (len(full1) - pinned, 0, pinned)
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == pinned
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == 0
    assert first.usage.model_extra["pinned_input_tokens"] == pinned
    assert pinned_blocks(anthropic_server) == before + pinned // B
    second = create(anthropic_client, model=MODEL, max_tokens=4, system=system_blocks(system),
                                    messages=[{"role": "user", "content": q2}], extra_body={"cache_salt": "bp"})
    read = min(common(full1, full2), len(full2) - 1) // B * B
    assert read >= pinned
    assert usage_tuple(second.usage)[:3] == (len(full2) - read, read, 0)
    assert pinned_blocks(anthropic_server) == before + pinned // B  # the same prefix: refreshed, not pinned twice
    pins = anthropic_server.engine.engine.kv_cache_manager.pins.pins
    assert max(p.ttl_s for p in pins.values()) == 3600.0
    shown = httpx.get(anthropic_server.base_url + "/v1/cache/stats").json()["pins"]  # the dashboard's data
    assert shown["budget_blocks"] == 80  # 0.5 of the 160 blocks
    assert sorted(b["block_id"] for b in shown["blocks"]) == sorted(pins)
    assert all(0 < b["expires_in_s"] <= b["ttl_s"] for b in shown["blocks"])
    page = httpx.get(anthropic_server.base_url + "/dashboard").text  # the operator sees them on the dashboard too
    assert f'<strong id="pins-summary">{len(pins)} blocks pinned of a budget of 80</strong>' in page
    soonest = shown["blocks"][0]
    assert f"<tr><td>{soonest['block_id']}</td><td>{soonest['depth']}</td><td>" in page


def test_usage_equals_what_metrics_counts(anthropic_server, anthropic_client):
    before = anthropic_server.metrics()
    system = "Metrics test. " + SYSTEM
    usages = [create(anthropic_client, model=MODEL, max_tokens=3, system=system_blocks(system),
                                     messages=[{"role": "user", "content": q}]).usage
              for q in ("Who runs the museum?", "Is it open on Monday?", "How long is a tour?")]
    after = anthropic_server.metrics()

    def delta(name):
        return after[name] - before.get(name, 0)

    assert delta("prefixcache:prefix_cache_queries_total") == sum(
        u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens for u in usages)
    assert delta("prefixcache:prefix_cache_hits_total") == sum(u.cache_read_input_tokens for u in usages)
    assert delta("prefixcache:generation_tokens_total") == sum(u.output_tokens for u in usages)
    assert usages[0].cache_creation_input_tokens > 0 and usages[1].cache_read_input_tokens > 0


def test_c25_salt_applies_on_messages(anthropic_server, anthropic_client):
    system = "Salt test. " + SYSTEM

    def cached(salt):
        extra = None if salt is None else {"cache_salt": salt}
        usage = create(anthropic_client, model=MODEL, max_tokens=2, system=system, extra_body=extra,
                       messages=[{"role": "user", "content": "Hello there"}]).usage
        return usage.cache_read_input_tokens

    assert cached("alpha") == 0
    assert cached("beta") == 0
    assert cached("alpha") > 0
    assert cached(None) == 0


def test_c25_tenants_apply_on_messages_and_pins_stay_private(smollm2):
    s = start_server(smollm2, enable_partial_block_reuse=False,
                     app_options={"api_keys": KEYS, "tenant_isolation": True})
    try:
        acme, globex = (anthropic.Anthropic(base_url=s.base_url, api_key=k, max_retries=0) for k in KEYS)
        system = "Tenant test. " + SYSTEM

        def run(client, question):
            return create(client, model=MODEL, max_tokens=2, system=system_blocks(system),
                                          messages=[{"role": "user", "content": question}]).usage

        first = run(acme, "Where is the gallery?")
        assert first.cache_creation_input_tokens > 0 and len(s.engine.engine.kv_cache_manager.pins) > 0
        assert run(globex, "Where is the gallery?").cache_read_input_tokens == 0  # acme's pinned blocks: not a hit
        assert run(acme, "Where is the shop?").cache_read_input_tokens >= first.cache_creation_input_tokens

        def shown(key):
            doc = httpx.get(s.base_url + "/v1/cache/stats", headers={"Authorization": f"Bearer {key}"}).json()
            return {b["block_id"] for b in doc["pins"]["blocks"]}

        # each tenant pinned its own copy of the prefix and sees only its own pins
        acme_pins, globex_pins = shown("key-acme"), shown("key-globex")
        assert len(acme_pins) == len(globex_pins) == first.cache_creation_input_tokens // B
        assert not acme_pins & globex_pins and len(s.engine.engine.kv_cache_manager.pins) == 2 * len(acme_pins)
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.base_url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    finally:
        stop_server(s)


def error_of(client, **kwargs):
    base = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.APIStatusError) as e:
        create(client, **{**base, **kwargs})
    assert e.value.body["type"] == "error"
    return e.value.status_code, e.value.body["error"]["type"], e.value.body["error"]["message"]


def test_bad_cache_control_gets_anthropic_errors_naming_the_field(anthropic_server, anthropic_client):
    bad = 400, "invalid_request_error"
    persistent = [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]
    assert error_of(anthropic_client, system=persistent) == (
        *bad, "system.0.cache_control.type: must be 'ephemeral', got 'persistent'")
    ten_minutes = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]
    assert error_of(anthropic_client, system=ten_minutes) == (
        *bad, "system.0.cache_control.ttl: must be '5m' or '1h', got '10m'")
    five = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    assert error_of(anthropic_client, system=five) == (
        *bad, "cache_control: a maximum of 4 blocks with cache_control may be provided, found 5")
    empty = [{"role": "user", "content": [{"type": "text", "text": "", "cache_control": {"type": "ephemeral"}}]}]
    assert error_of(anthropic_client, messages=empty) == (
        *bad, "messages.0.content.0.cache_control: cache_control cannot be set on an empty text block")
    tool = [{"name": "t", "input_schema": {"type": "object"}, "cache_control": {"type": "nope"}}]
    assert error_of(anthropic_client, tools=tool) == (
        *bad, "tools.0.cache_control.type: must be 'ephemeral', got 'nope'")
    engine = anthropic_server.engine.engine  # nothing leaked: every block is free or pinned
    assert engine.kv_cache_manager.num_free_blocks + pinned_blocks(anthropic_server) == engine.num_blocks


def test_bad_requests_get_anthropic_errors(anthropic_server, anthropic_client):
    bad = 400, "invalid_request_error"
    status, kind, message = error_of(anthropic_client, extra_body={"temperature": -1})
    assert (status, kind) == bad and message.startswith("temperature")
    assert error_of(anthropic_client, extra_body={"temperature": 1.5}) == (  # Anthropic's range is 0..1, OpenAI's 0..2
        *bad, "temperature: must be between 0 and 1 on the Messages API, got 1.5")
    # a wrong type in a union field names its forms and where the value went wrong, not a made-up member
    assert error_of(anthropic_client, system=5) == (*bad, "system: must be a string or a list of ContentBlock")
    assert error_of(anthropic_client, system=[{"type": "text", "text": "x", "cache_control": "ephemeral"}]) == (
        *bad, "system: must be a string or a list of ContentBlock; system.0.cache_control: Input should be a valid "
              "dictionary or object to extract fields from")
    assert error_of(anthropic_client, messages=[{"role": "user", "content": [{"type": "text"}]}]) == (
        *bad, "messages.0.content.0.text: a text block needs its text (a string)")
    for empty in ("", []):
        assert error_of(anthropic_client, messages=[{"role": "user", "content": empty}]) == (
            *bad, "messages.0.content: a message's content must not be empty")
    assert error_of(anthropic_client, messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]) == (
        *bad, "messages.0.content.0.text: text content blocks must be non-empty")
    mixed = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
             {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert error_of(anthropic_client, system=mixed) == (
        *bad, "system.1.cache_control.ttl: a breakpoint with a longer ttl must come before any with a shorter one "
              "(system.0 has the shorter)")
    status, kind, message = error_of(anthropic_client, stop_sequences=[""])
    assert (status, kind) == bad and message.startswith("stop_sequences")
    assert error_of(anthropic_client, model="claude-nope")[:2] == (404, "not_found_error")
    image = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
    assert error_of(anthropic_client, messages=image) == (
        *bad, "messages.0.content.0.type: only text and tool_result blocks are supported in a user message, "
              "got 'image'")
    prefilled = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert error_of(anthropic_client, messages=prefilled) == (
        *bad, "messages.1.role: the last message must be the user's (a prefilled assistant turn is not supported yet)")
    r = httpx.post(anthropic_server.base_url + "/v1/messages", json={"model": MODEL, "messages": [
        {"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(anthropic_server.base_url + "/v1/messages", content=b"{nope",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "malformed JSON body at character 1: Expecting property name enclosed in double quotes")
    r = httpx.post(anthropic_server.base_url + "/v1/messages", content=b'{"max_tokens": 2}')  # no content-type
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "body: send a JSON object with content-type: application/json (this request had no content-type)")
    ok = create(anthropic_client, model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert ok.usage.output_tokens == 2


def test_count_tokens_is_the_prompt_that_messages_runs(anthropic_server, anthropic_client):
    """``messages.count_tokens`` (the real SDK) answers every token ``messages.create`` runs for the same body:
    the rendering's length, and the sum of the message's input, cache read and cache creation tokens; its
    errors are /v1/messages' (no max_tokens needed); nothing runs on the model."""
    system = "Count test. " + SYSTEM
    messages = [{"role": "user", "content": "Which gallery is closed?"}]
    tools = [{"name": "ticket_price", "description": "A ticket's price.",
              "input_schema": {"type": "object", "properties": {"age": {"type": "integer"}}}}]
    runner = anthropic_server.engine.engine.runner
    counts = []
    for extra in ({}, {"tools": tools}):
        computed = runner.num_prompt_tokens_computed
        count = anthropic_client.messages.count_tokens(model=MODEL, system=system, messages=messages, **extra)
        assert runner.num_prompt_tokens_computed == computed  # counted, not run
        msg = create(anthropic_client, model=MODEL, max_tokens=2, system=system, messages=messages, **extra)
        u = msg.usage
        assert count.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        counts.append(count.input_tokens)
    assert counts[0] == len(ids_of(anthropic_server, [{"role": "system", "content": system}, *messages]))
    assert counts[1] > counts[0]  # the tools' signatures are in the prompt
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.count_tokens(model="claude-nope", messages=messages)
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": ""}])
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages.0.content: a message's content must not be empty"}}
    r = httpx.post(anthropic_server.base_url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["message"] == "messages: at least one message is required"
    # what /v1/messages refuses, count_tokens refuses with the same message: sampling fields without max_tokens, a
    # max_tokens or a prompt the context can't hold
    max_model_len = anthropic_server.engine.engine.max_model_len
    long_text = "word " * (max_model_len + 10)  # over max_model_len in tokens, under the character screen
    for body in ({"top_p": 2.0}, {"max_tokens": 10**9}, {"messages": [{"role": "user", "content": long_text}]}):
        replies = [httpx.post(anthropic_server.base_url + path, json={
            "model": MODEL, "messages": messages, **({"max_tokens": 4} if path == "/v1/messages" else {}), **body})
            for path in ("/v1/messages/count_tokens", "/v1/messages")]
        assert [r.status_code for r in replies] == [400, 400], body
        count_message, messages_message = (r.json()["error"]["message"] for r in replies)
        assert count_message == messages_message.replace("max_tokens 4 ", "max_tokens 1 "), body
        assert count_message.startswith(next(iter(body)) if "messages" not in body else "messages"), count_message


class _Renderer:
    """The engine side of ``AnthropicServing.breakpoints`` over a real tokenizer and its chat template."""

    def __init__(self, tokenizer):
        self.engine = type("Engine", (), {"tokenizer": tokenizer})()
        self.tokenizer = tokenizer

    async def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                                  return_dict=False)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_a_system_breakpoint_ends_after_the_system_text_whatever_the_template(model):
    """Gemma 3's template folds the system prompt into the first user turn and renders a system prompt alone as
    <bos>: the cut after the system block was 1 token, so the breakpoint pinned nothing. The cut is then rendered
    with a stand-in turn after it: the breakpoint ends just past the system text, as with SmolLM2's own turn."""
    import asyncio

    from transformers import AutoTokenizer

    from prefixcache.entrypoints.anthropic.serving_messages import (AnthropicServing, MessagesRequest, conversation,
                                                                    marked_blocks)
    from prefixcache.models.fetch import builtin_model_dir, is_complete

    if not is_complete(builtin_model_dir(model)):
        pytest.skip(f"{model} is not fetched (scripts/setup.sh fetches it)")
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_dir(model))
    system = "You are a librarian. " * 40
    req = MessagesRequest(model=model, max_tokens=4, system=system_blocks(system, "5m"),
                          messages=[{"role": "user", "content": "How do I renew a book?"}])
    renderer = _Renderer(tokenizer)
    serving = AnthropicServing(type("Serving", (), {"engine": renderer})())
    prompt_ids = asyncio.run(renderer.apply_chat_template(conversation(req)))
    (point,) = asyncio.run(serving.breakpoints(req, marked_blocks(req), prompt_ids))
    pinned = tokenizer.decode(prompt_ids[: point.num_tokens])
    assert system.strip() in pinned and "renew" not in pinned
    assert point.num_tokens >= len(tokenizer(system.strip(), add_special_tokens=False)["input_ids"])
