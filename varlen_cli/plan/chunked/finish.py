"""After phase 2: step totals, LR scales, shape ids, statistics and metadata of a chunked plan.

Computed epoch by epoch on the microbatch tables (rows in (step, rank, micro) order, so step, rank and
micro follow from the row position and are never stored): each epoch's rows are tallied
(:class:`Tally`, by the ranks of a shared layout), and :func:`finish` turns the tallies and what the
chunks reported (:class:`LaidOut`: too-long and dropped samples, packing and per-source statistics)
into the plan's columns per step and its metadata (:func:`varlen_cli.plan.writer.build_metadata`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from ... import format
from ...errors import InternalConsistencyError, UsageError
from .. import lr, stats
from .epoch import BLOCK_ROWS, EpochRows
from .form import LIST_LIMIT, PlanContext


def row_positions(m: int, dp: int, grad_accum: int, lo: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(epoch-local step, rank, micro) of rows ``[lo, lo + m)`` of an epoch in (step, rank, micro) order."""
    i = np.arange(lo, lo + m, dtype=np.int64)
    slots = dp * grad_accum
    return i // slots, (i % slots) // grad_accum, i % grad_accum


DENSE_SHAPES = 1 << 22  # seqlens up to this look their shape id up in a table (4 bytes a seqlen)


@dataclass
class Finished:
    """What the writer needs besides the epochs' rows: per-step columns and the shapes."""

    step_start: list  # global step of each epoch's first step
    scales: np.ndarray  # per global step
    step_samples: np.ndarray
    step_tokens: np.ndarray
    step_loss_tokens: np.ndarray
    shape_keys: np.ndarray  # sorted (B << 32 | T) of the shapes: a row's shape_id is its key's index
    fixed_b: bool  # B is part of a shape (static shapes, packing)
    metadata: dict
    summary: dict
    dropped_ids: np.ndarray

    def shape_id(self, batch: np.ndarray, seqlen: np.ndarray) -> np.ndarray:
        table = self._by_seqlen
        if table is not None and (not len(seqlen) or (int(seqlen.min()) >= 0 and int(seqlen.max()) < len(table))):
            return table[seqlen]
        key = (batch.astype(np.int64) if self.fixed_b else np.zeros(len(seqlen), np.int64)) << 32 | seqlen
        return np.searchsorted(self.shape_keys, key).astype(np.int32)

    @functools.cached_property
    def _by_seqlen(self) -> np.ndarray | None:
        """When the shapes are the seqlens (B not part of them) up to :data:`DENSE_SHAPES`: the shape id of
        every seqlen ``0..T_max`` (the binary search's results, looked up instead of searched)."""
        if self.fixed_b or not len(self.shape_keys) or int(self.shape_keys[-1]) >= DENSE_SHAPES:
            return None
        return np.searchsorted(self.shape_keys, np.arange(int(self.shape_keys[-1]) + 1)).astype(np.int32)


