"""OpenAI-compatible HTTP server: ``prefixcache serve [MODEL] --host 127.0.0.1 --port 8000``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE streams ending with
``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``POST /reset_prefix_cache``,
``GET /metrics`` (Prometheus). ``usage.prompt_tokens_details.cached_tokens`` is the request's real
number of prompt tokens served from the prefix cache; ``cache_salt`` in the body isolates a
request's cache namespace. With ``--tenant-isolation`` every API key belongs to a tenant and each
tenant gets its own cache namespace automatically; only operator-approved shared prefixes
(``--approved-prefix``, ``--approved-system-prompt``) are shared across tenants
(:mod:`prefixcache.engine.tenancy`).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid input
(the field in ``param``), 401 for a missing/wrong API key, 403 for ``/reset_prefix_cache`` under
tenant isolation, 404 for an unknown model or route, 409 for ``/reset_prefix_cache`` while requests
hold KV blocks. A request that fails validation never
reaches the engine, so no block leaks; a client that disconnects aborts its request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.config import DEFAULT_MODEL, EngineConfig
from prefixcache.engine.async_engine import AsyncLLMEngine, EngineDeadError
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.tenancy import validate_tenant
from prefixcache.entrypoints.metrics import ServerMetrics
from prefixcache.entrypoints.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseMessage,
    Usage,
)
from prefixcache.layers.lora import LoRARequest
from prefixcache.outputs import RequestOutput
from prefixcache.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHAT_DEFAULT_MAX_TOKENS = 512  # chat default: the rest of the context, capped at this
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
_REQUEST_FIELDS = frozenset(
    "model prompt messages max_tokens max_completion_tokens temperature top_p top_k seed stop "
    "stop_token_ids n stream stream_options cache_salt".split()
)


class APIError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: HTTP status code.
        message: what is wrong, naming the field.
        param: the offending request field, if any.
        code: a short machine-readable code (OpenAI's ``error.code``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "api_error"), param=param, code=code)
    )
    return JSONResponse(body.model_dump(), status_code=status)


def _param_of(message: str, prompt_field: str) -> str | None:
    """The request field a ``ValueError`` message from the engine or SamplingParams names."""
    if re.match(r"prompt \+ max_tokens", message):  # the request can't fit in the KV pool
        return "max_tokens"
    m = re.match(r"([a-z_]+)", message)
    if m is None or m.group(1) not in _REQUEST_FIELDS:
        return None
    return prompt_field if m.group(1) == "prompt" else m.group(1)


def _value_error(e: ValueError, prompt_field: str) -> APIError:
    """A 400 for an engine/SamplingParams ``ValueError``; the message starts with the field."""
    message = str(e)
    param = _param_of(message, prompt_field)
    if param is not None and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(400, message, param)


def _usage(outs: list[RequestOutput]) -> Usage:
    """Usage of a request from its samples' final outputs (the prompt counted once)."""
    completion_tokens = sum(len(o.token_ids) for o in outs)
    return Usage(
        prompt_tokens=outs[0].num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=outs[0].num_prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=outs[0].num_cached_tokens),
    )


