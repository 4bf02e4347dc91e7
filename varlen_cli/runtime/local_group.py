"""Torch-free local process groups: ``--nproc N`` on the CPU without torch.distributed.

``varlen sort --nproc 2`` used to start its workers through torch's elastic launcher and join them
in a gloo group. On a small machine that fixed cost (importing torch in the launcher, the agent,
the rendezvous, gloo's set-up: 2-3 s) was larger than the work a second worker saves. A stage's
collectives are few and simple, so for local CPU workers varlen runs its own group instead:

* :func:`launch_local` starts N worker processes (``multiprocessing``, fork on the command line,
  spawn in a library by default: ``VARLEN_START_METHOD``), joined by one pipe per ordered pair of
  workers, and supervises them: the first worker that fails stops the others (SIGKILL) and its own
  error is raised in the launcher, exactly as with the elastic launcher;
* :class:`LocalGroup` is a worker's end: it moves bytes between workers through those pipes with
  one ``selectors`` loop (every send and receive of a collective in flight at once, so no pair of
  workers can wait on each other), which gives :class:`~varlen_cli.runtime.dist.LocalDist` its
  collectives: all-gather of objects, all-reduce, all-to-all of rows, point-to-point rows.

Every worker calls the collectives in the same order (the stages are SPMD), so each pipe carries
one message per collective, in order. A peer that exits closes its pipes: the others see end of
file and fail with a one-line :class:`~varlen_cli.errors.WorkerError` instead of waiting. Workers die
with their launcher (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import WorkerError

_CURRENT: LocalGroup | None = None
_CHUNK = 1 << 20  # bytes per write: a pipe takes at most its buffer size anyway
_PIPE_BYTES = 1 << 20  # ask Linux for 1 MiB pipe buffers (fewer wake-ups); the default is 64 KiB
_F_SETPIPE_SZ = 1031


def current() -> LocalGroup | None:
    """The local group of this process when it is a :func:`launch_local` worker, else None."""
    return _CURRENT


class LocalGroup:
    """One worker's pipes to every other worker of a :func:`launch_local` job."""

    def __init__(self, rank: int, world_size: int, send_fds: dict, recv_fds: dict, counter, timeout: float):
        self.rank, self.world_size = rank, world_size
        self.send_fds, self.recv_fds = send_fds, recv_fds  # peer rank -> pipe fd
        self.counter = counter  # the job-wide progress counter (a shared multiprocessing.Value)
        self.timeout = timeout
        for fd in (*send_fds.values(), *recv_fds.values()):
            os.set_blocking(fd, False)
        for fd in send_fds.values():
            _grow_pipe(fd)

    def pump(self, outgoing: dict, incoming: dict) -> None:
        """Send each ``outgoing[peer]`` (bytes-like) and fill each ``incoming[peer]`` (writable byte
        memoryview) completely, all at once: one ``selectors`` loop over the pipes involved."""
        todo = {}
        with selectors.DefaultSelector() as sel:
            for peer, buf in outgoing.items():
                if len(buf):
                    todo[("w", peer)] = [memoryview(buf).cast("B"), 0]
                    sel.register(self.send_fds[peer], selectors.EVENT_WRITE, ("w", peer))
            for peer, buf in incoming.items():
                if len(buf):
                    todo[("r", peer)] = [buf, 0]
                    sel.register(self.recv_fds[peer], selectors.EVENT_READ, ("r", peer))
            deadline = time.monotonic() + self.timeout
            while todo:
                events = sel.select(timeout=max(0.0, deadline - time.monotonic()))
                if not events:
                    raise WorkerError(f"worker {self.rank} waited more than {self.timeout:.0f} s for its peers "
                                      "(VARLEN_TIMEOUT)")
                for key, _ in events:
                    if self._step(key.fd, key.data, todo[key.data]):
                        sel.unregister(key.fd)
                        del todo[key.data]

    def _step(self, fd: int, what: tuple, state: list) -> bool:
        """Move what the pipe takes (or has) now; True when this transfer is complete."""
        kind, peer = what
        buf, done = state
        try:
            if kind == "w":
                moved = os.write(fd, buf[done:done + _CHUNK])
            else:
                moved = os.readv(fd, [buf[done:]])
                if moved == 0:
                    raise WorkerError(f"worker {peer} stopped before its share of a collective arrived")
        except BlockingIOError:
            return False
        except BrokenPipeError:
            raise WorkerError(f"worker {peer} stopped before taking its share of a collective") from None
        state[1] = done + moved
        return state[1] == len(buf)

    def peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every worker's ``payload``, in rank order (sizes first, then the bytes)."""
        size = np.array([len(payload)], dtype=np.int64)
        sizes = {p: np.zeros(1, dtype=np.int64) for p in self.peers()}
        self.pump({p: size for p in self.peers()}, {p: _bytes_view(a) for p, a in sizes.items()})
        got = {p: bytearray(int(a[0])) for p, a in sizes.items()}
        self.pump({p: payload for p in self.peers()}, {p: memoryview(b) for p, b in got.items()})
        return [payload if r == self.rank else bytes(got[r]) for r in range(self.world_size)]

    def all_gather_object(self, obj: Any) -> list:
        payloads = self.all_gather_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        return [obj if r == self.rank else pickle.loads(p) for r, p in enumerate(payloads)]

    def all_to_all_rows(self, rows: np.ndarray, sends: Sequence[int], recvs: Sequence[int]) -> np.ndarray:
        """``rows[sum(sends[:p]):sum(sends[:p+1])]`` to worker p; returns the rows received, by rank."""
        rows = np.ascontiguousarray(rows)
        out = np.empty((int(sum(recvs)),) + rows.shape[1:], dtype=rows.dtype)
        send_at = np.concatenate([[0], np.cumsum(sends)]).astype(np.int64)
        recv_at = np.concatenate([[0], np.cumsum(recvs)]).astype(np.int64)
        me = self.rank
        out[recv_at[me]:recv_at[me + 1]] = rows[send_at[me]:send_at[me + 1]]
        self.pump({p: _bytes_view(rows[send_at[p]:send_at[p + 1]]) for p in self.peers()},
                  {p: _bytes_view(out[recv_at[p]:recv_at[p + 1]]) for p in self.peers()})
        return out

    def send_rows(self, rows: np.ndarray, dst: int) -> None:
        self.pump({dst: _bytes_view(np.ascontiguousarray(rows))}, {})

    def recv_rows(self, out: np.ndarray, src: int) -> np.ndarray:
        self.pump({}, {src: _bytes_view(out)})
        return out

    def add_progress(self, amount: int) -> int:
        with self.counter.get_lock():
            self.counter.value += int(amount)
            return int(self.counter.value)