def blocks(ep: EpochRows, slots: int, lo: int = 0, hi: int | None = None):
    """``(lo, hi)`` blocks of whole steps of an epoch's rows ``[lo, hi)`` (default: all; bounded
    temporaries). A shared layout's parts are whole blocks (``epoch.split_block``)."""
    size = slots * max(1, BLOCK_ROWS // slots)
    hi = ep.count if hi is None else hi
    for a in range(lo, hi, size):
        yield a, min(hi, a + size)


@dataclass
class Tally:
    """What ``finish`` reads from plan rows ``[lo, hi)`` of an epoch (whole blocks): per-step sums and
    straggler, the shape keys, the rows over budget, sums; the straggler's float sums per block, so
    that adding them up in block order gives the same bits whoever tallied which rows."""

    completed: np.ndarray  # per step
    tokens: np.ndarray
    lost: np.ndarray
    strag: np.ndarray
    top: list  # per block: the steps' largest rank load, summed
    mean: list  # per block: the steps' mean rank load, summed
    keys: np.ndarray  # (B << 32 | T) of the rows' shapes, unique (B = 0 where B is not part of a shape)
    over: int  # microbatches over budget
    t_max: int
    padded: int  # B x T summed
    count: int  # entries (samples or pieces)
    token_sum: int
    rows: int  # packed rows used (packing)
    target_padded: int = 0  # two budgets: B x T_target summed


def tally(c, ctx: PlanContext, ep: EpochRows, lo: int = 0, hi: int | None = None) -> Tally:
    """The :class:`Tally` of an epoch's rows ``[lo, hi)`` (default: all)."""
    slots, fixed_b = ctx.slots, bool(c.static_shapes or c.packing)
    sums: dict = {name: [] for name in ("completed", "tokens", "lost", "strag")}
    top, mean, keys = [], [], set()
    over = t_max = padded = count = token_sum = rows = target_padded = 0
    for a, b in blocks(ep, slots, lo, hi):
        batch, seqlen = ep.column("batch", a, b).astype(np.int64), ep.column("seqlen", a, b).astype(np.int64)
        tokens = ep.column("tokens", a, b).astype(np.int64)
        for name, values in (("completed", ep.column("completed", a, b)), ("tokens", tokens),
                             ("lost", ep.column("lost", a, b))):
            sums[name].append(values.astype(np.int64).reshape(-1, slots).sum(axis=1))
        step, rank, _ = row_positions(b - a, c.dp, c.grad_accum)
        load = format.step_loads(step, rank, ep.column("cost", a, b), c.dp)
        m = load.mean(axis=1)
        sums["strag"].append(np.where(m > 0, load.max(axis=1) / np.where(m > 0, m, 1), 1.0))
        top.append(float(load.max(axis=1).sum()))
        mean.append(float(m.sum()))
        keys.update(np.unique((batch if fixed_b else np.zeros(b - a, np.int64)) << 32 | seqlen).tolist())
        if ctx.packing:
            over += int(np.count_nonzero(tokens > batch * seqlen))
            if ctx.budget.max_tokens is not None:
                over += int(np.count_nonzero(~ctx.budget.fits(batch, seqlen)))
            rows += int(ep.column("rows", a, b).astype(np.int64).sum())
        elif ctx.two_sided:
            tseqlen = ep.column("tseqlen", a, b).astype(np.int64)
            over += int(np.count_nonzero(~ctx.budget.fits(batch, seqlen, tseqlen)))
            target_padded += int((batch * tseqlen).sum())
        else:
            over += int(np.count_nonzero(~ctx.budget.fits(batch, seqlen)))
        t_max = max(t_max, int(seqlen.max()) if len(seqlen) else 0)
        padded += int((batch * seqlen).sum())
        count += int(ep.column("count", a, b).astype(np.int64).sum())
        token_sum += int(tokens.sum())
    per_step = {name: np.concatenate(v) if v else np.zeros(0, np.float64 if name == "strag" else np.int64)
                for name, v in sums.items()}
    return Tally(per_step["completed"], per_step["tokens"], per_step["lost"], per_step["strag"], top, mean,
                 np.array(sorted(keys), np.int64), over, t_max, padded, count, token_sum, rows, target_padded)


def merge_tallies(parts: list[Tally]) -> Tally:
    """One epoch's tally from the tallies of its consecutive parts, in order."""
    if len(parts) == 1:
        return parts[0]
    cat = {name: np.concatenate([getattr(t, name) for t in parts]) for name in ("completed", "tokens", "lost", "strag")}
    return Tally(cat["completed"], cat["tokens"], cat["lost"], cat["strag"], [v for t in parts for v in t.top],
                 [v for t in parts for v in t.mean], np.unique(np.concatenate([t.keys for t in parts])),
                 sum(t.over for t in parts), max(t.t_max for t in parts), sum(t.padded for t in parts),
                 sum(t.count for t in parts), sum(t.token_sum for t in parts), sum(t.rows for t in parts),
                 sum(t.target_padded for t in parts))


def _straggler(tallies: list[Tally]) -> tuple[np.ndarray, float]:
    top, mean = 0.0, 0.0
    for t in tallies:  # block after block, as one pass over the rows adds them
        for v in t.top:
            top += v
        for v in t.mean:
            mean += v
    strag = np.concatenate([t.strag for t in tallies]) if tallies else np.zeros(0)
    return strag, (top / mean - 1.0 if mean > 0 else 0.0)


def check_budget(c, ctx: PlanContext, tallies: list[Tally]) -> float:
    """The per-microbatch token budget; no microbatch over it, every T within int32."""
    over = sum(t.over for t in tallies)
    t_max = max((t.t_max for t in tallies), default=0)
    if over:
        raise InternalConsistencyError(f"{over} microbatches over budget")
    if t_max > format.INT32_MAX:
        raise UsageError(f"a microbatch would have seqlen {t_max:,}, more than plans store ({format.INT32_MAX:,}, "
                         "int32); lower --pad-multiple or --max-tokens")
    budget = ctx.budget.max_tokens  # given, or from a memory profile (--max-memory)
    if ctx.packing:
        return float(budget) if budget is not None else float(ctx.rows_per_mb * c.seq_len)
    return float(budget)


def _shapes(c, tallies: list[Tally]) -> tuple[list, np.ndarray, bool]:
    """The plan's (B, T) shapes sorted by (B, T) (B = 0 where it varies), as ``shapes.pair_ids`` sorts them."""
    fixed_b = bool(c.static_shapes or c.packing)
    shape_keys = np.unique(np.concatenate([t.keys for t in tallies])) if tallies else np.zeros(0, np.int64)
    shapes = [[int(k >> 32), int(k & 0xFFFFFFFF)] for k in shape_keys.tolist()]
    return shapes, shape_keys.astype(np.int64), fixed_b


def packing_info(c, ctx: PlanContext, tallies: list[Tally], packing_stats: list[dict]) -> dict:
    """The metadata's ``packing``: row length and count, efficiency, split samples, samples per row."""
    tokens = sum(t.token_sum for t in tallies)
    rows_used = sum(t.rows for t in tallies)
    return {"seq_len": int(c.seq_len), "rows_per_microbatch": int(ctx.rows_per_mb), "max_per_row": c.max_per_row,
            "efficiency": tokens / (rows_used * c.seq_len) if rows_used else 1.0, "split_long": bool(c.split_long),
            "split_samples": int(sum(p["split_samples"] for p in packing_stats)),
            "samples_per_row_mean": float(np.mean([p["samples_per_row_mean"] for p in packing_stats])),
            "samples_per_row_max": int(max(p["samples_per_row_max"] for p in packing_stats))}


@dataclass
class Dropped:
    """Samples the plan leaves out: too long for any microbatch (every epoch; ``num_long`` of them, listed
    up to :data:`~.form.LIST_LIMIT`, beyond which only counted) or dropped by ``--tail drop`` (per
    epoch). A mixture's entries are copies: its lists name each copy with its source, and every
    too-long copy is listed (``varlen validate`` counts a mixture's copies per sample)."""

    long_ids: np.ndarray
    tail_ids: list  # per epoch
    epochs: int
    num_long: int
    long_sources: np.ndarray | None = None  # a mixture: the source of each long id
    tail_sources: list | None = None  # a mixture: per epoch, the source of each tail id

    @property
    def listed(self) -> bool:  # more are counted, not listed: the rule that drops them is recorded
        return self.num_long <= LIST_LIMIT or self.long_sources is not None

    @property
    def tail_count(self) -> int:
        return int(sum(len(x) for x in self.tail_ids))

    @property
    def count(self) -> int:
        return self.num_long * self.epochs + self.tail_count

    def all_ids(self) -> np.ndarray:
        long_ids = self.long_ids if self.listed else np.zeros(0, np.int64)
        return np.unique(np.concatenate([long_ids] + self.tail_ids)) if len(long_ids) or self.tail_count \
            else np.zeros(0, np.int64)

    def to_dict(self, all_ids: np.ndarray, longest_fitting: int, longest_target_fitting: int | None = None) -> dict:
        long_ids = self.long_ids if self.listed else np.zeros(0, np.int64)
        out = {"count": self.count, "reason": {"too_long": self.num_long * self.epochs, "tail": self.tail_count},
               "sample_ids": all_ids.tolist(), "too_long_ids": long_ids.tolist(),
               "tail": [{"epoch": e, "sample_ids": ids.tolist()} for e, ids in enumerate(self.tail_ids) if len(ids)]}
        if self.long_sources is not None:  # mixtures: the source of each listed copy
            out["too_long_sources"] = (self.long_sources if self.listed else long_ids).tolist()
            for entry, sources in zip(out["tail"], [s for s in self.tail_sources if len(s)]):
                entry["sources"] = sources.tolist()
        if not self.listed:
            out.update(too_long_listed=False, too_long_count=int(self.num_long), too_long_over=int(longest_fitting))
            if longest_target_fitting is not None:  # two budgets: or a target longer than this
                out["too_long_target_over"] = int(longest_target_fitting)
        return out


@dataclass
class LaidOut:
    """Phase 2 up to the columns: the epochs laid out, their chunk files' readers, and what ``finish``
    needs from the chunks' tables besides the rows."""

    epochs: list
    readers: list
    packing_stats: list  # per epoch (packing)
    dropped: Dropped
    fixed_batch: int | None
    source_tokens: list | None = None  # a mixture: per epoch, each source's tokens
    tallies: list | None = None  # per epoch, each rank's Tally of its rows (a shared layout), rank order


def _step_columns(c, epochs: list[EpochRows], tallies: list[Tally], slots: int, trained_only: bool):
    """Each epoch's first global step, and per step: samples, tokens, loss tokens and LR scale (and the
    base batch size)."""
    step_start = list(np.concatenate([[0], np.cumsum([ep.count // slots for ep in epochs])]).astype(int))
    step_samples = np.concatenate([t.completed for t in tallies])
    step_tokens = np.concatenate([t.tokens for t in tallies])
    step_targets = step_tokens - np.concatenate([t.lost for t in tallies])
    # target_length (analyze --target-length): "tokens" are those that carry loss
    scales, base = lr.lr_scales(step_samples, step_targets if trained_only else step_tokens, step_targets,
                                c.lr_scaling, c.lr_scale_by, c.base_batch_size)
    if not np.all(np.isfinite(scales)):
        raise UsageError(f"--base-batch-size {c.base_batch_size} gives a non-finite lr_scale; give a larger base "
                         "batch size")
    return step_start, step_samples, step_tokens, step_targets, scales, base


def _summary(c, ctx: PlanContext, laid: LaidOut, tallies: list[Tally], cols: tuple, num_shapes: int,
             t0: float) -> dict:
    """The plan's statistics (``stats.summary``) from the tallies and the step columns."""
    epochs, (step_start, step_samples, step_tokens, step_targets, scales, _) = laid.epochs, cols
    strag, overhead = _straggler(tallies)
    per_epoch = [t.count for t in tallies]
    summary = stats.summary(
        num_steps=int(step_start[-1]), num_microbatches=sum(ep.count for ep in epochs), samples=sum(per_epoch),
        tokens=int(step_tokens.sum()), padded_tokens=sum(t.padded for t in tallies),
        budget_tokens=check_budget(c, ctx, tallies), strag=strag, shapes=num_shapes, lr=scales,
        dropped=laid.dropped.count, over_budget=0, warmup_steps=epochs[0].warmup_steps, epochs=c.epochs,
        samples_per_epoch=per_epoch, seconds=time.perf_counter() - t0)
    summary["straggler_overhead"] = overhead
    if epochs[0].warmup_missing:
        summary["warmup_missing"] = int(epochs[0].warmup_missing)
    if ctx.two_sided:  # the target side's padding: padded-but-empty target positions / all of them
        summary.update(stats.target_summary(int(step_targets.sum()), sum(t.target_padded for t in tallies)))
    zero_loss = int(np.count_nonzero(step_targets == 0))  # steps whose loss is 0/0 (cli/summary.py warns)
    if zero_loss:
        summary["zero_loss_steps"] = zero_loss
    if c.lr_scaling != "none" and c.lr_scale_by == "samples":
        # steps of non-final --split-long chunks only: they complete no sample, so their lr_scale is 0
        idle = int(np.count_nonzero((step_samples == 0) & (step_tokens > 0)))
        if idle:
            summary["zero_lr_scale_steps"] = idle
    return summary


def finish(c, ctx: PlanContext, plan_input, laid: LaidOut, t0: float, *, trained_only: bool = False,
           config: dict | None = None) -> Finished:
    """Step columns, LR, shapes, statistics and metadata of the epochs ``laid`` out, from each epoch's
    :class:`Tally` (made by the ranks of a shared layout, or here). ``plan_input``: what the plan was
    planned from (``.sources``); ``config``: the options a derived plan records (default: ``c``'s)."""
    from ..writer import build_metadata, recorded_config

    epochs, slots = laid.epochs, ctx.slots
    tallies = [tally(c, ctx, ep) for ep in epochs] if laid.tallies is None else \
        [merge_tallies(parts) for parts in laid.tallies]
    cols = _step_columns(c, epochs, tallies, slots, trained_only)
    shapes, shape_keys, fixed_b = _shapes(c, tallies)
    summary = _summary(c, ctx, laid, tallies, cols, len(shapes), t0)
    dropped_all = laid.dropped.all_ids()
    metadata = build_metadata(
        c, config=config or recorded_config(c), input=plan_input.record(c), num_steps=int(cols[0][-1]),
        num_microbatches=sum(ep.count for ep in epochs), steps_per_epoch=[ep.count // slots for ep in epochs],
        orders=[ep.mode for ep in epochs], shapes=shapes, warmup_steps=epochs[0].warmup_steps,
        base_batch_size=cols[5], budget=ctx.budget, shape_map=ctx.shape.to_dict(), fixed_batch=laid.fixed_batch,
        packing=packing_info(c, ctx, tallies, laid.packing_stats) if c.packing else None,
        dropped=laid.dropped.to_dict(dropped_all, ctx.longest_fitting,
                                     ctx.longest_target_fitting if ctx.two_sided else None), summary=summary)
    if trained_only:
        metadata["loss_tokens"] = format.TARGET_LENGTH_COLUMN
    if ctx.two_sided:  # the target side's shape map (the source's is shape_map)
        metadata["target_shape_map"] = ctx.target_shape.to_dict()
    metadata["chunks"] = {"samples": int(c.chunk_samples), "count": None}
    if laid.source_tokens is not None:  # a mixture: its sources and their tokens per epoch
        sources = [{**entry, "tokens_per_epoch": [int(t[k]) for t in laid.source_tokens]}
                   for k, entry in enumerate(plan_input.sources_record(c))]
        metadata["mixture"] = {"sources": sources, "seed": c.seed}
        summary["tokens_per_source_per_epoch"] = {e["name"]: e["tokens_per_epoch"] for e in sources}
    _schedule_and_memory(c, ctx, epochs, metadata, summary, shape_keys, fixed_b, len(shapes))
    if len(dropped_all) > LIST_LIMIT:
        dropped_all = dropped_all[:LIST_LIMIT]
    return Finished(cols[0], cols[4], cols[1], cols[2], cols[3], shape_keys, fixed_b, metadata, summary, dropped_all)


def _schedule_and_memory(c, ctx: PlanContext, epochs: list[EpochRows], metadata: dict, summary: dict,
                         shape_keys: np.ndarray, fixed_b: bool, num_shapes: int) -> None:
    """The metadata's ``schedule`` report (``--schedule``) and ``memory`` entry (a memory budget)."""
    from ..writer import memory_entry

    if c.schedule is not None:
        from ...schedule.order import combined_report

        metadata["schedule"] = combined_report(c.schedule, c.stages, [ep.schedule_order for ep in epochs])
    if ctx.budget.memory is not None:
        b = np.concatenate([ep.column("batch").astype(np.int64) for ep in epochs])
        t = np.concatenate([ep.column("seqlen").astype(np.int64) for ep in epochs])
        sid = np.searchsorted(shape_keys, (b if fixed_b else np.zeros(len(t), np.int64)) << 32 | t)
        sumsq = np.concatenate([ep.column("sumsq") for ep in epochs]) if c.packing else None
        metadata["memory"] = memory_entry(c, ctx.budget, b, t, sid, num_shapes, sum_squares=sumsq)
        summary["predicted_peak_max"] = metadata["memory"]["predicted_peak_max"]
