"""OpenAI-format error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server answers goes through :func:`error_response`, so the body always has this
shape and is always valid JSON: non-ASCII is escaped (a lone surrogate echoed from a request can't
break the encoding), and a message is cut at :data:`MAX_MESSAGE_CHARS`. Values echoed from a
request are cut further, at :data:`MAX_ECHO_CHARS`, by :func:`clip`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from fastapi.responses import JSONResponse

from prefixcache.entrypoints.protocol import ErrorInfo, ErrorResponse
from prefixcache import errors
from prefixcache.errors import InvalidInputError

MAX_ECHO_CHARS = 100  # of one request value quoted in an error message
MAX_MESSAGE_CHARS = 1000  # of a whole error message (engine messages quote values too)
ERROR_TYPES: Mapping[int, str] = MappingProxyType({
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
})


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


def cut(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters + ``"..."`` (:func:`prefixcache.errors.cut`)."""
    return errors.cut(text, limit)


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters + ``"..."`` (:func:`prefixcache.errors.clip`)."""
    return errors.clip(value, limit)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error body as a dict (also sent as an SSE event when a stream fails)."""
    info = ErrorInfo(message=cut(message, MAX_MESSAGE_CHARS), type=ERROR_TYPES.get(status, "api_error"), param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_json(body: dict) -> bytes:
    """``body`` as ASCII JSON: lone surrogates and other odd characters come out as ``\\uXXXX``."""
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class _ErrorJSONResponse(JSONResponse):
    def render(self, content: object) -> bytes:
        return error_json(content)  # type: ignore[arg-type]


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A JSON response with OpenAI's error body."""
    return _ErrorJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def input_error(e: ValueError, prompt_field: str) -> APIError:
    """A 400 for a ``ValueError`` from SamplingParams or the engine.

    The field comes from :attr:`InvalidInputError.field` (``prompt`` is reported as
    ``prompt_field``: ``messages`` for chat, the message then starting with ``"messages: "``); a
    plain ``ValueError`` names no field.
    """
    field = e.field if isinstance(e, InvalidInputError) else None
    message = str(e)
    if field == "prompt" and prompt_field != "prompt":
        field, message = prompt_field, f"{prompt_field}: {message}"
    return APIError(400, message, field)


# A pydantic location element naming a union member ("str", "list[constrained-int]", ...), not a field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|constrained-\w+|(list|dict|tuple|set)\[.*\])$")


def _describe(tag: str, plural: bool = False) -> str:
    """A union member's tag in words: ``list[constrained-int]`` -> "a list of integers"."""
    if tag.startswith("list[") and tag.endswith("]"):
        return ("lists of " if plural else "a list of ") + _describe(tag[5:-1], True)
    base = tag.removeprefix("constrained-").split("[")[0]
    one, many = {"str": ("a string", "strings"), "int": ("an integer", "integers"),
                 "float": ("a number", "numbers"), "bool": ("a boolean", "booleans"),
                 "dict": ("an object", "objects")}.get(base, (base, base))
    return many if plural else one


def validation_message(errors: Sequence[dict]) -> tuple[str, str | None]:
    """(message, param) of pydantic's errors for a request body (FastAPI's
    ``RequestValidationError.errors()``, at least one): the first error's field, dotted with list
    indices (``stop_token_ids.1: ...``). Where that field is a union (``prompt``: a string, token
    ids, ...), pydantic reports every member's failure and the first one alone misled ("prompt:
    Input should be a valid string" for ``[1, 2, "x"]``): the message names every accepted form,
    then the failure of the member the value got furthest into, when it got inside one."""
    first = errors[0]
    loc = [x for x in first.get("loc", ()) if x != "body"]
    tag_at = next((i for i, x in enumerate(loc) if isinstance(x, str) and _UNION_TAG.match(x)), None)
    members, tags = [], []
    if tag_at is not None:  # a union's members fail together, each under its own tag
        members = [e for e in errors if [x for x in e.get("loc", ()) if x != "body"][:tag_at] == loc[:tag_at]
                   and len(e["loc"]) > tag_at and _UNION_TAG.match(str([x for x in e["loc"] if x != "body"][tag_at]))]
        tags = list(dict.fromkeys(str([x for x in e["loc"] if x != "body"][tag_at]) for e in members))
    field = loc if len(tags) < 2 else loc[:tag_at]  # one "tag" alone may be a dict key: no union then
    param = str(field[0]) if field else None
    where = cut(".".join(str(x) for x in field) or "body")
    if len(tags) < 2:
        return f"{where}: {first.get('msg')}", param
    forms = [_describe(t) for t in tags]
    accepted = forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]
    deepest = max(members, key=lambda e: (len(e["loc"]), e["loc"][-1] if isinstance(e["loc"][-1], int) else -1))
    inner = [x for x in deepest["loc"] if x != "body"][tag_at + 1:]
    detail = f"; {where}.{'.'.join(map(str, inner))}: {deepest.get('msg')}" if inner else ""
    return f"{where}: must be {accepted}{detail}", param


# OpenAPI: the error responses each operation documents (besides its 200).
_ERROR_DOCS: Mapping[int, str] = MappingProxyType({
    400: "invalid request: malformed JSON, a wrong type or value (`param` names the field)",
    401: "missing or wrong API key",
    403: "forbidden under --tenant-isolation",
    404: "unknown model",
    405: "method not allowed on this route",
    408: "request head or body not received within --timeout-request-header / --timeout-request-body",
    409: "requests hold KV blocks; retry when idle",
    413: "request body larger than --max-request-body-bytes",
    500: "unexpected server error, or the engine step that ran the request failed",
    503: "the engine loop has stopped, or the server is shutting down",
})


def error_docs(*statuses: int) -> dict[int | str, dict]:
    """``responses=`` entries documenting ``statuses`` with the error schema."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DOCS[s]} for s in statuses}
