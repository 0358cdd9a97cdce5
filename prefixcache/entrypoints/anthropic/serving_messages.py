"""``POST /v1/messages``: Anthropic's Messages API on the engine, with cache breakpoints; and
``POST /v1/messages/count_tokens``, the prompt's tokens as that route would run it.

The request is rendered by the model's chat template exactly as a chat completion is (system
blocks, then the messages; each message's text blocks joined as chat joins content parts), and run
by the same engine call, so ``cache_salt`` and the tenant isolate it as they do the OpenAI routes.
Tools: ``tools`` (custom tools: name, description, input_schema) and ``tool_choice`` are written
at the head of the system message in the Hermes format (a ``<tools>`` list of JSON signatures and
the ``<tool_call>`` convention; :func:`tools_text`), the chat template having no tool support of
its own; ``tool_use`` blocks render as ``<tool_call>`` and ``tool_result`` blocks as
``<tool_response>``. A tool's ``cache_control`` pins the prefix through that tool's signature.
The answer is text: a tool call the model writes is not parsed into a ``tool_use`` block.

Answers are Anthropic's: a ``message`` object, or with ``stream: true`` the SSE events
``message_start``, ``content_block_start``, ``content_block_delta``..., ``content_block_stop``,
``message_delta`` (stop reason and usage), ``message_stop``.

Cache breakpoints: ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on a system, tool
or message block (or at the top level of the body: on the last message's last block) pins the
prompt's prefix up to the end of that block for its ttl, refreshed on every hit
(:mod:`prefixcache.cache.pins`). A breakpoint's position is found in tokens by rendering
the conversation cut after its block and taking the tokens it shares with the whole prompt::

    | system ... block* | user ... | assistant ... block* | user ... |<generation prompt>
    |<---- pinned ---->|                                             (* = cache_control)
    |<--------------------- pinned ----------------------->|

Usage, in tokens (they add up to the prompt; exact, from the engine's own counts):
``cache_read_input_tokens`` = served from the prefix cache (the same number ``/metrics`` counts as
hits and the OpenAI routes report as ``cached_tokens``); ``cache_creation_input_tokens`` = computed
now and pinned under a breakpoint; ``input_tokens`` = the rest. ``pinned_input_tokens`` and
``pin_requested_input_tokens`` (ours) say how much of the longest breakpoint's prefix the pin
budget (``--max-pinned-fraction``) let in; non-streamed answers carry the same in the header
``x-prefixcache-pinned-tokens: PINNED/REQUESTED``.

Errors have Anthropic's body ``{"type": "error", "error": {"type", "message"}}`` (the message
names the field): 400 ``invalid_request_error``, 404 ``not_found_error`` (unknown model), 500
``api_error``, 503 ``overloaded_error``. Bad ``cache_control`` (an unknown type, a ttl other than
5m or 1h, more than 4 breakpoints, a breakpoint on an empty block) is a 400.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.cache.block import common_prefix_length
from prefixcache.cache.pins import CACHE_TTLS_S, MAX_CACHE_BREAKPOINTS, CacheBreakpoint, cache_usage
from prefixcache.engine.async_engine import EngineDeadError
from prefixcache.entrypoints.openai.api_errors import (APIError, clip, cut, error_docs, error_json, json_error_message,
                                                     unparsed_body_message, union_paths,
                                                     validation_message)
from prefixcache.entrypoints.openai.protocol import Int64
from prefixcache.entrypoints.openai.serving_engine import OpenAIServing, lone_surrogate_field
from prefixcache.entrypoints.openai.serving_outputs import final_outputs, stream_text
from prefixcache.errors import InvalidInputError
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams

logger = logging.getLogger("prefixcache.server")

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 500: "api_error",
                         503: "overloaded_error"}
# SamplingParams / engine field -> the Messages API field an error names
_FIELD_NAMES = {"stop": "stop_sequences", "prompt": "messages"}


# ---------------------------------------------------------------------------- request models
class _Request(BaseModel):
    # As the OpenAI request models: strict types, unknown fields kept (and ignored).
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class CacheControl(_Request):
    """A breakpoint: ``type`` must be ``"ephemeral"``, ``ttl`` ``"5m"`` (default) or ``"1h"``."""

    type: str
    ttl: str | None = None


class ResultBlock(_Request):
    """A block of a ``tool_result``'s content: only ``type: "text"`` is served."""

    type: str
    text: str | None = None


