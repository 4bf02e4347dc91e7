"""Microbatch formers: turn an ordered sequence of samples into microbatches under the budget.

Every former returns a :class:`Microbatches` (samples as CSR: ``samples[offsets[k]:offsets[k+1]]``
are microbatch ``k``), in the order the plan will use them. Layout, LR and writing only ever see
this structure, so padded and packed plans share them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .shapes import Budget, ShapeMap


@dataclass(frozen=True)
class Targets:
    """The target side of a two-budget plan (``--max-target-tokens``): each input position's target
    length (the metrics' ``target_length``, aligned with the lengths) and the map to its padded T_target."""

    length: np.ndarray
    shape: ShapeMap

    def padded(self, positions: np.ndarray) -> np.ndarray:
        return self.shape(self.length[positions])

    def seqlen(self, samples: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Per microbatch (CSR ``samples``/``offsets``), its padded T_target."""
        if not len(samples):
            return np.zeros(len(offsets) - 1, np.int64)
        return self.shape(segment_max(self.length[samples], offsets))


@dataclass
class Microbatches:
    samples: np.ndarray  # int64 input positions, microbatch after microbatch
    offsets: np.ndarray  # int64, M + 1
    seqlen: np.ndarray  # int64 padded T per microbatch
    batch_size: np.ndarray  # int64 padded B per microbatch
    tokens: np.ndarray  # int64 real tokens per microbatch
    # per entry of ``samples``: its tokens (padded plans: the sample's length); packed plans also
    item_length: np.ndarray | None = None
    item_start: np.ndarray | None = None
    item_row: np.ndarray | None = None  # row inside the microbatch
    # a deferred reorder (:meth:`reordered`): samples/offsets are None, ``base``'s microbatches in ``base_order``
    base: Microbatches | None = field(default=None, repr=False)
    base_order: np.ndarray | None = field(default=None, repr=False)
    target_seqlen: np.ndarray | None = None  # two budgets: int64 padded T_target per microbatch

    @property
    def count(self) -> int:
        return len(self.seqlen)

    def take(self, order: np.ndarray) -> Microbatches:
        """The microbatches in the given order (a permutation or a subset)."""
        order = np.asarray(order, dtype=np.int64)
        src, src_order = (self, order) if self.base is None else (self.base, self.base_order[order])
        counts = np.diff(src.offsets)[src_order]
        new_off = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(counts, out=new_off[1:])
        idx = segment_gather(src.offsets[src_order], counts, new_off)

        def g(a):
            return None if a is None else a[idx]

        return Microbatches(src.samples[idx], new_off, self.seqlen[order], self.batch_size[order],
                            self.tokens[order], g(src.item_length), g(src.item_start), g(src.item_row),
                            target_seqlen=_pick(self.target_seqlen, order))

    def reordered(self, order: np.ndarray) -> Microbatches:
        """The microbatches in the given order, their samples not moved yet: only the per-microbatch
        arrays are reordered; the next :meth:`take` gathers the samples once, through both orders
        (a 100M-sample epoch: one gather instead of two). Until then ``samples``/``offsets`` are None."""
        order = np.asarray(order, dtype=np.int64)
        base, base_order = (self, order) if self.base is None else (self.base, self.base_order[order])
        return Microbatches(None, None, self.seqlen[order], self.batch_size[order], self.tokens[order],
                            base=base, base_order=base_order, target_seqlen=_pick(self.target_seqlen, order))


def _pick(values: np.ndarray | None, order: np.ndarray) -> np.ndarray | None:
    return None if values is None else values[order]


def segment_gather(starts: np.ndarray, counts: np.ndarray, new_offsets: np.ndarray) -> np.ndarray:
    """Indices that concatenate segments ``[starts[k], starts[k] + counts[k])`` (vectorised)."""
    total = int(new_offsets[-1])
    if total == 0:
        return np.zeros(0, np.int64)
    # int32 where every index fits: 4 bytes a sample for the temporaries of a full gather
    dtype = np.int32 if max(total, int(starts.max()) + int(counts.max())) < 1 << 31 else np.int64
    shift = np.repeat((starts - new_offsets[:-1]).astype(dtype), counts)
    shift += np.arange(total, dtype=dtype)
    return shift


def segment_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    if len(offsets) <= 1:
        return np.zeros(0, values.dtype)
    return np.maximum.reduceat(values, offsets[:-1])


def segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    if len(offsets) <= 1:
        return np.zeros(0, np.int64)
    wide = np.int64 if values.dtype.kind in "biu" else None  # int32/uint16 values: sums in int64, no wrap
    return np.add.reduceat(values, offsets[:-1], dtype=wide).astype(np.int64, copy=False)


def stable_argsort_int(keys: np.ndarray) -> np.ndarray:
    """Stable argsort of non-negative integer keys in O(N): numpy radix-sorts 16-bit keys, so sort
    by 16-bit digits, least significant first."""
    k = np.asarray(keys, dtype=np.int64)
    if not len(k):
        return np.zeros(0, np.int64)
    hi = int(k.max())
    if int(k.min()) < 0 or hi >= 1 << 48:
        return np.argsort(k, kind="stable")
    order = None
    shift = 0
    while True:
        digit = ((k if order is None else k[order]) >> shift & 0xFFFF).astype(np.uint16)
        step = np.argsort(digit, kind="stable")
        order = step if order is None else order[step]
        shift += 16
        if hi >> shift == 0:
            return order.astype(np.int64)


def finalize_padded(samples: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, shape: ShapeMap,
                    budget: Budget, static: bool, fixed_batch: int | None = None, *,
                    lens: np.ndarray | None = None, padded: np.ndarray | None = None,
                    targets: Targets | None = None) -> Microbatches:
    """Seqlen, padded batch size and tokens of microbatches given by samples/offsets (and their target
    seqlen, under two budgets: ``targets``). ``lens`` (``lengths[samples]``) and ``padded``
    (``shape(lens)``): when the caller has them (no gather)."""
    if lens is None:
        lens = lengths[samples]
    if not len(samples):
        seqlen = np.zeros(0, np.int64)
    elif padded is not None:  # max of shape(l) = shape(max of l): the shape map is non-decreasing
        seqlen = segment_max(padded, offsets)
    else:
        seqlen = shape(segment_max(lens, offsets))
    counts = np.diff(offsets)
    target_seqlen = targets.seqlen(samples, offsets) if targets is not None else None
    if static:
        batch = budget.cap(seqlen, target_seqlen) if fixed_batch is None else np.full(len(counts), fixed_batch,
                                                                                      np.int64)
    else:
        batch = counts.astype(np.int64)
    return Microbatches(samples, offsets, seqlen.astype(np.int64), batch.astype(np.int64),
                        segment_sum(lens, offsets), item_length=narrow(lens), target_seqlen=target_seqlen)


def narrow(lengths: np.ndarray) -> np.ndarray:
    """Sample lengths kept per entry (the plan's own check reads them), in 4 bytes where they were 8
    (lengths fit int32: the reader refuses longer samples)."""
    return lengths.astype(np.int32) if lengths.dtype.itemsize > 4 else lengths


# -- greedy consecutive microbatches ---------------------------------------------------------------
def greedy_offsets(padded: np.ndarray, cap: np.ndarray, closed: bool = False, monotone: bool = True) -> np.ndarray:
    """Offsets of greedy consecutive microbatches: each takes as many next samples as fit, i.e. while
    the count stays <= the smallest cap of its members (cap depends on the padded length only, or,
    ``monotone=False``, also on something else: a two-budget plan's target side).

    Non-decreasing ``padded`` (length-sorted sequences, buckets) with ``monotone`` caps: a loop per run
    of equal cap with ``arange``, O(N + runs). Otherwise a loop per microbatch over growing windows.
    ``closed`` (static shapes on sorted input): no microbatch spans two padded lengths, so every bucket
    keeps its own (B, T) shape.
    """
    n = len(padded)
    if n == 0:
        return np.zeros(1, np.int64)
    if n == 1 or (monotone and bool(np.all(padded[1:] >= padded[:-1]))):
        return _greedy_sorted(cap, padded if closed else cap, closed)
    return _greedy_general(cap)


def _greedy_sorted(cap: np.ndarray, run_key: np.ndarray, closed: bool) -> np.ndarray:
    n = len(cap)
    small = n < 1 << 30 and int(cap.max()) < 1 << 30  # int32 arrays: 4 bytes a sample
    idx_type = np.int32 if small else np.int64
    # a microbatch ending at j may start at j - cap[j] + 1 or later; strictly increasing in j
    earliest = np.arange(1, n + 1, dtype=idx_type)
    earliest -= cap.astype(idx_type, copy=False)
    change = np.flatnonzero(run_key[1:] != run_key[:-1]) + 1
    run_stop = np.append(change, n)
    pieces = []
    i = 0
    while i < n:
        b = int(run_stop[np.searchsorted(run_stop, i, side="right")])  # the end of i's run
        c = int(cap[i])
        k = (b - i) // c
        if k:
            pieces.append(np.arange(i, i + k * c, c, dtype=np.int64))
            i += k * c
        if i < b:  # a microbatch that starts in this run and may reach into the next ones
            # (the needle in earliest's own dtype: a Python int would make numpy cast the whole array)
            end = b - 1 if closed else int(np.searchsorted(earliest, earliest.dtype.type(i), side="right")) - 1
            pieces.append(np.array([i], dtype=np.int64))
            i = end + 1
    pieces.append(np.array([n], dtype=np.int64))
    return np.concatenate(pieces)


def greedy_weighted_offsets(cap: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """:func:`greedy_offsets` for units of ``weight`` samples each (a group kept whole: a DPO pair, a
    GRPO group), in non-decreasing padded length, so ``cap`` (samples at the unit's T) never rises:
    each microbatch takes as many next units as fit, i.e. while its samples stay <= the cap of its
    last unit. Every unit must fit alone (``weight <= cap``). One binary search per microbatch."""
    n = len(cap)
    prefix = np.zeros(n + 1, np.int64)
    np.cumsum(weight, out=prefix[1:])
    # units i..j fit iff prefix[j + 1] - prefix[i] <= cap[j]: strictly increasing in j (weights >= 1)
    earliest = prefix[1:] - np.asarray(cap, np.int64)
    starts = []
    i = 0
    while i < n:
        starts.append(i)
        i = max(i + 1, int(np.searchsorted(earliest, prefix[i], side="right")))
    starts.append(n)
    return np.array(starts, dtype=np.int64)


def _greedy_general(cap: np.ndarray) -> np.ndarray:
    n = len(cap)
    starts = []
    i = 0
    w = 64
    while i < n:
        while True:
            hi = min(n, i + w)
            mincap = np.minimum.accumulate(cap[i:hi])
            bad = np.flatnonzero(np.arange(1, hi - i + 1) > mincap)
            if len(bad) or hi == n:
                m = int(bad[0]) if len(bad) else hi - i
                break
            w *= 2
        starts.append(i)
        i += max(m, 1)
        w = max(64, 2 * m)
    starts.append(n)
    return np.array(starts, dtype=np.int64)


def form_sequence(seq: np.ndarray, lengths: np.ndarray, shape: ShapeMap, budget: Budget, static: bool,
                  padded: np.ndarray | None = None, lens: np.ndarray | None = None,
                  targets: Targets | None = None) -> Microbatches:
    """Consecutive samples of ``seq`` (curriculum, reverse, bucket-shuffle) greedily under the budget
    (both budgets, with ``targets``); ``lens`` (lengths[seq]) and ``padded`` (shape(lens)) when the
    caller has them already."""
    if lens is None:
        lens = lengths[seq]
    if padded is None:
        padded = shape(lens)
    cap = budget.cap(padded) if targets is None else budget.cap(padded, targets.padded(seq))
    fin = dict(lens=lens, padded=padded, targets=targets)
    if len(padded) > 1 and bool(np.all(padded[1:] <= padded[:-1])) and not bool(np.all(padded[1:] == padded[:-1])):
        # non-increasing (reverse order): cut the ascending sequence, then map the cuts back, so the
        # samples inside each microbatch stay in sequence order too (a tail split keeps that order)
        off = greedy_offsets(padded[::-1], cap[::-1], static, targets is None)
        return finalize_padded(seq, len(seq) - off[::-1], lengths, shape, budget, static, **fin)
    off = greedy_offsets(padded, cap, static, targets is None)
    return finalize_padded(seq, off, lengths, shape, budget, static, **fin)


def bucket_sequence(canon: np.ndarray, padded: np.ndarray, rng: np.random.Generator,
                    target_padded: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """bucket-shuffle: samples grouped by padded length (``padded`` is aligned with ``canon``; two
    budgets: by (padded length, padded target length), ``target_padded``), in random order inside each
    group. Returns the sequence and its padded lengths."""
    n = len(canon)
    perm = rng.permutation(n)
    hi = int(padded.max()) if n else 0
    if target_padded is not None and n:
        key = padded.astype(np.int64) * (int(target_padded.max()) + 1) + target_padded
        order = perm[stable_argsort_int(key[perm])]
        return canon[order], padded[order]
    if n >= 1 << 31 or hi >= 1 << 16 or int(padded.min()) < 0:
        order = perm[stable_argsort_int(padded[perm])]
        return canon[order], padded[order]
    # the same sequence with 4- and 2-byte arrays (random gathers are memory-bound): a stable
    # radix argsort of the 16-bit keys in permutation order; the sorted keys from their counts
    perm32 = perm.astype(np.int32)
    del perm
    key = np.take(padded.astype(np.uint16, copy=False), perm32)
    order = np.take(perm32, np.argsort(key, kind="stable"))
    del perm32
    counts = np.bincount(key, minlength=hi + 1)
    del key
    seq_padded = np.repeat(np.arange(hi + 1, dtype=padded.dtype), counts)
    if n and int(canon[0]) == 0 and int(canon[-1]) == n - 1 and is_identity(canon):
        return order, seq_padded
    return canon[order], seq_padded


def is_identity(a: np.ndarray) -> bool:
    """Whether ``a`` is ``arange(len(a))`` (one sequential pass)."""
    n = len(a)
    if not n:
        return True
    if int(a[0]) != 0 or int(a[-1]) != n - 1:
        return False
    return bool(np.all(a[1:] > a[:-1]))


def form_random(canon: np.ndarray, lengths: np.ndarray, shape: ShapeMap, budget: Budget, static: bool,
                rng: np.random.Generator, targets: Targets | None = None) -> tuple[Microbatches, int]:
    """The padded fixed-batch baseline: random order, a fixed B that fits the longest sample (and the
    longest target, under two budgets)."""
    perm = canon[rng.permutation(len(canon))]
    t_max = int(shape(lengths[canon]).max()) if len(canon) else 1
    b = max(int(fixed_cap(budget, t_max, targets, canon)), 1)
    off = np.append(np.arange(0, len(perm), b, dtype=np.int64), len(perm)).astype(np.int64)
    return finalize_padded(perm, off, lengths, shape, budget, static, fixed_batch=b, targets=targets), b


def fixed_cap(budget: Budget, t_max: int, targets: Targets | None = None, positions: np.ndarray | None = None,
              target_max: int | None = None) -> int:
    """The random order's fixed B: the cap of the longest padded T (and, under two budgets, of the longest
    padded T_target: ``target_max``, else that of ``targets`` at ``positions``)."""
    if targets is None and target_max is None:
        return int(budget.cap(np.array([t_max]))[0])
    if target_max is None:
        target_max = int(targets.padded(positions).max()) if len(positions) else 1
    return int(budget.cap(np.array([t_max]), np.array([target_max]))[0])


# -- same shape per step ---------------------------------------------------------------------------
def form_same_shape(seq: np.ndarray, lengths: np.ndarray, shape: ShapeMap, budget: Budget, static: bool,
                    slots: int) -> tuple[Microbatches, np.ndarray]:
    """Microbatches whose consecutive groups of ``slots`` (= dp x grad_accum) share one (B, T).

    Samples are grouped by padded length (stable, so ``seq``'s order survives inside a group);
    walking the lengths upwards, every time a full step's worth (slots x cap(T)) has gathered it
    becomes full steps at that T; the rest is carried up (its samples fit the larger T). What is
    left at the top joins the last group, spread evenly over a multiple of ``slots`` microbatches
    (padding rows). Returns the microbatches (step-aligned) and
    the positions that could not be placed (only when too few samples are left for one step).
    """
    padded = shape(lengths[seq])
    order = stable_argsort_int(padded)
    seq2 = seq[order]
    t_sorted = padded[order]
    n = len(seq2)
    bounds = np.append(np.flatnonzero(t_sorted[1:] != t_sorted[:-1]) + 1, n) if n else np.zeros(0, np.int64)

    def fit(count: int, t: int) -> tuple[int, int]:
        c = int(budget.cap(np.array([t]))[0])
        if count < slots or c < 1:
            return 0, 0
        per_mb = -(-count // c)  # microbatches needed at c samples each
        m = slots * -(-per_mb // slots)
        if m <= count:
            return m, count
        m = slots * (count // slots)
        return m, min(count, m * c)

    groups = []  # [lo, used, m, t]
    lo = 0
    for b in bounds.tolist():
        # full steps only (slots microbatches of c samples); the rest is carried up to the next T
        c = int(budget.cap(np.array([int(t_sorted[b - 1])]))[0])
        full = (b - lo) // (slots * c)
        if full:
            used = full * slots * c
            groups.append([lo, used, full * slots, int(t_sorted[lo + used - 1])])
            lo += used
    leftover = np.zeros(0, np.int64)
    t_top = int(t_sorted[n - 1]) if n else 0
    while lo < n:  # samples left over at the top: merge them into the previous group(s)
        if not groups:
            m, used = fit(n - lo, t_top)
            if m:
                groups.append([lo, used, m, int(t_sorted[lo + used - 1])])
                lo += used
            leftover = seq2[lo:]
            break
        glo = groups.pop()[0]
        m, used = fit(n - glo, t_top)
        if m and used == n - glo:
            groups.append([glo, used, m, t_top])
            lo = n
        else:
            lo = glo
    off_parts, seqlens, batches = [], [], []
    for glo, used, m, t in groups:
        off_parts.append(glo + (np.arange(m, dtype=np.int64) * used) // m)
        seqlens.append(np.full(m, t, np.int64))
        b = int(budget.cap(np.array([t]))[0]) if static else -(-used // m)
        batches.append(np.full(m, b, np.int64))
    end = groups[-1][0] + groups[-1][1] if groups else 0
    offsets = np.append(np.concatenate(off_parts) if off_parts else np.zeros(0, np.int64), end).astype(np.int64)
    samples = seq2[:end]
    lens = lengths[samples]
    mb = Microbatches(samples, offsets, np.concatenate(seqlens) if seqlens else np.zeros(0, np.int64),
                      np.concatenate(batches) if batches else np.zeros(0, np.int64), segment_sum(lens, offsets),
                      item_length=narrow(lens))
    return mb, leftover


# -- packed ----------------------------------------------------------------------------------------
def packed_microbatches(samples, item_start, item_length, item_row, num_rows: int, seq_len: int, rows_per_mb: int,
                        count: int) -> Microbatches:
    """Spread ``num_rows`` rows (items sorted by row) evenly over ``count`` microbatches of at most
    ``rows_per_mb`` rows each, keeping row order."""
    row_mb = (np.arange(num_rows, dtype=np.int64) * count) // max(num_rows, 1)  # microbatch of each row
    first_row = np.searchsorted(row_mb, np.arange(count), side="left")
    mb_of_item = row_mb[item_row]
    offsets = np.searchsorted(mb_of_item, np.arange(count + 1), side="left").astype(np.int64)
    local_row = item_row - first_row[mb_of_item]
    return Microbatches(samples, offsets, np.full(count, seq_len, np.int64), np.full(count, rows_per_mb, np.int64),
                        segment_sum(item_length, offsets) if count else np.zeros(0, np.int64),
                        item_length=item_length, item_start=item_start, item_row=local_row)
