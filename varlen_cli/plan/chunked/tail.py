"""Phase 2, the tail of a chunked epoch: make its microbatch count a multiple of dp x grad_accum.

The single-process rule (``layout.fix_tail_padded``): split the fullest microbatches in two, the
fullest first and the earliest among equals, until the count is a multiple; with fewer samples
than microbatch slots, ``--tail drop`` drops the microbatches with the fewest samples (the latest
among equals), else it is an error. Here the units of all chunks are one sequence in (chunk,
position) order, and the rule runs on their counts: the fullest units are among the chunks'
reported candidates (each chunk reports its ``dp x grad_accum`` fullest, with their halves'
statistics), so one round is a merge of those; when fewer units than needed have two samples,
every chunk has reported all of its splittable units with their items' lengths, and the rounds run
on those.

The result is a :class:`Tail`: which units become which pieces (their columns, and where each
piece's items start inside its unit), or which units are dropped. The packed counterpart splits
rows the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import InputError
from .. import batching, layout


@dataclass
class Tail:
    """Units (sequence positions, ascending) replaced by pieces, or dropped."""

    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pieces: dict = field(default_factory=dict)  # per piece: the unit columns and item_offset (inside its unit)
    piece_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # pieces per position
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # positions of dropped units


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
    """The single-process loop on every unit with >= 2 items (each chunk reported them all, with their
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
    idx = batching.segment_gather(starts[:-1][order], counts[order], np.concatenate([[0], np.cumsum(counts[order])]))
    lengths = np.concatenate(len_parts)[idx]
    extras = {name: np.concatenate(v)[idx] for name, v in extra_parts.items()}
    g, counts = g[order], counts[order]
    unit_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    offsets = unit_off
    while extra > 0:  # layout.fix_tail_padded's rounds, on the splittable units only
        c = np.diff(offsets)
        cand = np.flatnonzero(c >= 2)
        if not len(cand):
            break
        pick = cand[np.argsort(-c[cand], kind="stable")[:extra]]
        offsets = np.sort(np.concatenate([offsets, offsets[pick] + c[pick] // 2]))
        extra -= len(pick)
    pieces = refinalize(lengths, offsets, extras)
    owner = np.searchsorted(unit_off, offsets[:-1], side="right") - 1
    pieces["item_offset"] = offsets[:-1] - unit_off[owner]
    return Tail(g, pieces, np.bincount(owner, minlength=len(g)).astype(np.int64))


def drop_fewest(counts: np.ndarray, slots: int) -> Tail:
    """``--tail drop``: the units with the fewest items dropped (the latest among equals) so the count
    is a multiple of ``slots``."""
    m = len(counts)
    keep_count = slots * (m // slots)
    rank = np.lexsort((-np.arange(m), counts))
    return Tail(dropped=np.sort(rank[: m - keep_count]))


def fix(counts: np.ndarray, tables: list, unit_start: np.ndarray, slots: int, dp: int, grad_accum: int, tail: str,
        refinalize, what: str = "samples", extra: int | None = None,
        remedies: layout.Remedies = layout.PLAN_REMEDIES) -> Tail:
    """What makes the epoch's unit count (``counts``: items per unit, sequence order) a multiple of
    ``slots`` (or ``extra`` more units, when given)."""
    m = len(counts)
    target = slots * -(-m // slots) if extra is None else m + extra
    if target == m:
        return Tail()
    n = int(counts.sum())
    if n >= target:
        done = round_one(merged_candidates(tables, unit_start), target - m)
        return done if done is not None else all_rounds(tables, unit_start, target - m, refinalize)
    if extra is not None or tail != "drop" or slots * (m // slots) == 0:
        raise InputError(layout.tail_message(n, target, dp, grad_accum, what, remedies) if tail != "drop" or
                         extra is not None
                         else f"{n:,} {what} are fewer than the {slots:,} microbatches of one step (dp x grad-accum); "
                         "nothing would be left after --tail drop: lower --dp/--grad-accum")
    return drop_fewest(counts, slots)
