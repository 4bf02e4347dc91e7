"""Series over a plan's steps, downsampled to a fixed number of buckets of consecutive steps and
summed window by window: memory grows with the buckets, never with the steps (``varlen inspect``,
``varlen report``). A bucket keeps the min, the max and the mean of its values, so a spike of one
step out of a million still shows. Imports numpy only.
"""

from __future__ import annotations

import numpy as np


def bucket_edges(total: int, count: int) -> np.ndarray:
    """``min(count, total) + 1`` edges cutting steps ``0 .. total - 1`` into buckets of (nearly) equal
    size: bucket ``k`` holds steps ``edges[k] .. edges[k + 1] - 1`` (one step a bucket when
    ``total <= count``)."""
    total = max(int(total), 0)
    return np.linspace(0, total, min(int(count), total) + 1).astype(np.int64)


def bucket_of(edges: np.ndarray, positions) -> np.ndarray:
    """The bucket of each step position (positions past the last edge go to the last bucket)."""
    last = max(len(edges) - 2, 0)
    return np.clip(np.searchsorted(edges, np.asarray(positions, np.int64), side="right") - 1, 0, last)


class Buckets:
    """Sum, count of finite values, min and max per bucket of one series; values that are not finite
    (a damaged plan) are counted in :attr:`non_finite`, never averaged."""

    def __init__(self, total: int, count: int):
        self.edges = bucket_edges(total, count)
        k = len(self.edges) - 1
        self.sum, self.count = np.zeros(k), np.zeros(k, np.int64)
        self.min, self.max = np.full(k, np.inf), np.full(k, -np.inf)
        self.non_finite = 0

    def add(self, positions, values) -> None:
        """Add ``values`` at step ``positions`` (one value a step, or several: one per sample entry)."""
        values = np.asarray(values, np.float64)
        if not len(values) or not len(self.sum):
            return
        b = bucket_of(self.edges, positions)
        finite = np.isfinite(values)
        self.non_finite += int(len(values) - finite.sum())
        b, kept = b[finite], values[finite]
        self.sum += np.bincount(b, weights=kept, minlength=len(self.sum))
        self.count += np.bincount(b, minlength=len(self.sum))
        np.minimum.at(self.min, b, kept)
        np.maximum.at(self.max, b, kept)

    def means(self) -> np.ndarray:
        """The mean of each bucket (NaN where it holds no finite value)."""
        return np.where(self.count > 0, self.sum / np.maximum(self.count, 1), np.nan)

    def summary(self) -> dict:
        """``min``, ``max`` and ``mean`` of every value (NaN when none is finite), and ``non_finite``
        when some are not finite."""
        seen = self.count > 0
        n = int(self.count.sum())
        out = {"min": float(self.min[seen].min()) if n else float("nan"),
               "max": float(self.max[seen].max()) if n else float("nan"),
               "mean": float(self.sum.sum() / n) if n else float("nan")}
        if self.non_finite:
            out["non_finite"] = self.non_finite
        return out

    def to_json(self) -> dict:
        """``min``, ``mean`` and ``max`` per bucket as lists (None for a bucket without a value)."""
        seen = self.count > 0
        return {name: [float(v) if ok else None for v, ok in zip(values, seen)]
                for name, values in (("min", self.min), ("mean", self.means()), ("max", self.max))}


class BucketMatrix:
    """Per row (a rank, a source) and bucket: the sum of values and the number of steps they came
    from (rows may grow, for a damaged plan with more ranks than it says)."""

    def __init__(self, total: int, count: int, rows: int):
        self.edges = bucket_edges(total, count)
        self.sums = np.zeros((rows, len(self.edges) - 1))

    def grow(self, rows: int) -> None:
        if rows > len(self.sums):
            self.sums = np.pad(self.sums, ((0, rows - len(self.sums)), (0, 0)))

    def add(self, positions, rows, values) -> None:
        """Add ``values`` of ``rows`` (row indices, as many as the values) at step ``positions``."""
        values = np.asarray(values, np.float64)
        k = self.sums.shape[1]
        if not len(values) or not k:
            return
        rows = np.asarray(rows, np.int64)
        self.grow(int(rows.max()) + 1)
        flat = rows * k + bucket_of(self.edges, positions)
        self.sums += np.bincount(flat, weights=values, minlength=self.sums.size).reshape(self.sums.shape)

    def steps(self) -> np.ndarray:
        """Steps in each bucket."""
        return np.diff(self.edges).astype(np.float64)