def _stream_text(out: RequestOutput, stops: tuple[str, ...]) -> str:
    """The part of a streaming output's text that is safe to send.

    Until the request finishes, hold back a trailing incomplete UTF-8 character and any tail that
    could still grow into a stop string (which the final text drops), so the concatenated deltas
    equal the non-streamed text.
    """
    text = out.text
    if out.finished:
        return text
    text = text.rstrip("\ufffd")
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[: len(text) - hold]


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _message_text(content: str | list[dict] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "messages: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


async def _wait_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _final_outputs(stream: AsyncIterator[RequestOutput], raw_request: Request) -> list[RequestOutput] | None:
    """Each sample's final output, by index; None (and the request aborted) if the client
    disconnects."""

    async def last() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for out in stream:
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


def build_app(
    engine: LLMEngine | AsyncLLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    lora_modules: dict[str, str] | None = None,
    *,
    api_keys: Mapping[str, str] | None = None,
    tenant_isolation: bool = False,
    approved_prefixes: Sequence[str] = (),
    approved_system_prompts: Sequence[str] = (),
) -> FastAPI:
    """Builds the FastAPI app serving ``engine``.

    Args:
        engine: an engine (wrapped in an :class:`AsyncLLMEngine`) or an async engine not yet
            serving another app. The app starts its loop on startup and stops it on shutdown.
        served_model_name: the model name clients send and ``/v1/models`` lists.
        lora_modules: adapter name → PEFT adapter directory; a request whose ``model`` is one of
            these names runs with that adapter (vLLM's ``--lora-modules``).
        api_key: when set, ``/v1/*`` and ``/reset_prefix_cache`` need ``Authorization: Bearer KEY``.
        api_keys: more accepted keys, ``key -> tenant name`` (several keys may name one tenant).
            ``api_key`` joins them as its own tenant, named after a digest of the key.
        tenant_isolation: give every tenant its own cache namespace; needs at least one key.
            ``/reset_prefix_cache`` is then refused (403): one tenant must not flush the others.
        approved_prefixes: public prompt texts every tenant may share (tokenized as completion
            prompts are).
        approved_system_prompts: public chat system messages every tenant may share.

    Returns:
        The app; ``app.state.engine`` is the async engine, ``app.state.metrics`` its metrics.

    Raises:
        ValueError: ``tenant_isolation`` without keys, a bad tenant name, or an empty approved
            prefix.
    """
    async_engine = engine if isinstance(engine, AsyncLLMEngine) else AsyncLLMEngine(engine)
    llm_engine = async_engine.engine
    key_to_tenant = tenants_by_key(api_key, api_keys)
    if tenant_isolation and not key_to_tenant:
        raise ValueError("tenant isolation needs API keys: give --api-key or --tenant-api-key TENANT=KEY")
    # The engine loop is not running yet, so the engine can be called directly here.
    for text in approved_prefixes:
        llm_engine.add_approved_prefix(text)
    for content in approved_system_prompts:
        llm_engine.add_approved_system_prompt(content)
    metrics = ServerMetrics(served_model_name)
    async_engine.on_finish = metrics.observe_finished
    block_size = llm_engine.config.block_size

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="prefixcache", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.metrics = metrics

    # ------------------------------------------------------------------ errors and auth
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return _error_response(400, f"malformed JSON body: {err.get('msg')}", None, "invalid_json")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc[:1] + [x for x in loc[1:] if x.isdigit()]) or "body"
        return _error_response(400, f"{where}: {err.get('msg')}", param, "invalid_type")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(e.status_code, str(e.detail), None, None)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return _error_response(503, str(e), None, "engine_dead")

    if key_to_tenant:
        bearers = [(f"Bearer {key}".encode(), tenant) for key, tenant in key_to_tenant.items()]

        @app.middleware("http")
        async def _check_api_key(request: Request, call_next):
            path = request.url.path
            if path.startswith("/v1") or path == "/reset_prefix_cache":
                header = request.headers.get("authorization", "").encode()
                tenant = None
                for bearer, name in bearers:  # compare with every key: time doesn't tell which matched
                    if secrets.compare_digest(header, bearer):
                        tenant = name
                if tenant is None:
                    return _error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                           None, "invalid_api_key")
                request.state.tenant = tenant
            return await call_next(request)

    def tenant_of(raw_request: Request) -> str | None:
        return getattr(raw_request.state, "tenant", None) if tenant_isolation else None

    # ------------------------------------------------------------------ helpers
    adapters = dict(lora_modules or {})

    def check_model(model: str | None) -> LoRARequest | None:
        """The request's adapter (None for the base model); 404 for an unknown model name."""
        if model is None or model == served_model_name:
            return None
        if model in adapters:
            return LoRARequest(model, adapters[model])
        names = [served_model_name, *adapters]
        raise APIError(404, f"model {model!r} does not exist; this server serves {names}", "model",
                       "model_not_found")

    def sampling_params(
        req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, default_max_tokens: int,
        prompt_field: str,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                seed=req.seed,
                stop=req.stop or (),
                stop_token_ids=req.stop_token_ids or (),
                ignore_eos=bool(req.ignore_eos),
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                n=1 if req.n is None else req.n,
            )
        except ValueError as e:
            raise _value_error(e, prompt_field) from e

    async def start(
        prompt: str | list[int], params: SamplingParams, req: CompletionRequest | ChatCompletionRequest,
        request_id: str, prompt_field: str, lora: LoRARequest | None, tenant: str | None,
    ) -> AsyncIterator[RequestOutput]:
        try:
            return await async_engine.generate(
                prompt, params, cache_salt=req.cache_salt, request_id=request_id, stream=bool(req.stream), lora=lora,
                tenant=tenant,
            )
        except ValueError as e:
            raise _value_error(e, prompt_field) from e

    def include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
        return bool(req.stream_options is not None and req.stream_options.include_usage)

    async def sse(
        stream: AsyncIterator[RequestOutput],
        stops: tuple[str, ...],
        make_chunk: Callable[[int, str, RequestOutput | None], dict],
        usage_chunk: Callable[[list[RequestOutput]], dict] | None,
    ) -> AsyncIterator[str]:
        """SSE events: one chunk per text delta of each sample (its last one with finish_reason),
        then usage once every sample finished, then [DONE]."""
        sent: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for out in stream:
                text = _stream_text(out, stops)
                done = sent.get(out.index, 0)
                delta, sent[out.index] = text[done:], max(done, len(text))
                if delta or out.finished:
                    yield _sse(make_chunk(out.index, delta, out if out.finished else None))
                if out.finished:
                    finals[out.index] = out
            if usage_chunk is not None and finals:
                yield _sse(usage_chunk([finals[i] for i in sorted(finals)]))
        except EngineDeadError as e:
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(e), type=_ERROR_TYPES[503])).model_dump())
        yield "data: [DONE]\n\n"

    async def respond(
        req: CompletionRequest | ChatCompletionRequest,
        params: SamplingParams,
        stream: AsyncIterator[RequestOutput],
        raw_request: Request,
        request_id: str,
        model_name: str,
        chunk_object: str,
        stream_choice: Callable[[int, str], dict],
        make_response: Callable[[list[RequestOutput], int], Any],
    ) -> Any:
        """The endpoint's answer: an SSE stream of ``chunk_object`` chunks (one choice each, from
        ``stream_choice(index, delta)`` plus the finish and stop reasons), or
        ``make_response(final outputs, created)``; 499 if a non-streaming client went away."""
        created = int(time.time())
        if req.stream:
            with_usage = include_usage(req)
            head = {"id": request_id, "object": chunk_object, "created": created, "model": model_name}

            def chunk(index: int, delta: str, final: RequestOutput | None) -> dict:
                choice = stream_choice(index, delta)
                choice["logprobs"] = None
                choice["finish_reason"] = None if final is None else final.finish_reason
                if final is not None:
                    choice["stop_reason"] = final.stop_reason
                data = {**head, "choices": [choice]}
                if with_usage:
                    data["usage"] = None
                return data

            def usage_chunk(outs: list[RequestOutput]) -> dict:
                return {**head, "choices": [], "usage": _usage(outs).model_dump()}

            gen = sse(stream, params.stop, chunk, usage_chunk if with_usage else None)
            return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        outs = await _final_outputs(stream, raw_request)
        if outs is None:
            return Response(status_code=499)
        return make_response(outs, created)

    # ------------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health() -> Response:
        if async_engine.error is not None:
            return _error_response(503, f"engine loop failed: {async_engine.error!r}", None, "engine_dead")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=served_model_name, max_model_len=llm_engine.max_model_len)]
        cards += [ModelCard(id=name, parent=served_model_name, max_model_len=llm_engine.max_model_len)
                  for name in adapters]
        return ModelList(data=cards)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        stats = await async_engine.get_stats()
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if tenant_isolation:
            raise APIError(403, "/reset_prefix_cache is disabled under --tenant-isolation (one tenant "
                                "would flush every tenant's cache); restart the server to reset", None,
                           "forbidden")
        if not await async_engine.reset_prefix_cache():
            raise APIError(409, "the prefix cache can't be reset while requests hold KV blocks; "
                                "retry when the server is idle", None, "requests_in_flight")
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw_request: Request):
        lora = check_model(req.model)
        model_name = req.model or served_model_name
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: a batch of {len(prompt)} prompts is not supported yet; "
                                    "send one prompt per request", "prompt")
            prompt = prompt[0]
        params = sampling_params(req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await start(prompt, params, req, request_id, "prompt", lora, tenant_of(raw_request))

        def choice(index: int, delta: str) -> dict:
            return {"index": index, "text": delta}

        def response(outs: list[RequestOutput], created: int) -> CompletionResponse:
            return CompletionResponse(
                id=request_id, created=created, model=model_name, usage=_usage(outs),
                choices=[CompletionChoice(index=o.index, text=o.text, finish_reason=o.finish_reason,
                                          stop_reason=o.stop_reason) for o in outs],
            )

        return await respond(req, params, stream, raw_request, request_id, model_name, "text_completion",
                             choice, response)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request):
        lora = check_model(req.model)
        model_name = req.model or served_model_name
        if not req.messages:
            raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        conversation = [{"role": m.role, "content": _message_text(m.content)} for m in req.messages]
        try:
            prompt_ids = await async_engine.apply_chat_template(conversation)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
        # Default: the rest of the context, as far as the pool can hold it for each of the n samples
        # (they share the prompt's full blocks).
        n = req.n if isinstance(req.n, int) and req.n >= 1 else 1
        full = len(prompt_ids) // block_size
        per_sample = max(0, llm_engine.num_blocks - full) // n
        room = min(llm_engine.max_model_len, (full + per_sample) * block_size) - len(prompt_ids)
        default_max_tokens = max(1, min(MAX_CHAT_DEFAULT_MAX_TOKENS, room))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens, default_max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await start(prompt_ids, params, req, request_id, "messages", lora, tenant_of(raw_request))
        started: set[int] = set()  # samples whose first chunk (with the role) went out

        def choice(index: int, delta: str) -> dict:
            message = {"content": delta}
            if index not in started:
                message["role"] = "assistant"
                started.add(index)
            return {"index": index, "delta": message}

        def response(outs: list[RequestOutput], created: int) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=request_id, created=created, model=model_name, usage=_usage(outs),
                choices=[ChatChoice(index=o.index, message=ResponseMessage(content=o.text),
                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason) for o in outs],
            )

        return await respond(req, params, stream, raw_request, request_id, model_name, "chat.completion.chunk",
                             choice, response)

    return app


