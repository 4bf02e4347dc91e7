"""Concatenate Parquet files written with one schema into one file, copying their row groups' bytes.

A Parquet file is ``PAR1``, the column chunks of its row groups one after another, a footer (the
Thrift-compact-encoded ``FileMetaData``), the footer's length and ``PAR1``. Column chunk bytes hold
no absolute offsets (page headers are relative), so the row groups of several files written by the
same writer settings are concatenated by copying their bytes and writing one footer: the first
file's ``FileMetaData`` with every file's row groups, their offsets shifted to where their bytes
now lie, ordinals renumbered and ``num_rows`` summed. The result is the file one writer would have
written with the same row groups, byte for byte (tested), which is what lets several workers encode
the row groups of one plan in parallel and still write the same file as one worker.

With ``footer=TEMPLATE`` the output's footer fields around the row groups (schema, key-value metadata,
``created_by``, column orders) are those of another file of the same Parquet schema, e.g. one written
with no row groups: the row groups of files written with other metadata (a plan and the rows appended
to it, ``varlen plan --extend``) are joined under new metadata without being decoded.

Only what pyarrow writes by default is handled: no page index (``write_page_index``), no bloom
filters, no encryption, no ``file_path`` (external column chunks); anything else is refused.
"""

from __future__ import annotations

import errno
import os
import struct

from ..errors import OutputError

MAGIC = b"PAR1"

# Thrift compact protocol types
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)

# field ids (parquet.thrift)
_FMD_NUM_ROWS, _FMD_ROW_GROUPS = 3, 4
_RG_COLUMNS, _RG_FILE_OFFSET, _RG_ORDINAL = 1, 5, 7
_CC_FILE_PATH, _CC_FILE_OFFSET, _CC_META, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX = 1, 2, 3, 4, 6
_CC_CRYPTO, _CC_ENCRYPTED = 8, 9
_CM_OFFSETS = frozenset({9, 10, 11})  # data_page_offset, index_page_offset, dictionary_page_offset
_CM_BLOOM = 14
_FMD_ENCRYPTION = frozenset({8, 9})


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes, pos: int = 0):
        self.buf, self.pos = buf, pos

    def varint(self) -> int:
        buf, pos, shift, out = self.buf, self.pos, 0, 0
        while True:
            b = buf[pos]
            pos += 1
            out |= (b & 0x7F) << shift
            if b < 0x80:
                self.pos = pos
                return out
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def field(self, last: int) -> tuple[int, int]:
        """(field id, type) of the next field header; type 0 is the struct's end."""
        b = self.buf[self.pos]
        self.pos += 1
        kind = b & 0x0F
        if kind == _STOP:
            return 0, _STOP
        delta = b >> 4
        return (last + delta if delta else self.zigzag()), kind

    def list_header(self) -> tuple[int, int]:
        b = self.buf[self.pos]
        self.pos += 1
        size = b >> 4
        return (self.varint() if size == 15 else size), b & 0x0F

    def skip(self, kind: int) -> None:
        if kind in (_TRUE, _FALSE):
            return
        if kind == _BYTE:
            self.pos += 1
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.pos += 8
        elif kind == _BINARY:
            n = self.varint()
            self.pos += n
        elif kind in (_LIST, _SET):
            size, elem = self.list_header()
            if elem in (_TRUE, _FALSE):
                self.pos += size
            else:
                for _ in range(size):
                    self.skip(elem)
        elif kind == _MAP:
            size = self.varint()
            if size:
                kv = self.buf[self.pos]
                self.pos += 1
                for _ in range(size):
                    self.skip(kv >> 4)
                    self.skip(kv & 0x0F)
        elif kind == _STRUCT:
            last = 0
            while True:
                fid, k = self.field(last)
                if k == _STOP:
                    return
                self.skip(k)
                last = fid
        else:
            raise OutputError(f"cannot concatenate Parquet files: unknown Thrift type {kind} in a footer")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _list_header(size: int, elem: int) -> bytes:
    return bytes([(size << 4) | elem]) if size < 15 else bytes([0xF0 | elem]) + _varint(size)


