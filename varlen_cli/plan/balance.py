"""Compute-balanced packed plans (``--packing --attention-cost A``; issue 17).

A packed row's compute is not its token count: with varlen attention each segment of ``l`` tokens
costs ``l + A l^2`` (linear layers plus causal attention over the segment alone), so a row holding
one long document costs far more than a row of many short samples. A row costs its tokens plus
``A x sum(l_i^2)`` over its segments (a split chunk counts its own length), a microbatch the sum of
its rows (:func:`microbatch_cost`: :func:`varlen_cli.budget.packed_cost`, the one formula).

:func:`balance_rows` re-deals the rows the packer made (it never changes a row, so exactly-once,
``--max-per-row`` and the row length hold as packed) over the epoch's microbatches, and returns them
in (step, rank, micro) order; the layout keeps those ranks (``Formed.ranked``):

1. *Deal rows into rank-steps* (:func:`deal_rows`): the epoch has steps x dp rank-steps of
   grad_accum microbatches. Rows in decreasing cost, round by round: each round gives the next rows,
   largest first, to the rank-steps in increasing load (a longest-processing-time deal with the row
   count fixed: every rank-step gets ``q`` or ``q + 1`` rows, so no microbatch exceeds R rows).
   With several rows per rank-step this makes every rank-step cost about the same.
2. *Choose which rank-steps form a step*: rank-steps sorted by load and cut into steps of dp, so a
   step's ranks cost alike even when one row per rank leaves nothing to mix (a row holding one
   64k-token chunk is never in a step with light rows unless the counts force it). Shuffled plans
   also set dp rank-steps aside for the epoch's last step, chosen by an exact dynamic programme
   (:func:`cut_steps`) so the other steps do not straddle the jumps between cost classes.
3. *Split* a rank-step's rows (decreasing cost, serpentine) over its grad_accum microbatches.
4. *Order the steps*: shuffled (the former's ``rng``; the set-aside step last) for shuffled plans;
   curriculum plans do 1-3 inside windows of :data:`CURRICULUM_WINDOW_STEPS` consecutive steps and
   keep the windows, and inside a window the steps, in input (difficulty) order.

Vectorised: one numpy round per row of a rank-step, one cumulative minimum per rank set aside, one
loop per curriculum window.
"""

from __future__ import annotations

import numpy as np

from ..budget import Budget, packed_cost, segment_sum_squares
from ..errors import InternalConsistencyError
from .batching import Microbatches, segment_gather

CURRICULUM_WINDOW_STEPS = 64
"""Curriculum plans balance inside windows of this many steps (the order between windows is kept)."""
LAST_STEP_MAX_CELLS = 8_000_000
"""The last-step search (:func:`cut_steps`) runs when rank-steps x (dp + 1) is at most this."""


