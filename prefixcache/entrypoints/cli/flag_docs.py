"""Markdown tables of every ``prefixcache`` subcommand's flags, generated from the argparse parsers
themselves (as llama.cpp's server README regenerates its tables from the program's own help), so the
docs can't drift from the flags.

A table lives in a page under ``docs/`` between two markers naming the subcommand::

    <!-- flags:serve:begin -->
    ... generated ...
    <!-- flags:serve:end -->

``python -m prefixcache.entrypoints.cli.flag_docs`` rewrites every such table under ``docs/``;
``--check`` only reports the stale ones (exit 1), which is what ``tests/docs/test_flag_tables.py``
runs. A table has one row per flag, grouped by the parser's argument groups: the flag (with its
``--no-`` form or value name), its default, its choices and its help text. Defaults that depend on
the machine (free cores, a CUDA device) are written as the help text describes them, never as the
value this machine computed.

``cluster`` takes every ``serve`` flag; its table lists only the flags of its own.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from prefixcache.entrypoints.cli.main import build_parser

SUBCOMMANDS = ("demo", "fetch", "serve", "cluster", "bench", "analyze")
MARKER = re.compile(r"(<!-- flags:(?P<name>[\w-]+):begin -->\n)(?P<body>.*?)(<!-- flags:(?P=name):end -->)", re.S)
_DEFAULT_NOTE = re.compile(r"\s*\(default:?\s*(?P<text>[^()]*(?:\([^()]*\)[^()]*)*)\)\s*$")
_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
DOCS_DIR = Path(__file__).resolve().parents[3] / "docs"


def _parser(command: str) -> argparse.ArgumentParser:
    _, parsers, _ = build_parser(command)
    return parsers[command]


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}` (positional)"
    if isinstance(action, argparse.BooleanOptionalAction):
        return " / ".join(f"`{s}`" for s in action.option_strings)
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{flags}`"
    metavar = action.metavar  # argparse's default (the dest in capitals) repeats the flag: left out
    suffix = f" {metavar}" if metavar else ""
    if action.nargs in ("*", "+"):
        suffix = f" {metavar} ..." if metavar else " ..."
    return f"`{flags}{suffix}`"


def _default_cell(action: argparse.Action) -> str:
    """The default: the value, or what the help text says it is when the value is None (computed at
    run time: ``--num-threads``' free cores, ``--device``'s CUDA if present)."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or default == [] or (action.nargs == 0 and default is False):
        note = _DEFAULT_NOTE.search(" ".join((action.help or "").split()))
        text = note.group("text").strip() if note and action.nargs != 0 else ""
        return "" if text == "None" else text.replace("|", "\\|")
    if isinstance(default, bool):
        return "on" if default else "off"
    if getattr(action.type, "__name__", "") == "memory_bytes" and isinstance(default, int):
        for unit, size in _BINARY_UNITS:
            if default % size == 0:
                return f"`{default // size}{unit}`"
    return f"`{default}`"


def _help_cell(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:  # argparse formats every help text: %(default)s and friends, and %% for a percent sign
        params = dict(vars(action), prog="prefixcache")
        params = {k: (v.__name__ if hasattr(v, "__name__") else v) for k, v in params.items()}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        text = text % params
    text = _DEFAULT_NOTE.sub("", " ".join(text.split()))  # the default has its own column
    return text.replace("|", "\\|")


def _skip(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._HelpAction, argparse._VersionAction))


def flag_table(command: str) -> str:
    """The Markdown table of ``prefixcache COMMAND``'s flags, one section per argument group."""
    parser = _parser(command)
    skip_dests = set()
    if command == "cluster":  # every serve flag is given to each replica: documented with serve
        skip_dests = {a.dest for a in _parser("serve")._actions} - {"help"}
    lines: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not _skip(a) and a.dest not in skip_dests]
        if not actions:
            continue
        title = group.title or ""
        if title in ("positional arguments", "options", "optional arguments"):
            title = ""
        if title:
            lines += ["", f"**{title}**", ""] if lines else [f"**{title}**", ""]
        elif lines:
            lines.append("")
        lines += ["| flag | default | choices | meaning |", "|---|---|---|---|"]
        for a in actions:
            choices = ", ".join(f"`{c}`" for c in a.choices) if a.choices else ""
            lines.append(f"| {_flag_cell(a)} | {_default_cell(a)} | {choices} | {_help_cell(a)} |")
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    """``text`` with every flag table between markers regenerated.

    Raises:
        ValueError: a marker naming a subcommand that does not exist.
    """
    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in SUBCOMMANDS:
            raise ValueError(f"<!-- flags:{name}:begin -->: no subcommand {name!r} (one of {', '.join(SUBCOMMANDS)})")
        return f"{m.group(1)}{flag_table(name)}{m.group(4)}"

    return MARKER.sub(replace, text)


def stale_pages(docs_dir: Path = DOCS_DIR, write: bool = False) -> list[Path]:
    """The pages under ``docs_dir`` whose flag tables differ from the parsers' (rewritten when
    ``write``)."""
    stale = []
    for page in sorted(docs_dir.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        if "<!-- flags:" not in text:
            continue
        new = render(text)
        if new != text:
            stale.append(page)
            if write:
                page.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    """Rewrites the stale tables (``--check``: only lists them); returns 1 if ``--check`` found any."""
    p = argparse.ArgumentParser(prog="python -m prefixcache.entrypoints.cli.flag_docs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="list stale tables, change nothing (exit 1 if any)")
    p.add_argument("--docs", default=str(DOCS_DIR), help="the docs folder (default: the repository's)")
    args = p.parse_args(argv)
    stale = stale_pages(Path(args.docs), write=not args.check)
    for page in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {page}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
