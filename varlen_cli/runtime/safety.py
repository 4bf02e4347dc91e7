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
from ..storage.files import open_regular

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
    """The folder part of a source before any glob wildcard (``*``, ``?``, ``[``), local or in object
    storage; the source itself if it has none."""
    from .. import storage

    if any(ch in source for ch in "*?[") and storage.scheme(source) not in ("http", "https") and storage.exists(source):
        return source  # a path with wildcards in its name, read as named (analyze's discovery)
    for i, ch in enumerate(source):
        if ch in "*?[":
            head = source[:i]
            if not storage.is_remote(source):
                return os.path.dirname(head) or "."
            cut = head.rfind("/")
            return head[:cut] if cut >= head.find("://") + 3 else head
    return source


def _inside(child: str, parent: str, sep: str = os.sep) -> bool:
    return child != parent and child.startswith(parent.rstrip(sep) + sep)


def check_no_overlap(output: str, inputs: Iterable[str]) -> None:
    """Refuse an output that is, contains, or lies inside one of ``inputs`` (OutputError, exit 4).
    An object-storage output is compared with the inputs in the same store by key prefix, by the
    same rules (an input's glob counts from its folder)."""
    from .. import storage

    if storage.scheme(output) in ("file", "local"):  # else written below the current directory, in ./file:/
        raise OutputError(f"output {output} is a URL; varlen writes a local output by its path: give "
                          f"{storage.local_path(output)}")
    remote = storage.is_remote(output)
    sep = "/" if remote else os.sep
    out = output.rstrip("/") if remote else os.path.realpath(output)
    for given in inputs:
        if not given or storage.is_remote(str(given)) != remote:
            continue  # a local path and an object cannot overlap
        root = _source_root(str(given) if remote else storage.local_path(str(given)))  # file:///x is /x
        inp = root.rstrip("/") if remote else os.path.realpath(root)
        if out == inp:
            how = "is"
        elif _inside(inp, out, sep):
            how = "contains"
        elif _inside(out, inp, sep) and (remote or os.path.isdir(inp)):
            how = "lies inside"
        else:
            continue
        raise OutputError(f"output {output} {how} the input {given}; write the output elsewhere")


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
            found += [str(v) for v in value if isinstance(v, (str, os.PathLike))]  # not an in-memory dataset
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
# What varlen wrote in an output directory is decided by its manifests, which list exactly that: a
# metrics/sorted directory's _manifest.json (itself and its parts), a run's _run.json (its plan and its
# metrics/sorted directories, each checked the same way), and, while an object-storage output is being
# published, the commit marker (the names being written and those being replaced). Anything else is
# the user's: --overwrite refuses, naming it. One rule for local directories and object-storage prefixes
# (a tree: LocalTree, RemoteTree).
COMMIT_MARKER = "_varlen_commit.json"
COMMIT_FORMAT = "varlen-commit"


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


class LocalTree:
    """The entries of a local output directory, for the ownership rules."""

    def __init__(self, root: str):
        self.root = root

    def entries(self, sub: str = "") -> dict[str, bool]:
        """``{name: is a directory}`` of the folder ``sub`` (links are no directories)."""
        folder = os.path.join(self.root, sub)
        return {n: os.path.isdir(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n))
                for n in os.listdir(folder)}

    def read_json(self, rel: str) -> dict | None:
        return _json(os.path.join(self.root, rel))

    @staticmethod
    def join(sub: str, name: str) -> str:
        return os.path.join(sub, name) if sub else name