class ContentBlock(_Request):
    """A content block: ``text``; ``tool_use`` (an assistant's call: ``id``, ``name``, ``input``);
    ``tool_result`` (the user's answer to one: ``tool_use_id``, ``content``, ``is_error``). Other
    types are refused, naming the block."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class MessageParam(_Request):
    role: str  # "user" or "assistant"
    content: str | list[ContentBlock]


class ToolParam(_Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools (web search, ...) are refused
    cache_control: CacheControl | None = None


class ToolChoice(_Request):
    """``auto`` (the model decides), ``any`` (it must call one), ``tool`` (it must call ``name``), ``none``."""

    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Request):
    user_id: str | None = None  # accepted, not used


class MessagesRequest(_Request):
    """Anthropic's ``POST /v1/messages`` body (the fields we serve), plus ``cache_salt`` (vLLM's)."""

    model: str
    max_tokens: Int64
    messages: list[MessageParam]
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None  # default 1.0 (Anthropic's)
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: Metadata | None = None
    stream: bool | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # a breakpoint on the last block (Anthropic's automatic caching)
    cache_salt: str | None = None  # the request's prefix-cache namespace, as on the OpenAI routes


class CountTokensRequest(MessagesRequest):
    """Anthropic's ``POST /v1/messages/count_tokens`` body: a Messages request, ``max_tokens`` not needed (the
    sampling fields are checked as /v1/messages checks them, then unused)."""

    max_tokens: Int64 | None = None


# ---------------------------------------------------------------------------- response models
class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextContent(_Model):
    type: Literal["text"] = "text"
    text: str


class CacheCreation(_Model):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class MessageUsage(_Model):
    """Anthropic's usage (module docstring), plus what the pin budget let in (ours)."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation: CacheCreation
    output_tokens: int
    pinned_input_tokens: int
    pin_requested_input_tokens: int


class MessageResponse(_Model):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent]
    stop_reason: str  # end_turn, max_tokens or stop_sequence
    stop_sequence: str | None
    usage: MessageUsage


class MessageTokensCount(_Model):
    """``count_tokens``' answer: every token of the prompt (cached or not; /v1/messages' usage splits the same
    total into input, cache read and cache creation)."""

    input_tokens: int


class AnthropicErrorInfo(_Model):
    type: str  # invalid_request_error, not_found_error, api_error, overloaded_error
    message: str


class AnthropicErrorResponse(_Model):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


# One SSE event as a client parses it (the WHATWG fields).
_SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
              "required": ["data"]}
_ERROR_DESCRIPTIONS = {400: "invalid request (the message names the field)", 404: "unknown model",
                       500: "unexpected server error, or the engine step that ran the request failed",
                       503: "the engine loop has stopped, or the server is shutting down"}
# OpenAPI ``responses`` of the route: its own errors in Anthropic's shape; those answered before the
# route runs (key, method, timeouts, body size) in the OpenAI routes' shape.
MESSAGES_RESPONSES: dict[int | str, dict] = {
    200: {"model": MessageResponse, "description": "the message, or with `stream: true` its SSE events",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
    **{status: {"model": AnthropicErrorResponse, "description": text} for status, text in _ERROR_DESCRIPTIONS.items()},
    **error_docs(401, 405, 408, 413),
}
COUNT_TOKENS_RESPONSES: dict[int | str, dict] = {
    200: {"model": MessageTokensCount, "description": "the prompt's tokens"},
    **{status: {"model": AnthropicErrorResponse, "description": text} for status, text in _ERROR_DESCRIPTIONS.items()},
    **error_docs(401, 405, 408, 413),
}


# ---------------------------------------------------------------------------- errors
def anthropic_error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Anthropic's error body, ASCII JSON (as the OpenAI routes' errors)."""
    return JSONResponse(json.loads(error_json(anthropic_error_body(status, message))), status_code=status,
                        headers=headers)


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                       "message": cut(message, 1000)}}


# the union fields of the body (system, content), for validation_message's "must be a string or ..." errors
MESSAGES_UNION_PATHS = frozenset(union_paths(MessagesRequest))


class AnthropicRoute(APIRoute):
    """A route whose errors (validation included) are answered in Anthropic's shape, not OpenAI's."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                errors = e.errors()
                if errors and errors[0].get("type") == "json_invalid":
                    return anthropic_error_response(400, json_error_message(errors[0]))
                if errors and (unparsed := unparsed_body_message(errors[0], request.headers.get("content-type"))):
                    return anthropic_error_response(400, unparsed)
                return anthropic_error_response(400, validation_message(errors, MESSAGES_UNION_PATHS)[0])
            except APIError as e:
                return anthropic_error_response(e.status, e.message)
            except EngineDeadError as e:
                return anthropic_error_response(503, str(e))
            except StarletteHTTPException as e:  # a body FastAPI could not read
                return anthropic_error_response(e.status_code, str(e.detail))
            except Exception as e:
                logger.exception("a /v1/messages request failed")
                return anthropic_error_response(500, f"internal server error ({type(e).__name__})")

        return run


