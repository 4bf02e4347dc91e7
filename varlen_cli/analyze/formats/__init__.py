"""Shard formats of training corpora, each in its own module, behind one small dispatch.

========== ============================================= ============================================
format     a SOURCE                                      one sample (``sample_id`` order)
========== ============================================= ============================================
megatron   ``PREFIX.idx`` (or ``PREFIX``) beside         a sequence of the index (the ``.bin`` is
           ``PREFIX.bin``                                only read for ``input_ids``)
mds        a folder with an MDS ``index.json``           a sample, shards in ``index.json`` order
webdataset ``.tar`` shards (a file, folder or glob)      a key group, shards in path order
lance      a ``DIR.lance`` folder (its latest version)   a row in Lance's order (``dataset.take``):
           or ``DIR/_versions/N.manifest``               fragments in manifest order, deletions skipped
litdata    a folder with a LitData ``index.json``        an item, chunks in ``index.json`` order
           (``optimize()`` output)
========== ============================================= ============================================

:mod:`varlen_cli.analyze.sources` calls :func:`format_of` (names), :func:`describe` (rows known
up front), :func:`units`, :func:`schema`, and a :class:`Reader` per worker (which
``varlen_cli.loader.SourceDataset`` also reads items with; :data:`ITEM_COLUMNS`). Every
byte is read through :mod:`varlen_cli.storage`, so local paths and object-storage URLs both work.
This package imports nothing from ``sources`` (units are returned as plain tuples).

**The reader contract** (every format keeps it: a damaged, truncated or changed shard is refused in
one line, never read in part):

1. A count the files declare is checked against the container's own sizes before anything is
   allocated from it: MDS ``samples`` and byte counts are integers of 0 or more, each shard file
   has the size ``index.json`` gives it, and a raw shard's size can hold its samples' offsets
   (compressed shards are decompressed a step at a time, never past the declared size); Megatron's
   sequence and document counts fill the ``.idx`` exactly; LitData's ``chunk_size`` and ``chunk_bytes``
   are integers of 0 or more and each chunk file has exactly its ``chunk_bytes`` (decompressed, for
   zstd); each Lance data file has the size its version's manifest records. Tar shards declare no count.
2. Where reading ends, the container's own end marker must be there: a tar walk ends at the two
   zero blocks of end-of-archive, followed by zeros only (``tarfile`` itself takes a damaged header
   for the end); an MDS shard's first 4 bytes hold the index's sample count and its last sample ends
   at its last byte; a Megatron ``.bin`` ends where the last sequence does (the first starts at 0); a
   LitData chunk's first 4 bytes hold its item count, its last item ends at its last byte (or where
   its Arrow footer starts, which fills the rest exactly); a Lance unit returns the rows its manifest
   counts.
3. What is read is checked on the way: MDS and LitData offsets non-decreasing (LitData items hold
   their leaves' sizes), each MDS sample exactly its columns, each MDS shard's own header (its column
   names, encodings, sizes) the index's; Megatron pointers each where the previous sequence ends (so
   the lengths are exactly the ``.bin``'s layout), document boundaries non-decreasing within
   0..sequences.
4. :func:`companions` names the files beside the one discovered that the samples come from (a
   Megatron ``.bin``, MDS shards, LitData chunks, a Lance version's data files): the dataset
   fingerprint records them, so a rewritten one makes
   the metrics stale (:mod:`varlen_cli.runtime.freshness`).

Indexes are read once per run (:func:`clear_cache` when a run discovers its sources).
"""

from __future__ import annotations

import os

import numpy as np

from ... import storage
from . import lance, litdata, mds, megatron, webdataset

NAMES = ("megatron", "mds", "webdataset", "lance", "litdata")
EXTENSIONS = {".idx": "megatron", ".tar": "webdataset"}


def format_of(path: str) -> str | None:
    """The shard format a file name says, or None."""
    name = storage.name(path)
    if name == mds.INDEX_NAME:
        return "mds"  # or litdata: :func:`index_format` tells them apart by content
    if lance.is_manifest(path):
        return "lance"
    lower = name.lower()
    for ext, fmt in EXTENSIONS.items():
        if lower.endswith(ext):
            return fmt
    return None


def index_format(path: str) -> str:
    """``mds`` or ``litdata``: the format of an ``index.json`` (LitData's has ``chunks`` and ``config``)."""
    return "litdata" if litdata.is_index(path) else "mds"


def dataset_manifest(directory: str) -> str | None:
    """The file that stands for a dataset folder of a format that is a folder (a Lance dataset: its
    latest version's manifest), or None."""
    return lance.latest_manifest(directory)


_VERSIONS: dict[tuple, lance.Version] = {}  # Lance versions opened, per process (immutable once written)


