"""Comments and docstrings in ``prefixcache/`` say why the code is as it is, not when or by whom it
was found: dates, commit ids, work-session numbers, review notes, issue numbers of a tracker that is
not in the repository and paths outside it go stale and belong in the commit message; measured
numbers belong in docs/benchmarks.md. Only comments and docstrings are read (``tokenize`` and
``ast``), so hash constants and example data in code are never flagged; C++ sources under
``kernels/csrc`` are read for their ``//`` and ``/* */`` comments.

A comment that points at the documentation names a page under ``docs/`` that exists, not a README
section (the README is a front door; its sections move).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prefixcache"

_ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
             "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth").split()
RULES: dict[str, re.Pattern[str]] = {
    "ISO date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "commit id": re.compile(r"\bcommits?\s+(?:[0-9a-f]{7,40}\b)|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
                            r"(?=\s*(?:\)|,|;|:|$|\s+(?:and|or|to|vs|before|after)\b))"),
    "work-session number": re.compile(
        r"\bsession\s+\d+\b|\b(?:twenty-)?(?:" + "|".join(_ORDINALS) + r"|\d+(?:st|nd|rd|th))\s+session\b"
        r"|\b(?:this|last|previous|next|that) session(?:'s)?\s+(?:machine|run|runs|commit|measurement)", re.I),
    "review note": re.compile(r"found in review|\(review[:,]|\breview,\s*20\d\d|\breviewer(?:'s)?\b", re.I),
    "tracker issue number": re.compile(r"\bissues?\s+#?\d+\b|(?<![\w/&])#\d+\b", re.I),
    "path outside the repository": re.compile(r"\.\./shared\b|(?<![\w.])/work/|\.\./\.\./"),
    "README section reference": re.compile(r"README(?:'s)?\s*(?:section\s*)?[\"'“(]|README\s+section", re.I),
}
# A bare hex token counts as a commit id only where it stands alone after words like these; anything
# else needs the word "commit" before it (example hashes in docstrings are data, not provenance).
_BARE_HEX = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
# A repository path a comment names (a docs page, a script, a test) must exist: moved files leave no
# dangling pointers.
_REPO_PATH = re.compile(r"(?<![\w./-])((?:docs|scripts|tools|benchmarks|tests)/[\w./-]*\w)")
# Example data: a cache-breaker example needs a timestamp.
EXAMPLE_DATA = {"prefixcache/cache/breakers.py": {"2026-11-30", "2026-12-01"}}


def _python_texts(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line, kind, text)`` of every comment and docstring of a Python file."""
    source = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], "comment", tok.string.lstrip("#")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                for offset, line in enumerate(body[0].value.value.splitlines()):
                    yield body[0].lineno + offset, "docstring", line


_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _c_texts(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line, "comment", text)`` of every ``//`` and ``/* */`` comment of a C or C++ file (string
    literals holding ``//`` are not expected in these sources)."""
    source = path.read_text(encoding="utf-8")
    for m in _C_COMMENT.finditer(source):
        first = source.count("\n", 0, m.start()) + 1
        for offset, line in enumerate(m.group().splitlines()):
            yield first + offset, "comment", line


def _texts() -> Iterator[tuple[Path, int, str, str]]:
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix == ".py":
            reader = _python_texts
        elif path.suffix in (".c", ".cpp", ".h"):
            reader = _c_texts
        else:
            continue
        for line, kind, text in reader(path):
            yield path, line, kind, text


def find_offences() -> list[str]:
    """One ``path:line: rule: text`` per offending comment or docstring line."""
    found = []
    for path, line, kind, text in _texts():
        rel = str(path.relative_to(ROOT))
        where = f"{rel}:{line}"
        for rule, pattern in RULES.items():
            if rule == "commit id":
                hit = re.search(r"\bcommits?\s+[0-9a-f]{7,40}\b", text) or (
                    kind == "comment" and _BARE_HEX.search(text))
            else:
                hit = pattern.search(text)
            if hit and hit.group() not in EXAMPLE_DATA.get(rel, ()):
                found.append(f"{where}: {rule}: {hit.group()!r} in {text.strip()[:100]!r}")
        for named in _REPO_PATH.findall(text):
            if "*" not in named and not (ROOT / named).exists():
                found.append(f"{where}: names {named}, which does not exist")
    return found


def test_the_scan_reads_comments_and_docstrings_only(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""Module, 2026-12-01."""\nX = "2026-12-01"  # commit 1a2b3c4d\n'
                   'def f():\n    """Since session 12."""\n    return 0xdeadbeef1\n')
    texts = [(kind, text) for _, kind, text in _python_texts(src)]
    assert texts == [("comment", " commit 1a2b3c4d"), ("docstring", "Module, 2026-12-01."),
                     ("docstring", "Since session 12.")]


@pytest.mark.parametrize("text, rule", [
    ("measured 2026-12-02 on the AMD machine", "ISO date"),
    ("the eleventh session's kernel", "work-session number"),
    ("session 12 moved it", "work-session number"),
    ("(review: a dict key was taken for a union member)", "review note"),
    ("found in review", "review note"),
    ("see issue 12's targets", "tracker issue number"),
    ("as #41 asked", "tracker issue number"),
    ("python3 ../shared/tools/layering.py", "path outside the repository"),
    ("see the README's \"Limits\"", "README section reference"),
])
def test_each_rule_catches_its_example(text, rule):
    assert RULES[rule].search(text)


@pytest.mark.parametrize("text", [
    "a chat session's turns share the prefix", "vLLM's issue tracker: vllm-project/vllm#8268",
    "xxh64 of the parent hash", "see docs/serving.md",
])
def test_ordinary_words_pass(text):
    flagged = [rule for rule, pattern in RULES.items()
               if rule not in ("ISO date", "commit id") and pattern.search(text)]
    assert flagged == []


def test_package_comments_and_docstrings_carry_no_dates_ids_sessions_or_outside_paths():
    offences = find_offences()
    assert offences == [], (
        f"{len(offences)} comment or docstring line(s) say when, by whom or where outside the repository "
        "something happened; say why instead (dates and commit ids go in the commit message, numbers in "
        "docs/benchmarks.md):\n" + "\n".join(offences))
