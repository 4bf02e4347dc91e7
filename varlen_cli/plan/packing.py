"""Padding-free packing: samples concatenated into rows of exactly ``seq_len`` tokens.

:func:`pack` assigns every sample (or every chunk of a too-long sample, with ``split_long``) to a
row of ``seq_len`` tokens so that as few rows as possible are needed, optionally with at most
``max_per_row`` samples in a row. The result, a :class:`Packing`, lists the items row by row; the
planner groups rows into microbatches of R rows and the loader (:mod:`varlen_cli.loader.packed`)
rebuilds them into ``input_ids``, ``position_ids`` and ``cu_seqlens``.

Algorithm: global best-fit decreasing (BFD), exact, vectorised by distinct length.

* Items are taken in decreasing length (ties in input order). All items of one length ``L`` are
  placed together: best fit puts an item in the open row with the smallest remaining space
  ``r >= L``; after that the row's space is ``r - L``, still the smallest that fits, so best fit
  for equal items means *walk the rows in increasing remaining space, giving each row
  ``min(r // L, free slots)`` items* until the items run out, then open new rows holding
  ``min(seq_len // L, max_per_row)`` items each. That is what the code does, so the result is the
  textbook BFD packing (ties between rows of equal space broken deterministically).
* Open rows are kept in buckets by remaining space (a stack of row-id arrays per value of ``r``,
  plus a sorted list of non-empty buckets). Each step works on whole numpy arrays of row ids: the
  Python loop runs once per distinct length and per bucket touched, never per sample. A row that
  is full (``r == 0``) or has ``max_per_row`` samples leaves the buckets.
* Cost: O(N) radix sort of the lengths (int16 when they fit) plus O(D log T + N) for the
  placement, D <= seq_len distinct lengths (see ``benchmarks/packing.md``).

Under ``max_per_row`` (K), plain BFD fills rows with a few long items and leaves the shortest ones
to the last rows, hundreds per row. :func:`_cap_aware` is a cardinality-aware packer built from
the same vectorised pieces, for R = the lower bound on rows:

1. :func:`_split_short` picks ``l0``: items ``<= l0`` are short; each row's fair share of them is
   ``c`` items and ``g`` tokens. ``l0`` is the smallest length for which a row of nothing but the
   shortest long items (BFD's crowded last rows) plus ``c`` short ones stays
   :data:`CAP_MARGIN` of K under K.
2. :func:`_reserved_bfd`: exact BFD of the long items into R pre-opened rows of ``T - g`` tokens
   with at most ``K - c`` items; rows it opens past R go to the short items.
3. :func:`_fill_short`: the short items, decreasing, dealt layer by layer (one numpy pass per
   layer, about ``c`` layers): every row with space and a free slot takes one item, the longest
   to the rows that need the most tokens per free slot; BFD's half-empty rows first.
4. Exact finish: the shortest items (:data:`HOLD_BACK_ROWS` per row) skip step 3 and keep a
   slot, :func:`_pull_back` takes the last dealt items of rows not exactly full back, and capped
   BFD places them all into the gaps.
5. Overflow: items that found no row with both space and a free slot (gaps left in rows at the
   cap, or gaps too short) come back in :func:`_rehome`: exact swaps move those gaps to rows with
   free slots, and capped BFD places the items again (up to :data:`REHOME_PASSES` passes).

:func:`_pack_positive` packs without the cap first and keeps that when it meets the cap. Else it
tries candidates until one is within :data:`SLACK` (0.03%) of the bound, keeping the fewest rows:
when the cap is loose (:data:`LOOSE_CAP`) or BFD's excess over it small (:data:`REPAIR_SHARE`),
the vectorised chunk swaps of :func:`_uncrowd` (BFD's rows kept, or nothing), then, for a small
excess, the exact-size swap repair of BFD (:func:`_repair_cap`, a Python loop per swap); then
:func:`_cap_aware`, BFD with the excess
spilled (:func:`_spill`), capped BFD, the repair on small inputs, the windowed packing
(:func:`_windowed`, moderate excess) and, more than :data:`LAST_RESORT` off, :func:`_dealt_search`.

Orders: ``"shuffle"`` packs globally and emits rows in a seeded random order (BFD creates long-first
rows; shuffling removes that bias); ``"curriculum"`` packs consecutive windows of the input order
(the input is sorted by difficulty) and emits each window's rows ordered by their samples' mean
input position, so difficulty still rises row by row; the few least-filled rows of a window are
not emitted but handed on to the next window. Without an explicit ``window`` it starts at
:data:`CURRICULUM_WINDOW_ROWS` rows' worth of samples and grows x8 until efficiency is within 0.1%
of the bound -- up to the whole dataset when difficulty is the length (windows of similar lengths
cannot fill rows). ``"none"`` emits rows in the order they were opened.

Zero-length samples take no tokens but count as samples: each appears exactly once, in the row(s)
with the fewest samples (respecting ``max_per_row``); rows are only opened for them when no row has a
free slot. The loader gives them no ``cu_seqlens`` segment.

This module imports only numpy (and :mod:`varlen_cli.errors`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError, UsageError

ORDERS = ("shuffle", "curriculum", "none")
NO_CAP = np.iinfo(np.int64).max // 4
CURRICULUM_WINDOW_ROWS = 2048
"""Default curriculum window: about this many rows' worth of samples (efficiency >= 99.9% on the
benchmarked distributions, while difficulty still rises every ~2k rows)."""


@dataclass
class Packing:
    """Items (samples or chunks of samples) assigned to rows of ``seq_len`` tokens.

    Items are sorted by ``(item_row, position in row)``; a row is the concatenation of its items,
    each item being tokens ``[item_start, item_start + item_length)`` of input sample
    ``item_sample`` (a position in the input arrays, not a sample_id). What is left of a row up
    to ``seq_len`` is padding.
    """

    item_sample: np.ndarray  # int64 input position per item
    item_start: np.ndarray  # int64 first token of the sample this item holds (0 unless split)
    item_length: np.ndarray  # int64 tokens of the item
    item_row: np.ndarray  # int64 row of each item, non-decreasing
    num_rows: int
    seq_len: int
    dropped: np.ndarray  # int64 input positions dropped as too long (drop_long)
    max_per_row: int | None = None
    order: str = "none"
    num_samples: int = 0  # input samples (including dropped ones)
    num_split: int = 0  # input samples cut into several chunks (split_long)
    window: int | None = None  # curriculum window in samples
    seconds: float = 0.0
    _offsets: np.ndarray | None = field(default=None, repr=False, compare=False)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def num_items(self) -> int:
        return int(len(self.item_sample))

    @property
    def tokens(self) -> int:
        """Real tokens in all rows."""
        return int(self.item_length.sum())

    @property
    def efficiency(self) -> float:
        """Real tokens / (rows x seq_len); 1.0 for an empty packing."""
        return self.tokens / (self.num_rows * self.seq_len) if self.num_rows else 1.0

    @property
    def min_rows(self) -> int:
        """A lower bound on the rows any packing needs: tokens / seq_len, items longer than half a
        row (two never share one), and samples / max_per_row."""
        if not self.num_items:
            return 0
        big = int(np.count_nonzero(2 * self.item_length > self.seq_len))
        cap = -(-self.num_items // self.max_per_row) if self.max_per_row else 1
        return max(-(-self.tokens // self.seq_len), big, cap, 1)

    @property
    def efficiency_bound(self) -> float:
        """The efficiency of :attr:`min_rows` rows: no packing of these items can do better."""
        return self.tokens / (self.min_rows * self.seq_len) if self.min_rows else 1.0

    # ---- per row ---------------------------------------------------------------------------
    def row_offsets(self) -> np.ndarray:
        """CSR offsets: items of row ``r`` are ``offsets[r]:offsets[r + 1]`` (length num_rows + 1)."""
        if self._offsets is None:
            self._offsets = np.searchsorted(self.item_row, np.arange(self.num_rows + 1), side="left").astype(np.int64)
        return self._offsets

    def samples_per_row(self) -> np.ndarray:
        return np.diff(self.row_offsets())

    def row_tokens(self) -> np.ndarray:
        return np.bincount(self.item_row, weights=self.item_length, minlength=self.num_rows).astype(np.int64)

    def item_offset(self) -> np.ndarray:
        """First position of each item inside its row."""
        csum = np.cumsum(self.item_length) - self.item_length
        return csum - csum[self.row_offsets()[self.item_row]] if self.num_items else csum

    def stats(self) -> dict:
        """Summary statistics (JSON-serialisable) for the plan metadata and the summary table."""
        spr = self.samples_per_row()
        return {
            "seq_len": self.seq_len,
            "max_per_row": self.max_per_row,
            "order": self.order,
            "window": self.window,
            "rows": self.num_rows,
            "items": self.num_items,
            "samples": self.num_samples,
            "tokens": self.tokens,
            "efficiency": self.efficiency,
            "efficiency_bound": self.efficiency_bound,
            "min_rows": self.min_rows,
            "samples_per_row_mean": float(spr.mean()) if len(spr) else 0.0,
            "samples_per_row_max": int(spr.max()) if len(spr) else 0,
            "split_samples": self.num_split,
            "dropped": int(len(self.dropped)),
            "seconds": self.seconds,
        }


# ---- validation --------------------------------------------------------------------------------

def _check_args(lengths, seq_len, max_per_row, order, split_long, drop_long, window) -> np.ndarray:
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise UsageError(f"--seq-len must be a positive integer, got {seq_len!r}")
    if max_per_row is not None and (isinstance(max_per_row, bool) or not isinstance(max_per_row, (int, np.integer))
                                    or max_per_row < 1):
        raise UsageError(f"--max-per-row must be a positive integer, got {max_per_row!r}")
    if order not in ORDERS:
        raise UsageError(f"unknown packing order {order!r} (expected one of: {', '.join(ORDERS)})")
    if split_long and drop_long:
        raise UsageError("--split-long and --drop-long are mutually exclusive")
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise UsageError(f"packing window must be a positive number of samples, got {window!r}")
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise InputError(f"sample lengths must be a 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iub":
        if arr.size and arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.floor(arr)):
            pass
        elif arr.size:
            raise InputError(f"sample lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        neg = int(np.count_nonzero(arr < 0))
        raise InputError(f"{neg:,} sample length(s) are negative (smallest: {int(arr.min()):,})")
    return arr


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


def _order_desc(lens: np.ndarray) -> np.ndarray:
    """Indices of ``lens`` by decreasing value, ties in index order (numpy's stable sort is a radix
    sort for 16-bit integers: several times faster than on int64, so lengths that fit use it)."""
    if len(lens) and int(lens.max()) <= np.iinfo(np.int16).max:
        return np.argsort(-lens.astype(np.int16), kind="stable")
    return np.argsort(-lens, kind="stable")


def _bfd(lens: np.ndarray, seq_len: int, cap: int, init_used: np.ndarray | None = None,
         init_space: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Best-fit decreasing of positive lengths <= seq_len into rows with at most ``cap`` items.

    ``init_used``/``init_space``: rows already open (items in them, space left), numbered first.
    Returns ``(order, row, num_rows)``: ``order`` is the placement order (indices into ``lens``,
    decreasing length, ties by index) and ``row[i]`` the row of item ``order[i]``; rows are numbered
    in the order they were opened.
    """
    n = len(lens)
    order = _order_desc(lens)
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


