"""No import cycles inside varlen_cli.loader, counting imports inside functions (issue 23: collate /
model_inputs / packed, and guard / plan_file, were cycles)."""

import ast
import os

from tests.loader_helpers import ROOT

PACKAGE = "varlen_cli.loader"
FOLDER = os.path.join(ROOT, *PACKAGE.split("."))


def _modules() -> dict[str, str]:
    return {(PACKAGE if f == "__init__.py" else f"{PACKAGE}.{f[:-3]}"): os.path.join(FOLDER, f)
            for f in sorted(os.listdir(FOLDER)) if f.endswith(".py")}


def _imports(name: str, path: str, modules) -> set[str]:
    """The loader modules ``name`` imports anywhere in its file (functions included)."""
    package = PACKAGE if name != PACKAGE else PACKAGE
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target in modules:
                out.add(target)
            for alias in node.names:  # `from . import collate` names a module
                if f"{target}.{alias.name}" in modules:
                    out.add(f"{target}.{alias.name}")
    out.discard(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_loader_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph[f"{PACKAGE}.collate"] and f"{PACKAGE}.batch" in graph[f"{PACKAGE}.collate"]  # the scan sees imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_scan_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
