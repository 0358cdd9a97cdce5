"""API keys and tenants: which keys the server accepts, and the ASGI middleware that checks them.

Every accepted key belongs to a tenant (:mod:`prefixcache.engine.tenancy`). The middleware puts
the tenant of a request's key in ``request.state.tenant``; with tenant isolation the serving
layer passes it to the engine, which gives each tenant its own cache namespace.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import urllib.parse
from collections.abc import Mapping

from starlette.responses import HTMLResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from prefixcache.engine.tenancy import validate_tenant
from prefixcache.entrypoints.dashboard.routes import COOKIE_NAME, LOGIN_PAGE
from prefixcache.entrypoints.openai.api_errors import error_response

# What an HTTP Authorization header can carry: printable ASCII, inner single spaces.
_HEADER_SAFE_KEY = re.compile(r"[\x21-\x7e]+(?: +[\x21-\x7e]+)*")


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
        if not isinstance(key, str) or not _HEADER_SAFE_KEY.fullmatch(key):
            raise ValueError("API keys must be non-empty printable ASCII without surrounding spaces "
                             "(an HTTP Authorization header can't carry anything else)")
        if key in keys:
            raise ValueError("an API key is given twice; each key belongs to one tenant")
        try:
            keys[key] = validate_tenant(tenant)
        except ValueError as e:
            raise ValueError(f"tenant {str(tenant)[:40]!r}: {e}") from e
    return keys


# Besides /v1/*: /flush_cache is SGLang's name of /reset_prefix_cache.
PROTECTED_PATHS = frozenset({"/reset_prefix_cache", "/flush_cache", "/tokenize", "/detokenize", "/dashboard"})
# A browser can't add a header to a page load: these GETs also take the key from the dashboard's cookie.
COOKIE_PATHS = frozenset({"/dashboard", "/v1/cache/stats"})


def needs_key(path: str) -> bool:
    """Whether ``path`` is protected: ``/v1/*``, ``/reset_prefix_cache`` (``/flush_cache``), ``/tokenize``,
    ``/detokenize`` and ``/dashboard`` (not ``/health``, ``/metrics``, the OpenAPI docs or the
    dashboard's static files)."""
    return path.startswith("/v1") or path in PROTECTED_PATHS


def _cookie_bearer(scope: Scope) -> bytes:
    """``Bearer KEY`` from the dashboard's ``prefixcache_key`` cookie, for a GET (or HEAD) of a dashboard path."""
    if scope.get("method") not in ("GET", "HEAD") or scope["path"] not in COOKIE_PATHS:
        return b""
    for name, value in scope["headers"]:
        if name == b"cookie":
            for part in value.split(b";"):
                key, _, val = part.strip().partition(b"=")
                if key == COOKIE_NAME.encode():
                    return b"Bearer " + urllib.parse.unquote_to_bytes(val)
    return b""


def _x_api_key(scope: Scope) -> bytes:
    """``Bearer KEY`` from an ``x-api-key: KEY`` header (how Anthropic's clients send the key)."""
    value = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
    return b"Bearer " + value if value else b""


class APIKeyMiddleware:
    """Answers 401 to a protected request without a valid ``Authorization: Bearer KEY`` (or
    ``x-api-key: KEY``, Anthropic's header); otherwise
    sets ``scope["state"]["tenant"]`` to the key's tenant.

    Args:
        app: the app to protect.
        key_to_tenant: accepted keys → tenant (from :func:`tenants_by_key`).
    """

    def __init__(self, app: ASGIApp, key_to_tenant: Mapping[str, str]) -> None:
        self.app = app
        self._bearers = [(f"Bearer {key}".encode(), tenant) for key, tenant in key_to_tenant.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = (next((v for k, v in scope["headers"] if k == b"authorization"), b"") or _x_api_key(scope)
                  or _cookie_bearer(scope))
        tenant = None
        for bearer, name in self._bearers:  # compare with every key: time doesn't tell which matched
            if secrets.compare_digest(header, bearer):
                tenant = name
        if tenant is None:
            response = error_response(401, "invalid or missing API key (Authorization: Bearer KEY)", None,
                                      "invalid_api_key")
            if scope["path"] == "/dashboard":  # a person at a browser: ask for the key
                response = HTMLResponse(LOGIN_PAGE, status_code=401)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
