"""Records spilled to temporary files by (group, key range), read back one file at a time.

``varlen validate`` checks the chunks of a ``--split-long`` plan's split samples per sample (their
tiling), after every entry of the plan has been read: a billion-sample plan has tens of millions of
such entries. Instead of holding them until the end, each window's are appended to the file of
their (epoch, range of keys), and the check reads one file at a time (a sample's entries share its
key, so each file holds every entry of its samples): memory bounded by one file, whatever the plan.
Imports numpy and :mod:`varlen_cli.errors` only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from ..errors import OutputError


class KeyRangeSpill:
    """int64 records (``fields``, one of them ``key``, in ``[0, key_limit)``) appended by group (an
    int, e.g. the epoch) into ``parts`` ranges of keys, under ``directory`` (which the caller owns)."""

    def __init__(self, directory: str, fields: tuple, key_limit: int, parts: int):
        self.directory = directory
        self.dtype = np.dtype([(name, np.int64) for name in fields])
        self.width = max(1, -(-max(int(key_limit), 1) // max(int(parts), 1)))  # keys a file covers
        self.files: dict = {}  # (group, part) -> path
        self.count = 0

    def add(self, group: np.ndarray, columns: dict) -> None:
        """Append records; ``group``: each record's group, ``columns``: each field's values."""
        key = np.asarray(columns["key"], np.int64)
        if not len(key):
            return
        group = np.asarray(group, np.int64)
        part = key // self.width
        order = np.lexsort((part, group))
        records = np.empty(len(key), self.dtype)
        for name in self.dtype.names:
            records[name] = np.asarray(columns[name])[order]
        g, p = group[order], part[order]
        cuts = np.flatnonzero((g[1:] != g[:-1]) | (p[1:] != p[:-1])) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(key)]):
            where = (int(g[lo]), int(p[lo]))
            path = self.files.get(where)
            if path is None:
                path = self.files[where] = os.path.join(self.directory, f"{len(self.files)}.bin")
            try:
                with open(path, "ab") as f:
                    records[lo:hi].tofile(f)
            except OSError as exc:  # a full disk: where, and what to do
                raise OutputError(f"cannot write temporary files under {self.directory}: {exc.strerror or exc}; "
                                  "free space there or point TMPDIR elsewhere") from None
        self.count += len(key)

    def groups(self) -> list[int]:
        return sorted({g for g, _ in self.files})

    def parts(self, group: int) -> Iterator[dict]:
        """The records of ``group``, one range of keys at a time, in key order (each field's values)."""
        for where in sorted(w for w in self.files if w[0] == group):
            records = np.fromfile(self.files[where], self.dtype)
            yield {name: np.ascontiguousarray(records[name]) for name in self.dtype.names}
            del records
