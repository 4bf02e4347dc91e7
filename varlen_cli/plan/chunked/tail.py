"""Phase 2, the tail of a chunked epoch: make its microbatch count a multiple of dp x grad_accum.

The single-process rule (``layout.fix_tail_padded``): split the fullest microbatches in two, the
fullest first and the earliest among equals, until the count is a multiple; with fewer samples
than microbatch slots, ``--tail drop`` drops the microbatches with the fewest samples (the latest
among equals), else it is an error. Here the units of all chunks form one table in (chunk,
position) order, and the rule runs on the table: the fullest units are among the chunks' reported
candidates (each chunk reports its ``dp x grad_accum`` fullest, with their halves' statistics), so
one round is a merge of those; when fewer units than needed have two samples, every chunk has
reported all of its splittable units with their items' lengths, and the rounds run on those.

A split unit becomes two rows of the table that take its place; their items are the two halves of
its item range. The packed counterpart splits rows (:func:`split_rows`).
"""

from __future__ import annotations

import numpy as np

from ...errors import InputError
from .. import batching, layout


def merged_candidates(tables: list, unit_start: np.ndarray) -> dict:
    """The chunks' candidates as one table: global unit index, count and the halves' columns."""
    out: dict = {}
    for k, t in enumerate(tables):
        cand = t.candidates
        if not len(cand.get("index", ())):
            continue
        index = np.asarray(cand["index"], np.int64)
        parts = {"g": unit_start[k] + index, "count": t.units["count"][index].astype(np.int64)}
        for name, values in cand.items():
            if name.startswith("half_"):
                parts[name] = np.asarray(values).reshape(len(index), 2)
        for name, values in parts.items():
            out.setdefault(name, []).append(values)
    return {name: np.concatenate(v) for name, v in out.items()}


def pick_splits(cand: dict, extra: int) -> np.ndarray:
    """Positions (in ``cand``) of the ``extra`` units to split: most items first, then earliest."""
    if not extra or not len(cand.get("g", ())):
        return np.zeros(0, np.int64)
    order = np.lexsort((cand["g"], -cand["count"]))
    return order[:extra]


def apply_splits(cols: dict, picks_g: np.ndarray, halves: dict) -> dict:
    """``cols`` (per unit, ``item_lo`` and ``count`` among them) with each unit in ``picks_g`` replaced by
    its two halves (``halves[name]``: (len(picks_g), 2) per column, ``count`` included)."""
    m = len(cols["count"])
    reps = np.ones(m, np.int64)
    reps[picks_g] = 2
    src = np.repeat(np.arange(m), reps)
    out = {name: values[src] for name, values in cols.items()}
    first = (np.cumsum(reps) - reps)[picks_g]
    for name, pair in halves.items():
        out[name][first] = pair[:, 0]
        out[name][first + 1] = pair[:, 1]
    out["item_lo"][first + 1] = cols["item_lo"][picks_g] + halves["count"][:, 0]
    return out


def round_one(cols: dict, cand: dict, extra: int) -> dict | None:
    """One round of splits from the merged candidates, or None when fewer than ``extra`` can split."""
    pick = pick_splits(cand, extra)
    if len(pick) < extra:
        return None
    pick = pick[np.argsort(cand["g"][pick], kind="stable")]
    halves = {name[5:]: cand[name][pick] for name in cand if name.startswith("half_")}
    return apply_splits(cols, cand["g"][pick], halves)