def cut_steps(load: np.ndarray, dp: int) -> np.ndarray:
    """Step of every rank-step, ``load`` sorted in decreasing order (``len(load)`` a multiple of dp):
    consecutive groups of dp, except dp rank-steps set aside for the last step so that the other
    steps do not straddle the jumps of the sorted loads. Minimises the sum over the other steps of
    (max - mean) / mean (exact dynamic programme over (position, rank-steps set aside), vectorised as one
    cumulative minimum per residue class and count set aside). The last step is K - 1."""
    n = len(load)
    steps = n // dp
    if steps < 2 or dp < 2 or n * (dp + 1) > LAST_STEP_MAX_CELLS:
        return np.arange(n) // dp
    prefix = np.concatenate([[0.0], np.cumsum(load)])
    rows = -(-(n + 1) // dp)
    size = rows * dp
    g = np.zeros(size)  # cost of the group ending at position i (its first is the max: sorted)
    end = np.arange(dp, n + 1)
    mean = (prefix[end] - prefix[end - dp]) / dp
    g[end] = (load[end - dp] - mean) / np.where(mean > 0, mean, 1.0)
    big = np.ascontiguousarray(np.cumsum(g.reshape(rows, dp), axis=0).T)  # (residue, row): chains contiguous
    f = np.full(size, np.inf)
    f[: n + 1: dp] = np.concatenate([[0.0], np.cumsum(g[dp: n + 1: dp])])
    src = np.empty((dp + 1, dp, rows), np.int32)  # where each layer's cumulative minimum was reached
    row_index = np.arange(rows, dtype=np.int32)
    for r in range(1, dp + 1):
        c = np.full(size, np.inf)
        c[1: n + 1] = f[:n]
        v = c.reshape(rows, dp).T - big
        best = np.minimum.accumulate(v, axis=1)
        src[r] = np.maximum.accumulate(np.where(v == best, row_index, 0), axis=1)
        f = (best + big).T.reshape(-1)
    if not np.isfinite(f[n]):
        return np.arange(n) // dp
    aside = np.zeros(n, bool)
    i = n
    for r in range(dp, 0, -1):
        start = int(src[r, i % dp, i // dp]) * dp + i % dp
        aside[start - 1] = True
        i = start - 1
    step = np.full(n, steps - 1, np.int64)
    step[~aside] = np.arange(n - dp) // dp
    return step


def microbatch_cost(mb: Microbatches, budget: Budget) -> np.ndarray:
    """Per microbatch, the cost ranks are balanced on (:meth:`varlen_cli.budget.Budget.microbatch_cost`):
    packed: tokens + A x sum(l_i^2) over its segments; padded: B*T + A*B*T^2."""
    sum_squares = segment_sum_squares(mb.item_length, mb.offsets) if budget.needs_segment_lengths else None
    return budget.microbatch_cost(mb.tokens, mb.batch_size, mb.seqlen, sum_squares)


def deal_rows(cost: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin of every row and load of every bin: rows in decreasing cost, dealt round by round, each
    round's largest row onto the least-loaded bin (every bin gets ``len(cost) // bins`` or one more
    row; needs ``len(cost) >= bins``)."""
    n = len(cost)
    if not n >= bins >= 1:
        raise InternalConsistencyError(f"cannot deal {n} rows into {bins} bins")
    order = np.argsort(-cost, kind="stable")
    bin_of = np.empty(n, np.int64)
    bin_of[order[:bins]] = np.arange(bins)
    load = cost[order[:bins]].astype(np.float64)
    for lo in range(bins, n, bins):
        rows = order[lo:lo + bins]
        target = np.argsort(load, kind="stable")[: len(rows)]
        bin_of[rows] = target
        load[target] += cost[rows]
    return bin_of, load


def _window(cost: np.ndarray, row_index: np.ndarray, dp: int, grad_accum: int, steps: int,
            keep_order: bool) -> np.ndarray:
    """Rows of one window of ``steps`` steps dealt into rank-steps, cut into steps, split into
    microbatches. Returns the window-local microbatch of every row, in (step, rank, micro) order."""
    bins = steps * dp
    bin_of, load = deal_rows(cost, bins)
    by_load = np.argsort(-load, kind="stable")
    step_sorted = np.arange(bins) // dp if keep_order else cut_steps(load[by_load], dp)
    step_of_bin = np.empty(bins, np.int64)
    step_of_bin[by_load] = step_sorted
    rank_of_bin = np.empty(bins, np.int64)
    rank_of_bin[by_load[np.argsort(step_sorted, kind="stable")]] = np.arange(bins) % dp
    if keep_order:  # steps in the order of their rows' mean position (difficulty)
        rows_per_step = np.bincount(step_of_bin[bin_of], minlength=steps)
        key = np.bincount(step_of_bin[bin_of], weights=row_index, minlength=steps) / np.maximum(rows_per_step, 1)
        step_rank = np.empty(steps, np.int64)
        step_rank[np.argsort(key, kind="stable")] = np.arange(steps)
        step_of_bin = step_rank[step_of_bin]
    # a rank-step's rows (by decreasing cost) dealt serpentine over its grad_accum microbatches
    order = np.lexsort((-cost, bin_of))
    first = np.searchsorted(bin_of[order], np.arange(bins), side="left")
    pos = np.empty(len(cost), np.int64)
    pos[order] = np.arange(len(cost)) - first[bin_of[order]]
    rnd, within = pos // grad_accum, pos % grad_accum
    micro = np.where(rnd % 2 == 0, within, grad_accum - 1 - within)
    return (step_of_bin[bin_of] * dp + rank_of_bin[bin_of]) * grad_accum + micro


def balance_rows(mb: Microbatches, budget: Budget, dp: int, grad_accum: int, *, keep_order: bool,
                 rng: np.random.Generator | None = None) -> Microbatches:
    """``mb`` (packed, count a multiple of dp x grad_accum) with its rows re-dealt over the same number
    of microbatches, returned in (step, rank, micro) order: the ranks of a step cost alike (see the
    module docstring; the layout keeps this rank assignment). ``keep_order``: curriculum (windows
    kept in order); else the steps are shuffled with ``rng``."""
    m = mb.count
    slots = dp * grad_accum
    if m == 0 or not len(mb.samples):
        return mb
    # global row of every item (items are sorted by microbatch, then row)
    parent = np.repeat(np.arange(m), np.diff(mb.offsets))
    new_row = np.ones(len(parent), bool)
    new_row[1:] = (parent[1:] != parent[:-1]) | (mb.item_row[1:] != mb.item_row[:-1])
    row_of_item = np.cumsum(new_row) - 1
    num_rows = int(row_of_item[-1]) + 1
    tokens = np.bincount(row_of_item, weights=mb.item_length, minlength=num_rows)
    sq = np.bincount(row_of_item, weights=mb.item_length.astype(np.float64) ** 2, minlength=num_rows)
    cost = packed_cost(tokens, sq, budget.attention_cost)
    mb_of_row = _deal_windows(cost, m, dp, grad_accum, keep_order)
    if not keep_order and rng is not None:  # shuffle whole steps; the set-aside step stays last
        steps = m // slots
        perm = np.empty(steps, np.int64)
        perm[rng.permutation(steps - 1)] = np.arange(steps - 1)
        perm[steps - 1] = steps - 1
        mb_of_row = perm[mb_of_row // slots] * slots + mb_of_row % slots
    return _rebuild(mb, row_of_item, mb_of_row, num_rows)


def _deal_windows(cost: np.ndarray, m: int, dp: int, grad_accum: int, keep_order: bool) -> np.ndarray:
    """Microbatch (0..m-1, in (step, rank, micro) order) of every row; windows of consecutive rows
    for curriculum."""
    num_rows = len(cost)
    slots = dp * grad_accum
    window_mbs = CURRICULUM_WINDOW_STEPS * slots if keep_order else m
    mb_of_row = np.empty(num_rows, np.int64)
    for first_mb in range(0, m, window_mbs):
        last_mb = min(m, first_mb + window_mbs)
        # rows spread evenly over microbatches (as the packer's layout did): this window's rows
        lo, hi = -(-first_mb * num_rows // m), -(-last_mb * num_rows // m)
        local = _window(cost[lo:hi], np.arange(lo, hi, dtype=np.float64), dp, grad_accum,
                        (last_mb - first_mb) // slots, keep_order)
        mb_of_row[lo:hi] = first_mb + local
    return mb_of_row


def _rebuild(mb: Microbatches, row_of_item: np.ndarray, mb_of_row: np.ndarray, num_rows: int) -> Microbatches:
    """Microbatches holding the rows ``mb_of_row`` says (rows of a microbatch in their old order,
    items of a row in their old order)."""
    m = mb.count
    row_order = np.lexsort((np.arange(num_rows), mb_of_row))  # rows in new (microbatch, old row) order
    row_new_index = np.empty(num_rows, np.int64)
    row_new_index[row_order] = np.arange(num_rows)
    row_counts = np.bincount(row_of_item, minlength=num_rows)
    row_start = np.zeros(num_rows + 1, np.int64)
    np.cumsum(row_counts, out=row_start[1:])
    new_counts = row_counts[row_order]
    new_row_start = np.zeros(num_rows + 1, np.int64)
    np.cumsum(new_counts, out=new_row_start[1:])
    idx = segment_gather(row_start[row_order], new_counts, new_row_start)
    sorted_mb = mb_of_row[row_order]
    first_row_of_mb = np.searchsorted(sorted_mb, np.arange(m), side="left")
    item_new_row = row_new_index[row_of_item[idx]]
    item_mb = sorted_mb[item_new_row]
    offsets = np.searchsorted(item_mb, np.arange(m + 1), side="left").astype(np.int64)
    local_row = item_new_row - first_row_of_mb[item_mb]
    length = mb.item_length[idx]
    return Microbatches(mb.samples[idx], offsets, mb.seqlen.copy(), mb.batch_size.copy(),
                        np.bincount(item_mb, weights=length, minlength=m).astype(np.int64),
                        item_length=length, item_start=mb.item_start[idx], item_row=local_row)
