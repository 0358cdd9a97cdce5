"""The operator dashboard's routes: ``GET /v1/cache/stats``, ``GET /dashboard`` and its static files.

``/dashboard`` is rendered on the server from the same document as ``/v1/cache/stats`` (so it shows
numbers without JavaScript), then ``dashboard.js`` polls the JSON every couple of seconds and updates
it, drawing the history with uPlot (MIT, shipped in ``static/`` with its licence: no CDN,
nothing fetched from outside the server). Every text from the cache is escaped (server side) or set
as text (browser side).

With API keys, ``/dashboard`` and ``/v1/cache/stats`` need the key as the API does
(:mod:`~prefixcache.entrypoints.openai.auth`): an ``Authorization: Bearer KEY`` header, or, for a
browser, the ``prefixcache_key`` cookie that the login form sets. The static files (the page's
code, no data) are public.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from fastapi import Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from prefixcache.entrypoints.openai.api_errors import APIError

STATIC_DIR = Path(__file__).with_name("static")
STATIC_FILES = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css",
                "dashboard.js": "text/javascript", "dashboard.css": "text/css", "LICENSE-uPlot": "text/plain"}
COOKIE_NAME = "prefixcache_key"
POLL_MS = 2000

# (label, JSON path, format, element id): the numbers of the page, rendered here and by dashboard.js.
STAT_FIELDS = (
    ("Hit rate (tokens)", "totals.hit_rate", "pct", "hit-rate"),
    ("Prompt tokens queried", "totals.prefix_cache_queries", "int", "queries"),
    ("Prompt tokens hit", "totals.prefix_cache_hits", "int", "hits"),
    ("Prefill tokens saved", "totals.prefill_tokens_saved", "int", "saved"),
    ("Requests finished", "totals.finished_requests", "int", "finished"),
    ("Requests running", "requests.running", "int", "running"),
    ("Requests waiting", "requests.waiting", "int", "waiting"),
    ("TTFT cold p50", "ttft.cold.p50_s", "s", "ttft-cold-p50"),
    ("TTFT cold p99", "ttft.cold.p99_s", "s", "ttft-cold-p99"),
    ("TTFT warm p50", "ttft.warm.p50_s", "s", "ttft-warm-p50"),
    ("TTFT warm p99", "ttft.warm.p99_s", "s", "ttft-warm-p99"),
    ("Blocks in use", "pool.blocks_in_use", "int", "blocks-in-use"),
    ("Blocks cached", "pool.blocks_cached", "int", "blocks-cached"),
    ("Blocks free (cached ones too)", "pool.blocks_free", "int", "blocks-free"),
    ("KV pool", "pool.total_bytes", "bytes", "pool-bytes"),
    ("KV cached", "pool.cached_bytes", "bytes", "cached-bytes"),
    ("Blocks evicted", "pool.evictions", "int", "evictions"),
)


def fmt(value, kind: str) -> str:
    """A value as dashboard.js's ``fmt`` writes it."""
    if value is None:
        return "–"
    if kind == "pct":
        return f"{value * 100:.1f} %"
    if kind == "s":
        return f"{value * 1000:.1f} ms"
    if kind == "bytes":
        return f"{value / 1048576:.1f} MiB"
    return str(value)


def _get(doc: dict, path: str):
    for key in path.split("."):
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def _tiles(doc: dict) -> str:
    return "\n".join(
        f'<div class="tile"><div class="label">{html.escape(label)}</div>'
        f'<div class="value" id="{eid}" data-stat="{path}" data-fmt="{kind}">{html.escape(fmt(_get(doc, path), kind))}'
        f"</div></div>"
        for label, path, kind, eid in STAT_FIELDS
    )


def _node(n: dict) -> str:
    ago = "never" if n["last_use_s_ago"] is None else f"{n['last_use_s_ago']:.1f} s ago"
    line = (f"[{n['start']}, {n['end']}) {n['tokens']} tokens · hits {n['hits']} · served {n['served_tokens']} · "
            f"last use {ago}")
    preview = f'<code class="preview">{html.escape(json.dumps(n["preview"], ensure_ascii=False))}</code>' if "preview" in n else ""
    kids = "".join(_node(k) for k in n["children"])
    return f'<li><span class="node">{html.escape(line)}</span>{preview}{f"<ul>{kids}</ul>" if kids else ""}</li>'


