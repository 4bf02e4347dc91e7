"""Process groups: the one module that owns ``torch.distributed``.

A stage runs in one of three ways, and calls :func:`session` to get a :class:`Dist` either way:

* world size 1 in-process, with no environment at all: no process group, and torch is not even
  imported (collectives are identities);
* under ``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``): a gloo
  group on CPU, nccl with ``device="cuda"``, created here and destroyed at the end;
* with ``--nproc N``: :func:`launch` starts N local workers through torch's elastic launcher
  (the engine behind torchrun), each of which then takes the torchrun path.

A worker that fails makes the whole job fail: the elastic agent stops the other workers, and
:func:`launch` re-raises the failing worker's own error (a user error keeps its one-line message).
Collectives also carry a timeout (``VARLEN_TIMEOUT`` seconds, default 1800) as a backstop. Joining
the group waits at most ``VARLEN_JOIN_TIMEOUT`` seconds (default 120) for the other ranks, and a
signal (Ctrl-C, SIGTERM) stops the wait: a process started with ``RANK``/``WORLD_SIZE`` whose peers
never come (variables left over from another job) fails in one line instead of waiting half an hour,
deaf to signals (torch retries the store's connection in C++).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import ERROR_CLASSES, UsageError, VarlenError, WorkerError
from . import local_group, notes
from .faults import fault_point  # noqa: F401 - the stages import it from here

DEFAULT_TIMEOUT_S = 1800.0
_PROGRESS_KEY = "varlen/progress"


def _seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name`` (``default`` when unset);
    anything else is one UsageError line."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UsageError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


def collective_timeout() -> float:
    """Seconds a collective may wait for a peer before the job fails (``VARLEN_TIMEOUT``)."""
    return _seconds_from_env("VARLEN_TIMEOUT", DEFAULT_TIMEOUT_S)


DEFAULT_JOIN_TIMEOUT_S = 120.0  # torchrun's agent has met its peers before workers start: they join at once


def join_timeout() -> float:
    """Seconds a rank waits for the others to join the process group (``VARLEN_JOIN_TIMEOUT``)."""
    return _seconds_from_env("VARLEN_JOIN_TIMEOUT", min(DEFAULT_JOIN_TIMEOUT_S, collective_timeout()))


def _join_group(tdist, backend: str, timeout) -> None:
    """``init_process_group`` in a helper thread while this one waits in Python: a signal handler runs
    (torch's connection retries in C++ would hold it off for the whole timeout) and the wait for the
    other ranks ends after :func:`join_timeout` (a stuck helper thread dies with the process)."""
    import threading

    failed: list[BaseException] = []

    def join() -> None:
        try:
            tdist.init_process_group(backend=backend, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
            failed.append(exc)

    helper = threading.Thread(target=join, name="varlen-join", daemon=True)
    helper.start()
    deadline = time.monotonic() + join_timeout()
    while helper.is_alive():
        helper.join(0.2)
        if helper.is_alive() and time.monotonic() > deadline:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise WorkerError(f"could not join the process group ({backend}): rank {os.environ.get('RANK')} of "
                              f"{os.environ.get('WORLD_SIZE')} waited {join_timeout():.0f} s at {where} for the other "
                              "ranks (VARLEN_JOIN_TIMEOUT); are RANK and WORLD_SIZE left over from another job?")
    if failed:
        raise failed[0]


def in_launched_worker() -> bool:
    """True when a launcher (torchrun, ``--nproc``) set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class Dist:
    """This process's rank and world size, and the few collectives the stages use.

    Arrays go in and come out as numpy; with world size 1 every collective is an identity and
    torch is never imported.
    """

    backend = "torch"  # collectives through torch.distributed (gloo or nccl)

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, device: str = "cpu", group=None):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self._group = group
        self._store = None
        self._progress_seen = 0

    def __repr__(self) -> str:
        return f"Dist(rank={self.rank}, world_size={self.world_size}, device={self.device!r})"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # -- collectives -------------------------------------------------------------------------
    def _torch(self):
        import torch
        import torch.distributed as tdist

        return torch, tdist

    def _to_device(self, tensor):
        return tensor.cuda() if self.device == "cuda" else tensor

    def barrier(self) -> None:
        if self.distributed:
            _, tdist = self._torch()
            tdist.barrier()

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable, produced by varlen itself), in rank order."""
        if not self.distributed:
            return [obj]
        _, tdist = self._torch()
        out: list = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def all_reduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """Element-wise sum, max or min of a numeric array over all ranks."""
        array = np.ascontiguousarray(array)
        if not self.distributed:
            return array.copy()
        torch, tdist = self._torch()
        tensor = self._to_device(torch.from_numpy(array.copy()))
        reduce_op = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}[op]
        tdist.all_reduce(tensor, op=reduce_op)
        return tensor.cpu().numpy()

    def all_gather_int(self, value: int) -> np.ndarray:
        """Every rank's integer, as an int64 array in rank order."""
        if not self.distributed:
            return np.array([value], dtype=np.int64)
        torch, tdist = self._torch()
        mine = self._to_device(torch.tensor([value], dtype=torch.int64))
        out = [self._to_device(torch.zeros(1, dtype=torch.int64)) for _ in range(self.world_size)]
        tdist.all_gather(out, mine)
        return np.array([int(t.item()) for t in out], dtype=np.int64)

    def exchange_counts(self, sends: np.ndarray) -> np.ndarray:
        """All-to-all of one int64 per peer: ``sends[p]`` goes to rank p; returns what each rank sent here."""
        sends = np.ascontiguousarray(sends, dtype=np.int64)
        if not self.distributed:
            return sends.copy()
        torch, tdist = self._torch()
        recv = self._to_device(torch.empty(len(sends), dtype=torch.int64))
        tdist.all_to_all_single(recv, self._to_device(torch.from_numpy(sends.copy())))
        return recv.cpu().numpy()

    def all_to_all_rows(self, rows: np.ndarray, sends, recvs) -> np.ndarray:
        """Rows ``[sum(sends[:p]), sum(sends[:p+1]))`` of a numpy array go to rank p; returns the rows
        received, in rank order (``recvs[p]`` from rank p). Any fixed-width dtype; sent as bytes."""
        if not self.distributed:
            return np.ascontiguousarray(rows).copy()
        torch, tdist = self._torch()
        send = self._to_device(torch.from_numpy(_byte_rows(rows)))
        out = send.new_empty((int(sum(recvs)), send.shape[1]))
        tdist.all_to_all_single(out, send, output_split_sizes=[int(x) for x in recvs],
                                input_split_sizes=[int(x) for x in sends])
        return out.cpu().numpy().view(rows.dtype).reshape((-1,) + rows.shape[1:])

    def send_rows(self, rows: np.ndarray, dst: int) -> None:
        """Point-to-point: send a numpy array to rank ``dst`` (which calls :meth:`recv_rows`)."""
        torch, tdist = self._torch()
        tdist.send(self._to_device(torch.from_numpy(_byte_rows(rows))), dst=dst)

    def recv_rows(self, out: np.ndarray, src: int) -> np.ndarray:
        """Point-to-point: fill ``out`` (the shape and dtype ``src`` sends) from rank ``src``."""
        torch, tdist = self._torch()
        buf = self._to_device(torch.empty((len(out), out.dtype.itemsize * int(np.prod(out.shape[1:]))),
                                          dtype=torch.uint8))
        tdist.recv(buf, src=src)
        _byte_rows(out)[...] = buf.cpu().numpy()
        return out

    # -- whole-job progress ------------------------------------------------------------------
    def _progress_store(self):
        if not self.distributed:
            return None
        if self._store is None:
            try:
                from torch.distributed.distributed_c10d import _get_default_store

                self._store = _get_default_store()
            except Exception:  # pragma: no cover - private API moved: fall back to local progress
                self._store = False
        return self._store or None

    def add_progress(self, amount: int) -> int:
        """Add this rank's finished work to the job-wide counter; return the job-wide total so far."""
        store = self._progress_store()
        if store is None:
            self._progress_seen += int(amount)
            return self._progress_seen
        self._progress_seen = int(store.add(_PROGRESS_KEY, int(amount)))
        return self._progress_seen

    def progress_total(self) -> int:
        """The job-wide counter without adding to it."""
        return self.add_progress(0)


