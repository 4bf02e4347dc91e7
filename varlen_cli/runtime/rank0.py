"""Single-process stages (plan, validate, inspect) under torchrun: rank 0 works, the others wait.

Under ``torchrun --nproc-per-node N -m varlen_cli plan ...`` every rank runs the command. Only
rank 0 reads the input and writes the output; the other ranks wait for it and then return the same
result (or raise the same user error), so every rank exits with the same code.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import ERROR_CLASSES, VarlenError, WorkerError
from .dist import in_launched_worker, session


def needs_group() -> bool:
    """True in a launched worker of a multi-rank job whose process group does not exist yet."""
    if not in_launched_worker() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import sys

    from . import local_group

    if local_group.current() is not None:
        return False  # a worker of a local group (`varlen run --nproc N`): the caller decides, as below
    if "torch" in sys.modules:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            return False  # the caller (e.g. `varlen run`) already decides which rank does what
    return True


def outcome_of(fn: Callable[[], Any]) -> tuple:
    """``("ok", fn())``, or ``("error", kind, message)`` for a user error: what one rank sends the
    others. An error that every rank already has (``shared``, raised by :func:`result_of`) is
    raised again as it is: gathering it a second time would meet no peer."""
    try:
        return ("ok", fn())
    except VarlenError as exc:
        if getattr(exc, "shared", False):
            raise
        return ("error", type(exc).__name__, exc.message)


def result_of(outcome: tuple) -> Any:
    """The value of an :func:`outcome_of`, or its error raised, marked ``shared`` (every rank raises it
    after the same collective)."""
    if outcome[0] == "ok":
        return outcome[1]
    error = ERROR_CLASSES.get(outcome[1], WorkerError)(outcome[2])
    error.shared = True
    raise error


def on_rank0(fn: Callable[[Any], Any], config: Any) -> Any:
    """``fn(config)`` on rank 0 only; every rank returns its result or raises its user error."""
    with session("cpu") as d:
        outcome: tuple = ("ok", None)
        if d.is_main:
            try:
                outcome = outcome_of(lambda: fn(config))
            except BaseException as exc:
                outcome = ("error", "WorkerError", f"rank 0 failed: {type(exc).__name__}: {exc}")
                d.all_gather_object(outcome)
                raise
        outcome = d.all_gather_object(outcome if d.is_main else None)[0]
    return result_of(outcome)
