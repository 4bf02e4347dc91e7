"""Shard formats of training corpora, each in its own module, behind one small dispatch.

========== ============================================= ============================================
format     a SOURCE                                      one sample (``sample_id`` order)
========== ============================================= ============================================
megatron   ``PREFIX.idx`` (or ``PREFIX``) beside         a sequence of the index (the ``.bin`` is
           ``PREFIX.bin``                                only read for ``input_ids``)
mds        a folder with an MDS ``index.json``           a sample, shards in ``index.json`` order
webdataset ``.tar`` shards (a file, folder or glob)      a key group, shards in path order
========== ============================================= ============================================

:mod:`varlen_cli.analyze.sources` calls :func:`format_of` (names), :func:`describe` (rows known
up front), :func:`units`, :func:`schema`, and a :class:`Reader` per worker (which
``varlen_cli.loader.SourceDataset`` also reads items with; :data:`ITEM_COLUMNS`). Every
byte is read through :mod:`varlen_cli.storage`, so local paths and object-storage URLs both work.
This package imports nothing from ``sources`` (units are returned as plain tuples).
"""

from __future__ import annotations

import numpy as np

from ... import storage
from . import mds, megatron, webdataset

NAMES = ("megatron", "mds", "webdataset")
EXTENSIONS = {".idx": "megatron", ".tar": "webdataset"}


def format_of(path: str) -> str | None:
    """The shard format a file name says, or None."""
    name = storage.name(path)
    if name == mds.INDEX_NAME:
        return "mds"
    lower = name.lower()
    for ext, fmt in EXTENSIONS.items():
        if lower.endswith(ext):
            return fmt
    return None


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
    return webdataset.units(size, chunk_bytes)


def schema(path: str, fmt: str, size: int):
    if fmt == "megatron":
        return megatron.schema(megatron.read_index(path, size))
    if fmt == "mds":
        return mds.schema(mds.read_index(path))
    return webdataset.schema(path)


class Reader:
    """One worker's reader of units of these formats (keeps a shard open between units)."""

    def __init__(self):
        self._mds = mds.ShardReader()
        self._wds = webdataset.ShardReader()
        self._index: megatron.Index | None = None  # the last Megatron index read (its header, checked)

    def read(self, path: str, fmt: str, size: int, unit, columns):
        """The unit's rows (``unit``: part, start, stop) as an Arrow table of ``columns`` (None: all)."""
        if fmt == "megatron":
            if self._index is None or self._index.path != path or self._index.size != size:
                self._index = megatron.read_index(path, size)
            return megatron.table(self._index, unit.start, unit.stop, columns)
        if fmt == "mds":
            return self._mds.read(path, unit.part, unit.start, unit.stop, columns)
        return self._wds.read(path, unit.start, unit.stop, columns)


def document_offsets(paths: list[str], formats: list[str], sizes: list[int]) -> np.ndarray | None:
    """Per file, the number of documents before it, when every file has documents (Megatron), else None."""
    if not paths or any(f != "megatron" for f in formats):
        return None
    counts = [megatron.read_index(p, s).num_documents for p, s in zip(paths, sizes)]
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


#: an item's columns when a reader of single samples (``varlen_cli.loader.SourceDataset``) asks for
#: all: a Megatron sample is its tokens (from ``.bin``) with its length and document
ITEM_COLUMNS: dict[str, tuple | None] = {"megatron": (megatron.TOKENS_COLUMN, "length", "document")}
