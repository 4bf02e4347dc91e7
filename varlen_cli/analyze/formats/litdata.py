"""LitData ``optimize()`` output: a folder with ``index.json`` and its chunks (``chunk-R-K.bin``).

Read natively (no ``litdata`` needed, so no CUDA torch pulled in): ``index.json`` lists the chunks in
order (``{"chunks": [{"filename", "chunk_size", "chunk_bytes", ...}], "config": {"data_format",
"data_spec", "item_loader", "compression", "encryption", ...}}``); ``sample_id`` is the index of
``litdata.StreamingDataset`` (without shuffling): chunks in ``index.json`` order, items in chunk order.

A chunk (``PyTreeLoader``, LitData's default) is::

    uint32 n | uint32 offsets[n + 1] (absolute, per item) | items | [Arrow IPC footer]

and an item is ``uint32 sizes[leaves]`` then each leaf's bytes. The leaves are the item's pytree
(``data_spec``, torch's pytree JSON) flattened: a dict's keys become columns (nested dicts: struct
columns, so ``--length value:meta.len`` reads ``item["meta"]["len"]``), a tuple's or list's elements
are named by position (``"0"``, ``"1"``), an item that is one leaf is the column ``item``. Leaves by
``data_format``: ``int`` -> int64, ``float`` -> float64, ``bool``, ``str``/``text`` -> string,
``bytes`` -> binary, ``numpy``/``no_header_numpy:D``/``tensor``/``no_header_tensor:D`` -> a list of the
array's elements (flattened: ``--length list:tokens``), anything else (images, audio, pickles) ->
binary (``--length bytes:COL`` is its stored size). Chunks whose rows LitData also stored as an Arrow
IPC footer (``LDARW01``: flat records of strings, nested lists) are read from that footer.

The contract (a damaged, truncated or changed chunk is refused, never read in part): ``chunk_size``
and ``chunk_bytes`` are integers of 0 or more, a chunk file has exactly ``chunk_bytes`` bytes (a
``zstd`` chunk decompresses to exactly that), a chunk's first 4 bytes hold its ``chunk_size``, the
offsets start after the header, never decrease, and the last one ends where the items end (the
footer, when there is one, fills the rest exactly). Refused in one line: ``TokensLoader`` chunks (a
token stream with no sample boundaries), encrypted chunks, zstd framed per batch or per sample.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ... import storage
from ...errors import InputError
from . import ranges

INDEX_NAME = "index.json"
FOOTER_MAGIC = b"LDARW01\0"
NUMPY_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
                "float64"]  # litdata's _NUMPY_DTYPES_MAPPING, indexes 0..10
TORCH_DTYPES = {0: "float32", 1: "float32", 2: "float64", 3: "float64", 8: "float16", 9: "float16", 11: "uint8",
                12: "int8", 13: "int16", 14: "int16", 15: "int32", 16: "int32", 17: "int64", 18: "int64", 19: "bool",
                20: "uint16"}  # litdata's _TORCH_DTYPES_MAPPING (bfloat16 and complex: no numpy dtype)
SCALARS = {"int": "<i8", "float": "<f8", "bool": "?"}
TEXT = ("str", "text")
ONE_LEAF = "item"


@dataclass(frozen=True)
class Chunk:
    path: str
    items: int
    nbytes: int  # uncompressed bytes (the index's chunk_bytes)
    info: storage.FileInfo  # the file as found when the index was read


@dataclass(frozen=True)
class Index:
    path: str
    chunks: tuple
    leaves: tuple  # (steps, data_format) per leaf, in flatten order
    compression: str | None


def is_index(path: str) -> bool:
    """Whether ``path`` (an ``index.json``) is LitData's (MDS's has ``shards``)."""
    try:
        obj = json.loads(storage.read_bytes(path))
    except (ValueError, OSError, InputError, RecursionError):  # not LitData's: the MDS reader says what is wrong
        return False
    return isinstance(obj, dict) and "chunks" in obj and "config" in obj


_INDEXES: dict[tuple, Index] = {}


def clear_cache() -> None:
    _INDEXES.clear()


def read_index(path: str) -> Index:
    """The index (checked against its chunk files), read once per version of the file (the last
    version read of each index kept: several LitData sources do not evict each other)."""
    st = os.stat(path) if not storage.is_remote(path) else None
    key = (path, st.st_size, st.st_mtime_ns) if st is not None else (path,)
    if key not in _INDEXES:
        for old in [k for k in _INDEXES if k[0] == path]:
            del _INDEXES[old]
        _INDEXES[key] = _parse_index(path)
    return _INDEXES[key]


def _parse_index(path: str) -> Index:
    try:
        obj = json.loads(storage.read_bytes(path))
        config, entries = obj["config"], obj["chunks"]
        if not isinstance(config, dict) or not isinstance(entries, list):
            raise TypeError("'config' must be an object and 'chunks' a list")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: nested past Python's limit
        raise InputError(f"{path} is not a LitData index: {exc}") from None
    compression = _check_config(config, path)
    leaves = _leaves(config, path)
    folder = storage.parent(path)
    chunks = tuple(_chunk(entry, k, folder, path, compression) for k, entry in enumerate(entries))
    return Index(path, chunks, leaves, compression)


def _check_config(config: dict, path: str) -> str | None:
    """The chunks' file compression (None or ``zstd``); what varlen cannot read refused in one line."""
    loader = config.get("item_loader")
    if loader != "PyTreeLoader":
        why = " (a stream of tokens with no sample boundaries: there are no samples to measure)" \
            if loader == "TokensLoader" else ""
        raise InputError(f"{path}: LitData chunks written with the {loader} item loader cannot be read as "
                         f"samples{why}; varlen reads PyTreeLoader chunks (optimize()'s default)")
    if config.get("encryption"):
        raise InputError(f"{path}: the LitData chunks are encrypted")
    compression = config.get("compression")
    if compression and (str(compression).split(":")[0] != "zstd" or config.get("compression_level") not in
                        (None, "chunk")):
        raise InputError(f"{path}: LitData compression {compression!r} (level {config.get('compression_level')!r}) is "
                         "not read; varlen reads uncompressed chunks and whole-chunk zstd")
    return "zstd" if compression else None


