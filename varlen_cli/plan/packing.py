"""Padding-free packing: samples concatenated into rows of exactly ``seq_len`` tokens.

:func:`pack` assigns every sample (or every chunk of a too-long sample, with ``split_long``) to a
row of ``seq_len`` tokens so that as few rows as possible are needed, optionally with at most
``max_per_row`` samples in a row. The result, a :class:`Packing`, lists the items row by row; the
planner groups rows into microbatches of R rows and the loader (:mod:`varlen_cli.loader.packed`)
rebuilds them into ``input_ids``, ``position_ids`` and ``cu_seqlens``.

Three modules: the best-fit decreasing engine (:mod:`varlen_cli.plan.bfd`: global BFD, exact,
vectorised by distinct length), the cap repair (:mod:`varlen_cli.plan.cap_repair`: ways under
``max_per_row``), and this one, :func:`pack` with its orders and the choice among the packers.

Under a cap K, :func:`_pack_positive` packs without the cap first and keeps that when it meets the
cap. Else it tries candidates until one is within :data:`SLACK` (0.03%) of the bound, keeping the
fewest rows: when the cap is loose (:data:`LOOSE_CAP`) or BFD's excess over it small
(:data:`REPAIR_SHARE`), the vectorised chunk swaps of :func:`~varlen_cli.plan.cap_repair.uncrowd`
(BFD's rows kept, or nothing), then, for a small excess, the exact-size swap repair of BFD
(:func:`~varlen_cli.plan.cap_repair.repair_cap`, a Python loop per swap); then the cap-aware packer
(:func:`~varlen_cli.plan.cap_repair.cap_aware`), BFD with the excess spilled
(:func:`~varlen_cli.plan.cap_repair.spill`), capped BFD, the repair on small inputs, the windowed
packing (:func:`_windowed`, moderate excess) and, more than :data:`LAST_RESORT` off,
:func:`_dealt_search`.

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

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError, UsageError
from .bfd import NO_CAP, bfd, min_rows, order_desc
from .cap_repair import cap_aware, deal_then_bfd, repair_cap, spill, uncrowd

ORDERS = ("shuffle", "curriculum", "none")
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
BFD's last rows, so uncapped BFD and the swap fix-up (:func:`uncrowd`) come first."""
REPAIR_SHARE = 0.05
"""The swap repair (a Python loop per swap) comes first when uncapped BFD exceeds the cap by at
most this share of the items in all."""


def _good_enough(nrows: int, bound: int) -> bool:
    return nrows <= bound + int(SLACK * bound)


