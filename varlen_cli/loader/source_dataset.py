"""``SourceDataset``: a map-style dataset over the sources ``varlen analyze`` read; item ``i`` is the
source row whose ``sample_id`` is ``i``, read from the files in place (local or object storage).

``dataloader_for_plan(SourceDataset("metrics"), plan)`` is then the whole data path:

* **Where a row lives.** The metrics directory's manifest lists the source files in ``sample_id``
  order with their row counts; each file is cut into *blocks* (Parquet row groups, the byte
  chunks of JSONL/text files that analyze recorded, a whole Arrow file). ``sample_id`` -> file ->
  block is two ``searchsorted`` calls on cumulative row counts (vectorised over a microbatch).
* **Block cache.** A block is read once (a range request, or a few, for the wanted columns) and kept
  decoded in an LRU cache of ``cache_bytes`` per process.
* **Plan-order read-ahead.** :meth:`prefetch` starts background reads (``threads``) of the blocks
  that given sample ids need. :func:`~varlen_cli.loader.dataloader_for_plan` makes the plan's
  batch sampler attach to each microbatch the sample ids of the next ones the same DataLoader worker
  will fetch (``MicrobatchIndices.ahead``), and :class:`~varlen_cli.loader.PlanDataset` hands them to
  ``prefetch`` before it fetches the microbatch: each worker reads ahead exactly what it needs next.
* **Freshness.** A source that changed since analyze (size, modification time, Parquet footer;
  ETag/version in object storage) is refused (``InputError``), as ``varlen plan`` does.
* **Formats.** Every format analyze reads; the row-reading dispatch is a registry by format name
  (:func:`register_format`), so new source formats plug in their own block and read functions.
  A format without an entry is cut into analyze's work units when they know their rows (else one
  block per file) and read with analyze's own ``Reader``.

Items are dicts of the selected columns (all by default): list columns as 1-D numpy arrays, other
values as Python objects (``str`` for text). With ``tokenizer`` (a ``tokenizer.json`` path, a
directory analyze accepts, a ``tokenizers.Tokenizer`` or a transformers tokenizer) the text (or the
conversation) analyze measured is tokenized into ``input_ids`` (an int64 array) as analyze counted it
(:mod:`.item_tokens`): its length is the metrics' length. Indices are integers (numpy's too); a
float, a string or a nested list is refused (:class:`IndexTypeError`).

Imports only numpy and pyarrow at module level (and torch through ``varlen_cli.loader``).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, UsageError
from .item_tokens import ItemTokenizer

DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_THREADS = 4
RECHECK_S = 1.0  # a file's size and mtime are re-checked before a block is read, at most this often


@dataclass(frozen=True)
class Block:
    """A piece of one source file read whole: ``unit`` is the reader's :class:`~varlen_cli.analyze.sources.Unit`."""

    file: int
    unit: Any
    rows: int


BlocksFn = Callable[[Any, dict], list]  # (SourceFile, manifest file entry) -> [Unit, ...] in row order
ReadFn = Callable[[Any, Any, Sequence[str] | None], Any]  # (SourceFile, Unit, columns) -> pyarrow.Table
_FORMATS: dict[str, tuple[BlocksFn, ReadFn]] = {}


def register_format(fmt: str, blocks: BlocksFn, read: ReadFn) -> None:
    """Teach :class:`SourceDataset` a source format (``fmt`` as analyze records it in the manifest):
    ``blocks(file, entry)`` cuts a file into units whose ``rows`` are known, ``read(file, unit, columns)``
    returns a unit's rows as a ``pyarrow.Table`` (all columns when ``columns`` is None)."""
    _FORMATS[fmt] = (blocks, read)


def _reader_read(file, unit, columns):
    """analyze's own reader (one per thread: it keeps one file open)."""
    from ..analyze.sources import Reader

    reader = _thread_cache().setdefault("reader", Reader())
    return reader.read(file, unit, columns)


def _parquet_read(file, unit, columns):
    """One row group (slice) of a Parquet file; footers stay open per thread, one per file."""
    from ..analyze.sources import parquet_file

    files = _thread_cache().setdefault("parquet", {})
    pf = files.get(file.path)
    if pf is None:
        pf = files[file.path] = parquet_file(file.path, file.size)
    names = pf.schema_arrow.names
    for c in columns or ():
        if c not in names:
            raise InputError(f"column '{c}' not found in {file.path} (columns: {', '.join(names)})")
    table = pf.read_row_group(unit.part, columns=list(columns) if columns is not None else None)
    if unit.start != 0 or unit.stop != table.num_rows:
        table = table.slice(unit.start, unit.stop - unit.start)
    return table