def _deal_then_bfd(lens: np.ndarray, seq_len: int, cap: int, nrows: int, rounds: int):
    """Cap-aware packing: open ``nrows`` rows, deal the ``rounds * nrows`` longest items to them
    layer by layer (each layer's longest item to the least-loaded row, skipping items that do not
    fit), then best-fit the rest (decreasing) into the space left, opening rows only if needed.
    Every row gets the same share of long items and keeps space *and* free slots for the short
    ones, which plain BFD gives away: it fills rows with a few long items and leaves the short
    ones to rows of their own that hit the cap long before they are full."""
    n = len(lens)
    order = np.argsort(-lens, kind="stable")
    load = np.zeros(nrows, dtype=np.int64)
    used = np.zeros(nrows, dtype=np.int64)
    row_of = np.full(n, -1, dtype=np.int64)
    for j in range(0, min(n, rounds * nrows), nrows):
        idx = order[j:j + nrows]
        L = lens[idx]
        rs = np.argsort(load, kind="stable")[: len(idx)]
        ok = (load[rs] + L <= seq_len) & (used[rs] < cap)
        row_of[idx[ok]] = rs[ok]
        load[rs[ok]] += L[ok]
        used[rs[ok]] += 1
    dealt = row_of >= 0
    first = order[dealt[order]]  # dealt items, in dealing order (longest first)
    rest = np.flatnonzero(~dealt)
    o, r, total = _bfd(lens[rest], seq_len, cap, used, seq_len - load)
    return np.concatenate((first, rest[o])), np.concatenate((row_of[first], r)), total


def _find_swap(lens: np.ndarray, mine: list, pos: int, jtop: int, maxlen: int, find):
    """For :func:`_repair_cap`: ``(j, k, donor)``, the largest ``j <= jtop`` such that the ``j - 1``
    shortest items of ``mine[pos:]`` plus item ``mine[k]`` have exactly the length of a donor item
    (``find``), or None."""
    for j in range(jtop, 1, -1):
        if pos + j > len(mine):
            continue
        base = int(lens[mine[pos:pos + j - 1]].sum())
        # the j-1 shortest left plus one more, tried from the next shortest upward
        for k in range(pos + j - 1, min(len(mine), pos + j + 15)):
            total = base + int(lens[mine[k]])
            if total > maxlen:
                break
            d = find(total, j - 1)
            if d >= 0:
                return j, k, d
    return None


