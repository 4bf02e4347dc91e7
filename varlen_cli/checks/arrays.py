"""What every check of a plan works on: :class:`PlanArrays` (a window of plan rows as arrays),
:class:`Check` (one check's result), CSR segment reductions and the examples a failed check shows."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_EXAMPLES = 5


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False


@dataclass
class PlanArrays:
    """Plan rows as arrays: per-microbatch columns (``cols``: epoch, step, rank, micro, num_samples,
    seqlen, batch_size, tokens, lr_scale, shape_id, step_samples, step_tokens and, when present,
    step_loss_tokens), the list columns flattened (``ids``; packed plans ``lengths``, ``rows``,
    ``starts``; mixtures ``source``) with their CSR ``offsets``, and, when known (``--metrics``, the
    planner), ``sample_length``: each entry's whole sample length, and ``sample_target``: each
    entry's loss tokens as the metrics counted them (their ``target_length``; plans whose metadata
    says ``loss_tokens: target_length``). ``first_row``: the plan row of the first row (a window of a
    larger plan; whole steps)."""

    cols: dict
    offsets: np.ndarray
    ids: np.ndarray
    lengths: np.ndarray | None = None
    rows: np.ndarray | None = None
    starts: np.ndarray | None = None
    source: np.ndarray | None = None
    sample_length: np.ndarray | None = None
    sample_target: np.ndarray | None = None
    first_row: int = 0
    _final: np.ndarray | None = field(default=None, repr=False)
    _split: np.ndarray | None = field(default=None, repr=False)  # entries of split samples (final_entries)
    _epoch: np.ndarray | None = field(default=None, repr=False)  # entry_epoch()

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    @property
    def split(self) -> bool:
        """Whether some entry of these rows is a chunk past a sample's start (``--split-long``)."""
        return self.starts is not None and len(self.starts) > 0 and bool(self.starts.any())

    def entry_epoch(self) -> np.ndarray:
        if self._epoch is None:
            self._epoch = np.repeat(self.cols["epoch"].astype(np.int64), np.diff(self.offsets))
        return self._epoch


# -- segments ----------------------------------------------------------------------------------------


def segment_reduce(ufunc, values: np.ndarray, offsets: np.ndarray, empty=0, dtype=None) -> np.ndarray:
    """``ufunc.reduceat`` over the CSR segments, ``empty`` for empty ones (any offsets)."""
    counts = np.diff(offsets)
    out = np.full(len(counts), empty, dtype=dtype or (np.float64 if values.dtype.kind == "f" else np.int64))
    nz = np.flatnonzero(counts > 0)
    if len(nz):
        out[nz] = ufunc.reduceat(values, offsets[nz], dtype=out.dtype if ufunc is np.add else None)
    return out


def join_values(values) -> str:
    return ", ".join(str(int(v)) for v in list(values)[:MAX_EXAMPLES])


class Examples:
    """Up to MAX_EXAMPLES values, the first ones met in plan order (``first_row``: the plan row of the
    window's first value; windows fed out of order, or merged, keep the first by plan row)."""

    def __init__(self):
        self.values: list = []
        self.rows: list = []

    def add(self, mask: np.ndarray, values: np.ndarray, first_row: int = 0) -> None:
        if len(self.values) < MAX_EXAMPLES and mask.any():
            at = np.flatnonzero(mask)[:MAX_EXAMPLES]
            self.values += values[at].tolist()
            self.rows += (first_row + at).tolist()

    def merge(self, other: Examples) -> None:
        """The first MAX_EXAMPLES of both, by plan row."""
        pairs = sorted(zip(self.rows + other.rows, self.values + other.values), key=lambda p: p[0])[:MAX_EXAMPLES]
        self.rows, self.values = [p[0] for p in pairs], [p[1] for p in pairs]

    def __str__(self) -> str:
        return join_values(self.values)


def smallest(*parts) -> np.ndarray:
    """The MAX_EXAMPLES smallest distinct values of arrays."""
    return np.unique(np.concatenate([np.asarray(p, np.int64) for p in parts]))[:MAX_EXAMPLES]


def edges_decrease(edges: list) -> bool:
    """Whether the epoch falls from one window to the next; ``edges``: (first row, first epoch, last
    epoch) of each window, in any order."""
    edges = sorted(edges)
    return any(b[1] < a[2] for a, b in zip(edges, edges[1:]))


def first_met(a: tuple | None, b: tuple | None) -> tuple | None:
    """Of two (first row, ...) findings, the one met first in plan order."""
    if a is None or b is None:
        return a if b is None else b
    return min(a, b, key=lambda x: x[0])


def compact(values: np.ndarray) -> np.ndarray:
    """``values`` as int32 when they fit (split chunks' epochs, keys, starts and lengths), else int64."""
    values = np.asarray(values)
    if not len(values) or (int(values.min()) >= -INT32_LIMIT and int(values.max()) < INT32_LIMIT):
        return values.astype(np.int32)
    return values.astype(np.int64)


INT32_LIMIT = 1 << 31