# ---------------------------------------------------------------------------- CLI
def _memory_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1e9"`` or ``"1073741824"`` → bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?)?\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 2GiB, 512MiB, 1073741824)")
    unit = (m.group(2) or "").rstrip("B").rstrip("i")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds ``prefixcache serve``'s options (server and engine) to ``parser``."""
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="built-in name, HF directory or .gguf file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="name clients send (default: MODEL)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* and /reset_prefix_cache")
    t = parser.add_argument_group("tenants")
    t.add_argument("--tenant-api-key", action="append", default=[], metavar="TENANT=KEY",
                   help="accept KEY as tenant TENANT (repeat for more keys/tenants)")
    t.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help='JSON {"TENANT": "KEY" or ["KEY", ...], ...}: keys out of the process list')
    t.add_argument("--tenant-isolation", action="store_true",
                   help="a cache namespace per tenant; only approved prefixes are shared across tenants")
    t.add_argument("--approved-prefix", action="append", default=[], metavar="TEXT",
                   help="public prompt text every tenant may share (repeatable)")
    t.add_argument("--approved-system-prompt", action="append", default=[], metavar="TEXT",
                   help="public chat system message every tenant may share (repeatable)")
    t.add_argument("--approved-prefixes-file", default=None, metavar="PATH",
                   help='JSON [{"text": ...} or {"system": ...}, ...]: long approved prefixes')
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) clients select with the model field")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    e = parser.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    e.add_argument("--kv-cache-memory", type=_memory_bytes, default=None, help="KV pool budget, e.g. 2GiB")
    e.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per forward pass")
    e.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--hash-algo", default="xxh64", choices=["xxh64", "sha256"])
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--device", default=None, help="cpu, cuda, ... (default: CUDA if present)")
    e.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--hash-seed", type=int, default=None,
                   help="fix the block-hash seed (reproducible keys across processes); default random per process")
    e.add_argument("--eviction-policy", default="lru", help="lru, lfu, ttl or cost")
    e.add_argument("--cache-ttl-s", type=float, default=300.0, help="idle seconds before a cached block expires (ttl)")
    e.add_argument("--enable-partial-block-reuse", action=argparse.BooleanOptionalAction, default=True)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``["name=path", ...]`` → ``{name: path}``.

    Raises:
        ValueError: an item without ``=``, an empty name, or a duplicate name.
    """
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in modules:
            raise ValueError(f"--lora-modules expects distinct NAME=PATH entries, got {item!r}")
        modules[name] = path
    return modules


def tenants_by_key(api_key: str | None, api_keys: Mapping[str, str] | None) -> dict[str, str]:
    """All accepted keys → tenant name; ``api_key`` is a tenant named after its digest.

    Raises:
        ValueError: a key that no client could send (empty, non-ASCII, control characters or
            surrounding spaces, which HTTP headers can't carry), a key given twice, or a bad
            tenant name.
    """
    keys: dict[str, str] = {}
    items = [] if api_key is None else [(api_key, "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:12])]
    for key, tenant in [*items, *(api_keys or {}).items()]:
        if not isinstance(key, str) or not re.fullmatch(r"[\x21-\x7e]+(?: +[\x21-\x7e]+)*", key):
            raise ValueError("API keys must be non-empty printable ASCII without surrounding spaces "
                             "(an HTTP Authorization header can't carry anything else)")
        if key in keys:
            raise ValueError("an API key is given twice; each key belongs to one tenant")
        try:
            keys[key] = validate_tenant(tenant)
        except ValueError as e:
            raise ValueError(f"tenant {str(tenant)[:40]!r}: {e}") from e
    return keys


def parse_tenant_args(args: argparse.Namespace) -> tuple[dict[str, str], list[str], list[str]]:
    """``--tenant-api-key``, ``--api-keys-file`` and the approved-prefix flags → build_app inputs.

    Returns:
        ``(api_keys key -> tenant, approved prefix texts, approved system prompts)``.

    Raises:
        ValueError: a malformed flag or file, naming it.
    """
    api_keys: dict[str, str] = {}

    def add(tenant: object, key: object, where: str) -> None:
        if not isinstance(tenant, str) or not tenant or not isinstance(key, str) or not key:
            raise ValueError(f"{where}: tenant names and keys must be non-empty strings")
        if key in api_keys:
            raise ValueError(f"{where}: an API key is given twice")
        api_keys[key] = tenant

    for item in args.tenant_api_key:
        tenant, sep, key = item.partition("=")
        if not sep:
            raise ValueError(f"--tenant-api-key expects TENANT=KEY, got {item!r}")
        add(tenant, key, "--tenant-api-key")
    if args.api_keys_file:
        data = _read_json(args.api_keys_file, "--api-keys-file")
        if not isinstance(data, dict):
            raise ValueError('--api-keys-file must hold a JSON object {"TENANT": "KEY" or ["KEY", ...]}')
        for tenant, keys in data.items():
            for key in [keys] if isinstance(keys, str) else keys if isinstance(keys, list) else [None]:
                add(tenant, key, "--api-keys-file")
    texts, systems = list(args.approved_prefix), list(args.approved_system_prompt)
    if any(not t for t in texts) or any(not t for t in systems):
        raise ValueError("--approved-prefix / --approved-system-prompt: must not be empty")
    if args.approved_prefixes_file:
        data = _read_json(args.approved_prefixes_file, "--approved-prefixes-file")
        if not isinstance(data, list):
            raise ValueError('--approved-prefixes-file must hold a JSON list of {"text": ...} / {"system": ...}')
        for entry in data:
            if not isinstance(entry, dict) or len(entry) != 1 or not isinstance(next(iter(entry.values())), str):
                raise ValueError(f"--approved-prefixes-file: each entry is {{'text': str}} or {{'system': str}}, "
                                 f"got {entry!r}")
            if "text" not in entry and "system" not in entry:
                raise ValueError(f"--approved-prefixes-file: unknown entry {entry!r} (use 'text' or 'system')")
            if not next(iter(entry.values())):
                raise ValueError(f"--approved-prefixes-file: empty prefix in {entry!r}")
            (texts if "text" in entry else systems).append(next(iter(entry.values())))
    if (texts or systems) and not args.tenant_isolation:
        raise ValueError("approved prefixes only matter with --tenant-isolation (without it every "
                         "request may share every cached block); add --tenant-isolation or drop them")
    return api_keys, texts, systems


def _read_json(path: str, flag: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read JSON from {path!r}: {e}") from e


def run_cli(args: argparse.Namespace) -> int:
    """Loads the model and serves until interrupted.

    Raises:
        ValueError: bad engine options or a model that can't be loaded.
    """
    import uvicorn

    config = EngineConfig.from_kwargs(
        model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, hash_algo=args.hash_algo, dtype=args.dtype,
        device=args.device, num_threads=args.num_threads, seed=args.seed, hash_seed=args.hash_seed,
        eviction_policy=args.eviction_policy, cache_ttl_s=args.cache_ttl_s,
        enable_partial_block_reuse=args.enable_partial_block_reuse,
    )
    api_keys, approved_texts, approved_systems = parse_tenant_args(args)
    lora_modules = parse_lora_modules(args.lora_modules)
    try:  # bad keys fail before the model loads
        tenants_by_key(args.api_key, api_keys)
    except ValueError as e:
        raise ValueError(f"--api-key / --tenant-api-key / --api-keys-file: {e}") from e
    if args.tenant_isolation and not (args.api_key or api_keys):
        raise ValueError("--tenant-isolation needs API keys: give --tenant-api-key TENANT=KEY or --api-keys-file")
    if api_keys and not args.tenant_isolation:
        print("prefixcache serve: tenant API keys authenticate, but without --tenant-isolation all tenants "
              "share one cache namespace", file=sys.stderr)
    app = build_app(LLMEngine(config), args.served_model_name or args.model, api_key=args.api_key,
                    lora_modules=lora_modules, api_keys=api_keys, tenant_isolation=args.tenant_isolation,
                    approved_prefixes=approved_texts, approved_system_prompts=approved_systems)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
