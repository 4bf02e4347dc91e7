"""The names docstrings and docs cite, and whether each exists: read from the source (``ast``), nothing
imported, so a cite of a module that needs torch or a framework costs nothing.

A cite is
* in a docstring of ``varlen_cli``: a Sphinx role (``:mod:``, ``:func:``, ``:class:``, ``:meth:``,
  ``:data:``, ``:attr:``, ``:exc:``) naming ``varlen_cli.x.y``, ``.y`` (the citing module, then its
  package), a name of the citing class or module, or a dotted name whose first part is a module the
  citing module imports or a module of its package or one above (``core.finish`` in
  ``plan/chunked/finish.py``: ``varlen_cli.plan.core.finish``); and a ``literal`` of such a dotted
  name whose first part is ``varlen_cli`` or one of those modules;
* in README.md and docs/*.md: a `span` naming ``varlen_cli.x.y`` or a path ``varlen_cli/x/y.py``, and
  ``Class.attr`` for a class of the package that a doc names so.

It exists when the module's file does and every further part is bound there: a function, class or
assignment at module level, an import, a class's method, attribute, dataclass field or ``self.x``;
past a plain value (a constant, an instance), or a class with a base from outside the package,
anything goes.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from dataclasses import dataclass, field
from functools import cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "varlen_cli"
ROLES = ("mod", "func", "class", "meth", "data", "attr", "exc")
ROLE = re.compile(r":(?:py:)?(" + "|".join(ROLES) + r"):`[~!]?([^`<>]+?)`")
LITERAL = re.compile(r"``([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``")
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
ANY = "any"  # past this, any attribute is accepted


@dataclass
class Klass:
    members: dict = field(default_factory=dict)  # name -> binding
    open: bool = False  # a base from outside the package (or not found): members unknown


@cache
def modules() -> dict[str, str]:
    """{dotted module name: path} of the package (``varlen_cli.x.y``; packages by their __init__)."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out[os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")] = path
    return out


@cache
def tree(module: str) -> ast.Module:
    with open(modules()[module], encoding="utf-8") as f:
        return ast.parse(f.read())


