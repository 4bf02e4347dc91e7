"""Fault-injection points for the tests (``VARLEN_FAULT``, ``VARLEN_PAUSE``), a leaf module so that
any layer (the stages, the output swap) can mark a point."""

from __future__ import annotations

import os
import signal
import time


def fault_point(name: str) -> None:
    """Test hooks: ``VARLEN_FAULT=NAME:RANK`` kills this worker (SIGKILL) when it reaches NAME;
    ``VARLEN_PAUSE=NAME`` makes every worker wait there (60 s, or until a signal ends it).

    Used by the fault-injection tests: a dead worker fails the whole job; a signal that arrives
    while a stage is surely still running (paused) leaves the previous output as it was.
    """
    if os.environ.get("VARLEN_PAUSE") == name:
        time.sleep(60.0)
    spec = os.environ.get("VARLEN_FAULT")
    if not spec:
        return
    point, _, rank = spec.rpartition(":")
    if point == name and int(os.environ.get("RANK", 0)) == int(rank):
        os.kill(os.getpid(), signal.SIGKILL)
