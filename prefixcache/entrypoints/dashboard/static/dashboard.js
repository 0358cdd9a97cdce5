// prefixcache dashboard: polls /v1/cache/stats and updates the server-rendered page.
// Elements with data-stat="a.b.c" and data-fmt show that field of the JSON (the same table renders them
// server-side: prefixcache/entrypoints/dashboard/routes.py STAT_FIELDS). Text from the server is only ever
// set with textContent (never parsed as HTML).
"use strict";
(function () {
  const POLL_MS = Number(document.body.dataset.pollMs || 2000);
  const charts = {};

  function get(obj, path) {
    return path.split(".").reduce((o, k) => (o == null ? null : o[k]), obj);
  }

  function fmt(value, kind) {
    if (value === null || value === undefined) return "–";
    switch (kind) {
      case "pct": return (value * 100).toFixed(1) + " %";
      case "s": return (value * 1000).toFixed(1) + " ms";
      case "bytes": return (value / 1048576).toFixed(1) + " MiB";
      default: return String(value);
    }
  }

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }

  function renderStats(doc) {
    document.querySelectorAll("[data-stat]").forEach((e) => {
      e.textContent = fmt(get(doc, e.dataset.stat), e.dataset.fmt);
    });
    const w = doc.worth || {};
    document.getElementById("worth-verdict").textContent = w.verdict || "unknown yet";
    document.getElementById("worth-reason").textContent = w.reason || "";
    document.getElementById("updated").textContent = new Date(doc.time_s * 1000).toLocaleTimeString();
  }

  function nodeLine(n) {
    const ago = n.last_use_s_ago === null ? "never" : n.last_use_s_ago.toFixed(1) + " s ago";
    return `[${n.start}, ${n.end}) ${n.tokens} tokens · hits ${n.hits} · served ${n.served_tokens} · ` +
      `last use ${ago}` + (n.blocks_in_use ? ` · ${n.blocks_in_use} blocks in use` : "");
  }

  function renderNode(n) {
    const li = el("li");
    li.appendChild(el("span", nodeLine(n), "node"));
    if (n.preview !== undefined) li.appendChild(el("code", JSON.stringify(n.preview), "preview"));
    if (n.children.length) {
      const ul = el("ul");
      n.children.forEach((c) => ul.appendChild(renderNode(c)));
      li.appendChild(ul);
    }
    return li;
  }

  function nsLabel(ns) {
    const parts = [ns.tenant === null ? "no tenant / shared" : "tenant " + ns.tenant];
    if (ns.salt) parts.push("salt#" + ns.salt);
    if (ns.adapter) parts.push("adapter#" + ns.adapter);
    return parts.join(" · ");
  }

  function renderPrefixes(groups) {
    const root = document.getElementById("prefixes");
    root.replaceChildren();
    if (!groups.length) root.appendChild(el("p", "The cache holds no prefix yet.", "muted"));
    groups.forEach((g) => {
      root.appendChild(el("h3", `${nsLabel(g.namespace)} — ${g.blocks} blocks, ${g.tokens} tokens, ` +
        `${g.served_tokens} tokens served`));
      const ul = el("ul", undefined, "tree");
      g.chains.forEach((n) => ul.appendChild(renderNode(n)));
      root.appendChild(ul);
    });
  }

  function renderBreakers(b) {
    const body = document.getElementById("breakers-body");
    body.replaceChildren();
    b.top.forEach((g) => {
      const tr = el("tr");
      [g.kind, g.position, g.block, g.count, g.tokens_lost].forEach((v) => tr.appendChild(el("td", String(v))));
      const ex = g.examples && g.examples.length ? g.examples[0] : null;
      tr.appendChild(el("td", ex ? `${JSON.stringify(ex.request)} vs ${JSON.stringify(ex.chain)}` : "(hidden)"));
      body.appendChild(tr);
    });
  }

  function renderZeroHits(z) {
    document.getElementById("zero-explanation").textContent = z.explanation || "none yet";
    const body = document.getElementById("zero-body");
    body.replaceChildren();
    Object.entries(z.by_reason).forEach(([reason, r]) => {
      const tr = el("tr");
      [reason, r.count, r.prompt_tokens, r.latest].forEach((v) => tr.appendChild(el("td", String(v))));
      body.appendChild(tr);
    });
  }

  const PINS_SHOWN = 20;  // as routes.py's PINS_SHOWN

  function renderPins(p) {
    const budget = p.budget_blocks == null ? "unknown yet" : p.budget_blocks;
    document.getElementById("pins-summary").textContent =
      p.blocks.length + " blocks pinned of a budget of " + budget;
    const body = document.getElementById("pins-body");
    body.replaceChildren();
    p.blocks.slice(0, PINS_SHOWN).forEach((b) => {
      const tr = el("tr");
      [b.block_id, b.depth, String(b.ttl_s), b.expires_in_s.toFixed(0)].forEach((v) => tr.appendChild(el("td", String(v))));
      body.appendChild(tr);
    });
  }

  const TIER_KEYS = ["queries", "hits", "bytes_loaded", "bytes_stored", "entries", "bytes", "errors"];

  function renderTiers(tiers) {
    const names = Object.keys(tiers).sort();
    document.getElementById("tiers-section").hidden = !names.length;
    const body = document.getElementById("tiers-body");
    body.replaceChildren();
    names.forEach((name) => {
      const tr = el("tr");
      tr.appendChild(el("td", name));
      TIER_KEYS.forEach((k) => tr.appendChild(el("td", k in tiers[name] ? String(tiers[name][k]) : "–")));
      body.appendChild(tr);
    });
  }

  const GROUP_KEYS = ["group_id", "label", "layers", "in_use", "cached", "cached_free", "retained"];  // routes.py GROUP_COLUMNS

  function renderGroups(groups) {
    const body = document.getElementById("groups-body");
    body.replaceChildren();
    (groups || []).forEach((g) => {
      const tr = el("tr");
      GROUP_KEYS.forEach((k) => tr.appendChild(el("td", k === "layers" ? g[k].join(" ") : String(g[k]))));
      body.appendChild(tr);
    });
  }

  function chart(id, title, labels, colors, xs, ys) {
    const target = document.getElementById(id);
    const key = labels.join("|");
    if (!charts[id] || charts[id].key !== key) {
      if (charts[id]) charts[id].plot.destroy();
      const series = [{}].concat(labels.map((l, i) => ({ label: l, stroke: colors[i % colors.length], width: 2 })));
      const opts = { title, width: Math.max(target.clientWidth, 320), height: 200, series };
      charts[id] = { key, plot: new uPlot(opts, [xs].concat(ys), target) };
    } else {
      charts[id].plot.setData([xs].concat(ys));
    }
  }

  const COLORS = ["#1f77b4", "#2ca02c", "#d62728", "#ff7f0e", "#9467bd", "#8c564b"];

  function renderCharts(history) {
    if (typeof uPlot === "undefined" || !history.length) return;
    const xs = history.map((s) => s.t);
    chart("chart-hits", "Prompt tokens per interval: queried vs hit", ["queried", "hit"], COLORS, xs,
      [history.map((s) => s.queries), history.map((s) => s.hits)]);
    const reasons = [...new Set(history.flatMap((s) => Object.keys(s.evictions_by_reason)))].sort();
    const rs = reasons.length ? reasons : ["(none)"];
    chart("chart-evictions", "Blocks evicted per interval, by reason", rs, COLORS, xs,
      rs.map((r) => history.map((s) => s.evictions_by_reason[r] || 0)));
    chart("chart-blocks", "Blocks at the end of each interval", ["in use", "cached", "free"], COLORS, xs,
      [history.map((s) => s.blocks_in_use), history.map((s) => s.blocks_cached), history.map((s) => s.blocks_free)]);
  }

  async function poll() {
    try {
      const r = await fetch("/v1/cache/stats", { credentials: "same-origin", cache: "no-store" });
      if (r.status === 401) { location.reload(); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      const doc = await r.json();
      renderStats(doc);
      renderPrefixes(doc.prefixes);
      renderBreakers(doc.breakers);
      renderZeroHits(doc.zero_hits);
      renderPins(doc.pins);
      renderTiers(doc.tiers);
      renderGroups(doc.kv_groups);
      renderCharts(doc.history);
      document.getElementById("status").textContent = !doc.tree_stale ? "live"
        : "live; a long step is running: prefixes and breakers " + (doc.tree_as_of_s == null ? "not taken yet"
          : "from " + Math.round(doc.time_s - doc.tree_as_of_s) + " s ago");
    } catch (e) {
      document.getElementById("status").textContent = "not updating: " + e.message;
    }
    setTimeout(poll, POLL_MS);
  }
  poll();
})();
