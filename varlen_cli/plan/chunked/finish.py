"""After phase 2: step totals, LR scales, shape ids, statistics and metadata of a chunked plan.

The same formulas as the single-process planner (``core.finish``), computed epoch by epoch on the
microbatch tables (rows in (step, rank, micro) order, so step, rank and micro follow from the row
position and are never stored).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ... import format
from ...errors import InternalConsistencyError, UsageError
from .. import lr, stats
from ..shapes import pair_ids
from .epoch import EpochRows
from .form import LIST_LIMIT, PlanContext


def row_positions(m: int, dp: int, grad_accum: int, lo: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(epoch-local step, rank, micro) of rows ``[lo, lo + m)`` of an epoch in (step, rank, micro) order."""
    i = np.arange(lo, lo + m, dtype=np.int64)
    slots = dp * grad_accum
    return i // slots, (i % slots) // grad_accum, i % grad_accum


@dataclass
class Finished:
    """What the writer needs besides the epochs' rows: per-step columns and per-row shape ids."""

    step_start: list  # global step of each epoch's first step
    scales: np.ndarray  # per global step
    step_samples: np.ndarray
    step_tokens: np.ndarray
    step_loss_tokens: np.ndarray
    shape_id: list  # per epoch, int32 per row
    metadata: dict
    summary: dict
    dropped_ids: np.ndarray


def _step_sums(ep: EpochRows, slots: int, name: str) -> np.ndarray:
    return ep.cols[name].astype(np.int64).reshape(-1, slots).sum(axis=1) if ep.count else np.zeros(0, np.int64)


def _loads(ep: EpochRows, dp: int, grad_accum: int) -> np.ndarray:
    step, rank, _ = row_positions(ep.count, dp, grad_accum)
    return format.step_loads(step, rank, ep.cols["cost"], dp)


def _straggler(epochs: list[EpochRows], dp: int, grad_accum: int) -> tuple[np.ndarray, float]:
    per_step, top, mean = [], [], []
    for ep in epochs:
        load = _loads(ep, dp, grad_accum)
        m = load.mean(axis=1)
        per_step.append(np.where(m > 0, load.max(axis=1) / np.where(m > 0, m, 1), 1.0))
        top.append(load.max(axis=1))
        mean.append(m)
    strag = np.concatenate(per_step) if per_step else np.zeros(0)
    mean_all = float(np.concatenate(mean).sum()) if mean else 0.0
    overhead = float(np.concatenate(top).sum()) / mean_all - 1.0 if mean_all > 0 else 0.0
    return strag, overhead


def _check_budget(c, ctx: PlanContext, epochs: list[EpochRows]) -> float:
    """The per-microbatch token budget; no microbatch over it, every T within int32 (``core._budget_tokens``)."""
    over, t_max = 0, 0
    for ep in epochs:
        b, t = ep.cols["batch"].astype(np.int64), ep.cols["seqlen"].astype(np.int64)
        if ctx.packing:
            over += int(np.count_nonzero(ep.cols["tokens"] > b * t))
            if c.max_tokens is not None:
                over += int(np.count_nonzero(~ctx.budget.fits(b, t)))
        else:
            over += int(np.count_nonzero(~ctx.budget.fits(b, t)))
        t_max = max(t_max, int(t.max()) if len(t) else 0)
    if over:
        raise InternalConsistencyError(f"{over} microbatches over budget")
    if t_max > format.INT32_MAX:
        raise UsageError(f"a microbatch would have seqlen {t_max:,}, more than plans store ({format.INT32_MAX:,}, "
                         "int32); lower --pad-multiple or --max-tokens")
    if ctx.packing:
        return float(c.max_tokens) if c.max_tokens is not None else float(ctx.rows_per_mb * c.seq_len)
    return float(c.max_tokens)


def _shapes(c, ctx: PlanContext, epochs: list[EpochRows]) -> tuple[list, list]:
    fixed_b = c.static_shapes or c.packing
    sizes = [ep.count for ep in epochs]
    seqlen = np.concatenate([ep.cols["seqlen"].astype(np.int64) for ep in epochs])
    key_b = (np.concatenate([ep.cols["batch"].astype(np.int64) for ep in epochs]) if fixed_b
             else np.zeros(len(seqlen), np.int64))
    shape_b, shape_t, shape_id = pair_ids(key_b, seqlen)
    shapes = [[int(x), int(y)] for x, y in zip(shape_b.tolist(), shape_t.tolist())]
    cut = np.cumsum(sizes)[:-1]
    return shapes, np.split(shape_id.astype(np.int32).reshape(-1), cut)


def _packing_info(c, ctx: PlanContext, epochs: list[EpochRows], packing_stats: list[dict]) -> dict:
    tokens = sum(int(ep.cols["tokens"].sum()) for ep in epochs)
    rows_used = sum(int(ep.cols["rows"].astype(np.int64).sum()) for ep in epochs)
    return {"seq_len": int(c.seq_len), "rows_per_microbatch": int(ctx.rows_per_mb), "max_per_row": c.max_per_row,
            "efficiency": tokens / (rows_used * c.seq_len) if rows_used else 1.0, "split_long": bool(c.split_long),
            "split_samples": int(sum(p["split_samples"] for p in packing_stats)),
            "samples_per_row_mean": float(np.mean([p["samples_per_row_mean"] for p in packing_stats])),
            "samples_per_row_max": int(max(p["samples_per_row_max"] for p in packing_stats))}


