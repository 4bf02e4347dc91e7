"""The tail rule: an epoch's microbatch count made a multiple of dp x grad_accum, in one place.

The rule: split the fullest microbatches in two, the fullest first and the earliest among equals,
until the count is a multiple (never duplicating, never dropping a sample). Only when there are
fewer samples than microbatch slots: ``--tail drop`` drops the microbatches with the fewest samples
(the latest among equals), else it is refused in one line. Packed plans split their fullest rows
the same way when they have fewer rows than microbatches, and drop whole rows (a split sample goes
whole) under ``--tail drop``.

Two callers apply it:

* an epoch formed whole (:func:`fix_padded`, :func:`fix_packed`: the formers of :mod:`.orders`);
* the unit tables of a chunked epoch (:func:`fix`): the units of all chunks are one sequence in
  (chunk, position) order, and the rule runs on their counts. The fullest units are among the
  chunks' reported candidates (each chunk reports its ``dp x grad_accum`` fullest with their
  halves' statistics, :func:`top_candidates`), so one round is a merge of those
  (:func:`round_one`); when fewer units than needed have two samples, every chunk has reported all
  of its splittable units with their items' lengths, and the rounds run on those
  (:func:`all_rounds`). The result is a :class:`Tail`: which units become which pieces, or which
  units are dropped.

Both run the same primitives: :func:`split_rounds` (which microbatches split), :func:`fewest`
(which are dropped) and :func:`refusal` (the one-line error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from .batching import Microbatches, packed_microbatches, segment_gather
from .layout import PLAN_REMEDIES, Remedies, tail_message


def slots_target(m: int, slots: int) -> int:
    """The microbatch count an epoch of ``m`` is brought to: the next multiple of ``slots``."""
    return slots * -(-m // slots)


def split_rounds(offsets: np.ndarray, extra: int) -> np.ndarray:
    """CSR ``offsets`` with ``extra`` more microbatches: each round splits the fullest ones (>= 2 items;
    the earliest among equals) in two halves, until ``extra`` are added or none can split."""
    while extra > 0:
        counts = np.diff(offsets)
        cand = np.flatnonzero(counts >= 2)
        if not len(cand):
            break
        pick = cand[np.argsort(-counts[cand], kind="stable")[:extra]]
        offsets = np.sort(np.concatenate([offsets, offsets[pick] + counts[pick] // 2]))
        extra -= len(pick)
    return offsets


def fewest(counts: np.ndarray, slots: int) -> np.ndarray:
    """``--tail drop``: the microbatches (indices, ascending) with the fewest items, the latest among
    equals, whose removal leaves a multiple of ``slots``."""
    m = len(counts)
    rank = np.lexsort((-np.arange(m), counts))
    return np.sort(rank[: m - slots * (m // slots)])


def refusal(n: int, target: int, slots: int, dp: int, grad_accum: int, tail: str, what: str = "samples",
            remedies: Remedies = PLAN_REMEDIES) -> InputError:
    """The error for ``n`` items that cannot fill ``target`` slots (split) or leave nothing (drop)."""
    if tail != "drop":
        return InputError(tail_message(n, target, dp, grad_accum, what, remedies))
    return InputError(f"{n:,} {what} are fewer than the {slots:,} microbatches of one step (dp x grad-accum); "
                      "nothing would be left after --tail drop: lower --dp/--grad-accum")


# -- an epoch formed whole ---------------------------------------------------------------------------
def fix_padded(mb: Microbatches, slots: int, dp: int, grad_accum: int, tail: str,
               refinalize: Callable[[np.ndarray, np.ndarray], Microbatches],
               remedies: Remedies = PLAN_REMEDIES) -> tuple[Microbatches, np.ndarray]:
    """The rule on an epoch's padded microbatches: the fixed microbatches (``refinalize(samples,
    offsets)`` recomputes their shapes) and the samples ``--tail drop`` dropped."""
    m = mb.count
    target = slots_target(m, slots)
    if target == m:
        return mb, np.zeros(0, np.int64)
    n = len(mb.samples)
    if n >= target:
        return refinalize(mb.samples, split_rounds(mb.offsets, target - m)), np.zeros(0, np.int64)
    if tail != "drop" or m < slots:
        raise refusal(n, target, slots, dp, grad_accum, tail, remedies=remedies)
    drop = fewest(np.diff(mb.offsets), slots)
    mask = np.ones(m, dtype=bool)
    mask[drop] = False
    dropped = np.concatenate([mb.samples[mb.offsets[k]:mb.offsets[k + 1]] for k in drop.tolist()])
    kept = mb.take(np.flatnonzero(mask))
    return refinalize(kept.samples, kept.offsets), dropped


def _row_starts(item_row: np.ndarray) -> np.ndarray:
    flag = np.ones(len(item_row), dtype=bool)
    flag[1:] = item_row[1:] != item_row[:-1]
    return flag


def fix_packed(samples: np.ndarray, start: np.ndarray, length: np.ndarray, item_row: np.ndarray, num_rows: int,
               rows_per_mb: int, seq_len: int, slots: int, dp: int, grad_accum: int,
               tail: str, remedies: Remedies = PLAN_REMEDIES) -> tuple[Microbatches, np.ndarray]:
    """The rule on an epoch's packed rows (items sorted by row): spread over a multiple of ``slots``
    microbatches of at most ``rows_per_mb`` rows (the rest padding rows), the fullest rows split when
    there are fewer rows than microbatches; ``--tail drop`` drops whole rows from the end."""
    target = slots_target(-(-num_rows // rows_per_mb), slots)
    dropped = np.zeros(0, np.int64)
    items = len(samples)
    if items < target:
        keep_mbs = slots * (-(-num_rows // rows_per_mb) // slots)
        if tail != "drop" or keep_mbs == 0:
            raise refusal(items, target, slots, dp, grad_accum, tail, "packed samples", remedies)
        cut = int(np.searchsorted(item_row, min(num_rows, keep_mbs * rows_per_mb), side="left"))
        dropped = samples[cut:]
        keep = (np.arange(len(samples)) < cut) & ~np.isin(samples, dropped)  # a split sample goes whole
        dropped = np.unique(dropped)
        samples, start, length, item_row = samples[keep], start[keep], length[keep], item_row[keep]
        flag = _row_starts(item_row)
        item_row = np.cumsum(flag) - 1
        num_rows, target = int(flag.sum()), keep_mbs
        if len(samples) < target:
            raise refusal(len(samples), target, slots, dp, grad_accum, "split", "packed samples", remedies)
    if num_rows < target:  # split the fullest rows in two
        row_off = np.searchsorted(item_row, np.arange(num_rows + 1), side="left")
        cuts = split_rounds(row_off, target - num_rows)
        flag = np.zeros(len(item_row), dtype=bool)
        flag[cuts[:-1]] = True
        item_row = np.cumsum(flag) - 1
        num_rows = len(cuts) - 1
    return packed_microbatches(samples, start, length, item_row, num_rows, seq_len, rows_per_mb, target), dropped


# -- the unit tables of a chunked epoch ----------------------------------------------------------------
@dataclass
class Tail:
    """Units (sequence positions, ascending) replaced by pieces, or dropped."""

    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pieces: dict = field(default_factory=dict)  # per piece: the unit columns and item_offset (inside its unit)
    piece_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # pieces per position
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # positions of dropped units


def top_candidates(counts: np.ndarray, slots: int) -> tuple[np.ndarray, bool]:
    """A chunk's candidates: the (up to) ``slots`` units with the most items (at least 2), most first,
    ties by position; and whether they are all the units with >= 2 items."""
    cand = np.flatnonzero(counts >= 2)
    pick = cand[np.argsort(-counts[cand], kind="stable")[:slots]]
    return pick.astype(np.int64), len(pick) == len(cand)


def merged_candidates(tables: list, unit_start: np.ndarray) -> dict:
    """The chunks' candidates as one table: global position, count and the halves' columns."""
    out: dict = {}
    for k, t in enumerate(tables):
        cand = t.candidates
        if not len(cand.get("index", ())):
            continue
        index = np.asarray(cand["index"], np.int64)
        parts = {"g": unit_start[k] + index, "count": np.asarray(cand["count"]).astype(np.int64)}
        for name, values in cand.items():
            if name.startswith("half_"):
                parts[name] = np.asarray(values).reshape(len(index), 2)
        for name, values in parts.items():
            out.setdefault(name, []).append(values)
    return {name: np.concatenate(v) for name, v in out.items()}


def round_one(cand: dict, extra: int) -> Tail | None:
    """One round of splits from the merged candidates (most items first, then earliest), or None
    when fewer than ``extra`` units can split."""
    if not len(cand.get("g", ())):
        return None
    pick = np.lexsort((cand["g"], -cand["count"]))[:extra]
    if len(pick) < extra:
        return None
    pick = pick[np.argsort(cand["g"][pick], kind="stable")]
    pieces = {name[5:]: cand[name][pick].reshape(-1) for name in cand if name.startswith("half_")}
    first = pieces["count"].reshape(-1, 2)[:, 0]
    pieces["item_offset"] = np.stack([np.zeros(len(pick), np.int64), first.astype(np.int64)], axis=1).reshape(-1)
    return Tail(cand["g"][pick], pieces, np.full(len(pick), 2, np.int64))


def all_rounds(tables: list, unit_start: np.ndarray, extra: int, refinalize) -> Tail:
    """:func:`split_rounds` on every unit with >= 2 items (each chunk reported them all, with their
    items' lengths). ``refinalize(lengths, offsets, extras)``: the pieces' columns (``extras``: the
    per-item arrays the chunks reported besides lengths)."""
    g_parts, len_parts, count_parts, extra_parts = [], [], [], {}
    for k, t in enumerate(tables):
        cand = t.candidates
        if not len(cand.get("index", ())):
            continue
        g_parts.append(unit_start[k] + np.asarray(cand["index"], np.int64))
        len_parts.append(np.asarray(cand["lengths"], np.int64))
        count_parts.append(np.diff(np.asarray(cand["offsets"], np.int64)))
        for name in ("final", "target"):
            if name in cand:
                extra_parts.setdefault(name, []).append(np.asarray(cand[name]))
    g = np.concatenate(g_parts)
    order = np.argsort(g, kind="stable")  # the units in sequence order (each chunk lists them fullest first)
    counts = np.concatenate(count_parts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    idx = segment_gather(starts[:-1][order], counts[order], np.concatenate([[0], np.cumsum(counts[order])]))
    lengths = np.concatenate(len_parts)[idx]
    extras = {name: np.concatenate(v)[idx] for name, v in extra_parts.items()}
    g, counts = g[order], counts[order]
    unit_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    offsets = split_rounds(unit_off, extra)
    pieces = refinalize(lengths, offsets, extras)
    owner = np.searchsorted(unit_off, offsets[:-1], side="right") - 1
    pieces["item_offset"] = offsets[:-1] - unit_off[owner]
    return Tail(g, pieces, np.bincount(owner, minlength=len(g)).astype(np.int64))


def fix(counts: np.ndarray, tables: list, unit_start: np.ndarray, slots: int, dp: int, grad_accum: int, tail: str,
        refinalize, what: str = "samples", extra: int | None = None, remedies: Remedies = PLAN_REMEDIES) -> Tail:
    """What makes a chunked epoch's unit count (``counts``: items per unit, sequence order) a multiple
    of ``slots`` (or ``extra`` more units, when given: packed rows, which are never dropped)."""
    m = len(counts)
    target = slots_target(m, slots) if extra is None else m + extra
    if target == m:
        return Tail()
    n = int(counts.sum())
    if n >= target:
        done = round_one(merged_candidates(tables, unit_start), target - m)
        return done if done is not None else all_rounds(tables, unit_start, target - m, refinalize)
    if extra is not None or tail != "drop" or m < slots:
        raise refusal(n, target, slots, dp, grad_accum, "split" if extra is not None else tail, what, remedies)
    return Tail(dropped=fewest(counts, slots))
