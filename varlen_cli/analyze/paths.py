"""Field paths: ``--length KIND:PATH``, ``--target-length KIND:PATH``, ``--difficulty value:PATH`` and
``SourceDataset(columns=[PATH, ...])`` name a column or a value nested in struct and list columns.

A PATH is ``NAME`` followed by ``.NAME`` (a struct field, a JSON object's key) and ``[INDEX]`` (a
list element; a negative index counts from the end, as in Python) steps: ``text``,
``recording.num_samples``, ``supervisions[0].text``, ``meta.len``, ``turns[-1]``. A column whose own
name holds dots (``my.col``) is taken whole: the first name is the longest dotted prefix that is a
column of the source (WebDataset's ``EXT.FIELD`` columns are the member's JSON fields, see
:mod:`varlen_cli.analyze.formats.webdataset`).

Values are taken with Arrow compute (``struct_field``, ``list_element``, a ``take`` for negative
indexes): vectorised over a unit, never a Python loop per row. A missing field or an index past a
list's end is one line naming the field and what is there (the fields a struct has; the rows whose
list is too short and the shortest length).

:func:`parse` is the one parser (analyze, ``SourceDataset``, the CLI help's :data:`SYNTAX`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, UsageError

SYNTAX = "PATH is a column, or a field nested in struct/list columns: a.b, a[0].b, a[-1]"
STEP = re.compile(r"\.([^.\[\]]+)|\[(-?\d+)\]")
FIRST = re.compile(r"[^.\[\]]+")


@dataclass(frozen=True)
class FieldPath:
    """A parsed PATH: ``steps`` are field names (str) and list indexes (int), a name first."""

    text: str
    steps: tuple

    def __str__(self) -> str:
        return self.text

    @property
    def nested(self) -> bool:
        return len(self.steps) > 1


def parse(text: str, what: str = "PATH") -> FieldPath:
    """``text`` as a :class:`FieldPath`; a malformed one refused in one line (``what`` names the option)."""
    first = FIRST.match(text)
    if not text or first is None:
        raise UsageError(f"{what}: {text!r} is not a field path ({SYNTAX})")
    steps: list = [first.group(0)]
    pos = first.end()
    while pos < len(text):
        m = STEP.match(text, pos)
        if m is None:
            raise UsageError(f"{what}: {text!r} is not a field path: cannot read {text[pos:]!r} after "
                             f"{text[:pos]!r} ({SYNTAX})")
        steps.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    return FieldPath(text, tuple(steps))


def render(steps: Sequence) -> str:
    """The PATH text of ``steps`` (names joined by dots, indexes in brackets)."""
    out = ""
    for s in steps:
        out += f"[{s}]" if isinstance(s, int) else (f".{s}" if out else str(s))
    return out


def split(path: FieldPath, names: Sequence[str], joined: bool = False) -> tuple[str, tuple]:
    """(the column to read, the steps to take inside it). The column is the longest dotted prefix of
    the path's leading names that is one of ``names`` (the whole path when it is a column), else its
    first name. ``joined``: the reader resolves dotted names itself (WebDataset's ``EXT.FIELD``): the
    column is every leading name, joined."""
    lead = 0
    while lead < len(path.steps) and isinstance(path.steps[lead], str):
        lead += 1
    if joined:
        return ".".join(path.steps[:lead]), path.steps[lead:]
    known = set(names)
    for k in range(lead, 1, -1):
        name = ".".join(path.steps[:k])
        if name in known:
            return name, path.steps[k:]
    return path.steps[0], path.steps[1:]


def extract(column, steps: Sequence, path: FieldPath | str, where: str):
    """The values at ``steps`` inside ``column`` (an Arrow array or chunked array read for ``path``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = str(path)
    full = parse(text).steps
    taken = len(full) - len(steps)  # the steps the column itself stands for
    for k, step in enumerate(steps):
        here = render(full[: taken + k])
        t = column.type
        if isinstance(step, str):
            if not pa.types.is_struct(t):
                raise InputError(f"field '{text}' not found in {where}: {here} is {_kind(t)}, not a struct, so it "
                                 f"has no field '{step}'")
            names = [t.field(i).name for i in range(t.num_fields)]
            if step not in names:
                raise InputError(f"field '{text}' not found in {where}: {here} has no field '{step}' (its fields: "
                                 f"{', '.join(names) or 'none'})")
            column = pc.struct_field(column, [names.index(step)])
        else:
            column = _element(column, step, here, text, where)
    return column


def _kind(t) -> str:
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "a list"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "a string"
    if pa.types.is_struct(t):
        return f"a struct (fields: {', '.join(t.field(i).name for i in range(t.num_fields))})"
    return f"of type {t}"


def _element(column, index: int, here: str, text: str, where: str):
    """Element ``index`` of every (non-null) list of ``column``; refused where a list is too short."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise InputError(f"field '{text}' not found in {where}: {here} is {_kind(t)}, not a list, so it has no "
                         f"element [{index}]")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)  # float, NaN for null lists
    valid = ~np.isnan(lengths) if lengths.dtype.kind == "f" else np.ones(len(lengths), bool)
    short = valid & ((lengths <= index) if index >= 0 else (lengths < -index))
    if short.any():
        shortest = _count(int(lengths[short].min()), "element")
        raise InputError(f"field '{text}' not found in {where}: {here}[{index}] is out of range in {int(short.sum())} "
                         f"of {len(lengths)} rows (the shortest list there has {shortest})")
    if index >= 0:
        return pc.list_element(column, index)
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out = [_from_end(c, index) for c in chunks]
    return pa.chunked_array(out, t.value_type) if isinstance(column, pa.ChunkedArray) else out[0]


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _from_end(lists, index: int):
    """Element ``index`` (< 0) of each list of one array, nulls kept."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_fixed_size_list(lists.type):  # values of the whole parent: rows from the array's offset
        ends = (np.arange(len(lists), dtype=np.int64) + lists.offset + 1) * lists.type.list_size
    else:
        ends = lists.offsets.to_numpy().astype(np.int64)[1:]
    positions = pa.array(ends + index, pa.int64(), mask=pc.is_null(lists).to_numpy(zero_copy_only=False))
    return lists.values.take(positions)


def value(obj, steps: Sequence):
    """The value at ``steps`` inside a Python object (dicts and lists, as a ``SourceDataset`` item
    holds them); None where a field or element is missing."""
    for step in steps:
        if isinstance(step, str):
            if not isinstance(obj, dict) or step not in obj:
                return None
            obj = obj[step]
        else:
            if not isinstance(obj, (list, tuple, np.ndarray)) or not -len(obj) <= step < len(obj):
                return None
            obj = obj[step]
    return obj
