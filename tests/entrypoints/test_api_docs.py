"""The API docs pages work offline (issue 17): ``/docs`` (Swagger UI) and ``/redoc`` load their
scripts and styles from the server itself (``/docs/static/``, the files of the ``fastapi-offline``
package), not from FastAPI's default CDN; no URL in the pages points off-host, and their
Content-Security-Policy keeps the bundles from fetching off-host themselves. The pages are public
like ``/openapi.json`` when the server has an API key. A headless chromium in which every off-host
request would be refused and recorded renders Swagger UI's operations list and ReDoc's, and tries
none (the set-up of test_dashboard_browser.py: Debian's chromium driven by Playwright).
"""

from __future__ import annotations

import os
import re
import shutil

import httpx
import pytest

from prefixcache.entrypoints.openai.api_docs import CONTENT_SECURITY_POLICY
from tests.entrypoints.conftest import start_server, stop_server

KEY = "sk-docs-test"
ASSET_URL = re.compile(r"""(?:src|href)=["']([^"']+)["']""")
# content type, minimum size in bytes, a string the real file holds
ASSETS = {
    "swagger-ui-bundle.js": ("text/javascript", 500_000, "SwaggerUIBundle"),
    "swagger-ui.css": ("text/css", 50_000, ".swagger-ui"),
    "redoc.standalone.js": ("text/javascript", 500_000, "Redoc"),
    "favicon.png": ("image/png", 1_000, "PNG"),
}


@pytest.fixture(scope="module")
def keyed_server(smollm2):
    s = start_server(smollm2, api_key=KEY)
    yield s
    stop_server(s)


def _media_type(response: httpx.Response) -> str:
    kind = response.headers["content-type"].split(";")[0].strip()
    return "text/javascript" if kind == "application/javascript" else kind  # the same, by system mime table


@pytest.mark.parametrize("page,expected", [
    ("/docs", {"/docs/static/swagger-ui.css", "/docs/static/favicon.png", "/docs/static/swagger-ui-bundle.js"}),
    ("/redoc", {"/docs/static/favicon.png", "/docs/static/redoc.standalone.js"}),
])
def test_docs_pages_load_only_local_assets_without_a_key(keyed_server, page, expected):
    base = keyed_server.base_url
    r = httpx.get(base + page, timeout=30)
    assert r.status_code == 200 and _media_type(r) == "text/html"
    assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert set(ASSET_URL.findall(r.text)) == expected
    assert "://" not in r.text  # nothing absolute: no CDN, no fonts, no validator
    assert "'/openapi.json'" in r.text or '"/openapi.json"' in r.text
    for url in expected:
        asset = httpx.get(base + url, timeout=30)  # public like the page: no Authorization header
        kind, min_bytes, marker = ASSETS[url.rsplit("/", 1)[1]]
        assert (asset.status_code, _media_type(asset)) == (200, kind), url
        assert len(asset.content) >= min_bytes and marker.encode() in asset.content, url
    assert httpx.get(base + "/openapi.json", timeout=30).status_code == 200
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 401  # the key still guards the API


def test_swagger_ui_has_the_online_validator_badge_off(keyed_server):
    page = httpx.get(keyed_server.base_url + "/docs", timeout=30).text
    assert '"validatorUrl": "none"' in page  # else a server on a LAN address shows a badge from swagger.io


def test_a_missing_docs_asset_is_the_json_404_of_an_unknown_route(keyed_server):
    r = httpx.get(keyed_server.base_url + "/docs/static/nope.js", timeout=30)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Not Found", "type": "not_found_error", "param": None, "code": None}}


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed (scripts/setup.sh installs it)")
def test_docs_render_every_operation_in_an_offline_browser(keyed_server):
    playwright_sync = pytest.importorskip("playwright.sync_api")
    base = keyed_server.base_url
    schema = httpx.get(base + "/openapi.json", timeout=30).json()
    operations = sorted((method.upper(), path) for path, item in schema["paths"].items() for method in item)
    assert len(operations) >= 10  # 14 today
    refused = []

    def only_this_server(route):  # the machine may have internet; the test must not use it
        if route.request.url.startswith(base + "/"):
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.route("**/*", only_this_server)
            page.goto(base + "/docs")
            page.wait_for_selector(".opblock", timeout=30_000)
            shown = page.eval_on_selector_all(  # deprecated paths have their own class: data-path is in both
                ".opblock", "els => els.map(e => [e.querySelector('.opblock-summary-method').textContent,"
                            " e.querySelector('[data-path]').getAttribute('data-path')])")
            assert sorted(map(tuple, shown)) == operations
            assert page.text_content(".info .title").startswith("prefixcache")

            page.goto(base + "/redoc")
            page.wait_for_selector("[data-section-id^='operation/']", state="attached", timeout=30_000)
            sections = page.eval_on_selector_all("[data-section-id^='operation/']",
                                                 "els => els.map(e => e.getAttribute('data-section-id'))")
            assert set(sections) == {f"operation/{schema['paths'][path][method.lower()]['operationId']}"
                                     for method, path in operations}
        finally:
            browser.close()
    assert refused == []
