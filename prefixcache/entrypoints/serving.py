"""Serving logic of ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's ``serving_completion``
and ``serving_chat``): a parsed request → checks → :class:`SamplingParams` → engine requests (one
per prompt of a completion's list) → a JSON answer or an SSE stream, with usage; and of
``/tokenize`` / ``/detokenize`` (vLLM's ``serving_tokenization``), which tokenize by the very code
a request's prompt goes through.

A request is checked in this order, each failure a 400 naming the field in ``param`` unless said:
its JSON and field types (FastAPI with ``protocol.py``, before this module), lone surrogates in
any string, fields we don't implement, ``stream_options`` without ``stream``, the model (404), the
sampling parameters, the chat template, then the engine's own checks when the request is added.
Nothing is queued before the last, so a refused request never holds a KV block; a client that
leaves aborts its request.

A request that the engine finishes with ``finish_reason == "error"`` (the step that ran it
failed) is answered with a 500 in OpenAI's error format, or in a stream with an error event
followed by ``data: [DONE]``; other requests go on.

Logprobs (chat ``logprobs``/``top_logprobs``, completions ``logprobs``) are the engine's: the
model's raw distribution (``SamplingParams.logprobs``), one entry per generated token, shaped as
OpenAI's chat ``choices[].logprobs.content[]`` or the legacy completions object. A stream sends a
token's logprobs in the chunk whose text delta completes the token's text: a token whose text is
held back (a possible stop string, an incomplete UTF-8 character) waits with it, and the final
chunk carries every token left, so the chunks' logprobs concatenate to the non-streamed ones.
-inf is sent as -9999.0 (vLLM's clamp; JSON has no infinity).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import logging
import time
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from prefixcache.engine.async_engine import AsyncLLMEngine, EngineDeadError
from prefixcache.engine.output_processor import TokenDecoder
from prefixcache.entrypoints.api_errors import APIError, clip, cut, error_body, input_error
from prefixcache.entrypoints.cache_retention import check_prompt_cache_retention
from prefixcache.entrypoints.protocol import (
    UNSUPPORTED_FIELDS,
    CachedTokensDetails,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    PrefixCacheBlocks,
    PromptTokensDetails,
    ResponseMessage,
    SGLangExtensions,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
)
from prefixcache.errors import InvalidInputError, counted
from prefixcache.layers.lora import LoRARequest
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams, StructuredOutputsParams, encodes_utf8

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS_PER_REQUEST = 1024  # prompts in one /v1/completions request (each is an engine request)
MAX_CHAT_DEFAULT_MAX_TOKENS = 512  # chat default: the rest of the context, capped at this
logger = logging.getLogger("prefixcache.server")

MIN_LOGPROB = -9999.0  # what -inf is sent as (vLLM's clamp)

AnyRequest = CompletionRequest | ChatCompletionRequest
# The request fields that constrain the output (at most one per request), in the order checked.
STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")
CheckedRequest = CompletionRequest | ChatCompletionRequest | TokenizeRequest | DetokenizeRequest
# (output, text delta, tokens [lo, hi) whose logprobs go with it) -> the choice of a stream chunk;
# (final outputs, created) -> the answer
StreamChoice = Callable[[RequestOutput, str, int, int], dict]
MakeResponse = Callable[[list[RequestOutput], int], BaseModel]


# ---------------------------------------------------------------------------- request checks
def lone_surrogate_field(req: BaseModel) -> str | None:
    """The first declared field of ``req`` holding a string with a lone UTF-16 surrogate (JSON
    allows ``"\\ud800"``; no tokenizer or UTF-8 encoder does), or None. Walks nested lists, dicts
    and models without recursion (any JSON depth)."""
    for name in type(req).model_fields:
        stack: list[Any] = [getattr(req, name)]
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                if not value.isascii() and not encodes_utf8(value):
                    return name
            elif isinstance(value, BaseModel):
                stack.extend(getattr(value, f) for f in type(value).model_fields)
            elif isinstance(value, dict):
                stack.extend(value.keys())
                stack.extend(value.values())
            elif isinstance(value, (list, tuple)):
                if not _only_numbers(value):  # a token-id list may hold millions of ints
                    stack.extend(value)
    return None


def _only_numbers(values: list | tuple) -> bool:
    """Every item is an int, float or bool (checked at C speed: no Python loop per item)."""
    return set(map(type, values)) <= {int, float, bool}


def _changes_nothing(value: Any, noops: tuple[Any, ...]) -> bool:
    """``value`` is null or equal to one of ``noops`` (a bool never equals a number here)."""
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in noops)


def check_request(req: CheckedRequest, endpoint: str) -> None:
    """Refuses lone surrogates and fields we don't implement (``endpoint``: "completions", "chat"
    or "tokenize").

    Raises:
        APIError: 400 naming the field.
    """
    field = lone_surrogate_field(req)
    if field is not None:
        raise APIError(400, f"{field} contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                            "valid Unicode text", field, "invalid_unicode")
    unsupported = UNSUPPORTED_FIELDS[endpoint]
    for name, value in (req.model_extra or {}).items():
        if name in unsupported and not _changes_nothing(value, unsupported[name]):
            raise APIError(400, f"{name} is not supported yet", name, "unsupported_parameter")


def structured_output_field(req: AnyRequest) -> str | None:
    """The field holding the request's output constraint (``response_format`` of type ``text``
    constrains nothing), or None.

    Raises:
        APIError: 400 naming the second such field when a request sets two.
    """
    given = [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format.type == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise APIError(400, f"{given[1]} can't be combined with {given[0]}: give one output constraint", given[1])
    return given[0] if given else None


def structured_outputs(req: AnyRequest) -> StructuredOutputsParams | None:
    """The request's output constraint (OpenAI's ``response_format``, vLLM's ``structured_outputs``
    or its older ``guided_json`` / ``guided_regex`` / ``guided_choice``), or None.

    Raises:
        APIError: 400 naming the field: two constraints, a ``json_schema`` without ``schema``, a
            ``structured_outputs`` key we don't implement (``grammar``, ...), or a malformed one.
    """
    name = structured_output_field(req)
    if name is None:
        return None
    value = getattr(req, name)
    try:
        if name == "response_format":
            if value.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if value.json_schema is None or value.json_schema.json_schema is None:
                raise APIError(400, "response_format: json_schema.schema is required for type json_schema", name)
            return StructuredOutputsParams(json=value.json_schema.json_schema)
        if name == "structured_outputs":
            for key, extra in (value.model_extra or {}).items():
                if extra is not None:
                    raise APIError(400, f"structured_outputs.{cut(key)} is not supported yet", name,
                                   "unsupported_parameter")
            return StructuredOutputsParams(json=value.json_schema, regex=value.regex, choice=value.choice,
                                           json_object=bool(value.json_object))
        keyword = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}[name]
        return StructuredOutputsParams(**{keyword: value})
    except InvalidInputError as e:
        raise APIError(400, f"{name}: {e}", name) from e


def message_text(content: str | list[dict] | None) -> str:
    """A chat message's text: a string, or the concatenated text of its content parts.

    Raises:
        APIError: 400 (``messages``) for a non-text part.
    """
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "messages: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def chat_conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The ``{role, content}`` dicts the chat template renders (chat completions and ``/tokenize``).

    Raises:
        APIError: 400 (``messages``) for an empty list or a non-text content part.
    """
    if not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    return [{"role": m.role, "content": message_text(m.content)} for m in messages]


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completion request's prompts: one text or token-id list, or a list of them.

    Raises:
        APIError: 400 (``prompt``) for an empty list of prompts or more than
            :data:`MAX_PROMPTS_PER_REQUEST` (an empty single prompt is the engine's to refuse).
    """
    if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], (str, list)):
        return [prompt]  # one text, or one token-id list ([] included: the engine names it)
    if len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise APIError(400, f"prompt: a list of {len(prompt)} prompts; at most {MAX_PROMPTS_PER_REQUEST} per "
                            "request", "prompt")
    return list(prompt)


def check_echo(req: CompletionRequest) -> None:
    """``echo`` with ``logprobs`` covers the prompt's tokens too (from its prompt logprobs, which
    come whole once the prompt is computed), so it is not streamed, as vLLM's prompt logprobs.

    Raises:
        APIError: 400 (``echo``) for ``echo: true`` with ``logprobs`` and ``stream: true``.
    """
    if req.echo and req.logprobs is not None and req.stream:
        raise APIError(400, "echo with logprobs is not available with stream: true", "echo", "unsupported_parameter")


def echo_only(req: CompletionRequest) -> bool:
    """``echo: true`` with ``max_tokens: 0`` (OpenAI's legacy API and vLLM's
    ``echo_without_generation``, used to score a prompt's logprobs): the answer is the prompt alone.
    The engine generates at least one token, so the request runs with ``max_tokens = 1`` and
    :func:`without_generation` drops that token. ``max_tokens: 0`` without echo stays a 400.

    Raises:
        APIError: 400 (``min_tokens``) for ``min_tokens`` > 0 with it, as for any ``max_tokens``.
    """
    if not (req.echo and req.max_tokens == 0):
        return False
    if req.min_tokens:
        raise APIError(400, f"min_tokens must be in [0, max_tokens=0], got {req.min_tokens}", "min_tokens")
    return True


async def without_generation(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The outputs of an :func:`echo_only` request with the generated token dropped: no text,
    tokens or logprobs, finished by ``"length"`` (``max_tokens`` 0 reached; a failed or aborted
    request keeps its reason). Closing it closes ``stream``."""
    async with contextlib.aclosing(stream):
        async for out in stream:
            ended = out.finish_reason in ("stop", "length")
            yield dataclasses.replace(out, text="", token_ids=[], logprobs=None if out.logprobs is None else [],
                                      finish_reason="length" if ended else out.finish_reason,
                                      stop_reason=None if ended else out.stop_reason)


def echo_logprobs(out: RequestOutput, num_logprobs: int, decoder: TokenDecoder) -> CompletionLogprobs:
    """The legacy ``logprobs`` of an echoed prompt's tokens (vLLM's layout: the first token has
    ``None``; offsets add up the tokens' texts from 0), from ``out.prompt_logprobs``."""
    result = CompletionLogprobs()
    offset = 0
    for i, token_id in enumerate(out.prompt_token_ids):
        entry = out.prompt_logprobs[i]
        text = decoder.text(token_id) if entry is None else entry[token_id].decoded_token
        result.tokens.append(text)
        result.token_logprobs.append(None if entry is None else _logprob(entry[token_id].logprob))
        result.top_logprobs.append(None if entry is None else {
            lp.decoded_token: _logprob(lp.logprob) for lp in list(entry.values())[:num_logprobs]})
        result.text_offset.append(offset)
        offset += len(text)
    return result


# ---------------------------------------------------------------------------- outputs
def _per_prompt(outs: list[RequestOutput]) -> list[RequestOutput]:
    """One final output per prompt of a request: its lowest choice index (the sample that carries
    the prompt's counts)."""
    return list({o.request_id: o for o in reversed(outs)}.values())


def usage(outs: list[RequestOutput]) -> Usage:
    """Usage of a request from its samples' final outputs: each prompt counted once (its first
    sample's counts; several prompts of one completion request are summed, as vLLM does), the
    completion tokens of every sample."""
    prompts = {o.request_id: o for o in _per_prompt(outs)}
    prompt_tokens = sum(o.num_prompt_tokens for o in prompts.values())
    completion_tokens = sum(len(o.token_ids) for o in outs)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in prompts.values())),
    )


