"""The processes that measure: a fresh Python process per shape, or a fork server (see
:mod:`varlen_cli.memory.child` for the protocol, docs/memory.md for what is counted).

- :func:`measure_fresh` / :class:`FreshProcess`: one shape in a fresh ``python -m
  varlen_cli.memory.child`` process, exactly what a training process does (import torch and the
  model's module, build, warm up, one step). Its peak is the ground truth (``calibrate --verify``).
- :class:`Measurer`: what ``varlen calibrate`` uses: every shape in a child forked from a server that
  has imported torch and the model's module (seconds faster per shape), plus one fresh process at
  the first shape. A forked child does not count the library pages only the imports touched; that
  difference, constant over shapes (72 +- 3 MB for a transformers model, docs/memory.md), is measured
  as fresh minus forked at the same shape and added to every point. CPU only: on CUDA every shape
  runs in a fresh process.

This module does not import torch.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from ..errors import ERROR_CLASSES, InputError, WorkerError
from .measure import MeasureSetup

START_ENV = "VARLEN_CALIBRATE_START"  # "fresh" (or "spawn"): every shape in a fresh process, no fork server
DEFAULT_TIMEOUT = 600.0


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Child:
    """``python -m varlen_cli.memory.child ARGS`` with a JSON-lines answer pipe and its output in a file."""

    def __init__(self, *args: str):
        read, write = os.pipe()
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(  # its own session: killing it kills the children it forked too
                [sys.executable, "-m", "varlen_cli.memory.child", "--result-fd", str(write), *args],
                stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, pass_fds=(write,), env=env,
                start_new_session=True)
        finally:
            os.close(write)
        self.answers = os.fdopen(read, "rb", buffering=0)
        self.pending = b""

    def send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the next answer says so

    def answer(self, timeout: float, what: str) -> dict:
        """The next answer line; a :class:`WorkerError` when the process dies or stays silent."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.answers], [], [], max(left, 0))
            if not ready:
                self.kill()
                raise WorkerError(f"{what} took longer than {timeout:.0f} s")
            chunk = self.answers.read(1 << 16)
            if not chunk:
                code = self.proc.wait()
                raise WorkerError(f"{what}: the measuring process died (exit code {code}){self._tail()}")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def _tail(self) -> str:
        self.log.seek(0)
        lines = [ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
        return f": {lines[-1].strip()}" if lines else ""

    def kill(self) -> None:
        """Kill the process and every measuring child it forked (one process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self.answers.close()
        self.log.close()


def _result(answer: dict, what: str) -> dict:
    """The measurement in an answer; a user error is re-raised as its class, anything else a worker error."""
    if "ok" in answer:
        return answer["ok"]
    if "error" in answer:
        name, message = answer["error"]
        raise ERROR_CLASSES.get(name, InputError)(message)
    if "timeout" in answer:
        raise WorkerError(f"{what} took longer than {answer['timeout']:.0f} s")
    raise WorkerError(f"{what} failed: {answer.get('crash', answer)}".splitlines()[0])


class FreshProcess:
    """One shape measured in a fresh process, started at once (:meth:`result` waits for it)."""

    def __init__(self, setup: MeasureSetup, batch: int, seqlen: int, input_ids=None):
        self.what = f"measuring {batch}x{seqlen} in a fresh process"
        self.child = _Child("--once")
        request = {"setup": setup.to_json(), "batch": batch, "seqlen": seqlen}
        if input_ids is not None:
            request["input_ids"] = [[int(v) for v in row] for row in input_ids]
        self.child.send(request)

    def result(self, timeout: float = DEFAULT_TIMEOUT) -> dict:
        try:
            answer = self.child.answer(timeout, self.what)
        finally:
            self.child.close()
        return dict(_result(answer, self.what), process="fresh")


def measure_fresh(setup: MeasureSetup, batch: int, seqlen: int, input_ids=None,
                  timeout: float = DEFAULT_TIMEOUT) -> dict:
    """Measure one shape in a fresh process (the peak a training process of that shape has)."""
    return FreshProcess(setup, batch, seqlen, input_ids).result(timeout)


class ForkServer:
    """A server process that imported torch and the model's module; :meth:`measure` forks a child per shape."""

    def __init__(self, setup: MeasureSetup, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = timeout
        self.child = _Child("--serve")
        self.child.send({"setup": setup.to_json()})
        answer = self.child.answer(timeout, "starting the measuring process")
        if not answer.get("ready"):
            self.close()
            _result(answer, "starting the measuring process")

    def measure(self, batch: int, seqlen: int) -> dict:
        what = f"measuring {batch}x{seqlen}"
        self.child.send({"batch": batch, "seqlen": seqlen, "timeout": self.timeout})
        return dict(_result(self.child.answer(self.timeout + 60, what), what), process="fork")

    def close(self) -> None:
        self.child.close()


def use_fork_server(device: str) -> bool:
    """CPU on a system with ``fork``, unless ``VARLEN_CALIBRATE_START=fresh``; CUDA always measures in fresh
    processes (a library that initialised CUDA in the server would break every forked child)."""
    return device == "cpu" and hasattr(os, "fork") and os.environ.get(START_ENV, "fork") not in ("fresh", "spawn")


class Measurer:
    """Measures shapes as fresh processes would: forked children plus the fresh-process offset (CPU),
    or a fresh process per shape (``VARLEN_CALIBRATE_START=fresh``, or no ``fork``). The fresh process
    at ``reference`` (the first shape to measure) starts first, alongside the server's imports."""

    def __init__(self, setup: MeasureSetup, reference: tuple[int, int], timeout: float = DEFAULT_TIMEOUT):
        self.setup, self.timeout, self.reference_shape = setup, timeout, reference
        self.server: ForkServer | None = None
        self.reference: FreshProcess | None = None
        self.offset = 0
        self.raw: dict[tuple[int, int], dict] = {}  # as measured (forked points without the offset)
        if use_fork_server(setup.device):
            self.reference = FreshProcess(setup, *reference)
            try:
                self.server = ForkServer(setup, timeout)
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> Measurer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(kill=exc_type is not None)  # interrupted or failed: stop the measuring processes at once

    def measure(self, batch: int, seqlen: int) -> dict:
        """One shape as a fresh process reads it (each shape measured once)."""
        if self.reference is not None:
            self._resolve_offset()
        shape = (batch, seqlen)
        if shape not in self.raw:
            if self.server is None:
                self.raw[shape] = measure_fresh(self.setup, batch, seqlen, timeout=self.timeout)
            else:
                self.raw[shape] = self.server.measure(batch, seqlen)
        return self._corrected(self.raw[shape])

    def _resolve_offset(self) -> None:
        """Fresh minus forked peak at the reference shape (kept >= 0: a forked child never reads less)."""
        forked = self.server.measure(*self.reference_shape)
        self.raw[self.reference_shape] = forked
        fresh, self.reference = self.reference.result(self.timeout), None
        if not fresh.get("oom") and not forked.get("oom"):
            self.offset = max(0, int(fresh["peak_bytes"]) - int(forked["peak_bytes"]))

    def _corrected(self, point: dict) -> dict:
        if point.get("process") != "fork" or point.get("oom"):
            return dict(point)
        return dict(point, peak_bytes=point["peak_bytes"] + self.offset, base_bytes=point["base_bytes"] + self.offset,
                    fork_offset_bytes=self.offset)

    def close(self, kill: bool = False) -> None:
        if self.reference is not None:
            self.reference.child.kill()
            self.reference.child.close()
            self.reference = None
        if self.server is not None:
            if kill:
                self.server.child.kill()
            self.server.close()
            self.server = None
