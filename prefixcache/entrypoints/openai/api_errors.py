"""OpenAI-format error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server answers goes through :func:`error_response`, so the body always has this
shape and is always valid JSON: non-ASCII is escaped (a lone surrogate echoed from a request can't
break the encoding), and a message is cut at :data:`MAX_MESSAGE_CHARS`. Values echoed from a
request are cut further, at :data:`MAX_ECHO_CHARS`, by :func:`clip`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType, UnionType
from typing import Annotated, Union, get_args, get_origin

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from prefixcache.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                   ErrorInfo, ErrorResponse, TokenizeRequest)
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


def union_paths(model: type[BaseModel], path: tuple = ()) -> set[tuple]:
    """Paths (field names; ``"*"`` for a list index) of the fields of ``model`` and of the models
    inside it whose type is a union of two or more forms besides None: where pydantic's error
    locations carry a member's tag (``("prompt", "list[str]", 0)``) after the field."""
    found: set[tuple] = set()
    for name, info in model.model_fields.items():
        todo = [(info.annotation, (*path, info.alias or name))]
        while todo:
            tp, at = todo.pop()
            if get_origin(tp) is Annotated:
                tp = get_args(tp)[0]
            if get_origin(tp) in (Union, UnionType):
                forms = [a for a in get_args(tp) if a is not type(None)]
                if len(forms) > 1:
                    found.add(at)
                    continue  # members' own errors follow their tag: not named here
                tp = forms[0]
            if get_origin(tp) is list:
                todo.append((get_args(tp)[0], (*at, "*")))
            elif isinstance(tp, type) and issubclass(tp, BaseModel):
                found |= union_paths(tp, at)
    return found


_UNION_PATHS = frozenset(set().union(*(union_paths(m) for m in (
    CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest))))


def _describe(tag: str, plural: bool = False) -> str:
    """A union member's tag (pydantic's, from our own schema) in words: ``list[constrained-int]`` ->
    "a list of integers"."""
    if tag.startswith("list[") and tag.endswith("]"):
        return ("lists of " if plural else "a list of ") + _describe(tag[5:-1], True)
    base = tag.removeprefix("constrained-").split("[")[0]
    one, many = {"str": ("a string", "strings"), "int": ("an integer", "integers"),
                 "float": ("a number", "numbers"), "bool": ("a boolean", "booleans"),
                 "dict": ("an object", "objects")}.get(base, (base, base))
    return many if plural else one


def _loc(error: dict) -> list:
    """An error's location in the body: FastAPI's leading ``"body"`` dropped (only that one)."""
    loc = list(error.get("loc", ()))
    return loc[1:] if loc[:1] == ["body"] else loc


def _union_tag_at(loc: list, paths: frozenset[tuple]) -> int | None:
    """Index of the union member's tag in ``loc``: the first position after a union field's path."""
    for i in range(1, len(loc)):
        if tuple("*" if isinstance(x, int) else x for x in loc[:i]) in paths:
            return i
    return None


def json_error_message(error: dict) -> str:
    """The 400 message of a body that is not JSON (pydantic's ``json_invalid`` error, first of
    ``RequestValidationError.errors()``): where the decoder stopped (FastAPI's character offset) and why, e.g.
    ``malformed JSON body at character 8: Expecting property name enclosed in double quotes``."""
    loc = error.get("loc") or ()
    at = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
    reason = (error.get("ctx") or {}).get("error") or error.get("msg")
    return f"malformed JSON body{at}: {cut(str(reason), 200)}"


def unparsed_body_message(error: dict, content_type: str | None) -> str | None:
    """The 400 message of a body FastAPI did not parse as JSON because of its content type (its first validation
    error is then the whole body, still bytes: ``curl -d`` sends form-urlencoded), naming the header, or of a JSON
    string body (parsed, then no object); None for any other error."""
    if tuple(error.get("loc") or ()) != ("body",) or not isinstance(error.get("input"), (bytes, str)):
        return None
    media = (content_type or "").split(";")[0].strip().lower()
    if isinstance(error["input"], str) and (media == "application/json" or media.endswith("+json")):
        return "body: must be a JSON object, got a JSON string"  # parsed as JSON (FastAPI's rule): the header is right
    got = f"content-type {cut(content_type, 80)!r}" if content_type else "no content-type"
    return f"body: send a JSON object with content-type: application/json (this request had {got})"


def validation_message(errors: Sequence[dict], paths: frozenset[tuple] = _UNION_PATHS) -> tuple[str, str | None]:
    """(message, param) of pydantic's errors for a request body (FastAPI's
    ``RequestValidationError.errors()``, at least one): the first error's field, dotted with list
    indices (``stop_token_ids.1: ...``). Where that field is a union (``prompt``: a string, token
    ids, ...), pydantic reports every member's failure and the first one alone misled ("prompt:
    Input should be a valid string" for ``[1, 2, "x"]``): the message names every accepted form,
    then the first failure of the member with the fewest failures (the latest first failure on a
    tie) among those the value got inside (``prompt.2: Input should be a valid integer``). Which
    fields are unions comes from the request models, so a dict key in a location (``logit_bias``'s)
    is never taken for a member (``paths``: :func:`union_paths` of the route's request models; the OpenAI
    routes' by default)."""
    loc = _loc(errors[0])
    tag_at = _union_tag_at(loc, paths)
    field = loc if tag_at is None else loc[:tag_at]
    param = str(field[0]) if field else None
    where = cut(".".join(str(x) for x in field) or "body")
    if tag_at is None:
        return f"{where}: {errors[0].get('msg')}", param
    by_tag: dict[str, list[dict]] = {}
    for e in errors:
        at = _loc(e)
        if len(at) > tag_at and at[:tag_at] == field:
            by_tag.setdefault(str(at[tag_at]), []).append(e)
    forms = [_describe(t) for t in by_tag]
    accepted = forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]
    inside = [es for es in by_tag.values() if len(_loc(es[0])) > tag_at + 1]
    detail = ""
    if inside:
        def progress(es: list[dict]) -> tuple[int, int]:  # fewest failures, then the latest first failure
            first = _loc(es[0])[tag_at + 1]
            return len(es), -first if isinstance(first, int) else 0

        closest = min(inside, key=progress)[0]
        detail = f"; {cut('.'.join(map(str, [*field, *_loc(closest)[tag_at + 1:]])))}: {closest.get('msg')}"
    return f"{where}: must be {cut(accepted)}{detail}", param


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
