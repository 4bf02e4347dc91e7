"""Phase 2: one epoch's steps and ranks, from its chunks' unit tables (rank 0; no sample is read).

:func:`lay_out` concatenates the chunks' tables in chunk order, fixes the tail (:mod:`.tail`),
groups packed rows into microbatches, orders the units across chunks (:func:`cross_chunk_order`) and
hands the microbatch table to the single-process layout (``layout.layout_epoch``: ranks by LPT,
compile warm-up; ``--schedule``). The result, :class:`EpochRows`, is the epoch's plan rows in
(step, rank, micro) order with where each row's items lie in the chunk files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ... import format
from .. import batching, layout
from ..batching import Microbatches
from ..orders import CURRICULAR
from . import tail
from .form import PlanContext

WINDOW_STEPS = 64  # bucket-shuffle: microbatches sorted by cost inside windows of this many steps


@dataclass
class EpochRows:
    """An epoch's plan rows in (step, rank, micro) order: per row its columns and its items' place
    (``chunk``, ``item_lo``, ``count``; packed microbatches also ``rows``, and when formed in phase 2
    from the chunks' rows ``row_lo``, with the rows' item counts in ``row_counts_flat``)."""

    mode: str
    cols: dict  # per row: chunk, item_lo, count, seqlen, batch, tokens, completed, lost, cost, (rows, row_lo)
    warmup_steps: int = 0
    warmup_missing: int = 0
    schedule_order: dict | None = None
    tail_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dropped_units: dict | None = None  # --tail drop in phase 2: chunk, item_lo, count of each dropped unit
    item_rows: bool = False  # the chunk files hold each item's row inside its microbatch
    row_counts_flat: np.ndarray | None = None  # chunk-level packed rows: item count per row, chunk after chunk
    row_start: np.ndarray | None = None  # first row of each chunk in row_counts_flat

    @property
    def count(self) -> int:
        return len(self.cols["count"])


def _concat(tables: list, columns) -> tuple[dict, np.ndarray]:
    """Units of all chunks in chunk order: the given columns plus chunk, item_lo; and each chunk's first unit."""
    counts = np.array([t.count for t in tables], np.int64)
    unit_start = np.concatenate([[0], np.cumsum(counts)])
    cols = {name: np.concatenate([np.asarray(t.units[name]) for t in tables]) for name in columns}
    cols["chunk"] = np.repeat(np.arange(len(tables), dtype=np.int32), counts)
    cols["item_lo"] = np.concatenate([np.asarray(t.offsets[:-1], np.int64) for t in tables])
    return cols, unit_start


