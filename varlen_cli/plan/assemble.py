"""The epoch pipeline's last stages: per-microbatch columns from the laid-out epochs
(:func:`assemble_columns`), then step columns, LR scales, statistics and metadata, the plan's own
check (:mod:`varlen_cli.plan_checks`, the checks of ``varlen validate``) and the written plan
(:func:`finish`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from .. import __version__, format, storage
from ..budget import Budget
from ..errors import InternalConsistencyError, UsageError
from ..plan_checks import PlanArrays, run_checks
from ..runtime import artifacts
from . import batching, lr, stats, writer
from .batching import Microbatches
from .config import PlanConfig, PlanResult
from .orders import EpochInputs
from .pipeline import PlannedEpoch, Rows
from .reader import TARGET_COLUMN
from .shapes import pair_ids


def _concat(parts: list) -> np.ndarray:
    """No copy for a single epoch (100M-sample plans: every copy is 800 MB)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def assemble_columns(c: PlanConfig, rows: Rows, epochs: list[PlannedEpoch], slots: int) -> tuple[dict, dict]:
    """Per-microbatch columns (all epochs, plan order) and per-sample-entry items of the plan
    (``sample_ids``; packed: ``sample_lengths``/``sample_rows``/``sample_starts``; mixtures ``source``;
    ``sample_length``, and ``sample_target`` with target_length: each entry's whole sample length and
    loss tokens, for the plan's own check)."""
    cols = {k: [] for k in ("epoch", "step", "rank", "micro", "num_samples", "seqlen", "batch_size", "tokens", "cost",
                            "completed", "targets")}
    items = {k: [] for k in ("sample_ids", "sample_lengths", "sample_rows", "sample_starts", "source",
                             "sample_length", "sample_target")}
    step0 = 0
    identity = batching.is_identity(rows.sample_id)  # ids 0..N-1 in row order (metrics directories): no gather
    full = rows.full_length if rows.full_length is not None else rows.length
    any_empty = bool(len(full)) and int(full.min()) == 0
    # each entry's whole sample length: the entry's own, unless it may be a chunk (--split-long, pieces)
    chunks = c.packing and (c.split_long or rows.start is not None)
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
        items["sample_ids"].append(mb.samples if identity else rows.sample_id[mb.samples])
        sample_length = mb.item_length if mb.item_length is not None and not chunks else \
            batching.narrow(full[mb.samples])
        items["sample_length"].append(sample_length)
        starts = mb.item_start
        if c.packing and rows.start is not None:  # pieces of a replan: their chunks start inside the sample
            starts = starts + rows.start[mb.samples]
        completed, targets = entry_totals(mb, sample_length, starts if c.packing else None, any_empty, rows.target)
        cols["completed"].append(completed)
        cols["targets"].append(targets)
        if c.packing:
            items["sample_lengths"].append(mb.item_length)
            items["sample_rows"].append(mb.item_row)
            items["sample_starts"].append(starts)
        if rows.source is not None:
            items["source"].append(rows.source[mb.samples])
        if rows.target is not None:  # for the plan's own check of step_loss_tokens
            items["sample_target"].append(rows.target[mb.samples])
        step0 += mb.count // slots
    return ({k: _concat(v) for k, v in cols.items()}, {k: _concat(v) for k, v in items.items() if v})


