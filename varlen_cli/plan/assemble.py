"""The epoch pipeline's last stages: per-microbatch columns from the laid-out epochs
(:func:`assemble_columns`), then step columns, LR scales, statistics, metadata and the written plan
(:func:`finish`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from .. import __version__, format
from ..errors import InternalConsistencyError, UsageError
from ..runtime import artifacts
from . import batching, cost_model, lr, stats, writer
from .batching import Microbatches
from .config import PlanConfig, PlanResult
from .orders import EpochInputs
from .pipeline import PlannedEpoch
from .shapes import Budget, pair_ids


def _concat(parts: list) -> np.ndarray:
    """No copy for a single epoch (100M-sample plans: every copy is 800 MB)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def assemble_columns(c: PlanConfig, sample_id: np.ndarray, length: np.ndarray, epochs: list[PlannedEpoch],
                     slots: int) -> tuple[dict, dict]:
    """Per-microbatch columns (all epochs, plan order) and per-sample-entry items of the plan."""
    cols = {k: [] for k in ("epoch", "step", "rank", "micro", "num_samples", "seqlen", "batch_size", "tokens", "cost",
                            "completed", "targets")}
    items = {"sample_ids": [], "sample_lengths": [], "sample_rows": [], "sample_starts": []}
    step0 = 0
    identity = batching.is_identity(sample_id)  # ids 0..N-1 in row order (metrics directories): no gather
    any_empty = bool(len(length)) and int(length.min()) == 0
    for e, ep in enumerate(epochs):
        mb, lay = ep.mb, ep.layout
        cols["epoch"].append(np.full(mb.count, e, np.int64))
        cols["step"].append(lay.step + step0)
        cols["rank"].append(lay.rank)
        cols["micro"].append(lay.micro)
        cols["num_samples"].append(np.diff(mb.offsets))
        cols["seqlen"].append(mb.seqlen)
        cols["batch_size"].append(mb.batch_size)
        cols["tokens"].append(mb.tokens)
        cols["cost"].append(ep.cost)
        # identity: the positions are the ids (int32 where they fit; the writer widens them chunk by chunk)
        items["sample_ids"].append(mb.samples if identity else sample_id[mb.samples])
        completed, lost = _completed_and_lost(c, mb, length, any_empty)
        cols["completed"].append(completed)
        cols["targets"].append(mb.tokens.astype(np.int64) - lost)
        if c.packing:
            items["sample_lengths"].append(mb.item_length)
            items["sample_rows"].append(mb.item_row)
            items["sample_starts"].append(mb.item_start)
        step0 += mb.count // slots
    return ({k: _concat(v) for k, v in cols.items()}, {k: _concat(v) for k, v in items.items() if v})