def _pack_positive(lens: np.ndarray, seq_len: int, cap: int, top: bool = False):
    """BFD. Under a cap: the cap-aware packer first when many items are tiny (:data:`TINY_SHARE`)
    and the cap is not loose (:data:`LOOSE_CAP`); uncapped BFD when it meets the cap; else
    candidates in turn until one is within :data:`SLACK` of the lower bound, the fewest rows
    winning (the earlier on ties): the vectorised swaps of :func:`uncrowd` when the cap is loose
    or BFD's rows exceed it by at most :data:`REPAIR_SHARE` of the items in all, then in the latter
    case the per-swap repair of uncapped BFD (:func:`repair_cap`), the cap-aware packer
    (:func:`cap_aware`), uncapped BFD with the excess spilled (:func:`spill`), capped BFD; then
    the swap repair on small inputs; at the top level (``top``) with an excess of at most
    :data:`WINDOWED_SHARE`, the windowed packing (:func:`_windowed`); more than
    :data:`LAST_RESORT` off, the dealt search."""
    if cap >= NO_CAP or not len(lens):
        return bfd(lens, seq_len, cap)
    bound = min_rows(lens, seq_len, cap)
    aware = None
    loose = cap * bound >= LOOSE_CAP * len(lens)
    if not loose and np.count_nonzero(lens <= (seq_len - 1) // cap) > TINY_SHARE * len(lens):  # L * K < T
        # many items K of which do not fill a row: BFD would crowd them, try the cap-aware packer first
        aware = cap_aware(lens, seq_len, cap, bound)
        if aware is not None and _good_enough(aware[2], bound):
            return aware
    free = bfd(lens, seq_len, NO_CAP)
    counts = np.bincount(free[1], minlength=free[2])
    if counts.max(initial=0) <= cap:
        return free
    excess = int(np.clip(counts - cap, 0, None).sum())
    few_swaps = excess <= REPAIR_SHARE * len(lens)

    def repair():
        fixed = repair_cap(lens, cap, *free)
        return None if fixed is None else (fixed[0], fixed[1], free[2])

    candidates = [lambda: uncrowd(lens, seq_len, cap, free)] if loose or few_swaps else []
    candidates += [repair] if few_swaps else []
    candidates += [lambda: aware if aware is not None else cap_aware(lens, seq_len, cap, bound),
                   lambda: spill(lens, seq_len, cap, free), lambda: bfd(lens, seq_len, cap)]
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
    """Last resort: :func:`deal_then_bfd` with a few numbers of dealing rounds around the mean
    count per row; returns the packing with the fewest rows (``best`` on ties)."""
    avg = len(lens) / bound
    tried = {}

    def attempt(k):
        nonlocal best
        if k < 1 or k >= cap or k in tried or _good_enough(best[2], bound):
            return
        cand = deal_then_bfd(lens, seq_len, cap, bound, k)
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


def _items(lens: np.ndarray, seq_len: int, split_long: bool, drop_long: bool):
    """The items to pack: (input position, first token, length) of each, the dropped positions and the
    number of samples split. A sample longer than ``seq_len`` is refused (:class:`InputError`), dropped
    (``drop_long``) or cut into chunks of ``seq_len`` and a remainder (``split_long``)."""
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
    return sample, start, ilen, dropped, num_split


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
    sample, start, ilen, dropped, num_split = _items(lens, seq_len, split_long, drop_long)
    positive = ilen[ilen > 0]
    bound = min_rows(positive, seq_len, cap)
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


# ---- into a given number of rows --------------------------------------------------------------
def pack_into(lengths: np.ndarray, seq_len: int, rows: int, *, split_long: bool = False,
              best_fit: bool = True) -> Packing | None:
    """Pack into ``rows`` rows of ``seq_len`` tokens where this packer can (else into as few more as it
    needs, or None without ``best_fit``): the per-step packer of :mod:`varlen_cli.online` (a step's
    microbatches are known, so are its rows; a millisecond or a few for 8k samples, where BFD's loop
    per distinct length takes tens).

    First the items, in decreasing length, are dealt layer by layer into ``rows`` rows: each layer's
    longest item to the least-loaded row (a longest-processing-time deal on tokens), an item that does
    not fit its row going at the head of the next layer, what is left after the last layer to the
    rows with the most space (:func:`_worst_fit_rounds`). Rows end with near-equal tokens, which leaves
    no room for the last items when the rows are nearly full; then the last
    :data:`BEST_FIT_LAYERS` layers go through BFD instead, into the space the dealt ones left
    (:func:`~varlen_cli.plan.cap_repair.deal_then_bfd`), opening rows past ``rows`` only if they must
    (``best_fit=False``: None instead, for a caller that would rather try more rows). Empty rows are
    left out; the same arguments
    give the same packing. ``split_long`` as in :func:`pack` (no ``max_per_row``: :func:`pack` honours it)."""
    lens = _check_args(lengths, seq_len, None, "none", split_long, False, None)
    seq_len, rows = int(seq_len), int(rows)
    sample, start, ilen, dropped, num_split = _items(lens, seq_len, split_long, False)
    order = order_desc(ilen)
    row_of = _deal_layers(ilen[order], seq_len, rows)
    if row_of is None and not best_fit:
        return None
    if row_of is None:  # BFD for the last layers (on the positive lengths; empty items where rows have fewest)
        positive = np.flatnonzero(ilen > 0)
        layers = -(-len(positive) // max(rows, 1))
        o, r, used = deal_then_bfd(ilen[positive], seq_len, NO_CAP, rows, max(layers - BEST_FIT_LAYERS, 0))
        zeros = np.flatnonzero(ilen == 0)
        zero_rows, _ = _place_zeros(np.bincount(r, minlength=used), len(zeros), NO_CAP)
        order, row_of = np.concatenate([positive[o], zeros]), np.concatenate([r, zero_rows])
    present, row_of = np.unique(row_of, return_inverse=True)  # empty rows out, the others in order
    srt = np.argsort(row_of, kind="stable")  # items by (row, placement order)
    items = order[srt]
    return Packing(item_sample=sample[items], item_start=start[items], item_length=ilen[items].astype(np.int64),
                   item_row=row_of[srt].astype(np.int64), num_rows=len(present), seq_len=seq_len, dropped=dropped,
                   order="none", num_samples=len(lens), num_split=num_split)


BEST_FIT_LAYERS = 2
""":func:`pack_into`'s second try: the last this many layers of the deal go through BFD."""


def _deal_layers(sl: np.ndarray, seq_len: int, rows: int) -> np.ndarray | None:
    """Row of each item of ``sl`` (decreasing lengths) dealt into ``rows`` rows (see :func:`pack_into`),
    None when some item finds no room."""
    n = len(sl)
    row_of = np.full(n, -1, np.int64)
    load = np.zeros(rows, np.int64)
    pending = np.zeros(0, np.int64)
    j = 0
    while j < n:
        if len(pending) >= rows:
            return None
        take = rows - len(pending)
        idx = np.concatenate([pending, np.arange(j, min(n, j + take), dtype=np.int64)])
        j = min(n, j + take)
        target = np.argsort(load, kind="stable")[:len(idx)]
        ok = load[target] + sl[idx] <= seq_len
        row_of[idx[ok]] = target[ok]
        load[target[ok]] += sl[idx[ok]]
        pending = idx[~ok]
    return None if len(_worst_fit_rounds(sl, pending, row_of, load, seq_len)) else row_of


def _worst_fit_rounds(sl: np.ndarray, pending: np.ndarray, row_of: np.ndarray, load: np.ndarray,
                      seq_len: int) -> np.ndarray:
    """Place ``pending`` items (decreasing), round by round, the longest into the row with the most
    space, the next into the next... while a round places any; returns those left."""
    while len(pending):
        target = np.argsort(load, kind="stable")[:len(pending)]
        ok = load[target] + sl[pending] <= seq_len
        if not ok.any():
            return pending
        row_of[pending[ok]] = target[ok]
        np.add.at(load, target[ok], sl[pending[ok]])
        pending = pending[~ok]
    return pending
