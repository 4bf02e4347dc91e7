"""WebDataset shards: ``.tar`` files whose members are grouped into samples by key.

The rules are the ``webdataset`` package's (``tariterators.tar_file_iterator`` and
``group_by_keys``): regular files only; ``__name__`` metadata members are skipped; a member
``DIR/KEY.EXT`` has the key ``DIR/KEY`` (up to the first dot of the file name) and the extension
``EXT`` (lower-cased, may hold dots: ``seg.json``); a sample is a run of consecutive members with
the same key (a key group). ``sample_id`` counts key groups in shard order.

Columns of a unit, named by member extension:

* ``__key__``: the key;
* ``EXT``: the member's content: text (``txt``, ``text``, ``transcript``, ``*.txt``) as a string,
  ``*.npy`` as a list of the array's elements (flattened), anything else as binary (so
  ``--length bytes:EXT`` is the member's size);
* ``EXT.FIELD`` (``EXT`` ending in ``json``/``jsn``): the field ``FIELD`` of the JSON member
  (``json.num_tokens``, ``meta.json.sizes.tokens`` for nested objects).

A key group without the named member is an error (one line naming the shard, the key and the
members it has). Work units are byte ranges of a shard: a unit holds the key groups whose first
member's header starts in its range (a group may run past the range's end), found by walking the
tar headers from the shard's start, skipping member data (a worker walks each shard at most once).
"""

from __future__ import annotations

import json
import re
import tarfile

import numpy as np

from ... import storage
from ...errors import InputError

KEY_COLUMN = "__key__"
TEXT_EXTS = ("txt", "text", "transcript")
JSON_EXTS = ("json", "jsn")
SKIP_META = re.compile(r"__[^/]*__($|/)")
KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
WEIGHT_BYTES = 4096  # units are balanced on bytes: one weight per 4 KiB


def key_and_ext(name: str) -> tuple[str | None, str | None]:
    """webdataset's ``base_plus_ext``, the extension lower-cased; (None, None) for names without one."""
    if "/" not in name and name.startswith("__") and name.endswith("__") or SKIP_META.match(name):
        return None, None
    m = KEY_EXT.match(name)
    return (m.group(1), m.group(2).lower()) if m else (None, None)


def split_column(column: str) -> tuple[str, list[str]]:
    """``EXT`` or ``EXT.FIELD...``: the member extension and the JSON field path (empty for a member).

    The extension ends at the first dotted component that is ``json`` or ``jsn`` (``json.n`` ->
    ``json`` + ``n``; ``meta.json.a.b`` -> ``meta.json`` + ``a``, ``b``); otherwise the whole name
    is the extension (``en.txt``, ``npy``)."""
    parts = column.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in JSON_EXTS:
            return ".".join(parts[: i + 1]), parts[i + 1:]
    return column, []


class _Member:
    __slots__ = ("key", "ext", "offset_data", "size")

    def __init__(self, key: str, ext: str, offset_data: int, size: int):
        self.key, self.ext, self.offset_data, self.size = key, ext, offset_data, size


class Walker:
    """The members of one shard in order, walking headers only (data is skipped by seeking).

    Keeps its place, so a worker reading consecutive units of a shard walks it once. Where the walk
    ends, the shard's own end marker is checked (:func:`check_end`): ``tarfile`` takes an invalid
    header for the end of the archive, which would silently drop every member after it."""

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size
        self._fh = storage.open_input(path)
        try:
            self._tar = tarfile.open(fileobj=self._fh, mode="r:")
        except tarfile.TarError as exc:
            raise InputError(f"{path} is not a valid tar file: {exc}") from None
        self.pending: list[tuple[int, _Member]] = []  # looked at, not yet consumed (offset, member)
        self.prev_key: str | None = None  # key of the last consumed member
        self.group_start = -1  # header offset of the first member of the last group consumed

    def _next(self) -> tuple[int, _Member] | None:
        if self.pending:
            return self.pending.pop()
        while True:
            try:
                info = self._tar.next()
            except tarfile.TarError as exc:
                if "unexpected end of data" in str(exc):  # skipping a member's data ran past the end
                    raise InputError(f"{self.path} is truncated: it ends at byte {self.size:,}, inside a tar "
                                     "member") from None
                raise InputError(f"{self.path} is not a valid tar file: {exc}") from None
            if info is None:
                check_end(self._fh, self.path, self._tar.offset, self.size)
                return None
            self._tar.members = []  # no list of every member kept
            if not info.isreg():
                continue
            if info.issparse():  # its data is stored without the holes: read at its offset it would be wrong
                raise InputError(f"{self.path}: member {info.name} is a sparse file (packed with GNU tar -S), which "
                                 "varlen does not read; pack the shard without -S (webdataset's TarWriter never "
                                 "writes one)")
            key, ext = key_and_ext(info.name)
            if key is not None:
                return info.offset, _Member(key, ext, info.offset_data, info.size)

    def groups(self, start: int, stop: int) -> list[list[_Member]]:
        """Key groups whose first member's header lies in [start, stop), each a list of members."""
        out: list[list[_Member]] = []
        while True:
            item = self._next()
            if item is None:
                break
            offset, m = item
            new_group = m.key != self.prev_key
            if new_group and offset >= stop:
                self.pending.append(item)
                break
            self.prev_key = m.key
            if new_group:
                self.group_start = offset
            if new_group and offset >= start:
                out.append([m])
            elif not new_group and out:
                if any(x.ext == m.ext for x in out[-1]):
                    raise InputError(f"{self.path}: duplicate member {m.key}.{m.ext} in one key group")
                out[-1].append(m)
        return out

    def read(self, m: _Member) -> bytes:
        self._fh.seek(m.offset_data)
        data = self._fh.read(m.size)
        if len(data) != m.size:
            raise InputError(f"{self.path} is truncated (member {m.key}.{m.ext})")
        return data

    def close(self) -> None:
        self._fh.close()