def _bad(message: str) -> APIError:
    return APIError(400, message)


def _field_error(e: ValueError) -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine, naming the Messages API field."""
    field = e.field if isinstance(e, InvalidInputError) else None
    message = str(e)
    name = _FIELD_NAMES.get(field, field)
    if name is not None and name != field:
        message = message.replace(field, name, 1) if message.startswith(field) else f"{name}: {message}"
    elif name is not None and not message.startswith(name):
        message = f"{name}: {message}"
    return _bad(message)


# ---------------------------------------------------------------------------- breakpoints
def _ttl_s(control: CacheControl, where: str) -> float:
    """A block's cache_control as a ttl in seconds.

    Raises:
        APIError: 400 for a type other than "ephemeral" or a ttl other than "5m" / "1h".
    """
    at = f"{where}.cache_control" if where else "cache_control"
    if control.type != "ephemeral":
        raise _bad(f"{at}.type: must be 'ephemeral', got {clip(control.type)}")
    ttl = "5m" if control.ttl is None else control.ttl
    if ttl not in CACHE_TTLS_S:
        raise _bad(f"{at}.ttl: must be '5m' or '1h', got {clip(control.ttl)}")
    return CACHE_TTLS_S[ttl]


def _blocks(content: str | list[ContentBlock] | None) -> list[ContentBlock]:
    if content is None:
        return []
    return [ContentBlock(type="text", text=content)] if isinstance(content, str) else content


def marked_blocks(req: MessagesRequest) -> list[tuple[str, int, int, float]]:
    """The request's breakpoints, checked, in prompt order: ``(where, message index, block index,
    ttl_s)``; message index -1 is the system prompt, -2 a tool (block index: the tool's).

    Raises:
        APIError: 400 naming the block: bad cache_control, a breakpoint on an empty block, more
            than :data:`MAX_CACHE_BREAKPOINTS`, a block of a type the role can't send or missing
            its fields, a tool_result answering no earlier tool_use.
    """
    found = []
    for t, tool in enumerate(req.tools or []):
        if tool.cache_control is not None:
            found.append((f"tools.{t}", -2, t, _ttl_s(tool.cache_control, f"tools.{t}")))
    places = [("system", -1, "system", req.system)]
    places += [(f"messages.{i}.content", i, m.role, m.content) for i, m in enumerate(req.messages)]
    tool_use_ids: set[str] = set()
    for name, index, role, content in places:
        if index >= 0 and not content:  # "" or []: Anthropic's 400 too
            raise _bad(f"{name}: a message's content must not be empty")
        for j, block in enumerate(_blocks(content)):
            where = name if isinstance(content, str) else f"{name}.{j}"
            _check_block(block, where, role, tool_use_ids)
            if block.cache_control is not None:
                ttl_s = _ttl_s(block.cache_control, where)
                if block.type == "text" and not block.text:
                    raise _bad(f"{where}.cache_control: cache_control cannot be set on an empty text block")
                found.append((where, index, j, ttl_s))
            elif index >= 0 and block.type == "text" and not block.text:
                raise _bad(f"{where}.text: text content blocks must be non-empty")
    if req.cache_control is not None and req.messages:  # on the last block, unless it has its own
        ttl_s = _ttl_s(req.cache_control, "")
        last, blocks = len(req.messages) - 1, _blocks(req.messages[-1].content)
        if blocks and blocks[-1].type == "text" and not blocks[-1].text:
            raise _bad("cache_control: cache_control cannot be set on an empty text block (the last message's last)")
        if blocks and not any(f[1:3] == (last, len(blocks) - 1) for f in found):
            found.append(("cache_control", last, len(blocks) - 1, ttl_s))
    for (where, *_, ttl_s), (later, *_, later_ttl_s) in zip(found, found[1:]):
        if later_ttl_s > ttl_s:  # Anthropic: longer-lived entries come first when ttls are mixed
            at = later if later == "cache_control" else f"{later}.cache_control"  # the top level's is itself
            raise _bad(f"{at}.ttl: a breakpoint with a longer ttl must come before any with a "
                       f"shorter one ({where} has the shorter)")
    if len(found) > MAX_CACHE_BREAKPOINTS:
        raise _bad(f"cache_control: a maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be "
                   f"provided, found {len(found)}")
    return found


# block types each role may send (the system prompt: text only)
_BLOCK_TYPES = {"system": ("text",), "user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


def _check_block(block: ContentBlock, where: str, role: str, tool_use_ids: set[str]) -> None:
    """Checks one content block's type and fields; records a tool_use's id in ``tool_use_ids``.

    Raises:
        APIError: 400 naming the block's field.
    """
    allowed = _BLOCK_TYPES.get(role, ("text",))
    if block.type not in allowed:
        place = {"system": "the system prompt", "user": "a user message"}.get(role, "an assistant message")
        raise _bad(f"{where}.type: only {' and '.join(allowed)} blocks are supported in {place}, got {clip(block.type)}")
    if block.type == "text" and block.text is None:
        raise _bad(f"{where}.text: a text block needs its text (a string)")
    if block.type == "tool_use":
        for field, value in (("id", block.id), ("name", block.name)):
            if not value:
                raise _bad(f"{where}.{field}: a tool_use block needs its {field} (a non-empty string)")
        if block.input is None:
            raise _bad(f"{where}.input: a tool_use block needs its input (an object)")
        _check_json(block.input, f"{where}.input")
        tool_use_ids.add(block.id)
    if block.type == "tool_result":
        if not block.tool_use_id:
            raise _bad(f"{where}.tool_use_id: a tool_result block needs the id of the tool_use it answers")
        if block.tool_use_id not in tool_use_ids:
            raise _bad(f"{where}.tool_use_id: no tool_use block with id {clip(block.tool_use_id)} comes before it")
        for k, part in enumerate(block.content if isinstance(block.content, list) else ()):
            if part.type != "text" or part.text is None:
                raise _bad(f"{where}.content.{k}: only text blocks (with their text) are supported in a tool_result")


def _check_json(value: dict[str, Any], where: str) -> None:
    """Refuses an object the prompt can't render as JSON: NaN or Infinity (which Python's parser
    takes) would be written into the prompt as non-JSON, as the OpenAI routes refuse them too."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError as e:
        raise _bad(f"{where}: is not JSON data: {e}") from e


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = ("auto", "any", "tool", "none")