def _chunk(entry, k: int, folder: str, path: str, compression: str | None) -> Chunk:
    try:
        items, nbytes, name = entry["chunk_size"], entry["chunk_bytes"], entry["filename"]
    except (KeyError, TypeError):
        raise InputError(f"{path}: chunk {k} is not a valid LitData chunk entry") from None
    for key, value in (("chunk_size", items), ("chunk_bytes", nbytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InputError(f"{path}: chunk {k} has {key} {value!r}; expected an integer of 0 or more")
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise InputError(f"{path}: chunk {k} has filename {name!r}; expected a file name in the index's folder")
    chunk_path = storage.join(folder, name)
    try:
        info = storage.stat(chunk_path)
    except InputError:
        raise InputError(f"LitData chunk {chunk_path} (chunk {k} of {path}) is missing") from None
    if compression is None and info.size != nbytes:
        raise InputError(f"LitData chunk {chunk_path} has {info.size} bytes where {path} records {nbytes} "
                         "(truncated or changed)")
    return Chunk(chunk_path, items, nbytes, info)


def _leaves(config: dict, path: str) -> tuple:
    """(steps, data_format) of every leaf of the items' pytree (``data_spec``), in flatten order."""
    formats = config.get("data_format") or []
    try:
        spec = json.loads(config["data_spec"])
        steps = _walk(spec[1] if isinstance(spec, list) else spec, ())
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise InputError(f"{path}: cannot read the items' structure (data_spec): {exc}") from None
    if len(steps) != len(formats):
        raise InputError(f"{path}: data_spec has {len(steps)} leaves, data_format {len(formats)}")
    return tuple((s if s else (ONE_LEAF,), f) for s, f in zip(steps, formats))


def _walk(node: dict, prefix: tuple) -> list[tuple]:
    kind, children = node.get("type"), node.get("children_spec") or []
    if kind is None:
        return [prefix]
    if kind in ("builtins.dict", "collections.OrderedDict", "collections.defaultdict"):
        context = node["context"]
        keys = json.loads(context) if isinstance(context, str) else context
        if kind == "collections.defaultdict":
            keys = keys["dict_context"] if isinstance(keys, dict) else keys
        names = [str(k) for k in keys]
    elif kind in ("builtins.list", "builtins.tuple"):
        names = [str(i) for i in range(len(children))]
    else:
        raise TypeError(f"items of type {kind} (varlen reads dicts, lists, tuples and leaves)")
    out = []
    for name, child in zip(names, children):
        out += _walk(child, (*prefix, name))
    return out


def units(index: Index, chunk_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """(part, start, stop, rows, weight): item ranges of about ``chunk_bytes`` per chunk (a compressed
    chunk is one unit: it is decompressed whole)."""
    return [unit for k, c in enumerate(index.chunks) for unit in ranges.row_ranges(
        k, c.items, c.items if index.compression else ranges.unit_rows(c.items, c.nbytes, chunk_bytes))]


def leaf_type(data_format: str):
    import pyarrow as pa

    kind, _, code = data_format.partition(":")
    if kind in SCALARS:
        return pa.from_numpy_dtype(np.dtype(SCALARS[kind]))
    if kind in TEXT:
        return pa.large_string()
    dtype = _array_dtype(kind, code)
    return pa.large_list(pa.from_numpy_dtype(np.dtype(dtype))) if dtype else pa.large_binary()


def _array_dtype(kind: str, code: str) -> str | None:
    """The element dtype of an array leaf (None for a leaf that is not one; '' when stored per item)."""
    if kind == "no_header_numpy" and code.isdigit() and int(code) < len(NUMPY_DTYPES):
        return NUMPY_DTYPES[int(code)]
    if kind == "no_header_tensor" and code.isdigit() and int(code) in TORCH_DTYPES:
        return TORCH_DTYPES[int(code)]
    if kind in ("numpy", "tensor"):
        return "float64"  # per item: widened to float64 when the items disagree (read_array)
    return None


def schema(index: Index):
    """The items' columns (from the leaves; a chunk with an Arrow footer: the footer's schema)."""
    import pyarrow as pa

    if index.chunks and index.chunks[0].items:
        footer = ChunkReader().footer_table(index, 0)
        if footer is not None:
            return footer.schema
    fields: dict = {}
    for steps, fmt in index.leaves:
        _nest(fields, steps, leaf_type(fmt))
    return pa.schema([(name, _struct_type(value)) for name, value in fields.items()])


def _nest(tree: dict, steps: tuple, value) -> None:
    for s in steps[:-1]:
        tree = tree.setdefault(s, {})
    tree[steps[-1]] = value


def _struct_type(value):
    import pyarrow as pa

    if isinstance(value, dict):
        return pa.struct([(k, _struct_type(v)) for k, v in value.items()])
    return value


class ChunkReader:
    """Reads units of LitData chunks; keeps the last decompressed chunk and the last Arrow footer."""

    def __init__(self):
        self._whole: tuple[str, bytes] | None = None
        self._footer: tuple[str, object] | None = None

    def read(self, index_path: str, part: int, start: int, stop: int, columns):
        index = read_index(index_path)
        chunk = index.chunks[part]
        footer = self.footer_table(index, part)
        if footer is not None:
            table = footer.slice(start, stop - start)
            return table if columns is None else _select(table, columns, chunk.path)
        buf, base, offsets = self._items(index, chunk, start, stop)
        return decode(buf, offsets - base, index, columns, chunk.path)

    def _bytes(self, index: Index, chunk: Chunk, a: int, b: int) -> bytes:
        if index.compression is None:
            data = storage.read_range(chunk.path, a, b)
            if len(data) != b - a:
                raise InputError(f"LitData chunk {chunk.path} is truncated (bytes {a}-{b})")
            return data
        if self._whole is None or self._whole[0] != chunk.path:
            self._whole = None
            self._whole = (chunk.path, _decompress(chunk))
        return self._whole[1][a:b]

    def _size(self, index: Index, chunk: Chunk) -> int:
        return chunk.info.size if index.compression is None else chunk.nbytes

    def footer_table(self, index: Index, part: int):
        """The chunk's Arrow IPC footer as a table (checked against the chunk's size), or None."""
        import pyarrow as pa

        chunk = index.chunks[part]
        if self._footer is not None and self._footer[0] == chunk.path:
            return self._footer[1]
        size = self._size(index, chunk)
        tail = self._bytes(index, chunk, max(0, size - 12), size) if size >= 12 else b""
        if tail[-8:] != FOOTER_MAGIC:
            return None
        ipc_len = int(np.frombuffer(tail[:4], "<u4")[0])
        header = 4 * (chunk.items + 2)
        start = size - 12 - ipc_len
        end = int(np.frombuffer(self._bytes(index, chunk, header - 4, header), "<u4")[0]) if start >= header else -1
        if start < header or end != start:
            raise InputError(f"LitData chunk {chunk.path} is corrupt: its Arrow footer does not start where its items "
                             "end")
        try:
            ipc = pa.py_buffer(self._bytes(index, chunk, start, start + ipc_len))
            reader = pa.ipc.open_file(ipc) if bytes(ipc[:6]) == b"ARROW1" else pa.ipc.open_stream(ipc)
            table = reader.read_all()
        except pa.ArrowException as exc:
            raise InputError(f"LitData chunk {chunk.path}: its Arrow footer is unreadable ({exc})") from None
        if table.num_rows != chunk.items:
            raise InputError(f"LitData chunk {chunk.path}: its Arrow footer holds {table.num_rows} rows, the index "
                             f"{chunk.items}")
        self._footer = (chunk.path, table)
        return table

    def _items(self, index: Index, chunk: Chunk, start: int, stop: int) -> tuple[bytes, int, np.ndarray]:
        """(the bytes of items ``[start, stop)``, their first byte, their n + 1 offsets), checked."""
        size = self._size(index, chunk)
        head = self._bytes(index, chunk, 0 if start == 0 else 4 * (start + 1), 4 * (stop + 2))
        values = np.frombuffer(head, "<u4").astype(np.int64)
        offsets = values[1:] if start == 0 else values
        if start == 0 and (len(values) < 1 or values[0] != chunk.items):
            raise InputError(f"LitData chunk {chunk.path} holds {values[0] if len(values) else 'no'} items where the "
                             f"index records {chunk.items}")
        if (len(offsets) != stop - start + 1 or np.any(np.diff(offsets) < 0) or offsets[-1] > size
                or (start == 0 and offsets[0] != 4 * (chunk.items + 2))
                or (stop == chunk.items and offsets[-1] != size)):  # the items fill the chunk (no footer here)
            raise InputError(f"LitData chunk {chunk.path} is corrupt or truncated (item offsets {start}-{stop})")
        base = int(offsets[0])
        return self._bytes(index, chunk, base, int(offsets[-1])), base, offsets


def _decompress(chunk: Chunk) -> bytes:
    import pyarrow as pa

    try:
        with pa.input_stream(pa.BufferReader(storage.read_bytes(chunk.path)), compression="zstd") as stream:
            out = stream.read(chunk.nbytes + 1)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"cannot decompress LitData chunk {chunk.path} (zstd): {exc}") from None
    if len(out) != chunk.nbytes:
        raise InputError(f"LitData chunk {chunk.path} decompresses to {len(out)} bytes; the index records "
                         f"{chunk.nbytes}")
    return out


def _select(table, columns, where: str):
    for c in columns:
        if c not in table.column_names:
            raise InputError(f"column '{c}' not found in {where} (columns: {', '.join(table.column_names)})")
    return table.select(list(columns))


def decode(buf: bytes, offsets: np.ndarray, index: Index, columns, where: str):
    """The items at ``offsets`` (n + 1 bounds in ``buf``) as an Arrow table of ``columns`` (None: all)."""
    import pyarrow as pa

    view = np.frombuffer(buf, np.uint8)
    starts, n_leaves = offsets[:-1], len(index.leaves)
    if len(starts) and np.any(offsets[1:] - starts < 4 * n_leaves):
        raise InputError(f"LitData chunk {where} is corrupt: an item is shorter than its header")
    at = starts[:, None] + 4 * np.arange(n_leaves)[None, :]  # each item's uint32 size of each leaf
    sizes = (view[at[..., None] + np.arange(4)].astype(np.int64) << (8 * np.arange(4))).sum(axis=-1)
    leaf_start = starts[:, None] + 4 * n_leaves + np.cumsum(sizes, axis=1) - sizes
    if len(starts) and np.any(leaf_start[:, -1] + sizes[:, -1] > offsets[1:]):
        raise InputError(f"LitData chunk {where} is corrupt: leaf sizes run past their items")
    top = [steps[0] for steps, _ in index.leaves]
    names = list(dict.fromkeys(top))
    wanted = names if columns is None else list(columns)
    fields: dict = {}
    for name in wanted:
        if name not in names:
            raise InputError(f"column '{name}' not found in {where} (columns: {', '.join(names)})")
    for j, (steps, fmt) in enumerate(index.leaves):
        if steps[0] in wanted:
            _nest(fields, steps, _leaf(view, leaf_start[:, j], sizes[:, j], fmt, where))
    return pa.table({name: _struct_array(fields[name]) for name in wanted})


def gather(view: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bytes ``view[starts[i]:starts[i]+sizes[i]]`` of every i (ascending, disjoint spans), concatenated,
    and their offsets. Few bytes (a number per item): indexed; most of the range (an array per item):
    the range copied without the gaps between the spans (a mask, one byte a byte)."""
    offsets = np.zeros(len(starts) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if not len(starts):
        return np.zeros(0, np.uint8), offsets
    lo, hi = int(starts[0]), int(starts[-1] + sizes[-1])
    if 2 * offsets[-1] < hi - lo:
        return view[_spans(starts, sizes, offsets)], offsets
    gap_starts = starts[:-1] + sizes[:-1]
    gap_sizes = starts[1:] - gap_starts
    gap_offsets = np.zeros(len(gap_sizes) + 1, np.int64)
    np.cumsum(gap_sizes, out=gap_offsets[1:])
    keep = np.ones(hi - lo, bool)
    keep[_spans(gap_starts - lo, gap_sizes, gap_offsets)] = False
    return view[lo:hi][keep], offsets


def _spans(starts: np.ndarray, sizes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Every index of the spans ``[starts[i], starts[i] + sizes[i])`` (``offsets``: their running sizes)."""
    return np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])


def _struct_array(value):
    import pyarrow as pa

    if isinstance(value, dict):
        return pa.StructArray.from_arrays([_struct_array(v) for v in value.values()], names=list(value))
    return value


def _leaf(view, starts, sizes, fmt: str, where: str):
    import pyarrow as pa

    kind, _, code = fmt.partition(":")
    if kind in SCALARS:
        dtype = np.dtype(SCALARS[kind])
        if np.any(sizes != dtype.itemsize):
            raise InputError(f"LitData chunk {where} is corrupt: a {kind} leaf of {int(sizes.max())} bytes")
        data, _ = gather(view, starts, sizes)
        return pa.array(data.view(dtype))
    data, offsets = gather(view, starts, sizes)
    if kind in TEXT or _array_dtype(kind, code) is None:
        binary = pa.Array.from_buffers(pa.large_binary(), len(starts), [None, pa.py_buffer(offsets),
                                                                         pa.py_buffer(data)])
        if kind not in TEXT:
            return binary
        try:
            return binary.cast(pa.large_string())
        except pa.ArrowInvalid:
            raise InputError(f"a text leaf of LitData chunk {where} is not valid UTF-8") from None
    return read_array(view, starts, sizes, kind, code, where)


def read_array(view, starts, sizes, kind: str, code: str, where: str):
    """An array leaf as a large_list of its elements (flattened)."""
    import pyarrow as pa

    n = len(starts)
    head = np.zeros(n, np.int64)
    if kind in ("numpy", "tensor"):  # uint32 dtype, uint32 rank, uint32 shape[rank] (tensor: big-endian)
        order = ">u4" if kind == "tensor" else "<u4"
        word = view[starts[:, None] + np.arange(8)].copy().view(order).reshape(n, 2) if n else np.zeros((0, 2), int)
        codes, ranks = word[:, 0].astype(np.int64), word[:, 1].astype(np.int64)
        table = TORCH_DTYPES if kind == "tensor" else dict(enumerate(NUMPY_DTYPES))
        if n and (np.any(codes != codes[0]) or int(codes[0]) not in table):
            raise InputError(f"{kind} leaves of LitData chunk {where} have dtype codes {sorted(set(codes.tolist()))}; "
                             "varlen reads one known numeric dtype per unit")
        dtype = np.dtype(table[int(codes[0])] if n else "float64")
        head = 8 + 4 * ranks
    else:
        dtype = np.dtype(_array_dtype(kind, code))
    value_bytes = sizes - head
    if np.any(value_bytes < 0) or np.any(value_bytes % dtype.itemsize):
        raise InputError(f"array leaves of LitData chunk {where} are corrupt (sizes)")
    data, _ = gather(view, starts + head, value_bytes)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(value_bytes // dtype.itemsize, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(data.view(dtype)))
