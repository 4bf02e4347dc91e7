"""MosaicML Streaming MDS datasets: a folder with ``index.json`` and its shards.

``index.json`` lists the shards in order (``{"version": 2, "shards": [{"format": "mds",
"column_names", "column_encodings", "column_sizes", "samples", "raw_data": {"basename", "bytes"},
"zip_data", "compression"}, ...]}``). A raw shard (``MDSWriter``'s ``encode_joint_shard``) is::

    uint32 n | uint32 offsets[n + 1] (absolute, per sample) | config JSON | samples

and a sample is ``uint32 size`` for each variable-size column (in column order), then every
column's bytes (columns sorted by name). ``sample_id`` is the global index in shard order.

Encodings become Arrow columns: ``str`` -> string; ``bytes`` and the image/pickle encodings ->
binary (never decoded or unpickled); ``int``/``int8``...``uint64``/``float16``...``float64`` ->
numbers; ``str_int``/``str_float``/``str_decimal`` -> int64/float64; ``ndarray[:dtype[:shape]]``
-> a list of the array's elements (flattened; float64 when the dtype is per sample); ``json`` ->
the parsed value. So ``--length list:COL`` counts an ndarray's elements,
``tokens``/``chars``/``words``/``bytes`` measure a str column, ``value:COL`` takes an int column,
``chat:COL`` a json list of messages.

Raw shards are read with range reads (the unit's offsets, then its samples); units are sample
ranges of about ``chunk_bytes``. A compressed shard (``zstd``, ``gz``, ``bz2``, ``br``,
``snappy``) is read and decompressed whole, as one unit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ... import storage
from ...errors import InputError
from ...storage.files import check_regular
from . import ranges

INDEX_NAME = "index.json"
SCALARS = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "int8": np.int8,
           "int16": np.int16, "int32": np.int32, "int64": np.int64, "int": np.int64, "float16": np.float16,
           "float32": np.float32, "float64": np.float64}
NDARRAY_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                  34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
SHAPE_DTYPES = {0: np.uint8, 1: np.uint16, 2: np.uint32, 3: np.uint64}
CODECS = ("zstd", "gz", "bz2", "br", "snappy")
GATHER_BYTES = 8 << 20  # bytes gathered per numpy pass (bounds the index array's memory)


@dataclass(frozen=True)
class Shard:
    path: str  # the raw (or compressed) shard file
    samples: int
    raw_bytes: int
    names: tuple
    encodings: tuple
    sizes: tuple  # fixed size in bytes, or None (stored per sample)
    compression: str | None
    info: storage.FileInfo | None = None  # the shard file when the index was read (freshness records it)


MAX_RAW_BYTES = (1 << 32) - 1  # a raw shard's offsets are uint32: no shard is longer


def read_index(index_path: str) -> list[Shard]:
    """The shards listed by an MDS ``index.json``, checked: every count is a non-negative integer,
    every shard file exists with the size the index gives it, and a raw shard's size can hold the
    samples it declares (a 4-byte count and 4-byte offsets), so nothing is allocated from a count
    the files cannot back. Read once per run (:func:`clear_cache`)."""
    hit = _INDEXES.get(index_path)
    if hit is None:
        hit = _INDEXES[index_path] = _read_index(index_path)
    return hit


_INDEXES: dict[str, list[Shard]] = {}


def clear_cache() -> None:
    """Forget the indexes read so far (a new run reads them, and stats their shards, again)."""
    _INDEXES.clear()


def _read_index(index_path: str) -> list[Shard]:
    try:
        obj = json.loads(storage.read_bytes(index_path))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested past Python's limit
        raise InputError(f"{index_path} is not an MDS index: {exc}") from None
    if not isinstance(obj, dict) or "shards" not in obj:
        raise InputError(f"{index_path} is not an MDS index: 'shards'")
    shards = obj["shards"]
    if not isinstance(shards, list):
        raise InputError(f"{index_path} is not an MDS index: 'shards' is {json.dumps(shards)[:40]}, not a list of "
                         "shard entries")
    folder = storage.parent(index_path)
    return [_shard(index_path, folder, k, s) for k, s in enumerate(shards)]


def _shard(index_path: str, folder: str, k: int, s) -> Shard:
    """Entry ``k`` of the index, checked against its shard file."""
    where = f"{index_path}: shard {k}"
    if not isinstance(s, dict):
        raise InputError(f"{where} is not a valid MDS shard entry ({json.dumps(s)[:40]}, not an object)")
    try:
        if s.get("format") != "mds":
            raise InputError(f"{where} has format {s.get('format')!r}; only 'mds' shards are read (not xsv/json)")
        compression = s.get("compression")
        data = s["zip_data"] if compression else s["raw_data"]
        if compression and compression.split(":")[0] not in CODECS:
            raise InputError(f"{where} has unknown compression {compression!r}")
        names, encodings, sizes = (tuple(s[key]) for key in ("column_names", "column_encodings", "column_sizes"))
        samples, raw_bytes = _count(s["samples"], where, "samples"), _count(s["raw_data"]["bytes"], where, "raw bytes")
        file_bytes, basename = _count(data["bytes"], where, "bytes"), data["basename"]
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise InputError(f"{where} is not a valid MDS shard entry ({exc})") from None
    if not len(names) == len(encodings) == len(sizes) or not all(isinstance(n, str) for n in names):
        raise InputError(f"{where} is not a valid MDS shard entry (column names, encodings and sizes differ in number)")
    _check_columns(names, encodings, sizes, where)
    if not isinstance(basename, str) or not basename or basename.startswith("/") or ".." in basename.split("/"):
        raise InputError(f"{where} names the shard file {basename!r}; it must lie in the index's folder")
    if raw_bytes > MAX_RAW_BYTES or 4 * (samples + 2) > raw_bytes:
        raise InputError(f"{where} declares {samples:,} samples in {raw_bytes:,} raw bytes: a raw MDS shard (uint32 "
                         "offsets) cannot hold that; the index is corrupt")
    path = storage.join(folder, basename)
    if not storage.is_remote(path):
        check_regular(storage.local_path(path), "MDS shard")
    info = storage.stat(path)
    size = info.size
    if size != file_bytes:
        raise InputError(f"MDS shard {path} has {size:,} bytes; {index_path} says {file_bytes:,} (truncated or "
                         "replaced)")
    return Shard(path, samples, raw_bytes, names, encodings, sizes, compression.split(":")[0] if compression else None,
                 info)


def _check_columns(names: tuple, encodings: tuple, sizes: tuple, where: str) -> None:
    """Column encodings are names, sizes are None (stored per sample) or byte counts, and a number
    column's size is its type's (an index whose ``int64`` column has size 4 would read its neighbour)."""
    for name, encoding, size in zip(names, encodings, sizes):
        if not isinstance(encoding, str) or size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                                                  or size < 0):
            raise InputError(f"{where} is not a valid MDS shard entry (column {name!r}: encoding "
                             f"{json.dumps(encoding)[:40]}, size {json.dumps(size)[:40]})")
        scalar = SCALARS.get(encoding)
        if scalar is not None and size != np.dtype(scalar).itemsize:
            raise InputError(f"{where} is not a valid MDS shard entry (column {name!r} is {encoding}, "
                             f"{np.dtype(scalar).itemsize} bytes a sample, but its size is {json.dumps(size)})")


def _count(value, where: str, what: str) -> int:
    """A count of the index: a JSON integer of 0 or more (not a float, a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{where} has {what} {json.dumps(value)[:40]}; an integer of 0 or more is needed")
    return value


def units(shards: list[Shard], chunk_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """(part, start, stop, rows, weight): sample ranges of about ``chunk_bytes`` per shard."""
    return [unit for k, s in enumerate(shards) for unit in ranges.row_ranges(
        k, s.samples, s.samples if s.compression else ranges.unit_rows(s.samples, s.raw_bytes, chunk_bytes))]


def schema(shards: list[Shard]):
    import pyarrow as pa

    if not shards:
        return pa.schema([])
    s = shards[0]
    return pa.schema([(n, arrow_type(e)) for n, e in zip(s.names, s.encodings)])


def arrow_type(encoding: str):
    import pyarrow as pa

    name, _, rest = encoding.partition(":")
    if name == "str":
        return pa.large_string()
    if name in SCALARS:
        return pa.from_numpy_dtype(SCALARS[name])
    if name == "str_int":
        return pa.int64()
    if name in ("str_float", "str_decimal"):
        return pa.float64()
    if name == "ndarray":
        dtype = rest.partition(":")[0]
        return pa.large_list(pa.from_numpy_dtype(np.dtype(dtype)) if dtype else pa.float64())
    if name == "json":
        return pa.large_string()  # parsed per unit; its type is what the values are
    return pa.large_binary()


class ShardReader:
    """Reads units of MDS shards; keeps the last decompressed shard (a compressed shard is one unit)."""

    def __init__(self):
        self._index: tuple[str, list[Shard]] | None = None
        self._decompressed: tuple[str, bytes] | None = None

    def shards(self, index_path: str) -> list[Shard]:
        if self._index is None or self._index[0] != index_path:
            self._index = (index_path, read_index(index_path))
        return self._index[1]

    def read(self, index_path: str, part: int, start: int, stop: int, columns):
        shard = self.shards(index_path)[part]
        if shard.compression:
            buf = self._whole(shard)
            offsets = _offsets(buf[4 * (start + 1): 4 * (stop + 2)], shard, start, stop)
            base = 0
        else:  # the first unit also reads the shard's own sample count (its first 4 bytes) and header
            head = storage.read_range(shard.path, 4 * (start + 1) if start else 0, 4 * (stop + 2))
            if not start:
                _check_count(head[:4], shard)
                head = head[4:]
            offsets = _offsets(head, shard, start, stop)
            base = 4 * (shard.samples + 2) if not start else int(offsets[0])
            buf = storage.read_range(shard.path, base, int(offsets[-1]))
            if len(buf) != int(offsets[-1]) - base:
                raise InputError(f"MDS shard {shard.path} is truncated")
            if not start:
                check_header(buf[:int(offsets[0]) - base], shard)
        view = np.frombuffer(buf, np.uint8)
        return decode(view, offsets.astype(np.int64) - base, shard, columns)

    def _whole(self, shard: Shard) -> bytes:
        if self._decompressed is None or self._decompressed[0] != shard.path:
            self._decompressed = None
            buf = decompress(storage.read_bytes(shard.path), shard)
            _check_count(buf[:4], shard)
            first = _offsets(buf[4:8], shard, 0, 0)[0] if len(buf) >= 8 else 0
            check_header(buf[4 * (shard.samples + 2):first], shard)
            self._decompressed = (shard.path, buf)
        return self._decompressed[1]


DECOMPRESS_STEP = 8 << 20


def decompress(data: bytes, shard: Shard) -> bytes:
    """The raw shard, decompressed a step at a time: never more than the ``raw_bytes`` the index
    declares is produced (a corrupt count cannot make varlen allocate what the data does not hold)."""
    import bz2
    import zlib

    import pyarrow as pa

    limit, parts, total = shard.raw_bytes + 1, [], 0
    try:
        if shard.compression in ("gz", "bz2"):
            d = zlib.decompressobj(wbits=31) if shard.compression == "gz" else bz2.BZ2Decompressor()
            chunk = d.decompress(data, limit)
            parts, total = [chunk], len(chunk)
        elif shard.compression == "snappy":  # a raw snappy block starts with its decompressed size (a varint)
            size = _varint(data)
            if size != shard.raw_bytes:
                raise InputError(f"MDS shard {shard.path} decompresses to {size} bytes; index.json says "
                                 f"{shard.raw_bytes}")
            parts, total = [pa.decompress(data, decompressed_size=size, codec="snappy").to_pybytes()], size
        else:
            codec = {"zstd": "zstd", "br": "brotli"}[shard.compression]
            with pa.CompressedInputStream(pa.BufferReader(data), codec) as stream:
                while total < limit:
                    chunk = stream.read(min(DECOMPRESS_STEP, limit - total))
                    if not chunk:
                        break
                    parts.append(chunk)
                    total += len(chunk)
    except (OSError, ValueError, EOFError, zlib.error, pa.ArrowException) as exc:
        raise InputError(f"cannot decompress MDS shard {shard.path} ({shard.compression}): {exc}") from None
    if total != shard.raw_bytes:
        got = f"more than {shard.raw_bytes}" if total > shard.raw_bytes else str(total)
        raise InputError(f"MDS shard {shard.path} decompresses to {got} bytes; index.json says {shard.raw_bytes}")
    return b"".join(parts)


def _varint(data: bytes) -> int:
    value = 0
    for i, byte in enumerate(data[:10]):
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value
    return -1


def _check_count(head: bytes, shard: Shard) -> None:
    """The shard's own sample count (its first 4 bytes) must be the one the index declares."""
    n = int.from_bytes(head, "little") if len(head) == 4 else -1
    if n != shard.samples:
        raise InputError(f"MDS shard {shard.path} holds {n:,} samples; index.json says {shard.samples:,} (the index "
                         "or the shard is corrupt)" if n >= 0 else f"MDS shard {shard.path} is truncated")


HEADER_KEYS = ("column_names", "column_encodings", "column_sizes")


def check_header(data: bytes, shard: Shard) -> None:
    """The shard's own header (the config JSON ``MDSWriter`` writes between the offsets and the
    samples) must give the columns ``index.json`` gives it: an index edited or taken from another
    dataset would decode the samples with the wrong encodings. A shard without a header (0 bytes)
    has nothing to compare."""
    if not data:
        return
    try:
        own = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        own = None
    if not isinstance(own, dict):
        raise InputError(f"MDS shard {shard.path} is corrupt: its header (between its offsets and its samples) is no "
                         "JSON object")
    for key, what, listed in zip(HEADER_KEYS, ("name", "encoding", "size"), (shard.names, shard.encodings,
                                                                             shard.sizes)):
        theirs = own.get(key)
        if not isinstance(theirs, list) or len(theirs) != len(listed):
            raise InputError(f"MDS shard {shard.path} does not match its index: its header gives {key} "
                             f"{json.dumps(theirs)[:60]}, index.json {len(listed)} columns")
        for j, (mine, given) in enumerate(zip(theirs, listed)):
            if mine != given:
                raise InputError(f"MDS shard {shard.path} does not match its index: its header gives column {j} "
                                 f"({shard.names[j]}) the {what} {json.dumps(mine)[:40]}, index.json "
                                 f"{json.dumps(given)[:40]}")


def _offsets(data: bytes, shard: Shard, start: int, stop: int) -> np.ndarray:
    """Sample offsets ``start..stop`` (inclusive), checked: non-decreasing, after the offsets table,
    within the shard, and the last sample's end at the shard's end (its own end marker)."""
    offsets = np.frombuffer(data, np.uint32)
    bad = len(offsets) != stop - start + 1 or np.any(np.diff(offsets.astype(np.int64)) < 0)
    if not bad and len(offsets):
        bad = offsets[0] < 4 * (shard.samples + 2) or offsets[-1] > shard.raw_bytes or (
            stop == shard.samples and offsets[-1] != shard.raw_bytes)
    if bad:
        raise InputError(f"MDS shard {shard.path} is corrupt or truncated (sample offsets {start}-{stop})")
    return offsets


def gather(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes ``buf[starts[i]:starts[i]+lengths[i]]`` of every i, concatenated, and their offsets."""
    offsets = np.zeros(len(starts) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), np.uint8)
    i = 0
    while i < len(starts):  # in slices of about GATHER_BYTES: the index array costs 8 bytes a byte
        j = int(np.searchsorted(offsets, offsets[i] + GATHER_BYTES, side="right"))
        j = min(max(j - 1, i + 1), len(starts))
        lo, hi = int(offsets[i]), int(offsets[j])
        if hi > lo:
            idx = np.repeat(starts[i:j] - offsets[i:j], lengths[i:j]) + np.arange(lo, hi)
            out[lo:hi] = buf[idx]
        i = j
    return out, offsets


def _uint32_at(buf: np.ndarray, at: np.ndarray) -> np.ndarray:
    b = buf[at[:, None] + np.arange(4)].astype(np.uint32)
    return (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)).astype(np.int64)


def column_spans(buf: np.ndarray, starts: np.ndarray, shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    """(n, columns) arrays of each column's start and size in ``buf`` for samples starting at ``starts``."""
    n, k = len(starts), len(shard.names)
    sizes = np.zeros((n, k), np.int64)
    var = [j for j, s in enumerate(shard.sizes) if s is None]
    for v, j in enumerate(var):
        sizes[:, j] = _uint32_at(buf, starts + 4 * v) if n else 0
    for j, s in enumerate(shard.sizes):
        if s is not None:
            sizes[:, j] = int(s)
    col_start = starts[:, None] + 4 * len(var) + np.cumsum(sizes, axis=1) - sizes
    return col_start, sizes


def decode(buf: np.ndarray, offsets: np.ndarray, shard: Shard, columns):
    """The samples at ``offsets`` (n + 1 sample bounds in ``buf``) as an Arrow table of ``columns``."""
    import pyarrow as pa

    wanted = list(shard.names) if columns is None else list(columns)
    starts = offsets[:-1]
    col_start, sizes = column_spans(buf, starts, shard)
    ends = col_start[:, -1] + sizes[:, -1] if shard.names else starts
    if len(starts) and np.any(ends != offsets[1:]):  # a sample is its columns, nothing more
        raise InputError(f"MDS shard {shard.path} is corrupt: column sizes do not add up to their samples' sizes")
    out = {}
    for name in wanted:
        if name not in shard.names:
            raise InputError(f"column '{name}' not found in MDS shard {shard.path} (columns: {', '.join(shard.names)})")
        j = shard.names.index(name)
        out[name] = _column(buf, col_start[:, j], sizes[:, j], shard.encodings[j], shard.path, name)
    return pa.table(out)


def _column(buf, starts, sizes, encoding: str, path: str, name: str):
    import pyarrow as pa
    import pyarrow.compute as pc

    kind, _, rest = encoding.partition(":")
    n = len(starts)
    if kind in SCALARS:
        dtype = np.dtype(SCALARS[kind])
        data, _ = gather(buf, starts, np.full(n, dtype.itemsize, np.int64))
        return pa.array(data.view(dtype))
    if kind == "ndarray":
        return _ndarray(buf, starts, sizes, rest, path, name)
    data, offsets = gather(buf, starts, sizes)
    binary = pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    if kind in ("str", "str_int", "str_float", "str_decimal", "json"):
        try:
            text = binary.cast(pa.large_string())
        except pa.ArrowInvalid:
            raise InputError(f"column '{name}' of MDS shard {path} is not valid UTF-8") from None
        if kind == "str":
            return text
        if kind == "json":
            return _json_values(text, path, name)
        try:
            return pc.cast(text, pa.int64() if kind == "str_int" else pa.float64())
        except pa.ArrowInvalid as exc:
            raise InputError(f"column '{name}' ({kind}) of MDS shard {path}: {exc}") from None
    return binary


def _json_values(text, path: str, name: str):
    import pyarrow as pa

    try:
        return pa.array([json.loads(v) for v in text.to_pylist()])
    except (ValueError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"json column '{name}' of MDS shard {path}: {exc}") from None


def _ndarray(buf, starts, sizes, config: str, path: str, name: str):
    """An ``ndarray[:dtype[:shape]]`` column as a large_list of each array's elements (flattened)."""
    import pyarrow as pa

    dtype_name, _, shape_text = config.partition(":")
    n = len(starts)
    head = np.zeros(n, np.int64)
    if dtype_name:
        codes = None
    else:
        codes = buf[starts].astype(np.int64) if n else np.zeros(0, np.int64)
        head += 1
        known = np.isin(codes, list(NDARRAY_DTYPES))
        if not known.all():
            raise InputError(f"ndarray column '{name}' of MDS shard {path} has an unknown dtype code "
                             f"{int(codes[~known][0])}")
    if not shape_text:
        byte = buf[starts + head].astype(np.int64) if n else np.zeros(0, np.int64)
        head += 1 + (byte >> 2) * (1 << (byte & 3))  # ndim, times the shape dtype's bytes
    value_bytes = sizes - head
    if codes is None or not n or np.all(codes == codes[0]):
        dtype = np.dtype(dtype_name or NDARRAY_DTYPES[int(codes[0])] if n else dtype_name or "float64")
        if np.any(value_bytes % dtype.itemsize) or np.any(value_bytes < 0):
            raise InputError(f"ndarray column '{name}' of MDS shard {path} is corrupt (sizes)")
        data, _ = gather(buf, starts + head, value_bytes)
        counts = value_bytes // dtype.itemsize
        values = pa.array(data.view(dtype) if dtype_name else data.view(dtype).astype(np.float64))
    else:  # arrays of several dtypes in one column: one per sample, widened by numpy
        parts = [np.frombuffer(buf[s + h: s + z].tobytes(), NDARRAY_DTYPES[int(c)])
                 for s, h, z, c in zip(starts, head, sizes, codes)]
        counts = np.array([len(p) for p in parts], np.int64)
        values = pa.array(np.concatenate(parts).astype(np.float64))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), values)
