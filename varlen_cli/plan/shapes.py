"""Budgets and padded shapes: what a microbatch of B samples at seqlen T costs, which T a length
pads to (``--pad-multiple``, ``--num-shapes``), and padding-minimising bucket edges."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_CANDIDATES = 1024  # distinct seqlen candidates the bucket-edge DP considers (quantiles beyond)


@dataclass(frozen=True)
class Budget:
    """Cost of a padded microbatch: ``B*T`` (+ ``A*B*T^2`` with ``--attention-cost A``), bounded by
    ``max_tokens``; ``max_samples`` caps B."""

    max_tokens: int | None
    max_samples: int | None = None
    attention_cost: float = 0.0

    def cost(self, batch, seqlen) -> np.ndarray:
        b = np.asarray(batch, dtype=np.int64)
        t = np.asarray(seqlen, dtype=np.int64)
        if self.attention_cost:
            bf, tf = b.astype(np.float64), t.astype(np.float64)
            return bf * tf + self.attention_cost * bf * tf * tf
        return b * t

    def fits(self, batch, seqlen) -> np.ndarray:
        if self.max_tokens is None:
            ok = np.ones(np.broadcast(np.asarray(batch), np.asarray(seqlen)).shape, dtype=bool)
        else:
            ok = self.cost(batch, seqlen) <= self.max_tokens
        if self.max_samples is not None:
            ok &= np.asarray(batch) <= self.max_samples
        return ok

    def cap(self, seqlen) -> np.ndarray:
        """The most samples a microbatch of seqlen T may hold (0: not even one fits)."""
        t = np.asarray(seqlen)
        if t.ndim == 1 and len(t) > 4096 and t.dtype.kind in "iu":
            hi = int(t.max()) if len(t) else 0
            if 0 <= int(t.min()) and hi <= max(1 << 20, len(t) // 4):
                table = self._cap(np.arange(hi + 1, dtype=np.int64))  # a table: one division per T
                if int(table.max()) < 1 << 31:  # int32 result: 4 bytes a sample
                    table = table.astype(np.int32)
                return table[t]
        return self._cap(t.astype(np.int64, copy=False))

    def _cap(self, t: np.ndarray) -> np.ndarray:
        if self.max_tokens is None:
            c = np.full(t.shape, np.iinfo(np.int64).max // 4, dtype=np.int64)
        elif self.attention_cost:
            tf = np.maximum(t, 1).astype(np.float64)
            c = np.floor(self.max_tokens / (tf + self.attention_cost * tf * tf)).astype(np.int64)
            c = np.maximum(c, 0)
            # float rounding: step down where the exact check fails, up where one more still fits
            c -= (self.cost(c, t) > self.max_tokens) & (c > 0)
            c += self.cost(c + 1, t) <= self.max_tokens
        else:
            c = self.max_tokens // np.maximum(t, 1)
        if self.max_samples is not None:
            c = np.minimum(c, self.max_samples)
        return c


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
