"""Output directories in object storage (``-o s3://bucket/metrics``): nothing half-written is visible,
nothing varlen did not write is replaced.

Object stores have no rename, so the local swap of :mod:`.safety` cannot be used. Instead:

1. rank 0 checks the output with the rules of a local output (:func:`.safety.check_replaceable`: a
   prefix varlen did not make, or one holding objects varlen did not write, is refused with
   ``--overwrite`` too, naming them), removes stale temporaries of killed runs
   (:func:`clean_stale_temporaries`) and starts a hidden temporary prefix beside the output,
   ``.NAME.varlen-tmp-<random>/``, with its owner record (``_varlen_tmp.json``: host, pid, time);
2. every rank writes its files into a local staging folder (``out.file(name)``, as for a local
   output), then uploads them to the temporary prefix (each upload read back: its size);
3. once every rank has uploaded (a barrier) and rank 0 has called ``out.commit()``, rank 0 checks the
   output again and publishes (:meth:`RemoteAtomicDir.publish`): it writes the commit marker
   ``NAME/_varlen_commit.json``, which lists the objects being written and those of the old output
   being replaced (what a run killed in this window leaves is then still provably varlen's), deletes
   the old output's manifest, then its other objects, copies the new objects in, the
   ``_manifest.json`` **last** (the manifest is the commit marker readers go by: varlen, and anything
   that reads the manifest, sees a complete output or none), reads the listing back (every object,
   its size), and deletes the marker and the temporary prefix;
4. on failure the temporary prefix and the staging folders are removed; the output is untouched.

Only the objects the old output's manifests list are ever deleted, one by one, by their exact key.

A single file (a plan, ``-o s3://bucket/plan.parquet``) is written locally and uploaded with one PUT,
which object stores make visible whole or not at all, then read back (:func:`remote_atomic_file`).
A bucket root (``-o s3://bucket``) is refused (:func:`.safety.check_remote_place`).

Limits: there is no lock (two runs writing one prefix at once are not detected), and a run
killed during step 3 leaves the output without its manifest (refused until replaced).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from .. import format, storage
from ..errors import OutputError
from . import safety

COMMIT_MARKER = safety.COMMIT_MARKER
TMP_TAG = safety.TMP_TAG
OWNER_NAME = "_varlen_tmp.json"  # in a temporary prefix: who made it, and when
STALE_TMP_S = 24 * 3600.0  # a temporary of another host (or without an owner record) is stale after this
_TMP_FILES = re.compile(rf"^({re.escape(OWNER_NAME)}|{re.escape(format.MANIFEST_NAME)}|part-\d{{5,}}\.parquet)$")


def _tmp_prefix(path: str) -> str:
    return storage.join(storage.parent(path), f".{storage.name(path)}{TMP_TAG}-{uuid.uuid4().hex[:12]}")


def check(path: str, overwrite: bool, inputs: Iterable[str] = ()) -> safety.RemoteTree:
    """Refuse an output that overlaps an input, is a bucket root, exists without ``--overwrite``, or
    (with it) holds anything varlen did not write (OutputError, exit 4, like a local output; an
    unreachable store is an OutputError too). Returns what is there now (all varlen's)."""
    safety.check_no_overlap(path, inputs)
    return safety.check_replaceable(path, overwrite, "dir")


def check_file(path: str, overwrite: bool, json_format: str | None = None) -> None:
    """Refuse a file output that is a bucket or a prefix, exists without ``--overwrite``, or (with it)
    is not a varlen plan (``json_format``: not a JSON file of that format)."""
    safety.check_replaceable(path, overwrite, "file" if json_format is None else "json", json_format)


class _LocalFile:
    def __init__(self, path: str, tmp: str):
        self.given = self.path = path
        self.tmp = tmp


@contextmanager
def remote_atomic_file(path: str, overwrite: bool, json_format: str | None = None) -> Iterator[_LocalFile]:
    """Yield an object whose ``tmp`` is a local file to write; on success it is uploaded to ``path``
    in one PUT (visible whole or not at all) and read back; on failure nothing is uploaded."""
    check_file(path, overwrite, json_format)
    fd, tmp = tempfile.mkstemp(prefix="varlen-remote-file-", suffix=".parquet")
    os.close(fd)
    try:
        yield _LocalFile(path, tmp)
        check_file(path, overwrite, json_format)  # still ours to replace
        storage.put_file(tmp, path)
    finally:
        os.remove(tmp)


class RemoteAtomicDir:
    """An object-storage output directory with the interface of :class:`~.artifacts.AtomicDir`
    (``file``, ``commit``, ``path``, ``tmp``); see the module docstring for the protocol."""

    def __init__(self, path: str, overwrite: bool = False):
        self.given = path
        self.path = path.rstrip("/")
        self.overwrite = overwrite
        self.tmp = _tmp_prefix(self.path)  # rank 0's name is shared with every rank
        self._staging: str | None = None
        self.commit_requested = False
        self.created = False  # rank 0 started the temporary prefix (abort removes it)

    def check(self) -> safety.RemoteTree:
        return check(self.path, self.overwrite)

    def create(self) -> None:
        """Rank 0: remove stale temporaries of killed runs, then start ours with its owner record."""
        with storage.translate_errors(self.path, write=True):
            clean_stale_temporaries(self.path)
            self.created = True
            owner = {"pid": os.getpid(), "host": platform.node(), "time": time.time()}
            storage.write_bytes(storage.join(self.tmp, OWNER_NAME), json.dumps(owner).encode())

    def file(self, name: str) -> str:
        """A local path to write ``name`` to; uploaded to the temporary prefix by :meth:`upload`."""
        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix="varlen-remote-out-")
        return os.path.join(self._staging, name)

    def commit(self) -> None:
        """Rank 0, once the output is complete: publish it after every rank's upload."""
        self.commit_requested = True

    def upload(self) -> None:
        """This rank's staged files to the temporary prefix; the staging folder is removed."""
        if self._staging is None:
            return
        try:
            with storage.translate_errors(self.path, write=True):
                for name in sorted(os.listdir(self._staging)):
                    if ".tmp-" not in name:  # atomic_write_json's own temporaries
                        storage.put_file(os.path.join(self._staging, name), storage.join(self.tmp, name))
        finally:
            self.discard_staging()

    def publish(self) -> None:
        """Rank 0: replace what varlen wrote at the output by the temporary prefix's objects (the
        module docstring, step 3); remove the temporary."""
        with storage.translate_errors(self.path, write=True):
            old = self.check().names  # checked again: nothing but varlen's own is there now
            listed = {storage.relpath(o, self.tmp): info.size for o, info in storage.find_info(self.tmp + "/").items()}
            new = {n: size for n, size in listed.items() if _TMP_FILES.match(n) and n != OWNER_NAME}
            if format.MANIFEST_NAME not in new:
                raise OutputError(f"cannot write {self.path}: {self.tmp} holds no {format.MANIFEST_NAME}")
            marker = storage.join(self.path, COMMIT_MARKER)
            record = {"format": safety.COMMIT_FORMAT, "from": self.tmp, "files": sorted(new), "replaces": old}
            storage.write_bytes(marker, json.dumps(record).encode())
            # the old manifest first (the output reads as incomplete from then on), then its other objects
            gone = [n for n in old if n != COMMIT_MARKER and (n not in new or n == format.MANIFEST_NAME)]
            gone.sort(key=lambda n: n != format.MANIFEST_NAME)
            storage.remove_many([storage.join(self.path, n) for n in gone])
            for name in sorted(new, key=lambda n: n == format.MANIFEST_NAME):  # the manifest last
                storage.copy(storage.join(self.tmp, name), storage.join(self.path, name))
            self._check_published(new)
            storage.remove_many([marker])
        self.abort()

    def _check_published(self, new: dict[str, int]) -> None:
        """Read the output back: every object written, with its size (a store that answers and keeps
        nothing is an OutputError, not a success)."""
        have = {storage.relpath(o, self.path): info.size for o, info in storage.find_info(self.path + "/").items()}
        lost = [n for n, size in sorted(new.items()) if have.get(n) != size]
        if lost:
            raise OutputError(f"the store did not keep {self.path}: reading it back, {safety.listed(lost)} "
                              "missing or of another size")

    def discard_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def abort(self) -> None:
        self.discard_staging()
        if not self.created:
            return
        try:
            remove_temporary(self.tmp)
        except OutputError:
            pass  # best effort: a hidden prefix, never read as data; the next run removes it when stale


