"""Phase progress of ``varlen plan``: read, form and layout (per epoch), columns, write.

A rich bar on stderr that appears only once the plan has run for ``delay_s`` (about a second: short
plans print nothing), only on a terminal and only when asked (``--progress``, not ``VARLEN_NO_PROGRESS``).
It also records the seconds of every phase (``seconds``), shown or not.
"""

from __future__ import annotations

import sys
import threading
import time

from ..runtime.progress import enabled

DELAY_S = 1.0


class PlanProgress:
    """``with PlanProgress(show, epochs) as bar: bar.phase("read"); ...``; phases run one after another."""

    def __init__(self, show: bool, epochs: int, delay_s: float = DELAY_S):
        self.total = 3 + 2 * max(int(epochs), 1)  # read, form + layout per epoch, columns, write
        self.show = bool(show) and enabled()
        self.delay_s = delay_s
        self.seconds: dict[str, float] = {}
        self._name: str | None = None
        self._since = 0.0
        self._done = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._progress = None
        self._task = None

    def __enter__(self) -> PlanProgress:
        if self.show:
            self._timer = threading.Timer(self.delay_s, self._start)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with self._lock:
            if self._done < 0:  # finished meanwhile
                return
            console = Console(file=sys.stderr)
            if not console.is_terminal:
                return
            self._progress = Progress(TextColumn("[bold]plan[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task(self._name or "", total=self.total, completed=self._done)

    def _close_phase(self, now: float) -> None:
        if self._name is not None:
            key = self._name.split(" ")[0]
            self.seconds[key] = self.seconds.get(key, 0.0) + now - self._since
            self._done += 1

    def phase(self, name: str) -> None:
        """The previous phase is done; ``name`` (its first word is the phase, e.g. ``form epoch 2/3``) starts."""
        now = time.perf_counter()
        with self._lock:
            self._close_phase(now)
            self._name, self._since = name, now
            if self._progress is not None:
                self._progress.update(self._task, description=name, completed=self._done)

    def __exit__(self, *exc) -> None:
        now = time.perf_counter()
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._close_phase(now)
            self._name = None
            if self._progress is not None:
                if exc[0] is None:
                    self._progress.update(self._task, description="done", completed=self.total)
                self._progress.stop()
                self._progress = None
            self._done = -1
