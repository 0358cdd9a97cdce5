"""The interactive API docs, offline: ``GET /docs`` (Swagger UI) and ``GET /redoc`` (ReDoc).

FastAPI's own docs pages load Swagger UI and ReDoc from a CDN, so on a machine without internet
they are blank. Here the pages come from FastAPI's page builders
(``fastapi.openapi.docs.get_swagger_ui_html`` / ``get_redoc_html``, FastAPI's "custom docs UI
static assets" recipe) with their scripts and styles served by this server under
:data:`DOCS_STATIC_URL`, from the Swagger UI 5 and ReDoc 2 bundles shipped in the
``fastapi-offline`` wheel (MIT; its licence travels in its dist-info).

Invariants: no URL in either page points off-host, and each page's Content-Security-Policy
(:data:`CONTENT_SECURITY_POLICY`) lets the browser load nothing from another host either, so what
the bundles would fetch themselves (ReDoc's "by Redocly" logo from its CDN, Swagger UI's
online-validator badge, also switched off with ``validatorUrl: "none"``) is blocked before it leaves
the machine. The pages, their files and ``/openapi.json`` need no API key (:mod:`.auth`).
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_STATIC_URL = "/docs/static"  # swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png
STATIC_DIR = Path(fastapi_offline.__file__).with_name("static")
# Only this server: the pages' own inline start-up script and the styles the bundles inject, images
# and fonts as data: URLs, ReDoc's search worker from a blob: URL.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
                           "connect-src 'self'; frame-ancestors 'self'")
SWAGGER_UI_PARAMETERS = {"validatorUrl": "none"}  # no badge image from swagger.io: the docs pages work offline


def add_docs_routes(app: FastAPI) -> None:
    """Mounts the docs' files and adds ``/docs`` and ``/redoc`` to ``app`` (built with
    ``docs_url=None, redoc_url=None``, so FastAPI adds its CDN pages neither)."""
    app.mount(DOCS_STATIC_URL, StaticFiles(directory=STATIC_DIR), name="docs-static")

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_swagger_ui_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{root}{DOCS_STATIC_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{DOCS_STATIC_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{DOCS_STATIC_URL}/favicon.png",
                                   swagger_ui_parameters=SWAGGER_UI_PARAMETERS)
        page.headers["content-security-policy"] = CONTENT_SECURITY_POLICY
        return page

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{DOCS_STATIC_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{DOCS_STATIC_URL}/favicon.png", with_google_fonts=False)
        page.headers["content-security-policy"] = CONTENT_SECURITY_POLICY
        return page

    app.add_api_route("/docs", swagger_ui, methods=["GET"], include_in_schema=False, response_class=HTMLResponse)
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False, response_class=HTMLResponse)
