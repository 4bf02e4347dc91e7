"""The best-fit decreasing (BFD) engine of :mod:`varlen_cli.plan.packing`: exact, vectorised by
distinct length.

* Items are taken in decreasing length (ties in input order). All items of one length ``L`` are
  placed together: best fit puts an item in the open row with the smallest remaining space
  ``r >= L``; after that the row's space is ``r - L``, still the smallest that fits, so best fit
  for equal items means *walk the rows in increasing remaining space, giving each row
  ``min(r // L, free slots)`` items* until the items run out, then open new rows holding
  ``min(seq_len // L, max_per_row)`` items each. That is what :func:`bfd` does, so the result is
  the textbook BFD packing (ties between rows of equal space broken deterministically).
* Open rows are kept in buckets by remaining space (a stack of row-id arrays per value of ``r``,
  plus a sorted list of non-empty buckets). Each step works on whole numpy arrays of row ids: the
  Python loop runs once per distinct length and per bucket touched, never per sample. A row that
  is full (``r == 0``) or has ``max_per_row`` samples leaves the buckets.
* Cost: O(N) radix sort of the lengths (int16 when they fit) plus O(D log T + N) for the
  placement, D <= seq_len distinct lengths (see ``benchmarks/packing.md``).

This module imports only numpy.
"""

from __future__ import annotations

import bisect

import numpy as np

NO_CAP = np.iinfo(np.int64).max // 4


# ---- best-fit decreasing -----------------------------------------------------------------------

class _Buckets:
    """Open rows grouped by remaining space: a stack of row-id arrays per space value."""

    __slots__ = ("stacks", "keys")

    def __init__(self):
        self.stacks: dict = {}
        self.keys: list = []  # sorted spaces with a non-empty stack

    def push(self, space: int, rows: np.ndarray) -> None:
        st = self.stacks.get(space)
        if st is None:
            self.stacks[space] = [rows]
            bisect.insort(self.keys, space)
        else:
            st.append(rows)

    def push_many(self, rows: np.ndarray, space: np.ndarray) -> None:
        if not len(rows):
            return
        if space[0] == space[-1] and (len(space) < 3 or bool(np.all(space == space[0]))):
            self.push(int(space[0]), rows)
            return
        o = np.argsort(space, kind="stable")
        rows, space = rows[o], space[o]
        cut = np.flatnonzero(np.diff(space)) + 1
        lo = 0
        for hi in list(cut) + [len(space)]:
            self.push(int(space[lo]), rows[lo:hi])
            lo = hi

    def pop(self, space: int, n: int) -> np.ndarray:
        """Up to n row ids from the stack of ``space`` (the caller removes an emptied key)."""
        st = self.stacks[space]
        a = st[-1]
        if len(a) > n:
            st[-1] = a[: len(a) - n]
            return a[len(a) - n:]
        st.pop()
        if len(a) == n or not st:
            return a
        parts, n = [a], n - len(a)
        while n > 0 and st:
            a = st[-1]
            if len(a) > n:
                st[-1] = a[: len(a) - n]
                parts.append(a[len(a) - n:])
                n = 0
            else:
                st.pop()
                parts.append(a)
                n -= len(a)
        return np.concatenate(parts)


def order_desc(lens: np.ndarray) -> np.ndarray:
    """Indices of ``lens`` by decreasing value, ties in index order (numpy's stable sort is a radix
    sort for 16-bit integers: several times faster than on int64, so lengths that fit use it)."""
    if len(lens) and int(lens.max()) <= np.iinfo(np.int16).max:
        return np.argsort(-lens.astype(np.int16), kind="stable")
    return np.argsort(-lens, kind="stable")


def bfd(lens: np.ndarray, seq_len: int, cap: int, init_used: np.ndarray | None = None,
         init_space: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Best-fit decreasing of positive lengths <= seq_len into rows with at most ``cap`` items.

    ``init_used``/``init_space``: rows already open (items in them, space left), numbered first.
    Returns ``(order, row, num_rows)``: ``order`` is the placement order (indices into ``lens``,
    decreasing length, ties by index) and ``row[i]`` the row of item ``order[i]``; rows are numbered
    in the order they were opened.
    """
    n = len(lens)
    order = order_desc(lens)
    row_of = np.empty(n, dtype=np.int64)
    r0 = 0 if init_used is None else len(init_used)
    if n == 0:
        return order, row_of, r0
    sl = lens[order]
    cut = np.flatnonzero(np.diff(sl)) + 1
    starts = np.concatenate(([0], cut)).tolist()
    ends = np.concatenate((cut, [n])).tolist()
    glens = sl[starts].tolist()
    used = np.zeros(n + r0, dtype=np.int64)  # items per row
    nrows = r0
    buckets = _Buckets()
    if r0:
        used[:r0] = init_used
        ok = (init_space > 0) & (init_used < cap)
        buckets.push_many(np.flatnonzero(ok), init_space[ok])
    keys = buckets.keys
    for L, s, e in zip(glens, starts, ends):
        need, pos = e - s, s
        pending = []
        i = bisect.bisect_left(keys, L)
        while need and i < len(keys):
            r = keys[i]
            k = r // L
            stack = buckets.stacks[r]
            while need and stack:
                rows = buckets.pop(r, -(-need // k))
                if cap >= NO_CAP:
                    take = np.full(len(rows), k, dtype=np.int64)
                else:
                    take = np.minimum(k, cap - used[rows])
                total = int(take.sum())
                if total > need:
                    cs = np.cumsum(take)
                    q = int(np.searchsorted(cs, need, side="left"))
                    if q + 1 < len(rows):
                        stack.append(rows[q + 1:])
                    rows, take = rows[: q + 1], take[: q + 1].copy()
                    take[-1] -= int(cs[q]) - need
                    total = need
                row_of[pos:pos + total] = np.repeat(rows, take)
                pos += total
                need -= total
                used[rows] += take
                pending.append((rows, r - take * L))
            if not stack:
                del buckets.stacks[r]
                keys.pop(i)
            else:
                i += 1
        if need:
            per = min(seq_len // L, cap)
            nb = -(-need // per)
            rows = np.arange(nrows, nrows + nb, dtype=np.int64)
            nrows += nb
            take = np.full(nb, per, dtype=np.int64)
            take[-1] = need - per * (nb - 1)
            row_of[pos:pos + need] = np.repeat(rows, take)
            used[rows] = take
            pending.append((rows, seq_len - take * L))
        for rows, space in pending:
            keep = space > 0
            if cap < NO_CAP:
                keep &= used[rows] < cap
            if not keep.all():
                rows, space = rows[keep], space[keep]
            buckets.push_many(rows, space)
    return order, row_of, nrows


def min_rows(lens: np.ndarray, seq_len: int, cap: int) -> int:
    if not len(lens):
        return 0
    bound = max(-(-int(lens.sum()) // seq_len), int(np.count_nonzero(2 * lens > seq_len)), 1)
    return bound if cap >= NO_CAP else max(bound, -(-len(lens) // cap))