def interleave(labels_count: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random interleaving of sequences of the given lengths: the units (numbered
    sequence after sequence) in the order of a random permutation of the multiset of labels."""
    labels = np.repeat(np.arange(len(labels_count), dtype=np.int32), labels_count)
    if len(labels_count) <= 1:
        return np.arange(len(labels), dtype=np.int64)
    perm_labels = labels[rng.permutation(len(labels))]
    where = np.argsort(perm_labels, kind="stable")  # unit j (sequence-major) sits at position where[j]
    seq = np.empty(len(labels), np.int64)
    seq[where] = np.arange(len(labels), dtype=np.int64)
    return seq


def windowed_steps(seq: np.ndarray, cost: np.ndarray, slots: int, rng: np.random.Generator) -> np.ndarray:
    """Bucket-shuffle balance: ``seq`` sorted by cost inside windows of WINDOW_STEPS steps, cut into
    steps, and the steps shuffled inside their window (so the ranks of a step finish together)."""
    m = len(seq)
    window = np.arange(m) // (WINDOW_STEPS * slots)
    seq = seq[np.lexsort((cost[seq], window))]
    steps = m // slots
    step_window = np.arange(steps) // WINDOW_STEPS
    step_order = np.lexsort((rng.random(steps), step_window))
    return seq.reshape(steps, slots)[step_order].reshape(-1)


def cross_chunk_order(mode: str, per_chunk: np.ndarray, cost: np.ndarray, slots: int, rng,
                      whole_steps: bool) -> np.ndarray:
    """Unit order of the epoch: curriculum keeps the chunks one after another; other orders take a
    random interleaving (of whole steps for step-level chunks), bucket-shuffle then its windows."""
    if mode in CURRICULAR:
        return np.arange(int(per_chunk.sum()), dtype=np.int64)
    if whole_steps:
        steps = interleave(per_chunk // slots, rng)
        return (steps[:, None] * slots + np.arange(slots)[None, :]).reshape(-1)
    seq = interleave(per_chunk, rng)
    if mode == "bucket-shuffle":
        seq = windowed_steps(seq, cost, slots, rng)
    return seq


def _padded_refinalize(ctx: PlanContext):
    def refinalize(lengths, offsets, extras):
        mb = batching.finalize_padded(np.arange(len(lengths)), offsets, lengths, ctx.shape, ctx.budget, ctx.static,
                                      ctx.fixed_batch)
        nonempty = batching.segment_sum((lengths > 0).astype(np.int32), offsets)
        return {"count": np.diff(offsets).astype(np.int32), "seqlen": mb.seqlen.astype(np.int32),
                "batch": mb.batch_size.astype(np.int32), "tokens": mb.tokens, "nonempty": nonempty.astype(np.int32)}
    return refinalize


def _row_refinalize(lengths, offsets, extras):
    final = extras["final"]
    return {"count": np.diff(offsets).astype(np.int32),
            "tokens": batching.segment_sum(lengths, offsets).astype(np.int64),
            "completed": batching.segment_sum(final.astype(np.int32), offsets).astype(np.int32),
            "lost": batching.segment_sum(((lengths > 0) & final).astype(np.int32), offsets).astype(np.int32)}


def _padded_table(tables: list, ctx: PlanContext, unit_level: bool) -> tuple[dict, dict | None]:
    """The padded units of all chunks (their tail fixed) and the units ``--tail drop`` dropped."""
    cols, start = _concat(tables, ("count", "seqlen", "batch", "tokens", "nonempty"))
    dropped = None
    if unit_level:
        before = cols
        cols, drop = tail.fix(cols, tables, start, ctx.slots, ctx.dp, ctx.grad_accum, ctx.tail,
                              _padded_refinalize(ctx))
        if len(drop):
            dropped = {name: before[name][drop] for name in ("chunk", "item_lo", "count")}
    cols["completed"] = cols["count"]
    cols["lost"] = cols.pop("nonempty")  # loss targets = tokens - one per non-empty sample
    return cols, dropped


def _packed_rows_to_microbatches(tables: list, ctx: PlanContext) -> tuple[dict, list]:
    """Chunk-level packed rows grouped into microbatches of at most R consecutive rows of one chunk:
    each chunk spreads its rows evenly over ceil(rows / R) microbatches, plus the epoch's extra
    microbatches (to a multiple of dp x grad_accum) given to the last chunks with rows to spare, then
    by splitting the fullest rows (:mod:`.tail`)."""
    cols, start = _concat(tables, ("count", "tokens", "completed", "lost"))
    r = int(ctx.rows_per_mb)
    rows = np.array([t.count for t in tables], np.int64)
    mbs = -(-rows // r)
    total = int(mbs.sum())
    extra = ctx.slots * -(-total // ctx.slots) - total
    spare = rows - mbs
    give = np.zeros(len(rows), np.int64)
    left = extra
    for k in range(len(rows) - 1, -1, -1):  # one step per chunk
        give[k] = min(int(spare[k]), left)
        left -= int(give[k])
    mbs += give
    if left:  # fewer rows than microbatches: split the fullest rows
        n_items = int(cols["count"].sum())
        if n_items < int(rows.sum()) + left:
            from ...errors import InputError

            raise InputError(layout.tail_message(n_items, int(mbs.sum()) + left, ctx.dp, ctx.grad_accum,
                                                 "packed samples") + " (or a larger --chunk-samples)")
        before = cols["chunk"]
        cols = _split_rows(cols, tables, start, left)
        mbs += np.bincount(cols["chunk"], minlength=len(rows)) - np.bincount(before, minlength=len(rows))
    rows_now = np.bincount(cols["chunk"], minlength=len(rows)).astype(np.int64)
    # row -> microbatch inside each chunk: (row * mbs) // rows, as layout.packed_microbatches spreads them
    row_start = np.concatenate([[0], np.cumsum(rows_now)])
    local_row = np.arange(int(rows_now.sum()), dtype=np.int64) - np.repeat(row_start[:-1], rows_now)
    k_of = cols["chunk"].astype(np.int64)
    mb_start = np.concatenate([[0], np.cumsum(mbs)])
    mb_of_row = mb_start[k_of] + (local_row * mbs[k_of]) // rows_now[k_of]
    m = int(mbs.sum())
    first_row = np.searchsorted(mb_of_row, np.arange(m), side="left")
    nrows = np.diff(np.append(first_row, len(mb_of_row)))
    bounds = np.append(first_row, len(mb_of_row))
    out = {"chunk": cols["chunk"][first_row], "item_lo": cols["item_lo"][first_row],
           "row_lo": local_row[first_row], "rows": nrows.astype(np.int32)}
    for name in ("count", "tokens", "completed", "lost"):
        out[name] = np.add.reduceat(cols[name].astype(np.int64), bounds[:-1]) if m else np.zeros(0, np.int64)
    out["count"] = out["count"].astype(np.int32)
    out["seqlen"] = np.full(m, ctx.seq_len, np.int32)
    out["batch"] = np.full(m, r, np.int32)
    out["lost"] = out["lost"].astype(np.int32)
    out["completed"] = out["completed"].astype(np.int32)
    row_counts = [cols["count"][row_start[k]:row_start[k + 1]].astype(np.int32) for k in range(len(rows))]
    return out, row_counts


def _split_rows(cols: dict, tables: list, start: np.ndarray, extra: int) -> dict:
    done = tail.round_one(cols, tail.merged_candidates(tables, start), extra)
    return done if done is not None else tail.all_rounds(cols, tables, start, extra, _row_refinalize)


def _packed_mb_table(tables: list) -> dict:
    cols, _ = _concat(tables, ("count", "seqlen", "batch", "tokens", "completed", "lost", "rows", "sumsq"))
    return cols


def _cost(cols: dict, ctx: PlanContext) -> np.ndarray:
    if ctx.packing:  # tokens (+ A x sum of squared segment lengths): balance.microbatch_cost's formula
        spec = format.straggler_cost(True, ctx.budget.attention_cost)
        return format.microbatch_cost(spec, cols["tokens"], cols["batch"], cols["seqlen"], cols.get("sumsq"))
    return np.asarray(ctx.budget.cost(cols["batch"], cols["seqlen"]), dtype=np.float64)


def lay_out(tables: list, ctx: PlanContext, mode: str, rng: np.random.Generator, *, warmup: bool,
            schedule: str | None = None, stages: int | None = None) -> EpochRows:
    """The epoch's plan rows from its chunks' tables (chunk order), see the module docstring."""
    level = tables[0].header["level"]
    row_counts, dropped = None, None
    if ctx.packing and level == "unit":
        cols, row_counts = _packed_rows_to_microbatches(tables, ctx)
        cols["sumsq"] = np.zeros(len(cols["count"]))
    elif ctx.packing:
        cols = _packed_mb_table(tables)
    else:
        cols, dropped = _padded_table(tables, ctx, level == "unit")
    cost = _cost(cols, ctx)
    if level != "epoch":
        per_chunk = np.bincount(cols["chunk"], minlength=len(tables)).astype(np.int64)
        seq = cross_chunk_order(mode, per_chunk, cost, ctx.slots, rng, whole_steps=level == "step")
        cols = {name: values[seq] for name, values in cols.items()}
        cost = cost[seq]
        if ctx.same_shape and not ctx.packing and level == "unit":  # random + --same-shape-per-step
            _same_shape_steps(cols, ctx.slots)
            cost = _cost(cols, ctx)
    ranked = bool(tables[0].header.get("ranked"))
    mb = Microbatches(None, None, cols["seqlen"].astype(np.int64), cols["batch"].astype(np.int64),
                      cols["tokens"].astype(np.int64))
    lay = layout.layout_epoch(mb, cost, ctx.dp, ctx.grad_accum, warmup=warmup,
                              same_shape=ctx.same_shape or ctx.packing, static=ctx.static, ranked=ranked)
    ordered = None
    if schedule is not None:
        from ...schedule.order import reorder_layout

        lay, ordered = reorder_layout(lay, cost, cols["batch"].astype(np.float64) * cols["seqlen"], dp=ctx.dp,
                                      grad_accum=ctx.grad_accum, schedule=schedule, stages=stages)
    cols = {name: values[lay.order] for name, values in cols.items()}
    cols["cost"] = cost[lay.order]
    tail_ids = np.concatenate([np.asarray(t.tail_ids, np.int64) for t in tables])
    ep = EpochRows(mode, cols, lay.warmup_steps, lay.warmup_missing, ordered, tail_ids, dropped,
                   item_rows=ctx.packing and level != "unit")
    if row_counts is not None:
        ep.row_counts_flat = np.concatenate(row_counts) if row_counts else np.zeros(0, np.int32)
        ep.row_start = np.concatenate([[0], np.cumsum([len(r) for r in row_counts])]).astype(np.int64)
    return ep


def _same_shape_steps(cols: dict, slots: int) -> None:
    """All microbatches of a step get the step's largest T and B (``layout.same_shape_steps``)."""
    if not len(cols["seqlen"]):
        return
    for name in ("seqlen", "batch"):
        cols[name] = np.repeat(cols[name].reshape(-1, slots).max(axis=1), slots)