END_BLOCKS = 2  # a tar archive ends with two zero blocks of 512 bytes (TarWriter pads to 10 KiB with more)
TAIL_READ = 1 << 20


def check_end(fh, path: str, offset: int, size: int) -> None:
    """Refuse a shard whose member walk stopped at byte ``offset`` anywhere but at its end-of-archive
    blocks: from ``offset`` to the end of the file (``size`` bytes) there must be zeros only, at
    least two blocks of them. A damaged header, a zeroed header and a cut (inside a header, at a
    member boundary, inside a member) are all refused here, in one line."""
    if offset > size:
        raise InputError(f"{path} is truncated: it ends at byte {size:,}, inside a tar member that runs to byte "
                         f"{offset:,}")
    fh.seek(offset)
    first = fh.read(min(tarfile.BLOCKSIZE, size - offset))
    if first.strip(b"\0") and len(first) < tarfile.BLOCKSIZE:
        raise InputError(f"{path} is truncated: it ends at byte {size:,}, inside a tar header")
    if first.strip(b"\0"):
        raise InputError(f"{path} is damaged: invalid tar header at byte {offset:,} ({_header_problem(first)}); the "
                         "members after it cannot be read")
    at = offset + len(first)
    while at < size:
        block = fh.read(min(TAIL_READ, size - at))
        if not block:
            break
        nonzero = block.lstrip(b"\0")
        if nonzero:
            raise InputError(f"{path} is damaged: an empty (zeroed) tar header at byte {offset:,} is followed by data "
                             f"at byte {at + len(block) - len(nonzero):,}")
        at += len(block)
    if at - offset < END_BLOCKS * tarfile.BLOCKSIZE:
        where = "right after a tar member" if at == offset else f"{at - offset:,} zero bytes after a tar member"
        raise InputError(f"{path} is truncated: it ends at byte {at:,}, {where}, without the end-of-archive blocks")


def _header_problem(block: bytes) -> str:
    """What ``tarfile`` finds wrong with a header block (a bad checksum, a truncated header)."""
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError as exc:
        return str(exc)
    return "not a header"


class ShardReader:
    """Reads units of WebDataset shards, keeping one shard's walker between units."""

    def __init__(self):
        self._walker: Walker | None = None

    def walker(self, path: str, size: int, start: int) -> Walker:
        w = self._walker
        # going on is right while everything consumed belongs to groups that start before ``start``
        if w is None or w.path != path or w.group_start >= start:
            if w is not None:
                w.close()
            w = self._walker = Walker(path, size)
        return w

    def read(self, path: str, size: int, start: int, stop: int, columns):
        w = self.walker(path, size, start)
        groups = w.groups(start, stop)
        return build_table(w, groups, columns)


def _member(w: Walker, group: list[_Member], ext: str) -> _Member:
    for m in group:
        if m.ext == ext:
            return m
    have = ", ".join(m.ext for m in group)
    raise InputError(f"tar member missing: key group '{group[0].key}' in {w.path} has no .{ext} member "
                     f"(it has: {have})")


