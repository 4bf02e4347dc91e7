"""Input datasets: finding the files, cutting them into work units, reading a unit as Arrow.

Formats (by extension; ``.gz`` allowed on the line formats):

* Parquet (``.parquet``, ``.pq``): one unit per row group (big row groups are cut into row slices).
* Arrow IPC file or stream (``.arrow``, ``.feather``, ``.ipc``), memory-mapped: one unit per batch.
* A Hugging Face ``save_to_disk`` directory (``state.json`` beside ``data-*.arrow``).
* JSONL (``.jsonl``, ``.ndjson``, ``.json`` with one object per line): byte-range chunks cut at
  line ends (a compressed file is one unit). Blank lines are skipped, as Arrow and ``datasets`` do.
* Plain text (``.txt``, ``.text``): one sample per ``\\n``-terminated line, column ``text``
  (``\\r\\n`` accepted); byte-range chunks like JSONL.

* Shard formats (:mod:`.formats`): Megatron, MDS, WebDataset, LitData, Lance; speech manifests
  (:mod:`.corpora`): NeMo shard ranges, Lhotse Shar folders; an in-memory ``datasets.Dataset``
  (:mod:`.memory`, through ``analyze_dataset``).

``sample_id`` is the row index over all files in sorted path order (a NeMo shard range in its own
order), rows in file order; that is the index of a map-style dataset built over the same files.

Sources may be URLs (``s3://``, ``gs://``, ``hf://``...): every read goes through
:mod:`varlen_cli.storage` (range requests; prefixes and globs through :mod:`.remote`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import format, storage
from ..errors import InputError, first_line
from ..runtime import freshness
from ..storage.files import check_regular, open_regular
from . import corpora, discovery, formats, memory, remote
from .formats import ranges

PARQUET_EXT = (".parquet", ".pq")
ARROW_EXT = (".arrow", ".feather", ".ipc")
JSONL_EXT = (".jsonl", ".ndjson", ".json")
TEXT_EXT = (".txt", ".text")
TEXT_COLUMN = "text"
DEFAULT_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class SourceFile:
    """One data file: its path, format (parquet, arrow, jsonl, text), size, compression."""

    path: str
    format: str
    size: int
    compression: str | None = None
    rows: int = -1  # known from metadata for parquet and arrow, -1 for line formats
    mtime_ns: int = 0  # when discovered: with size, what staleness checks compare
    etag: str | None = None  # object storage: what staleness checks compare instead of mtime_ns
    version: str | None = None


@dataclass(frozen=True)
class Unit:
    """A piece of one file that one worker reads whole: a row slice or a byte range."""

    file: int  # index into the sorted file list
    part: int  # row group (parquet) or record batch (arrow); -1 for line formats
    start: int  # first row within the part, or first byte (line formats)
    stop: int  # end row within the part, or end byte
    rows: int  # rows in the unit, -1 while unknown (line formats)
    weight: int  # rows, or estimated rows for line formats: what workers are balanced on


def file_format(path: str) -> tuple[str | None, str | None]:
    """(format, compression) of a data file from its name; (None, None) for a file of no format."""
    shard_format = formats.format_of(path)  # megatron .idx, MDS index.json, WebDataset .tar
    if shard_format is not None:
        return shard_format, None
    lower = path.lower()
    compression = None
    if lower.endswith(".gz"):
        compression, lower = "gzip", lower[:-3]
    if lower.endswith(PARQUET_EXT) and compression is None:
        return "parquet", None
    if lower.endswith(ARROW_EXT) and compression is None:
        return "arrow", None
    if lower.endswith(JSONL_EXT):
        return "jsonl", compression
    if lower.endswith(TEXT_EXT):
        return "text", compression
    return None, None


def _hf_dataset_files(directory: str) -> list[str] | None:
    state_path = os.path.join(directory, "state.json")
    if os.path.isfile(os.path.join(directory, "dataset_dict.json")):
        splits = ", ".join(sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d))))
        raise InputError(f"{directory} is a Hugging Face DatasetDict; pass one split directory ({splits})")
    if not os.path.isfile(state_path):
        return None
    try:
        with open_regular(state_path, what="Hugging Face dataset state") as fh:
            state = json.load(fh)
        return [os.path.join(directory, f["filename"]) for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"cannot read the Hugging Face dataset state {state_path}: {exc}") from None


def _is_data_file_name(name: str) -> bool:
    return file_format(name)[0] is not None


def _is_glob(source: str) -> bool:
    """A SOURCE with wildcards (``*``, ``?``, ``[``) is a glob, unless it names an existing path as written
    (a folder ``d[1]``): then it is that path, and refused if its glob would match other paths too
    (``d1``: which was meant cannot be told)."""
    wildcards = any(ch in source for ch in discovery.GLOB_CHARS)
    if not wildcards or storage.scheme(source) in ("http", "https") or not storage.exists(source):
        return wildcards  # (an http(s) URL's ? starts its query: as before)
    import glob

    matches = storage.glob(source) if storage.is_remote(source) else glob.glob(source, recursive=True)
    others = sorted(m for m in matches if m.rstrip("/") != source.rstrip("/"))
    if others:
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        raise InputError(f"source {source} names an existing path, but as a glob it matches {others[0]}{more} too; "
                         f"to read the path, escape its wildcards ({glob.escape(source)}), or rename it")
    return False


def _expand(source: str) -> list[tuple[str, bool]]:
    """The data-file candidates of one SOURCE, each with whether the user named it explicitly
    (see :mod:`varlen_cli.analyze.discovery` for what a directory or glob takes; :mod:`.corpora` for
    NeMo shard ranges and Lhotse Shar directories)."""
    if corpora.is_nemo_range(source):
        return [(p, True) for p in corpora.expand_nemo(source)]
    is_glob = _is_glob(source)
    if not is_glob and not storage.exists(source):
        idx = formats.megatron_prefix(source)  # PREFIX of PREFIX.idx + PREFIX.bin
        if idx is not None:
            return [(idx, True)]
    if storage.is_remote(source):
        return remote.expand(source, _is_data_file_name, lambda p: file_format(p)[0], is_glob)
    if is_glob:
        out = discovery.expand_glob(source, _is_data_file_name)
        if not out:
            raise InputError(f"no data files (Parquet, Arrow, JSONL, text) match {source}")
        return [(p, False) for p in out]
    if not os.path.lexists(source):
        raise InputError(f"source {source} does not exist")
    if os.path.isdir(source):
        discovery.refuse_artifact_dir(source)
        hf = _hf_dataset_files(source)
        if hf is not None:
            return [(p, True) for p in hf]
        shar = corpora.shar_cuts(source)
        if shar is not None:
            return [(p, True) for p in shar]
        manifest = formats.dataset_manifest(source)  # a Lance dataset: its latest version
        if manifest is not None:
            return [(manifest, True)]
        found = discovery.walk_directory(source, _is_data_file_name)
        if not found:
            raise InputError(f"no data files (Parquet, Arrow, JSONL, text) found in directory {source}")
        if len({file_format(p)[0] for p in found}) > 1:  # plans are no data (dropped by discover anyway)
            found = [p for p in found if file_format(p)[0] != "parquet" or not _is_plan_file(p)]
        discovery.check_single_format(source, found, lambda p: file_format(p)[0])
        return [(p, False) for p in found]
    parent = os.path.dirname(os.path.abspath(source))
    if discovery.artifact_kind(parent) is not None:
        raise InputError(f"{source} is part of a varlen output ({parent}), not a dataset")
    return [(source, True)]


def discover(sources: Sequence[str]) -> list[SourceFile]:
    """Resolve files, directories and globs into data files in sorted path order."""
    if not sources:
        raise InputError("no sources given")
    if any(memory.is_source(s) for s in sources):  # analyze_dataset: one in-memory datasets.Dataset
        src = memory.register(sources[0])
        return [SourceFile(src.path, memory.FORMAT, src.nbytes, None, src.rows)]
    _FOOTERS.clear()  # a new run: footers are read (once) again
    formats.clear_cache()  # and shard indexes
    explicit: dict[str, bool] = {}
    order: dict[str, tuple] = {}  # a shard range keeps its order, placed where its first file sorts
    for s in sources:
        expanded = [(p if storage.is_remote(p) else os.path.abspath(p), named)
                    for p, named in _expand(storage.local_path(str(s)))]  # file:///x is the local path /x
        if corpora.is_nemo_range(storage.local_path(str(s))):
            first = min(p for p, _ in expanded)
            order.update({p: (first, k) for k, (p, _) in enumerate(expanded) if p not in order})
        for path, named in expanded:
            explicit[path] = explicit.get(path, False) or named
    files = []
    for path in sorted(explicit, key=lambda p: order.get(p, (p, 0))):
        fmt, compression = file_format(path)
        if fmt is None:
            raise InputError(
                f"unsupported source file {path}: expected .parquet, .arrow/.feather, .jsonl[.gz], .txt[.gz], "
                "a Megatron .idx, an MDS or LitData index.json, WebDataset .tar shards or a Lance dataset"
            )
        if fmt == "mds":
            fmt = formats.index_format(path)  # an index.json: MDS's or LitData's
        if storage.is_remote(path):
            info = storage.stat(path)
            size, mtime_ns, etag, version = info.size, 0, info.etag, info.version
        else:
            st = _stat_readable(path)
            size, mtime_ns, etag, version = st.st_size, st.st_mtime_ns, None, None
        rows = -1
        if fmt == "parquet":
            metadata = _footer(path, size, (path, size, mtime_ns, etag, version))
            schema = metadata.schema.to_arrow_schema()
            if format.is_plan_schema(schema):
                if explicit[path]:
                    raise InputError(f"{path} is a varlen plan, not a dataset")
                continue  # a plan written inside a source directory is not data
            _check_unique_columns(schema, path)
            rows = metadata.num_rows
        elif fmt == "arrow":
            rows = sum(n for n in _arrow_batch_rows(path))
        elif fmt in formats.NAMES:
            rows = formats.describe(path, fmt, size)
        files.append(SourceFile(path, fmt, size, compression, rows, mtime_ns, etag, version))
    if not files:
        raise InputError(f"no data files (Parquet, Arrow, JSONL, text) in {', '.join(map(str, sources))}")
    return files


def _stat_readable(path: str) -> os.stat_result:
    """The file's stat; a clear error when it cannot be opened (permissions, a broken or looping
    link) or is not a regular file (a FIFO would block the reader forever)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise InputError(f"source {path} is not readable: {exc.strerror}") from None
    check_regular(path, "source")  # a socket cannot even be opened: say what it is
    try:
        with open_regular(path, "rb", what="source"):
            pass
    except OSError as exc:
        raise InputError(f"source {path} is not readable: {exc.strerror}") from None
    return st


