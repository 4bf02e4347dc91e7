"""The last touch of a packed step: swaps between ranks that even their costs to the sample.

The formers deal whole rows to ranks, so a step's ranks differ by about a row's worth of cost where
the rows are few. Here, round after round, the costliest rank ``a`` and the cheapest ``b`` (or, when
no swap of theirs narrows the gap, the next cheapest, up to :data:`PARTNERS`) swap one block each (a
sample or a split chunk; with ``groups``, a group's members in their row): the pair whose cost
difference is nearest half their gap, among those where each row has room for the block it takes (a
costlier group may hold fewer tokens: the attention term counts squares). Rows stay within
``seq_len`` (without groups they keep their entry counts); microbatches keep their rows, so counts,
budget and ``max_per_row`` hold as formed. Each round is one vectorised search (a binary search of
``a``'s blocks among ``b``'s by cost); rounds stop when the gap is below :data:`TOLERANCE` of the
mean rank cost or one token's, no swap narrows it, or after :data:`ROUNDS_PER_RANK` x dp rounds. Deterministic
(ties to the lowest index). Imports only numpy.
"""

from __future__ import annotations

import numpy as np

from ..budget import segment_sum_squares
from .form import Slots
from .spec import StepSpec
from .units import Units

TOLERANCE = 1e-7
ROUNDS_PER_RANK = 2
NEIGHBOURS = np.arange(-3, 3)  # candidates around the ideal cost, in b's sorted blocks
CANDIDATES = 512  # the costliest rank's blocks a round tries at most
PARTNERS = 3  # the cheapest ranks the costliest tries, in turn, when a swap with the cheapest cannot narrow


def refine(spec: StepSpec, lengths: np.ndarray, slots: Slots, units: Units) -> Slots:
    """``slots`` with blocks swapped between ranks until their costs are even (see the module)."""
    if not spec.packed or spec.dp < 2 or not slots.per_rank or len(slots.entries) < 2:
        return slots
    g, r = slots.per_rank, spec.rows_per_mb
    slot_of = np.repeat(np.arange(spec.dp * g), np.diff(slots.offsets))
    row = slot_of * r + slots.entry_row  # global row of each entry
    block = _blocks(slots, row, units)
    a_cost = spec.budget.attention_cost
    length = np.bincount(block, weights=slots.entry_length).astype(np.int64)
    first = np.flatnonzero(np.diff(np.concatenate([[-1], block])))
    block_row = row[first]
    cost = length + a_cost * np.bincount(block, weights=slots.entry_length.astype(np.float64) ** 2)
    rank = block_row // (g * r)
    row_load = np.bincount(block_row, weights=length, minlength=spec.dp * g * r).astype(np.int64)
    rank_load = np.bincount(rank, weights=cost, minlength=spec.dp)
    swapped = False
    by_cost = np.argsort(cost, kind="stable")  # every rank's blocks in cost order, by one mask a round
    for _ in range(ROUNDS_PER_RANK * spec.dp):
        pair = _best_swap(rank, cost, length, block_row, row_load, rank_load, spec.seq_len, by_cost)
        if pair is None:
            break
        e, f = pair
        row_load[block_row[e]] += length[f] - length[e]
        row_load[block_row[f]] += length[e] - length[f]
        rank_load[rank[e]] += cost[f] - cost[e]
        rank_load[rank[f]] += cost[e] - cost[f]
        block_row[e], block_row[f] = block_row[f], block_row[e]
        rank[e], rank[f] = rank[f], rank[e]
        swapped = True
    return _rebuild(spec, slots, block, block_row[block], r) if swapped else slots


def _blocks(slots: Slots, row: np.ndarray, units: Units) -> np.ndarray:
    """Block of each entry: entries alone, or a group's consecutive members in one row together."""
    if units.ids is None:
        return np.arange(len(slots.entries))
    unit_of = np.empty(len(units.members), np.int64)
    unit_of[units.members] = np.repeat(np.arange(units.count), np.diff(units.offsets))
    u = unit_of[slots.entries]
    new = np.ones(len(u), bool)
    new[1:] = (u[1:] != u[:-1]) | (row[1:] != row[:-1])
    return np.cumsum(new) - 1


def _best_swap(rank, cost, length, block_row, row_load, rank_load, seq_len, by_cost):
    """The swap between a block of the costliest rank and one of the cheapest rank with which one
    narrows their gap (the cheapest first), nearest half that gap; None when there is none."""
    a = int(np.argmax(rank_load))
    if float(rank_load[a] - rank_load.min()) <= max(TOLERANCE * float(rank_load.mean()), 1.0):
        return None  # (a swap moves at least one token: a gap of one cannot narrow)
    mine = by_cost[rank[by_cost] == a]
    if len(mine) > CANDIDATES:  # evenly spread over a's costs: enough to find a swap near any gap
        mine = mine[np.linspace(0, len(mine) - 1, CANDIDATES).astype(np.int64)]
    for b in np.argsort(rank_load, kind="stable")[:PARTNERS].tolist():
        if b == a:
            break
        gap = float(rank_load[a] - rank_load[b])
        theirs = by_cost[rank[by_cost] == b]  # b's blocks, cheapest first
        if not len(theirs):
            continue
        at = np.searchsorted(cost[theirs], cost[mine] - gap / 2)
        cand = np.clip(at[:, None] + NEIGHBOURS[None, :], 0, len(theirs) - 1)
        e = np.broadcast_to(mine[:, None], cand.shape).reshape(-1)
        f = theirs[cand.reshape(-1)]
        delta = cost[e] - cost[f]
        grow = length[e] - length[f]  # a costlier block may hold fewer tokens (attention: squares)
        room = np.where(grow >= 0, seq_len - row_load[block_row[f]] >= grow,  # b's row takes e
                        seq_len - row_load[block_row[e]] >= -grow)  # a's row takes f
        ok = (delta > 0) & (delta < gap) & room
        if ok.any():
            k = int(np.argmin(np.where(ok, np.abs(delta - gap / 2), np.inf)))
            return int(e[k]), int(f[k])
    return None


def _rebuild(spec: StepSpec, slots: Slots, block: np.ndarray, entry_row: np.ndarray, r: int) -> Slots:
    """Slots with each entry in its (new) row: entries by global row, in their old order within one."""
    order = np.argsort(entry_row, kind="stable")
    n_slots = spec.dp * slots.per_rank
    row = entry_row[order]
    slot = row // r
    offsets = np.searchsorted(slot, np.arange(n_slots + 1), side="left").astype(np.int64)
    length = slots.entry_length[order]
    tokens = np.bincount(slot, weights=length, minlength=n_slots).astype(np.int64)
    sum_squares = segment_sum_squares(length, offsets) if spec.budget.needs_segment_lengths else None
    cost = spec.budget.microbatch_cost(tokens, slots.batch, slots.seqlen, sum_squares)
    return Slots(slots.entries[order], offsets, slots.seqlen, slots.batch, tokens, cost, slots.per_rank, length,
                 slots.entry_start[order], row - slot * r)
