"""User-facing errors and their exit codes.

A user mistake raises a :class:`VarlenError` subclass; the command line prints its message as one
line on stderr (no traceback unless ``--debug``) and exits with the class's code:

====  =====================================================================
code  meaning
====  =====================================================================
1     internal error (a bug: please report it with the ``--debug`` traceback)
2     bad option or option value (:class:`UsageError`)
3     bad input data: missing, unreadable or invalid source or artifact (:class:`InputError`)
4     output problem: exists without ``--overwrite``, or unwritable (:class:`OutputError`)
5     a distributed worker failed or timed out (:class:`WorkerError`)
6     ``varlen validate`` found violations (:data:`VALIDATION_FAILED`), or a plan does not fit the
      dataset, world size or trainer, or the trainer left the plan (:class:`PlanError`)
====  =====================================================================

An uncaught varlen error in a training script is one line too, also under torchrun
(:mod:`.entry`, installed when ``varlen_cli`` is imported).
"""

from __future__ import annotations

import time


class VarlenError(Exception):
    """Base class of errors caused by the user's input or environment, not by a bug."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
        # When the failure happened, before any clean-up ran: of several failed workers, the first
        # to fail is the cause (a peer whose files that clean-up removed fails later, as a consequence).
        self.created_at = time.time()

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message


class UsageError(VarlenError):
    """An option or combination of options is invalid."""

    exit_code = 2


class InputError(VarlenError):
    """A source, column, value or input artifact is missing or invalid."""

    exit_code = 3


class OutputError(VarlenError):
    """The output exists (without --overwrite) or cannot be written."""

    exit_code = 4


class WorkerError(VarlenError):
    """A distributed worker died, failed without a user error, or a collective timed out."""

    exit_code = 5


class InternalConsistencyError(RuntimeError):
    """An invariant of varlen's own making does not hold: a bug (exit 1, "internal error"), never a
    user mistake. Raised by real checks (not ``assert``, which ``python -O`` removes)."""


VALIDATION_FAILED = 6


class PlanError(VarlenError, ValueError):
    """The plan does not fit the dataset, the world size or the loader, or the trainer consumed a
    microbatch out of the plan's order (one clear line; a ``ValueError`` too)."""

    exit_code = VALIDATION_FAILED

    def __init__(self, message: str):
        # a DataLoader worker re-raises as PlanError("Caught PlanError in DataLoader worker ...<traceback>"):
        # keep the original one-line message
        if "Original Traceback" in message:
            last = message.rstrip().splitlines()[-1]
            message = last.split("PlanError: ", 1)[-1] if "PlanError: " in last else last
        super().__init__(message)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a one-line
    refusal quotes of a library's error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


ERROR_CLASSES = {cls.__name__: cls for cls in (VarlenError, UsageError, InputError, OutputError, WorkerError,
                                               PlanError)}