class RemoteTree:
    """The objects below an object-storage prefix (one listing), for the ownership rules; a key with
    keys below it (``a`` and ``a/b``) is a directory."""

    def __init__(self, root: str, objects: Iterable[str]):
        from .. import storage

        self.root = root.rstrip("/")
        self.names = sorted(storage.relpath(o, self.root) for o in objects)

    def entries(self, sub: str = "") -> dict[str, bool]:
        prefix = sub + "/" if sub else ""
        out: dict[str, bool] = {}
        for rel in self.names:
            if rel.startswith(prefix):
                head, sep, _ = rel[len(prefix):].partition("/")
                out[head] = out.get(head, False) or bool(sep)
        return out

    def read_json(self, rel: str) -> dict | None:
        """The JSON object ``rel`` holds (None when it is missing or no JSON object); a store that
        fails to answer raises (OutputError on the output side)."""
        from .. import storage

        if rel not in self.names:
            return None
        try:
            data = json.loads(storage.read_bytes(storage.join(self.root, rel)))
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    @staticmethod
    def join(sub: str, name: str) -> str:
        return f"{sub}/{name}" if sub else name


def _listed_by_manifest(tree, sub: str) -> set[str]:
    """What a varlen manifest in ``sub`` says varlen wrote there: a metrics/sorted ``_manifest.json``
    (itself and its parts) or a ``varlen export`` ``_export.json`` (itself and its files)."""
    from .. import format

    manifest = tree.read_json(tree.join(sub, format.MANIFEST_NAME))
    if manifest is not None and manifest.get("format") == format.METRICS_FORMAT:
        parts = manifest.get("parts") if isinstance(manifest.get("parts"), list) else []
        return {format.MANIFEST_NAME} | {str(p.get("file")) for p in parts if isinstance(p, dict)}
    export = tree.read_json(tree.join(sub, format.EXPORT_MANIFEST_NAME))  # varlen export deepspeed
    if export is not None and export.get("format") == format.DEEPSPEED_EXPORT_FORMAT:
        files = export.get("files") if isinstance(export.get("files"), list) else []
        return {format.EXPORT_MANIFEST_NAME} | {str(f) for f in files}
    return set()


def _listed_by_marker(tree, sub: str) -> set[str]:
    """What a commit marker in ``sub`` says varlen was writing and replacing there (and the marker).
    A marker of an older varlen (no ``files``) vouches for itself only."""
    marker = tree.read_json(tree.join(sub, COMMIT_MARKER))
    if marker is None:
        return set()
    if marker.get("format") == COMMIT_FORMAT:
        listed = [n for key in ("files", "replaces") for n in marker.get(key) or [] if isinstance(n, str)]
        return {COMMIT_MARKER, *listed}
    return {COMMIT_MARKER} if TMP_TAG in str(marker.get("from", "")) else set()


def _run_record(tree, sub: str = "") -> bool:
    from .. import format

    run = tree.read_json(tree.join(sub, format.RUN_MANIFEST_NAME))
    return run is not None and run.get("format") == format.RUN_FORMAT


def made_by_varlen_dir(path_or_tree, sub: str = "") -> bool:
    """A varlen metrics/sorted directory (``_manifest.json``), a ``varlen run`` output (``_run.json``),
    a ``varlen export`` output (``_export.json``), a prefix a varlen commit marker vouches for, or an
    empty directory (nothing to lose)."""
    tree = LocalTree(path_or_tree) if isinstance(path_or_tree, str) else path_or_tree
    if not tree.entries(sub):
        return True
    return bool(_listed_by_manifest(tree, sub) or _listed_by_marker(tree, sub)) or _run_record(tree, sub)


def foreign_entries(path_or_tree, sub: str = "") -> list[str]:
    """What a varlen directory holds that varlen did not write there, relative to it (a directory
    with a trailing ``/``): anything its manifests do not list (:func:`made_by_varlen_dir`); in a
    ``varlen run`` output anything but ``_run.json``, ``plan.parquet`` and the ``metrics``/``sorted``
    directories, which are checked the same way. A listed name that is a directory is foreign."""
    from .. import format

    tree = LocalTree(path_or_tree) if isinstance(path_or_tree, str) else path_or_tree
    names = tree.entries(sub)
    shown = {n: n + "/" if is_dir else n for n, is_dir in names.items()}
    if _run_record(tree, sub):
        ours = {format.RUN_MANIFEST_NAME, "plan.parquet"}
        foreign = sorted(shown[n] for n in names if n not in ours | {"metrics", "sorted"} or names[n] and n in ours)
        for inner in sorted(set(names) & {"metrics", "sorted"}):
            inner_sub = tree.join(sub, inner)
            if names[inner] and made_by_varlen_dir(tree, inner_sub):
                foreign += [tree.join(inner, n) for n in foreign_entries(tree, inner_sub)]
            else:
                foreign.append(shown[inner])
        return foreign
    ours = _listed_by_manifest(tree, sub) | _listed_by_marker(tree, sub)
    return sorted(shown[n] for n in names if n not in ours or names[n])


