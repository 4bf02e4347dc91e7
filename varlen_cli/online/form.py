"""One step's microbatches, formed and dealt to ranks by the planner's own pieces.

* Padded (``max_tokens``): units (samples or whole groups) in increasing padded length, greedy
  consecutive microbatches under the budget (:func:`varlen_cli.plan.batching.greedy_offsets`; whole
  groups: :func:`~varlen_cli.plan.batching.greedy_weighted_offsets`), the fewest the budget allows;
  the tail rule's splits (:func:`varlen_cli.plan.tail.split_rounds`) up to ``dp x G``; ranks by the
  layout's LPT on the cost model (:func:`varlen_cli.plan.layout.assign_ranks`).
* Packed (``seq_len``): units packed into rows (:func:`varlen_cli.plan.packing.pack`), spread over
  ``dp x G`` microbatches of at most R rows (:func:`varlen_cli.plan.tail.fix_packed`), rows dealt so
  ranks cost alike (:func:`varlen_cli.plan.balance.balance_rows`).

``G`` is ``num_microbatches``, else the fewest microbatches per rank the budget allows. Only when the
step has fewer units (packed: items) than ``dp x G`` do empty microbatches remain; they are counted.
Then :mod:`.refine` moves samples between ranks to even their cost. The result is a :class:`Slots`:
the ``dp x G`` microbatches in (rank, micro) order.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..budget import segment_sum_squares
from ..errors import InputError
from ..plan import balance, batching, layout, tail
from ..plan.packing import pack, pack_into
from .spec import StepSpec
from .units import Units

EVEN_MAX_PER_RANK = 64
"""Padded steps of at most this many microbatches per rank even out their microbatches' costs first
(:func:`_even_offsets`); with more, LPT alone balances the ranks."""
EVEN_PRECISION = 0.002
"""The evened budget's search stops within this fraction of the step's budget."""
EXACT_BELOW_PER_RANK = 100
"""A packed step of fewer microbatches a rank than this, whose rows the deal cannot fit into the fewest
microbatches, asks BFD (one microbatch more a rank would cost over 1% of the step)."""
DEALT_SLACK = 0.005
"""With more microbatches a rank, the deal's extra microbatches are kept while they stay within this
share of the fewest; past it, BFD runs on the deal's last layers too."""


@dataclass
class Slots:
    """A step's ``dp x G`` microbatches in (rank, micro) order: entries (samples, or a split sample's
    chunks) as CSR, and per microbatch its padded T, padded B (packed: rows), real tokens and cost."""

    entries: np.ndarray  # int64 sample index per entry
    offsets: np.ndarray  # int64, dp x G + 1
    seqlen: np.ndarray
    batch: np.ndarray
    tokens: np.ndarray
    cost: np.ndarray  # float64, the cost model's
    per_rank: int  # G
    entry_length: np.ndarray | None = None  # packed: tokens of each entry
    entry_start: np.ndarray | None = None  # packed: first token of the sample the entry holds
    entry_row: np.ndarray | None = None  # packed: row inside its microbatch

    @property
    def empty(self) -> int:
        return int(np.count_nonzero(np.diff(self.offsets) == 0))


