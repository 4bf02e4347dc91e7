"""The house: varlen_cli's import graph has no cycles and the shared layer imports no stage.

The graph is read from the source (``ast``), so it counts every import: module level, inside
functions, under ``if TYPE_CHECKING:``, relative and absolute. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
import os
from functools import cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "varlen_cli"

# The stages. Everything else is the shared layer (varlen_cli.runtime and the top-level modules:
# errors, format, storage, budget, ...), which may import only itself, never a stage.
STAGE_PACKAGES = ("analyze", "sort", "plan", "loader", "memory", "schedule", "integrations", "cli", "online")
STAGE_MODULES = ("inspect", "validate", "plan_checks", "run", "__main__")  # plan_checks: validate's checks



def _is_shared(module: str) -> bool:
    parts = module.split(".")
    return len(parts) == 1 or parts[1] not in STAGE_PACKAGES + STAGE_MODULES


@cache
def modules() -> dict[str, str]:
    """{module name: path} of every module of the package."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    mods = modules()
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module if mods[module].endswith("__init__.py") else module.rpartition(".")[0]
    if node.level:
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = base + ("." + node.module if node.module else "")
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def imports_in(module: str, source: str) -> frozenset[str]:
    """The package's modules that ``source`` (the text of ``module``) imports anywhere."""
    mods = modules()
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(module, node):
                while target.startswith(PACKAGE) and target not in mods:  # pkg.mod.attr -> pkg.mod
                    target = target.rpartition(".")[0]
                if target in mods and target != module:
                    found.add(target)
    return frozenset(found)


@cache
def graph() -> dict[str, frozenset[str]]:
    """{module: the package's modules it imports anywhere in its source}."""
    edges = {}
    for module, path in modules().items():
        with open(path, encoding="utf-8") as f:
            edges[module] = imports_in(module, f.read())
    return edges


def cycles(edges: dict[str, frozenset[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
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
                        out.append(frozenset(component))
    return out


def test_the_graph_counts_every_kind_of_import():
    edges = graph()
    assert "varlen_cli.plan.heap" in edges["varlen_cli.cli.plan"]  # inside a function, absolute
    assert "varlen_cli.runtime.safety" in edges["varlen_cli.runtime.dist"]  # inside a function, relative
    assert "varlen_cli.errors" in edges["varlen_cli.runtime.dist"]  # module level, `from ..errors import`
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .config import PlanConfig\n"
              "from . import writer\nimport varlen_cli.format\n")
    assert imports_in("varlen_cli.plan.core", source) == {
        "varlen_cli.plan.config", "varlen_cli.plan.writer", "varlen_cli.format"}  # typing-only imports count too


def test_cycle_finder_finds_cycles():
    edges = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"}),
             "e": frozenset({"f"}), "f": frozenset({"e"})}
    assert sorted(map(sorted, cycles(edges))) == [["a", "b", "c"], ["e", "f"]]


def test_no_import_cycles():
    found = [sorted(c) for c in cycles(graph())]
    assert found == [], f"import cycles: {found}"


def test_the_shared_layer_imports_no_stage():
    upward = sorted((m, t) for m, targets in graph().items() if _is_shared(m)
                    for t in targets if not _is_shared(t))
    assert upward == [], f"imports from the shared layer up into a stage: {upward}"