def check_tools(req: MessagesRequest) -> None:
    """Checks ``tools`` and ``tool_choice``.

    Raises:
        APIError: 400 naming the field: a name that is not 1-64 of ``[a-zA-Z0-9_-]`` or repeats one,
            no ``input_schema`` (or not a JSON schema object), a server tool (``type`` other than
            ``custom``), an unknown ``tool_choice.type``, ``tool`` naming no tool, ``any``/``tool``
            without tools.
    """
    names: set[str] = set()
    for t, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise _bad(f"tools.{t}.type: only custom tools (name, description, input_schema) are supported, "
                       f"got {clip(tool.type)}")
        if not _TOOL_NAME.fullmatch(tool.name):
            raise _bad(f"tools.{t}.name: must be 1 to 64 letters, digits, '_' or '-', got {clip(tool.name)}")
        if tool.name in names:
            raise _bad(f"tools.{t}.name: tool names must be unique, {clip(tool.name)} repeats")
        names.add(tool.name)
        if tool.input_schema is None:
            raise _bad(f"tools.{t}.input_schema: Field required")
        if tool.input_schema.get("type") != "object":
            raise _bad(f"tools.{t}.input_schema.type: must be 'object' (a JSON schema of the tool's input)")
        _check_json(tool.input_schema, f"tools.{t}.input_schema")
    choice = req.tool_choice
    if choice is None:
        return
    if choice.type not in TOOL_CHOICES:
        raise _bad(f"tool_choice.type: must be one of {', '.join(TOOL_CHOICES)}, got {clip(choice.type)}")
    if choice.type in ("any", "tool") and not names:
        raise _bad(f"tool_choice: type {choice.type!r} needs tools")
    if choice.type == "tool" and choice.name not in names:
        raise _bad(f"tool_choice.name: must name one of the tools, got {clip(choice.name)}")


