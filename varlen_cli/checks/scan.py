"""Reading a plan file in windows of whole steps, with bounded memory (validate, inspect, simulate).

A plan can hold billions of sample ids; :func:`windows` reads its row groups one at a time and
yields :class:`Window`\\ s of consecutive rows that end on a step boundary (a step cut by a row group
is carried into the next window), each with its scalar columns as numpy arrays and its list
columns flattened (values, the window-local row of each value, and each row's offsets).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .. import format

TARGET_VALUES = 1 << 21  # list values per window (several row groups are read together below this)


@dataclass
class Window:
    first_row: int  # plan row of the first row of this window
    cols: dict  # scalar column -> numpy array (window rows)
    lists: dict  # list column -> (offsets int64 (rows + 1, from 0), values numpy)

    @property
    def n(self) -> int:
        return len(next(iter(self.cols.values()))) if self.cols else 0

    def values(self, name: str) -> np.ndarray:
        return self.lists[name][1]

    def offsets(self, name: str = "sample_ids") -> np.ndarray:
        return self.lists[name][0]

    def parent(self, name: str = "sample_ids") -> np.ndarray:
        """The window row of each value of list column ``name``."""
        off = self.lists[name][0]
        return np.repeat(np.arange(len(off) - 1, dtype=np.int64), np.diff(off))

    def slice(self, lo: int, hi: int) -> Window:
        lists = {}
        for name, (off, vals) in self.lists.items():
            a, b = int(off[lo]), int(off[hi])
            lists[name] = (off[lo:hi + 1] - a, vals[a:b])
        return Window(self.first_row + lo, {k: v[lo:hi] for k, v in self.cols.items()}, lists)


def _concat(a: Window, b: Window) -> Window:
    lists = {}
    for name in a.lists:
        (oa, va), (ob, vb) = a.lists[name], b.lists[name]
        lists[name] = (np.concatenate([oa, ob[1:] + oa[-1]]), np.concatenate([va, vb]))
    return Window(a.first_row, {k: np.concatenate([v, b.cols[k]]) for k, v in a.cols.items()}, lists)


def flatten(column) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa
    import pyarrow.compute as pc

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(array, pa.ChunkedArray):  # an empty chunked array
        array = pa.array([], type=array.type)
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = pc.list_flatten(array).to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values


def windows(pf, scalars, lists, slots: int, target: int | None = None) -> Iterator[Window]:
    """Windows of whole steps (``slots`` rows a step) over an open ``pyarrow.parquet.ParquetFile``;
    row groups are read together up to ``target`` list values (default :data:`TARGET_VALUES`)."""
    target = TARGET_VALUES if target is None else target
    names = list(scalars) + list(lists)
    carry: Window | None = None
    row = 0
    pending: list = []
    pending_values = 0
    md = pf.metadata
    leaf = next((i for i in range(md.num_columns) if md.schema.column(i).path.startswith("sample_ids.")), None)
    for g in range(md.num_row_groups + 1):
        if g < md.num_row_groups:
            rg = md.row_group(g)
            pending.append(g)
            pending_values += rg.column(leaf).num_values if leaf is not None else rg.num_rows
            if pending_values < target and g + 1 < md.num_row_groups:
                continue
        if not pending:
            break
        t = pf.read_row_groups(pending, columns=names)
        pending, pending_values = [], 0
        w = Window(row, {c: t.column(c).to_numpy() for c in scalars}, {c: flatten(t.column(c)) for c in lists})
        row += t.num_rows
        del t
        if carry is not None:
            w = _concat(carry, w)
        end = w.first_row + w.n
        cut = (end // slots) * slots - w.first_row
        if cut > 0:
            yield w.slice(0, cut)
        carry = w.slice(cut, w.n) if cut < w.n else None
    if carry is not None and carry.n:
        yield carry


def present(schema, names) -> list[str]:
    return [n for n in names if n in schema.names]


LIST_COLUMNS = format.PLAN_LIST_COLUMNS
