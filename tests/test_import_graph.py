"""The house: varlen_cli's import graph has no cycles and no arrow back up its floors; few top-level
modules; no private name imported across modules; no function over 80 lines.

The graph is read from the source (``ast``), so it counts every import: module level, inside
functions, under ``if TYPE_CHECKING:``, relative and absolute. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
import os
import re
from functools import cache

from tests.doc_cites import PACKAGE, ROOT, modules  # {module name: path} of every module of the package

# The floors, lowest first. A module's floor is that of its top-level module or package under
# varlen_cli ("": the package's own __init__); it imports only from its own floor or below. A new
# top-level module or package needs a floor here.
FLOORS = (
    ("", "errors"),  # the package root (__version__) and the error types
    ("storage",),  # where files live: local paths and object storage, regular-file reads
    ("format", "budget"),  # the artifacts' formats, the one budget (cost model)
    ("runtime",),  # the shared runtime: workers, artifacts, output safety, progress
    ("memory", "schedule"),  # the models the planner and the checks consult
    ("checks",),  # a plan's invariants: what validate and the planner's own check run
    ("analyze", "sort", "plan", "loader", "inspect", "validate", "report", "export"),  # the stages
    ("integrations", "online"),  # the frameworks' adapters over the loader; the in-process step planner
    ("run", "cli", "__main__"),  # the pipeline and the command line
)
MAX_TOP_LEVEL = 8  # top-level modules in varlen_cli/, __init__ and __main__ not counted
MAX_FUNCTION_LINES = 80

# Exceptions, each with its reason; each entry must still occur (remove it with the code).
ALLOWED_PRIVATE_IMPORTS: set = set()
ALLOWED_LONG_FUNCTIONS: set = set()



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


def imports_in(module: str, source: str | ast.Module) -> frozenset[str]:
    """The package's modules that ``source`` (the text of ``module``, or its tree) imports anywhere."""
    mods = modules()
    found = set()
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
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
    return {module: found[0] for module, found in findings().items()}


@cache
def findings() -> dict[str, tuple[frozenset, set, list]]:
    """{module: (the package's modules it imports, its private imports, its long functions)}: each
    file parsed once, its tree dropped (trees held alive make every garbage collection slower)."""
    out = {}
    for module, path in modules().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        out[module] = (imports_in(module, tree), private_imports(module, tree), long_functions(module, tree))
    return out


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


def floor_of(module: str) -> int | None:
    """The floor (index into FLOORS) of a module of the package, None for one no floor names."""
    top = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(FLOORS) if top in names), None)


