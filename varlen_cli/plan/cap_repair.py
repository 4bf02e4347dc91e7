"""The cap repair of :mod:`varlen_cli.plan.packing`: packings under ``max_per_row`` (K).

Under K, plain BFD fills rows with a few long items and leaves the shortest ones to the last rows,
hundreds per row. This module holds the ways :func:`varlen_cli.plan.packing.pack` gets under the
cap at (or next to) the lower bound on rows, all built from the vectorised BFD engine
(:mod:`varlen_cli.plan.bfd`):

* :func:`uncrowd`: vectorised chunk swaps of uncapped BFD (rows kept, tokens per row unchanged);
  :func:`repair_cap`: the exact-size swap repair, a Python loop per swap (few swaps);
* :func:`spill`: BFD with the excess past the cap best-fit into the other rows;
* :func:`deal_then_bfd`: long items dealt layer by layer, then BFD;
* :func:`cap_aware`: a cardinality-aware packer for R = the lower bound on rows:

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

Which of them runs, and in which order, is :func:`varlen_cli.plan.packing.pack`'s choice. This
module imports only numpy.
"""

from __future__ import annotations

import math

import numpy as np

from .bfd import bfd, order_desc


def deal_then_bfd(lens: np.ndarray, seq_len: int, cap: int, nrows: int, rounds: int):
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
    o, r, total = bfd(lens[rest], seq_len, cap, used, seq_len - load)
    return np.concatenate((first, rest[o])), np.concatenate((row_of[first], r)), total


def _find_swap(lens: np.ndarray, mine: list, pos: int, jtop: int, maxlen: int, find):
    """For :func:`repair_cap`: ``(j, k, donor)``, the largest ``j <= jtop`` such that the ``j - 1``
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


def repair_cap(lens: np.ndarray, cap: int, order: np.ndarray, row: np.ndarray, nrows: int):
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
"""Swap fix-up of uncapped BFD (:func:`uncrowd`): at most this many vectorised rounds."""
UNCROWD_CHUNKS = (0.5, 0.5, 0.9, 0.2, 0.7, 0.1, 0.4, 0.95, 0.3, 0.6, 0.05, 0.8, 0.45, 0.15, 0.65, 0.25)
"""Chunk sizes of :func:`uncrowd`'s rounds, as fractions of the free slots per row (cap - mean):
varied so that chunks left without a donor of their length get other sums."""
UNCROWD_STALL = 6
"""Swap fix-up: stop after this many rounds in a row that swapped nothing."""


def uncrowd(lens: np.ndarray, seq_len: int, cap: int, free):
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
    """The rows still over the cap after :func:`uncrowd`'s swaps (chunks whose sums no donor
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
    o, rr, total = bfd(lens[out], seq_len, cap, used[rows], seq_len - load[rows])
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
    """One round of :func:`uncrowd`'s swaps with chunks of ``q + 1`` items (updates ``item_row``,
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
    o, r, total = bfd(lens[rest], space, cap, init_used, init_space)
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
    o, r, new_total = bfd(len_p[homeless], seq_len, cap, count, gap)
    if new_total >= total:
        return order, row, total
    row_p[homeless[o]] = r
    return order, row_p, new_total


def cap_aware(lens: np.ndarray, seq_len: int, cap: int, nrows: int):
    """Capped packing near the lower bound ``nrows`` (see the module docstring): short items get a
    fair share of every row, the long ones are best-fit around that share, the short ones then
    fill the gaps. Returns (order, row, num_rows) like :func:`bfd`, or None when not applicable."""
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
    queue = short[order_desc(lens[short])]
    # the shortest items (HOLD_BACK_ROWS per row at most) are kept for the final best fit, with slots
    held = queue[len(queue) - min(len(queue), int(HOLD_BACK_ROWS * nrows)):]
    held = held[lens[held] <= lens[held[-1]] + HOLD_BACK_EXTRA] if len(held) else held
    queue = queue[: len(queue) - len(held)]
    keep = -(-len(held) // nrows) + HOLD_BACK_SLOTS if len(held) else 0
    fill, frow2, queue = _fill_short(lens, queue, load, used, seq_len, max(1, cap - keep), 2 * (g + l0))
    fill, frow2, pulled = _pull_back(lens, fill, frow2, load, used, seq_len, PULL_ITEMS)
    queue = np.concatenate((queue, held, pulled))
    o, r, total = bfd(lens[queue], seq_len, cap, used, seq_len - load)
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


def spill(lens: np.ndarray, seq_len: int, cap: int, free):
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
    o, r, total = bfd(lens[moved], seq_len, cap, used, seq_len - load)
    return np.concatenate((stay_o, moved[o])), np.concatenate((stay_r, r)), total