def entry_totals(mb: Microbatches, sample_length: np.ndarray, starts: np.ndarray | None, any_empty: bool,
                 target: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per microbatch: the samples it completes (every entry, except the non-final chunks of a split
    sample, which counts once, where its last token is; for step_samples) and its loss targets
    (:func:`varlen_cli.format.loss_targets`: shifted labels; ``target``: per row, the tokens that carry
    loss as the input counted them, ``target_length``: every entry is then a whole sample)."""
    counts = np.diff(mb.offsets)
    if target is not None:
        return counts, batching.segment_sum(format.loss_targets(None, target=target[mb.samples]), mb.offsets)
    if starts is None and not any_empty:  # every entry a whole non-empty sample: one completed, l - 1 targets
        return counts, mb.tokens.astype(np.int64) - counts
    final = None
    entry_len = sample_length
    if starts is not None:
        entry_len = mb.item_length
        final = starts + mb.item_length == sample_length
    completed = counts if final is None else batching.segment_sum(final.astype(np.int64), mb.offsets)
    return completed, batching.segment_sum(format.loss_targets(entry_len, final), mb.offsets)


def _budget_tokens(c: PlanConfig, budget: Budget, rows_per_mb: int | None, b: np.ndarray, t: np.ndarray,
                   tokens: np.ndarray) -> float:
    """The per-microbatch token budget; checks no microbatch is over it and every T fits int32."""
    if c.packing:
        over = int(np.count_nonzero(tokens > b * t))
        if budget.max_tokens is not None:
            over += int(np.count_nonzero(~budget.fits(b, t)))
        budget_tokens = float(budget.max_tokens) if budget.max_tokens is not None else float(rows_per_mb * c.seq_len)
    else:
        over = int(np.count_nonzero(~budget.fits(b, t)))
        budget_tokens = float(budget.max_tokens)
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
    """Samples the plan leaves out: too long for any microbatch (every epoch) or dropped by --tail drop.
    Row positions; a mixture's rows are copies, so its lists name each copy (with its source)."""

    rows: Rows
    long_pos: np.ndarray
    tail_pos: list  # per epoch
    epochs: int

    @property
    def tail_count(self) -> int:
        return int(sum(len(x) for x in self.tail_pos))

    @property
    def count(self) -> int:
        return len(self.long_pos) * self.epochs + self.tail_count

    def all_ids(self) -> np.ndarray:
        if not (len(self.long_pos) or self.tail_count):
            return np.zeros(0, np.int64)
        return np.unique(self.rows.sample_id[np.concatenate([self.long_pos] + self.tail_pos).astype(np.int64)])

    def to_dict(self, all_ids: np.ndarray) -> dict:
        ids = self.rows.sample_id
        out = {"count": self.count, "reason": {"too_long": len(self.long_pos) * self.epochs, "tail": self.tail_count},
               "sample_ids": all_ids.tolist(), "too_long_ids": ids[self.long_pos].tolist(),
               "tail": [{"epoch": e, "sample_ids": ids[pos].tolist()} for e, pos in enumerate(self.tail_pos)
                        if len(pos)]}
        if self.rows.source is not None:  # mixtures: the source of each listed copy
            out["too_long_sources"] = self.rows.source[self.long_pos].tolist()
            for entry, pos in zip(out["tail"], [p for p in self.tail_pos if len(p)]):
                entry["sources"] = self.rows.source[pos].tolist()
        return out


def location_record(path: str, output: str) -> dict:
    """An input of the plan ``output`` as its metadata records it: ``path``, absolute (a URL as given),
    and ``relative_path``, the input as seen from the plan's folder: still right after a move of both
    (varlen run's swap); null when the input or the plan is in object storage."""
    where = storage.absolute(path)
    if storage.is_remote(path) or storage.is_remote(output):
        return {"path": where, "relative_path": None}
    return {"path": where, "relative_path": os.path.relpath(where, os.path.dirname(os.path.abspath(output)))}


def input_info(c: PlanConfig, manifest: dict, num_rows: int) -> dict:
    """The metadata's ``input``: the metrics or sorted directory the plan was made from."""
    where = location_record(c.input, c.output)  # relative_path: input and plan move together (varlen run)
    if c.recorded_input:
        where["path"] = storage.absolute(c.recorded_input)
    return {**where,
            "kind": manifest.get("kind"),
            "artifact_id": manifest.get("artifact_id"), "num_rows": int(num_rows),
            "dataset_digest": (manifest.get("dataset") or {}).get("digest")}


def build_metadata(c: PlanConfig, epochs: list[PlannedEpoch], *, source: dict, num_steps: int, num_microbatches: int,
                   shapes: list, base_batch_size, inputs: EpochInputs, fixed_batch: int | None, packing: dict | None,
                   dropped: dict, summary: dict) -> dict:
    """The plan's key-value metadata (see docs/formats.md); ``source``: its ``input`` (and ``config``
    as recorded, if not ``c``'s)."""
    return {
        "format": format.PLAN_FORMAT, "format_version": format.PLAN_FORMAT_VERSION,
        "varlen_version": __version__,
        "config": source.get("config") or recorded_config(c), "input": source["input"],
        "dp": c.dp, "grad_accum": c.grad_accum, "epochs": c.epochs, "num_steps": num_steps,
        "steps_per_epoch": [ep.mb.count // inputs.slots for ep in epochs], "num_microbatches": num_microbatches,
        "orders": [ep.mode for ep in epochs],
        "shapes": shapes, "warmup_steps": epochs[0].layout.warmup_steps,
        "base_batch_size": base_batch_size, "lr_scaling": c.lr_scaling, "lr_scale_by": c.lr_scale_by,
        "budget": inputs.budget.to_metadata(),
        "shape_map": inputs.shape.to_dict(), "fixed_batch_size": fixed_batch,
        "packing": packing,
        "dropped": dropped,
        "stats": {key: value for key, value in summary.items() if key != "seconds"},
    }


def recorded_config(c: PlanConfig) -> dict:
    """The options a plan records: what it is made of, not how the command ran (no output, overwrite,
    progress, nproc, allow_stale: ``artifacts.RUNTIME_FIELDS``), so the same input and options give
    the same file, whatever the number of workers and wherever it is written."""
    recorded = {k: v for k, v in artifacts.config_dict(c).items() if k not in artifacts.RUNTIME_FIELDS}
    if c.recorded_input:
        recorded["input"] = storage.absolute(c.recorded_input)
    return recorded


def memory_entry(c: PlanConfig, budget: Budget, b: np.ndarray, t: np.ndarray, shape_id: np.ndarray, num_shapes: int,
                 items: dict | None = None, offsets: np.ndarray | None = None, sum_squares=None) -> dict:
    """The ``memory`` entry of a plan kept under a memory limit; refused (one line) when a microbatch's
    predicted peak exceeds it (a replan given another --max-tokens than the limit allows)."""
    from ..memory.budget import over_limit, plan_memory_metadata
    from ..memory.sizes import format_size

    over, worst = over_limit(budget.memory, b, t, bool(c.packing))
    if over:
        raise UsageError(f"{over:,} microbatches are predicted above the plan's --max-memory "
                         f"{format_size(budget.memory['max_memory'])} (up to {format_size(worst)}) with "
                         f"{budget.describe()}; give a smaller --max-tokens, or --max-memory for a new limit")
    return plan_memory_metadata(budget.memory, b, t, shape_id, num_shapes, bool(c.packing),
                                (items or {}).get("sample_lengths"), offsets, sum_squares)


def finish(c: PlanConfig, rows: Rows, epochs: list[PlannedEpoch], col: dict, it: dict, long_pos: np.ndarray,
           inputs: EpochInputs, fixed_batch: int | None, t0: float, *, source: dict,
           extra_metadata: dict | None = None) -> PlanResult:
    """Step columns, LR, shapes, statistics and metadata (updated with ``extra_metadata``); the plan's
    own check; writes the plan. ``source``: the metadata's ``input`` (and ``config``, see
    :func:`build_metadata`)."""
    budget = inputs.budget
    num_steps = sum(ep.mb.count // inputs.slots for ep in epochs)
    counts = col["num_samples"].astype(np.int64)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    step = col["step"].astype(np.int64)
    step_samples = np.bincount(step, weights=col["completed"], minlength=num_steps).astype(np.int64)
    step_tokens = np.bincount(step, weights=col["tokens"], minlength=num_steps).astype(np.int64)
    step_loss_tokens = np.bincount(step, weights=col["targets"], minlength=num_steps).astype(np.int64)
    trained_only = rows.target is not None  # tokens: those that carry loss (target_length)
    scales, base = lr.lr_scales(step_samples, step_loss_tokens if trained_only else step_tokens, step_loss_tokens,
                                c.lr_scaling, c.lr_scale_by, c.base_batch_size)
    if not np.all(np.isfinite(scales)):
        raise UsageError(f"--base-batch-size {c.base_batch_size} gives a non-finite lr_scale; give a larger base "
                         "batch size")

    # shapes: (B, T); B = 0 where it varies (no static shapes)
    fixed_b = c.static_shapes or c.packing
    key_b = col["batch_size"].astype(np.int64) if fixed_b else np.zeros(len(counts), np.int64)
    shape_b, shape_t, shape_id = pair_ids(key_b, col["seqlen"].astype(np.int64))
    shapes = [[int(x), int(y)] for x, y in zip(shape_b.tolist(), shape_t.tolist())]

    b, t = col["batch_size"].astype(np.int64), col["seqlen"].astype(np.int64)
    budget_tokens = _budget_tokens(c, budget, inputs.rows_per_mb, b, t, col["tokens"])
    strag = format.straggler(step, col["rank"].astype(np.int64), col["cost"], c.dp)
    dropped = Dropped(rows, long_pos, [ep.dropped for ep in epochs], c.epochs)
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
    metadata = build_metadata(c, epochs, source=source, num_steps=num_steps, num_microbatches=len(counts),
                              shapes=shapes, base_batch_size=base, inputs=inputs, fixed_batch=fixed_batch,
                              packing=packing, dropped=dropped.to_dict(dropped_all), summary=summary)
    if trained_only:
        metadata["loss_tokens"] = TARGET_COLUMN
    metadata.update(extra_metadata or {})
    if c.schedule is not None:
        from ..schedule.order import combined_report

        metadata["schedule"] = combined_report(c.schedule, c.stages, [ep.schedule_order for ep in epochs])
    if budget.memory is not None:
        metadata["memory"] = memory_entry(c, budget, b, t, shape_id, len(shapes), it, offsets)
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
    lists = {"sample_ids": it["sample_ids"]}
    if c.packing:
        lists.update({k: it[k].astype(np.int32) for k in ("sample_lengths", "sample_rows", "sample_starts")})
    if "source" in it:
        lists["source"] = it["source"].astype(np.int32)
    self_check(row_cols, offsets, lists, it["sample_length"], metadata, it.get("sample_target"))
    writer.write_plan(c.output, c.overwrite, row_cols, offsets, lists, metadata, inputs.slots)
    summary["seconds"] = time.perf_counter() - t0
    return PlanResult(output=storage.absolute(c.output), order=c.order, num_steps=num_steps,
                      num_microbatches=len(counts), stats=summary, packing=packing, dropped_ids=dropped_all,
                      seconds=summary["seconds"], metadata=metadata)


def self_check(row_cols: dict, offsets: np.ndarray, lists: dict, sample_length: np.ndarray, metadata: dict,
               sample_target: np.ndarray | None = None) -> None:
    """The checks of ``varlen validate`` (:mod:`varlen_cli.plan_checks`) on the plan about to be written:
    a violation is a varlen bug (InternalConsistencyError), and no such plan is written."""
    arrays = PlanArrays(row_cols, offsets, lists["sample_ids"], lists.get("sample_lengths"), lists.get("sample_rows"),
                        lists.get("sample_starts"), lists.get("source"), sample_length, sample_target=sample_target)
    bad = [check for check in run_checks(arrays, metadata) if not check.ok]
    if bad:
        raise InternalConsistencyError("the plan fails its own check: " + "; ".join(f"{x.name}: {x.detail}"
                                                                                  for x in bad))