def remove_temporary(tmp: str, listed: Iterable[str] | None = None) -> None:
    """Delete the objects of the temporary prefix ``tmp`` that varlen writes there (its owner record,
    parts and manifest), by their exact keys; anything else stays."""
    names = [storage.relpath(o, tmp) for o in storage.find(tmp + "/")] if listed is None else list(listed)
    storage.remove_many([storage.join(tmp, n) for n in names if _TMP_FILES.match(n)])


def clean_stale_temporaries(path: str, now: float | None = None) -> list[str]:
    """Remove the temporaries ``.NAME.varlen-tmp-<12 hex>/`` beside ``path`` that killed runs left
    (returns them). Stale: its owner record names a process of this host that no longer runs, or its
    newest object is older than :data:`STALE_TMP_S` (a run of another host, or of a varlen without
    owner records). Only varlen's own objects in them are deleted (:func:`remove_temporary`)."""
    parent, name = storage.parent(path), storage.name(path)
    pattern = re.compile(rf"^\.{re.escape(name)}{re.escape(TMP_TAG)}-[0-9a-f]{{12}}$")
    groups: dict[str, dict[str, float]] = {}
    for loc, info in storage.find_info(parent, start=f".{name}{TMP_TAG}-").items():
        head, sep, rest = storage.relpath(loc, parent).partition("/")
        if sep and pattern.match(head):
            groups.setdefault(head, {})[rest] = info.mtime_ns / 1e9
    now = time.time() if now is None else now
    stale = [head for head, files in sorted(groups.items())
             if _stale_temporary(storage.join(parent, head), files, now)]
    for head in stale:
        remove_temporary(storage.join(parent, head), groups[head])
    return [storage.join(parent, head) for head in stale]