def _prefixes(groups: list[dict]) -> str:
    if not groups:
        return '<p class="muted">The cache holds no prefix yet.</p>'
    out = []
    for g in groups:
        ns = g["namespace"]
        label = "no tenant / shared" if ns["tenant"] is None else f"tenant {ns['tenant']}"
        label += "".join(f" · {k}#{ns[k]}" for k in ("salt", "adapter") if ns[k])
        out.append(f"<h3>{html.escape(label)} — {g['blocks']} blocks, {g['tokens']} tokens, "
                   f"{g['served_tokens']} tokens served</h3>")
        out.append('<ul class="tree">' + "".join(_node(n) for n in g["chains"]) + "</ul>")
    return "\n".join(out)


def _breakers(b: dict) -> str:
    rows = []
    for g in b["top"]:
        ex = g.get("examples")
        example = f"{json.dumps(ex[0]['request'])} vs {json.dumps(ex[0]['chain'])}" if ex else "(hidden)"
        cells = [g["kind"], g["position"], g["block"], g["count"], g["tokens_lost"], example]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


def _zero_hits(z: dict) -> str:
    rows = []
    for reason, r in z["by_reason"].items():
        cells = [reason, r["count"], r["prompt_tokens"], r["latest"]]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


PINS_SHOWN = 20  # pinned blocks listed (soonest expiry first); dashboard.js shows as many


def _pins_summary(p: dict) -> str:
    budget = "unknown yet" if p["budget_blocks"] is None else p["budget_blocks"]
    return f"{len(p['blocks'])} blocks pinned of a budget of {budget}"