def cached_tokens_details(prompts: Iterable[RequestOutput]) -> CachedTokensDetails:
    """SGLang's ``cached_tokens_details`` of a request, from one output of each of its prompts (the
    sample that carries the prompt's counts, as :func:`usage` takes): its cached tokens split by
    where they came from, ``device`` (the KV pool: full blocks, partial-block copies) and
    ``storage`` (the KV tiers, named in ``storage_backend``); ``host`` is 0, we have no memory
    tier between the pool and the disk."""
    tiers: dict[str, int] = {}
    device = 0
    for out in prompts:
        device += out.num_cached_tokens - sum(out.cached_tier_tokens.values())
        for name, num_tokens in out.cached_tier_tokens.items():
            tiers[name] = tiers.get(name, 0) + num_tokens
    storage = sum(tiers.values())
    return CachedTokensDetails(device=device, host=0, storage=storage,
                               storage_backend="+".join(n for n, t in tiers.items() if t) if storage else None)


async def numbered(stream: AsyncIterator[RequestOutput],
                   first_choice: Mapping[str, int]) -> AsyncIterator[RequestOutput]:
    """The outputs of a multi-prompt request with ``index`` turned into the choice index:
    ``first_choice[request_id] + sample index``, i.e. ``prompt_index * n + sample_index``
    (vLLM's ``serving_completion`` rule). Closing it closes ``stream`` (aborting what runs)."""
    async with contextlib.aclosing(stream):
        async for out in stream:
            yield dataclasses.replace(out, index=first_choice[out.request_id] + out.index)


