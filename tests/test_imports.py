"""The package's import graph has no cycles, lazy (function-level) imports included.

A cycle hidden inside a function still couples two modules both ways and breaks the day
someone moves the import to the top; so every ``import gridtrain...`` statement counts,
wherever it stands. Edges to a parent package's ``__init__`` (which Python imports
implicitly) are not counted; ``from gridtrain.runtime import activation_meter`` counts as
an edge to ``gridtrain.runtime.activation_meter``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    assert {"gridtrain.training.trainer", "gridtrain.training.report"} <= graph["gridtrain.training.loop"], "the graph was not read"
    assert "gridtrain.cli.commands" in graph["gridtrain.cli.parser"], "lazy imports were not read"
    assert "gridtrain.runtime.activation_meter" in graph["gridtrain.models.decoder"], "from-package imports were not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_config_imports_nothing_of_the_package():
    """Every module may import the config; so it imports none of them."""
    assert import_graph()["gridtrain.config"] == set()


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# The layering: each concern and the concerns it may import (besides itself). A concern
# is a subpackage (or a top-level module) of gridtrain; the package root's own
# ``__init__`` (lazy re-exports for users) stands above everything.
LOW = {"gridtrain.config"}
MAY_IMPORT = {
    "gridtrain.config": set(),
    "gridtrain.runtime": LOW,
    "gridtrain.data": LOW,
    "gridtrain.parallel": LOW | {"gridtrain.runtime", "gridtrain.data"},
    "gridtrain.models": LOW | {"gridtrain.runtime", "gridtrain.parallel"},
    "gridtrain.memory": LOW | {"gridtrain.runtime", "gridtrain.parallel", "gridtrain.models"},
    "gridtrain.optim": LOW | {"gridtrain.runtime", "gridtrain.parallel"},
    "gridtrain.checkpoint": LOW | {"gridtrain.runtime", "gridtrain.parallel", "gridtrain.models",
                                   "gridtrain.optim", "gridtrain.data"},
}
MAY_IMPORT["gridtrain.training"] = set(MAY_IMPORT) - {"gridtrain.training"}
MAY_IMPORT["gridtrain.dryrun"] = MAY_IMPORT["gridtrain.training"] | {"gridtrain.training"}
MAY_IMPORT["gridtrain.planner"] = MAY_IMPORT["gridtrain.training"] | {"gridtrain.training"}
MAY_IMPORT["gridtrain.cli"] = set(MAY_IMPORT) - {"gridtrain.cli"}
MAY_IMPORT["gridtrain.__main__"] = {"gridtrain.cli"}
# the self-check sits above everything and nothing imports it
MAY_IMPORT["gridtrain.selfcheck"] = set(MAY_IMPORT) - {"gridtrain.selfcheck", "gridtrain.__main__"}


def concern_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        if module == "gridtrain":
            continue
        mine = concern_of(module)
        for target in targets:
            theirs = concern_of(target)
            if theirs != mine and theirs != "gridtrain" and theirs not in MAY_IMPORT[mine]:
                bad.append(f"{module} imports {target}")
    return sorted(bad)


def test_every_module_belongs_to_a_known_concern():
    unknown = {concern_of(m) for m in import_graph()} - set(MAY_IMPORT) - {"gridtrain"}
    assert not unknown, f"give these a place in MAY_IMPORT: {sorted(unknown)}"


def test_each_concern_imports_only_the_concerns_below_it():
    """E.g. runtime/ never imports parallel/, models/ never the optimizer or the loop,
    nothing below training/ imports it, and only the CLI sits above the dry run and planner."""
    assert layering_violations(import_graph()) == []


def test_the_layering_check_finds_a_violation():
    graph = {"gridtrain.runtime.watchdog": {"gridtrain.parallel.comm"},
             "gridtrain.parallel.comm": {"gridtrain.runtime.watchdog"}}
    assert layering_violations(graph) == ["gridtrain.runtime.watchdog imports gridtrain.parallel.comm"]


# Modules that cost a worker a second or more of CPU each (or pull in large trees) and
# that only some runs use: compiling (dynamo, inductor), checkpoints (DCP), Hugging Face
# interop (transformers), metrics and pictures (tensorboard, matplotlib, jinja2).
HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.checkpoint", "transformers",
         "tensorboard", "torch.utils.tensorboard", "matplotlib", "jinja2")


@pytest.mark.spawn
def test_the_public_api_imports_from_the_package_without_torch_and_a_worker_without_heavy_modules():
    """``gridtrain.pretrain``, ``gridtrain.Datasets`` and ``gridtrain.load_model`` are the
    names users and the examples import; ``import gridtrain`` alone must not import torch.
    What a training worker imports of the package (the train command's worker, which the
    warm server preloads: gridtrain/runtime/warm.py) imports none of :data:`HEAVY`: each
    is imported where it is used. torch._dynamo is the exception the server preloads
    besides: torch imports it when the first optimizer is built, which the third line
    checks (were that to change, the preload could go). Nothing the server preloads asks
    for CUDA (the fourth line): a CUDA driver initialised before a fork is unusable in the
    forked workers, which bind their GPU themselves."""
    import subprocess
    import sys

    code = ("import sys, gridtrain; assert 'torch' not in sys.modules; "
            "from gridtrain import Datasets, load_model, pretrain; "
            "from gridtrain.data import Datasets as D; assert D is Datasets; print(pretrain.__name__); "
            "import torch; asked = []; torch.cuda.is_available = lambda: asked.append(1) or False; "
            "torch.cuda.device_count = lambda: asked.append(1) or 0; "
            "from gridtrain.runtime import warm; import importlib; "
            "[importlib.import_module(m) for m in warm.PRELOAD if m.startswith('gridtrain')]; "
            f"print([m for m in {HEAVY!r} if m in sys.modules]); "
            "torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]); "
            "print('torch._dynamo' in sys.modules, 'torch._dynamo' in warm.PRELOAD); "
            "from gridtrain.data.corpora import builtin_bytes; import gridtrain.checkpoint.dcp_io; print(len(asked))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:4] == ["pretrain", "[]", "True True", "0"], out.stdout