def _pins(p: dict) -> str:
    rows = []
    for b in p["blocks"][:PINS_SHOWN]:
        cells = [b["block_id"], b["depth"], f"{b['ttl_s']:g}", f"{b['expires_in_s']:.0f}"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


# (column, tier counter) of the KV tiers table; dashboard.js has the same list.
TIER_COLUMNS = (("tier", None), ("tokens queried", "queries"), ("tokens hit", "hits"), ("bytes loaded", "bytes_loaded"),
                ("bytes stored", "bytes_stored"), ("entries", "entries"), ("bytes held", "bytes"), ("errors", "errors"))


def _tiers(tiers: dict) -> str:
    rows = []
    for name, stats in sorted(tiers.items()):
        cells = [name] + [stats.get(key, "–") for _, key in TIER_COLUMNS[1:]]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


# (column, kv_groups key) of the KV-cache groups table; dashboard.js has the same list.
GROUP_COLUMNS = (("group", "group_id"), ("attention", "label"), ("layers", "layers"), ("blocks in use", "in_use"),
                 ("blocks cached", "cached"), ("cached, free", "cached_free"), ("retained", "retained"))


def _group_cell(group: dict, key: str) -> str:
    value = group[key]
    return " ".join(map(str, value)) if key == "layers" else str(value)


def _kv_groups(groups: list[dict]) -> str:
    return "\n".join("<tr>" + "".join(f"<td>{html.escape(_group_cell(g, key))}</td>" for _, key in GROUP_COLUMNS)
                     + "</tr>" for g in groups)


def render_page(doc: dict) -> str:
    """The dashboard's HTML, filled in from a ``/v1/cache/stats`` document."""
    worth = doc["worth"]
    b = doc["breakers"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>prefixcache · {html.escape(doc['model'])}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/dashboard/static/uPlot.min.css">
<link rel="stylesheet" href="/dashboard/static/dashboard.css">
</head><body data-poll-ms="{POLL_MS}">
<header><h1>prefixcache · {html.escape(doc['model'])}</h1>
<span class="muted">updated <span id="updated">now</span> · <span id="status">server-rendered</span></span></header>
<section class="tiles">{_tiles(doc)}</section>
<section id="groups-section"><h2>KV-cache groups</h2>
<p class="muted">One pool serves every group; a block holds one group's layers. A sliding-window group releases the
blocks its window has passed (cached until evicted; the last ones of a prefix are retained). A request's hit is what
every group serves, so the hit rate above is each group's.</p>
<table><thead><tr>{''.join(f"<th>{c}</th>" for c, _ in GROUP_COLUMNS)}</tr></thead>
<tbody id="groups-body">{_kv_groups(doc['kv_groups'])}</tbody></table></section>
<section><h2>Worth enabling?</h2><p><strong id="worth-verdict">{html.escape(worth.get('verdict') or 'unknown yet')}</strong>
— <span id="worth-reason">{html.escape(worth.get('reason', ''))}</span></p></section>
<section id="tiers-section"{'' if doc['tiers'] else ' hidden'}><h2>KV tiers</h2>
<table><thead><tr>{''.join(f"<th>{c}</th>" for c, _ in TIER_COLUMNS)}</tr></thead>
<tbody id="tiers-body">{_tiers(doc['tiers'])}</tbody></table></section>
<section class="charts"><div id="chart-hits"></div><div id="chart-evictions"></div><div id="chart-blocks"></div></section>
<section><h2>Cache breakers</h2>
<p class="muted">Prompts that left a cached chain early: where (token, block), what changed, and the tokens
after it that the chain held. Keep what never changes first; move timestamps and ids to the end.
<span id="breakers-count" data-stat="breakers.count" data-fmt="int">{b['count']}</span> breakers cost
<span id="breakers-lost" data-stat="breakers.tokens_lost" data-fmt="int">{b['tokens_lost']}</span> tokens.</p>
<table><thead><tr><th>kind</th><th>token</th><th>block</th><th>count</th><th>tokens lost</th><th>example</th></tr></thead>
<tbody id="breakers-body">{_breakers(b)}</tbody></table></section>
<section><h2>Requests with no cached token</h2>
<p class="muted">Why a request was served nothing from the cache, compared with the earlier prompts of its namespace.
Latest: <strong id="zero-explanation">{html.escape(doc['zero_hits']['explanation'] or 'none yet')}</strong></p>
<table><thead><tr><th>reason</th><th>requests</th><th>prompt tokens</th><th>latest</th></tr></thead>
<tbody id="zero-body">{_zero_hits(doc['zero_hits'])}</tbody></table></section>
<section><h2>Pinned prefixes</h2>
<p class="muted">Blocks held by cache breakpoints (Anthropic's cache_control, or LLM.generate(cache_control=...)) until
their ttl passes without a hit, soonest expiry first (the first {PINS_SHOWN}):
<strong id="pins-summary">{html.escape(_pins_summary(doc['pins']))}</strong>.</p>
<table><thead><tr><th>block</th><th>depth</th><th>ttl (s)</th><th>expires in (s)</th></tr></thead>
<tbody id="pins-body">{_pins(doc['pins'])}</tbody></table></section>
<section><h2>Cached prefixes</h2><div id="prefixes">{_prefixes(doc['prefixes'])}</div></section>
<script src="/dashboard/static/uPlot.iife.min.js"></script>
<script src="/dashboard/static/dashboard.js"></script>
</body></html>"""


LOGIN_PAGE = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>prefixcache dashboard: API key</title>
<link rel="stylesheet" href="/dashboard/static/dashboard.css"></head><body>
<h1>prefixcache dashboard</h1><p>This server needs an API key.</p>
<form id="login"><input type="password" id="key" placeholder="API key" autocomplete="off">
<button type="submit">Open</button></form>
<script>
document.getElementById("login").addEventListener("submit", function (e) {{
  e.preventDefault();
  document.cookie = "{COOKIE_NAME}=" + encodeURIComponent(document.getElementById("key").value) +
    "; path=/; SameSite=Strict";
  location.reload();
}});
</script></body></html>"""


# ---------------------------------------------------------------------------- routes
def _viewer(raw_request: Request) -> str | None:
    """The viewer's tenant under tenant isolation (sees its own namespace), else None (sees all)."""
    return getattr(raw_request.state, "tenant", None) if raw_request.app.state.tenant_isolation else None


async def cache_stats(raw_request: Request) -> JSONResponse:
    return JSONResponse(await raw_request.app.state.dashboard.stats(_viewer(raw_request)))


async def dashboard(raw_request: Request) -> HTMLResponse:
    doc = await raw_request.app.state.dashboard.stats(_viewer(raw_request))
    return HTMLResponse(render_page(doc), headers={"Cache-Control": "no-store"})


async def static_file(name: str) -> Response:
    if name not in STATIC_FILES:
        raise APIError(404, f"no static file {name[:80]!r}", None, "not_found")
    return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])
