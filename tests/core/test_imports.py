"""No import cycles in src/kvcomm, lazy imports included.

Every module is parsed (not imported); every ``import`` and ``from ... import`` counts,
at module level or inside a function, except under ``if TYPE_CHECKING:`` (never run).
``from P import name`` depends on ``P`` (a package: its ``__init__``), or, when ``P.name``
is a module, on that module alone (``import P.name`` then a look-up: it works while ``P``
is still being made); ``import a.b`` depends on ``a.b``. Being inside a package is no
import of it (Python imports the packages above a module first, whatever it says). A
cycle means some import order finds a module half made, and that two pieces that should
be one layer apart are not.
"""

from __future__ import annotations

import ast
import itertools
import pathlib

import kvcomm

SRC = pathlib.Path(kvcomm.__file__).parent

# (importer, imported): edges allowed for now, each with why and what removes it
KNOWN: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, kvcomm's only."""
    modules = _modules()

    def known(name: str) -> str | None:  # the module a dotted name lands in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = _type_checking_only(tree)
        deps: dict[str, int] = {}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules
                           else source for a in node.names]
            for target in targets:
                dep = known(target)
                if dep is not None and dep != name:
                    deps.setdefault(dep, node.lineno)
        graph[name] = deps
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component
    of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return [_a_cycle(graph, c) for c in components]


def _a_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w in component and w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return "\n".join(f"  {a} -> {b} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle))


def test_no_import_cycles() -> None:
    graph = import_graph()
    for importer, imported in KNOWN:  # (an edge already gone: its entry is stale, drop it)
        graph[importer].pop(imported, None)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n\n".join(_describe(graph, c) for c in cycles)


def test_the_checker_sees_lazy_imports_and_relative_ones() -> None:
    """The checker finds a cycle made of a module-level import one way and a lazy,
    relative one the other, and skips what only type checkers read."""
    graph = import_graph()
    # a lazy import inside a function (base.py opens the strong-key store on demand)
    assert "kvcomm._client.strong" in graph["kvcomm._client.base"]
    # a TYPE_CHECKING-only import is no edge (kvcomm's own __init__ names the client so)
    assert "kvcomm._client" not in graph["kvcomm"]
    made_up = {"p": {"p.a": 1}, "p.a": {"p.b": 3}, "p.b": {"p.a": 9}, "q": {}}
    assert find_cycles(made_up) == [["p.a", "p.b", "p.a"]]
    assert _describe(made_up, ["p.a", "p.b", "p.a"]) == \
        "  p.a -> p.b (line 3)\n  p.b -> p.a (line 9)"
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