def stream_text(out: RequestOutput, stops: tuple[str, ...]) -> str:
    """The part of a streaming output's text that is safe to send.

    Until the request finishes, hold back a trailing incomplete UTF-8 character and any tail that
    could still grow into a stop string (which the final text drops), so the concatenated deltas
    equal the non-streamed text.
    """
    text = out.text
    if out.finished:
        return text
    text = text.rstrip("\ufffd")
    return text[: len(text) - stop_prefix_hold(text, stops)]


def stop_prefix_hold(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string (0 if none).

    Only tails starting at a character equal to a stop string's first one are compared, so the
    work is about the stop strings' length, not its square.
    """
    hold = 0
    for stop in stops:
        window = len(stop) - 1
        start = max(0, len(text) - window)
        i = text.find(stop[0], start)
        while 0 <= i and len(text) - i > hold:
            if stop.startswith(text[i:]):
                hold = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return hold


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict] | None] | None:
    """vLLM's JSON of a request's prompt logprobs: per prompt token, token id (as a string) →
    {logprob, rank, decoded_token}; None when not asked for."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in out.prompt_logprobs]


def sse_event(data: dict) -> str:
    """One SSE event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def failed_output_error(out: RequestOutput) -> APIError:
    """The 500 for a request the engine finished with ``finish_reason == "error"``."""
    return APIError(500, f"the engine step running this request failed: {out.error or 'unknown error'}",
                    None, "engine_error")


async def _wait_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def final_outputs(stream: AsyncIterator[RequestOutput], raw_request: Request) -> list[RequestOutput] | None:
    """Each sample's final output, by index; None (and the request aborted) if the client
    disconnects.

    Raises:
        APIError: 500 when the engine finished a sample with ``finish_reason == "error"`` (the
            other samples are aborted).
        EngineDeadError: the engine loop stopped, or the server is shutting down.
    """

    async def last() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(stream):  # leaving early aborts the request's other samples
            async for out in stream:
                if out.finish_reason == "error":
                    raise failed_output_error(out)
                if out.finished:
                    finals[out.index] = out
        return [finals[i] for i in sorted(finals)]

    task = asyncio.ensure_future(last())
    disconnect = asyncio.ensure_future(_wait_disconnect(raw_request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if task.done():
        return task.result()
    task.cancel()  # the stream's cleanup aborts the request and frees its blocks
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


class _TokenCoverage:
    """Which of a streamed sample's tokens its sent text covers: token i goes out once the text
    sent reaches the length its text had when it arrived (trailing U+FFFD not counted)."""

    def __init__(self) -> None:
        self.needs: list[int] = []  # per token, non-decreasing
        self.num_sent = 0  # tokens whose logprobs went out

    def advance(self, out: RequestOutput, num_chars_sent: int) -> tuple[int, int]:
        """Records ``out``'s new tokens; returns the token range ``[lo, hi)`` to send now."""
        if len(self.needs) < len(out.token_ids):
            need = max(len(out.text.rstrip("\ufffd")), self.needs[-1] if self.needs else 0)
            self.needs.extend([need] * (len(out.token_ids) - len(self.needs)))
        lo = self.num_sent
        hi = len(out.token_ids) if out.finished else bisect.bisect_right(self.needs, num_chars_sent)
        return lo, max(lo, hi)


async def sse_events(
    stream: AsyncIterator[RequestOutput],
    stops: tuple[str, ...],
    make_chunk: Callable[[RequestOutput, str, int, int], dict],
    usage_chunk: Callable[[list[RequestOutput]], dict] | None,
) -> AsyncIterator[str]:
    """SSE events: one chunk per text delta of each sample (its last one with finish_reason),
    then usage once every sample finished, then ``[DONE]``. ``make_chunk(out, delta, lo, hi)``
    gets the tokens ``[lo, hi)`` whose text the chunk completes (module docstring). A failure (a
    sample finished with ``"error"``, the engine gone, a bug here) becomes an error event before
    ``[DONE]``."""
    sent: dict[int, int] = {}
    coverage: dict[int, _TokenCoverage] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async with contextlib.aclosing(stream):  # leaving early aborts the rest of the request
            async for out in stream:
                if out.finish_reason == "error":
                    e = failed_output_error(out)
                    yield sse_event(error_body(e.status, e.message, e.param, e.code))
                    break
                text = stream_text(out, stops)
                done = sent.get(out.index, 0)
                delta, sent[out.index] = text[done:], max(done, len(text))
                tokens = coverage.setdefault(out.index, _TokenCoverage())
                lo, hi = tokens.advance(out, sent[out.index])
                if delta or out.finished:
                    yield sse_event(make_chunk(out, delta, lo, hi))
                    tokens.num_sent = hi
                if out.finished:
                    finals[out.index] = out
            else:
                if usage_chunk is not None and finals:
                    yield sse_event(usage_chunk([finals[i] for i in sorted(finals)]))
    except EngineDeadError as e:
        yield sse_event(error_body(503, str(e), None, "engine_dead"))
    except Exception as e:  # the headers are out: report in the stream, never cut it silently
        logger.exception("streaming a response failed")
        yield sse_event(error_body(500, f"internal server error ({type(e).__name__})", None, "internal_error"))
    yield "data: [DONE]\n\n"


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(out: RequestOutput, lo: int, hi: int, top_logprobs: int, decoder: TokenDecoder) -> ChatLogprobs:
    """OpenAI's chat ``logprobs`` of tokens ``[lo, hi)`` of ``out``: each chosen token with its
    text, logprob and bytes, and the ``top_logprobs`` most likely tokens (best first)."""
    content = []
    for token_id, entry in zip(out.token_ids[lo:hi], out.logprobs[lo:hi]):
        top = [TopLogprob(token=lp.decoded_token, logprob=_logprob(lp.logprob), bytes=list(decoder.bytes(t)))
               for t, lp in list(entry.items())[:top_logprobs]]
        chosen = entry[token_id]
        content.append(ChatLogprobToken(token=chosen.decoded_token, logprob=_logprob(chosen.logprob),
                                        bytes=list(decoder.bytes(token_id)), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(out: RequestOutput, lo: int, hi: int, num_logprobs: int, text_offset: int) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` of tokens ``[lo, hi)`` of ``out``; ``text_offset`` is
    where token ``lo`` starts (offsets add up the tokens' texts, as vLLM's do)."""
    result = CompletionLogprobs()
    for token_id, entry in zip(out.token_ids[lo:hi], out.logprobs[lo:hi]):
        chosen = entry[token_id]
        result.tokens.append(chosen.decoded_token)
        result.token_logprobs.append(_logprob(chosen.logprob))
        result.top_logprobs.append({lp.decoded_token: _logprob(lp.logprob) for lp in list(entry.values())[:num_logprobs]})
        result.text_offset.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return result


def _renamed(error: APIError, renames: dict[str, str]) -> APIError:
    """``error`` naming the field the client sent (``max_completion_tokens`` for ``max_tokens``)."""
    if error.param not in renames:
        return error
    name = renames[error.param]
    # every mention as a whole word ("lower max_tokens to ..." too; "top_logprobs" is not "logprobs")
    message = re.sub(rf"(?<![\w.]){re.escape(error.param)}(?!\w)", name, error.message)
    return APIError(error.status, message, name, error.code)


def logit_bias_ids(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON's ``{"token id": bias}`` with int keys.

    Raises:
        APIError: 400 (``logit_bias``) for a key that is not a decimal token id.
    """
    if logit_bias is None:
        return None
    converted = {}
    for key, bias in logit_bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 20:
            raise APIError(400, f"logit_bias keys must be token ids (decimal strings), got {clip(key)}", "logit_bias")
        converted[int(key)] = bias
    return converted


# ---------------------------------------------------------------------------- the endpoints
def check_lora_module_names(served_model_name: str, lora_modules: Mapping[str, str]) -> None:
    """An adapter may not take the served model's name: requests naming it run the base model, so
    the adapter could never be reached (and ``/v1/models`` would list the name twice).

    Raises:
        ValueError: naming ``--lora-modules`` and the name.
    """
    if served_model_name in lora_modules:
        raise ValueError(f"--lora-modules: the adapter name {served_model_name!r} is the served model's name "
                         "(--served-model-name, else the model argument); give the adapter another name")


class OpenAIServing:
    """Runs OpenAI requests on one engine.

    Args:
        async_engine: the engine; its loop runs on the serving event loop.
        served_model_name: the model name clients send (``model`` may also be omitted).
        lora_modules: adapter name → PEFT directory; ``model`` set to a name selects its adapter.
    """

    def __init__(self, async_engine: AsyncLLMEngine, served_model_name: str,
                 lora_modules: dict[str, str] | None = None) -> None:
        check_lora_module_names(served_model_name, lora_modules or {})
        self.engine = async_engine
        self.served_model_name = served_model_name
        self.lora_modules = dict(lora_modules or {})
        self.token_decoder = TokenDecoder(async_engine.engine.tokenizer)  # logprobs' token bytes

    def begin(self, req: CompletionRequest | ChatCompletionRequest, kind: str) -> tuple[LoRARequest | None, str]:
        """Checks a request's fields for ``kind`` (``"completions"`` or ``"chat"``); returns its
        adapter and the model name its response carries.

        Raises:
            APIError: 400 for a refused field, 404 for an unknown model.
        """
        check_request(req, kind)
        if req.stream_options is not None and not req.stream:  # vLLM's and OpenAI's rule
            raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        if req.prompt_logprobs is not None and req.stream:  # as vLLM: they come whole, after the prompt
            raise APIError(400, "prompt_logprobs is not available with stream: true", "prompt_logprobs")
        check_prompt_cache_retention(req.prompt_cache_retention, self.engine.engine.config.kv_disk_dir is not None)
        return self.lora_for(req.model), req.model or self.served_model_name

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The request's adapter (None for the base model).

        Raises:
            APIError: 404 (``model``) for a name this server doesn't serve.
        """
        if model is None or model == self.served_model_name:
            return None
        if model in self.lora_modules:
            return LoRARequest(model, self.lora_modules[model])
        names = [self.served_model_name, *self.lora_modules]
        raise APIError(404, f"model {clip(model)} does not exist; this server serves {names}", "model",
                       "model_not_found")

    @staticmethod
    def sampling_params(req: AnyRequest, max_tokens: int | None, default_max_tokens: int, prompt_field: str,
                        logprobs: int | None = None, renames: dict[str, str] | None = None) -> SamplingParams:
        """The request's :class:`SamplingParams` (``None`` fields take the defaults).

        Args:
            logprobs: ``SamplingParams.logprobs`` (the endpoint reads it from its own fields).
            renames: SamplingParams field -> the request field an error names instead.

        Raises:
            APIError: 400 naming the invalid field.
        """
        def default(value, fallback):
            return fallback if value is None else value

        try:
            return SamplingParams(
                temperature=default(req.temperature, 1.0),
                top_p=default(req.top_p, 1.0),
                top_k=default(req.top_k, 0),
                max_tokens=default(max_tokens, default_max_tokens),
                seed=req.seed,
                stop=default(req.stop, ()),  # "" is refused, as [""] is
                stop_token_ids=default(req.stop_token_ids, ()),
                ignore_eos=bool(req.ignore_eos),
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                n=default(req.n, 1),
                structured_outputs=structured_outputs(req),
                prompt_logprobs=req.prompt_logprobs,
                presence_penalty=default(req.presence_penalty, 0.0),
                frequency_penalty=default(req.frequency_penalty, 0.0),
                repetition_penalty=default(req.repetition_penalty, 1.0),
                min_p=default(req.min_p, 0.0),
                min_tokens=default(req.min_tokens, 0),
                logit_bias=logit_bias_ids(req.logit_bias),
                logprobs=logprobs,
            )
        except ValueError as e:
            raise _renamed(input_error(e, prompt_field), renames or {}) from e

    async def start(self, prompts: list[str | list[int]], params: SamplingParams, req: AnyRequest, request_id: str,
                    prompt_field: str, lora: LoRARequest | None, tenant: str | None,
                    renames: dict[str, str] | None = None) -> AsyncIterator[RequestOutput]:
        """Adds one engine request per prompt, together (the scheduler runs them in the same
        steps; none is queued if one is refused); their outputs as one stream, ``index`` being
        the choice index (``prompt_index * n + sample_index``). The engine ids are ``request_id``
        for one prompt, ``request_id-i`` for several (vLLM's). ``renames``: see
        :meth:`sampling_params`.

        Raises:
            APIError: 400 for input the engine refuses.
            EngineDeadError: the engine loop has stopped.
        """
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        try:
            stream = await self.engine.generate_batch(prompts, params, cache_salt=req.cache_salt, request_ids=ids,
                                                      stream=bool(req.stream), lora=lora, tenant=tenant,
                                                      priority=req.priority or 0)
        except ValueError as e:
            if isinstance(e, InvalidInputError) and e.field == "structured_outputs":  # a schema that doesn't compile
                name = structured_output_field(req)
                raise APIError(400, f"{name}: {e}", name) from e
            raise _renamed(input_error(e, prompt_field), renames or {}) from e
        return stream if len(ids) == 1 else numbered(stream, {rid: i * params.n for i, rid in enumerate(ids)})

    async def respond(self, req: AnyRequest, params: SamplingParams, stream: AsyncIterator[RequestOutput],
                      raw_request: Request, head: dict, stream_choice: StreamChoice,
                      make_response: MakeResponse) -> Response | BaseModel:
        """An SSE stream of chunks (``head`` = id, object, created, model; one choice each, from
        ``stream_choice(out, delta, lo, hi)`` (with its logprobs) plus the finish and stop
        reasons; with ``stream_options.continuous_usage_stats`` each carries its choice's usage so
        far, with ``include_usage`` a final chunk the request's), or ``make_response(final outputs,
        created)``; 499 if a non-streaming client went away."""
        details = bool(req.return_cached_tokens_details)
        if not req.stream:
            outs = await final_outputs(stream, raw_request)
            if outs is None:
                return Response(status_code=499)
            answer = make_response(outs, head["created"])
            if details:
                answer.sglext = SGLangExtensions(cached_tokens_details=cached_tokens_details(_per_prompt(outs)))
            return answer
        options = req.stream_options
        with_usage = bool(options is not None and options.include_usage)
        continuous = with_usage and bool(options.continuous_usage_stats)  # vLLM's: only with include_usage
        prompts: dict[str, RequestOutput] = {}  # per prompt, the output carrying its cached-token counts

        def sglext(outs: Iterable[RequestOutput]) -> dict:
            return {"sglext": {"cached_tokens_details": cached_tokens_details(outs).model_dump()}} if details else {}

        def chunk(out: RequestOutput, delta: str, lo: int, hi: int) -> dict:
            choice = stream_choice(out, delta, lo, hi)
            choice["finish_reason"] = out.finish_reason if out.finished else None
            extra = {}
            if out.finished:
                choice["stop_reason"] = out.stop_reason
                # SGLang's clients read sglext from whichever chunk has it, usage chunk or not: each
                # finish chunk carries the prompts seen so far, the last one the request's.
                known = prompts.get(out.request_id)
                if known is None or out.num_cached_tokens > known.num_cached_tokens:
                    prompts[out.request_id] = out
                extra = sglext(prompts.values())
            if continuous:  # vLLM's: the chunk's choice so far (its prompt, its tokens generated yet)
                return {**head, "choices": [choice], "usage": usage([out]).model_dump(), **extra}
            return {**head, "choices": [choice], **({"usage": None} if with_usage else {}), **extra}

        def usage_chunk(outs: list[RequestOutput]) -> dict:
            return {**head, "choices": [], "usage": usage(outs).model_dump(), **sglext(_per_prompt(outs))}

        events = sse_events(stream, params.stop, chunk, usage_chunk if with_usage else None)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def create_completion(self, req: CompletionRequest, raw_request: Request,
                                tenant: str | None) -> Response | BaseModel:
        """``POST /v1/completions``: one prompt or a list of them (``n`` choices each, indexes
        ``prompt_index * n + sample_index``, usage summed over the prompts); ``echo`` starts each
        choice's text with its prompt (a streamed choice's first chunk carries it).

        Raises:
            APIError: 400 / 404 for a bad request, 500 when the engine failed to run it.
            EngineDeadError: the engine loop has stopped.
        """
        check_echo(req)
        lora, model_name = self.begin(req, "completions")
        prompts = completion_prompts(req.prompt)
        prompt_only = echo_only(req)
        params = self.sampling_params(req, 1 if prompt_only else req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                                      "prompt", req.logprobs)
        echo_lps = bool(req.echo) and params.logprobs is not None  # the prompt's tokens get logprobs too
        if echo_lps:
            params = dataclasses.replace(params, prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))
        echoes = await self.prompt_texts(prompts) if req.echo else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self.start(prompts, params, req, request_id, "prompt", lora, tenant)
        if prompt_only:
            stream = without_generation(stream)
        echoed: set[int] = set()  # choices whose prompt went out (streaming)
        offsets: dict[int, int] = {}  # per streamed choice: where its next token's text starts

        def logprobs(out: RequestOutput, lo: int, hi: int) -> CompletionLogprobs | None:
            if params.logprobs is None:
                return None
            head = echo_logprobs(out, params.logprobs, self.token_decoder) if echo_lps else None
            start = offsets.get(out.index, 0) if head is None else sum(len(t) for t in head.tokens)
            result = completion_logprobs(out, lo, hi, params.logprobs, start)
            offsets[out.index] = start + sum(len(t) for t in result.tokens)
            if head is not None:  # non-streamed: the prompt's tokens first
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(head, name).extend(getattr(result, name))
                return head
            return result

        def choice(out: RequestOutput, delta: str, lo: int, hi: int) -> dict:
            if echoes is not None and out.index not in echoed:
                echoed.add(out.index)
                delta = echoes[out.index // params.n] + delta
            lp = logprobs(out, lo, hi)
            return {"index": out.index, "text": delta, "logprobs": None if lp is None else lp.model_dump()}

        def response(outs: list[RequestOutput], created: int) -> CompletionResponse:
            return CompletionResponse(
                id=request_id, created=created, model=model_name, usage=usage(outs),
                choices=[CompletionChoice(index=o.index, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                          text=o.text if echoes is None else echoes[o.index // params.n] + o.text,
                                          logprobs=logprobs(o, 0, len(o.token_ids)),
                                          prompt_logprobs=None if req.prompt_logprobs is None else prompt_logprobs_json(o))
                         for o in outs],
            )

        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_name}
        return await self.respond(req, params, stream, raw_request, head, choice, response)

    async def prompt_texts(self, prompts: list[str | list[int]]) -> list[str]:
        """Each prompt's text for ``echo``: a text as sent, token ids decoded (special tokens kept).

        Raises:
            APIError: 400 (``prompt``) for a token id outside the vocabulary.
        """
        texts = []
        for i, prompt in enumerate(prompts):
            try:
                texts.append(prompt if isinstance(prompt, str) else await self.engine.detokenize(prompt, "prompt"))
            except ValueError as e:
                where = f"prompt[{i}]: " if len(prompts) > 1 else ""
                raise APIError(400, where + str(e), "prompt") from e
        return texts

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """``POST /tokenize`` (vLLM's): the token ids a completion (``prompt``) or chat
        (``messages``) request with the same input feeds the engine, by the same code
        (``usage.prompt_tokens`` is their count), and how they fall into KV blocks.

        Raises:
            APIError: 400 naming the field (``prompt`` / ``messages`` for bad input, or when neither
                or both are given), 404 for an unknown model.
        """
        check_request(req, "tokenize")
        self.lora_for(req.model)  # adapters don't change tokenization, but the name must exist
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt (a completion's input) or messages (a chat's)", "prompt")
        try:
            if req.messages is not None:
                generation_prompt = req.add_generation_prompt is not False
                ids = await self.engine.apply_chat_template(chat_conversation(req.messages), generation_prompt,
                                                            bool(req.add_special_tokens))
            else:
                ids = await self.engine.tokenize(req.prompt, req.add_special_tokens is not False)
        except ValueError as e:
            raise input_error(e, "prompt" if req.messages is None else "messages") from e
        block_size = self.engine.engine.config.block_size
        return TokenizeResponse(
            count=len(ids), max_model_len=self.engine.engine.max_model_len, tokens=ids,
            token_strs=await self.engine.token_strs(ids) if req.return_token_strs else None,
            prefix_cache=PrefixCacheBlocks(block_size=block_size, num_full_blocks=len(ids) // block_size),
        )

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """``POST /detokenize`` (vLLM's): token ids → text, special tokens kept.

        Raises:
            APIError: 400 (``tokens``) for an id outside the vocabulary, 404 for an unknown model.
        """
        check_request(req, "tokenize")
        self.lora_for(req.model)
        try:
            return DetokenizeResponse(prompt=await self.engine.detokenize(req.tokens, "tokens"))
        except ValueError as e:
            raise input_error(e, "tokens") from e

    def chat_default_max_tokens(self, num_prompt_tokens: int, n: int) -> int:
        """Chat's default ``max_tokens``: the rest of the context, as far as the pool can hold it for
        each of the ``n`` samples (they share the prompt's full blocks), capped at
        :data:`MAX_CHAT_DEFAULT_MAX_TOKENS`."""
        room = self.engine.engine.input_processor.max_tokens_that_fit(num_prompt_tokens, n)
        return max(1, min(MAX_CHAT_DEFAULT_MAX_TOKENS, room))

    def default_does_not_fit(self, num_prompt_tokens: int, n: int) -> APIError:
        """The 400 for a chat request without ``max_tokens`` that the pool can't hold even with the
        smallest default (1 token per sample): it names ``n`` when fewer samples would fit, else
        ``messages`` (the prompt itself is too long for the pool). The blocks are counted by the
        engine's own rule (``InputProcessor.kv_blocks_needed``)."""
        engine = self.engine.engine
        num_blocks, blocks_needed = engine.num_blocks, engine.input_processor.kv_blocks_needed
        full = num_prompt_tokens // engine.config.block_size
        per_sample = blocks_needed(num_prompt_tokens, 1) - full  # blocks after the shared ones
        needed = blocks_needed(num_prompt_tokens, 1, n)
        fitting = (num_blocks - full) // per_sample if num_blocks > full else 0
        prompt = f"the prompt ({counted(num_prompt_tokens, 'token')}) plus 1 token"
        if fitting >= 1:
            return APIError(400, f"n={n} samples don't fit the KV pool even with the smallest default max_tokens "
                                 f"(1): {prompt} for each of n={n} samples needs {counted(needed, 'KV block')} but "
                                 f"the pool has {counted(num_blocks, 'block')}; lower n to at most {fitting} or "
                                 "raise num_blocks / kv_cache_memory_bytes", "n")
        return APIError(400, f"messages: {prompt} needs {counted(full + per_sample, 'KV block')} but the pool has "
                             f"{counted(num_blocks, 'block')}; shorten the messages or raise num_blocks / "
                             "kv_cache_memory_bytes", "messages")

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request,
                                     tenant: str | None) -> Response | BaseModel:
        """``POST /v1/chat/completions``.

        Raises:
            APIError: 400 / 404 for a bad request, 500 when the engine failed to run it.
            EngineDeadError: the engine loop has stopped.
        """
        lora, model_name = self.begin(req, "chat")
        try:
            prompt_ids = await self.engine.apply_chat_template(chat_conversation(req.messages))
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
        n = req.n if isinstance(req.n, int) and req.n >= 1 else 1
        max_tokens, renames = req.max_tokens, {}
        if req.max_completion_tokens is not None:
            max_tokens, renames = req.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
        params = self.sampling_params(req, max_tokens, self.chat_default_max_tokens(len(prompt_ids), n), "messages",
                                      chat_num_logprobs(req), {**renames, "logprobs": "top_logprobs"})
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            stream = await self.start([prompt_ids], params, req, request_id, "messages", lora, tenant, renames)
        except APIError as e:
            if max_tokens is None and e.param == "max_tokens":  # the default (1 at least) doesn't fit
                raise self.default_does_not_fit(len(prompt_ids), n) from e
            raise
        started: set[int] = set()  # samples whose first chunk (with the role) went out

        def logprobs(out: RequestOutput, lo: int, hi: int) -> ChatLogprobs | None:
            return None if params.logprobs is None else chat_logprobs(out, lo, hi, params.logprobs, self.token_decoder)

        def choice(out: RequestOutput, delta: str, lo: int, hi: int) -> dict:
            message = {"content": delta}
            if out.index not in started:
                message["role"] = "assistant"
                started.add(out.index)
            lp = logprobs(out, lo, hi)
            return {"index": out.index, "delta": message, "logprobs": None if lp is None else lp.model_dump()}

        def response(outs: list[RequestOutput], created: int) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=request_id, created=created, model=model_name, usage=usage(outs),
                choices=[ChatChoice(index=o.index, message=ResponseMessage(content=o.text),
                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                    logprobs=logprobs(o, 0, len(o.token_ids))) for o in outs],
                prompt_logprobs=prompt_logprobs_json(outs[0]) if outs else None,
            )

        head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name}
        return await self.respond(req, params, stream, raw_request, head, choice, response)


def chat_num_logprobs(req: ChatCompletionRequest) -> int | None:
    """``SamplingParams.logprobs`` of a chat request: ``top_logprobs`` (default 0) when ``logprobs``
    is true, else None.

    Raises:
        APIError: 400 (``top_logprobs``) for top_logprobs > 0 without ``logprobs: true`` (OpenAI's rule).
    """
    if req.logprobs:
        return 0 if req.top_logprobs is None else req.top_logprobs
    if req.top_logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    return None
