"""Summary statistics of a length column across all workers (exact percentiles, no gather of rows)."""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError
from ..runtime.dist import Dist
from ..runtime.text import LOG_BINS, log2_histogram

EXACT_MAX = 1 << 22  # lengths up to 4M: exact percentiles from an all-reduced bincount
INT64_MAX = (1 << 63) - 1


def _log2_from_counts(counts: np.ndarray) -> np.ndarray:
    """The log2 histogram of the values whose exact counts (value -> count) are ``counts``."""
    hist = np.zeros(LOG_BINS, dtype=np.int64)
    if len(counts) == 0:
        return hist
    edges = [0] + [1 << k for k in range(LOG_BINS - 1) if (1 << k) < len(counts)]  # bin k starts at 2**(k-1)
    sums = np.add.reduceat(counts, edges)
    hist[: len(sums)] = sums
    return hist


def distribution(local: np.ndarray, d: Dist, quantiles=(0.5, 0.9, 0.99)) -> dict:
    """count, total, min, mean, percentiles, max and a log2 histogram of integer lengths over all ranks."""
    return LengthStats().add(local).finish(d, quantiles)


class LengthStats:
    """:func:`distribution` fed piece by piece (a worker's lengths need not be in memory at once): the
    exact total, min, max and the counts per length (up to :data:`EXACT_MAX`; past it, per power of two)."""

    def __init__(self):
        self.n, self.total = 0, 0
        self.lo, self.hi = np.iinfo(np.int64).max, -1
        self.counts = np.zeros(0, np.int64)  # exact counts per length while every length <= EXACT_MAX
        self.log2: np.ndarray | None = None  # per power of two, once a length > EXACT_MAX was seen

    def add(self, values: np.ndarray) -> LengthStats:
        v = np.asarray(values, dtype=np.int64)
        if not len(v):
            return self
        self.n += len(v)
        lo, hi = int(v.min()), int(v.max())
        safe = hi <= INT64_MAX // len(v)
        # x == (x >> 32) * 2**32 + (x & 0xFFFFFFFF): the two halves summed apart cannot wrap for n < 2**31
        self.total += int(v.sum()) if safe else (int((v >> 32).sum()) << 32) + int((v & 0xFFFFFFFF).sum())
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        if self.log2 is None and (lo < 0 or self.hi > EXACT_MAX):
            self.log2 = _log2_from_counts(self.counts)
        if self.log2 is None:
            new = np.bincount(v, minlength=len(self.counts))
            new[: len(self.counts)] += self.counts
            self.counts = new
        else:
            self.log2 += log2_histogram(v)
        return self

    def finish(self, d: Dist, quantiles=(0.5, 0.9, 0.99)) -> dict:
        n = self.n
        count = int(d.all_reduce(np.array([n], dtype=np.int64))[0])
        total = sum(d.all_gather_object(self.total))
        if total > INT64_MAX:
            raise InputError(f"the lengths add up to {total}, more than 2**63-1; their total must fit int64")
        lo = d.all_reduce(np.array([self.lo if n else np.iinfo(np.int64).max], dtype=np.int64), op="min")[0]
        hi = d.all_reduce(np.array([self.hi if n else -1], dtype=np.int64), op="max")[0]
        out = {"count": count, "total": total, "min": int(lo) if count else 0, "max": int(hi) if count else 0,
               "mean": total / count if count else 0.0}
        if count and hi <= EXACT_MAX and lo >= 0:
            # One exact bincount gives the percentiles and the histogram.
            local = np.zeros(int(hi) + 1, np.int64)
            local[: len(self.counts)] = self.counts
            counts = d.all_reduce(local)
            hist = _log2_from_counts(counts)
            cum = np.cumsum(counts)
            for q in quantiles:
                out[f"p{round(q * 100)}"] = int(np.searchsorted(cum, q * count, side="left"))
        else:
            # Huge lengths: percentiles from the log2 histogram's upper bin edges (approximate).
            mine = self.log2 if self.log2 is not None else _log2_from_counts(self.counts)
            hist = d.all_reduce(mine)
            cum = np.cumsum(hist)
            for q in quantiles:
                k = int(np.searchsorted(cum, q * count, side="left")) if count else 0
                out[f"p{round(q * 100)}"] = (1 << k) - 1 if k else 0
            out["approximate_percentiles"] = True
        last = int(np.max(np.flatnonzero(hist))) + 1 if hist.any() else 1
        out["histogram"] = {"log2_bins": hist[:last].tolist()}
        return out


def float_summary(unit_values, count: int, d: Dist) -> dict:
    """count, min, max and mean of float values held as per-unit arrays (``unit_values``) on each rank.

    The same for any number of workers, to the last bit: each unit's values (divided by ``count``
    first, so no sum can overflow) are summed within the unit (units do not depend on the worker
    count), and the per-unit sums of all ranks are added with ``math.fsum`` (exact, so the order of
    ranks does not matter).
    """
    acc = FloatSummary(count)
    for v in unit_values:
        acc.add(v)
    return acc.finish(d)


class FloatSummary:
    """:func:`float_summary` fed unit by unit (``count``: the values of all ranks, known up front)."""

    def __init__(self, count: int):
        self.count = count
        self.sums: list = []
        self.lo, self.hi = math.inf, -math.inf

    def add(self, values) -> None:
        v = np.asarray(values, dtype=np.float64)
        if not len(v):
            return
        if self.count:
            self.sums.append(float(np.sum(v / self.count)))
        self.lo, self.hi = min(self.lo, float(np.min(v))), max(self.hi, float(np.max(v)))

    def finish(self, d: Dist) -> dict:
        sums = [s for rank_sums in d.all_gather_object(self.sums) for s in rank_sums]
        lo = float(d.all_reduce(np.array([self.lo]), op="min")[0])
        hi = float(d.all_reduce(np.array([self.hi]), op="max")[0])
        if not self.count:
            return {"count": int(self.count), "min": 0.0, "max": 0.0, "mean": 0.0}
        return {"count": int(self.count), "min": lo, "max": hi, "mean": math.fsum(sums)}