def _byte_rows(rows: np.ndarray) -> np.ndarray:
    """A C-contiguous (rows, bytes per row) uint8 view of a numpy array."""
    rows = np.ascontiguousarray(rows)
    return rows.view(np.uint8).reshape(len(rows), rows.dtype.itemsize * int(np.prod(rows.shape[1:])))


class LocalDist(Dist):
    """A :class:`Dist` over a torch-free :class:`~varlen_cli.runtime.local_group.LocalGroup` (the
    ``--nproc N`` workers on the CPU): the same collectives, moved through pipes."""

    backend = "local"

    def __init__(self, group):
        super().__init__(group.rank, group.world_size, group.rank, "cpu")
        self._local = group

    def barrier(self) -> None:
        self._local.all_gather_bytes(b"")

    def all_gather_object(self, obj: Any) -> list:
        return self._local.all_gather_object(obj)

    def all_reduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        arrays = self._local.all_gather_object(np.ascontiguousarray(array))
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
        out = arrays[0].copy()
        for a in arrays[1:]:
            fn(out, a, out=out)
        return out

    def all_gather_int(self, value: int) -> np.ndarray:
        return np.array(self._local.all_gather_object(int(value)), dtype=np.int64)

    def exchange_counts(self, sends: np.ndarray) -> np.ndarray:
        sends = np.ascontiguousarray(sends, dtype=np.int64)
        return self._local.all_to_all_rows(sends, [1] * self.world_size, [1] * self.world_size)

    def all_to_all_rows(self, rows: np.ndarray, sends, recvs) -> np.ndarray:
        return self._local.all_to_all_rows(rows, sends, recvs)

    def send_rows(self, rows: np.ndarray, dst: int) -> None:
        self._local.send_rows(rows, dst)

    def recv_rows(self, out: np.ndarray, src: int) -> np.ndarray:
        return self._local.recv_rows(out, src)

    def add_progress(self, amount: int) -> int:
        self._progress_seen = self._local.add_progress(amount)
        return self._progress_seen


