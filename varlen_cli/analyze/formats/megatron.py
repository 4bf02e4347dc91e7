"""Megatron-LM indexed datasets (``PREFIX.idx`` + ``PREFIX.bin``), read from the index alone.

The ``.idx`` layout (megatron-core ``megatron/core/datasets/indexed_dataset.py``, ``_IndexWriter``),
all little-endian::

    magic         9 bytes   b"MMIDIDX\\x00\\x00"
    version       uint64    1
    dtype code    uint8     of the tokens in .bin: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                            6 float64, 7 float32, 8 uint16
    sequences     uint64    n
    doc entries   uint64    d (the document boundaries, a leading 0 included)
    lengths       int32[n]  tokens per sequence
    pointers      int64[n]  byte offset of each sequence in .bin
    documents     int64[d]  sequence index where each document starts (0, ..., end of the last)
    modes         int8[n]   multimodal indexes only

A sample is a sequence: ``sample_id`` is the sequence index, its length the index's length.
Columns of a unit: ``length`` (int32) and ``document`` (the document holding the sequence, in this
file: the last boundary at or below the sequence index); ``input_ids`` (the tokens, from ``.bin``)
only when named. Every read is a range read (a local file or an object-storage URL, through
:mod:`varlen_cli.storage`).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass

import numpy as np

from ... import storage
from ...errors import InputError
from ...storage.files import check_regular, open_regular

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic 9 + version 8 + dtype 1 + sequences 8 + doc entries 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
COLUMNS = ("length", "document")  # what a unit holds; input_ids (the .bin) only when named
TOKENS_COLUMN = "input_ids"


@dataclass(frozen=True)
class Index:
    """The header of one ``.idx`` file, checked against the file's size."""

    path: str
    sequences: int
    doc_entries: int
    dtype: type
    multimodal: bool
    size: int = 0  # of the file, in bytes
    data: storage.FileInfo | None = None  # the .bin, as checked when the index was read (check_bin)

    @property
    def pointers_at(self) -> int:
        return HEADER_BYTES + 4 * self.sequences

    @property
    def documents_at(self) -> int:
        return HEADER_BYTES + 12 * self.sequences

    @property
    def num_documents(self) -> int:
        return self.doc_entries - 1


def bin_path(idx_path: str) -> str:
    return idx_path[: -len(".idx")] + ".bin"