_THREAD_LOCAL = threading.local()


def _thread_cache() -> dict:
    """This thread's open readers; emptied in a forked child (a DataLoader worker inherits the
    forking thread's, whose remote clients must not be used after a fork)."""
    if getattr(_THREAD_LOCAL, "pid", None) != os.getpid():
        _THREAD_LOCAL.__dict__.clear()
        _THREAD_LOCAL.pid = os.getpid()
    return _THREAD_LOCAL.__dict__


def _parquet_blocks(file, entry):
    from ..analyze.sources import make_units

    return make_units([file])


def _arrow_blocks(file, entry):
    from ..analyze.sources import Unit

    return [Unit(0, -1, 0, file.rows, file.rows, file.rows)]


def _line_blocks(file, entry):
    from ..analyze.sources import Unit

    chunks = entry.get("chunks")
    if file.compression is not None or not chunks:  # one block: the whole (decompressed) file
        return [Unit(0, -1, 0, file.size, int(entry["rows"]), int(entry["rows"]))]
    return [Unit(0, -1, int(a), int(b), int(n), int(n)) for a, b, n in chunks]


def _any_blocks(file, entry):
    """Formats without their own entry: the byte chunks analyze recorded with their rows, else
    analyze's work units when they know their rows, else the whole file as one block."""
    from ..analyze.sources import Unit, make_units

    if entry.get("chunks"):
        return _line_blocks(file, entry)
    units = make_units([file])
    if units and all(u.rows >= 0 for u in units):
        return units
    return [Unit(0, -1, 0, file.size, file.rows, file.rows)]


def _shard_read(file, unit, columns):
    """Megatron, MDS and WebDataset units through analyze's reader; an item's default columns are
    the format's (a Megatron item holds its tokens, ``input_ids``, read from the ``.bin``; a
    WebDataset item every member, typed as a named column is: text as ``str``, ``.npy`` as its
    elements, anything else as bytes)."""
    from ..analyze.formats import ITEM_COLUMNS, webdataset

    table = _reader_read(file, unit, columns if columns is not None else ITEM_COLUMNS.get(file.format))
    if columns is None and file.format == "webdataset":
        table = webdataset.typed_members(table, file.path)
    return table


register_format("parquet", _parquet_blocks, _parquet_read)
for _fmt, _blocks in (("arrow", _arrow_blocks), ("jsonl", _line_blocks), ("text", _line_blocks)):
    register_format(_fmt, _blocks, _reader_read)
# sample ranges (Megatron sequences, MDS samples); WebDataset: the byte chunks analyze recorded
for _fmt, _blocks in (("megatron", _any_blocks), ("mds", _any_blocks), ("webdataset", _line_blocks)):
    register_format(_fmt, _blocks, _shard_read)
for _fmt in ("lance", "litdata"):  # fragments' and chunks' row ranges
    register_format(_fmt, _any_blocks, _shard_read)
register_format("dataset", _any_blocks, _reader_read)  # an in-memory datasets.Dataset (SourceDataset(dataset=...))


# -- the manifest ------------------------------------------------------------------------------------
def read_metrics_manifest(metrics_dir: str) -> dict:
    """The manifest of a local or object-storage metrics (or sorted) directory."""
    from ..runtime import artifacts

    return artifacts.read_manifest(metrics_dir)


def _source_files(manifest: dict, where: str) -> tuple[list, list[dict]]:
    from .. import storage
    from ..analyze.sources import SourceFile, file_format

    dataset = manifest.get("dataset")
    if not isinstance(dataset, dict) or not dataset.get("files"):
        raise InputError(f"{where} does not list its source files (written by an older varlen?); re-run analyze")
    root = dataset.get("root") or ""
    files, entries = [], []
    for entry in dataset["files"]:
        path = storage.under(str(entry["path"]), root)
        fmt = entry.get("format") or file_format(path)[0]
        compression = file_format(path)[1] if fmt in ("jsonl", "text") else None
        files.append(SourceFile(path, fmt, int(entry["size"]), compression, int(entry["rows"])))
        entries.append(entry)
    return files, entries