def _import_base(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module if modules()[module].endswith("__init__.py") else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return base + ("." + node.module if node.module else "")


def _bind_import(module: str, node, names: dict) -> None:
    mods = modules()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                names[alias.asname] = ("module", alias.name) if alias.name in mods else (ANY, None)
            else:
                top = alias.name.split(".")[0]
                names[top] = ("module", top) if top in mods else (ANY, None)
        return
    base = _import_base(module, node)
    for alias in node.names:
        target = f"{base}.{alias.name}"
        names[alias.asname or alias.name] = (("module", target) if target in mods else
                                             ("from", (base, alias.name)) if base in mods else (ANY, None))


def _class(module: str, node: ast.ClassDef) -> Klass:
    k = Klass()
    for base in node.bases:
        name = ast.unparse(base)
        found = resolve_in(module, name.split("."))
        if found is None or found[0] != "class":
            k.open = True
        else:
            k.members.update(found[1].members)
            k.open |= found[1].open
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            k.members[item.name] = (ANY, None)
        elif isinstance(item, ast.ClassDef):
            k.members[item.name] = ("class", _class(module, item))
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        k.members[n.id] = (ANY, None)
    for n in ast.walk(node):  # self.x = ... anywhere in its methods
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and \
                isinstance(n.ctx, ast.Store):
            k.members.setdefault(n.attr, (ANY, None))
    return k


@cache
def names_of(module: str, local: bool = False) -> dict:
    """{name: binding} bound at the top of ``module`` (including under ``if``/``try``): its attributes;
    ``local``: also the imports inside its functions (names its own docstrings may cite)."""
    names: dict = {}
    body = list(tree(module).body)
    while body:
        node = body.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = (ANY, None)
        elif isinstance(node, ast.ClassDef):
            names[node.name] = ("lazy-class", node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = (ANY, None)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            _bind_import(module, node, names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body[:0] = [n for part in ("body", "orelse", "finalbody", "handlers") for n in getattr(node, part, [])]
        elif isinstance(node, ast.ExceptHandler):
            body[:0] = node.body
    if "__getattr__" in names:  # names served on first use: those it spells out (``{"name": "submodule"}``)
        for node in ast.walk(tree(module)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.setdefault(node.value, (ANY, None))
    if local:  # what its functions import or define (a class made on first use)
        names = dict(names)
        for node in ast.walk(tree(module)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                _bind_import(module, node, names)
            elif isinstance(node, ast.ClassDef):
                names.setdefault(node.name, ("lazy-class", node))
    return names


@cache
def variables(module: str) -> frozenset[str]:
    """The names ``module`` gives its functions' parameters and local variables (``config``, ``loader``)."""
    out = set()
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return frozenset(out)


def _binding(module: str, name: str, seen: frozenset = frozenset(), local: bool = False):
    """What ``name`` is in ``module``: ("module", dotted), ("class", Klass), (ANY, None) or None."""
    if f"{module}.{name}" in modules():
        return ("module", f"{module}.{name}")
    found = names_of(module, local).get(name)
    if found is None:
        return None
    kind, value = found
    if kind == "lazy-class":
        return ("class", _class(module, value))
    if kind == "from":
        base, attr = value
        if (base, attr) in seen:
            return None
        return _binding(base, attr, seen | {(base, attr)})
    return found


def _walk(start, parts: list[str]):
    current = start
    for part in parts:
        kind, value = current
        if kind == ANY:
            return current
        if kind == "module":
            current = _binding(value, part)
        elif kind == "class":
            current = value.members.get(part) or ((ANY, None) if value.open else None)
        if current is None:
            return None
    return current


def resolve_in(module: str, parts: list[str], local: bool = False):
    """``parts`` looked up in ``module``'s names (the first; ``local``: its functions' imports too) and
    then attribute by attribute."""
    first = _binding(module, parts[0], local=local)
    return None if first is None else _walk(first, parts[1:])


def resolve_absolute(dotted: str):
    """A ``varlen_cli.x.y.name`` (the longest module prefix, then attributes), or None."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        if head in modules():
            return _walk(("module", head), parts[k:])
    return None


def _packages_up(module: str) -> list[str]:
    """``module`` (a package), its package, and each one above, up to ``varlen_cli``."""
    out = [module] if modules()[module].endswith("__init__.py") else []
    while "." in module:
        module = module.rpartition(".")[0]
        out.append(module)
    return out


def in_scope(module: str, first: str) -> bool:
    """Whether ``first`` names a module of the package as seen from ``module``: the package itself, an
    imported module, or a module of ``module``'s package or of one above."""
    if first == PACKAGE:
        return True
    binding = names_of(module, True).get(first)
    if binding is not None and binding[0] == "module":
        return True
    return any(f"{p}.{first}" in modules() for p in _packages_up(module))


def _module_classes(module: str) -> list[Klass]:
    return [b[1] for name in names_of(module) if (b := _binding(module, name)) and b[0] == "class"]


def cite_exists(module: str, target: str, klass: Klass | None = None, role: str | None = None) -> bool:
    """Whether ``target``, cited in ``module`` (in a docstring of the class ``klass`` or of one of its
    methods when given; ``role``: ``meth``, ``func``...), exists."""
    target = target.strip().removesuffix("()")
    if target.startswith(PACKAGE + "."):
        return resolve_absolute(target) is not None
    relative = target.startswith(".")
    parts = target.lstrip(".").split(".")
    if klass is not None and not relative and _walk(("class", klass), parts) is not None:
        return True
    if klass is None and role in ("meth", "attr") and len(parts) == 1 and any(  # a module docstring's :meth:`x`
            parts[0] in k.members for k in _module_classes(module)):
        return True
    if resolve_in(module, parts, local=True) is not None:
        return True
    if any(resolve_absolute(f"{p}.{'.'.join(parts)}") is not None for p in _packages_up(module)):
        return True
    if not relative and len(parts) > 1 and parts[0] not in names_of(module, True) and not in_scope(module, parts[0]):
        return importlib.util.find_spec(parts[0]) is not None  # another library's name (os.open, torch.x)
    return not relative and len(parts) == 1 and parts[0] in __builtins__  # :class:`dict`, :exc:`OSError`


def _docstrings(module: str):
    """(docstring, the class it belongs to or None) of the module, its classes, functions and methods."""
    def visit(node, klass):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                k = _binding(module, child.name)
                k = k[1] if k and k[0] == "class" and klass is None else _class(module, child)
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    yield doc, k
                yield from visit(child, k)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    yield doc, klass
                yield from visit(child, klass)

    doc = ast.get_docstring(tree(module), clean=False)
    if doc:
        yield doc, None
    yield from visit(tree(module), None)


FILE_SUFFIXES = {"parquet", "json", "jsonl", "py", "md", "txt", "gz", "tar", "idx", "bin", "arrow", "csv", "yaml"}


def _literal_cite(module: str, dotted: str) -> bool:
    """Whether a ``literal`` dotted name is a cite: its first part a module in scope that the module
    does not also use as a variable name (``config.dp`` is a config's field) nor is a package of, not a
    file name."""
    parts = dotted.split(".")
    if parts[-1] in FILE_SUFFIXES or not in_scope(module, parts[0]):
        return False
    imported = names_of(module).get(parts[0], (None,))[0] == "module"
    if parts[0] == PACKAGE or imported:
        return True
    # ``loader.epoch`` in varlen_cli.loader: an object of the package's own kind, not a module
    return parts[0] not in variables(module) and parts[0] not in module.split(".")[1:]


def docstring_cites(module: str, text: str) -> list[tuple[str | None, str]]:
    """(role, target) of each cite of ``text`` (a docstring of ``module``): every role, and the literals
    of dotted names whose first part is a module in scope (role None)."""
    cites = [(m.group(1), m.group(2)) for m in ROLE.finditer(text)]
    cites += [(None, m.group(1)) for m in LITERAL.finditer(text) if _literal_cite(module, m.group(1))]
    return cites


def stale_docstring_cites(module: str) -> list[tuple[str, str]]:
    """(module, target) of each cite in ``module``'s docstrings that does not exist."""
    out = []
    for doc, klass in _docstrings(module):
        out += [(module, c) for role, c in docstring_cites(module, doc) if not cite_exists(module, c, klass, role)]
    return out


@cache
def classes() -> dict[str, list[str]]:
    """{class name: the modules that define it at top level}."""
    out: dict = {}
    for module in modules():
        for name, (kind, _) in names_of(module).items():
            if kind == "lazy-class":
                out.setdefault(name, []).append(module)
    return out


def doc_cite_exists(span: str) -> bool | None:
    """Whether a doc's `span` names something that exists; None when it is no cite."""
    span = span.strip().removesuffix("()")
    if span.startswith(PACKAGE + "/"):
        return os.path.exists(os.path.join(ROOT, span.split("::")[0].split(":")[0]))
    if not DOTTED.fullmatch(span):
        return None
    if span.startswith(PACKAGE + "."):
        return resolve_absolute(span) is not None
    first, _, rest = span.partition(".")
    if first in classes():
        return any(resolve_in(m, span.split(".")) is not None for m in classes()[first])
    return None


def stale_doc_cites(text: str) -> list[str]:
    return [m.group(1) for m in SPAN.finditer(text) if doc_cite_exists(m.group(1)) is False]