def _is_plan_file(path: str) -> bool:
    try:
        return format.is_plan_schema(parquet_file(path).schema_arrow)
    except InputError:
        return False


def _check_unique_columns(schema, path: str) -> None:
    names = [schema.field(i).name for i in range(len(schema))]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(f"{path} has duplicate column names ({', '.join(dup)}); rename them before analyze")


# Parquet footers of the files being analysed, read once per run (discovery, unit planning and the
# reader all need them): (path, size, mtime_ns, etag, version) -> FileMetaData.
# Cleared when a run discovers its files; the key changes with any change freshness would see.
_FOOTERS: dict[tuple, tuple] = {}


def _footer(path: str, size: int, key: tuple) -> tuple:
    hit = _FOOTERS.get(key)
    if hit is None:
        hit = _FOOTERS[key] = storage.parquet_footer(path, size)[1]
    return hit


def footer_key(f: SourceFile) -> tuple:
    return (f.path, f.size, f.mtime_ns, f.etag, f.version)


def parquet_file(path: str, size: int | None = None, key: tuple | None = None):
    """A Parquet file opened for reading; with ``key`` (:func:`footer_key`) and ``size`` its footer
    comes from this run's cache (read by one tail request the first time)."""
    import pyarrow.parquet as pq

    metadata = _footer(path, size, key) if key is not None and size is not None else None
    if storage.is_remote(path):
        return storage.parquet_file(path, size=size, metadata=metadata)
    check_regular(path, "source")
    try:
        return pq.ParquetFile(path, metadata=metadata)
    except Exception as exc:
        raise InputError(f"cannot read Parquet file {path}: {exc}") from None