def _read(path: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a file or object; short reads are a corrupt (truncated) index."""
    data = storage.read_range(path, start, stop)
    if len(data) != stop - start:
        raise InputError(f"corrupt Megatron index {path}: truncated (wanted bytes {start}-{stop})")
    return data


def read_index(path: str, size: int) -> Index:
    """The checked header of ``path`` (``size``: the file's size in bytes), and the ``.bin`` beside it
    checked against it (:func:`check_bin`). Read once per run (:func:`clear_cache`)."""
    hit = _INDEXES.get((path, size))
    if hit is None:
        hit = _read_index(path, size)
        hit = _INDEXES[(path, size)] = dataclasses.replace(hit, data=check_bin(hit))
    return hit


_INDEXES: dict[tuple, Index] = {}


def clear_cache() -> None:
    """Forget the indexes read so far (a new run reads and checks them again)."""
    _INDEXES.clear()


def check_bin(index: Index) -> storage.FileInfo:
    """The ``.bin`` must exist and end where the index's last sequence ends: the index's counts
    checked against the data file's size (its own end marker). The first sequence starts at byte 0."""
    data = bin_path(index.path)
    if not storage.is_remote(data):
        check_regular(storage.local_path(data), "Megatron data")
    try:
        info = storage.stat(data)
    except InputError as exc:
        raise InputError(f"Megatron data {data} (beside its index) cannot be read: {exc.message}") from None
    end = 0
    if index.sequences:
        first = int(_array(index.path, index.pointers_at, 1, np.int64)[0])
        last = int(_array(index.path, index.pointers_at + 8 * (index.sequences - 1), 1, np.int64)[0])
        length = int(lengths(index, index.sequences - 1, index.sequences)[0])
        if first != 0 or length < 0:
            raise InputError(f"corrupt Megatron index {index.path}: the first sequence starts at byte {first} of "
                             f"{data}, the last has length {length}")
        end = last + length * np.dtype(index.dtype).itemsize
    if info.size != end:
        raise InputError(f"Megatron data {data} has {info.size:,} bytes, but its index {index.path} ends its last "
                         f"sequence at byte {end:,} (truncated, or not the index's data)")
    return info


def _read_index(path: str, size: int) -> Index:
    if size < HEADER_BYTES:
        raise InputError(f"corrupt Megatron index {path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    head = _read(path, 0, HEADER_BYTES)
    if head[:9] != MAGIC:
        raise InputError(f"corrupt Megatron index {path}: bad magic {head[:9]!r} (expected {MAGIC!r})")
    version, code, n, d = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise InputError(f"corrupt Megatron index {path}: version {version} (only version 1 is known)")
    if code not in DTYPES:
        raise InputError(f"corrupt Megatron index {path}: unknown token dtype code {code}")
    plain = HEADER_BYTES + 12 * n + 8 * d
    if size not in (plain, plain + n):
        raise InputError(f"corrupt Megatron index {path}: {size} bytes, but {n} sequences and {d} document "
                         f"entries need {plain} (or {plain + n} with modes)")
    index = Index(path, n, d, DTYPES[code], size == plain + n and n > 0, size)
    # megatron-core's IndexedDataset asserts the same: boundaries run from 0 to the sequence count
    if d < 1 or _boundary(index, 0) != 0 or _boundary(index, d - 1) != n:
        raise InputError(f"corrupt Megatron index {path}: document boundaries must run from 0 to {n} (the "
                         f"sequence count)")
    return index


def _array(path: str, offset: int, count: int, dtype) -> np.ndarray:
    """``count`` values of ``dtype`` at byte ``offset``: ``np.fromfile`` on a local file (no
    intermediate bytes object), one range read on object storage."""
    if storage.is_remote(path):
        return np.frombuffer(_read(path, offset, offset + count * np.dtype(dtype).itemsize), dtype)
    try:
        with open_regular(storage.local_path(path), "rb", what="Megatron index") as fh:  # a FIFO: refused
            values = np.fromfile(fh, dtype, count=count, offset=offset)
    except OSError as exc:
        raise InputError(f"{path} is not readable: {exc.strerror}") from None
    if len(values) != count:
        raise InputError(f"corrupt Megatron index {path}: truncated (wanted {count} values at byte {offset})")
    return values


def lengths(index: Index, start: int, stop: int) -> np.ndarray:
    """``int32`` lengths of sequences [start, stop): one read."""
    return _array(index.path, HEADER_BYTES + 4 * start, stop - start, np.int32)


def _arrow(values: np.ndarray):
    """A numpy array as an Arrow array without a copy (``pa.array`` copies a read-only array slowly)."""
    import pyarrow as pa

    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _boundary(index: Index, k: int) -> int:
    at = index.documents_at + 8 * k
    return int(np.frombuffer(_read(index.path, at, at + 8), np.int64)[0])


def _last_boundary_at_or_below(index: Index, seq: int, fh) -> int:
    """The largest k with documents[k] <= seq: a binary search, O(log d) reads of 8 bytes on ``fh``."""
    lo, hi = 0, index.doc_entries - 1  # documents[0] == 0 <= seq
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fh.seek(index.documents_at + 8 * mid)
        raw = fh.read(8)
        if len(raw) != 8:
            raise InputError(f"corrupt Megatron index {index.path}: truncated")
        if int.from_bytes(raw, "little", signed=True) <= seq:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _boundaries(index: Index, start: int, stop: int) -> tuple[int, np.ndarray]:
    """``(k0, documents[k0:k1 + 1])`` with ``k0``/``k1`` the last boundaries at or below ``start`` and
    ``stop - 1``: the documents of sequences [start, stop). Usually one read: the boundaries are
    guessed by interpolation (documents spread evenly over the sequences), with slack; a guess that
    misses falls back to two binary searches."""
    d, n = index.doc_entries, index.sequences
    guess_lo, guess_hi = (d - 1) * start // n, -(-(d - 1) * stop // n)
    slack = 4096 + (guess_hi - guess_lo) // 32
    a, b = max(0, guess_lo - slack), min(d, guess_hi + slack + 1)
    window = _array(index.path, index.documents_at + 8 * a, b - a, np.int64)
    _check_boundaries(index, window)
    if window[0] <= start and window[-1] > stop - 1:  # documents[d - 1] == n > stop - 1 closes the last one
        k0 = int(np.searchsorted(window, start, "right")) - 1
        k1 = int(np.searchsorted(window, stop - 1, "right")) - 1
        return a + k0, window[k0:k1 + 1]
    with storage.open_input(index.path, block_size=1 << 16) as fh:
        k0 = _last_boundary_at_or_below(index, start, fh)
        k1 = _last_boundary_at_or_below(index, stop - 1, fh)
    bounds = _array(index.path, index.documents_at + 8 * k0, k1 - k0 + 1, np.int64)
    _check_boundaries(index, bounds)
    return k0, bounds


def _check_boundaries(index: Index, bounds: np.ndarray) -> None:
    """Document boundaries read must be non-decreasing sequence indexes (0 to the sequence count)."""
    if len(bounds) and (np.any(bounds[1:] < bounds[:-1]) or bounds[0] < 0 or bounds[-1] > index.sequences):
        raise InputError(f"corrupt Megatron index {index.path}: document boundaries must not decrease and must lie "
                         f"in 0..{index.sequences} (the sequence count)")


def documents(index: Index, start: int, stop: int) -> np.ndarray:
    """The document (in this file) of each sequence in [start, stop), as int64 (vectorised; speed in
    benchmarks/README.md).

    Document k holds the sequences [documents[k], documents[k+1]); empty documents keep their
    number. Reads only the boundaries that cover the range."""
    if stop <= start:
        return np.zeros(0, np.int64)
    k0, bounds = _boundaries(index, start, stop)
    m = stop - start
    if len(bounds) == m and (m == 1 or (bounds[1] == start + 1 and not np.any(bounds[2:] == bounds[1:-1]))):
        # a document starts at every sequence (one sequence a document, Megatron's usual layout)
        return np.arange(k0, k0 + m, dtype=np.int64)
    # boundaries after k0 all lie in (start, stop): document = k0 + the boundaries at or below the
    # sequence, a running sum of the boundaries per sequence (several at one sequence: empty documents)
    marks = np.bincount(bounds[1:] - start, minlength=m)
    marks[0] += k0
    return np.cumsum(marks, out=marks)


def tokens(index: Index, start: int, stop: int, lens: np.ndarray | None = None):
    """The tokens of sequences [start, stop) as an Arrow large_list (one range read of ``.bin``:
    a builder writes consecutive sequences back to back)."""
    import pyarrow as pa

    lens = lengths(index, start, stop) if lens is None else lens
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    if stop <= start:
        return pa.array([], pa.large_list(pa.from_numpy_dtype(index.dtype)))
    ptr = np.frombuffer(_read(index.path, index.pointers_at + 8 * start, index.pointers_at + 8 * stop), np.int64)
    item = np.dtype(index.dtype).itemsize
    if np.any(ptr - ptr[0] != offsets[:-1] * item):
        raise InputError(f"Megatron data {bin_path(index.path)}: sequences {start}-{stop} are not stored back to back")
    data = storage.read_range(bin_path(index.path), int(ptr[0]), int(ptr[0]) + int(offsets[-1]) * item)
    if len(data) != int(offsets[-1]) * item:
        raise InputError(f"Megatron data {bin_path(index.path)} is shorter than its index says")
    values = _arrow(np.frombuffer(data, index.dtype))
    return pa.LargeListArray.from_arrays(pa.array(offsets), values)


CHECK_BLOCK = 1 << 16  # pointers compared at a time: the buffers stay in the CPU cache


def _pointer_blocks(index: Index, start: int, count: int):
    """``(a, pointers[start + a : start + a + CHECK_BLOCK + 1])`` for a = 0, CHECK_BLOCK, ... below
    ``count - 1`` (consecutive blocks share a pointer): one reused buffer for a local index (no fresh
    array of the unit's pointers to page in), one range read in object storage."""
    at = index.pointers_at + 8 * start
    if storage.is_remote(index.path):
        ptr = np.frombuffer(_read(index.path, at, at + 8 * count), np.int64)
        for a in range(0, count - 1, CHECK_BLOCK):
            yield a, ptr[a:a + CHECK_BLOCK + 1]
        return
    buf = np.empty(min(count, CHECK_BLOCK + 1), np.int64)
    try:
        with open_regular(storage.local_path(index.path), "rb", what="Megatron index", buffering=0) as fh:
            for a in range(0, count - 1, CHECK_BLOCK):
                view = buf[:min(CHECK_BLOCK + 1, count - a)]
                fh.seek(at + 8 * a)
                if fh.readinto(memoryview(view).cast("B")) != 8 * len(view):
                    raise InputError(f"corrupt Megatron index {index.path}: truncated (wanted {len(view)} pointers "
                                     f"at byte {at + 8 * a})")
                yield a, view
    except OSError as exc:
        raise InputError(f"{index.path} is not readable: {exc.strerror}") from None


def check_sequences(index: Index, start: int, stop: int, lens: np.ndarray) -> None:
    """Sequences [start, stop) lie back to back in the ``.bin`` exactly as their lengths say: each
    pointer is the previous one plus that sequence's bytes, up to the pointer of ``stop`` (the next
    unit's first; for the last unit :func:`check_bin` checked that its last sequence ends at the
    ``.bin``'s end, and that the first starts at byte 0). Every unit of a file checked means the lengths
    are exactly the ``.bin``'s layout: a changed, swapped or negative length, a count that does not
    match the data, a pointer out of order are refused. One read of the unit's pointers (8 bytes a
    sequence, beside the lengths' 4: the lengths' sum alone cannot tell two swapped lengths apart),
    compared in cache-sized blocks (speed: benchmarks/README.md)."""
    if stop <= start:
        return
    item = np.dtype(index.dtype).itemsize
    count = stop - start + (stop < index.sequences)  # the unit's pointers, and the next unit's first
    gaps, sizes = np.empty(min(count, CHECK_BLOCK), np.int64), np.empty(min(count, CHECK_BLOCK), np.int64)
    for a, ptr in _pointer_blocks(index, start, count):
        k = len(ptr) - 1
        np.subtract(ptr[1:], ptr[:-1], out=gaps[:k])
        np.multiply(lens[a:a + k], item, out=sizes[:k], dtype=np.int64)
        if not np.array_equal(gaps[:k], sizes[:k]):
            if np.any(lens < 0):
                raise InputError(f"corrupt Megatron index {index.path}: negative sequence lengths (sequences "
                                 f"{start}-{stop})")
            j = int(np.flatnonzero(gaps[:k] != sizes[:k])[0])
            raise InputError(f"corrupt Megatron index {index.path}: sequence {start + a + j} has length "
                             f"{int(lens[a + j]):,} ({int(sizes[j]):,} bytes), but its pointer and the next are "
                             f"{int(gaps[j]):,} bytes apart in {bin_path(index.path)}")


def table(index: Index, start: int, stop: int, columns) -> object:
    """Sequences [start, stop) as an Arrow table of ``columns`` (None: length and document), checked
    (:func:`check_sequences`)."""
    import pyarrow as pa

    wanted = list(COLUMNS) if columns is None else list(columns)
    lens = lengths(index, start, stop)
    check_sequences(index, start, stop, lens)
    out = {}
    for c in wanted:
        if c == "length":
            out[c] = _arrow(lens)
        elif c == "document":
            out[c] = pa.array(documents(index, start, stop))
        elif c == TOKENS_COLUMN:
            out[c] = tokens(index, start, stop, lens)
        else:
            raise InputError(f"column '{c}' not found in Megatron index {index.path} (columns: length, document, "
                             f"{TOKENS_COLUMN})")
    return pa.table(out)


def schema(index: Index):
    import pyarrow as pa

    return pa.schema([("length", pa.int32()), ("document", pa.int64())])



def write_index(path: str, sequence_lengths, document_starts, dtype=np.int32, modes=None) -> None:
    """Write an ``.idx`` (the inverse of :func:`read_index`; benchmarks and tests build big ones), and
    where there is no ``.bin`` beside it, an all-zero (sparse) one of the size the index needs."""
    lens = np.asarray(sequence_lengths, np.int32)
    item = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lens), np.int64)
    if len(lens):
        np.cumsum(lens[:-1].astype(np.int64) * item, out=pointers[1:])
    docs = np.asarray(document_starts, np.int64)
    code = {np.dtype(v): k for k, v in DTYPES.items()}[np.dtype(dtype)]
    with open(path, "wb") as fh:
        fh.write(MAGIC + struct.pack("<QBQQ", 1, code, len(lens), len(docs)))
        fh.write(lens.tobytes())
        fh.write(pointers.tobytes())
        fh.write(docs.tobytes())
        if modes is not None:
            fh.write(np.asarray(modes, np.int8).tobytes())
    if not os.path.exists(bin_path(path)):
        with open(bin_path(path), "wb") as fh:
            fh.truncate(int(lens.astype(np.int64).sum()) * item)
