"""OpenAI-compatible HTTP server: the FastAPI app (routes, error handlers, middleware).

``prefixcache serve [MODEL] --host 127.0.0.1 --port 8000`` (flags:
:mod:`~prefixcache.entrypoints.cli.serve`; running under uvicorn: :mod:`.launcher`). Endpoints:
``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE streams ending with
``data: [DONE]``; logic in :mod:`.serving_completion` and :mod:`.serving_chat`, on the shared
:mod:`.serving_engine`), ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API, its errors in
Anthropic's shape: :mod:`~prefixcache.entrypoints.anthropic.serving_messages`), ``GET /v1/models``,
``GET /health``, ``POST /reset_prefix_cache`` (also as SGLang's ``POST /flush_cache``),
``GET /metrics`` (Prometheus), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's,
:mod:`.serving_tokenization`), the operator dashboard: ``GET /v1/cache/stats`` (JSON) and
``GET /dashboard`` (:mod:`~prefixcache.entrypoints.dashboard`), and
``GET /server_info`` and ``GET /model_info`` (SGLang's, for routers: :mod:`.router_probes`), and
the API docs, which work offline: ``GET /docs`` (Swagger UI) and ``GET /redoc`` (:mod:`.api_docs`).
Every ``GET`` of the table below also answers ``HEAD`` (same status and headers, no body).
``usage.prompt_tokens_details.cached_tokens`` is the request's real
number of prompt tokens served from the prefix cache; ``cache_salt`` in the body isolates a
request's cache namespace. With tenant isolation every API key belongs to a tenant
(:mod:`.auth`) and each tenant gets its own cache namespace; only operator-approved shared
prefixes are shared across tenants (:mod:`prefixcache.engine.tenancy`).

Every error has OpenAI's body ``{"error": {"message", "type", "param", "code"}}``
(:mod:`.api_errors`): 400 for invalid input (the field in ``param``; never 422, and
``/openapi.json`` says so), 401 for a missing/wrong API key, 403 for ``/reset_prefix_cache`` under
tenant isolation, 404 for an unknown model or route, 408 for a request that arrives too slowly,
409 for ``/reset_prefix_cache`` while requests hold KV blocks, 413 for a body over the limit, 500
for anything unexpected (or a request whose engine step failed), 503 when the engine is gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.config import INT4_DECODER_FORMATS
from prefixcache.engine.async_engine import AsyncLLMEngine, EngineDeadError
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.anthropic.serving_messages import (COUNT_TOKENS_RESPONSES, MESSAGES_RESPONSES,
                                                               AnthropicRoute, AnthropicServing, CountTokensRequest,
                                                               MessagesRequest)
from prefixcache.entrypoints.dashboard.routes import cache_stats, dashboard, static_file
from prefixcache.entrypoints.dashboard.state import DashboardOptions, DashboardState
from prefixcache.entrypoints.openai.api_docs import add_docs_routes
from prefixcache.entrypoints.openai.api_errors import (APIError, clip, error_docs, error_response, json_error_message,
                                                     unparsed_body_message, validation_message)
from prefixcache.entrypoints.openai.auth import APIKeyMiddleware, tenants_by_key
from prefixcache.entrypoints.openai.http_limits import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestBodyLimitMiddleware
from prefixcache.entrypoints.openai.metrics import ServerMetrics
from prefixcache.entrypoints.openai.server_log import RequestLog
from prefixcache.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from prefixcache.entrypoints.openai.router_probes import model_info, server_info
from prefixcache.entrypoints.openai.serving_chat import OpenAIServingChat
from prefixcache.entrypoints.openai.serving_completion import OpenAIServingCompletion
from prefixcache.entrypoints.openai.serving_engine import OpenAIServing
from prefixcache.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from prefixcache.layers.lora import LoRARequest

# Parsed by every route but the GETs; every route may answer these.
_ANY_ROUTE_ERRORS = (405, 408, 413, 500, 503)
_V1_ERRORS = (400, 401, *_ANY_ROUTE_ERRORS)


def _json_or_sse(model: type) -> dict[int | str, dict]:
    return {200: {"model": model, "description": "the answer, or with `stream: true` an SSE stream of chunks "
                                                  "ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


# One server-sent event as parsed by a client (the WHATWG fields): ``data`` is a chunk's JSON, or
# ``[DONE]`` at the end.
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                               "id": {"type": "string"}, "retry": {"type": "integer"}},
              "required": ["data"]}


class PrometheusResponse(Response):
    media_type = "text/plain; version=0.0.4; charset=utf-8"


# ---------------------------------------------------------------------------- endpoints
def _serving(raw_request: Request) -> OpenAIServing:
    return raw_request.app.state.serving


def _tenant(raw_request: Request) -> str | None:
    """The tenant of the request's API key, under tenant isolation (else None: one namespace)."""
    return getattr(raw_request.state, "tenant", None) if raw_request.app.state.tenant_isolation else None