def _completed_and_lost(c: PlanConfig, mb: Microbatches, length: np.ndarray,
                        any_empty: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per microbatch: the samples it completes (every entry, except the non-final chunks of a split
    sample, which counts once, where its last token is; for step_samples) and the tokens without a
    loss target (shifted labels: the last token of each non-empty sample; a non-final chunk of a
    split sample keeps its last token's target, the next chunk's first)."""
    counts = np.diff(mb.offsets)
    if not c.packing and not any_empty:  # every entry a whole non-empty sample: one of each per entry
        return counts, counts.astype(np.int64)
    parent = np.repeat(np.arange(mb.count), counts)
    final = True
    completed = counts
    if c.packing and c.split_long and len(mb.samples):
        final = mb.item_start + mb.item_length == length[mb.samples]
        completed = np.bincount(parent, weights=final, minlength=mb.count).astype(np.int64)
    entry_len = mb.item_length if c.packing else length[mb.samples]
    lost = np.bincount(parent, weights=(entry_len > 0) & final, minlength=mb.count).astype(np.int64)
    return completed, lost


def _budget_tokens(c: PlanConfig, budget: Budget, rows_per_mb: int | None, b: np.ndarray, t: np.ndarray,
                   tokens: np.ndarray) -> float:
    """The per-microbatch token budget; checks no microbatch is over it and every T fits int32."""
    if c.packing:
        over = int(np.count_nonzero(tokens > b * t))
        if c.max_tokens is not None:
            over += int(np.count_nonzero(~budget.fits(b, t)))
        budget_tokens = float(c.max_tokens) if c.max_tokens is not None else float(rows_per_mb * c.seq_len)
    else:
        over = int(np.count_nonzero(~budget.fits(b, t)))
        budget_tokens = float(c.max_tokens)
    if over:
        raise InternalConsistencyError(f"{over} microbatches over budget")
    if len(t) and int(t.max()) > format.INT32_MAX:  # a padded T over int32 (e.g. a huge --pad-multiple)
        raise UsageError(f"a microbatch would have seqlen {int(t.max()):,}, more than plans store "
                         f"({format.INT32_MAX:,}, int32); lower --pad-multiple or --max-tokens")
    return budget_tokens


def _packing_info(c: PlanConfig, rows_per_mb: int, epochs: list[PlannedEpoch], items: dict, offsets: np.ndarray,
                  tokens: np.ndarray) -> dict:
    packing_stats = [ep.packing_stats for ep in epochs]
    rows_used = int((batching.segment_max(items["sample_rows"], offsets) + 1).sum()) if len(offsets) > 1 else 0
    eff = float(tokens.sum()) / (rows_used * c.seq_len) if rows_used else 1.0
    return {"seq_len": int(c.seq_len), "rows_per_microbatch": int(rows_per_mb), "max_per_row": c.max_per_row,
            "efficiency": eff, "split_long": bool(c.split_long),
            "split_samples": int(sum(p["split_samples"] for p in packing_stats)),
            "samples_per_row_mean": float(np.mean([p["samples_per_row_mean"] for p in packing_stats])),
            "samples_per_row_max": int(max(p["samples_per_row_max"] for p in packing_stats))}


@dataclass
class Dropped:
    """Samples the plan leaves out: too long for any microbatch (every epoch) or dropped by --tail drop."""

    long_ids: np.ndarray
    tail_ids: list  # per epoch
    epochs: int

    @property
    def tail_count(self) -> int:
        return int(sum(len(x) for x in self.tail_ids))

    @property
    def count(self) -> int:
        return len(self.long_ids) * self.epochs + self.tail_count

    def all_ids(self) -> np.ndarray:
        if not (len(self.long_ids) or self.tail_count):
            return np.zeros(0, np.int64)
        return np.unique(np.concatenate([self.long_ids] + self.tail_ids))

    def to_dict(self, all_ids: np.ndarray) -> dict:
        return {"count": self.count, "reason": {"too_long": len(self.long_ids) * self.epochs, "tail": self.tail_count},
                "sample_ids": all_ids.tolist(), "too_long_ids": self.long_ids.tolist(),
                "tail": [{"epoch": e, "sample_ids": ids.tolist()} for e, ids in enumerate(self.tail_ids) if len(ids)]}


def build_metadata(c: PlanConfig, manifest: dict, num_rows: int, epochs: list[PlannedEpoch], *, num_steps: int,
                   num_microbatches: int, shapes: list, base_batch_size, inputs: EpochInputs, fixed_batch: int | None,
                   packing: dict | None, dropped: dict, summary: dict) -> dict:
    """The plan's key-value metadata (see docs/plan.md)."""
    input_info = {"path": os.path.abspath(c.input),
                  # the input as seen from the plan's folder: still right after a move of both (varlen run's swap)
                  "relative_path": os.path.relpath(os.path.abspath(c.input),
                                                   os.path.dirname(os.path.abspath(c.output))),
                  "kind": manifest.get("kind"),
                  "artifact_id": manifest.get("artifact_id"), "num_rows": int(num_rows),
                  "dataset_digest": (manifest.get("dataset") or {}).get("digest")}
    return {
        "format": format.PLAN_FORMAT, "format_version": format.PLAN_FORMAT_VERSION,
        format.STRAGGLER_COST_KEY: format.straggler_cost(c.packing, inputs.budget.attention_cost),
        "cost_model": cost_model.describe(c),
        "varlen_version": __version__, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": artifacts.config_dict(c), "input": input_info,
        "dp": c.dp, "grad_accum": c.grad_accum, "epochs": c.epochs, "num_steps": num_steps,
        "steps_per_epoch": [ep.mb.count // inputs.slots for ep in epochs], "num_microbatches": num_microbatches,
        "orders": [ep.mode for ep in epochs],
        "shapes": shapes, "warmup_steps": epochs[0].layout.warmup_steps,
        "base_batch_size": base_batch_size, "lr_scaling": c.lr_scaling, "lr_scale_by": c.lr_scale_by,
        "budget": {"max_tokens": c.max_tokens, "max_samples": c.max_samples,
                   "attention_cost": inputs.budget.attention_cost},
        "shape_map": inputs.shape.to_dict(), "fixed_batch_size": fixed_batch,
        "packing": packing,
        "dropped": dropped,
        "stats": summary,
    }


def finish(c: PlanConfig, manifest: dict, sample_id: np.ndarray, epochs: list[PlannedEpoch], col: dict, it: dict,
            long_pos: np.ndarray, inputs: EpochInputs, fixed_batch: int | None, t0: float,
            extra_metadata: dict | None = None) -> PlanResult:
    """Step columns, LR, shapes, statistics and metadata (updated with ``extra_metadata``); writes the plan.
    ``items`` may hold a ``source`` entry list (mixture plans)."""
    num_steps = sum(ep.mb.count // inputs.slots for ep in epochs)
    counts = col["num_samples"].astype(np.int64)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    step = col["step"].astype(np.int64)
    step_samples = np.bincount(step, weights=col["completed"], minlength=num_steps).astype(np.int64)
    step_tokens = np.bincount(step, weights=col["tokens"], minlength=num_steps).astype(np.int64)
    step_loss_tokens = np.bincount(step, weights=col["targets"], minlength=num_steps).astype(np.int64)
    scales, base = lr.lr_scales(step_samples, step_tokens, c.lr_scaling, c.lr_scale_by, c.base_batch_size)
    if not np.all(np.isfinite(scales)):
        raise UsageError(f"--base-batch-size {c.base_batch_size} gives a non-finite lr_scale; give a larger base "
                         "batch size")

    # shapes: (B, T); B = 0 where it varies (no static shapes)
    fixed_b = c.static_shapes or c.packing
    key_b = col["batch_size"].astype(np.int64) if fixed_b else np.zeros(len(counts), np.int64)
    shape_b, shape_t, shape_id = pair_ids(key_b, col["seqlen"].astype(np.int64))
    shapes = [[int(x), int(y)] for x, y in zip(shape_b.tolist(), shape_t.tolist())]

    b, t = col["batch_size"].astype(np.int64), col["seqlen"].astype(np.int64)
    budget_tokens = _budget_tokens(c, inputs.budget, inputs.rows_per_mb, b, t, col["tokens"])
    strag = format.straggler(step, col["rank"].astype(np.int64), col["cost"], c.dp)
    dropped = Dropped(sample_id[long_pos], [sample_id[ep.dropped] for ep in epochs], c.epochs)
    dropped_all = dropped.all_ids()
    lay0 = epochs[0].layout
    summary = stats.summary(
        num_steps=num_steps, num_microbatches=len(counts), samples=int(counts.sum()), tokens=int(col["tokens"].sum()),
        padded_tokens=int((b * t).sum()), budget_tokens=budget_tokens, strag=strag, shapes=len(shapes), lr=scales,
        dropped=dropped.count, over_budget=0, warmup_steps=lay0.warmup_steps, epochs=c.epochs,
        samples_per_epoch=[len(ep.mb.samples) for ep in epochs], seconds=time.perf_counter() - t0)
    summary["straggler_overhead"] = format.straggler_overhead(step, col["rank"].astype(np.int64), col["cost"], c.dp)
    if lay0.warmup_missing:
        summary["warmup_missing"] = int(lay0.warmup_missing)
    if c.lr_scaling != "none" and c.lr_scale_by == "samples":
        # steps of non-final --split-long chunks only: they complete no sample, so their lr_scale is 0
        idle = int(np.count_nonzero((step_samples == 0) & (step_tokens > 0)))
        if idle:
            summary["zero_lr_scale_steps"] = idle
    packing = (_packing_info(c, inputs.rows_per_mb, epochs, it, offsets, col["tokens"]) if c.packing else None)
    metadata = build_metadata(c, manifest, len(sample_id), epochs, num_steps=num_steps, num_microbatches=len(counts),
                              shapes=shapes, base_batch_size=base, inputs=inputs, fixed_batch=fixed_batch,
                              packing=packing, dropped=dropped.to_dict(dropped_all), summary=summary)
    metadata.update(extra_metadata or {})
    if c.schedule is not None:
        from ..schedule.order import combined_report

        metadata["schedule"] = combined_report(c.schedule, c.stages, [ep.schedule_order for ep in epochs])
    if c.memory_profile is not None:
        from varlen_cli.memory.budget import plan_memory_metadata

        metadata["memory"] = plan_memory_metadata(c, b, t, shape_id, len(shapes), bool(c.packing),
                                                  it.get("sample_lengths"), offsets)
        summary["predicted_peak_max"] = metadata["memory"]["predicted_peak_max"]
    del epochs[:]
    row_cols = {
        "epoch": col["epoch"].astype(np.int32), "step": step, "rank": col["rank"].astype(np.int32),
        "micro": col["micro"].astype(np.int32), "num_samples": counts.astype(np.int32),
        "seqlen": t.astype(np.int32), "batch_size": b.astype(np.int32), "tokens": col["tokens"].astype(np.int64),
        "lr_scale": scales[step], "shape_id": shape_id.astype(np.int32).reshape(-1),
        "step_samples": step_samples[step], "step_tokens": step_tokens[step],
        "step_loss_tokens": step_loss_tokens[step],
    }
    source = {"source": it["source"]} if "source" in it else {}
    if c.packing:
        it = {"sample_ids": it["sample_ids"], "sample_lengths": it["sample_lengths"].astype(np.int32),
              "sample_rows": it["sample_rows"].astype(np.int32), "sample_starts": it["sample_starts"].astype(np.int32),
              **source}
    else:
        it = {"sample_ids": it["sample_ids"], **source}
    writer.write_plan(c.output, c.overwrite, row_cols, offsets, it, metadata, inputs.slots)
    summary["seconds"] = time.perf_counter() - t0
    return PlanResult(output=os.path.abspath(c.output), order=c.order, num_steps=num_steps,
                      num_microbatches=len(counts), stats=summary, packing=packing, dropped_ids=dropped_all,
                      seconds=summary["seconds"], metadata=metadata)