@contextmanager
def session(device: str = "cpu") -> Iterator[Dist]:
    """The :class:`Dist` of this process: world size 1, or the launcher's group (created here).

    A process group that the caller already initialised is reused and left alone.
    """
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be 'cpu' or 'cuda', not {device!r}")
    group = local_group.current()
    if group is not None:  # a worker of launch_local: its pipes are the group
        yield LocalDist(group)
        return
    if "torch" in sys.modules:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            local = int(os.environ.get("LOCAL_RANK", 0))
            yield Dist(tdist.get_rank(), tdist.get_world_size(), local, device)
            return
    if not in_launched_worker() or int(os.environ["WORLD_SIZE"]) == 1:
        if device == "cuda":
            _set_cuda_device(0)
        yield Dist(0, 1, 0, device)
        return
    import datetime

    import torch.distributed as tdist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        _set_cuda_device(local)
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=collective_timeout())
    join_timeout()  # a bad VARLEN_JOIN_TIMEOUT is a usage error, before the join
    try:
        _join_group(tdist, backend, timeout)
    except WorkerError:
        raise
    except Exception as exc:
        raise WorkerError(f"could not join the process group ({backend}): {exc}") from exc
    succeeded = False
    try:
        yield Dist(rank, world, local, device)
        succeeded = True
    finally:
        _close_group(tdist, synchronise=succeeded)


def _close_group(tdist, synchronise: bool) -> None:
    """Destroy the process group. After a success every rank first meets at a barrier (bounded by the
    group's timeout, :func:`collective_timeout`), so no rank tears down its gloo connections while a
    peer still uses them (that race makes a gloo process abort at exit: "terminate called without an
    active exception"). After a failure there is no barrier: the peers may be gone, and the launcher
    stops them; a barrier whose peer died meanwhile raises (gloo: the connection closed) and is skipped."""
    try:
        if synchronise:
            tdist.barrier()
    except RuntimeError:  # a peer failed after this rank succeeded: the launcher reports it
        pass
    finally:
        try:
            tdist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort on the way out
            pass


def _set_cuda_device(local_rank: int) -> None:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--device cuda was given but torch sees no CUDA device")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())


