"""User code named on the command line as ``MODULE:FUNCTION``: ``analyze --difficulty``,
``calibrate --model`` and ``simulate --schedule`` load it the same way, with the same messages.

MODULE is a dotted module name, looked up in the current directory first (then taken off
``sys.path`` again: the caller may be a training script importing varlen as a library), or a path to
a ``.py`` file. A module that fails to import, even by ``sys.exit()``, is the user's error, not
varlen's: one line naming the option, the module and the exception.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

from ..errors import InputError, UsageError, VarlenError
from ..storage.files import check_regular


def split_spec(spec: str, option: str) -> tuple[str, str]:
    """``(module, function)`` of ``MODULE:FUNCTION``, or a usage error naming ``option``."""
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise UsageError(f"{option} must be MODULE:FUNCTION (got {spec!r})")
    return module_name, function


def module_path(spec: str) -> str | None:
    """The file (or package directory) of ``MODULE:FUNCTION`` in this directory or at a ``.py`` path,
    found without importing anything; None for anything else (an installed module, or no spec)."""
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        return None
    if module_name.endswith(".py"):
        return module_name
    base = os.path.join(*module_name.split("."))  # relative to the current directory, as imported
    for candidate in (base + ".py", base):
        if os.path.lexists(candidate):
            return candidate
    return None


def load_function(spec: str, option: str, error: type[VarlenError] = UsageError) -> Callable:
    """The function ``spec`` names; ``error`` (a varlen error class) when it cannot be had."""
    module_name, function = split_spec(spec, option)
    local = module_path(spec)
    if local is not None and not os.path.isdir(local):
        check_regular(local, f"{option} module")  # importing a FIFO would block forever
    try:
        module = _load_file(module_name, option, spec) if module_name.endswith(".py") else _import(module_name)
    except VarlenError:
        raise
    except (Exception, SystemExit) as exc:  # a user module that fails to import (sys.exit included)
        raise error(f"{option} {spec}: cannot import module '{module_name}': {describe(exc)}") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise error(f"{option} {spec}: module '{module_name}' has no function '{function}'")
    return fn


def _import(module_name: str):
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _load_file(path: str, option: str, spec: str):
    """A ``.py`` file as module ``varlen_user_<stem>`` (kept in ``sys.modules``, so forked workers
    reuse what their parent loaded)."""
    if not os.path.isfile(path):
        raise InputError(f"{option} {spec}: file {path} does not exist")
    name = "varlen_user_" + os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == os.path.abspath(path):
        return module
    loader_spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def describe(exc: BaseException) -> str:
    """One line for an exception raised by user code."""
    if isinstance(exc, SystemExit):
        return f"SystemExit (sys.exit({exc.code!r}))"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
