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


def describe(path: str, fmt: str, size: int) -> int:
    """The file's samples when known without reading the data (-1 otherwise); checks the header."""
    if fmt == "megatron":
        return megatron.read_index(path, size).sequences
    if fmt == "mds":
        return sum(s.samples for s in mds.read_index(path))
    if fmt == "lance":
        _VERSIONS.pop((os.getpid(), path), None)  # a new run opens and checks it again
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
    return webdataset.schema(path)


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
        return self._wds.read(path, unit.start, unit.stop, columns)


def document_offsets(paths: list[str], formats: list[str], sizes: list[int]) -> np.ndarray | None:
    """Per file, the number of documents before it, when every file has documents (Megatron), else None."""
    if not paths or any(f != "megatron" for f in formats):
        return None
    counts = [megatron.read_index(p, s).num_documents for p, s in zip(paths, sizes)]
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def companions(path: str, fmt: str, size: int) -> list[storage.FileInfo]:
    """The files beside ``path`` (a Lance manifest, a LitData ``index.json``) that its samples are read
    from, as found when the index was read: the dataset fingerprint records them."""
    if fmt == "lance":
        return lance_version(path).data
    if fmt == "litdata":
        return [c.info for c in litdata.read_index(path).chunks]
    return []


#: an item's columns when a reader of single samples (``varlen_cli.loader.SourceDataset``) asks for
#: all: a Megatron sample is its tokens (from ``.bin``) with its length and document
ITEM_COLUMNS: dict[str, tuple | None] = {"megatron": (megatron.TOKENS_COLUMN, "length", "document")}