def listed(names: list[str], limit: int = 5) -> str:
    """``a, b, c, d, e and 3 more``."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_dir_ours(given: str, tree, noun: str = "directory") -> None:
    """Refuse to replace the existing output directory (``noun``: or prefix) ``given`` unless varlen
    made it and it holds nothing else (OutputError, exit 4)."""
    if not made_by_varlen_dir(tree):
        raise OutputError(f"output {given} is a {noun} varlen did not make (no varlen _manifest.json or "
                          "_run.json); --overwrite replaces only varlen outputs")
    foreign = foreign_entries(tree)
    if foreign:
        what = "objects" if isinstance(tree, RemoteTree) else "files"
        raise OutputError(f"output {given} holds {what} varlen did not write ({listed(foreign)}); --overwrite "
                          "replaces only what varlen made: move them out first")


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


MARKED_SUFFIX = {"report": "html", "trace": "json"}


def made_by_varlen_mark(path: str, kind: str) -> bool:
    """A page or image of ``varlen report`` (``kind`` ``report``) or a ``varlen simulate --trace`` file
    (``trace``): its mark (``format.OUTPUT_MARKS``) in the first 4 KiB, so a large file is not read."""
    from .. import format

    if not _regular_file(path):
        return False
    try:
        with open_regular(path, "rb") as fh:
            head = fh.read(4096)
    except (OSError, InputError):
        return False
    return any(mark.encode() in head for mark in format.OUTPUT_MARKS[kind])


def _regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def check_file_name(path: str, example: str = "plan.parquet") -> None:
    """Refuse a file output named like a folder (``out/``, local or in object storage): it would be
    written as a file named ``out``."""
    if str(path).endswith(("/", os.sep)):
        raise OutputError(f"output {path} ends with '/', which names a folder; give a file name such as "
                          f"{path}{example}")


def check_replaceable(path: str, overwrite: bool, kind: str, json_format: str | None = None):
    """Refuse to replace an existing ``path`` unless ``--overwrite`` and varlen made it and holds
    nothing else: ``kind`` ``dir`` (a metrics, sorted or run directory, without files varlen did not
    write there), ``file`` (a plan), ``json`` (a JSON file whose ``format`` is ``json_format``, such
    as a memory profile), ``report`` (a page or image of ``varlen report``) or ``trace`` (a ``varlen
    simulate --trace`` file). Symbolic links are never replaced (nor their targets). An object-storage
    ``path`` follows the same rules (:func:`check_remote_replaceable`), whose result it returns."""
    from .. import storage

    if storage.is_remote(path):
        return check_remote_replaceable(path, overwrite, kind, json_format)
    if not os.path.lexists(path):
        return None
    if not overwrite:
        raise OutputError(f"output {path} already exists; pass --overwrite to replace it")
    if os.path.islink(path):
        raise OutputError(f"output {path} is a symbolic link; --overwrite does not replace links or their targets "
                          "(remove the link or give the real path)")
    if kind == "dir":
        if not os.path.isdir(path):
            raise OutputError(f"output {path} exists and is not a directory")
        check_dir_ours(path, LocalTree(path))
    elif kind == "json":
        if os.path.isdir(path):
            raise OutputError(f"output {path} is a directory; give a file name")
        if not _regular_file(path) or _json_format(path) != json_format:
            raise OutputError(f"output {path} is not a {json_format.replace('-', ' ')}; --overwrite replaces only "
                              "varlen outputs")
    elif kind in ("report", "trace"):
        if os.path.isdir(path):
            raise OutputError(f"output {path} is a directory; give a file name such as {kind}.{MARKED_SUFFIX[kind]}")
        if not made_by_varlen_mark(path, kind):
            raise OutputError(f"output {path} is not a varlen {kind}; --overwrite replaces only varlen outputs")
    else:
        if os.path.isdir(path):
            raise OutputError(f"output {path} is a directory; give a file name such as plan.parquet")
        if not made_by_varlen_file(path):
            raise OutputError(f"output {path} is not a varlen plan; --overwrite replaces only varlen outputs")
    return None


def check_remote_place(path: str, kind: str) -> None:
    """Refuse an object-storage output at a bucket's root (``s3://B``): the output's temporary goes
    beside the output, and a bucket has no beside (inside it, the whole bucket would be the output);
    and a file output named like a prefix (``s3://B/dir/``)."""
    from .. import storage

    root = path.rstrip("/")
    scheme, _, rest = root.partition("://")
    bucket, _, key = rest.partition("/")
    if "//" in key or key.startswith("/"):
        tidy = f"{scheme}://{bucket}/" + "/".join(part for part in key.split("/") if part)
        raise OutputError(f"output {path} has an empty segment ('//') in its key, which object-storage listings do not "
                          f"keep (varlen could not find what it wrote); give {tidy}")
    if storage.parent(root) == root:
        example = "a prefix such as {}/metrics" if kind == "dir" else "a key such as {}/plan.parquet"
        raise OutputError(f"output {path} is a whole bucket: varlen writes an output beside its temporary, inside "
                          f"a bucket, and replaces only what it wrote; give {example.format(root)}")
    if kind != "dir":
        check_file_name(path)


def check_remote_replaceable(path: str, overwrite: bool, kind: str, json_format: str | None = None):
    """:func:`check_replaceable` in object storage: the same rules, decided from one listing (every
    error, the store's own included, is an OutputError). A directory output returns the
    :class:`RemoteTree` of what is there now (empty for a new output): all varlen's to replace."""
    from .. import storage

    check_remote_place(path, kind)
    with storage.translate_errors(path, write=True):
        if kind == "dir":
            return _check_remote_dir(path.rstrip("/"), overwrite)
        if storage.isdir(path):
            raise OutputError(f"output {path} is a directory; give a file name such as plan.parquet")
        if not storage.isfile(path):
            return None
        if not overwrite:
            raise OutputError(f"output {path} already exists; pass --overwrite to replace it")
        if not _remote_file_ours(path, kind, json_format):
            what = "varlen plan" if kind == "file" else json_format.replace("-", " ")
            raise OutputError(f"output {path} is not a {what}; --overwrite replaces only varlen outputs")
    return None


def _check_remote_dir(path: str, overwrite: bool) -> RemoteTree:
    from .. import storage

    if storage.isfile(path):
        raise OutputError(f"output {path} exists and is not a directory")
    tree = RemoteTree(path, storage.find(path + "/"))
    if tree.names:
        if not overwrite:
            raise OutputError(f"output {path} already exists; pass --overwrite to replace it")
        check_dir_ours(path, tree, "prefix")
    return tree


def _remote_file_ours(path: str, kind: str, json_format: str | None) -> bool:
    from .. import format, storage

    if kind == "json":
        try:
            return json.loads(storage.read_bytes(path)).get("format") == json_format
        except (ValueError, AttributeError):
            return False
    try:  # the footer alone (one read): a store that fails is an OutputError here, bad bytes an InputError
        _, metadata = storage.parquet_footer(path, storage.stat(path).size)
        return format.is_plan_schema(metadata.schema.to_arrow_schema())
    except InputError:
        return False  # no Parquet at all: not a plan


# -- output locks --------------------------------------------------------------------------------------
def _held() -> list[str]:
    return [p for p in os.environ.get(_HELD_ENV, "").split(os.pathsep) if p]


def pid_alive(pid: int) -> bool:
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
    return host == platform.node() and not pid_alive(pid)


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
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
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
