"""The flag tables in docs/ are generated from the argparse parsers
(:mod:`prefixcache.entrypoints.cli.flag_docs`); this fails when a committed table differs from what the
parsers give today, and says which command rewrites it."""

from __future__ import annotations

from pathlib import Path

from prefixcache.entrypoints.cli.flag_docs import SUBCOMMANDS, flag_table, render, stale_pages

DOCS = Path(__file__).resolve().parents[2] / "docs"
REGENERATE = ".venv/bin/python -m prefixcache.entrypoints.cli.flag_docs"


def test_committed_flag_tables_match_the_parsers():
    stale = [str(p.relative_to(DOCS.parent)) for p in stale_pages(DOCS)]
    assert stale == [], f"stale flag tables in {', '.join(stale)}: run `{REGENERATE}` and commit the result"


def test_every_subcommand_has_a_table_in_the_docs():
    text = "".join(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))
    assert [c for c in SUBCOMMANDS if f"<!-- flags:{c}:begin -->" not in text] == []


def test_a_table_lists_every_flag_with_its_default_and_choices():
    table = flag_table("serve")
    assert "| `--port` | `8000` |  | TCP port, 0-65535 |" in table
    assert "| `--eviction-policy` | `lru` |" in table and "`lfu`" in table
    assert "`--enable-prefix-caching` / `--no-enable-prefix-caching` | on |" in table
    assert "| `--kv-cache-memory BYTES` | 1GiB |" in table  # the default the help text states
    assert "--help" not in table


def test_render_replaces_only_between_markers():
    page = "before\n<!-- flags:analyze:begin -->\nold\n<!-- flags:analyze:end -->\nafter\n"
    out = render(page)
    assert out.startswith("before\n<!-- flags:analyze:begin -->\n| flag |")
    assert out.endswith("<!-- flags:analyze:end -->\nafter\n") and "old" not in out
    assert render(out) == out
