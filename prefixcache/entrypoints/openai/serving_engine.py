"""What the OpenAI endpoints share on the request side (vLLM's ``serving_engine``):
:class:`OpenAIServing` holds the engine, the served model's name and its adapters, checks a request,
builds its :class:`SamplingParams`, adds it to the engine and answers it (JSON or an SSE stream,
:mod:`.serving_outputs`). The endpoints wrap one: :mod:`.serving_completion`, :mod:`.serving_chat`,
:mod:`.serving_tokenization` and :mod:`~prefixcache.entrypoints.anthropic.serving_messages`.

A request is checked in this order, each failure a 400 naming the field in ``param`` unless said:
its JSON and field types (FastAPI with ``protocol.py``, before this module), lone surrogates in
any string, fields we don't implement, ``stream_options`` without ``stream``, the model (404), the
sampling parameters, the chat template, then the engine's own checks when the request is added.
Nothing is queued before the last, so a refused request never holds a KV block; a client that
leaves aborts its request.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from prefixcache.engine.async_engine import AsyncLLMEngine
from prefixcache.engine.detokenizer import TokenDecoder
from prefixcache.entrypoints.openai.api_errors import APIError, clip, cut, input_error
from prefixcache.entrypoints.openai.cache_retention import check_prompt_cache_retention, retained_tokens_header
from prefixcache.entrypoints.openai.protocol import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SGLangExtensions,
    TokenizeRequest,
)
from prefixcache.entrypoints.openai.serving_outputs import (
    cached_tokens_details,
    final_outputs,
    numbered,
    per_prompt,
    sse_events,
    usage,
)
from prefixcache.errors import InvalidInputError
from prefixcache.layers.lora import LoRARequest
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams, StructuredOutputsParams, encodes_utf8

AnyRequest = CompletionRequest | ChatCompletionRequest
# The request fields that constrain the output (at most one per request), in the order checked.
STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")
CheckedRequest = CompletionRequest | ChatCompletionRequest | TokenizeRequest | DetokenizeRequest
# (output, text delta, tokens [lo, hi) whose logprobs go with it) -> the choice of a stream chunk;
# (final outputs, created) -> the answer
StreamChoice = Callable[[RequestOutput, str, int, int], dict]
MakeResponse = Callable[[list[RequestOutput], int], BaseModel]


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
        self.retain_s(req)
        return self.lora_for(req.model), req.model or self.served_model_name

    def retain_s(self, req: AnyRequest) -> float | None:
        """Seconds to keep the request's prompts in the disk tier (``prompt_cache_retention``).

        Raises:
            APIError: 400 (``prompt_cache_retention``), see :func:`check_prompt_cache_retention`.
        """
        tiers = self.engine.engine.kv_tiers
        return check_prompt_cache_retention(req.prompt_cache_retention, self.engine.engine.config.kv_disk_dir is not None,
                                            tiers is not None and bool(tiers.retaining_tiers))

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
                                                      priority=req.priority or 0, retain_s=self.retain_s(req))
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
                answer.sglext = SGLangExtensions(cached_tokens_details=cached_tokens_details(per_prompt(outs)))
            retained = retained_tokens_header(outs, self.engine.engine.config.block_size)
            return JSONResponse(jsonable_encoder(answer), headers=retained) if retained else answer
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
            return {**head, "choices": [], "usage": usage(outs).model_dump(), **sglext(per_prompt(outs))}

        events = sse_events(stream, params.stop, chunk, usage_chunk if with_usage else None)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