def open_arrow(path: str):
    """(reader, is_file_format) of a memory-mapped Arrow IPC file or stream (an object in object
    storage is read whole: the stream format, which ``save_to_disk`` writes, has no index)."""
    import pyarrow as pa

    check_regular(path, "source")
    try:
        source = pa.BufferReader(storage.read_bytes(path)) if storage.is_remote(path) else pa.memory_map(path)
    except Exception as exc:
        raise InputError(f"cannot read Arrow file {path}: {exc}") from None
    try:
        return pa.ipc.open_file(source), True
    except Exception:
        source.seek(0)
    try:
        return pa.ipc.open_stream(source), False
    except Exception as exc:
        raise InputError(f"cannot read Arrow file {path}: {exc}") from None


def _arrow_batch_rows(path: str) -> list[int]:
    reader, is_file = open_arrow(path)
    try:
        if is_file:
            return [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
        return [batch.num_rows for batch in reader]
    except Exception as exc:
        raise InputError(f"cannot read Arrow file {path}: {exc}") from None


# -- units ------------------------------------------------------------------------------------------
def make_units(files: Sequence[SourceFile], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Unit]:
    """Cut every file into units, in global row order."""
    units: list[Unit] = []
    for i, f in enumerate(files):
        if f.format == "parquet":
            md = _footer(f.path, f.size, footer_key(f))
            units.extend(_row_units(i, [md.row_group(g).num_rows for g in range(md.num_row_groups)]))
        elif f.format == "arrow":
            # Record batches are often small (Hugging Face writes 1,000 rows each): one unit is a
            # row range of the whole file, read from the memory map without copying.
            units.extend(_row_units(i, [f.rows], whole_file=True))
        elif f.format in formats.NAMES:
            units.extend(Unit(i, *u) for u in formats.units(f.path, f.format, f.size, chunk_bytes))
        elif f.format == memory.FORMAT:
            step = ranges.unit_rows(f.rows, f.size, chunk_bytes)
            units.extend(Unit(i, -1, *u[1:]) for u in ranges.row_ranges(0, f.rows, step))
        elif f.compression is not None:
            units.append(Unit(i, -1, 0, f.size, -1, max(1, _estimate_rows(f.path, f.size, compressed=True))))
        else:
            bounds = _line_aligned_bounds(f.path, f.size, chunk_bytes)
            rate = _rows_per_byte(f.path)
            for a, b in zip(bounds[:-1], bounds[1:]):
                units.append(Unit(i, -1, a, b, -1, max(1, int(round((b - a) * rate)))))
    return units


def _row_units(file_index: int, part_rows: Sequence[int], whole_file: bool = False) -> list[Unit]:
    return [Unit(file_index, -1 if whole_file else part, *u[1:])
            for part, n in enumerate(part_rows) for u in ranges.row_ranges(part, n, ranges.MAX_UNIT_ROWS)]


def _rows_per_byte(path: str, probe: int = 1 << 20) -> float:
    head = storage.read_range(path, 0, probe)
    if not head:
        return 0.0
    return max(1, head.count(b"\n")) / len(head)


def _estimate_rows(path: str, size: int, compressed: bool) -> int:
    # A gzip file's size says little about its rows; three times the compressed size is a
    # typical text ratio, good enough for balancing.
    return int(size * 3 * 0.01) if compressed else int(size * _rows_per_byte(path))


def _line_aligned_bounds(path: str, size: int, chunk_bytes: int) -> list[int]:
    bounds = [0]
    with storage.open_input(path, block_size=1 << 16) as fh:
        target = chunk_bytes
        while target < size:
            fh.seek(target)
            pos = target
            while True:
                block = fh.read(1 << 16)
                if not block:
                    pos = size
                    break
                nl = block.find(b"\n")
                if nl >= 0:
                    pos += nl + 1
                    break
                pos += len(block)
            if pos >= size:
                break
            if pos > bounds[-1]:
                bounds.append(pos)
            target = pos + chunk_bytes
    bounds.append(size)
    return bounds


def assign(units: Sequence[Unit], world_size: int, rank: int) -> tuple[int, int]:
    """The contiguous range [lo, hi) of units for ``rank``, balanced on the units' weights."""
    weights = np.fromiter((u.weight for u in units), dtype=np.int64, count=len(units))
    cum = np.concatenate([[0], np.cumsum(weights)])
    total = cum[-1]
    targets = total * np.arange(world_size + 1) / world_size
    # Unit i goes to the rank whose share holds the unit's midpoint.
    mids = (cum[:-1] + cum[1:]) / 2.0
    owner = np.minimum(np.searchsorted(targets, mids, side="right") - 1, world_size - 1)
    lo = int(np.searchsorted(owner, rank, side="left"))
    hi = int(np.searchsorted(owner, rank, side="right"))
    return lo, hi


# -- reading -----------------------------------------------------------------------------------------
class Reader:
    """Reads units as Arrow tables, keeping the current file open between units.

    A worker reads its units in order, so the cache holds one file (a Parquet footer, or an Arrow
    file's memory map) and one decoded Parquet row group, which a big row group cut into several
    units is then decoded once for.
    """

    def __init__(self):
        self._path = None
        self._handle = None
        self._group_key = None
        self._group = None
        self._shards = formats.Reader()  # Megatron, MDS, WebDataset

    def _open(self, f: SourceFile):
        if self._path != f.path:
            self._path, self._handle, self._group_key, self._group = f.path, None, None, None
            if f.format == "parquet":
                self._handle = parquet_file(f.path, f.size, footer_key(f))
            elif f.format == "arrow":
                self._handle = _read_arrow_table(f.path)
        return self._handle

    def read(self, f: SourceFile, unit: Unit, columns: Sequence[str] | None):
        """The unit's rows with the given columns (all columns for None), as an Arrow table."""
        try:
            if f.format == "parquet":
                pf = self._open(f)
                names = pf.schema_arrow.names
                wanted = names if columns is None else list(columns)
                for c in wanted:
                    if c not in names:
                        raise InputError(f"column '{c}' not found in {f.path} (columns: {', '.join(names)})")
                key = (unit.part, tuple(wanted))
                if self._group_key != key:
                    self._group_key, self._group = None, None
                    self._group = pf.read_row_group(unit.part, columns=wanted)
                    self._group_key = key
                table = self._group
                if unit.start != 0 or unit.stop != table.num_rows:
                    table = table.slice(unit.start, unit.stop - unit.start)
            elif f.format == "arrow":
                table = self._open(f).slice(unit.start, unit.stop - unit.start)
            elif f.format in formats.NAMES:
                table = self._shards.read(f.path, f.format, f.size, unit, columns)
            elif f.format == memory.FORMAT:
                table = memory.read(f.path, unit.start, unit.stop, columns)
            elif f.format == "jsonl":
                table = _read_jsonl(f, unit)
            else:
                table = _read_text(f, unit)
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"cannot read {f.path}: {first_line(exc)}") from None
        if columns is None:
            return table
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            if table.num_rows == 0 and f.format in ("jsonl", "text"):
                import pyarrow as pa

                return pa.table({c: pa.array([], pa.null()) for c in columns})
            raise InputError(
                f"column '{missing[0]}' not found in {f.path} (columns: {', '.join(table.column_names) or 'none'})"
            )
        return table.select(list(columns))


