"""What keeps outputs safe: input/output overlap, what ``--overwrite`` may replace, output locks,
leftovers of killed runs, and SIGTERM turned into an exception so cleanup runs.

Used by :mod:`varlen_cli.runtime.artifacts` (``AtomicDir``, ``AtomicFile``); docs/commands.md
"Output safety" lists the guarantees.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import signal
import stat
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ..errors import InputError, OutputError
from .files import open_regular

TMP_TAG = ".varlen-tmp"
OLD_TAG = ".varlen-old"
LOCK_TAG = ".varlen-lock"
_HELD_ENV = "VARLEN_HELD_LOCKS"  # locks this process (or its launcher) holds; children inherit it
LAUNCH_PREFIX = "varlen-launch-"  # launcher temporary directories: varlen-launch-<pid>-<random>
STALE_UNREADABLE_LOCK_S = 60.0


def sibling(path: str, tag: str, unique: bool = False) -> str:
    """``.NAME<tag>`` beside ``path`` (``-<random>`` appended when ``unique``)."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}{tag}" + (f"-{uuid.uuid4().hex[:12]}" if unique else ""))


# -- inputs and outputs must not overlap -------------------------------------------------------------
def _source_root(source: str) -> str:
    """The directory part of a source before any glob wildcard (the source itself if it has none)."""
    for i, ch in enumerate(source):
        if ch in "*?[":
            return os.path.dirname(source[:i]) or "."
    return source


def _inside(child: str, parent: str) -> bool:
    return child != parent and child.startswith(parent.rstrip(os.sep) + os.sep)


def check_no_overlap(output: str, inputs: Iterable[str]) -> None:
    """Refuse an output that is, contains, or lies inside one of ``inputs`` (OutputError, exit 4).
    An object-storage output is compared with the inputs in the same store by key prefix."""
    from .. import storage

    if storage.is_remote(output):
        return _check_no_remote_overlap(output, [str(g) for g in inputs if g and storage.is_remote(str(g))])
    out = os.path.realpath(output)
    for given in inputs:
        if not given or storage.is_remote(str(given)):
            continue  # an object-storage input cannot overlap a local output
        inp = os.path.realpath(_source_root(str(given)))
        if out == inp:
            how = "is"
        elif _inside(inp, out):
            how = "contains"
        elif _inside(out, inp) and os.path.isdir(inp):
            how = "lies inside"
        else:
            continue
        raise OutputError(f"output {output} {how} the input {given}; write the output elsewhere")


def _check_no_remote_overlap(output: str, inputs: list[str]) -> None:
    path = output.rstrip("/")
    for given in inputs:
        root = given.split("*", 1)[0].rstrip("/")
        if path == root or path.startswith(root + "/") or root.startswith(path + "/"):
            raise OutputError(f"output {path} overlaps the input {given}; write the output elsewhere")


# Config fields that name input paths, and fields that name user code as MODULE:FUNCTION (its file
# is an input too). A new input option of a stage belongs here, so no output can swallow it.
INPUT_FIELDS = ("sources", "metrics_dir", "input", "metrics", "plan", "extend", "state", "tokenizer", "hf_config",
                "memory_profile")
CODE_FIELDS = ("difficulty", "model", "schedule")
# `varlen run`: the stages' options, by stage
NESTED_FIELDS = ("analyze", "sort", "plan")


def stage_inputs(config) -> list[str]:
    """Every input a stage config names: sources, metrics/sorted directories, plans, sampler states,
    tokenizers, configs, memory profiles, the directories of ``--mix`` and the files of user code
    (``--difficulty``/``--model``/``--schedule`` MODULE:FUNCTION). ``config`` is a config dataclass or
    a dict of its fields (``varlen run`` keeps the stages' options as dicts)."""
    from .user_code import module_path

    def get(name):
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    found: list[str] = []
    for name in INPUT_FIELDS:
        value = get(name)
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [str(v) for v in value]
    for name in CODE_FIELDS:
        value = get(name)
        path = module_path(value) if isinstance(value, str) else None
        if path is not None:
            found.append(path)
    mix = get("mix")
    if isinstance(mix, str):  # name=DIR:weight,...
        for item in mix.split(","):
            where, sep, _weight = item.partition("=")[2].strip().rpartition(":")
            found.append(where if sep else item.partition("=")[2].strip())
    for name in NESTED_FIELDS:
        value = get(name)
        if isinstance(value, dict):
            found += stage_inputs(value)
    return [f for f in found if f]


# -- what --overwrite may replace ---------------------------------------------------------------------
def _json(path: str) -> dict | None:
    try:
        with open_regular(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError, InputError):
        return None
    return data if isinstance(data, dict) else None


def _json_format(path: str) -> str | None:
    data = _json(path)
    return data.get("format") if data is not None else None