def finish(c, ctx: PlanContext, manifest: dict, num_rows: int, epochs: list[EpochRows], *, long_ids: np.ndarray,
           num_long: int, packing_stats: list[dict], fixed_batch: int | None, t0: float) -> Finished:
    """Step columns, LR, shapes, statistics and metadata (``core.finish``'s, epoch by epoch)."""
    from ..core import Dropped, build_metadata

    slots = ctx.slots
    step_start = list(np.concatenate([[0], np.cumsum([ep.count // slots for ep in epochs])]).astype(int))
    num_steps = int(step_start[-1])
    step_samples = np.concatenate([_step_sums(ep, slots, "completed") for ep in epochs])
    step_tokens = np.concatenate([_step_sums(ep, slots, "tokens") for ep in epochs])
    step_targets = np.concatenate([_step_sums(ep, slots, "tokens") - _step_sums(ep, slots, "lost") for ep in epochs])
    scales, base = lr.lr_scales(step_samples, step_tokens, c.lr_scaling, c.lr_scale_by, c.base_batch_size)
    if not np.all(np.isfinite(scales)):
        raise UsageError(f"--base-batch-size {c.base_batch_size} gives a non-finite lr_scale; give a larger base "
                         "batch size")
    shapes, shape_id = _shapes(c, ctx, epochs)
    budget_tokens = _check_budget(c, ctx, epochs)
    strag, overhead = _straggler(epochs, c.dp, c.grad_accum)
    tail_ids = [np.asarray(ep.tail_ids, np.int64) for ep in epochs]
    listed = num_long <= LIST_LIMIT  # more are counted, not listed: the rule that drops them is recorded
    dropped = Dropped(np.asarray(long_ids if listed else [], np.int64), tail_ids, c.epochs)
    dropped_all = dropped.all_ids()
    count = sum(ep.count for ep in epochs)
    tokens = sum(int(ep.cols["tokens"].sum()) for ep in epochs)
    padded = sum(int((ep.cols["batch"].astype(np.int64) * ep.cols["seqlen"].astype(np.int64)).sum()) for ep in epochs)
    samples = sum(int(ep.cols["count"].astype(np.int64).sum()) for ep in epochs)
    summary = stats.summary(
        num_steps=num_steps, num_microbatches=count, samples=samples, tokens=tokens, padded_tokens=padded,
        budget_tokens=budget_tokens, strag=strag, shapes=len(shapes), lr=scales,
        dropped=num_long * c.epochs + dropped.tail_count, over_budget=0, warmup_steps=epochs[0].warmup_steps,
        epochs=c.epochs, samples_per_epoch=[int(ep.cols["count"].astype(np.int64).sum()) for ep in epochs],
        seconds=time.perf_counter() - t0)
    summary["straggler_overhead"] = overhead
    if epochs[0].warmup_missing:
        summary["warmup_missing"] = int(epochs[0].warmup_missing)
    if c.lr_scaling != "none" and c.lr_scale_by == "samples":
        idle = int(np.count_nonzero((step_samples == 0) & (step_tokens > 0)))
        if idle:
            summary["zero_lr_scale_steps"] = idle
    packing = _packing_info(c, ctx, epochs, packing_stats) if c.packing else None
    adapters = [SimpleNamespace(mb=SimpleNamespace(count=ep.count), mode=ep.mode,
                                layout=SimpleNamespace(warmup_steps=ep.warmup_steps)) for ep in epochs]
    inputs = SimpleNamespace(budget=ctx.budget, slots=slots, shape=ctx.shape)
    dropped_meta = dropped.to_dict(dropped_all)
    if not listed:
        dropped_meta.update(count=dropped.tail_count + num_long * c.epochs,
                            reason={"too_long": num_long * c.epochs, "tail": dropped.tail_count},
                            too_long_listed=False, too_long_count=int(num_long),
                            too_long_over=int(ctx.longest_fitting))
    metadata = build_metadata(c, manifest, num_rows, adapters, num_steps=num_steps, num_microbatches=count,
                              shapes=shapes, base_batch_size=base, inputs=inputs, fixed_batch=fixed_batch,
                              packing=packing, dropped=dropped_meta, summary=summary)
    metadata["chunks"] = {"samples": int(c.chunk_samples), "count": None}
    if c.schedule is not None:
        from ...schedule.order import combined_report

        metadata["schedule"] = combined_report(c.schedule, c.stages, [ep.schedule_order for ep in epochs])
    if c.memory_profile is not None:
        from ...memory.budget import plan_memory_metadata

        b = np.concatenate([ep.cols["batch"].astype(np.int64) for ep in epochs])
        t = np.concatenate([ep.cols["seqlen"].astype(np.int64) for ep in epochs])
        metadata["memory"] = plan_memory_metadata(c, b, t, np.concatenate(shape_id), len(shapes), bool(c.packing),
                                                  None, None)
        summary["predicted_peak_max"] = metadata["memory"]["predicted_peak_max"]
    if len(dropped_all) > LIST_LIMIT:
        dropped_all = dropped_all[:LIST_LIMIT]
    return Finished(step_start, scales, step_samples, step_tokens, step_targets, shape_id, metadata, summary,
                    dropped_all)