def _stale_temporary(tmp: str, files: dict[str, float], now: float) -> bool:
    if now - max(files.values()) > STALE_TMP_S:
        return True
    if OWNER_NAME not in files:
        return False
    try:
        owner = json.loads(storage.read_bytes(storage.join(tmp, OWNER_NAME)))
        pid, host = int(owner["pid"]), str(owner["host"])
    except (ValueError, KeyError, TypeError):
        return False
    return host == platform.node() and pid != os.getpid() and not safety.pid_alive(pid)


@contextmanager
def remote_dir_for_group(d, path: str, overwrite: bool) -> Iterator[RemoteAtomicDir]:
    """The remote counterpart of :func:`~.artifacts.atomic_dir_for_group`: every rank stages and
    uploads; after a barrier rank 0 publishes, if the stage called ``commit()``."""
    out = RemoteAtomicDir(path, overwrite)
    try:
        if d.is_main:
            out.check()
            out.create()
        if d.distributed:
            out.tmp = d.all_gather_object(out.tmp if d.is_main else None)[0]
        d.barrier()
        yield out
        out.upload()
        d.barrier()  # every rank's files are in the temporary prefix
        if d.is_main and out.commit_requested:
            out.publish()
    except BaseException:
        if d.is_main:
            out.abort()
        else:
            out.discard_staging()
        raise