class TooManyMicrobatches(InputError):
    """The step's samples need more microbatches than ``dp x num_microbatches`` (``needed`` of them)."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


def microbatches_per_rank(spec: StepSpec, needed: int, samples: int) -> int:
    """G: ``num_microbatches`` (refused when the budget needs more), else the fewest per rank."""
    fewest = -(-needed // spec.dp)
    if spec.num_microbatches is None:
        return fewest
    if needed > spec.dp * spec.num_microbatches:
        what = "microbatches of packed rows" if spec.packed else "microbatches"
        raise TooManyMicrobatches(f"the step's {samples:,} samples need {needed:,} {what} under {spec.describe()}, "
                                  f"more than dp {spec.dp} x num_microbatches {spec.num_microbatches}; raise "
                                  "num_microbatches or plan fewer samples per step", needed)
    return spec.num_microbatches


def _too_long(spec: StepSpec, units: Units, lengths: np.ndarray, bad: np.ndarray, why: str) -> InputError:
    worst = int(bad[0])
    more = f" ({len(bad):,} in all)" if len(bad) > 1 else ""
    return InputError(f"{units.describe(worst, lengths)} does not fit {spec.describe()}{more}; {why}")


# -- padded ----------------------------------------------------------------------------------------
def form_padded(spec: StepSpec, lengths: np.ndarray, units: Units) -> Slots:
    """Greedy microbatches over the units by padded length, split to ``dp x G``, dealt by LPT."""
    padded = spec.shape(units.longest(lengths))
    order = batching.stable_argsort_int(padded)
    t_sorted = padded[order]
    weight = units.expand_counts(order)
    cap = spec.budget.cap(t_sorted)
    bad = np.flatnonzero(weight > cap)
    if len(bad):  # the longest unit that fits no microbatch, named, with the bound(s) it passes
        w, ms = int(weight[bad[-1]]), spec.budget.max_samples
        tokens = int(dataclasses.replace(spec.budget, max_samples=None).cap(t_sorted[bad[-1:]])[0]) < w
        knob = " and ".join(k for k, over in (("max_tokens", tokens), ("max_samples", ms is not None and w > ms))
                            if over)
        raise _too_long(spec, units, lengths, order[bad[::-1]], f"raise {knob} or leave it out of the step")
    grouped = units.ids is not None
    off = _greedy(t_sorted, weight, cap, grouped)
    per_rank = microbatches_per_rank(spec, len(off) - 1, int(weight.sum()))
    if spec.dp > 1 and 0 < per_rank <= EVEN_MAX_PER_RANK:
        off = _even_offsets(spec, t_sorted, weight, grouped, spec.dp * per_rank, off)
    off = tail.split_rounds(off, spec.dp * per_rank - (len(off) - 1))
    prefix = np.zeros(len(order) + 1, np.int64)
    np.cumsum(weight, out=prefix[1:])
    sample_off = prefix[off]
    samples = units.expand(order)
    seqlen = t_sorted[off[1:] - 1] if len(off) > 1 else np.zeros(0, np.int64)
    batch = np.diff(sample_off)
    tokens = batching.segment_sum(lengths[samples], sample_off)
    return _deal(spec, samples, sample_off, seqlen, batch, tokens, per_rank)


def _greedy(t_sorted: np.ndarray, weight: np.ndarray, cap: np.ndarray, grouped: bool) -> np.ndarray:
    if grouped:
        return batching.greedy_weighted_offsets(cap, weight)
    return batching.greedy_offsets(t_sorted, cap)


def _even_offsets(spec: StepSpec, t_sorted: np.ndarray, weight: np.ndarray, grouped: bool, slots: int,
                  off: np.ndarray) -> np.ndarray:
    """The greedy microbatches under the lowest budget that still forms at most ``slots`` of them
    (a binary search to :data:`EVEN_PRECISION`): microbatch costs near the step's cost over ``slots``,
    so a few microbatches per rank still add up to equal ranks. The former itself, under a tighter
    budget; ``off`` (under the step's budget) when nothing lower works."""
    change = np.flatnonzero(t_sorted[1:] != t_sorted[:-1]) + 1
    distinct = t_sorted[np.concatenate([[0], change])] if len(t_sorted) else t_sorted
    which = np.repeat(np.arange(len(distinct)), np.diff(np.concatenate([[0], change, [len(t_sorted)]])))
    unit_cost = np.asarray(spec.budget.cost(weight, t_sorted), np.float64)
    lo = int(max(math.ceil(float(unit_cost.sum()) / slots), math.ceil(float(unit_cost.max(initial=0)))))
    hi = int(spec.budget.max_tokens)
    best = off
    while lo < hi and hi - lo > EVEN_PRECISION * hi:
        mid = (lo + hi) // 2
        cap = dataclasses.replace(spec.budget, max_tokens=mid).cap(distinct)[which]
        trial = None if bool(np.any(weight > cap)) else _greedy(t_sorted, weight, cap, grouped)
        if trial is not None and len(trial) - 1 <= slots:
            hi, best = mid, trial
        else:
            lo = mid + 1
    return best


def _deal(spec: StepSpec, samples, offsets, seqlen, batch, tokens, per_rank: int) -> Slots:
    """Padded microbatches plus the empty ones dealt to ranks (LPT on the cost), (rank, micro) order."""
    slots = spec.dp * per_rank
    empty = slots - len(seqlen)
    t_empty = int(spec.shape(np.zeros(1, np.int64))[0])
    seqlen = np.concatenate([seqlen, np.full(empty, t_empty, np.int64)])
    batch = np.concatenate([batch, np.ones(empty, np.int64)])
    tokens = np.concatenate([tokens, np.zeros(empty, np.int64)])
    offsets = np.concatenate([offsets, np.full(empty, offsets[-1], np.int64)])
    cost = np.asarray(spec.budget.cost(batch, seqlen), np.float64)
    rank = layout.assign_ranks(cost[None, :], spec.dp, per_rank)[0] if slots else np.zeros(0, np.int64)
    where = np.lexsort((np.arange(slots), rank))  # (rank, position) order
    mb = batching.Microbatches(samples, offsets, seqlen, batch, tokens).take(where)
    return Slots(mb.samples, mb.offsets, mb.seqlen, mb.batch_size, mb.tokens, cost[where], per_rank)


# -- packed ----------------------------------------------------------------------------------------
def form_packed(spec: StepSpec, lengths: np.ndarray, units: Units) -> Slots:
    """Units packed into ``dp x G x R`` rows, spread over ``dp x G`` microbatches, rows dealt by cost."""
    total = units.total(lengths)
    long_units = np.flatnonzero(total > spec.seq_len)
    if len(long_units) and (units.ids is not None or not spec.split):
        longest = long_units[np.argsort(-total[long_units], kind="stable")]
        why = ("a group must fit one packed row: raise seq_len" if units.ids is not None else
               "pass split=True to cut it into rows, or raise seq_len")
        raise _too_long(spec, units, lengths, longest, why)
    if units.ids is not None and spec.max_per_row is not None:
        raise InputError("max_per_row with groups: a packed row holds whole groups, so it cannot cap samples")
    p, per_rank = _pack_rows(spec, total, len(lengths))
    slots = spec.dp * per_rank
    if p.num_items < slots or not slots:  # fewer items than microbatches: one item each, the rest empty
        item_mb = np.arange(p.num_items, dtype=np.int64)
        mb = batching.Microbatches(p.item_sample, np.arange(p.num_items + 1, dtype=np.int64),
                                   np.full(p.num_items, spec.seq_len, np.int64),
                                   np.full(p.num_items, spec.rows_per_mb, np.int64), p.item_length.copy(),
                                   item_length=p.item_length, item_start=p.item_start,
                                   item_row=np.zeros(p.num_items, np.int64))
        return _expand_packed(spec, lengths, units, _deal_items(spec, mb, item_mb, per_rank))
    # the rows spread over the microbatches, the fullest split where they are too few (the tail rule)
    mb, _ = tail.fix_packed(p.item_sample, p.item_start, p.item_length, p.item_row, p.num_rows,
                            spec.rows_per_mb, spec.seq_len, slots, spec.dp, per_rank, "split")
    mb = balance.balance_rows(mb, spec.budget, spec.dp, per_rank, keep_order=True)  # (rank, micro) order
    return _expand_packed(spec, lengths, units, mb)


def _pack_rows(spec: StepSpec, total: np.ndarray, samples: int):
    """The step's rows and G: ``(packing, G)``. Rows dealt into the fewest microbatches the lower bound
    allows (:func:`varlen_cli.plan.packing.pack_into`, milliseconds; G as many as its rows need), and
    where one microbatch more a rank would cost over 1/:data:`EXACT_BELOW_PER_RANK` of the step, the
    planner's BFD (:func:`varlen_cli.plan.packing.pack`: exact, slower) when it needs fewer.
    ``max_per_row``: BFD, which honours it."""
    r = spec.rows_per_mb
    if spec.max_per_row is not None:
        p = pack(total, spec.seq_len, max_per_row=spec.max_per_row, order="none", split_long=spec.split)
        return p, microbatches_per_rank(spec, -(-p.num_rows // r), samples)
    full, rest = np.divmod(total, spec.seq_len)  # (split) full rows and the rest of each sample: the items
    big = int(full.sum()) + int(np.count_nonzero(2 * rest > spec.seq_len))  # items no row shares
    bound_rows = max(-(-int(total.sum()) // spec.seq_len), big, 1 if len(total) else 0)
    fewest = -(-bound_rows // (r * spec.dp))  # G at the lower bound on rows
    target = spec.num_microbatches if spec.num_microbatches is not None else fewest

    p = pack_into(total, spec.seq_len, spec.dp * target * r, split_long=spec.split, best_fit=False)
    if p is None:
        p = _pack_harder(spec, total, target)
    return p, microbatches_per_rank(spec, -(-p.num_rows // r), samples)


def _pack_harder(spec: StepSpec, total: np.ndarray, target: int):
    """Rows where the deal cannot fit ``target`` microbatches a rank: with many microbatches a rank, the
    deal into a few more (kept within :data:`DEALT_SLACK`); else BFD on the deal's last layers, and
    below :data:`EXACT_BELOW_PER_RANK` the planner's BFD; the fewest rows of those tried."""
    rows_of = spec.dp * spec.rows_per_mb
    dealt, g, step = None, target, 1
    if spec.num_microbatches is None and target >= EXACT_BELOW_PER_RANK:
        low = target  # the deal fails at low: more rows for it (one microbatch more a rank costs under 1%)
        while dealt is None:
            low, g, step = g, g + step, step * 2
            dealt = pack_into(total, spec.seq_len, rows_of * g, split_long=spec.split, best_fit=False)
        while g - low > 1:  # the fewest between the last failure and g
            mid = (low + g) // 2
            trial = pack_into(total, spec.seq_len, rows_of * mid, split_long=spec.split, best_fit=False)
            low, g, dealt = (low, mid, trial) if trial is not None else (mid, g, dealt)
        if g <= target * (1 + DEALT_SLACK):
            return dealt
    p = pack_into(total, spec.seq_len, rows_of * target, split_long=spec.split)  # BFD for the last layers
    if target < EXACT_BELOW_PER_RANK and p.num_rows > rows_of * target:
        exact = pack(total, spec.seq_len, order="none", split_long=spec.split)
        p = exact if exact.num_rows < p.num_rows else p
    return dealt if dealt is not None and dealt.num_rows < p.num_rows else p


def _deal_items(spec: StepSpec, mb: batching.Microbatches, item_mb: np.ndarray, per_rank: int):
    """Single-item microbatches and ``dp x G - items`` empty ones dealt by LPT, in (rank, micro) order."""
    slots = spec.dp * per_rank
    cost = np.zeros(slots)
    cost[:mb.count] = _packed_cost(spec, mb)
    rank = layout.assign_ranks(cost[None, :], spec.dp, per_rank)[0]
    where = np.lexsort((np.arange(slots), rank))
    mb_of_item = np.empty(mb.count, np.int64)
    mb_of_item[where[where < mb.count]] = np.flatnonzero(where < mb.count)
    order = np.argsort(mb_of_item[item_mb], kind="stable")
    counts = np.bincount(mb_of_item[item_mb], minlength=slots)
    offsets = np.zeros(slots + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    tokens = np.bincount(mb_of_item[item_mb], weights=mb.item_length, minlength=slots).astype(np.int64)
    return batching.Microbatches(mb.samples[order], offsets, np.full(slots, spec.seq_len, np.int64),
                                 np.full(slots, spec.rows_per_mb, np.int64), tokens,
                                 item_length=mb.item_length[order], item_start=mb.item_start[order],
                                 item_row=mb.item_row[order])


def _packed_cost(spec: StepSpec, mb: batching.Microbatches) -> np.ndarray:
    sum_squares = segment_sum_squares(mb.item_length, mb.offsets) if spec.budget.needs_segment_lengths else None
    return spec.budget.microbatch_cost(mb.tokens, mb.batch_size, mb.seqlen, sum_squares)


def _expand_packed(spec: StepSpec, lengths: np.ndarray, units: Units, mb: batching.Microbatches) -> Slots:
    """Packed microbatches of units as :class:`Slots` of samples (a group's members one after another,
    in its row)."""
    if units.ids is None:
        entries, length, start, row, offsets = mb.samples, mb.item_length, mb.item_start, mb.item_row, mb.offsets
    else:
        counts = units.expand_counts(mb.samples)
        entries = units.expand(mb.samples)
        length = lengths[entries]
        start = np.zeros(len(entries), np.int64)
        row = np.repeat(mb.item_row, counts)
        prefix = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=prefix[1:])
        offsets = prefix[mb.offsets]
    out = batching.Microbatches(entries, offsets, mb.seqlen, mb.batch_size, mb.tokens, item_length=length,
                                item_start=start, item_row=row)
    per_rank = len(mb.seqlen) // spec.dp
    return Slots(entries.astype(np.int64), offsets.astype(np.int64), mb.seqlen.astype(np.int64),
                 mb.batch_size.astype(np.int64), mb.tokens.astype(np.int64), _packed_cost(spec, out), per_rank,
                 np.asarray(length, np.int64), np.asarray(start, np.int64), np.asarray(row, np.int64))
