"""On-disk artifacts: atomic output directories and files, manifests, fingerprints, row ranges.

Formats are specified in ``docs/formats.md``. A metrics directory (from ``varlen analyze``) and a
sorted directory (from ``varlen sort``) share one layout: ``part-00000.parquet ...`` whose
concatenation in name order is the artifact's row order, plus ``manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, is_dataclass
from typing import Any

from .. import __version__, format
from ..errors import InputError, OutputError
from ..storage.files import check_regular, open_regular
from . import safety
from .faults import fault_point

# The directory format is defined in varlen_cli.format; these are the names the stages use.
MANIFEST_NAME = format.MANIFEST_NAME
METRICS_FORMAT = format.METRICS_FORMAT
FORMAT_VERSION = format.METRICS_FORMAT_VERSION
part_name = format.part_name
metrics_schema = format.metrics_schema
# Config fields that say how a stage ran, not what it computed: left out of artifact ids. (An input
# directory's path is too: its artifact id is part of the id, and `varlen run` builds in a temporary.)
RUNTIME_FIELDS = frozenset({"nproc", "overwrite", "device", "progress", "output", "debug", "quiet", "allow_stale",
                            "metrics_dir", "storage_options", "recorded_input"})


def config_dict(config: Any) -> dict:
    """A JSON-ready dict of a config dataclass (tuples become lists), as artifacts record it:
    ``--storage-option`` values (at any depth: ``varlen run`` nests the stages' options) are
    recorded as ``key=***`` (they may be secrets)."""
    data = asdict(config) if is_dataclass(config) else dict(config)
    return _redacted(json.loads(json.dumps(data, default=str)))


def _redacted(data: Any) -> Any:
    from .. import storage

    if isinstance(data, dict):
        return {k: storage.redacted(v) if k == "storage_options" and isinstance(v, list) else _redacted(v)
                for k, v in data.items()}
    return data


def digest(obj: Any) -> str:
    """A short stable hash of a JSON-serialisable object."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def artifact_id(stage: str, config: Any, input_id: str, rows: Sequence[int]) -> str:
    """Identity of an artifact: what produced it from what, independent of the number of workers."""
    cfg = {k: v for k, v in config_dict(config).items() if k not in RUNTIME_FIELDS}
    return digest({"stage": stage, "config": cfg, "input": input_id, "rows": int(sum(rows))})


def provenance() -> dict:
    import platform
    import sys

    return {
        "varlen_version": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "host": platform.node(),
    }


# -- atomic outputs --------------------------------------------------------------------------------
class _AtomicOutput:
    """An output built in ``.NAME.varlen-tmp-<random>`` beside ``path`` and swapped in by :meth:`commit`."""

    def __init__(self, path: str, overwrite: bool = False):
        self.given = path  # as the user wrote it, for messages
        self.path = os.path.abspath(path)
        self.tmp = safety.sibling(self.path, safety.TMP_TAG, unique=True)
        self.overwrite = overwrite

    def check(self) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        """Rank 0, after every rank finished writing: swap the result into place."""
        self.check()  # still ours to replace (we hold the lock; a user may have changed it meanwhile)
        try:
            safety.swap_in(self.tmp, self.path)
        except OSError as exc:  # the user's filesystem (permissions, a read-only mount): the old output is back
            raise OutputError(f"cannot put output {self.given} in place: {exc.strerror or exc}") from None
        fault_point("commit.swapped")  # tests: a signal right after the swap


class AtomicDir(_AtomicOutput):
    """A directory written by all ranks into a uniquely named temporary sibling
    (``.NAME.varlen-tmp-<random>``), swapped into place at the end (:func:`safety.swap_in`).

    Rank 0 names and creates the temporary and shares its name with the other ranks
    (:func:`atomic_dir_for_group`); until :meth:`commit` an existing output stays untouched.
    ``--overwrite`` replaces only a directory varlen made, never a symbolic link
    (:func:`safety.check_replaceable`).
    """

    def check(self) -> None:
        safety.check_replaceable(self.given, self.overwrite, "dir")

    def create(self) -> None:
        """Rank 0: start the temporary directory (other ranks wait at a barrier after this)."""
        try:
            os.makedirs(self.tmp)
        except OSError as exc:
            raise OutputError(f"cannot create output directory next to {self.path}: {exc.strerror}") from None

    def file(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class AtomicFile(_AtomicOutput):
    """A file written to ``.NAME.varlen-tmp-<random>`` and swapped in by :meth:`commit`: a plan, or
    with ``json_format`` a JSON file of that ``format`` (a memory profile: ``--overwrite`` replaces
    only a file of the same format)."""

    json_format: str | None = None
    kind: str = "file"  # what --overwrite may replace (safety.check_replaceable): a plan, "report" or "trace"

    def check(self) -> None:
        from .. import storage

        if storage.is_remote(self.given):
            from .remote_output import check_file

            return check_file(self.given, self.overwrite, self.json_format)
        safety.check_file_name(self.given, "plan.parquet" if self.json_format is None else "profile.json")
        if os.path.isdir(self.path) and not os.path.islink(self.path):
            name = {"report": "report.html", "trace": "trace.json"}.get(
                self.kind, "plan.parquet" if self.json_format is None else "profile.json")
            raise OutputError(f"output {self.given} is a directory; give a file name such as {name}")
        if self.json_format is None:
            safety.check_replaceable(self.given, self.overwrite, self.kind)
        else:
            safety.check_replaceable(self.given, self.overwrite, "json", self.json_format)

    def abort(self) -> None:
        try:
            os.remove(self.tmp)
        except OSError:
            pass


@contextmanager
def atomic_file(path: str, overwrite: bool, inputs: Sequence[str] = (),
                json_format: str | None = None, kind: str = "file") -> Iterator[AtomicFile]:
    """Lock ``path``, check it, yield an :class:`AtomicFile` to write ``.tmp`` of, then swap it in;
    on any failure (or SIGTERM) the temporary is removed and an old file stays as it was. An
    object-storage ``path`` is written locally and uploaded at the end (:mod:`.remote_output`).

    ``inputs``: every input of the command (``safety.stage_inputs(config)``), none of which the output
    may be, contain or lie inside. ``json_format``: the output is a JSON file of that format (a memory
    profile) instead of a plan; ``kind``: ``"report"`` (a page or image of ``varlen report``) or ``"trace"``
    (a ``varlen simulate --trace`` file) instead of a plan."""
    from .. import storage

    safety.check_no_overlap(path, inputs)
    if storage.is_remote(path):
        from .remote_output import remote_atomic_file

        with remote_atomic_file(path, overwrite, json_format) as remote_out:
            yield remote_out
        return
    out = AtomicFile(path, overwrite)
    out.json_format, out.kind = json_format, kind
    out.check()
    with safety.output_lock(out.path, path):
        try:
            yield out
            out.commit()
        except BaseException:
            out.abort()
            raise


@contextmanager
def atomic_dir_for_group(d, path: str, overwrite: bool) -> Iterator[AtomicDir]:
    """An :class:`AtomicDir` shared by every rank of ``d`` (a :class:`~varlen_cli.runtime.dist.Dist`).

    Rank 0 takes the output lock (already held when a ``--nproc`` launcher took it), checks the
    output and creates the temporary directory, whose name it shares, while the others wait; if the
    stage fails on rank 0, rank 0 removes it. A peer still writing then fails too. An object-storage
    ``path`` (``s3://...``) goes to :func:`.remote_output.remote_dir_for_group` instead.
    """
    from .. import storage

    if storage.is_remote(path):
        from .remote_output import remote_dir_for_group

        with remote_dir_for_group(d, path, overwrite) as remote_out:
            yield remote_out
        return
    out = AtomicDir(path, overwrite)
    with ExitStack() as stack:
        if d.is_main:
            stack.enter_context(safety.output_lock(out.path, path))
            out.check()
            out.create()
        if d.distributed:
            out.tmp = d.all_gather_object(out.tmp if d.is_main else None)[0]
        d.barrier()
        try:
            yield out
        except BaseException:
            if d.is_main:
                out.abort()
            raise


def atomic_write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    # Test hook: VARLEN_FAULT_FULL_DISK=1 writes through /dev/full, so the OS itself answers ENOSPC.
    target = "/dev/full" if os.environ.get("VARLEN_FAULT_FULL_DISK") == "1" else tmp
    try:
        with open(target, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=False, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except OSError as exc:  # ENOSPC, EDQUOT, EIO: the user's disk, not a varlen bug
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None


# -- manifests and reading -------------------------------------------------------------------------
def read_manifest(path: str, what: str = "metrics directory", hint: str = "create one with `varlen analyze`") -> dict:
    """The manifest of a metrics or sorted directory, local or in object storage (``s3://...``: the
    manifest is the commit marker of a remote output, see :mod:`.remote_output`); a clear error for
    anything else."""
    from .. import storage

    manifest, present = (_remote_manifest if storage.is_remote(path) else _local_manifest)(path, what, hint)
    if not isinstance(manifest, dict) or manifest.get("format") != METRICS_FORMAT:
        raise InputError(f"{path} is not a varlen {what} ({MANIFEST_NAME} has no format '{METRICS_FORMAT}'); {hint}")
    try:
        format.check_manifest_fields(path, manifest, MANIFEST_NAME)
    except format.FormatError as exc:
        raise InputError(str(exc)) from None
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise InputError(f"{path} was written by a newer varlen (format {manifest['format_version']}); upgrade varlen")
    for part in manifest.get("parts", []):
        if not present(part["file"]):
            raise InputError(f"{path} is incomplete: {part['file']} listed in {MANIFEST_NAME} is missing")
    return manifest


def _local_manifest(path: str, what: str, hint: str):
    """``(manifest, is a file of the directory)`` of a local directory."""
    if not os.path.exists(path):
        raise InputError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise InputError(f"{path} is not a varlen {what}; {hint}")
    manifest_path = os.path.join(path, MANIFEST_NAME)
    check_regular(manifest_path, "manifest")
    if not os.path.isfile(manifest_path):
        raise InputError(f"{path} is not a varlen {what} (no {MANIFEST_NAME}); {hint}")
    try:
        with open_regular(manifest_path, what="manifest") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {manifest_path}: {exc}") from None

    def present(name: str) -> bool:
        check_regular(os.path.join(path, name), "part")  # a FIFO or a device is refused, never read
        return os.path.isfile(os.path.join(path, name))

    return manifest, present


def _remote_manifest(path: str, what: str, hint: str):
    """``(manifest, is an object of the prefix)`` of an object-storage prefix: one listing, one read."""
    from .. import storage

    root = path.rstrip("/")
    names = {storage.relpath(o, root) for o in storage.find(root + "/") if o.startswith(root + "/")}
    if not names:  # (an object named ``root`` itself, a plan, is listed as itself)
        if storage.isfile(root):
            raise InputError(f"{path} is not a varlen {what}; {hint}")
        raise InputError(f"{path} does not exist")
    if MANIFEST_NAME not in names:
        raise InputError(f"{path} is not a varlen {what} (no {MANIFEST_NAME}; or an output still being "
                         f"published); {hint}")
    loc = storage.join(root, MANIFEST_NAME)
    try:
        manifest = json.loads(storage.read_bytes(loc))
    except ValueError as exc:
        raise InputError(f"cannot read {loc}: {exc}") from None
    return manifest, names.__contains__


def _artifact_id_at(path: str) -> str | None:
    """The ``artifact_id`` of the metrics or sorted directory at ``path`` (local or object storage);
    None when it is gone or unreadable (a moved input cannot be checked)."""
    from .. import storage

    loc = storage.join(path, MANIFEST_NAME)
    try:
        if not storage.isfile(loc):
            return None
        manifest = json.loads(storage.read_bytes(loc))
    except (InputError, ValueError):
        return None
    return manifest.get("artifact_id") if isinstance(manifest, dict) else None


def check_fresh(path: str, manifest: dict, rerun: str) -> None:
    """Refuse an artifact whose input artifact was rebuilt (with other content) after it was made.

    A sorted directory records the ``artifact_id`` of the metrics directory it came from; if that
    directory now holds another artifact, the sorted rows are stale. Moved or deleted inputs cannot
    be checked and pass.
    """
    inp = manifest.get("input") or {}
    src, want = inp.get("path"), inp.get("artifact_id")
    if not src or not want:
        return
    have = _artifact_id_at(src)
    if have is not None and have != want:
        raise InputError(f"{path} is stale: {src} was rebuilt after it (artifact {want}, now {have}); re-run `{rerun}`")


def part_location(path: str, part: dict) -> str:
    """Where a part (an entry of the manifest's ``parts``) of the directory ``path`` lies."""
    from .. import storage

    return storage.join(path, part["file"])


def open_part(loc: str, memory_map: bool = False):
    """A part of a metrics or sorted directory as a ``pyarrow.parquet.ParquetFile``: a local file
    (memory-mapped if asked), or an object read by range requests (footer, then column chunks)."""
    import pyarrow.parquet as pq

    from .. import storage

    try:
        if storage.is_remote(loc):
            return storage.parquet_file(loc)
        return pq.ParquetFile(loc, memory_map=memory_map)
    except InputError:
        raise
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise InputError(f"cannot read {loc}: {exc}") from None


def row_bounds(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """The contiguous, balanced slice [start, stop) of ``total`` rows that ``rank`` owns."""
    start = total * rank // world_size
    stop = total * (rank + 1) // world_size
    return start, stop


def read_row_range(path: str, manifest: dict, start: int, stop: int, columns: Sequence[str] | None = None):
    """Rows [start, stop) of a metrics or sorted directory (local or in object storage) as one
    Arrow table, reading only the row groups that overlap the range."""
    import pyarrow as pa

    pieces = []
    offset = 0
    schema = None
    for part in manifest["parts"]:
        n = int(part["rows"])
        lo, hi = max(start, offset), min(stop, offset + n)
        if hi > lo or schema is None:
            pf = open_part(part_location(path, part))
            schema = pf.schema_arrow if columns is None else pa.schema([pf.schema_arrow.field(c) for c in columns])
        if hi > lo:
            rg_offset = 0
            for rg in range(pf.num_row_groups):
                rg_rows = pf.metadata.row_group(rg).num_rows
                a, b = max(lo - offset, rg_offset), min(hi - offset, rg_offset + rg_rows)
                if b > a:
                    table = pf.read_row_group(rg, columns=list(columns) if columns else None)
                    pieces.append(table.slice(a - rg_offset, b - a))
                rg_offset += rg_rows
        offset += n
    if not pieces:
        if schema is None:
            schema = metrics_schema()
        return schema.empty_table()
    return pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]


def write_parquet(table, path: str, row_group_size: int = 1 << 20) -> None:
    import pyarrow.parquet as pq

    try:
        pq.write_table(table, path, row_group_size=row_group_size, compression="zstd", compression_level=1)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc}") from None