def _read_arrow_table(path: str):
    """The whole Arrow IPC file or stream as a table backed by the memory map (no copy)."""
    reader, _ = open_arrow(path)
    try:
        return reader.read_all()
    except Exception as exc:
        raise InputError(f"cannot read Arrow file {path}: {first_line(exc)}") from None


def _read_bytes(f: SourceFile, unit: Unit) -> bytes:
    if f.compression:
        return read_decompressed(f)
    return storage.read_range(f.path, unit.start, unit.stop)


def read_decompressed(f: SourceFile, limit: int = -1) -> bytes:
    """A compressed file's decompressed bytes (the first ``limit`` of them when ``limit >= 0``)."""
    import pyarrow as pa

    try:
        if storage.is_remote(f.path):
            with storage.open_input(f.path, block_size=8 << 20) as raw, \
                    pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), f.compression) as stream:
                return stream.read() if limit < 0 else stream.read(limit)
        with pa.input_stream(f.path, compression=f.compression) as stream:
            return stream.read() if limit < 0 else stream.read(limit)
    except OSError as exc:
        raise InputError(f"cannot read {f.path}: {exc}") from None


def _read_jsonl(f: SourceFile, unit: Unit):
    import pyarrow as pa
    import pyarrow.json as pj

    data = _read_bytes(f, unit)
    if not data.strip():
        return pa.table({})
    block = max(1 << 20, min(len(data), 16 << 20))
    where = f"bytes {unit.start}-{unit.stop}" if not f.compression else "file"
    try:
        table = pj.read_json(pa.BufferReader(data), read_options=pj.ReadOptions(block_size=block))
    except pa.ArrowInvalid as exc:
        if "straddling" not in str(exc).lower():
            raise InputError(f"invalid JSONL in {f.path} ({where}): {exc}") from None
        table = pj.read_json(pa.BufferReader(data), read_options=pj.ReadOptions(block_size=len(data) + 1))
    try:  # pyarrow's JSON reader passes invalid UTF-8 in strings through; a .txt with the same bytes is refused
        table.validate(full=True)
    except pa.ArrowInvalid:
        raise InputError(f"invalid JSONL in {f.path} ({where}): not valid UTF-8") from None
    return table


