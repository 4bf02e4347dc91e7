"""Rank-0 progress bars over the whole job.

Every rank adds its finished work to a job-wide counter in the process group's store; rank 0 shows
that counter, so the bar tracks all workers, not only rank 0. Other ranks show nothing.
"""

from __future__ import annotations

import os
import sys
import time

from .dist import Dist


def enabled() -> bool:
    """Progress bars are on unless ``VARLEN_NO_PROGRESS`` is set (callers also pass ``show``)."""
    return os.environ.get("VARLEN_NO_PROGRESS") is None


class JobProgress:
    """``with JobProgress(d, total, "analyze") as p: p.advance(n)``; a no-op off rank 0."""

    def __init__(self, d: Dist, total: int, description: str, show: bool = True):
        self.d = d
        self.total = max(int(total), 1)
        self.description = description
        self.show = show and d.is_main and enabled()
        self._progress = None
        self._task = None

    def __enter__(self) -> JobProgress:
        if self.show:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            console = Console(file=sys.stderr)
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), console=console, transient=False, disable=not console.is_terminal,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=self.total)
        return self

    def advance(self, amount: int) -> None:
        done = self.d.add_progress(int(amount))
        if self._progress is not None:
            self._progress.update(self._task, completed=min(done, self.total))

    def wait_for_peers(self, target: int, patience_s: float = 5.0) -> None:
        """Rank 0, done with its own share: keep the bar moving until the others reach ``target``."""
        if self._progress is None or not self.d.distributed:
            return
        last, since = -1, time.monotonic()
        while True:
            done = self.d.progress_total()
            self._progress.update(self._task, completed=min(done, self.total))
            if done >= target:
                return
            if done != last:
                last, since = done, time.monotonic()
            elif time.monotonic() - since > patience_s:
                return  # the barrier that follows waits (and times out) for us
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            if exc[0] is None:
                self._progress.update(self._task, completed=self.total)
            self._progress.__exit__(*exc)