# ---------------------------------------------------------------------------- rendering
# Tools go at the head of the system message (Anthropic's prefix order: tools, system, messages),
# in the Hermes format most instruction-tuned models were trained on, so that the same tool list
# renders the same tokens whatever the template; calls and results as <tool_call> / <tool_response>.
_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TOOLS_TAIL = ("</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_text(req: MessagesRequest, upto: int | None = None) -> str:
    """The tool section of the system message ("" without tools); with ``upto``, cut after the
    first ``upto`` tools (a tool breakpoint's prefix)."""
    tools = req.tools or []
    if not tools:
        return ""
    lines = "".join(json.dumps({"name": t.name, "description": t.description or "", "parameters": t.input_schema},
                               ensure_ascii=False) + "\n" for t in tools[:upto])
    return _TOOLS_HEAD + lines + ("" if upto is not None else _TOOLS_TAIL)


def tool_choice_text(req: MessagesRequest) -> str:
    """The instruction ``tool_choice`` adds at the end of the system message ("" for auto): after
    the system text, so that changing it leaves the tools' and the system's prefixes cached."""
    choice = req.tool_choice
    if not req.tools or choice is None:
        return ""
    text = {"auto": "", "any": "You must call at least one of the tools.",
            "tool": f"You must call the tool {choice.name}.", "none": "Do not call any tool; answer in text."}[choice.type]
    if choice.disable_parallel_tool_use and choice.type != "none":
        text = (text + " " if text else "") + "Call at most one tool."
    return text


def block_text(block: ContentBlock) -> str:
    """One content block as the prompt renders it: a text block's text; a tool_use as a
    ``<tool_call>`` of its name and input (JSON); a tool_result as a ``<tool_response>`` of its
    text (``Error:`` first when ``is_error``)."""
    if block.type == "tool_use":
        call = json.dumps({"name": block.name, "arguments": block.input}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"
    if block.type == "tool_result":
        content = block.content
        text = content if isinstance(content, str) else "".join(p.text or "" for p in content or ())
        return f"<tool_response>\n{'Error: ' if block.is_error else ''}{text}\n</tool_response>"
    return block.text or ""


def conversation(req: MessagesRequest, cut_at: tuple[int, int] | None = None) -> list[dict[str, str]]:
    """The ``{role, content}`` dicts the chat template renders: one system message (the tools,
    then the system blocks, then the tool_choice instruction, apart by blank lines), then each
    message with its blocks joined (text blocks as chat joins content parts). With ``cut_at =
    (message index, block index)`` (-1: the system prompt, -2: the tools) it ends after that block."""
    if cut_at is not None and cut_at[0] == -2:
        return [{"role": "system", "content": tools_text(req, cut_at[1] + 1)}]
    out = []
    system = _blocks(req.system)
    if system or req.tools:
        last = len(system) if cut_at is None or cut_at[0] != -1 else cut_at[1] + 1
        parts = [tools_text(req), "".join(b.text or "" for b in system[:last])]
        if cut_at is None or cut_at[0] != -1:
            parts.append(tool_choice_text(req))
        out.append({"role": "system", "content": "\n\n".join(p for p in parts if p)})
        if cut_at is not None and cut_at[0] == -1:
            return out
    for i, message in enumerate(req.messages):
        blocks = _blocks(message.content)
        if cut_at is not None and i == cut_at[0]:
            out.append({"role": message.role, "content": "".join(block_text(b) for b in blocks[: cut_at[1] + 1])})
            return out
        out.append({"role": message.role, "content": "".join(block_text(b) for b in blocks)})
    return out


# ---------------------------------------------------------------------------- answers
STOP_REASONS = {"length": "max_tokens", "abort": "end_turn"}


def stop_reason(out: RequestOutput) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` of a finished output."""
    if out.finish_reason == "stop" and isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return STOP_REASONS.get(out.finish_reason, "end_turn"), None


def message_usage(out: RequestOutput, requested: int) -> dict[str, Any]:
    """Anthropic's usage of an output (module docstring), plus how much the pins got."""
    u = cache_usage(out.num_prompt_tokens, out.num_cached_tokens, out.pinned)
    return {
        "input_tokens": u.input_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens,
        "cache_read_input_tokens": u.cache_read_input_tokens,
        "cache_creation": {"ephemeral_5m_input_tokens": u.ephemeral_5m_input_tokens,
                           "ephemeral_1h_input_tokens": u.ephemeral_1h_input_tokens},
        "output_tokens": len(out.token_ids),
        "pinned_input_tokens": max((p.num_pinned_tokens for p in out.pinned), default=0),
        "pin_requested_input_tokens": requested,
    }


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def message_events(stream: AsyncIterator[RequestOutput], head: dict, stops: tuple[str, ...],
                         requested: int) -> AsyncIterator[str]:
    """The SSE events of a streamed message. ``message_start`` goes with the first output (the
    prompt is computed then, so its usage is exact); a failure becomes an ``error`` event."""
    sent = 0
    started = False
    try:
        async with contextlib.aclosing(stream):  # leaving early aborts the request
            async for out in stream:
                if out.finish_reason == "error":
                    yield sse("error", anthropic_error_body(500, f"the engine step running this request failed: "
                                                                 f"{out.error or 'unknown error'}"))
                    return
                if not started:
                    started = True
                    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                               "usage": message_usage(out, requested)}
                    yield sse("message_start", {"type": "message_start", "message": message})
                    yield sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                      "content_block": {"type": "text", "text": ""}})
                text = stream_text(out, stops)
                delta, sent = text[sent:], max(sent, len(text))
                if delta:
                    yield sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                      "delta": {"type": "text_delta", "text": delta}})
                if out.finished:
                    reason, sequence = stop_reason(out)
                    yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                    yield sse("message_delta", {"type": "message_delta",
                                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": message_usage(out, requested)})
                    yield sse("message_stop", {"type": "message_stop"})
                    return
    except EngineDeadError as e:
        yield sse("error", anthropic_error_body(503, str(e)))
    except Exception as e:  # the headers are out: report in the stream, never cut it silently
        logger.exception("streaming a message failed")
        yield sse("error", anthropic_error_body(500, f"internal server error ({type(e).__name__})"))


# ---------------------------------------------------------------------------- serving
_STAND_IN = "\u2063"  # a turn's text after a breakpoint's cut where the template needs one (see breakpoints)


class AnthropicServing:
    """Runs Messages requests on the engine of an :class:`OpenAIServing` (its model names, adapters
    and chat template)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    def check(self, req: MessagesRequest) -> list[tuple[str, int, int, float]]:
        """Field checks before anything is rendered; returns the breakpoints (:func:`marked_blocks`).

        Raises:
            APIError: 400 naming the field.
        """
        field = lone_surrogate_field(req)
        if field is not None:
            raise _bad(f"{field}: contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode")
        if not req.messages:
            raise _bad("messages: at least one message is required")
        for i, message in enumerate(req.messages):
            if message.role not in ("user", "assistant"):
                raise _bad(f"messages.{i}.role: must be 'user' or 'assistant', got {clip(message.role)}")
        marked = marked_blocks(req)
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:  # Anthropic's range, not OpenAI's 0..2
            raise _bad(f"temperature: must be between 0 and 1 on the Messages API, got {req.temperature}")
        check_tools(req)
        if req.messages[-1].role != "user":
            raise _bad(f"messages.{len(req.messages) - 1}.role: the last message must be the user's "
                       "(a prefilled assistant turn is not supported yet)")
        return marked

    def sampling_params(self, req: MessagesRequest) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                max_tokens=req.max_tokens,
                stop=tuple(req.stop_sequences or ()),
            )
        except ValueError as e:
            raise _field_error(e) from e

    async def breakpoints(self, req: MessagesRequest, marked: list[tuple[str, int, int, float]],
                          prompt_ids: list[int]) -> list[CacheBreakpoint]:
        """Each breakpoint's position in tokens: the tokens the conversation cut after its block
        (or tool) shares with the whole prompt."""
        found = []
        for _, index, block, ttl_s in marked:
            cut = conversation(req, (index, block))
            cut_ids = await self.engine.apply_chat_template(cut, False)
            if not self._renders(cut[-1]["content"], cut_ids):
                # A template that writes this turn only before a later one (Gemma 3 folds the system prompt into the
                # first user turn, and renders a system prompt alone as <bos>): render it with a stand-in turn after
                # it; the prompt shares that rendering up to the stand-in's text, just past the block.
                after = "assistant" if cut[-1]["role"] == "user" else "user"
                cut_ids = await self.engine.apply_chat_template(cut + [{"role": after, "content": _STAND_IN}], False)
            num_tokens = common_prefix_length(cut_ids, prompt_ids)
            if num_tokens >= 1:
                found.append(CacheBreakpoint(num_tokens, ttl_s))
        return found

    def _renders(self, text: str, ids: list[int]) -> bool:
        """Whether the rendering ``ids`` holds the end of ``text`` (the cut turn's content; "" counts as held)."""
        tail = text.strip()[-64:]
        return not tail or tail in self.engine.engine.tokenizer.decode(ids)

    async def count_tokens(self, req: CountTokensRequest) -> JSONResponse:
        """``POST /v1/messages/count_tokens``: the tokens ``POST /v1/messages`` would run for the same body
        (system, tools and messages through the chat template, the generation prompt included), with the
        same checks and refusals (``max_tokens`` absent: as if 1); nothing runs on the engine.

        Raises:
            APIError: 400 naming the field, 404 for an unknown model.
        """
        self.check(req)
        self.serving.lora_for(req.model)
        # the sampling fields are checked as there; without max_tokens, as for one generated token
        params = self.sampling_params(req if req.max_tokens is not None else req.model_copy(update={"max_tokens": 1}))
        try:
            prompt_ids = await self.engine.apply_chat_template(conversation(req))
            # what /v1/messages refuses for this prompt (one that max_model_len or the KV pool can't hold with
            # max_tokens, or with one token), so a count never says yes to a body the route says no to
            self.engine.engine.input_processor.check_fits(len(prompt_ids), params)
        except ValueError as e:
            raise _field_error(e) from e
        return JSONResponse(MessageTokensCount(input_tokens=len(prompt_ids)).model_dump())

    async def create_message(self, req: MessagesRequest, raw_request: Request, tenant: str | None) -> Response:
        """``POST /v1/messages``.

        Raises:
            APIError: 400 / 404 for a bad request, 500 when the engine failed to run it.
            EngineDeadError: the engine loop has stopped.
        """
        marked = self.check(req)
        lora = self.serving.lora_for(req.model)
        params = self.sampling_params(req)
        try:
            prompt_ids = await self.engine.apply_chat_template(conversation(req))
            breakpoints = await self.breakpoints(req, marked, prompt_ids)
        except ValueError as e:
            raise _field_error(e) from e
        block_size = self.engine.engine.config.block_size  # pins hold whole blocks
        requested = max((b.num_tokens // block_size * block_size for b in breakpoints), default=0)
        request_id = f"msg_{uuid.uuid4().hex}"
        try:
            stream = await self.engine.generate_batch([prompt_ids], params, cache_salt=req.cache_salt,
                                                      request_ids=[request_id], stream=bool(req.stream), lora=lora,
                                                      tenant=tenant, cache_control=breakpoints or None)
        except ValueError as e:
            raise _field_error(e) from e
        head = {"id": request_id, "type": "message", "role": "assistant", "model": req.model}
        if req.stream:
            return StreamingResponse(message_events(stream, head, params.stop, requested),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        outs = await final_outputs(stream, raw_request)
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        reason, sequence = stop_reason(out)
        usage = message_usage(out, requested)
        body = MessageResponse(id=request_id, model=req.model, content=[TextContent(text=out.text)],
                               stop_reason=reason, stop_sequence=sequence, usage=MessageUsage(**usage))
        pinned = f"{usage['pinned_input_tokens']}/{requested}"
        return JSONResponse(body.model_dump(), headers={"x-prefixcache-pinned-tokens": pinned})