def _read_text(f: SourceFile, unit: Unit):
    """Lines as a large_string column built straight on the bytes (no Python loop per line).

    Lines end as in Python's universal newlines (and so in the ``datasets`` text loader): at
    ``\\n``, ``\\r\\n`` or a lone ``\\r``. Empty lines are samples (of length 0); a last line
    without a terminator is a sample too. Units are cut just after a ``\\n``, which always ends a line.
    """
    import pyarrow as pa

    data = _read_bytes(f, unit)
    buf = np.frombuffer(data, dtype=np.uint8)
    is_nl, is_cr = buf == 10, buf == 13
    cr_alone = is_cr.copy()
    cr_alone[:-1] &= ~is_nl[1:]  # a CR followed by LF is the first byte of a CRLF
    term = np.flatnonzero(is_nl | cr_alone)  # last byte of each line terminator
    starts = np.concatenate([[0], term + 1])
    crlf = np.zeros(len(term), dtype=bool)
    crlf[term > 0] = is_nl[term[term > 0]] & is_cr[term[term > 0] - 1]
    ends = np.append(term - crlf, len(buf))  # exclusive end of each line's text
    if len(buf) == 0 or is_nl[-1] or is_cr[-1]:
        starts, ends = starts[:-1], ends[:-1]  # nothing after the last terminator
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(ends - starts, out=offsets[1:])
    if offsets[-1] == len(buf):
        values = data
    else:  # drop the terminators (every CR and LF is part of one): one vectorised copy
        values = buf[~(is_nl | is_cr)].tobytes()
    arr = pa.Array.from_buffers(pa.large_string(), len(starts), [None, pa.py_buffer(offsets), pa.py_buffer(values)])
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid:
        raise InputError(f"{f.path} is not valid UTF-8 text") from None
    return pa.table({TEXT_COLUMN: arr})