def made_by_varlen_dir(path: str) -> bool:
    """A varlen metrics/sorted directory (``_manifest.json``), a ``varlen run`` output (``_run.json``),
    or an empty directory (nothing to lose)."""
    if not os.listdir(path):
        return True
    from .. import format

    return (_json_format(os.path.join(path, format.MANIFEST_NAME)) == format.METRICS_FORMAT
            or _json_format(os.path.join(path, format.RUN_MANIFEST_NAME)) == format.RUN_FORMAT)


def foreign_entries(path: str) -> list[str]:
    """What a varlen directory holds that varlen did not write there, as paths relative to ``path``:
    anything but the manifest and the parts it lists (metrics/sorted), or, in a ``varlen run``
    output, anything but ``_run.json``, ``plan.parquet`` and the ``metrics``/``sorted`` directories
    (checked the same way)."""
    from .. import format

    names = set(os.listdir(path))
    run = _json(os.path.join(path, format.RUN_MANIFEST_NAME))
    if run is not None and run.get("format") == format.RUN_FORMAT:
        ours = {format.RUN_MANIFEST_NAME, "plan.parquet"}
        foreign = sorted(names - ours - {"metrics", "sorted"})
        for sub in sorted(names & {"metrics", "sorted"}):
            inner = os.path.join(path, sub)
            if os.path.isdir(inner) and not os.path.islink(inner) and made_by_varlen_dir(inner):
                foreign += [os.path.join(sub, name) for name in foreign_entries(inner)]
            else:
                foreign.append(sub)
        return foreign
    manifest = _json(os.path.join(path, format.MANIFEST_NAME)) or {}
    parts = manifest.get("parts") if isinstance(manifest.get("parts"), list) else []
    ours = {format.MANIFEST_NAME} | {str(p.get("file")) for p in parts if isinstance(p, dict)}
    return sorted(names - ours)


def _listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def made_by_varlen_file(path: str) -> bool:
    """A Parquet file whose schema metadata says it is a varlen plan (never a FIFO or other non-regular file)."""
    from .. import format

    if not _regular_file(path):
        return False
    try:
        format.read_plan_metadata(path)
    except format.FormatError as exc:
        return "plan format version" in str(exc)  # a plan of another version is still varlen's
    except Exception:  # noqa: BLE001 - pyarrow raises many types for files that are no Parquet at all
        return False
    return True


def _regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def check_replaceable(path: str, overwrite: bool, kind: str, json_format: str | None = None) -> None:
    """Refuse to replace an existing ``path`` unless ``--overwrite`` and varlen made it and holds
    nothing else: ``kind`` ``dir`` (a metrics, sorted or run directory, without files varlen did not
    write there), ``file`` (a plan) or ``json`` (a JSON file whose ``format`` is ``json_format``, such
    as a memory profile). Symbolic links are never replaced (nor their targets)."""
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise OutputError(f"output {path} already exists; pass --overwrite to replace it")
    if os.path.islink(path):
        raise OutputError(f"output {path} is a symbolic link; --overwrite does not replace links or their targets "
                          "(remove the link or give the real path)")
    if kind == "dir":
        if not os.path.isdir(path):
            raise OutputError(f"output {path} exists and is not a directory")
        if not made_by_varlen_dir(path):
            raise OutputError(f"output {path} is a directory varlen did not make (no varlen _manifest.json or "
                              "_run.json); --overwrite replaces only varlen outputs")
        foreign = foreign_entries(path)
        if foreign:
            raise OutputError(f"output {path} holds files varlen did not write ({_listed(foreign)}); --overwrite "
                              "replaces only what varlen made: move them out first")
    elif kind == "json":
        if os.path.isdir(path):
            raise OutputError(f"output {path} is a directory; give a file name")
        if not _regular_file(path) or _json_format(path) != json_format:
            raise OutputError(f"output {path} is not a {json_format.replace('-', ' ')}; --overwrite replaces only "
                              "varlen outputs")
    else:
        if os.path.isdir(path):
            raise OutputError(f"output {path} is a directory; give a file name such as plan.parquet")
        if not made_by_varlen_file(path):
            raise OutputError(f"output {path} is not a varlen plan; --overwrite replaces only varlen outputs")


# -- output locks --------------------------------------------------------------------------------------
def _held() -> list[str]:
    return [p for p in os.environ.get(_HELD_ENV, "").split(os.pathsep) if p]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(lock: str) -> bool:
    """A lock left by a dead process on this host (or unreadable and old)."""
    try:
        with open_regular(lock) as fh:
            owner = json.load(fh)
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError, InputError):
        try:
            return time.time() - os.path.getmtime(lock) > STALE_UNREADABLE_LOCK_S
        except OSError:
            return True
    return host == platform.node() and not _pid_alive(pid)