async def health(raw_request: Request) -> Response:
    engine: AsyncLLMEngine = raw_request.app.state.engine
    if engine.error is not None:
        return error_response(503, f"engine loop failed: {clip(engine.error, 300)}", None, "engine_dead")
    return Response(status_code=200)


async def show_models(raw_request: Request) -> ModelList:
    serving = _serving(raw_request)
    max_model_len = serving.engine.engine.max_model_len
    cards = [ModelCard(id=serving.served_model_name, max_model_len=max_model_len)]
    cards += [ModelCard(id=name, parent=serving.served_model_name, max_model_len=max_model_len)
              for name in serving.lora_modules]
    return ModelList(data=cards)


async def prometheus_metrics(raw_request: Request) -> Response:
    stats = await raw_request.app.state.engine.get_stats()
    return PrometheusResponse(raw_request.app.state.metrics.render(stats))


async def show_server_info(raw_request: Request) -> dict[str, Any]:
    serving = _serving(raw_request)
    return server_info(serving.engine.engine, serving.served_model_name)


async def show_model_info(raw_request: Request) -> dict[str, Any]:
    return model_info(_serving(raw_request).engine.engine)


async def reset_prefix_cache(raw_request: Request) -> Response:
    """``POST /reset_prefix_cache`` (vLLM's name) and ``POST /flush_cache`` (SGLang's): one endpoint."""
    if raw_request.app.state.tenant_isolation:
        raise APIError(403, f"{raw_request.url.path} is disabled under --tenant-isolation (one tenant would flush "
                            "every tenant's cache); restart the server to reset", None, "forbidden")
    if not await raw_request.app.state.engine.reset_prefix_cache():
        raise APIError(409, "the prefix cache can't be reset while requests hold KV blocks; "
                            "retry when the server is idle", None, "requests_in_flight")
    return Response(status_code=200)


async def create_completion(req: CompletionRequest, raw_request: Request) -> Any:
    serving: OpenAIServingCompletion = raw_request.app.state.serving_completion
    return await serving.create_completion(req, raw_request, _tenant(raw_request))


async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request) -> Any:
    serving: OpenAIServingChat = raw_request.app.state.serving_chat
    return await serving.create_chat_completion(req, raw_request, _tenant(raw_request))


async def create_message(req: MessagesRequest, raw_request: Request) -> Any:
    """``POST /v1/messages``: Anthropic's Messages API
    (:mod:`~prefixcache.entrypoints.anthropic.serving_messages`)."""
    return await raw_request.app.state.messages.create_message(req, raw_request, _tenant(raw_request))


async def count_message_tokens(req: CountTokensRequest, raw_request: Request) -> Any:
    """``POST /v1/messages/count_tokens``: Anthropic's token count of a Messages body."""
    return await raw_request.app.state.messages.count_tokens(req)


async def tokenize(req: TokenizeRequest, raw_request: Request) -> TokenizeResponse:
    return await raw_request.app.state.serving_tokenization.tokenize(req)