def fingerprint(files: Sequence[SourceFile], rows_per_file: Sequence[int]) -> dict:
    """Identity of the dataset: file names relative to their common folder, sizes and row counts."""
    from ..runtime.artifacts import digest

    if files and files[0].format == memory.FORMAT:  # analyze_dataset: the dataset's own fingerprint
        src = memory.lookup(files[0].path)
        entry = {"path": src.path, "size": src.nbytes, "rows": int(rows_per_file[0]), "format": memory.FORMAT,
                 "fingerprint": src.fingerprint}
        return {"digest": digest([entry]), "root": "", "num_files": 1, "num_rows": entry["rows"], "files": [entry]}
    root = storage.common_root([f.path for f in files])
    entries = [
        {"path": storage.relpath(f.path, root) if root else f.path, "size": f.size, "rows": int(n),
         "format": f.format}
        for f, n in zip(files, rows_per_file)
    ]
    ident = digest(entries)
    # When and what each file was (not part of the identity: a copied dataset is the same dataset), so
    # that sort, plan and validate can refuse metrics of a source rewritten since (runtime.freshness).
    for entry, f in zip(entries, files):
        info = storage.FileInfo(f.path, f.size, etag=f.etag, version=f.version, mtime_ns=f.mtime_ns)
        entry.update(freshness.record(info, f.format))
        companions = formats.companions(f.path, f.format, f.size) if f.format in formats.NAMES else []
        if companions:
            entry["companions"] = [{"path": storage.relpath(c.path, root) if root else c.path,
                                    **freshness.record(c, "data")} for c in companions]
    return {
        "digest": ident,
        "root": root,
        "num_files": len(files),
        "num_rows": int(sum(rows_per_file)),
        "files": entries,
    }