def _in_memory(dataset: Any, entries: list[dict], where: str):
    """The in-memory dataset of metrics made by ``analyze_dataset`` (registered, checked), else None."""
    from ..analyze import memory

    measured = [e for e in entries if e.get("format") == memory.FORMAT]
    if dataset is None:
        if measured:
            memory.lookup(str(measured[0]["path"]))  # registered in this process (analyze_dataset ran here) or refused
        return None
    if not measured:
        raise UsageError(f"dataset= is for metrics of an in-memory datasets.Dataset (analyze_dataset); {where} was "
                         "measured on files")
    source = memory.DatasetSource(dataset)
    memory.check_same(source, measured[0], where)
    return memory.register(source)


def _check_fresh(manifest: dict, where: str) -> None:
    from ..runtime import freshness

    changed = freshness.stale_source(manifest)
    if changed is not None:
        source, why = changed
        raise InputError(f"{where} is stale: source {source} {why} since `varlen analyze` read it; re-run "
                         "`varlen analyze` (or pass allow_stale=True if the data was moved or copied on purpose)")


# -- the dataset -------------------------------------------------------------------------------------
class SourceDataset:
    """Map-style dataset: ``dataset[i]`` is the source row with ``sample_id`` ``i`` (see the module doc).

    ``columns``: the source columns to return (None: all). ``tokenizer``: tokenize the text column
    analyze measured into ``input_ids``. ``cache_bytes``: decoded blocks kept per process.
    ``threads``: background readers of :meth:`prefetch`. ``storage_options``: for object storage
    (as ``--storage-option``; the standard environment otherwise). ``allow_stale``: skip the check
    that the sources are unchanged since analyze. ``dataset``: the in-memory ``datasets.Dataset``
    that :func:`varlen_cli.analyze.analyze_dataset` measured (checked: its fingerprint and length).
    """

    def __init__(self, metrics_dir: str | os.PathLike, columns: Sequence[str] | None = None, tokenizer: Any = None,
                 *, cache_bytes: int = DEFAULT_CACHE_BYTES, threads: int = DEFAULT_THREADS,
                 storage_options: Any = None, allow_stale: bool = False, dataset: Any = None):
        from .. import storage

        self.metrics_dir = str(metrics_dir)
        _check_arguments(cache_bytes, threads)
        self.storage_options = storage.parse_options(storage_options) if storage_options is not None else None
        if self.storage_options is not None:
            storage.configure(self.storage_options)
        manifest = read_metrics_manifest(self.metrics_dir)
        if not allow_stale:
            _check_fresh(manifest, self.metrics_dir)
        self.files, self._entries = _source_files(manifest, self.metrics_dir)
        self._in_memory = _in_memory(dataset, self._entries, self.metrics_dir)
        # what each file (and the files its samples come from) was when analyze read it: re-checked
        # (size and mtime, local files) before each block is read, so a file changed while training
        # is refused rather than read (object storage: checked once, here)
        self._records = [] if allow_stale else _watched(manifest)
        self.columns = list(columns) if columns is not None else None
        self._selection = _Selection(self.columns, self.files) if self.columns is not None else None
        self.cache_bytes = int(cache_bytes)
        self.threads = max(1, int(threads))
        self.tokenizer = ItemTokenizer(tokenizer, manifest.get("config") or {}, self.metrics_dir) \
            if tokenizer is not None else None
        if self.tokenizer is not None and self.columns is not None and not self._selection.holds(
                self.tokenizer.column, self.files):
            raise UsageError(f"tokenizer= tokenizes column '{self.tokenizer.column}' (what analyze measured): add it "
                             f"to columns={self.columns}")
        self._num_rows = int(sum(f.rows for f in self.files))
        self._blocks: list[Block] | None = None  # every file's blocks, in sample_id order (built on first use)
        self._block_starts: np.ndarray | None = None  # first sample_id of each block, then the total
        self._init_runtime()

    # -- per-process state (rebuilt in DataLoader workers) ------------------------------------------
    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict = OrderedDict()  # block -> _Decoded
        self._cached_bytes = 0
        self._inflight: dict[int, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._checked: dict[int, float] = {}  # file -> when its records were last re-checked

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_lock", "_cache", "_cached_bytes", "_inflight", "_pool", "_pid", "_checked"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._in_memory is not None:  # a DataLoader worker: the dataset came pickled with us
            from ..analyze import memory

            memory.register(self._in_memory)
        if self.storage_options is not None:
            from .. import storage

            storage.configure(self.storage_options)
        self._init_runtime()

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # a forked DataLoader worker: no threads, no shared cache
            self._init_runtime()

    def _executor(self) -> ThreadPoolExecutor:
        self._check_process()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="varlen-source")
        return self._pool

    # -- map-style interface --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, index: int) -> dict:
        if not _is_index(index):
            raise IndexTypeError(f"SourceDataset indices are sample ids (integers), not {type(index).__name__} "
                                 f"{index!r}")
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        ids = _sample_ids(indices)
        if len(ids) and (ids.min() < 0 or ids.max() >= self._num_rows):
            bad = ids[(ids < 0) | (ids >= self._num_rows)][0]
            raise IndexError(f"sample id {bad} out of range for {self._num_rows} source rows")
        self._check_process()
        starts = self._layout()
        blocks = np.searchsorted(starts, ids, side="right") - 1
        rows = (ids - starts[blocks]).tolist()
        needed = np.unique(blocks).tolist()
        if sum(b not in self._cache for b in needed) > 1:  # several blocks to read: in parallel
            self._submit(needed)
        decoded = {b: self._decoded(b) for b in needed}
        items = [decoded[b].item(r) for b, r in zip(blocks.tolist(), rows)]
        if self.tokenizer is not None:
            self.tokenizer.add_ids(items)
        return items

    def prefetch(self, sample_ids: Iterable[int]) -> None:
        """Start reading, in the background, the blocks that ``sample_ids`` need (what is cached or
        in flight is skipped). Called by :class:`~varlen_cli.loader.PlanDataset` with the ids of the
        microbatches this process fetches next."""
        ids = _sample_ids(sample_ids if isinstance(sample_ids, np.ndarray) else list(sample_ids))
        ids = ids[(ids >= 0) & (ids < self._num_rows)]
        if not len(ids):
            return
        self._submit(np.unique(np.searchsorted(self._layout(), ids, side="right") - 1).tolist())

    def _submit(self, blocks: list[int]) -> None:
        """Background reads of the ``blocks`` that are neither cached nor being read."""
        pool = self._executor()
        for block in blocks:
            if block in self._cache or block in self._inflight:  # most are: no lock needed to skip them
                continue
            with self._lock:
                if block not in self._cache and block not in self._inflight:
                    self._inflight[block] = pool.submit(self._load, block)

    # -- blocks -------------------------------------------------------------------------------------
    def _layout(self) -> np.ndarray:
        """First sample_id of every block (files cut by their format's ``blocks`` function; the
        files' footers are read once, in parallel)."""
        if self._block_starts is None:
            def cut(fi: int) -> list[Block]:
                f = self.files[fi]
                cut_file = _FORMATS.get(f.format, (_any_blocks, None))[0]
                blocks = [Block(fi, u, int(u.rows)) for u in cut_file(f, self._entries[fi])]
                if sum(b.rows for b in blocks) != f.rows:
                    raise InputError(f"{f.path} now holds {sum(b.rows for b in blocks)} rows, not the {f.rows} "
                                     "analyze counted; re-run `varlen analyze`")
                return blocks

            with ThreadPoolExecutor(self.threads) as pool:
                per_file = list(pool.map(cut, range(len(self.files))))
            self._blocks = [b for blocks in per_file for b in blocks]
            self._block_starts = np.concatenate([[0], np.cumsum([b.rows for b in self._blocks], dtype=np.int64)])
        return self._block_starts

    def _decoded(self, block: int) -> _Decoded:
        with self._lock:
            found = self._cache.get(block)
            if found is not None:
                self._cache.move_to_end(block)
                return found
            future = self._inflight.get(block)
        return future.result() if future is not None else self._load(block)

    def _load(self, block: int) -> _Decoded:
        try:
            b = self._blocks[block]
            f = self.files[b.file]
            self._check_unchanged(b.file)
            read = _FORMATS.get(f.format, (None, _reader_read))[1]
            try:
                if self._selection is None:
                    table = read(f, b.unit, None)
                else:
                    table = self._selection.table(read(f, b.unit, self._selection.read), f.path)
            except (InputError, UsageError):
                raise
            except Exception as exc:  # noqa: BLE001 - pyarrow and the stores raise many types for a bad file
                text = str(exc).strip()
                raise InputError(f"cannot read {f.path}: {text.splitlines()[0] if text else type(exc).__name__} "
                                 "(did it change since `varlen analyze`?)") from None
            if table.num_rows != b.rows:
                raise InputError(f"{f.path} changed since analyze (a block holds {table.num_rows} rows, not "
                                 f"{b.rows}); re-run `varlen analyze`")
            decoded = _Decoded(table)
            with self._lock:
                self._cache[block] = decoded
                self._cached_bytes += decoded.nbytes
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.nbytes
            return decoded
        finally:
            with self._lock:
                self._inflight.pop(block, None)


    def _check_unchanged(self, file: int) -> None:
        """Refuse to read a file that changed since analyze (size or mtime: a ``stat`` of it and of the
        files its samples come from, at most once a second per file: an MDS index has a shard each)."""
        import time

        from ..runtime import freshness

        now = time.monotonic()
        if not self._records or now - self._checked.get(file, -1.0) < RECHECK_S:
            return
        self._checked[file] = now
        for path, record in self._records[file]:
            why = freshness.quick_difference(path, record)
            if why is not None:
                raise InputError(f"{self.metrics_dir} is stale: source {path} {why} since `varlen analyze` read it "
                                 "(while SourceDataset reads it); re-run `varlen analyze`")



