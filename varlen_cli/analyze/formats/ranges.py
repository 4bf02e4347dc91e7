"""Work units of row containers: the one rule of how many rows analyze reads as one unit.

A unit is ``(part, start, stop, rows, weight)``: rows ``[start, stop)`` of container ``part`` (a
Parquet row group, an MDS shard, a LitData chunk, a Lance fragment, ...). Every reader cuts its
containers here, so one constant bounds what a worker reads at once (tests patch it down to reach the
slice boundaries only large containers have).
"""

from __future__ import annotations

MAX_UNIT_ROWS = 1 << 20  # rows of one unit at most


def unit_rows(rows: int, nbytes: int, chunk_bytes: int) -> int:
    """Rows per unit of a container of ``rows`` rows in ``nbytes`` bytes: about ``chunk_bytes`` of it,
    at least 1, at most :data:`MAX_UNIT_ROWS`."""
    return max(1, min(MAX_UNIT_ROWS, chunk_bytes * rows // max(nbytes, 1)))


def row_ranges(part: int, rows: int, step: int) -> list[tuple[int, int, int, int, int]]:
    """The units of container ``part`` of ``rows`` rows, ``step`` rows each (the last one shorter; an
    empty container is one empty unit)."""
    step = max(step, 1)
    return [(part, a, min(rows, a + step), min(rows, a + step) - a, min(rows, a + step) - a)
            for a in range(0, max(rows, 1), step)]
