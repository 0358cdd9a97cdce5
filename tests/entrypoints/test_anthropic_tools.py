"""Tools on ``POST /v1/messages`` with the real ``anthropic`` client: ``tools`` and ``tool_choice``
rendered into the system message (Hermes format), ``tool_use`` / ``tool_result`` blocks, and a
tool's ``cache_control`` pinning the prefix through the tools. Usage is checked exactly against
the tokenizer's rendering of the documented format."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.entrypoints.conftest import MODEL
from tests.entrypoints.test_anthropic_messages import common, create, ids_of, pinned_blocks, usage_tuple

B = 16
TOOLS = [
    {"name": "get_weather", "description": "The current weather of a city.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time", "description": "The local time of a city, as HH:MM.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
]
SYSTEM = "You are a travel assistant. Use the tools when they help, and answer in one short sentence."
HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TAIL = ("</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call>")


def signature(tool):
    return json.dumps({"name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]})


def system_text(tools=TOOLS, system=SYSTEM, choice=""):
    """The system message the documented format makes."""
    return "\n\n".join(p for p in (HEAD + "".join(signature(t) + "\n" for t in tools) + TAIL, system, choice) if p)


def test_tools_render_into_the_prompt_and_a_tool_breakpoint_pins_through_them(anthropic_server, anthropic_client):
    tools = [TOOLS[0], {**TOOLS[1], "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    question = {"role": "user", "content": "What time is it in Lisbon?"}
    full = ids_of(anthropic_server, [{"role": "system", "content": system_text()}, question])
    cut = ids_of(anthropic_server, [{"role": "system", "content": HEAD + "".join(signature(t) + "\n" for t in TOOLS)}],
                 generation_prompt=False)
    pinned = common(cut, full) // B * B
    assert pinned >= 8 * B  # the tool signatures are most of the prompt
    before = pinned_blocks(anthropic_server)
    raw = create(anthropic_client.messages.with_raw_response, model=MODEL, max_tokens=4, tools=tools, system=SYSTEM,
                 messages=[question], extra_body={"cache_salt": "tools"})
    msg = raw.parse()
    assert [b.type for b in msg.content] == ["text"]  # a tool call the model writes stays text
    assert usage_tuple(msg.usage) == (len(full) - pinned, 0, pinned, msg.usage.output_tokens)
    assert msg.usage.cache_creation.ephemeral_1h_input_tokens == pinned
    assert raw.headers["x-prefixcache-pinned-tokens"] == f"{pinned}/{pinned}"
    assert pinned_blocks(anthropic_server) == before + pinned // B
    other = {"role": "user", "content": "Is it raining in Oslo?"}  # the same tools, another question
    again = create(anthropic_client, model=MODEL, max_tokens=4, tools=tools, system=SYSTEM, messages=[other],
                   extra_body={"cache_salt": "tools"})
    full2 = ids_of(anthropic_server, [{"role": "system", "content": system_text()}, other])
    read = min(common(full, full2), len(full2) - 1) // B * B
    assert read >= pinned
    assert usage_tuple(again.usage) == (len(full2) - read, read, 0, again.usage.output_tokens)


def test_tool_use_and_tool_result_blocks_and_tool_choice(anthropic_server, anthropic_client):
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "18 C, sunny"}]},
            {"type": "text", "text": "Summarise it."}]},
    ]
    rendered = [
        {"role": "system", "content": system_text(choice="You must call the tool get_time.")},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
                                         '{"city": "Paris"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>Summarise it."},
    ]
    n = len(ids_of(anthropic_server, rendered))
    kwargs = dict(model=MODEL, max_tokens=6, tools=TOOLS, system=SYSTEM, messages=messages)
    msg = create(anthropic_client, **kwargs, tool_choice={"type": "tool", "name": "get_time"},
                 extra_body={"cache_salt": "use"})
    assert usage_tuple(msg.usage) == (n, 0, 0, msg.usage.output_tokens)
    with create(anthropic_client, **kwargs, helper=True, tool_choice={"type": "tool", "name": "get_time"},
                extra_body={"cache_salt": "use"}) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text
    assert final.usage.cache_read_input_tokens == (n - 1) // B * B
    # another tool_choice changes only the system message's tail: the tools and system stay cached
    auto = create(anthropic_client, **kwargs, tool_choice={"type": "auto"}, extra_body={"cache_salt": "use"})
    auto_ids = ids_of(anthropic_server, [{**rendered[0], "content": system_text()}, *rendered[1:]])
    assert auto.usage.cache_read_input_tokens == common(auto_ids, ids_of(anthropic_server, rendered)) // B * B >= 8 * B
    assert auto.usage.input_tokens == len(auto_ids) - auto.usage.cache_read_input_tokens


def error_of(client, **kwargs):
    base = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, **{**base, **kwargs})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    return e.value.body["error"]["message"]


def test_bad_tools_get_anthropic_errors_naming_the_field(anthropic_server, anthropic_client):
    schema = {"type": "object"}
    assert error_of(anthropic_client, tools=[{"name": "get weather", "input_schema": schema}]) == (
        "tools.0.name: must be 1 to 64 letters, digits, '_' or '-', got 'get weather'")
    twice = [{"name": "a", "input_schema": schema}, {"name": "a", "input_schema": schema}]
    assert error_of(anthropic_client, tools=twice) == (
        "tools.1.name: tool names must be unique, 'a' repeats")
    assert error_of(anthropic_client, tools=[{"name": "a"}]) == "tools.0.input_schema: Field required"
    assert error_of(anthropic_client, tools=[{"name": "a", "input_schema": {"type": "string"}}]) == (
        "tools.0.input_schema.type: must be 'object' (a JSON schema of the tool's input)")
    assert error_of(anthropic_client, tools=[{"type": "web_search_20250305", "name": "web_search"}]) == (
        "tools.0.type: only custom tools (name, description, input_schema) are supported, got 'web_search_20250305'")
    tools = [{"name": "a", "input_schema": schema}]
    assert error_of(anthropic_client, tools=tools, tool_choice={"type": "sometimes"}) == (
        "tool_choice.type: must be one of auto, any, tool, none, got 'sometimes'")
    assert error_of(anthropic_client, tools=tools, tool_choice={"type": "tool", "name": "b"}) == (
        "tool_choice.name: must name one of the tools, got 'b'")
    assert error_of(anthropic_client, tool_choice={"type": "any"}) == "tool_choice: type 'any' needs tools"
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]
    assert error_of(anthropic_client, messages=orphan) == (
        "messages.0.content.0.tool_use_id: no tool_use block with id 'toolu_9' comes before it")
    misplaced = [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "a", "input": {}}]}]
    assert error_of(anthropic_client, messages=misplaced) == (
        "messages.0.content.0.type: only text and tool_result blocks are supported in a user message, got 'tool_use'")
    no_input = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "a"}]},
                {"role": "user", "content": "Go on."}]
    assert error_of(anthropic_client, messages=no_input) == (
        "messages.1.content.0.input: a tool_use block needs its input (an object)")


def test_non_json_numbers_and_a_top_level_ttl_order_error_name_the_field():
    # no server: the checks run on the parsed body. NaN / Infinity parse (Python's json) but are not
    # JSON, and would be rendered into the prompt as such; the top-level breakpoint is "cache_control".
    from prefixcache.entrypoints.anthropic.serving_messages import MessagesRequest, check_tools, marked_blocks
    from prefixcache.entrypoints.openai.api_errors import APIError

    def message_of(check, body):
        req = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, **body})
        with pytest.raises(APIError) as e:
            check(req)
        assert e.value.status == 400
        return e.value.message

    hi = [{"role": "user", "content": "Hi"}]
    nan_schema = [{"name": "a", "input_schema": {"type": "object", "x": float("nan")}}]
    assert message_of(check_tools, {"messages": hi, "tools": nan_schema}) == (
        "tools.0.input_schema: is not JSON data: Out of range float values are not JSON compliant")
    inf_input = hi + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "a",
                                                         "input": {"k": [float("inf")]}}]},
                      {"role": "user", "content": "Go on."}]
    assert message_of(marked_blocks, {"messages": inf_input}).startswith(
        "messages.1.content.0.input: is not JSON data: Out of range float values")
    tools = [{"name": "a", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]
    assert message_of(marked_blocks, {"messages": hi, "tools": tools,
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}) == (
        "cache_control.ttl: a breakpoint with a longer ttl must come before any with a shorter one "
        "(tools.0 has the shorter)")
