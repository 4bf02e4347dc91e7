"""The measuring process: ``python -m varlen_cli.memory.child --result-fd N (--once | --serve)``.

A fresh Python process that imports what a training process imports (torch, the model's module) and
nothing else of note, then measures one training step (:func:`varlen_cli.memory.measure.measure_in_process`).
Requests come as JSON lines on stdin; every answer is one JSON line on file descriptor N (stdout and
stderr stay the user's code's):

- ``--once``: one request ``{"setup", "batch", "seqlen", "input_ids"?}``, measured in this process.
- ``--serve``: a fork server. The first line is ``{"setup"}``: it imports torch, ``torch._dynamo``
  (which the optimizer's first step imports) and the model's module (no torch op runs), answers
  ``{"ready": true}``, then forks one child per request ``{"batch", "seqlen", "timeout"}``, so each
  measurement starts from the same clean, imported state in milliseconds instead of seconds of
  imports. A forked child counts the libraries' file pages it touches itself but not those only the
  imports touched; :mod:`varlen_cli.memory.procs` adds that constant back from one fresh process
  measured at the same shape.

Answers: ``{"ok": measurement}``, ``{"error": [error class, message]}`` (a user error, re-raised by the
parent), ``{"crash": text}`` (anything else), ``{"ok": {"oom": true, ...}}`` when the step ran out of
memory or the kernel killed it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys


def _answer(fd: int, obj: dict) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _measure(request: dict) -> dict:
    """One measurement as an answer dict (never raises, except on interpreter exit)."""
    from ..errors import VarlenError
    from .measure import MeasureSetup, measure_in_process

    try:
        setup = MeasureSetup(**request["setup"])
        return {"ok": measure_in_process(setup, int(request["batch"]), int(request["seqlen"]),
                                         request.get("input_ids"))}
    except VarlenError as exc:
        return {"error": [type(exc).__name__, exc.message]}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it as a worker error
        import traceback

        return {"crash": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}


def _serve(fd: int) -> None:
    from ..errors import VarlenError
    from .measure import MeasureSetup, load_factory

    setup_json = json.loads(sys.stdin.readline())["setup"]
    try:
        import torch  # noqa: F401

        try:
            import torch._dynamo  # noqa: F401  (the optimizer's first step imports it: ~2 s per child otherwise)
        except ImportError:  # pragma: no cover - older torch
            pass
        load_factory(MeasureSetup(**setup_json).model)  # imports the model's module, runs nothing
    except VarlenError as exc:
        _answer(fd, {"error": [type(exc).__name__, exc.message]})
        return
    _answer(fd, {"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        _answer(fd, _fork_one(dict(request, setup=setup_json), float(request.get("timeout", 600))))


def _fork_one(request: dict, timeout: float) -> dict:
    """Measure ``request`` in a forked child; its answer, or what its end says (killed: out of memory)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the measuring child
        os.close(read)
        try:
            _answer(write, _measure(request))
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([read], [], [], timeout)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                return {"timeout": timeout}
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    if chunks:
        return json.loads(b"".join(chunks))
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:  # the kernel's OOM killer
        return {"ok": {"batch_size": request["batch"], "seqlen": request["seqlen"], "oom": True, "killed": True}}
    return {"crash": f"the measuring process died ({_describe_status(status)})"}


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def main(argv: list[str]) -> None:
    fd = int(argv[argv.index("--result-fd") + 1])
    if "--serve" in argv:
        _serve(fd)
    else:
        _answer(fd, _measure(json.loads(sys.stdin.readline())))


if __name__ == "__main__":
    main(sys.argv[1:])
