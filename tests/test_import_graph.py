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

# The shared layer: it may import only itself (never a stage package: analyze, sort, plan, loader,
# memory, schedule, integrations, cli, or the stage modules inspect, validate, run). varlen_cli.storage
# (where files live: local paths and object storage) is part of it.
SHARED_PREFIXES = ("varlen_cli.runtime",)
SHARED_MODULES = {"varlen_cli", "varlen_cli.errors", "varlen_cli.format", "varlen_cli.storage"}

# Cycles being removed on other branches (i23plan: the plan config in a leaf module; i21: loader).
# The lead empties this set when merging them; any other cycle fails now.
KNOWN_CYCLES_ELSEWHERE = {
    frozenset({"varlen_cli.plan.core", "varlen_cli.plan.cost_model", "varlen_cli.plan.extend",
               "varlen_cli.plan.mixture", "varlen_cli.plan.orders", "varlen_cli.plan.replan"}),
    frozenset({"varlen_cli.loader.guard", "varlen_cli.loader.plan_file"}),
    frozenset({"varlen_cli.loader.collate", "varlen_cli.loader.model_inputs", "varlen_cli.loader.packed"}),
}


def _is_shared(module: str) -> bool:
    return module in SHARED_MODULES or module.startswith(tuple(p + "." for p in SHARED_PREFIXES)) \
        or module in SHARED_PREFIXES


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


@cache
def graph() -> dict[str, frozenset[str]]:
    """{module: the package's modules it imports anywhere in its source}."""
    mods = modules()
    edges = {}
    for module, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, node):
                    while target.startswith(PACKAGE) and target not in mods:  # pkg.mod.attr -> pkg.mod
                        target = target.rpartition(".")[0]
                    if target in mods and target != module:
                        found.add(target)
        edges[module] = frozenset(found)
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
    assert "varlen_cli.plan.core" in edges["varlen_cli.plan.cost_model"]  # under TYPE_CHECKING


def test_cycle_finder_finds_cycles():
    edges = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"}),
             "e": frozenset({"f"}), "f": frozenset({"e"})}
    assert sorted(map(sorted, cycles(edges))) == [["a", "b", "c"], ["e", "f"]]


def test_no_import_cycles():
    unexpected = [sorted(c) for c in cycles(graph())
                  if not any(c <= known for known in KNOWN_CYCLES_ELSEWHERE)]
    assert unexpected == [], f"import cycles: {unexpected}"


def test_the_shared_layer_imports_no_stage():
    upward = sorted((m, t) for m, targets in graph().items() if _is_shared(m)
                    for t in targets if not _is_shared(t))
    assert upward == [], f"imports from the shared layer up into a stage: {upward}"