def _owner(lock: str) -> str:
    try:
        with open_regular(lock) as fh:
            owner = json.load(fh)
        return f"pid {owner['pid']} on {owner['host']}"
    except (OSError, ValueError, KeyError, TypeError, InputError):
        return "another process"


def _try_lock(lock: str, path: str) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        raise OutputError(f"cannot create output {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as fh:
        json.dump({"pid": os.getpid(), "host": platform.node(), "time": time.time()}, fh)
    return True


def _take_over(lock: str, shown: str) -> bool:
    """Replace a stale lock by ours. One process at a time breaks a lock (``LOCK.break``, O_EXCL),
    so two runs that both found it stale cannot both take it."""
    breaker = lock + ".break"
    if os.path.exists(breaker) and _stale(breaker):
        _remove(breaker)  # left by a process killed while breaking
    if not _try_lock(breaker, shown):
        return False
    try:
        if not _stale(lock):
            return False
        _remove(lock)
        return _try_lock(lock, shown)
    finally:
        _remove(breaker)


@contextmanager
def output_lock(path: str, shown: str | None = None) -> Iterator[None]:
    """Hold ``.NAME.varlen-lock`` beside ``path`` for the duration (O_EXCL, pid and host inside).

    A lock of a dead process on this host is taken over; a live one makes this run fail at once
    (OutputError). Re-entrant: workers started by a process that holds the lock inherit it. While
    it is held, leftovers of killed runs beside ``path`` are cleaned (:func:`clean_leftovers`).
    """
    lock = sibling(path, LOCK_TAG)
    shown = shown or path  # the output as the user wrote it, for messages
    make_parent(path, shown)
    if lock in _held():
        yield
        return
    if not _try_lock(lock, shown) and not _take_over(lock, shown):
        raise OutputError(f"output {shown} is being written by {_owner(lock)} (lock {lock}); wait for it to "
                          "finish, or remove the lock if that process is gone")
    saved = os.environ.get(_HELD_ENV)
    os.environ[_HELD_ENV] = os.pathsep.join(_held() + [lock])
    try:
        clean_leftovers(path)
        yield
    finally:
        if saved is None:
            os.environ.pop(_HELD_ENV, None)
        else:
            os.environ[_HELD_ENV] = saved
        _remove(lock)


def make_parent(path: str, shown: str) -> None:
    """Create the missing directories above a local output, as most tools do (``-o new/dir/plan.parquet``)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(parent):
        return
    above = parent
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise OutputError(f"cannot create output {shown}: {above} is not a directory")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create output {shown}: cannot create directory {parent}: {exc.strerror}") from None


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    except OSError:
        pass


def clean_leftovers(path: str) -> None:
    """Remove what killed runs left beside ``path`` (call with its lock held): temporaries, and old
    outputs set aside for a swap; an old output whose swap never finished is put back first."""
    parent, name = os.path.split(os.path.abspath(path))
    olds = sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}{OLD_TAG}*")))
    if olds and not os.path.lexists(path):
        os.rename(olds.pop(), path)  # killed between the two renames of a swap: the old output is back
    for leftover in olds + glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}{TMP_TAG}*")):
        _remove(leftover)
    clean_launcher_dirs()


def launcher_dir() -> str:
    """A fresh temporary directory for the ``--nproc`` launcher, named after this process."""
    return tempfile.mkdtemp(prefix=f"{LAUNCH_PREFIX}{os.getpid()}-")


def clean_launcher_dirs() -> None:
    """Remove launcher directories of processes that no longer run."""
    for d in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{LAUNCH_PREFIX}*")):
        pid = os.path.basename(d)[len(LAUNCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


# -- swaps ---------------------------------------------------------------------------------------------
def swap_in(tmp: str, path: str) -> None:
    """Put the finished ``tmp`` at ``path``: the old output is renamed aside, the new one in, then the
    old one deleted. Killed between the renames, the next run puts the old output back."""
    if os.path.lexists(path):
        old = sibling(path, OLD_TAG, unique=True)
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
        _remove(old)
    else:
        os.rename(tmp, path)


def identity(path: str | None) -> tuple[int, int] | None:
    """``(device, inode)`` of ``path`` (not following a link), or None when it does not exist. A
    swap puts a new inode at the path (the temporary was made while the old output existed), so a
    changed identity under the output lock means this run's output was committed."""
    try:
        st = os.lstat(path) if path else None
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st is not None else None


# -- SIGTERM -----------------------------------------------------------------------------------------
class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so ``finally`` blocks and cleanups run."""

    exit_code = 143


def _raise_terminated(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Terminated()


def install_sigterm_handler() -> None:
    """SIGTERM raises :class:`Terminated` (only from the main thread, only over the default action)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _raise_terminated)
