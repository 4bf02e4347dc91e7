"""The units a step is planned in: a sample, or a whole group (``groups``: a DPO pair, a GRPO group),
which no microbatch boundary may cut.

A :class:`Units` lists its members as CSR over the step's sample indices; groups are numbered by
their sorted ids (one deterministic order for any input order). Imports only numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..plan.batching import segment_gather


@dataclass(frozen=True)
class Units:
    members: np.ndarray  # int64 sample indices, unit after unit
    offsets: np.ndarray  # int64, units + 1
    ids: np.ndarray | None  # the group id of each unit (None: the units are the samples)

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    @property
    def weight(self) -> np.ndarray:
        """Samples per unit."""
        return np.diff(self.offsets)

    def longest(self, lengths: np.ndarray) -> np.ndarray:
        """Per unit, its longest member (the T it pads to)."""
        if self.ids is None:
            return lengths
        return np.maximum.reduceat(lengths[self.members], self.offsets[:-1]) if self.count else lengths[:0]

    def total(self, lengths: np.ndarray) -> np.ndarray:
        """Per unit, its members' tokens."""
        if self.ids is None:
            return lengths
        return np.add.reduceat(lengths[self.members], self.offsets[:-1]) if self.count else lengths[:0]

    def expand(self, unit_seq: np.ndarray) -> np.ndarray:
        """The samples of the units ``unit_seq``, in that order (members of a unit in index order)."""
        if self.ids is None:
            return unit_seq
        counts = np.diff(self.offsets)[unit_seq]
        out_off = np.zeros(len(unit_seq) + 1, np.int64)
        np.cumsum(counts, out=out_off[1:])
        return self.members[segment_gather(self.offsets[unit_seq], counts, out_off)]

    def expand_counts(self, unit_seq: np.ndarray) -> np.ndarray:
        """Members of each unit of ``unit_seq``."""
        return np.ones(len(unit_seq), np.int64) if self.ids is None else np.diff(self.offsets)[unit_seq]

    def describe(self, unit: int, lengths: np.ndarray) -> str:
        """A unit for messages: ``sample 17 (40,000 tokens)`` or ``group 5 (16 samples, ...)``."""
        lo, hi = int(self.offsets[unit]), int(self.offsets[unit + 1])
        members = self.members[lo:hi]
        if self.ids is None:
            return f"sample {int(members[0])} ({int(lengths[members[0]]):,} tokens)"
        member_lengths = lengths[members]
        return (f"group {self.ids[unit].item()!r} ({hi - lo} samples, {int(member_lengths.sum()):,} tokens, the "
                f"longest {int(member_lengths.max()):,})")


def units_of(n: int, groups) -> Units:
    """The step's units: each sample alone, or the samples of each group id together."""
    if groups is None:
        return Units(np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64), None)
    g = np.asarray(groups)
    if g.ndim != 1 or len(g) != n:
        raise InputError(f"groups must hold one id per sample: {n:,} lengths but groups of shape {g.shape}")
    if g.dtype.kind not in "iubUS" and n:
        raise InputError(f"groups must be integer or string ids, got dtype {g.dtype}")
    ids, inverse = np.unique(g, return_inverse=True)
    inverse = inverse.reshape(-1)
    members = np.argsort(inverse, kind="stable").astype(np.int64)
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(np.bincount(inverse, minlength=len(ids)), out=offsets[1:])
    return Units(members, offsets, ids)