def lance_version(path: str) -> lance.Version:
    """The Lance version ``path`` names, opened once per process (a forked DataLoader worker opens its
    own: Lance's runtime threads do not survive a fork)."""
    key = (os.getpid(), path)
    if key not in _VERSIONS:
        _VERSIONS[key] = lance.open_version(path)
    return _VERSIONS[key]


def megatron_prefix(source: str) -> str | None:
    """``PREFIX.idx`` for a SOURCE ``PREFIX`` that names a Megatron pair (``PREFIX.idx`` + ``PREFIX.bin``)."""
    if source.endswith((".idx", ".bin")) or not storage.isfile(source + ".idx"):
        return None
    return source + ".idx"


def clear_cache() -> None:
    """Forget the indexes read so far: a new run reads and checks them again."""
    megatron.clear_cache()
    mds.clear_cache()
    litdata.clear_cache()
    _VERSIONS.clear()


def companions(path: str, fmt: str, size: int) -> list[storage.FileInfo]:
    """The files beside ``path`` (an ``.idx``, an ``index.json``) that its samples are read from, as
    stat'ed when the index was read and checked against them."""
    if fmt == "megatron":
        return [megatron.read_index(path, size).data]
    if fmt == "mds":
        return [s.info for s in mds.read_index(path)]
    if fmt == "lance":  # the version's data files
        return lance_version(path).data
    if fmt == "litdata":  # the chunks
        return [c.info for c in litdata.read_index(path).chunks]
    return []


def describe(path: str, fmt: str, size: int) -> int:
    """The file's samples when known without reading the data (-1 otherwise); checks the header."""
    if fmt == "megatron":
        return megatron.read_index(path, size).sequences
    if fmt == "mds":
        return sum(s.samples for s in mds.read_index(path))
    if fmt == "lance":
        return sum(lance_version(path).rows)
    if fmt == "litdata":
        return sum(c.items for c in litdata.read_index(path).chunks)
    return -1


def units(path: str, fmt: str, size: int, chunk_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """(part, start, stop, rows, weight) work units of one file, in sample order."""
    if fmt == "megatron":
        n = megatron.read_index(path, size).sequences
        step = max(1, chunk_bytes // 4)  # chunk_bytes of lengths (int32) per unit
        bounds = [*range(0, n, step), n] if n else [0, 0]
        return [(-1, a, b, b - a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    if fmt == "mds":
        return mds.units(mds.read_index(path), chunk_bytes)
    if fmt == "lance":
        return lance.units(lance_version(path), chunk_bytes)
    if fmt == "litdata":
        return litdata.units(litdata.read_index(path), chunk_bytes)
    return webdataset.units(size, chunk_bytes)


def schema(path: str, fmt: str, size: int):
    if fmt == "megatron":
        return megatron.schema(megatron.read_index(path, size))
    if fmt == "mds":
        return mds.schema(mds.read_index(path))
    if fmt == "lance":
        return lance_version(path).dataset.schema
    if fmt == "litdata":
        return litdata.schema(litdata.read_index(path))
    return webdataset.schema(path, size)


class Reader:
    """One worker's reader of units of these formats (keeps a shard open between units)."""

    def __init__(self):
        self._mds = mds.ShardReader()
        self._wds = webdataset.ShardReader()
        self._litdata = litdata.ChunkReader()
        self._index: megatron.Index | None = None  # the last Megatron index read (its header, checked)

    def read(self, path: str, fmt: str, size: int, unit, columns):
        """The unit's rows (``unit``: part, start, stop) as an Arrow table of ``columns`` (None: all)."""
        if fmt == "megatron":
            if self._index is None or self._index.path != path or self._index.size != size:
                self._index = megatron.read_index(path, size)
            return megatron.table(self._index, unit.start, unit.stop, columns)
        if fmt == "mds":
            return self._mds.read(path, unit.part, unit.start, unit.stop, columns)
        if fmt == "lance":
            return lance.read(lance_version(path), unit.part, unit.start, unit.stop, columns)
        if fmt == "litdata":
            return self._litdata.read(path, unit.part, unit.start, unit.stop, columns)
        return self._wds.read(path, size, unit.start, unit.stop, columns)


def document_offsets(paths: list[str], formats: list[str], sizes: list[int]) -> np.ndarray | None:
    """Per file, the number of documents before it, when every file has documents (Megatron), else None."""
    if not paths or any(f != "megatron" for f in formats):
        return None
    counts = [megatron.read_index(p, s).num_documents for p, s in zip(paths, sizes)]
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


#: an item's columns when a reader of single samples (``varlen_cli.loader.SourceDataset``) asks for
#: all: a Megatron sample is its tokens (from ``.bin``) with its length and document
ITEM_COLUMNS: dict[str, tuple | None] = {"megatron": (megatron.TOKENS_COLUMN, "length", "document")}