class _Patcher:
    """Copies a struct's bytes from ``r``, replacing the integer fields ``patch`` maps to new values."""

    def __init__(self, r: _Reader):
        self.r = r

    def struct(self, out: bytearray, patch, nested=None) -> None:
        """``patch(fid, value) -> value`` for integer fields; ``nested[fid](out)`` rewrites a field's value."""
        r, last = self.r, 0
        while True:
            start = r.pos
            fid, kind = r.field(last)
            if kind == _STOP:
                out.append(0)
                return
            head_end = r.pos
            if nested and fid in nested:
                out += r.buf[start:head_end]
                nested[fid](out, kind)
            elif kind in (_I16, _I32, _I64) and patch is not None:
                value = r.zigzag()
                new = patch(fid, value)
                out += r.buf[start:head_end]
                out += _zigzag(new)
            else:
                r.skip(kind)
                out += r.buf[start:r.pos]
            last = fid


def _footer(path: str) -> tuple[bytes, int]:
    """The footer bytes of ``path`` and where its row group data ends."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 12:
            raise OutputError(f"{path} is not a Parquet file")
        fh.seek(size - 8)
        tail = fh.read(8)
        length = struct.unpack("<I", tail[:4])[0]
        if tail[4:] != MAGIC or length + 12 > size:
            raise OutputError(f"{path} is not a Parquet file (or is encrypted)")
        fh.seek(0)
        if fh.read(4) != MAGIC:
            raise OutputError(f"{path} is not a Parquet file")
        fh.seek(size - 8 - length)
        return fh.read(length), size - 8 - length


class _Part:
    """One file's footer: the raw fields around its row groups, and where its row groups' list lies."""

    def __init__(self, path: str, buf: bytes, data_end: int, shift: int, first_ordinal: int, groups: bytearray):
        """Parse the footer ``buf`` of ``path``, appending its row groups (moved by ``shift`` bytes,
        numbered from ``first_ordinal``) to ``groups``."""
        self.path, self.buf, self.data_end = path, buf, data_end
        r = _Reader(buf)
        self.before = bytearray()  # raw fields before num_rows (version, schema), headers included
        self.after = bytearray()  # raw fields after row_groups, with the struct's stop byte
        self.num_rows = 0
        self.groups_at = self.groups = -1  # first byte of the row groups' list elements, their number
        last = 0
        while True:
            start = r.pos
            fid, kind = r.field(last)
            if kind == _STOP:
                self.after.append(0)
                break
            if fid in _FMD_ENCRYPTION:
                raise OutputError(f"cannot concatenate {path}: it is encrypted")
            if fid == _FMD_NUM_ROWS and kind == _I64 and self.groups < 0 and last == 2:
                self.num_rows = r.zigzag()
            elif fid == _FMD_ROW_GROUPS and kind == _LIST and last == _FMD_NUM_ROWS:
                self.groups, _ = r.list_header()
                self.groups_at = r.pos
                r.pos = self._row_groups(groups, shift, first_ordinal)
            elif fid < _FMD_NUM_ROWS:
                r.skip(kind)
                self.before += self.buf[start:r.pos]
            elif fid > _FMD_ROW_GROUPS and self.groups >= 0:
                r.skip(kind)
                self.after += self.buf[start:r.pos]
            else:
                raise OutputError(f"cannot concatenate {path}: unexpected footer field {fid}")
            last = fid
        if self.groups < 0:
            raise OutputError(f"cannot concatenate {path}: its footer has no row groups")

    def _row_groups(self, out: bytearray, shift: int, first_ordinal: int) -> int:
        """Append this file's row groups to ``out``, their offsets moved by ``shift`` and ordinals from
        ``first_ordinal``; returns where the list ends."""
        p = _Patcher(_Reader(self.buf, self.groups_at))

        def offset(fid: int, value: int) -> int:
            return value + shift if value else value

        def column_meta(o: bytearray, kind: int) -> None:
            p.struct(o, lambda fid, v: offset(fid, v) if fid in _CM_OFFSETS or fid == _CM_BLOOM else v)

        def chunk(o: bytearray) -> None:
            def cc(fid: int, v: int) -> int:
                if fid in (_CC_FILE_OFFSET, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX):
                    return offset(fid, v)
                return v
            p.struct(o, cc, {_CC_META: column_meta, _CC_FILE_PATH: _refuse("an external file_path"),
                             _CC_CRYPTO: _refuse("encryption"), _CC_ENCRYPTED: _refuse("encryption")})

        def columns(o: bytearray, kind: int) -> None:
            n, elem = p.r.list_header()
            o += _list_header(n, elem)
            for _ in range(n):
                chunk(o)

        for i in range(self.groups):
            ordinal = first_ordinal + i

            def rg(fid: int, v: int, ordinal=ordinal) -> int:
                if fid == _RG_FILE_OFFSET:
                    return offset(fid, v)
                if fid == _RG_ORDINAL:
                    return ordinal
                return v
            p.struct(out, rg, {_RG_COLUMNS: columns})
        return p.r.pos


def _refuse(what: str):
    def refuse(out, kind):
        raise OutputError(f"cannot concatenate Parquet files with {what}")
    return refuse


def concat(paths: list[str], out_path: str, what: str | None = None, footer: str | None = None) -> None:
    """Write ``out_path``: the row groups of ``paths`` (same schema and settings) in order, one footer
    (``footer``: the fields around the row groups taken from that file, whose schema every path must
    have; default: the first path's, whose metadata every path must have too). A failing write (a
    full disk) is an OutputError naming ``what`` (default ``out_path``)."""
    if not paths:
        raise OutputError("nothing to concatenate")
    try:
        _concat(paths, out_path, footer)
    except OSError as exc:
        raise OutputError(f"cannot write {what or out_path}: {exc.strerror or exc}") from None


def _fields(path: str) -> _Part:
    """The footer fields of ``path`` around its row groups."""
    buf, data_end = _footer(path)
    return _Part(path, buf, data_end, 0, 0, bytearray())


def same_schema(a: str, b: str) -> bool:
    """Whether the Parquet files ``a`` and ``b`` have the same schema (their row groups can be joined
    under one footer, :func:`concat` with ``footer``)."""
    return _fields(a).before == _fields(b).before


def _concat(paths: list[str], out_path: str, footer_path: str | None = None) -> None:
    groups = bytearray()
    at, ordinal, parts = len(MAGIC), 0, []
    template = _fields(footer_path) if footer_path is not None else None
    with open(out_path, "wb", buffering=0) as out:
        out.write(MAGIC)
        for path in paths:
            buf, data_end = _footer(path)
            part = _Part(path, buf, data_end, at - len(MAGIC), ordinal, groups)
            if template is not None:
                if part.before != template.before:
                    raise OutputError(f"cannot concatenate {path}: its schema differs from {footer_path}'s")
            elif parts and (part.before != parts[0].before or part.after != parts[0].after):
                raise OutputError(f"cannot concatenate {path}: its schema or metadata differs from {paths[0]}'s")
            parts.append(part)
            ordinal += part.groups
            with open(part.path, "rb") as src:
                _copy(src, out, len(MAGIC), part.data_end - len(MAGIC))
            at += part.data_end - len(MAGIC)
        head = template if template is not None else parts[0]
        footer = bytearray(head.before)
        # the fields keep their order: num_rows (3) and row_groups (4) right after schema (2)
        footer += bytes([(1 << 4) | _I64]) + _zigzag(sum(p.num_rows for p in parts))
        footer += _row_groups_field(ordinal) + groups
        footer += head.after
        out.write(footer)
        out.write(struct.pack("<I", len(footer)))
        out.write(MAGIC)


def _row_groups_field(count: int) -> bytes:
    # field 4 right after field 3: delta 1, type list
    return bytes([(1 << 4) | _LIST]) + _list_header(count, _STRUCT)


_NO_COPY_FILE_RANGE = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF})


def _copy(src, dst, offset: int, length: int) -> None:
    """``length`` bytes of ``src`` from ``offset`` appended to ``dst``: by the kernel where the filesystem
    can (``copy_file_range``), else read and written; any other error (a full disk) is raised."""
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src.fileno(), dst.fileno(), length - done, offset + done)
            if n == 0:
                break
            done += n
    except OSError as exc:
        if exc.errno not in _NO_COPY_FILE_RANGE:
            raise
    if done < length:
        src.seek(offset + done)
        dst.seek(0, os.SEEK_END)
        left = length - done
        while left:
            chunk = src.read(min(left, 1 << 24))
            if not chunk:
                raise OutputError(f"{src.name} ended early")
            dst.write(chunk)
            left -= len(chunk)