def _repair_cap(lens: np.ndarray, cap: int, order: np.ndarray, row: np.ndarray, nrows: int):
    """Bring an uncapped packing under ``cap`` samples per row by exact-size swaps, keeping every
    row's tokens: in a row over the cap, ``j`` of its short items (``s`` tokens in all) trade places
    with one item of exactly ``s`` tokens from a row with ``j - 1`` free slots. Each swap lowers
    the crowded row's count by ``j - 1`` and changes no row's tokens, so the packing keeps BFD's
    row count. The loop runs once per swap (crowded rows are the few that collected the shortest
    samples). Returns ``(order, row)``, or None if some row cannot be fixed this way."""
    n = len(lens)
    item_row = np.empty(n, dtype=np.int64)
    item_row[order] = row
    counts = np.bincount(item_row, minlength=nrows).astype(np.int64)
    over = np.flatnonzero(counts > cap)
    if not len(over):
        return order, row
    avg = n / max(nrows, 1)
    if cap - avg < 1:
        return None
    jmax = int(max(2, cap - math.ceil(avg)))  # items moved out per swap, at most
    free = cap - counts
    crowded = np.zeros(nrows, dtype=bool)
    crowded[over] = True
    # donors: items of uncrowded rows with a free slot, grouped by length (cursor per length)
    donor = np.flatnonzero(~crowded[item_row] & (free[item_row] >= 1))
    donor = donor[np.argsort(lens[donor], kind="stable")]
    maxlen = int(lens.max())
    first = np.searchsorted(lens[donor], np.arange(maxlen + 2), side="left")
    cursor = first[:-1].copy()
    end = first[1:]
    donor_l = donor.tolist()

    def find(s: int, need: int) -> int:
        """A donor item of exactly s tokens whose row has ``need`` free slots, or -1."""
        c, stop = int(cursor[s]), int(end[s])
        while c < stop and (free[item_row[donor_l[c]]] < 1 or crowded[item_row[donor_l[c]]]):
            c += 1  # rows without a free slot never give again
        cursor[s] = c
        for k in range(c, min(stop, c + 16)):
            d = donor_l[k]
            if free[item_row[d]] >= need and not crowded[item_row[d]]:
                donor_l[k], donor_l[c] = donor_l[c], donor_l[k]
                cursor[s] = c + 1
                return d
        return -1

    # give up early when swaps make slow progress (small groups): the fallback is cheaper then
    budget = 4 * int((counts[over] - cap).sum()) // max(1, jmax - 1) + 100
    for r in over.tolist():
        mine = np.flatnonzero(item_row == r)
        mine = mine[np.argsort(lens[mine], kind="stable")].tolist()  # shortest first
        pos = 0
        while counts[r] > cap:
            hit = _find_swap(lens, mine, pos, min(int(counts[r] - cap) + 1, jmax), maxlen, find)
            if hit is None:
                return None
            j, k, d = hit
            budget -= 1
            if budget < 0:
                return None
            group = mine[pos:pos + j - 1] + [mine[k]]
            dr = int(item_row[d])
            item_row[group] = dr
            item_row[d] = r
            counts[r] -= j - 1
            counts[dr] += j - 1
            free[r] += j - 1
            free[dr] -= j - 1
            del mine[k]
            del mine[pos:pos + j - 1]  # the donor now sits in r; it is never moved out again
    o2 = order[np.argsort(item_row[order], kind="stable")]
    return o2, item_row[o2]


UNCROWD_ROUNDS = 16
"""Swap fix-up of uncapped BFD (:func:`_uncrowd`): at most this many vectorised rounds."""
UNCROWD_CHUNKS = (0.5, 0.5, 0.9, 0.2, 0.7, 0.1, 0.4, 0.95, 0.3, 0.6, 0.05, 0.8, 0.45, 0.15, 0.65, 0.25)
"""Chunk sizes of :func:`_uncrowd`'s rounds, as fractions of the free slots per row (cap - mean):
varied so that chunks left without a donor of their length get other sums."""
UNCROWD_STALL = 6
"""Swap fix-up: stop after this many rounds in a row that swapped nothing."""


def _uncrowd(lens: np.ndarray, seq_len: int, cap: int, free):
    """Bring uncapped BFD ``free = (order, row, num_rows)`` under ``cap`` items per row by exact
    swaps, vectorised: every row over the cap cuts its shortest surplus items into chunks of
    ``q + 1`` items (``s`` tokens each); a chunk trades places with one item of exactly ``s``
    tokens from a row with ``q`` free slots (one swap per such row and round). No row's tokens
    change, so the row count stays BFD's (at or next to the bound when BFD is). One numpy pass per
    round; the chunk size shrinks each round so that chunks without a donor get other sums.
    Rows left over the cap give their surplus to :func:`_uncrowd_rest`. Returns ``(order, row,
    num_rows)`` with BFD's rows, or None when it cannot keep them."""
    order, row, nrows = free
    n = len(lens)
    item_row = np.empty(n, dtype=np.int64)
    item_row[order] = row
    counts = np.bincount(item_row, minlength=nrows).astype(np.int64)
    over = counts > cap
    if not over.any():
        return free
    room = cap - math.ceil(n / max(nrows, 1))
    if room < 2:
        return None
    ol = lens[order]
    crowd = np.flatnonzero(over[row])  # positions in placement order of the crowded rows' items
    top = room * int(ol[crowd].max())
    # BFD's placement order is by decreasing length, the copies of a length that share a row next
    # to each other: one donor per (length, row) without a sort, read backwards (increasing length)
    pos = np.flatnonzero(np.r_[True, (row[1:] != row[:-1]) | (ol[1:] != ol[:-1])])[::-1]
    pos = pos[(ol[pos] <= top) & (counts[row[pos]] < cap)]
    # by length, the rows with the most free slots first: two stable radix sorts (16 bits)
    small = top <= np.iinfo(np.int16).max and cap <= np.iinfo(np.int16).max
    c = counts[row[pos]]
    pos = pos[np.argsort(c.astype(np.int16) if small else c, kind="stable")]
    pos = pos[np.argsort(ol[pos].astype(np.int16) if small else ol[pos], kind="stable")]
    dn = order[pos]
    bounds = np.searchsorted(ol[pos], np.arange(top + 2), side="left")
    nxt, end = bounds[:-1].copy(), bounds[1:]
    gap = seq_len - np.bincount(row, weights=ol, minlength=nrows).astype(np.int64)
    # the crowded rows' items by (row, length), sorted once (the rounds only filter it): two stable
    # radix sorts when the crowded rows and the lengths fit in 16 bits
    dense = np.cumsum(over) - 1
    by_len, by_row = ol[crowd], dense[row[crowd]]
    if small and int(dense[-1]) <= np.iinfo(np.int16).max:
        by_len, by_row = by_len.astype(np.int16), by_row.astype(np.int16)
    k = np.argsort(by_len, kind="stable")
    crowd, by_row = crowd[k], by_row[k]
    crowd = order[crowd[np.argsort(by_row, kind="stable")]]
    left, stalled = int((counts - cap)[over].sum()), 0
    for t in range(UNCROWD_ROUNDS):
        if not left or stalled >= UNCROWD_STALL:
            break
        crowd = _uncrowd_round(lens, cap, item_row, counts, gap, over,
                               max(1, int(room * UNCROWD_CHUNKS[t % len(UNCROWD_CHUNKS)])), dn, nxt, end, crowd)
        over = counts > cap
        now = int((counts - cap)[over].sum())
        stalled = stalled + 1 if now == left else 0
        left = now
    if left and not _uncrowd_rest(lens, seq_len, cap, item_row, counts, over):
        return None
    return order, item_row[order], nrows


UNCROWD_REHOME_ROWS = 32768
""":func:`_uncrowd_rest` hands :func:`_rehome` the rows with space left plus at least this many others..."""
UNCROWD_REHOME_PASSES = 8
"""... for at most this many passes (each cheap on the sample)."""


