"""Padded shapes: which T a length pads to (``--pad-multiple``, ``--num-shapes``), and
padding-minimising bucket edges. What a microbatch costs is :class:`varlen_cli.budget.Budget`
(re-exported here)."""

from __future__ import annotations

import numpy as np

from ..budget import Budget

__all__ = ["Budget", "ShapeMap", "choose_edges", "dense_ids", "pair_ids", "value_counts"]

MAX_CANDIDATES = 1024  # distinct seqlen candidates the bucket-edge DP considers (quantiles beyond)


class ShapeMap:
    """Length -> padded seqlen T: round up to ``pad_multiple``, then up to the next bucket edge."""

    def __init__(self, pad_multiple: int = 1, edges: np.ndarray | None = None):
        self.pad_multiple = int(pad_multiple)
        self.edges = None if edges is None else np.asarray(edges, dtype=np.int64)

    def pad(self, lengths) -> np.ndarray:
        v = np.asarray(lengths, dtype=np.int64)
        m = self.pad_multiple
        v = np.maximum(v, 1)  # an empty sample still takes one position of a row
        return v if m == 1 else -(-v // m) * m

    def __call__(self, lengths) -> np.ndarray:
        v = self.pad(lengths)
        if self.edges is None:
            return v
        idx = np.searchsorted(self.edges, v, side="left")
        return self.edges[np.minimum(idx, len(self.edges) - 1)]

    def to_dict(self) -> dict:
        return {"pad_multiple": self.pad_multiple, "edges": None if self.edges is None else self.edges.tolist()}


def value_counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values and their counts, O(N) with bincount for small non-negative ints."""
    v = np.asarray(values, dtype=np.int64)
    if not len(v):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lo, hi = int(v.min()), int(v.max())
    if lo >= 0 and hi <= max(1 << 24, 4 * len(v)):
        counts = np.bincount(v, minlength=hi + 1)
        u = np.flatnonzero(counts).astype(np.int64)
        return u, counts[u].astype(np.int64)
    u, c = np.unique(v, return_counts=True)
    return u.astype(np.int64), c.astype(np.int64)


def dense_ids(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, index of each value among them), O(N) for small non-negative ints."""
    v = np.asarray(values, dtype=np.int64)
    if len(v) and int(v.min()) >= 0 and int(v.max()) <= max(1 << 24, 4 * len(v)):
        present = np.zeros(int(v.max()) + 1, dtype=np.int64)
        present[v] = 1
        u = np.flatnonzero(present).astype(np.int64)
        rank = np.cumsum(present) - 1
        return u, rank[v]
    u, inv = np.unique(v, return_inverse=True)
    return u.astype(np.int64), inv.reshape(-1).astype(np.int64)


def pair_ids(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (a, b) pairs sorted by (a, b), and the index of each row's pair; O(N) for small ints."""
    ua, ia = dense_ids(a)
    ub, ib = dense_ids(b)
    u, inv = dense_ids(ia * max(len(ub), 1) + ib)
    return ua[u // max(len(ub), 1)], ub[u % max(len(ub), 1)], inv


def choose_edges(padded: np.ndarray, k: int) -> np.ndarray:
    """At most ``k`` bucket edges (seqlens) that minimise the total padding sum(edge(L) - L) of
    these (already pad-multiple rounded) lengths; the largest length is always an edge.

    Exact dynamic programme over the distinct lengths when there are at most ``MAX_CANDIDATES`` of
    them, else over that many quantile candidates (each candidate the upper end of its group, so
    every length still fits its edge). O(k * C^2) with C <= 1024.
    """
    u, c = value_counts(padded)
    if len(u) == 0:
        return np.zeros(0, np.int64)
    if len(u) <= k:
        return u
    s = u.astype(np.float64) * c
    if len(u) > MAX_CANDIDATES:
        cum = np.cumsum(c)
        targets = np.linspace(0, cum[-1], MAX_CANDIDATES + 1)[1:]
        cut = np.unique(np.minimum(np.searchsorted(cum, targets, side="left"), len(u) - 1))
        group = np.searchsorted(cut, np.arange(len(u)), side="left")  # group of each distinct value
        cand = u[cut]
        gc = np.bincount(group, weights=c, minlength=len(cut))
        gs = np.bincount(group, weights=s, minlength=len(cut))
    else:
        cand, gc, gs = u, c.astype(np.float64), s
    g = len(cand)
    if g <= k:
        return cand.astype(np.int64)
    pc = np.concatenate([[0.0], np.cumsum(gc)])
    ps = np.concatenate([[0.0], np.cumsum(gs)])
    # cost[i, j]: groups i..j-1 in one bucket with edge cand[j-1]  (i < j)
    i_idx = np.arange(g + 1)[:, None]
    j_idx = np.arange(g + 1)[None, :]
    edge = np.concatenate([[0.0], cand.astype(np.float64)])[None, :]  # edge for j (j >= 1)
    cost = (pc[None, :] - pc[:, None]) * edge - (ps[None, :] - ps[:, None])
    cost = np.where(i_idx < j_idx, cost, np.inf)
    best = np.full(g + 1, np.inf)
    best[0] = 0.0
    parents = []
    for _ in range(k):
        total = best[:, None] + cost
        parent = np.argmin(total, axis=0)
        best = total[parent, np.arange(g + 1)]
        parents.append(parent)
    # backtrack from j = g with exactly k buckets (k < g, so every bucket is non-empty)
    edges = []
    j = g
    for parent in reversed(parents):
        edges.append(cand[j - 1])
        j = int(parent[j])
    return np.array(sorted(edges), dtype=np.int64)
