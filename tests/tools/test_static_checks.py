"""pyflakes over the package, the benchmarks, the tools and the tests: no undefined name (a NameError waiting in a
rarely taken branch), no unused import or variable, no unreachable leftovers it can see."""

from __future__ import annotations

from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class _Collect(Reporter):
    def __init__(self):
        self.lines: list[str] = []

    def unexpectedError(self, filename, msg):
        self.lines.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.lines.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        self.lines.append(str(message))


@pytest.mark.parametrize("tree", ["prefixcache", "benchmarks", "tools", "tests"])
def test_pyflakes_finds_nothing(tree):
    reporter = _Collect()
    pyflakes_api.checkRecursive([str(ROOT / tree)], reporter)
    assert [line.replace(str(ROOT) + "/", "") for line in reporter.lines] == []