def all_rounds(cols: dict, tables: list, unit_start: np.ndarray, extra: int, refinalize) -> dict:
    """The single-process loop on every unit with >= 2 items (each chunk reported them all, with
    their items' lengths): the pieces replace their units. ``refinalize(lengths, offsets, extras)``
    gives the pieces' columns (``extras``: the per-item arrays the chunks reported besides lengths)."""
    g_parts, len_parts, off_parts, extra_parts = [], [], [], {}
    for k, t in enumerate(tables):
        cand = t.candidates
        if not len(cand.get("index", ())):
            continue
        if not cand["complete"] or "lengths" not in cand:  # pragma: no cover - chunks report all then
            raise AssertionError("a chunk did not report all its splittable units")
        g_parts.append(unit_start[k] + np.asarray(cand["index"], np.int64))
        len_parts.append(np.asarray(cand["lengths"], np.int64))
        off_parts.append(np.diff(np.asarray(cand["offsets"], np.int64)))
        for name in cand:
            if name in ("final",):
                extra_parts.setdefault(name, []).append(np.asarray(cand[name]))
    g = np.concatenate(g_parts)
    order = np.argsort(g, kind="stable")  # the units in table order (each chunk lists them fullest first)
    counts = np.concatenate(off_parts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    idx = batching.segment_gather(starts[:-1][order], counts[order], np.concatenate([[0], np.cumsum(counts[order])]))
    lengths = np.concatenate(len_parts)[idx]
    extras = {name: np.concatenate(v)[idx] for name, v in extra_parts.items()}
    g, counts = g[order], counts[order]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    while extra > 0:  # layout.fix_tail_padded's rounds, on the splittable units only
        c = np.diff(offsets)
        cand = np.flatnonzero(c >= 2)
        if not len(cand):
            break
        pick = cand[np.argsort(-c[cand], kind="stable")[:extra]]
        offsets = np.sort(np.concatenate([offsets, offsets[pick] + c[pick] // 2]))
        extra -= len(pick)
    pieces = refinalize(lengths, offsets, extras)
    owner = np.searchsorted(np.concatenate([[0], np.cumsum(counts)]), offsets[:-1], side="right") - 1
    reps = np.ones(len(cols["count"]), np.int64)
    reps[g] = np.bincount(owner, minlength=len(g))
    src = np.repeat(np.arange(len(reps)), reps)
    out = {name: values[src] for name, values in cols.items()}
    first = (np.cumsum(reps) - reps)[g]
    piece_pos = np.repeat(first, reps[g]) + (np.arange(len(owner)) - np.repeat(np.cumsum(reps[g]) - reps[g], reps[g]))
    for name, values in pieces.items():
        out[name][piece_pos] = values
    unit_first_item = np.concatenate([[0], np.cumsum(counts)])[:-1]
    out["item_lo"][piece_pos] = cols["item_lo"][g][owner] + (offsets[:-1] - unit_first_item[owner])
    return out


def drop_fewest(cols: dict, slots: int) -> tuple[dict, np.ndarray]:
    """``--tail drop``: the units with the fewest items dropped (the latest among equals) so the count
    is a multiple of ``slots``; returns the kept table and the dropped units' table positions."""
    m = len(cols["count"])
    keep_count = slots * (m // slots)
    rank = np.lexsort((-np.arange(m), cols["count"]))
    drop = np.sort(rank[: m - keep_count])
    mask = np.ones(m, bool)
    mask[drop] = False
    return {name: values[mask] for name, values in cols.items()}, drop


def fix(cols: dict, tables: list, unit_start: np.ndarray, slots: int, dp: int, grad_accum: int, tail: str,
        refinalize, what: str = "samples") -> tuple[dict, np.ndarray]:
    """The epoch's table with a multiple of ``slots`` units (see the module docstring); also the
    table positions of units dropped by ``--tail drop``."""
    m = len(cols["count"])
    target = slots * -(-m // slots)
    none = np.zeros(0, np.int64)
    if target == m:
        return cols, none
    n = int(cols["count"].sum())
    if n >= target:
        done = round_one(cols, merged_candidates(tables, unit_start), target - m)
        if done is None:
            done = all_rounds(cols, tables, unit_start, target - m, refinalize)
        return done, none
    if tail != "drop" or slots * (m // slots) == 0:
        raise InputError(layout.tail_message(n, target, dp, grad_accum, what) if tail != "drop" else
                         f"{n:,} {what} are fewer than the {slots:,} microbatches of one step (dp x grad-accum); "
                         "nothing would be left after --tail drop: lower --dp/--grad-accum")
    return drop_fewest(cols, slots)