class _Selection:
    """``columns=`` as PATHs (:mod:`varlen_cli.analyze.paths`): the columns read, and each item key's
    values taken from them (vectorised over a block)."""

    def __init__(self, columns: list[str], files: list):
        from ..analyze.core import split_path

        self.keys = columns
        self.at = [split_path(text, files) for text in columns]  # (column, steps) per key
        self.read = list(dict.fromkeys(column for column, _ in self.at))

    def holds(self, text: str, files: list) -> bool:
        """Whether the items hold PATH ``text`` (as a key, or inside a column they hold whole)."""
        from ..analyze.core import split_path

        return text in self.keys or split_path(text, files)[0] in self.keys

    def table(self, table, where: str):
        import pyarrow as pa

        from ..analyze.paths import extract

        if all(not steps and column == key for key, (column, steps) in zip(self.keys, self.at)):
            return table
        return pa.table({key: extract(table.column(column), steps, key, where) if steps and table.num_rows
                         else table.column(column) for key, (column, steps) in zip(self.keys, self.at)})


def _watched(manifest: dict) -> list[list[tuple[str, dict]]]:
    """Per source file, the (path, record) of it and of its companions that can be re-checked cheaply."""
    from .. import storage

    dataset = manifest.get("dataset") or {}
    root = dataset.get("root") or ""
    out = []
    for entry in dataset.get("files") or []:
        entry = entry if isinstance(entry, dict) else {}
        records = [entry, *(c for c in entry.get("companions") or [] if isinstance(c, dict))]
        out.append([(storage.under(str(r.get("path")), root), r) for r in records
                    if "mtime_ns" in r and not storage.is_remote(storage.under(str(r.get("path")), root))])
    return out


