"""The package's import graph has no cycles, lazy (function-level) imports included.

A cycle hidden inside a function still couples two modules both ways and breaks the day
someone moves the import to the top; so every ``import gridtrain...`` statement counts,
wherever it stands. Edges to a parent package's ``__init__`` (which Python imports
implicitly) are not counted; ``from gridtrain import memory`` counts as an edge to
``gridtrain.memory``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gridtrain

ROOT = Path(gridtrain.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            for target in targets:
                # the longest module name the target starts with: gridtrain.x.Name -> gridtrain.x
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert {"gridtrain.trainer", "gridtrain.reporting"} <= graph["gridtrain.train"], "the graph was not read"
    assert "gridtrain.run" in graph["gridtrain.cli"], "lazy imports were not read"
    assert "gridtrain.memory" in graph["gridtrain.model"], "from-package imports were not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_config_imports_nothing_of_the_package():
    """Every module may import the config; so it imports none of them."""
    assert import_graph()["gridtrain.config"] == set()


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