def _uncrowd_rest(lens, seq_len, cap, item_row, counts, over) -> bool:
    """The rows still over the cap after :func:`_uncrowd`'s swaps (chunks whose sums no donor
    matches: rows of the tiniest items) hand their shortest surplus items to capped BFD into the
    gaps, then to the gap moving of :func:`_rehome`, on a sample of the rows: the rows with space
    left and every k-th other one (:data:`UNCROWD_REHOME_ROWS` or more). Updates ``item_row`` and
    returns True when no row had to be opened (else leaves ``item_row`` as it was: False)."""
    nrows = len(counts)
    ci = np.flatnonzero(over[item_row])
    ci = ci[np.lexsort((lens[ci], item_row[ci]))]
    r = item_row[ci]
    out = ci[np.arange(len(ci)) - np.searchsorted(r, r, side="left") < (counts - cap)[r]]
    load = np.bincount(item_row, weights=lens, minlength=nrows).astype(np.int64)
    if int(lens[out].sum()) > nrows * seq_len - int(load.sum()):
        return False  # more than the space left in all rows
    load -= np.bincount(item_row[out], weights=lens[out], minlength=nrows).astype(np.int64)
    used = counts - np.bincount(item_row[out], minlength=nrows)
    pick = load < seq_len
    pick[:: max(1, nrows // UNCROWD_REHOME_ROWS)] = True
    rows = np.flatnonzero(pick)
    remap = np.full(nrows, -1, dtype=np.int64)
    remap[rows] = np.arange(len(rows))
    stay = np.ones(len(lens), dtype=bool)
    stay[out] = False
    sub = np.flatnonzero(pick[item_row] & stay)
    o, rr, total = _bfd(lens[out], seq_len, cap, used[rows], seq_len - load[rows])
    order, row = np.concatenate((sub, out[o])), np.concatenate((remap[item_row[sub]], rr))
    for _ in range(UNCROWD_REHOME_PASSES):
        if total <= len(rows):
            break
        order, row, total = _rehome(lens, order, row, total, len(rows), seq_len, cap)
    if total > len(rows):
        return False
    item_row[order] = rows[row]
    return True


def _uncrowd_round(lens, cap, item_row, counts, gap, over, q, dn, nxt, end, ci):
    """One round of :func:`_uncrowd`'s swaps with chunks of ``q + 1`` items (updates ``item_row``,
    ``counts``, ``gap`` (space left per row) and the donors' cursors ``nxt`` in place). ``ci``: the
    items of the rows first over the cap, by (row, length); the items that left them are skipped
    (returned: the list for the next round). The first chunk of a row with space left may take the
    next longer donor that still fits."""
    ci = ci[over[item_row[ci]]]  # the items still in crowded rows, by (row, length)
    kept = ci
    r = item_row[ci]
    rank = np.arange(len(ci)) - np.searchsorted(r, r, side="left")
    crowded = np.flatnonzero(over)
    j = np.searchsorted(crowded, r)  # crowded row of each item
    surplus = counts[crowded] - cap
    chunks = -(-surplus // q)
    first_chunk = np.cumsum(chunks) - chunks
    take = rank < surplus[j] + chunks[j]  # (q + 1) items per chunk, the last one smaller
    ci, j, rank = ci[take], j[take], rank[take]
    cid = first_chunk[j] + np.minimum(rank // (q + 1), chunks[j] - 1)
    nchunks = int(chunks.sum())
    need = np.bincount(cid, weights=lens[ci], minlength=nchunks).astype(np.int64)  # tokens of each chunk
    size = np.bincount(cid, minlength=nchunks)
    chunk_row = np.repeat(crowded, chunks)
    # a row with space left may take a donor longer than its first chunk (up to the space)
    want = need.copy()
    lead = first_chunk[(gap[crowded] > 0) & (need[first_chunk] < len(nxt))]
    top = len(nxt)
    nearest = np.minimum.accumulate(np.where(nxt < end, np.arange(top), top)[::-1])[::-1]
    longer = nearest[need[lead]]
    ok = longer <= need[lead] + gap[chunk_row[lead]]
    want[lead[ok]] = longer[ok]
    ks = np.flatnonzero((want < top) & (size > 1))
    ks = ks[np.argsort(want[ks], kind="stable")]
    sk = want[ks]
    idx = nxt[sk] + np.arange(len(ks)) - np.searchsorted(sk, sk, side="left")  # k-th unused donor
    hit = np.flatnonzero(idx < end[sk])
    np.add.at(nxt, sk[hit], 1)  # a donor looked at is used up
    ks, d = ks[hit], dn[idx[hit]]
    dr = item_row[d]
    fits = np.flatnonzero(counts[dr] + size[ks] - 1 <= cap)
    once = fits[np.unique(dr[fits], return_index=True)[1]]  # one swap per donor row and round
    ks, d, dr = ks[once], d[once], dr[once]
    target = np.full(len(need), -1, dtype=np.int64)
    target[ks] = dr
    moving = target[cid] >= 0
    item_row[ci[moving]] = target[cid[moving]]
    item_row[d] = chunk_row[ks]
    np.add.at(counts, chunk_row[ks], 1 - size[ks])
    counts[dr] += size[ks] - 1
    extra = want[ks] - need[ks]
    np.subtract.at(gap, chunk_row[ks], extra)
    gap[dr] += extra
    return kept


def _min_rows(lens: np.ndarray, seq_len: int, cap: int) -> int:
    if not len(lens):
        return 0
    bound = max(-(-int(lens.sum()) // seq_len), int(np.count_nonzero(2 * lens > seq_len)), 1)
    return bound if cap >= NO_CAP else max(bound, -(-len(lens) // cap))


SLACK = 0.0003
"""A capped packing within this fraction of the lower bound on rows (efficiency >= 99.97% of the
best possible) is good enough: no other candidate is tried."""

LAST_RESORT = 0.001
"""The dealt search (slowest candidate) runs only when the others end more than this fraction
above the lower bound."""
LAST_RESORT_MAX_ITEMS = 250_000
"""On at most this many items the swap repair is always among the candidates."""
WINDOWED_SHARE = 0.2
"""The windowed packing is a candidate when uncapped BFD exceeds the cap by at most this share of
the items (beyond it the windows fail too, slowly)."""
TINY_SHARE = 0.2
"""Under a cap K the cap-aware packer runs before anything else when more than this share of the
items are shorter than T / K."""
LOOSE_CAP = 4.0
"""A cap at least this multiple of the mean items per row (at the bound) is loose: it binds only in
BFD's last rows, so uncapped BFD and the swap fix-up (:func:`_uncrowd`) come first."""
REPAIR_SHARE = 0.05
"""The swap repair (a Python loop per swap) comes first when uncapped BFD exceeds the cap by at
most this share of the items in all."""

CAP_MARGIN = 0.2
"""Cap-aware packer: the short items are chosen so that a crowded row of long items plus a fair
share of short ones stays this fraction of the cap (at least 2) under it: slots for the final fit."""
HOLD_BACK_ROWS = 1.0
"""Cap-aware packer: up to this many of the shortest items per row (of the shortest length or so)
skip the dealing and go to the final best fit, with a slot kept for them in every row."""
HOLD_BACK_EXTRA = 0
HOLD_BACK_SLOTS = 1
PULL_ITEMS = 4
"""Cap-aware packer: the last (shortest) items dealt to a row that is not exactly full go back
to the final best fit (see :func:`_pull_back`)."""
MAX_FILL_LAYERS = 4096
"""The cap-aware packer deals short items in about (short items / rows) layers, one numpy pass
each; above this many it is not tried (capped BFD alone)."""


def _good_enough(nrows: int, bound: int) -> bool:
    return nrows <= bound + int(SLACK * bound)


def _split_short(lens: np.ndarray, seq_len: int, cap: int, nrows: int) -> tuple[int, int, int]:
    """Choose the short items of the cap-aware packer: lengths <= ``l0``. Returns ``(l0, g, c)``:
    ``g`` tokens and ``c`` slots per row is their fair share over ``nrows`` rows. ``l0`` is the
    smallest length such that a row of the longer items alone (at most ``(T - g) / next length``
    of them, BFD's crowded last rows) plus ``c`` short ones stays 2 under the cap (or the length
    that comes closest)."""
    per_len = np.bincount(lens)
    u = np.flatnonzero(per_len)
    count_le = np.cumsum(per_len)[u]
    tokens_le = np.cumsum(per_len * np.arange(len(per_len)))[u]
    c = -(-count_le // nrows)
    g = tokens_le // nrows
    nxt = np.append(u[1:], seq_len)
    crowd = (seq_len - g) // nxt + c
    ok = np.flatnonzero(crowd <= cap - max(2, int(CAP_MARGIN * cap)))
    j = int(ok[0]) if len(ok) else int(np.argmin(crowd))
    return int(u[j]), int(g[j]), int(c[j])


def _reserved_bfd(lens: np.ndarray, long_: np.ndarray, seq_len: int, reserve: int, cap: int, nrows: int):
    """BFD of the items ``long_`` into ``nrows`` pre-opened rows (more if needed) of ``seq_len -
    reserve`` tokens and at most ``cap`` items: ``reserve`` tokens of every row are kept for the
    short items. Items longer than that each start a row of their own. Returns (items, rows, num_rows)."""
    space = seq_len - reserve
    huge = long_[lens[long_] > space]
    rest = long_[lens[long_] <= space]
    init_used = np.ones(len(huge), dtype=np.int64)
    init_space = np.maximum(space - lens[huge], 0)
    if len(huge) < nrows:
        init_used = np.concatenate((init_used, np.zeros(nrows - len(huge), dtype=np.int64)))
        init_space = np.concatenate((init_space, np.full(nrows - len(huge), space, dtype=np.int64)))
    o, r, total = _bfd(lens[rest], space, cap, init_used, init_space)
    return np.concatenate((huge, rest[o])), np.concatenate((np.arange(len(huge), dtype=np.int64), r)), total


def _fill_short(lens: np.ndarray, queue: np.ndarray, load: np.ndarray, used: np.ndarray, seq_len: int,
                cap: int, big_gap: int):
    """Deal the short items ``queue`` (decreasing length) into the space left in the rows, updating
    ``load``/``used`` in place. Rows left with an unusually big gap (> ``big_gap``: BFD's last,
    half-empty rows) first take the longest short items; then layer by layer every row with space
    and a free slot takes one item, the longest items going to the rows that need the most tokens
    per free slot, so every row's gap and slots run out together. Items that do not fit their row
    wait for the next layer. Returns (items, rows, queue left over)."""
    placed, prow = [], []
    gap, slots = seq_len - load, cap - used
    wide = np.flatnonzero((gap > big_gap) & (slots > 0))
    for r in wide[np.argsort(-gap[wide], kind="stable")].tolist():  # a few rows, not per item
        cs = np.cumsum(lens[queue[: int(slots[r])]])
        k = int(np.searchsorted(cs, gap[r], side="right"))
        if k:
            placed.append(queue[:k])
            prow.append(np.full(k, r, dtype=np.int64))
            load[r] += int(cs[k - 1])
            used[r] += k
            queue = queue[k:]
    active = np.flatnonzero((load < seq_len) & (used < cap))
    least = max(1, len(load) // 512)
    # the queue is retry + queue[p:]: items that did not fit wait in retry (a layer's worth at
    # most), so a layer costs O(rows), not a copy of the whole queue
    retry, p = queue[:0], 0
    while len(retry) + len(queue) - p and len(active):
        m = min(len(active), len(retry) + len(queue) - p)
        fresh = max(0, m - len(retry))
        items = np.concatenate((retry[:m], queue[p:p + fresh]))
        p += fresh
        need = (seq_len - load[active]) / (cap - used[active])
        rows = active[np.argsort(-need, kind="stable")[:m]]
        ok = load[rows] + lens[items] <= seq_len
        placed.append(items[ok])
        prow.append(rows[ok])
        load[rows[ok]] += lens[items[ok]]
        used[rows[ok]] += 1
        retry = np.concatenate((items[~ok], retry[m:]))
        if len(retry) + len(queue) - p:
            last = queue[-1] if p < len(queue) else retry[-1]
            active = active[(seq_len - load[active] >= lens[last]) & (used[active] < cap)]
        if np.count_nonzero(ok) < least:
            break  # the last few items: best fit below
    empty = np.empty(0, dtype=np.int64)
    left = np.concatenate((retry, queue[p:]))
    return np.concatenate(placed) if placed else empty, np.concatenate(prow) if prow else empty, left


def _pull_back(lens, fill, frow, load, used, seq_len, k):
    """Take the last ``k`` dealt items (the shortest) out of every row that is not exactly full,
    updating ``load``/``used``: the final best fit then has a richer choice of sizes for the gaps
    (a gap of 1 token next to a 2-token item left over cannot be filled otherwise)."""
    if not k or not len(fill):
        return fill, frow, np.empty(0, dtype=np.int64)
    cand = np.flatnonzero(load[frow] < seq_len)  # the items of rows not exactly full
    rows = frow[cand]
    small = len(load) <= np.iinfo(np.int16).max  # numpy's stable sort is a radix sort on 16 bits
    by_row = np.argsort(rows.astype(np.int16) if small else rows, kind="stable")
    counts = np.bincount(rows, minlength=len(load))
    from_end = np.empty(len(rows), dtype=np.int64)
    from_end[by_row] = np.repeat(np.cumsum(counts), counts) - 1 - np.arange(len(rows))
    out = cand[from_end < k]
    load -= np.bincount(frow[out], weights=lens[fill[out]], minlength=len(load)).astype(np.int64)
    used -= np.bincount(frow[out], minlength=len(load))
    stay = np.ones(len(fill), dtype=bool)
    stay[out] = False
    return fill[stay], frow[stay], fill[out]


REHOME_PASSES = 3
"""Cap-aware packer: at most this many passes of :func:`_rehome` while rows overflow the bound."""
REHOME_ROUNDS = 64
"""Cap-aware packer: at most this many rounds of gap-moving swaps in :func:`_rehome`."""


def _move_gaps(len_p, row_p, count, gap, cap, lmin, mine, step, donors, nxt, end):
    """One round of :func:`_rehome`'s swaps. ``mine``: positions of the items in the rows whose gap
    moves; each such row trades its shortest item (x tokens) for a donor item of exactly
    ``x + d`` tokens, ``d = min(gap, step)``, from a row with the free slots for ``d`` more tokens
    of items of ``lmin`` (``donors``: positions sorted by length, the unused ones of length L at
    ``nxt[L]:end[L]``): ``d`` tokens of gap move to that row, no row's count changes. Updates
    ``row_p`` and ``gap``; returns the number of swaps."""
    mine = mine[np.lexsort((len_p[mine], row_p[mine]))]
    r = row_p[mine]
    a = mine[np.flatnonzero(np.r_[True, r[1:] != r[:-1]])]  # shortest item of each row
    rr = row_p[a]
    y = len_p[a] + np.minimum(gap[rr], step)
    keep = np.flatnonzero(y < len(nxt))
    keep = keep[np.argsort(y[keep], kind="stable")]
    yk = y[keep]
    idx = nxt[yk] + np.arange(len(keep)) - np.searchsorted(yk, yk, side="left")  # k-th unused donor
    hit = idx < end[yk]
    keep, yk, d = keep[hit], yk[hit], donors[idx[hit]]
    np.add.at(nxt, yk, 1)  # a donor looked at is used up (also one skipped below: plenty are left)
    dr = row_p[d]
    moved = yk - len_p[a[keep]]
    fits = np.flatnonzero((cap - count[dr]) * lmin >= gap[dr] + moved)
    once = fits[np.unique(dr[fits], return_index=True)[1]]  # one swap per donor row and round
    keep, d, dr, moved = keep[once], d[once], dr[once], moved[once]
    row_p[a[keep]] = dr
    row_p[d] = rr[keep]
    gap[rr[keep]] -= moved
    gap[dr] += moved
    return len(keep)


def _rehome(lens, order, row, total, nrows, seq_len, cap):
    """Bring the items of rows ``>= nrows`` (the cap-aware packer's overflow: short items for which
    no row with space had a free slot, or no gap was long enough) back into the first ``nrows``
    rows. The gaps of rows at the cap, and gaps shorter than any homeless item, move by exact swaps
    (a short item for one a few tokens longer, :func:`_move_gaps`) to rows with the free slots to
    fill them; then capped BFD places the homeless items into the gaps. Vectorised: one numpy pass
    per round, each round moving at most ``step`` tokens of every such row's gap. Returns (order,
    row, total), the input if that does not save a row."""
    len_p = lens[order]
    row_p = row.copy()
    home = row_p < nrows
    count = np.bincount(row_p[home], minlength=nrows).astype(np.int64)
    gap = seq_len - np.bincount(row_p[home], weights=len_p[home], minlength=nrows).astype(np.int64)
    lmin = int(len_p[~home].min())
    stuck = np.zeros(max(nrows, int(row_p.max()) + 1), dtype=bool)  # rows whose gap moves on
    stuck[:nrows] = (gap > 0) & ((count >= cap) | (gap < lmin))  # no slot, or too small for any item
    step = max(1, int(cap * nrows - count.sum()) // (2 * nrows)) * lmin  # half the mean free slots
    mine = np.flatnonzero(stuck[row_p])
    shortest = np.full(nrows, seq_len, dtype=np.int64)
    np.minimum.at(shortest, row_p[mine], len_p[mine])
    top = 2 * int(shortest[row_p[mine]].max(initial=0)) + step + 1
    donors = np.flatnonzero((len_p < top) & home)
    roomy = (count < cap - max(0, step // lmin - 1)) & ~stuck[:nrows]  # rows with many free slots
    donors = donors[roomy[row_p[donors]]]
    key = len_p[donors] * (cap + 1) + count[row_p[donors]]  # by length, most free slots first
    donors = donors[np.argsort(key.astype(np.int16) if top * (cap + 1) <= np.iinfo(np.int16).max else key,
                               kind="stable")]
    bounds = np.searchsorted(len_p[donors], np.arange(top + 1), side="left")
    nxt, end = bounds[:-1].copy(), bounds[1:]
    homeless = np.flatnonzero(~home)
    tokens = int(len_p[homeless].sum())
    for _ in range(REHOME_ROUNDS):
        if int(np.minimum(gap, (cap - count) * lmin)[gap >= lmin].sum()) >= tokens:
            break  # room enough for the homeless items where there are slots
        mine = mine[gap[np.minimum(row_p[mine], nrows - 1)] > 0]
        mine = mine[stuck[row_p[mine]]]
        if not len(mine) or not _move_gaps(len_p, row_p, count, gap, cap, lmin, mine, step, donors, nxt, end):
            break
    o, r, new_total = _bfd(len_p[homeless], seq_len, cap, count, gap)
    if new_total >= total:
        return order, row, total
    row_p[homeless[o]] = r
    return order, row_p, new_total


def _cap_aware(lens: np.ndarray, seq_len: int, cap: int, nrows: int):
    """Capped packing near the lower bound ``nrows`` (see the module docstring): short items get a
    fair share of every row, the long ones are best-fit around that share, the short ones then
    fill the gaps. Returns (order, row, num_rows) like :func:`_bfd`, or None when not applicable."""
    l0, g, c = _split_short(lens, seq_len, cap, nrows)
    if c > MAX_FILL_LAYERS:
        return None
    short = np.flatnonzero(lens <= l0)
    long_ = np.flatnonzero(lens > l0)
    first, frow, total = _reserved_bfd(lens, long_, seq_len, g, max(1, cap - c), nrows)
    load = np.bincount(frow, weights=lens[first], minlength=total).astype(np.int64)
    if total > nrows:
        # BFD wasted space: the rows it opened past the bound (its shortest long items) are dealt
        # with the short items instead
        over = frow >= nrows
        short = np.concatenate((short, first[over]))
        first, frow, total = first[~over], frow[~over], nrows
        load = load[:nrows]
    used = np.bincount(frow, minlength=total).astype(np.int64)
    queue = short[_order_desc(lens[short])]
    # the shortest items (HOLD_BACK_ROWS per row at most) are kept for the final best fit, with slots
    held = queue[len(queue) - min(len(queue), int(HOLD_BACK_ROWS * nrows)):]
    held = held[lens[held] <= lens[held[-1]] + HOLD_BACK_EXTRA] if len(held) else held
    queue = queue[: len(queue) - len(held)]
    keep = -(-len(held) // nrows) + HOLD_BACK_SLOTS if len(held) else 0
    fill, frow2, queue = _fill_short(lens, queue, load, used, seq_len, max(1, cap - keep), 2 * (g + l0))
    fill, frow2, pulled = _pull_back(lens, fill, frow2, load, used, seq_len, PULL_ITEMS)
    queue = np.concatenate((queue, held, pulled))
    o, r, total = _bfd(lens[queue], seq_len, cap, used, seq_len - load)
    order = np.concatenate((first, fill, queue[o]))
    row = np.concatenate((frow, frow2, r))
    for _ in range(REHOME_PASSES):
        if total <= nrows:
            break
        order, row, total = _rehome(lens, order, row, total, nrows, seq_len, cap)
    # pre-opened rows may stay empty: number the used rows densely, in order of opening
    kept = np.bincount(row, minlength=total) > 0
    renum = np.cumsum(kept) - 1
    return order, renum[row], int(np.count_nonzero(kept))


def _spill(lens: np.ndarray, seq_len: int, cap: int, free):
    """``free`` = uncapped BFD ``(order, row, num_rows)``: the items of every row over the cap past
    the cap (its shortest) are taken out and best-fit (capped, decreasing) into the space and free
    slots left in the other rows, new rows only if needed. Good when the cap binds only in BFD's
    last rows and the other rows have room."""
    order, row, total = free
    counts = np.bincount(row, minlength=total)
    if counts.max(initial=0) <= cap:
        return free
    # rank of each item in its row (BFD places longest first): the ones past the cap move
    starts = np.cumsum(counts) - counts
    by_row = np.argsort(row, kind="stable")
    rank = np.empty(len(row), dtype=np.int64)
    rank[by_row] = np.arange(len(row)) - np.repeat(starts, counts)
    out = rank >= cap
    stay_o, stay_r = order[~out], row[~out]
    load = np.bincount(stay_r, weights=lens[stay_o], minlength=total).astype(np.int64)
    used = np.bincount(stay_r, minlength=total).astype(np.int64)
    moved = order[out]
    o, r, total = _bfd(lens[moved], seq_len, cap, used, seq_len - load)
    return np.concatenate((stay_o, moved[o])), np.concatenate((stay_r, r)), total


def _pack_positive(lens: np.ndarray, seq_len: int, cap: int, top: bool = False):
    """BFD. Under a cap: the cap-aware packer first when many items are tiny (:data:`TINY_SHARE`)
    and the cap is not loose (:data:`LOOSE_CAP`); uncapped BFD when it meets the cap; else
    candidates in turn until one is within :data:`SLACK` of the lower bound, the fewest rows
    winning (the earlier on ties): the vectorised swaps of :func:`_uncrowd` when the cap is loose
    or BFD's rows exceed it by at most :data:`REPAIR_SHARE` of the items in all, then in the latter
    case the per-swap repair of uncapped BFD (:func:`_repair_cap`), the cap-aware packer
    (:func:`_cap_aware`), uncapped BFD with the excess spilled (:func:`_spill`), capped BFD; then
    the swap repair on small inputs; at the top level (``top``) with an excess of at most
    :data:`WINDOWED_SHARE`, the windowed packing (:func:`_windowed`); more than
    :data:`LAST_RESORT` off, the dealt search."""
    if cap >= NO_CAP or not len(lens):
        return _bfd(lens, seq_len, cap)
    bound = _min_rows(lens, seq_len, cap)
    aware = None
    loose = cap * bound >= LOOSE_CAP * len(lens)
    if not loose and np.count_nonzero(lens <= (seq_len - 1) // cap) > TINY_SHARE * len(lens):  # L * K < T
        # many items K of which do not fill a row: BFD would crowd them, try the cap-aware packer first
        aware = _cap_aware(lens, seq_len, cap, bound)
        if aware is not None and _good_enough(aware[2], bound):
            return aware
    free = _bfd(lens, seq_len, NO_CAP)
    counts = np.bincount(free[1], minlength=free[2])
    if counts.max(initial=0) <= cap:
        return free
    excess = int(np.clip(counts - cap, 0, None).sum())
    few_swaps = excess <= REPAIR_SHARE * len(lens)

    def repair():
        fixed = _repair_cap(lens, cap, *free)
        return None if fixed is None else (fixed[0], fixed[1], free[2])

    candidates = [lambda: _uncrowd(lens, seq_len, cap, free)] if loose or few_swaps else []
    candidates += [repair] if few_swaps else []
    candidates += [lambda: aware if aware is not None else _cap_aware(lens, seq_len, cap, bound),
                   lambda: _spill(lens, seq_len, cap, free), lambda: _bfd(lens, seq_len, cap)]
    if not few_swaps and len(lens) <= LAST_RESORT_MAX_ITEMS:
        candidates.append(repair)
    if top and excess <= WINDOWED_SHARE * len(lens):
        candidates.append(lambda: _windowed(lens, seq_len, cap))
    best = None
    for candidate in candidates:
        other = candidate()
        if other is not None and (best is None or other[2] < best[2]):
            best = other
        if best is not None and _good_enough(best[2], bound):
            return best
    if best[2] <= bound * (1 + LAST_RESORT):
        return best
    return _dealt_search(lens, seq_len, cap, bound, best)


def _windowed(lens: np.ndarray, seq_len: int, cap: int):
    """A fixed random permutation packed in windows of 16 default curriculum windows, each window
    like a small input (where the swap repair succeeds more often), its least-filled rows handed
    on to the next. None when the input fits in one window."""
    window = 16 * default_window(lens, seq_len)
    if len(lens) <= window:
        return None
    mix = np.random.default_rng(0x5EED).permutation(len(lens))
    items, rows, nrows = _curriculum(lens[mix], seq_len, cap, window)
    return mix[items], rows, nrows


def _dealt_search(lens: np.ndarray, seq_len: int, cap: int, bound: int, best):
    """Last resort: :func:`_deal_then_bfd` with a few numbers of dealing rounds around the mean
    count per row; returns the packing with the fewest rows (``best`` on ties)."""
    avg = len(lens) / bound
    tried = {}

    def attempt(k):
        nonlocal best
        if k < 1 or k >= cap or k in tried or _good_enough(best[2], bound):
            return
        cand = _deal_then_bfd(lens, seq_len, cap, bound, k)
        tried[k] = cand[2]
        if cand[2] < best[2]:
            best = cand

    for f in (0.3, 0.6, 0.9):
        attempt(min(cap - 1, max(1, int(round(avg * f)))))
    if tried:
        k0 = min(tried, key=lambda k: (tried[k], k))
        attempt(k0 - 1)
        attempt(k0 + 1)
    return best


def _place_zeros(row_counts: np.ndarray, n0: int, cap: int) -> tuple[np.ndarray, int]:
    """Rows for ``n0`` zero-length items: water-fill the rows with the fewest items (under ``cap``),
    opening new rows only when no slot is left. Returns (row per zero item, rows added)."""
    nrows = len(row_counts)
    if n0 == 0:
        return np.empty(0, dtype=np.int64), 0
    c = row_counts.astype(np.int64)
    free = (cap - c) if cap < NO_CAP else np.full(nrows, n0, dtype=np.int64)
    free = np.maximum(free, 0)
    into_old = min(n0, int(free.sum())) if nrows else 0
    parts = []
    if into_old:
        # smallest level lam such that sum(clip(lam - c, 0, free)) >= into_old
        top = np.minimum(c + free, c.max() + into_old)

        def filled(lam):
            return int(np.clip(lam - c, 0, top - c).sum())

        lo, hi = int(c.min()), int(top.max())
        while lo < hi:
            mid = (lo + hi) // 2
            if filled(mid) >= into_old:
                hi = mid
            else:
                lo = mid + 1
        base = np.clip(lo - 1 - c, 0, top - c)  # everything below the last level
        extra = into_old - int(base.sum())
        at_last = np.flatnonzero((c <= lo - 1) & (top >= lo))[:extra]
        base[at_last] += 1
        parts.append(np.repeat(np.arange(nrows, dtype=np.int64), base))
    rest = n0 - into_old
    added = 0
    if rest:
        per = rest if cap >= NO_CAP else cap
        added = -(-rest // per)
        parts.append(nrows + np.arange(rest, dtype=np.int64) // per)
    return np.concatenate(parts), added


def _pack_items(lens: np.ndarray, seq_len: int, cap: int, top: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """Pack items (lengths <= seq_len, zeros allowed). Returns (order, row, num_rows): item
    ``order[i]`` goes to row ``row[i]``; within a row, items keep the order of ``order``."""
    pos_mask = lens > 0
    if pos_mask.all():
        return _pack_positive(lens, seq_len, cap, top)
    nz = np.flatnonzero(pos_mask)
    zeros = np.flatnonzero(~pos_mask)
    o, r, nrows = _pack_positive(lens[nz], seq_len, cap, top)
    counts = np.bincount(r, minlength=nrows)
    zr, added = _place_zeros(counts, len(zeros), cap)
    return np.concatenate((nz[o], zeros)), np.concatenate((r, zr)), nrows + added


def _curriculum(lens: np.ndarray, seq_len: int, cap: int, window: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Pack consecutive windows of the input order; rows of a window ordered by their items' mean
    position; the least-filled rows of a window (at most 1% of them, with fill < 99.9%) move on to
    the next window. Returns (items in final order, row per item, num_rows)."""
    n = len(lens)
    out_items, out_rows = [], []
    nrows = 0
    carry = np.empty(0, dtype=np.int64)
    for w0 in range(0, n, window):
        last = w0 + window >= n
        idx = np.concatenate((carry, np.arange(w0, min(n, w0 + window), dtype=np.int64)))
        o, r, wr = _pack_items(lens[idx], seq_len, cap)
        items = idx[o]
        if not last and wr > 1:
            fill = np.bincount(r, weights=lens[items], minlength=wr)
            worst = np.argsort(fill, kind="stable")[: max(1, wr // 100)]
            worst = worst[fill[worst] < 0.999 * seq_len]
            if len(worst):
                hand_on = np.zeros(wr, dtype=bool)
                hand_on[worst] = True
                moved = hand_on[r]
                carry = np.sort(items[moved])
                items, r = items[~moved], r[~moved]
                # renumber the remaining rows densely
                keep_rows = np.flatnonzero(~hand_on)
                remap = np.full(wr, -1, dtype=np.int64)
                remap[keep_rows] = np.arange(len(keep_rows))
                r = remap[r]
                wr = len(keep_rows)
            else:
                carry = np.empty(0, dtype=np.int64)
        else:
            carry = np.empty(0, dtype=np.int64)
        # order rows by the mean input position of their items (difficulty rank)
        mean_pos = np.bincount(r, weights=items, minlength=wr) / np.maximum(np.bincount(r, minlength=wr), 1)
        rank = np.empty(wr, dtype=np.int64)
        rank[np.argsort(mean_pos, kind="stable")] = np.arange(wr)
        out_items.append(items)
        out_rows.append(nrows + rank[r])
        nrows += wr
    if not out_items:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), 0
    return np.concatenate(out_items), np.concatenate(out_rows), nrows


def _rank_rows(items: np.ndarray, rows: np.ndarray, nrows: int) -> np.ndarray:
    """Renumber rows by the mean input position of their items (stable)."""
    mean_pos = np.bincount(rows, weights=items, minlength=nrows) / np.maximum(np.bincount(rows, minlength=nrows), 1)
    rank = np.empty(nrows, dtype=np.int64)
    rank[np.argsort(mean_pos, kind="stable")] = np.arange(nrows)
    return rank[rows]


def _global(ilen: np.ndarray, seq_len: int, cap: int):
    """Global packing of all items (see :func:`_pack_items`)."""
    return _pack_items(ilen, seq_len, cap, top=True)


def default_window(lengths: np.ndarray, seq_len: int) -> int:
    """Curriculum window in samples: about :data:`CURRICULUM_WINDOW_ROWS` rows' worth."""
    n = len(lengths)
    mean = float(np.minimum(lengths, seq_len).mean()) if n else 1.0
    return max(1, int(math.ceil(CURRICULUM_WINDOW_ROWS * seq_len / max(mean, 1.0))))


def pack(lengths: np.ndarray, seq_len: int, *, max_per_row: int | None = None, order: str = "shuffle",
         seed: int = 0, split_long: bool = False, drop_long: bool = False,
         window: int | None = None) -> Packing:
    """Pack samples of the given lengths into rows of ``seq_len`` tokens (see the module docstring).

    ``lengths[i]`` is the length of input position ``i``; with ``order="curriculum"`` the input is
    already in difficulty order. ``max_per_row`` caps the samples (items) per row. Samples longer
    than ``seq_len`` raise :class:`InputError` unless ``split_long`` (cut into chunks of at most
    ``seq_len``: full rows plus one remainder chunk) or ``drop_long`` (listed in ``dropped``).
    ``window`` (curriculum only) is the number of consecutive samples packed together.
    The same arguments always give the same packing.
    """
    import time

    t0 = time.perf_counter()
    lens = _check_args(lengths, seq_len, max_per_row, order, split_long, drop_long, window)
    seq_len = int(seq_len)
    cap = int(max_per_row) if max_per_row is not None else NO_CAP
    n = len(lens)
    long_mask = lens > seq_len
    num_long = int(np.count_nonzero(long_mask))
    dropped = np.empty(0, dtype=np.int64)
    num_split = 0
    if num_long and not (split_long or drop_long):
        raise InputError(
            f"{num_long:,} sample(s) longer than the packed row length {seq_len:,} (longest: {int(lens.max()):,}); "
            "use --split-long to cut them into chunks or --drop-long to drop them")
    if num_long and drop_long:
        dropped = np.flatnonzero(long_mask).astype(np.int64)
        sample = np.flatnonzero(~long_mask).astype(np.int64)
        start = np.zeros(len(sample), dtype=np.int64)
        ilen = lens[sample]
    elif num_long:  # split_long
        num_split = num_long
        chunks = np.where(long_mask, -(-lens // seq_len), 1)
        sample = np.repeat(np.arange(n, dtype=np.int64), chunks)
        first = np.cumsum(chunks) - chunks
        k = np.arange(len(sample), dtype=np.int64) - np.repeat(first, chunks)
        start = k * seq_len
        ilen = np.minimum(lens[sample] - start, seq_len)
    else:
        sample = np.arange(n, dtype=np.int64)
        start = np.zeros(n, dtype=np.int64)
        ilen = lens
    positive = ilen[ilen > 0]
    bound = _min_rows(positive, seq_len, cap)
    if order == "curriculum":
        # Windows of the input (difficulty) order. Without an explicit window, start at about
        # CURRICULUM_WINDOW_ROWS rows' worth and grow it (x8) until the packing is within 0.1% of the
        # best possible: when difficulty correlates with length (difficulty = length), small windows
        # hold similar lengths that cannot fill rows, and the window grows up to the whole dataset
        # (global packing, rows ordered by their samples' mean difficulty rank).
        w = int(window) if window is not None else default_window(ilen, seq_len)
        while True:
            if w >= len(ilen):
                items, rows, nrows = _global(ilen, seq_len, cap)
                rows = _rank_rows(items, rows, nrows)
            else:
                items, rows, nrows = _curriculum(ilen, seq_len, cap, w)
            if window is not None or w >= len(ilen) or nrows <= bound / 0.999:
                break
            w = min(len(ilen), w * 8)
        window = w
    else:
        items, rows, nrows = _global(ilen, seq_len, cap)
        if order == "shuffle":
            rows = np.random.default_rng(seed).permutation(nrows)[rows]
    # sort by (row, placement order): the placement order is the current position
    key = rows.astype(np.uint16) if nrows <= np.iinfo(np.uint16).max + 1 else rows  # 16 bits: a radix sort
    srt = np.argsort(key, kind="stable")
    items, rows = items[srt], rows[srt]
    return Packing(
        item_sample=sample[items], item_start=start[items], item_length=ilen[items].astype(np.int64),
        item_row=rows.astype(np.int64), num_rows=int(nrows), seq_len=seq_len, dropped=dropped,
        max_per_row=int(max_per_row) if max_per_row is not None else None, order=order, num_samples=n,
        num_split=num_split, window=int(window) if order == "curriculum" else None,
        seconds=time.perf_counter() - t0)