def _check_arguments(cache_bytes: Any, threads: Any) -> None:
    for name, value, least in (("cache_bytes", cache_bytes, 0), ("threads", threads, 1)):
        if not _is_index(value) or value < least:
            raise UsageError(f"SourceDataset({name}=...) must be an integer >= {least}, not {value!r}")


class _Decoded:
    """A block's rows ready to hand out: list-of-number columns as numpy (offsets, values), so that
    an item is a slice (a view, no copy); other columns as Arrow arrays."""

    def __init__(self, table):
        import pyarrow as pa

        self.names = table.column_names
        self.nbytes = table.nbytes
        self.columns: list = []
        for name in self.names:
            arr = table.column(name).combine_chunks()
            if (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) and \
                    _is_primitive(arr.type.value_type) and arr.null_count == 0:
                self.columns.append((arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False)))
            else:
                self.columns.append(arr)

    def item(self, row: int) -> dict:
        out = {}
        for name, col in zip(self.names, self.columns):
            if isinstance(col, tuple):
                offsets, flat = col
                out[name] = flat[offsets[row]:offsets[row + 1]]
            else:
                out[name] = col[row].as_py()
        return out


def _is_primitive(t) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t)


class IndexTypeError(UsageError, TypeError):
    """An index of :class:`SourceDataset` that is not an integer (a ``TypeError`` too, as Python's own)."""


def _is_index(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _sample_ids(indices) -> np.ndarray:
    """``indices`` (a sequence or 1-D array of integers) as int64 sample ids; anything else refused
    (floats, strings, nested lists: ``ds[1.7]`` must not read row 1)."""
    ids = np.asarray(indices)
    if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
        shown = repr(indices) if len(repr(indices)) <= 60 else repr(indices)[:57] + "..."
        raise IndexTypeError(f"SourceDataset indices are sample ids (a flat list of integers), not {shown}")
    return ids.astype(np.int64, copy=False)