def _bytes_view(a: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (of any fixed-width dtype, datetimes included)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _grow_pipe(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size: keep the default
        pass


# -- the launcher ------------------------------------------------------------------------------------
def fits_fd_limit(nproc: int) -> bool:
    """Whether the launcher may open the ``2 * nproc * (nproc - 1)`` pipe ends of a group (raising
    its soft limit on open files up to the hard one if needed): 32 workers need ~2,000."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not Unix
        return False
    needed = 2 * nproc * (nproc - 1) + 256  # and what the process already holds
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return True
    if hard != resource.RLIM_INFINITY and hard < needed:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    except (ValueError, OSError):
        return False
    return True


def launch_local(entry: Callable[[Any], Any], config: Any, nproc: int, start_method: str, worker_env: dict,
                 error_dir: str, timeout: float) -> Any:
    """Run ``entry(config)`` in ``nproc`` local workers joined by a :class:`LocalGroup` whose
    collectives wait ``timeout`` seconds for a peer.

    Returns rank 0's return value. When a worker fails, the others are killed and the failing
    workers' exit codes are raised as :class:`WorkersFailed` (the caller turns the records the
    workers left in ``error_dir`` into the user's error).
    """
    import multiprocessing as mp

    ctx = mp.get_context(start_method)
    pipes = {(s, t): ctx.Pipe(duplex=False) for s in range(nproc) for t in range(nproc) if s != t}
    counter = ctx.Value("q", 0)
    result_r, result_w = ctx.Pipe(duplex=False)
    launcher_pid = None if start_method == "forkserver" else os.getpid()  # forkserver: not the parent
    common = (nproc, pipes, counter, result_w, worker_env, error_dir, timeout, launcher_pid, entry,
              config)
    procs = [ctx.Process(target=_worker_main, args=(rank, *common), name=f"varlen-worker-{rank}")
             for rank in range(nproc)]
    try:
        for p in procs:
            p.start()
        for r, w in pipes.values():
            r.close()
            w.close()
        result_w.close()
        return _supervise(procs, result_r)
    finally:
        _stop(procs)
        result_r.close()


class WorkersFailed(Exception):
    """Workers of a launched job failed (either launcher): ``exitcodes`` maps each failed rank to its
    exit code, the first to fail first; :func:`~varlen_cli.runtime.dist.failure_error` makes it the
    user's error."""

    def __init__(self, exitcodes: dict):
        super().__init__(f"workers failed: {exitcodes}")
        self.exitcodes = exitcodes


def _supervise(procs: list, result_r) -> Any:
    """Wait for every worker; rank 0's result, or :class:`WorkersFailed` at the first failure."""
    from multiprocessing.connection import wait

    result: list = []  # rank 0's result once received
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    waiting = [result_r, *running]
    while running:
        failed = {}
        for obj in wait(waiting):
            waiting.remove(obj)
            if obj is result_r:
                result = _receive(result_r)
                continue
            rank = running.pop(obj)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                failed[rank] = procs[rank].exitcode
        if failed:
            raise WorkersFailed(failed)
    if result_r in waiting:  # every worker ended before the result was read
        result = _receive(result_r)
    if not result:
        raise WorkersFailed({0: procs[0].exitcode})
    return result[0]


def _receive(conn) -> list:
    """``[rank 0's result]``, or ``[]`` when rank 0 ended without sending one (its exit code says why)."""
    try:
        return [conn.recv()]
    except EOFError:
        return []


def _stop(procs: list) -> None:
    """Kill the workers still running (after a failure or a signal in the launcher) and reap them."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        if p.pid is not None:
            p.join()


def _worker_main(rank: int, nproc: int, pipes: dict, counter, result_w, worker_env: dict, error_dir: str,
                 timeout: float, launcher_pid: int | None, entry: Callable[[Any], Any], config: Any) -> None:
    """Top of a local worker: its environment and pipes, then the stage; rank 0 sends back the result."""
    global _CURRENT
    _die_with_parent(launcher_pid)
    os.environ.update(worker_env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(nproc), "VARLEN_ERROR_DIR": error_dir})
    send, recv = {}, {}
    for (s, t), (r, w) in pipes.items():  # keep this worker's ends, close the rest (fork inherits all)
        if s == rank:
            send[t] = w
            r.close()
        elif t == rank:
            recv[s] = r
            w.close()
        else:
            r.close()
            w.close()
    _CURRENT = LocalGroup(rank, nproc, {t: c.fileno() for t, c in send.items()},
                          {s: c.fileno() for s, c in recv.items()}, counter, timeout)
    result = entry(config)  # dist.worker_entry around the stage: exits with the error's code on failure
    if rank == 0:
        result_w.send(result)
    result_w.close()
    sys.stdout.flush()


def _die_with_parent(launcher_pid: int | None) -> None:
    """Linux: this process gets SIGKILL when its launcher dies (no orphan finishes a cancelled job).
    Not with forkserver, whose server process, not the launcher, is the parent."""
    if launcher_pid is None or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        return
    if os.getppid() != launcher_pid:  # the launcher died before the line above
        os._exit(1)