# -- local launcher (--nproc) ----------------------------------------------------------------------
def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def cap_workers(config: Any, count_units: Callable[[], tuple[int, str]]) -> Any:
    """``config`` with its ``nproc`` capped by the work units and the cores, with a note saying so.

    ``count_units()`` gives the stage's work units and what one is (``(12, "work unit")``): a
    worker beyond them would have nothing to do, and one beyond the cores only shares them. It is
    called only for ``nproc > 1``, in the launcher. (Under torchrun the world is the launcher's: a
    rank beyond the units works on an empty share, which every stage supports.)"""
    nproc = int(config.nproc)
    if nproc <= 1:
        return config
    check_nproc(nproc)
    units, what = count_units()
    cores = available_cores()
    capped = max(1, min(nproc, units, cores))
    if capped == nproc:
        return config
    notes.add(f"--nproc {nproc} capped to {_count(capped, 'worker')}: {_count(units, what)}, "
              f"{_count(cores, 'core')}")
    return dataclasses.replace(config, nproc=capped)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def check_nproc(nproc: int) -> None:
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if nproc > 1 and in_launched_worker():
        raise UsageError("--nproc cannot be used under torchrun; torchrun already started the workers")


def launch(entry: Callable[[Any], Any], config: Any, nproc: int, cleanup: Sequence[str] = ()) -> Any:
    """Run ``entry(config)`` in ``nproc`` local workers.

    On the CPU the workers form a torch-free :mod:`~varlen_cli.runtime.local_group` (pipes between
    forked or spawned processes); with ``--device cuda``, or ``VARLEN_LAUNCHER=torch``, they are
    started by torch's elastic launcher (the engine behind torchrun) and join a gloo/nccl group.
    Returns rank 0's return value. If any worker fails, the others are stopped, the paths in
    ``cleanup`` are removed, and the failing worker's error is raised here: its own
    :class:`VarlenError` when it had one, else a :class:`WorkerError` naming the worker.
    """
    # spawn is safe in any process (threads, CUDA, tokenizer pools); the command line asks for fork
    # (see cli.main), which starts workers faster because they need not import anything again.
    start_method = os.environ.get("VARLEN_START_METHOD", "spawn")
    if start_method not in ("spawn", "fork", "forkserver"):
        raise UsageError(f"VARLEN_START_METHOD must be spawn, fork or forkserver, not {start_method!r}")
    launcher = os.environ.get("VARLEN_LAUNCHER", "auto")
    if launcher not in ("auto", "local", "torch"):
        raise UsageError(f"VARLEN_LAUNCHER must be auto, local or torch, not {launcher!r}")
    cuda = getattr(config, "device", "cpu") == "cuda"
    if launcher == "local" and cuda:
        raise UsageError("VARLEN_LAUNCHER=local starts CPU workers; --device cuda needs VARLEN_LAUNCHER=auto or torch")
    use_torch = launcher == "torch" or cuda
    if not use_torch and not local_group.fits_fd_limit(nproc):
        use_torch = True  # a local group needs a pipe per pair of workers: more than this process may open
    from .safety import clean_launcher_dirs, launcher_dir

    clean_launcher_dirs()  # of killed launchers
    error_dir = launcher_dir()
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    worker_env = {"OMP_NUM_THREADS": threads, "RAYON_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "true",
                  "VARLEN_ERROR_DIR": error_dir}
    try:
        if use_torch:
            return _launch_elastic(entry, config, nproc, start_method, worker_env, error_dir)
        return local_group.launch_local(functools.partial(worker_entry, entry), config, nproc, start_method,
                                        worker_env, error_dir, collective_timeout())
    except local_group.WorkersFailed as exc:
        _remove_all(cleanup)
        raise failure_error(exc.exitcodes, error_dir) from None
    except BaseException as exc:
        _remove_all(cleanup)
        _reraise_signal(exc)
        raise
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)