async def detokenize(req: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    return await raw_request.app.state.serving_tokenization.detokenize(req)


# (path, method, endpoint, route options)
_ROUTES: tuple[tuple[str, str, Any, dict[str, Any]], ...] = (
    ("/health", "GET", health, {"response_class": Response, "responses": {
        200: {"description": "the engine loop runs", "content": None}, **error_docs(503)}}),
    ("/v1/models", "GET", show_models, {"responses": error_docs(401, *_ANY_ROUTE_ERRORS)}),
    ("/metrics", "GET", prometheus_metrics, {"response_class": PrometheusResponse, "responses": {
        200: {"description": "Prometheus text exposition", "content": {PrometheusResponse.media_type: {}}},
        **error_docs(*_ANY_ROUTE_ERRORS)}}),
    *((path, "GET", endpoint, {"responses": error_docs(*_ANY_ROUTE_ERRORS), "deprecated": path.startswith("/get_")})
      for path, endpoint in (("/server_info", show_server_info), ("/get_server_info", show_server_info),
                             ("/model_info", show_model_info), ("/get_model_info", show_model_info))),  # routers
    *((path, "POST", reset_prefix_cache, {"response_class": Response, "responses": {
        200: {"description": "the cache is empty", "content": None}, **error_docs(401, 403, 409, *_ANY_ROUTE_ERRORS)}})
      for path in ("/reset_prefix_cache", "/flush_cache")),  # vLLM's name, SGLang's
    ("/v1/completions", "POST", create_completion, {"response_model": None, "responses": {
        **_json_or_sse(CompletionResponse), **error_docs(404, *_V1_ERRORS)}}),
    ("/v1/chat/completions", "POST", create_chat_completion, {"response_model": None, "responses": {
        **_json_or_sse(ChatCompletionResponse), **error_docs(404, *_V1_ERRORS)}}),
    ("/tokenize", "POST", tokenize, {"responses": error_docs(404, *_V1_ERRORS)}),
    ("/detokenize", "POST", detokenize, {"responses": error_docs(404, *_V1_ERRORS)}),
    ("/v1/cache/stats", "GET", cache_stats, {"responses": {
        200: {"description": "the cache's numbers, history, prefix tree and breakers (docs/dashboard-and-diagnostics.md)"},
        **error_docs(401, *_ANY_ROUTE_ERRORS)}}),
    ("/dashboard", "GET", dashboard, {"response_class": Response, "responses": {
        200: {"description": "the operator dashboard (HTML)", "content": {"text/html": {}}},
        **error_docs(401, *_ANY_ROUTE_ERRORS)}}),
    ("/dashboard/static/{name}", "GET", static_file, {"response_class": Response, "include_in_schema": False}),
)


# Anthropic's Messages API: its errors in Anthropic's shape (AnthropicRoute), so added apart.
_MESSAGES_ROUTE: dict[str, Any] = {"response_model": None, "route_class_override": AnthropicRoute,
                                   "responses": MESSAGES_RESPONSES}


# ---------------------------------------------------------------------------- errors
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    if errors[0].get("type") == "json_invalid":
        return error_response(400, json_error_message(errors[0]), None, "invalid_json")
    if (unparsed := unparsed_body_message(errors[0], request.headers.get("content-type"))) is not None:
        return error_response(400, unparsed, None, "invalid_json")
    message, param = validation_message(errors)
    return error_response(400, message, param, "invalid_type")


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    # FastAPI's only own 400 is a body it could not parse (not UTF-8, nested too deep, ...).
    code = getattr(e, "code", None) or ("invalid_json" if e.status_code == 400 else None)
    return error_response(e.status_code, str(e.detail), None, code, headers=e.headers)


async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
    return error_response(503, str(e), None, "engine_dead")


async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    # Starlette's outermost middleware calls this, sends the answer, then re-raises for uvicorn's log.
    return error_response(500, f"internal server error ({type(e).__name__})", None, "internal_error")


_EXCEPTION_HANDLERS: tuple[tuple[type[Exception], Any], ...] = (
    (APIError, _api_error), (RequestValidationError, _validation_error), (StarletteHTTPException, _http_error),
    (EngineDeadError, _engine_dead), (Exception, _unexpected),
)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, saying what the server does: invalid input is a 400 with the error
    schema (declared per route), never FastAPI's default 422; every error body is JSON (FastAPI
    would give a route's errors the media type of its 200)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
                for status, response in operation["responses"].items():
                    if int(status) >= 400:
                        response["content"] = {"application/json": next(iter(response["content"].values()))}
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.engine.start()
    app.state.dashboard.start()
    yield
    await app.state.dashboard.stop()
    await app.state.engine.shutdown()


def _prepare_engine(engine: LLMEngine, lora_modules: Mapping[str, str], approved_prefixes: Sequence[str],
                    approved_system_prompts: Sequence[str]) -> None:
    """Loads the adapters and declares the approved prefixes (before the engine loop runs, so
    the engine may be called directly).

    Raises:
        ValueError: an adapter that can't be loaded for this model or its weight format (int4,
            int4-int8), an empty approved prefix.
    """
    quantization = engine.runner.model.quantization
    if lora_modules and quantization in INT4_DECODER_FORMATS:  # every request naming one would be a 400
        raise ValueError(f"lora_modules: adapters need quantization 'none' or 'int8'; {quantization!r} runs "
                         f"generated tokens in fused kernels without LoRA deltas")
    for name, path in lora_modules.items():
        try:
            engine.lora_manager.get(LoRARequest(name, path))
        except ValueError as e:
            raise ValueError(f"LoRA adapter {name}={path}: {e}") from e
    for text in approved_prefixes:
        engine.add_approved_prefix(text)
    for content in approved_system_prompts:
        engine.add_approved_system_prompt(content)


def _add_serving(app: FastAPI, async_engine: AsyncLLMEngine, served_model_name: str,
                 lora_modules: dict[str, str] | None) -> None:
    """Each endpoint's serving object on ``app.state``, all wrapping one :class:`OpenAIServing`
    (``app.state.serving``: the engine, the served model's name and its adapters)."""
    serving = app.state.serving = OpenAIServing(async_engine, served_model_name, lora_modules)
    app.state.serving_completion = OpenAIServingCompletion(serving)
    app.state.serving_chat = OpenAIServingChat(serving)
    app.state.serving_tokenization = OpenAIServingTokenization(serving)
    app.state.messages = AnthropicServing(serving)


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
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    dashboard_options: DashboardOptions | None = None,
) -> FastAPI:
    """Builds the FastAPI app serving ``engine``.

    Args:
        engine: an engine (wrapped in an :class:`AsyncLLMEngine`) or an async engine not yet
            serving another app. The app starts its loop on startup and stops it on shutdown.
        served_model_name: the model name clients send and ``/v1/models`` lists.
        api_key: when set, ``/v1/*`` and ``/reset_prefix_cache`` need ``Authorization: Bearer KEY``.
        lora_modules: adapter name → PEFT adapter directory; a request whose ``model`` is one of
            these names runs with that adapter (vLLM's ``--lora-modules``). Loaded here.
        api_keys: more accepted keys, ``key -> tenant name`` (several keys may name one tenant).
            ``api_key`` joins them as its own tenant, named after a digest of the key.
        tenant_isolation: give every tenant its own cache namespace; needs at least one key.
            ``/reset_prefix_cache`` is then refused (403): one tenant must not flush the others.
        approved_prefixes: public prompt texts every tenant may share (tokenized as completion
            prompts are).
        approved_system_prompts: public chat system messages every tenant may share.
        max_request_body_bytes: larger request bodies are refused with 413 while being read.
        dashboard_options: ``/dashboard`` and ``/v1/cache/stats`` settings (previews, history).

    Returns:
        The app; ``app.state.engine`` is the async engine, ``app.state.metrics`` its metrics,
        ``app.state.dashboard`` the dashboard's state.

    Raises:
        ValueError: ``tenant_isolation`` without keys, a bad key or tenant name, an empty
            approved prefix, an adapter that can't be loaded, a body limit < 1 byte, a bad dashboard
            option.
    """
    async_engine = engine if isinstance(engine, AsyncLLMEngine) else AsyncLLMEngine(engine)
    key_to_tenant = tenants_by_key(api_key, api_keys)
    if tenant_isolation and not key_to_tenant:
        raise ValueError("tenant isolation needs API keys: give --api-key or --tenant-api-key TENANT=KEY")
    if isinstance(max_request_body_bytes, bool) or not isinstance(max_request_body_bytes, int) \
            or max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be an integer >= 1, got {max_request_body_bytes!r}")
    _prepare_engine(async_engine.engine, lora_modules or {}, approved_prefixes, approved_system_prompts)
    metrics = ServerMetrics(served_model_name)
    board = DashboardState(async_engine, served_model_name, tenant_isolation, dashboard_options)

    def on_finish(out, request_done: bool = True) -> None:
        metrics.observe_finished(out, request_done)
        board.observe_finished(out, request_done)

    async_engine.on_finish = RequestLog(then=on_finish)  # metrics and the dashboard, then one log line

    app = FastAPI(title="prefixcache", lifespan=_lifespan, redirect_slashes=False,  # "/v1/x/" is a 404, not a 307
                  docs_url=None, redoc_url=None)  # FastAPI's pages load from a CDN: ours below work offline
    add_docs_routes(app)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.dashboard = board
    _add_serving(app, async_engine, served_model_name, lora_modules)
    app.state.tenant_isolation = tenant_isolation
    for path, method, endpoint, options in _ROUTES:
        app.add_api_route(path, endpoint, methods=[method], **options)
        if method == "GET":  # HEAD: the GET's status and headers, no body (the server drops it); probes use it
            app.add_api_route(path, endpoint, methods=["HEAD"], **{**options, "include_in_schema": False})
    app.router.add_api_route("/v1/messages", create_message, methods=["POST"], **_MESSAGES_ROUTE)
    app.router.add_api_route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"],
                             **{**_MESSAGES_ROUTE, "responses": COUNT_TOKENS_RESPONSES})
    for exc_class, handler in _EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_class, handler)
    if key_to_tenant:
        app.add_middleware(APIKeyMiddleware, key_to_tenant=key_to_tenant)
    app.add_middleware(RequestBodyLimitMiddleware, max_body_bytes=max_request_body_bytes)  # outermost
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
