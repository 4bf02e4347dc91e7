"""Output directories in object storage (``-o s3://bucket/metrics``): nothing half-written is visible.

Object stores have no rename, so the local swap of :mod:`.safety` cannot be used. Instead:

1. every rank writes its files into a local staging folder (``out.file(name)``, as for a local
   output), then uploads them to a hidden temporary prefix beside the output,
   ``.NAME.varlen-tmp-<random>/``;
2. once every rank has uploaded (a barrier) and rank 0 has called ``out.commit()``, rank 0 copies
   the objects into the output prefix, the ``_manifest.json`` **last**: the manifest is the commit
   marker. varlen (and anything that reads the manifest) sees a complete output or none.
   While the copy runs, ``NAME/_varlen_commit.json`` marks the prefix as varlen's, so that a run
   killed in that window leaves an output that ``--overwrite`` may replace;
3. an existing output is replaced only with ``--overwrite`` and only when varlen made it (its
   ``_manifest.json`` or ``_run.json`` is varlen's, or the commit marker is there); its manifest is
   deleted first, so during the copy the output is incomplete (refused), never a mix;
4. on failure the temporary prefix and the staging folders are removed; the output is untouched.

A single file (a plan, ``-o s3://bucket/plan.parquet``) is written locally and uploaded with one PUT,
which object stores make visible whole or not at all (:func:`remote_atomic_file`).

Limits: there is no lock (two runs writing one prefix at once are not detected), and a run
killed during step 2 leaves the output without its manifest (refused until replaced).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from .. import format, storage
from ..errors import OutputError
from . import safety

COMMIT_MARKER = "_varlen_commit.json"
TMP_TAG = ".varlen-tmp"


def _tmp_prefix(path: str) -> str:
    return storage.join(storage.parent(path), f".{storage.name(path)}{TMP_TAG}-{uuid.uuid4().hex[:12]}")


def _varlen_made(path: str, objects: list[str]) -> bool:
    names = {storage.relpath(o, path) for o in objects}
    if COMMIT_MARKER in names:
        return True
    for name, fmt in ((format.MANIFEST_NAME, format.METRICS_FORMAT), (format.RUN_MANIFEST_NAME, format.RUN_FORMAT)):
        if name in names:
            try:
                if json.loads(storage.read_bytes(storage.join(path, name))).get("format") == fmt:
                    return True
            except (ValueError, AttributeError):
                continue
    return False


def check(path: str, overwrite: bool, inputs: Iterable[str] = ()) -> None:
    """Refuse an output that overlaps an input, exists without ``--overwrite``, or (with it) was not
    made by varlen (OutputError, exit 4); an unreachable store is an OutputError too."""
    path = path.rstrip("/")
    safety.check_no_overlap(path, inputs)
    with storage.translate_errors(path, write=True):
        if storage.isfile(path):
            raise OutputError(f"output {path} exists and is not a directory")
        objects = storage.find(path + "/")
    if objects and not overwrite:
        raise OutputError(f"output {path} already exists; pass --overwrite to replace it")
    if objects and not _varlen_made(path, objects):
        raise OutputError(f"output {path} is a prefix varlen did not make (no varlen _manifest.json or _run.json); "
                          "--overwrite replaces only varlen outputs")


def check_file(path: str, overwrite: bool) -> None:
    """Refuse a file output that exists without ``--overwrite``, or (with it) is not a varlen plan."""
    with storage.translate_errors(path, write=True):
        if storage.isdir(path):
            raise OutputError(f"output {path} is a directory; give a file name such as plan.parquet")
        if not storage.isfile(path):
            return
    if not overwrite:
        raise OutputError(f"output {path} already exists; pass --overwrite to replace it")
    try:
        is_plan = format.is_plan_schema(storage.parquet_file(path).schema_arrow)
    except Exception:  # noqa: BLE001 - an object that is no Parquet at all is simply not a plan
        is_plan = False
    if not is_plan:
        raise OutputError(f"output {path} is not a varlen plan; --overwrite replaces only varlen outputs")


class _LocalFile:
    def __init__(self, path: str, tmp: str):
        self.given = self.path = path
        self.tmp = tmp


@contextmanager
def remote_atomic_file(path: str, overwrite: bool) -> Iterator[_LocalFile]:
    """Yield an object whose ``tmp`` is a local file to write; on success it is uploaded to ``path``
    in one PUT (visible whole or not at all); on failure nothing is uploaded."""
    check_file(path, overwrite)
    fd, tmp = tempfile.mkstemp(prefix="varlen-remote-file-", suffix=".parquet")
    os.close(fd)
    try:
        yield _LocalFile(path, tmp)
        check_file(path, overwrite)  # still ours to replace
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

    def check(self) -> None:
        check(self.path, self.overwrite)

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
            for name in sorted(os.listdir(self._staging)):
                if ".tmp-" not in name:  # atomic_write_json's own temporaries
                    storage.put_file(os.path.join(self._staging, name), storage.join(self.tmp, name))
        finally:
            self.discard_staging()

    def publish(self) -> None:
        """Rank 0: copy the temporary prefix into place, manifest last; remove the temporary."""
        fs, _ = storage.filesystem(self.path)
        new = sorted(storage.find(self.tmp + "/"), key=lambda o: storage.name(o) == format.MANIFEST_NAME)
        marker = storage.join(self.path, COMMIT_MARKER)
        with storage.translate_errors(self.path, write=True):
            storage.write_bytes(marker, json.dumps({"from": self.tmp}).encode())
            old = [o for o in storage.find(self.path + "/") if o != marker]
            old.sort(key=lambda o: storage.name(o) != format.MANIFEST_NAME)  # the old manifest goes first
            for o in old:
                storage.remove(o)
            for o in new:
                fs.copy(storage.filesystem(o)[1], storage.filesystem(storage.join(self.path, storage.name(o)))[1])
            storage.remove(marker)
        self.abort()

    def discard_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def abort(self) -> None:
        self.discard_staging()
        try:
            storage.remove(self.tmp + "/", recursive=True)
        except OutputError:
            pass  # best effort: a hidden prefix, never read as data


@contextmanager
def remote_dir_for_group(d, path: str, overwrite: bool) -> Iterator[RemoteAtomicDir]:
    """The remote counterpart of :func:`~.artifacts.atomic_dir_for_group`: every rank stages and
    uploads; after a barrier rank 0 publishes, if the stage called ``commit()``."""
    out = RemoteAtomicDir(path, overwrite)
    if d.is_main:
        out.check()
    if d.distributed:
        out.tmp = d.all_gather_object(out.tmp if d.is_main else None)[0]
    d.barrier()
    try:
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
