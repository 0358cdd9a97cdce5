"""No import cycle inside ``prefixcache/``: every import counts, those under ``if TYPE_CHECKING:`` and
those inside functions included, since a cycle that only a deferred or type-only import hides is
still two modules that each need the other. The graph is read from the source with :mod:`ast`, so
nothing is imported; a cycle is reported as its modules with the line of each import that closes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "prefixcache"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement may bind: for ``from a import b``, ``a.b`` (a submodule) and ``a``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(package_dir: Path) -> dict[str, dict[str, int]]:
    """``module -> {imported module -> line of its first import}`` over the package's own modules."""
    files = {_module_name(p): p for p in sorted(package_dir.rglob("*.py"))}

    def owner(name: str) -> str | None:  # the package module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges = graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = _imported_names(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):  # `from a import b`: a's submodule b if it is one, else a
                submodules = [n for n in names[:-1] if n in files]
                names = submodules + ([names[-1]] if len(submodules) < len(node.names) else [])
            for name in names:
                target = owner(name) if name.split(".")[0] == PACKAGE else None
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """A shortest cycle ``[a, b, ..., a]`` per strongly connected component, from its first module."""
    return [_cycle_through(graph, min(c), c) for c in strongly_connected(graph)]


def _cycle_through(graph: dict[str, dict[str, int]], start: str, component: set[str]) -> list[str]:
    """A shortest path ``start -> ... -> start`` inside the component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in component:
                    continue
                if w == start:  # v closes the cycle: walk back from v to start
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component of > 1 module always has one


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_graph_counts_type_only_and_function_local_imports():
    graph = import_graph(ROOT / PACKAGE)
    assert "prefixcache.cache.hashing" in graph["prefixcache.request"]  # under `if TYPE_CHECKING:`
    assert "prefixcache.bench.runner" in graph["prefixcache.bench.cli"]  # inside run_cli


def test_find_cycles_reports_each_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}, "e": {"f": 5}, "f": {"e": 6}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]


def test_no_import_cycles():
    graph = import_graph(ROOT / PACKAGE)
    found = [f"{_describe(graph, _cycle_through(graph, min(c), c))}; all tied together: {sorted(c)}"
             for c in strongly_connected(graph)]
    assert found == []
