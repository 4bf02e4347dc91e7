"""Notes a stage leaves for the user: one line each, about a choice varlen made for them (today: a
``--nproc`` capped by the work units and the cores, :func:`varlen_cli.runtime.dist.cap_workers`).

The command line echoes each note on stderr as ``varlen: note: TEXT`` when it is made (before the
work, not minutes later) and adds them to ``--json`` as ``notes``; a library caller reads
:func:`current` after the call.
"""

from __future__ import annotations

import sys

_NOTES: list[str] = []
_ECHO = [False]


def start(echo: bool = False) -> None:
    """A new command: forget earlier notes; ``echo``: write each new one on stderr at once."""
    _NOTES.clear()
    _ECHO[0] = echo


def add(text: str) -> None:
    _NOTES.append(text)
    if _ECHO[0]:
        sys.stderr.write(f"varlen: note: {text}\n")
        sys.stderr.flush()


def current() -> list[str]:
    """The notes of the current command, oldest first."""
    return list(_NOTES)
