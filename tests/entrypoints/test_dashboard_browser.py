"""The dashboard in a real headless browser: Debian's chromium (scripts/setup.sh installs it) driven by
Playwright against a live server with an API key. The page asks for the key, opens, shows the
server-rendered numbers, then updates them by itself after requests; the charts draw from the
package's own uPlot (no network). A screenshot is saved in the test's tmp dir (path printed).
"""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from prefixcache.entrypoints.dashboard.state import DashboardOptions
from tests.entrypoints.conftest import MODEL, start_server, stop_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "sk-dashboard-test"
SYSTEM = ("You are the support assistant of the ACME online store. Answer in two sentences, politely, and only "
          "about orders, shipping, returns and our product catalogue.")

playwright_sync = pytest.importorskip("playwright.sync_api")


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/cache/stats", headers={"Authorization": f"Bearer {KEY}"}).json()


def _complete(url: str, prompt: str) -> None:
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed (scripts/setup.sh installs it)")
def test_dashboard_in_headless_chromium(smollm2, tmp_path):
    s = start_server(smollm2, api_key=KEY, enable_partial_block_reuse=False,
                     app_options={"dashboard_options": DashboardOptions(interval_s=0.2)})
    requests_seen = []
    try:
        _complete(s.base_url, SYSTEM + " Q: where is my order?")
        with playwright_sync.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.on("request", lambda r: requests_seen.append(r.url))
            page.goto(s.base_url + "/dashboard")
            page.fill("#key", KEY)  # the login form: 401 page, sets the cookie, reloads
            page.click("button[type=submit]")
            page.wait_for_selector("#queries")
            before = _stats(s.base_url)["totals"]
            assert page.text_content("#queries") == str(before["prefix_cache_queries"])
            assert page.text_content("#hits") == "0"

            _complete(s.base_url, SYSTEM + " Q: can I return shoes?")
            _complete(s.base_url, SYSTEM + " Q: do you ship to Norway?")
            s.wait_idle()
            after = _stats(s.base_url)["totals"]
            assert after["prefix_cache_hits"] > 0
            page.wait_for_function(
                "([q, h]) => document.querySelector('#queries').textContent === q"
                " && document.querySelector('#hits').textContent === h",
                arg=[str(after["prefix_cache_queries"]), str(after["prefix_cache_hits"])], timeout=15000)
            assert page.text_content("#finished") == "3"
            (group,) = _stats(s.base_url)["kv_groups"]  # SmolLM2: one group, every layer; its cached
            assert group["cached"] > 0 and group["label"] == "full attention"  # blocks grew after the load
            page.wait_for_function("c => document.querySelector('#groups-body td:nth-child(5)').textContent === c",
                                   arg=str(group["cached"]), timeout=15000)
            assert page.text_content("#status") == "live"
            page.wait_for_selector("#chart-hits canvas", timeout=15000)  # uPlot drew the history
            page.wait_for_selector("#prefixes ul.tree li .preview", timeout=15000)
            assert "You are the support assistant" in page.text_content("#prefixes")
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        assert shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
        assert all(u.startswith(s.base_url) for u in requests_seen), [u for u in requests_seen
                                                                        if not u.startswith(s.base_url)]
    finally:
        stop_server(s)