def build_table(w: Walker, groups: list[list[_Member]], columns):
    """The unit's table of ``columns`` (None: ``__key__`` and every member extension as binary)."""
    import pyarrow as pa

    if columns is None:
        exts = sorted({m.ext for g in groups for m in g})
        out = {KEY_COLUMN: pa.array([g[0].key for g in groups], pa.large_string())}
        for ext in exts:
            out[ext] = pa.array([_optional(w, g, ext) for g in groups], pa.large_binary())
        return pa.table(out)
    out = {}
    parsed: dict[str, list] = {}
    for column in columns:
        if column == KEY_COLUMN:
            out[column] = pa.array([g[0].key for g in groups], pa.large_string())
            continue
        ext, field = split_column(column)
        if field:
            if ext not in parsed:
                parsed[ext] = [_json(w, _member(w, g, ext)) for g in groups]
            out[column] = _field_array([_get(v, field) for v in parsed[ext]], column, w.path)
        elif ext.endswith("npy"):
            out[column] = _npy_array(w, [_member(w, g, ext) for g in groups])
        elif ext in TEXT_EXTS or ext.endswith(".txt"):
            out[column] = _text_array(w, [_member(w, g, ext) for g in groups])
        else:  # only the sizes are needed for bytes:EXT, but a binary column is what a user function gets
            out[column] = pa.array([w.read(_member(w, g, ext)) for g in groups], pa.large_binary())
    return pa.table(out) if out else pa.table({KEY_COLUMN: pa.array([g[0].key for g in groups], pa.large_string())})


def _optional(w: Walker, group: list[_Member], ext: str) -> bytes | None:
    for m in group:
        if m.ext == ext:
            return w.read(m)
    return None


def _json(w: Walker, m: _Member):
    try:
        return json.loads(w.read(m))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"invalid JSON in {w.path} member {m.key}.{m.ext}: {exc}") from None


def _get(value, field: list[str]):
    for name in field:
        if not isinstance(value, dict) or name not in value:
            return None
        value = value[name]
    return value


def _field_array(values: list, column: str, path: str):
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"JSON field '{column}' in {path} has values of mixed types: {exc}") from None


def _text_array(w: Walker, members: list[_Member]):
    import pyarrow as pa

    arr = pa.array([w.read(m) for m in members], pa.large_binary())
    try:
        return arr.cast(pa.large_string())
    except pa.ArrowInvalid:
        raise InputError(f"a text member in {w.path} is not valid UTF-8") from None


def _npy_values(data: bytes, name: str, path: str) -> np.ndarray:
    """A ``.npy`` member's elements, flattened."""
    import io

    try:
        return np.load(io.BytesIO(data), allow_pickle=False).reshape(-1)
    except (ValueError, OSError) as exc:
        raise InputError(f"invalid .npy member {name} in {path}: {exc}") from None


def _list_column(arrays: list):
    """Arrays (None: no member) as a large_list column of their elements."""
    import pyarrow as pa

    present = [a for a in arrays if a is not None]
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([0 if a is None else len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(present) if present else np.zeros(0, np.float32)
    mask = pa.array([a is None for a in arrays]) if len(present) < len(arrays) else None
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values), mask=mask)


def _npy_array(w: Walker, members: list[_Member]):
    """Each ``.npy`` member's elements, flattened, as a large_list column."""
    return _list_column([_npy_values(w.read(m), f"{m.key}.{m.ext}", w.path) for m in members])


def typed_members(table, path: str):
    """A unit read with every member as binary (``columns`` None), each member typed as the column of
    its name is: text (``txt``...) as strings, ``.npy`` as the array's elements, anything else binary
    (what ``SourceDataset`` items hold; a member a key group lacks stays null)."""
    import pyarrow as pa

    for i, name in enumerate(table.column_names):
        column = table.column(i)
        if name in TEXT_EXTS or name.endswith(".txt"):
            try:
                column = column.cast(pa.large_string())
            except pa.ArrowInvalid:
                raise InputError(f"a text member in {path} is not valid UTF-8") from None
        elif name.endswith("npy"):
            column = _list_column([None if v is None else _npy_values(v, f"{key}.{name}", path)
                                   for key, v in zip(table.column(KEY_COLUMN).to_pylist(), column.to_pylist())])
        else:
            continue
        table = table.set_column(i, name, column)
    return table


def schema(path: str, size: int):
    """Columns of the first key group (``__key__`` and one per member extension)."""
    import pyarrow as pa

    w = Walker(path, size)
    try:
        groups = w.groups(0, 1)
    finally:
        w.close()
    if not groups:
        return pa.schema([])
    fields = [(KEY_COLUMN, pa.large_string())]
    for m in groups[0]:
        t = (pa.large_list(pa.float64()) if m.ext.endswith("npy") else pa.large_string()
             if m.ext in TEXT_EXTS or m.ext.endswith(".txt") else pa.large_binary())
        fields.append((m.ext, t))
    return pa.schema(fields)


def units(size: int, chunk_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """(part, start, stop, rows, weight) byte ranges of one shard (rows unknown: -1)."""
    bounds = list(range(0, max(size, 1), max(chunk_bytes, 512))) + [max(size, 1)]
    return [(-1, a, b, -1, max(1, (b - a) // WEIGHT_BYTES)) for a, b in zip(bounds[:-1], bounds[1:])]
