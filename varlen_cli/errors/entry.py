"""A varlen refusal is one line, also under torchrun: ``varlen: error: [rank R] MESSAGE``.

Raised in a training script (a :class:`~varlen_cli.errors.PlanError` from the loader or an
integration), an uncaught varlen error used to print a 44-97-line traceback on every rank, and
torchrun's closing summary then said only "To enable traceback see: ..." while the line that
mattered was scrolled away. Here:

* :func:`report` prints the one line on stderr and, under torchrun (``TORCHELASTIC_ERROR_FILE``),
  records it as the rank's error, so that torchrun's summary ends with it (``traceback : varlen:
  error: ...``): the last thing the user sees;
* :func:`exit_on_error` runs a script's ``main`` that way and exits with the error's code (6 for a
  ``PlanError``): the examples and ``python -m varlen_cli`` use it;
* :func:`install_excepthook` (done when ``varlen_cli`` is imported) does the same for any script
  that lets a varlen error escape, such as the recipes of docs/loader.md and docs/integrations.md.
  ``VARLEN_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
import time

PREFIX = "varlen: error: "
WRAPPED = "Original Traceback"  # a DataLoader worker's error re-raised in the trainer: its message is a traceback


def varlen_error(exc: BaseException | None):
    """The varlen error ``exc`` is or was raised from (its cause or context), else None."""
    from . import VarlenError

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, VarlenError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def message_of(exc) -> str:
    """The error's message as one line (the last line of a DataLoader worker's re-raised traceback)."""
    message = str(getattr(exc, "message", exc))
    if WRAPPED in message:
        last = message.strip().splitlines()[-1]
        message = last.split(": ", 1)[1] if ": " in last else last
    return " ".join(message.split())


def error_line(exc, rank: bool = True) -> str:
    """``varlen: error: [rank R] MESSAGE`` (the rank only when there are several processes)."""
    several = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    where = f"[rank {os.environ.get('RANK')}] " if rank and several else ""
    return f"{PREFIX}{where}{message_of(exc)}"


def record_for_torchrun(exc, line: str) -> None:
    """Under torchrun: the rank's error file, which torchrun's summary shows as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    data = {"message": {"message": f"{type(exc).__name__}: {message_of(exc)}",
                        "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as fh:
            json.dump(data, fh)
    except OSError:
        pass  # the summary then says less; the line is on stderr anyway


def report(exc, rank_shown: bool = False) -> int:
    """Print the error's one line on stderr, record it for torchrun; the exit code to use.
    ``rank_shown``: something else prefixes the line with the rank already (torch's hook, below)."""
    line = error_line(exc)
    sys.stdout.flush()
    sys.stderr.write((error_line(exc, rank=False) if rank_shown else line) + "\n")
    sys.stderr.flush()
    record_for_torchrun(exc, line)
    return int(getattr(exc, "exit_code", 1))


def exit_on_error(main, *args, **kwargs):
    """``main(*args, **kwargs)``; a varlen error (or one raised from it) ends the process with its one
    line and exit code, without a traceback (``VARLEN_DEBUG=1``: with it). So does a local launch
    (torch's ``elastic_launch``) whose first failed worker reported a varlen error: its line."""
    try:
        return main(*args, **kwargs)
    except Exception as exc:
        if os.environ.get("VARLEN_DEBUG"):
            raise
        error = varlen_error(exc)
        if error is not None:
            sys.exit(report(error))
        child = worker_line(exc)
        if child is None:
            raise
        sys.stderr.write(child[0] + "\n")
        sys.exit(child[1])


def worker_line(exc) -> tuple[str, int] | None:
    """(line, exit code) of a torch ``ChildFailedError`` whose first failure is a reported varlen error."""
    if type(exc).__name__ != "ChildFailedError" or not hasattr(exc, "get_first_failure"):
        return None
    _, failure = exc.get_first_failure()
    message = failure.message if isinstance(failure.message, dict) else {}
    line = message.get("extraInfo", {}).get("py_callstack", "")
    return (line, failure.exitcode) if line.startswith(PREFIX) else None


def _excepthook(kind, value, tb, previous=None):
    error = varlen_error(value)
    if error is None or os.environ.get("VARLEN_DEBUG"):
        return (previous or sys.__excepthook__)(kind, value, tb)
    # torch.distributed.init_process_group wraps the hook it finds in one that prefixes "[rankR]: " to
    # every line: the line then does not say the rank twice
    report(error, rank_shown=getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook")


def install_excepthook() -> None:
    """An uncaught varlen error prints its one line (see the module's docstring); other exceptions go
    to the hook that was there before."""
    if getattr(sys.excepthook, "varlen", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        _excepthook(kind, value, tb, previous)

    hook.varlen = True
    sys.excepthook = hook