def arrows_up(edges: dict[str, frozenset[str]]) -> list[tuple[str, str]]:
    """The imports from a module to one on a higher floor (or where either has no floor)."""
    up = []
    for module, targets in edges.items():
        for target in targets:
            low, high = floor_of(module), floor_of(target)
            if low is None or high is None or high > low:
                up.append((module, target))
    return sorted(up)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_imports(module: str, source: str | ast.Module) -> set[tuple[str, str, str]]:
    """(module, the package's module, private name) for each private name ``source`` takes from another
    module of the package: ``from .x import _name``, or ``x._name`` on a module it imported."""
    mods, found, bound = modules(), set(), {}
    tree = ast.parse(source) if isinstance(source, str) else source
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _targets(module, ast.ImportFrom(module=node.module, names=[ast.alias("*")], level=node.level))[0]
            for alias, target in zip(node.names, _targets(module, node)):
                if target in mods and target.endswith("." + alias.name):
                    bound[alias.asname or alias.name] = target
                elif base.startswith(PACKAGE) and _private(alias.name):
                    found.add((module, base, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + ".") or alias.name == PACKAGE:
                    bound[alias.asname] = alias.name if alias.asname else None
                    bound.setdefault(PACKAGE, PACKAGE)
    bound = {k: v for k, v in bound.items() if k and v}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _dotted(node.value)
            if owner is not None:
                first, _, rest = owner.partition(".")
                target = bound.get(first, "") + ("." + rest if rest and first in bound else "")
                if target in mods and target != module:
                    found.add((module, target, node.attr))
    return found


def long_functions(module: str, source: str | ast.Module,
                   limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, str, int]]:
    """(module, qualified name, lines) of each function longer than ``limit`` lines (``def`` to its end)."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > limit:
                    out.append((module, name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source) if isinstance(source, str) else source, "")
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


def test_the_checkers_find_what_they_look_for():
    edges = {"varlen_cli.storage": frozenset({"varlen_cli.runtime.files"}),  # up: storage < runtime
             "varlen_cli.cli.plan": frozenset({"varlen_cli.plan.core", "varlen_cli.cli.common"}),
             "varlen_cli.plan.core": frozenset({"varlen_cli.validate", "varlen_cli.errors"}),  # sideways, down
             "varlen_cli.newstage": frozenset({"varlen_cli.errors"})}  # a module no floor names
    assert arrows_up(edges) == [("varlen_cli.newstage", "varlen_cli.errors"),
                                ("varlen_cli.storage", "varlen_cli.runtime.files")]
    source = ("from ..checks.scan import _flat, windows\nfrom .. import format\nfrom . import writer\n"
              "import varlen_cli.budget\nfrom torch import _dynamo\nfrom .. import __version__\n"
              "def f():\n    return writer._hidden(format._x, varlen_cli.budget._y, _flat, _dynamo)\n")
    assert private_imports("varlen_cli.plan.core", source) == {
        ("varlen_cli.plan.core", "varlen_cli.checks.scan", "_flat"),
        ("varlen_cli.plan.core", "varlen_cli.plan.writer", "_hidden"),
        ("varlen_cli.plan.core", "varlen_cli.format", "_x"),
        ("varlen_cli.plan.core", "varlen_cli.budget", "_y")}  # not torch's, not __version__
    body = "\n".join(f"    x = {i}" for i in range(79))
    method = "\n".join(f"        x = {i}" for i in range(79))
    source = f"def fits():\n{body}\n\nclass C:\n    def too_long(self):\n{method}\n        return x\n"
    assert long_functions("m", source) == [("m", "C.too_long", 81)]


def test_no_arrow_back_up_the_floors():
    up = arrows_up(graph())
    assert up == [], f"imports from a floor up to a higher one (or from/to a module with no floor): {up}"


def test_few_top_level_modules():
    top = sorted(m for m, path in modules().items() if m.count(".") == 1 and not path.endswith("__init__.py")
                 and m.rpartition(".")[2] != "__main__")
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} top-level modules in varlen_cli/ (at most {MAX_TOP_LEVEL}): {top}"


def test_no_private_name_imported_across_modules():
    found = set().union(*(f[1] for f in findings().values()))
    assert sorted(found - ALLOWED_PRIVATE_IMPORTS) == [], "private names imported across modules"
    assert sorted(ALLOWED_PRIVATE_IMPORTS - found) == [], "allowed but gone: remove from ALLOWED_PRIVATE_IMPORTS"


def test_no_function_over_80_lines():
    found = [f for found in findings().values() for f in found[2]]
    over = sorted(f for f in found if f[:2] not in ALLOWED_LONG_FUNCTIONS)
    assert over == [], f"functions over {MAX_FUNCTION_LINES} lines: {over}"
    gone = ALLOWED_LONG_FUNCTIONS - {f[:2] for f in found}
    assert not gone, f"allowed but gone (or short now): remove from ALLOWED_LONG_FUNCTIONS: {sorted(gone)}"


def test_benchmarks_import_no_tests():
    """A benchmark reproduces its numbers from benchmarks/ and the package alone: no import of a test
    module (``tests.x``, or a helper of tests/ reached through sys.path), no ``tests.x:NAME`` spec."""
    helpers = {name[:-3] for name in os.listdir(os.path.join(ROOT, "tests")) if name.endswith(".py")} | {"tests"}
    found = []
    for name in sorted(os.listdir(os.path.join(ROOT, "benchmarks"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "benchmarks", name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(name, a.name) for a in node.names if a.name.split(".")[0] in helpers]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in helpers:
                found.append((name, node.module))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value == "tests" or re.fullmatch(r"tests\.[\w.]+:\w+", node.value)):
                found.append((name, node.value))
    assert found == [], f"benchmarks that import from tests/: {found}"