def _remove_all(paths: Sequence[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _launch_elastic(entry: Callable[[Any], Any], config: Any, nproc: int, start_method: str, worker_env: dict,
                    error_dir: str) -> Any:
    """``launch`` through torch's elastic agent; a failure becomes :class:`local_group.WorkersFailed`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config_ = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"varlen-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.05,
        start_method=start_method,
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(error_dir, "logs")),
    )
    try:
        with _quiet_elastic_logs(), _environ(worker_env):
            results = elastic_launch(config_, worker_entry)(entry, config)
    except ChildFailedError as exc:
        failures = getattr(exc, "failures", {})
        first = exc.get_first_failure()[0] if failures else None
        codes = {first: failures[first].exitcode} if first is not None else {}
        codes.update({rank: f.exitcode for rank, f in failures.items()})
        raise local_group.WorkersFailed(codes) from None
    return results.get(0)


def _reraise_signal(exc: BaseException) -> None:
    """The elastic agent turns SIGINT/SIGTERM into its SignalException (after stopping the workers):
    raise what one process would have seen instead (exit 130 for SIGINT, 143 for SIGTERM)."""
    sigval = getattr(exc, "sigval", None)
    if type(exc).__name__ != "SignalException" or sigval is None:
        return
    from .safety import Terminated

    if sigval == signal.SIGINT:
        raise KeyboardInterrupt() from None
    raise Terminated() from None


def worker_entry(entry: Callable[[Any], Any], config: Any) -> Any:
    """Top of every launched worker: run the stage, and on failure leave a record for the parent."""
    try:
        return entry(config)
    except BaseException as exc:  # noqa: BLE001 - re-raised as an exit code below
        code = exc.exit_code if isinstance(exc, VarlenError) else 1
        if isinstance(exc, SystemExit):
            raise
        record = {
            "rank": int(os.environ.get("RANK", 0)),
            "type": type(exc).__name__ if isinstance(exc, VarlenError) else "internal",
            "message": exc.message if isinstance(exc, VarlenError) else f"{type(exc).__name__}: {exc}",
            "exit_code": code,
            "traceback": traceback.format_exc(),
            "time": getattr(exc, "created_at", time.time()),
        }
        error_dir = os.environ.get("VARLEN_ERROR_DIR")
        if error_dir:
            path = os.path.join(error_dir, f"rank-{record['rank']:05d}.json")
            with open(path + ".tmp", "w") as fh:
                json.dump(record, fh)
            os.replace(path + ".tmp", path)
        sys.exit(code)


def failure_error(exitcodes: dict, error_dir: str) -> VarlenError:
    """The user's error for a failed job: ``exitcodes`` maps the failed ranks (the first to fail
    first) to their exit codes; ``error_dir`` holds the records :func:`worker_entry` left."""
    records = []
    for name in sorted(os.listdir(error_dir)):
        if name.endswith(".json"):
            with open(os.path.join(error_dir, name)) as fh:
                records.append(json.load(fh))
    # A user error explains the failure best; other workers then fail only as a consequence.
    user = [r for r in records if r["type"] in ERROR_CLASSES and r["type"] != "WorkerError"]
    # A worker killed by a signal leaves no record; its peers then fail on the closed connection,
    # and the killed worker, not they, is the cause.
    recorded = {r["rank"] for r in records}
    # (The elastic agent stops the other workers with SIGTERM: those are not the cause.)
    killed = sorted(rank for rank, code in exitcodes.items()
                    if rank not in recorded and code is not None and code < 0)
    killed.sort(key=lambda rank: exitcodes[rank] == -signal.SIGTERM)
    if not user and killed:
        code = exitcodes[killed[0]]
        error = WorkerError(f"worker {killed[0]} was killed by signal {-code}; all workers were stopped")
        first = None
    elif user:
        first = min(user, key=lambda r: r["time"])
        error = ERROR_CLASSES[first["type"]](first["message"])
    elif records:
        first = min(records, key=lambda r: r["time"])
        error = WorkerError(f"worker {first['rank']} failed: {first['message']}")
    else:
        rank, code = next(iter(exitcodes.items()), (0, None))
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        error = WorkerError(f"worker {rank} {how}; all workers were stopped")
        first = None
    if first is not None:
        error.worker_traceback = first["traceback"]  # type: ignore[attr-defined]
    return error


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher",
                                                      "torch.distributed.elastic.multiprocessing",
                                                      "torch.multiprocessing",
                                                      "torch.distributed.elastic.agent.server.api")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run_distributed(entry: Callable[[Any], Any], config: Any, nproc: int, cleanup: Sequence[str] = ()) -> Any:
    """Run a stage: in this process (world size 1 or under torchrun), or in ``nproc`` local workers."""
    check_nproc(nproc)
    if nproc == 1:
        return entry(config)
    return launch(entry, config, nproc, cleanup=cleanup)
