"""``varlen plan --extend PLAN --epochs E``: a plan's rows, unchanged, followed by the rows of more epochs.

:func:`extend` plans the new epochs with the parent's options and budget (:mod:`.parent`; mixtures
and ``--split-long`` plans alike) into a temporary plan, and :func:`merge` appends its rows to the
parent's: steps and epochs shifted, shape ids remapped onto the parent's ``shapes`` list (new shapes
appended), metadata and statistics recomputed for the whole, which then passes the plan's own check
(:mod:`varlen_cli.plan_checks`) before it is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from .. import format, storage
from ..budget import segment_sum_squares
from ..errors import UsageError
from ..runtime import safety
from ..runtime.choices import ALLOW_MEMORY_EXTRAPOLATION_HELP, STORAGE_OPTION_HELP, doc
from . import stats, writer
from .assemble import self_check
from .config import PlanConfig, PlanResult
from .parent import (
    Parent,
    check_parent_size,
    config_record,
    open_parent,
    parent_config,
    parent_rows,
    plan_epochs_from,
    recorded_input,
)
from .pipeline import Rows, check_plan_size


@dataclass(frozen=True)
class ExtendConfig:
    """Options of ``varlen plan --extend PLAN --epochs E``."""

    plan: str = doc(help="The plan to lengthen.")
    output: str = doc(help="The extended plan file to write.")
    epochs: int = doc(help="Epochs of the extended plan (more than the plan has).")
    input: str | None = doc(None, "The plan's metrics/sorted directory, if it moved (default: the recorded path).")
    overwrite: bool = doc(False, "Replace an existing output (written atomically either way).")
    allow_stale: bool = doc(False, "Use metrics even if their source files changed since `varlen analyze`.")
    allow_memory_extrapolation: bool = doc(False, ALLOW_MEMORY_EXTRAPOLATION_HELP)
    storage_options: tuple = doc((), STORAGE_OPTION_HELP)


def extend(config: ExtendConfig) -> PlanResult:
    """Run ``varlen plan --extend``: the plan's rows unchanged, then epochs up to ``config.epochs``."""
    t0 = time.perf_counter()
    storage.configure(config.storage_options)  # the plan's input and the output may be in object storage
    parent = open_parent(config.plan)
    if config.epochs <= parent.epochs:
        raise UsageError(f"--epochs {config.epochs} must be more than the {parent.epochs} epoch(s) of "
                         f"{parent.path} to extend it")
    if parent.mixture and config.input:
        raise UsageError("INPUT_DIR does not apply to a mixture plan: its sources are recorded in it")
    inputs = [s.get("path") for s in parent.mixture["sources"]] if parent.mixture else \
        [config.input or recorded_input(parent)]
    safety.check_no_overlap(config.output, [config.plan] + [p for p in inputs if p])
    writer.check_output(config.output, config.overwrite)
    # the new epochs' plan, a local temporary (beside the output, or in the temporary folder for an object)
    out_dir = (tempfile.gettempdir() if storage.is_remote(config.output)
               else os.path.dirname(os.path.abspath(config.output)))
    tmp = os.path.join(out_dir, f".{storage.name(config.output)}.extend-{os.getpid()}-{time.time_ns()}")
    c = parent_config(parent, input=config.input, output=tmp, epochs=config.epochs - parent.epochs,
                      overwrite=False, allow_stale=config.allow_stale, storage_options=config.storage_options)
    if config.allow_memory_extrapolation:  # this run's opt-in, recorded like the parent's (config_record)
        c = dataclasses.replace(c, allow_memory_extrapolation=True)
    budget = parent.budget
    if budget.memory:  # the recorded limit, re-checked as every planning command checks it
        from ..memory.budget import check_calibrated_range

        check_calibrated_range(budget.memory, c.allow_memory_extrapolation)
    check_parent_size(parent, config.epochs, "varlen plan --extend")
    rows, manifest, mixture_info = parent_rows(parent, c)
    check_plan_size(rows.base, config.epochs, c.packing, f"{rows.base:,} samples")
    before = parent.lineage
    record = config_record(dataclasses.replace(c, output=config.output, overwrite=config.overwrite,
                                               epochs=config.epochs), budget)
    try:
        more = plan_epochs_from(c, parent, rows, budget, first_epoch=int(before.get("first_epoch", 0)) + parent.epochs,
                                left=None, manifest=manifest, mixture_info=mixture_info, config_record=record,
                                lineage=None, t0=t0)
        lineage = {**before, "kind": "extend", "parent": parent.fingerprint,
                   "parent_path": os.path.abspath(parent.path), "parent_steps": parent.num_steps,
                   "parent_epochs": parent.epochs}
        return merge(parent, more, dataclasses.replace(c, output=config.output, overwrite=config.overwrite,
                                                       epochs=config.epochs), record, lineage, rows, t0)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


EXTEND_KEEPS = ("input", "output", "epochs", "overwrite", "allow_stale", "allow_memory_extrapolation", "extend",
                "progress", "storage_options")  # others: refused


def run_extend(given: PlanConfig) -> PlanResult:
    """``plan(PlanConfig(extend=PLAN, epochs=E, output=OUT))``: refuses options that would change the plan."""
    defaults = PlanConfig(input="", output="")
    for f in dataclasses.fields(PlanConfig):
        if f.name not in EXTEND_KEEPS and getattr(given, f.name) != getattr(defaults, f.name):
            option = "--" + f.name.replace("_", "-")
            raise UsageError(f"{option} cannot be combined with --extend: the extended plan keeps the plan's options "
                             "(use `varlen replan` to change the layout)")
    return extend(ExtendConfig(plan=given.extend, output=given.output, epochs=given.epochs, input=given.input or None,
                               overwrite=given.overwrite, allow_stale=given.allow_stale,
                               allow_memory_extrapolation=given.allow_memory_extrapolation,
                               storage_options=given.storage_options))


# -- merging -----------------------------------------------------------------------------------------
def _read(path: str) -> tuple[dict, dict, np.ndarray, dict]:
    """Per-row columns, list columns (flat values), their offsets, and the metadata of a plan file."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[format.PLAN_METADATA_KEY.encode()])
    lists = [n for n in table.column_names if n in format.PLAN_LIST_COLUMNS]
    cols = {n: table.column(n).to_numpy() for n in table.column_names if n not in lists}
    items = {n: pc.list_flatten(table.column(n).combine_chunks()).to_numpy(zero_copy_only=False) for n in lists}
    counts = pc.list_value_length(table.column("sample_ids").combine_chunks()).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return cols, items, offsets, meta


def _dropped(old: dict, new: dict, epochs_before: int) -> dict:
    ids = sorted(set(old.get("sample_ids", [])) | set(new.get("sample_ids", [])))
    reasons = {k: int((old.get("reason") or {}).get(k, 0)) + int((new.get("reason") or {}).get(k, 0))
               for k in ("too_long", "tail")}
    tail = list(old.get("tail", [])) + [{**t, "epoch": t["epoch"] + epochs_before} for t in new.get("tail", [])]
    out = {"count": int(old.get("count", 0)) + int(new.get("count", 0)), "reason": reasons, "sample_ids": ids,
           "too_long_ids": old.get("too_long_ids", []), "tail": tail}
    if "too_long_sources" in old:
        out["too_long_sources"] = old["too_long_sources"]
    return out


def _packing(old: dict | None, new: dict | None, old_tokens: int, new_tokens: int) -> dict | None:
    if old is None or new is None:
        return old
    rows = old_tokens / old["efficiency"] + new_tokens / new["efficiency"]  # used rows x T
    return {**old, "efficiency": (old_tokens + new_tokens) / rows if rows else 1.0,
            "split_samples": int(old.get("split_samples", 0)) + int(new.get("split_samples", 0)),
            "samples_per_row_max": max(old.get("samples_per_row_max", 0), new.get("samples_per_row_max", 0))}


def _mixture(old: dict | None, new: dict | None) -> dict | None:
    if not old or not new:
        return old
    sources = [{**a, "tokens_per_epoch": list(a.get("tokens_per_epoch", [])) + list(b.get("tokens_per_epoch", []))}
               for a, b in zip(old["sources"], new["sources"])]
    return {**old, "sources": sources}


def _summary(c: PlanConfig, cols: dict, items: dict, offsets: np.ndarray, meta: dict, shapes: list, dropped: dict,
             samples_per_epoch: list, warmup_steps: int, t0: float) -> dict:
    step, b, t = cols["step"].astype(np.int64), cols["batch_size"].astype(np.int64), cols["seqlen"].astype(np.int64)
    tokens = cols["tokens"].astype(np.int64)
    budget = format.plan_budget(meta)
    sum_squares = segment_sum_squares(items["sample_lengths"], offsets) if budget.needs_segment_lengths else None
    cost = budget.microbatch_cost(tokens, b, t, sum_squares)
    slots = c.dp * c.grad_accum
    budget_tokens = float(budget.max_tokens) if budget.max_tokens is not None else float(
        meta["packing"]["rows_per_microbatch"] * meta["packing"]["seq_len"])
    rank = cols["rank"].astype(np.int64)
    out = stats.summary(
        num_steps=len(step) // slots, num_microbatches=len(step), samples=int(cols["num_samples"].sum()),
        tokens=int(tokens.sum()), padded_tokens=int((b * t).sum()), budget_tokens=budget_tokens,
        strag=format.straggler(step, rank, cost, c.dp), shapes=len(shapes),
        lr=cols["lr_scale"][::slots], dropped=dropped["count"], over_budget=0, warmup_steps=warmup_steps,
        epochs=c.epochs, samples_per_epoch=samples_per_epoch, seconds=time.perf_counter() - t0)
    out["straggler_overhead"] = format.straggler_overhead(step, rank, cost, c.dp)
    return out


def _sample_lengths(rows: Rows, items: dict, meta: dict) -> np.ndarray:
    """Each entry's whole sample length (by source and id), for the merged plan's own check."""
    span = int(rows.sample_id[:rows.base].max()) + 1 if rows.base else 1
    src_rows = rows.source[:rows.base].astype(np.int64) if rows.source is not None else 0
    length_of = np.zeros(span * (len(meta["mixture"]["sources"]) if meta.get("mixture") else 1), np.int64)
    length_of[src_rows * span + rows.sample_id[:rows.base]] = rows.length[:rows.base]
    src = items["source"].astype(np.int64) if "source" in items else 0
    return length_of[src * span + items["sample_ids"].astype(np.int64)]


def merge(parent: Parent, more: PlanResult, c: PlanConfig, record: dict, lineage: dict, rows: Rows,
          t0: float) -> PlanResult:
    """Write ``c.output``: the rows of ``parent``, then those of ``more`` (the new epochs, written to
    ``more.output``), as one plan of ``c.epochs`` epochs."""
    old_cols, old_items, old_off, old_meta = _read(parent.path)
    new_cols, new_items, new_off, new_meta = _read(more.output)
    shapes = [list(s) for s in old_meta["shapes"]]
    index = {tuple(s): i for i, s in enumerate(shapes)}
    for s in new_meta["shapes"]:
        index.setdefault(tuple(s), len(shapes))
        if len(shapes) < len(index):
            shapes.append(list(s))
    remap = np.array([index[tuple(s)] for s in new_meta["shapes"]], np.int64)
    new_cols["step"] = new_cols["step"] + parent.num_steps
    new_cols["epoch"] = new_cols["epoch"] + parent.epochs
    new_cols["shape_id"] = remap[new_cols["shape_id"].astype(np.int64)].astype(np.int32)
    cols = {n: np.concatenate([old_cols[n], new_cols[n].astype(old_cols[n].dtype)]) for n in old_cols}
    items = {n: np.concatenate([old_items[n], new_items[n]]) for n in old_items}
    offsets = np.concatenate([old_off, new_off[1:] + old_off[-1]])
    dropped = _dropped(old_meta.get("dropped") or {}, new_meta.get("dropped") or {}, parent.epochs)
    samples_per_epoch = list(old_meta["stats"]["samples_per_epoch"]) + list(new_meta["stats"]["samples_per_epoch"])
    summary = _summary(c, cols, items, offsets, new_meta, shapes, dropped, samples_per_epoch,
                       old_meta.get("warmup_steps", 0), t0)
    packing = _packing(old_meta.get("packing"), new_meta.get("packing"), int(old_cols["tokens"].sum()),
                       int(new_cols["tokens"].sum()))
    meta = {**old_meta, "config": record, "epochs": c.epochs, "num_steps": summary["steps"],
            "steps_per_epoch": list(old_meta["steps_per_epoch"]) + list(new_meta["steps_per_epoch"]),
            "num_microbatches": summary["microbatches"], "orders": old_meta.get("orders", []) +
            new_meta.get("orders", []), "shapes": shapes, "dropped": dropped, "packing": packing,
            "budget": new_meta["budget"], "stats": {k: v for k, v in summary.items() if k != "seconds"},
            "lineage": lineage}
    meta.pop("created_at", None)  # plans made before their files were a function of input and options
    for key in ("straggler_cost", "cost_model"):  # older plans' copies of the budget: it is in "budget" now
        meta.pop(key, None)
    if old_meta.get("mixture"):
        meta["mixture"] = _mixture(old_meta["mixture"], new_meta.get("mixture"))
    if new_meta.get("memory"):
        meta["memory"] = _memory(new_meta["memory"], cols, shapes, bool(packing), items, offsets)
        summary["predicted_peak_max"] = meta["memory"]["predicted_peak_max"]
    meta.pop("schedule", None)  # the schedule report covered the parent's steps only
    self_check(cols, offsets, items, _sample_lengths(rows, items, meta), meta)
    writer.write_plan(c.output, c.overwrite, cols, offsets, items, meta, c.dp * c.grad_accum)
    summary["seconds"] = time.perf_counter() - t0
    ids = np.asarray(dropped["sample_ids"], np.int64)
    return PlanResult(output=c.output, order=c.order, num_steps=summary["steps"],
                      num_microbatches=summary["microbatches"], stats=summary, packing=packing, dropped_ids=ids,
                      seconds=summary["seconds"], metadata=meta)


def _memory(memory: dict, cols: dict, shapes: list, packed: bool, items: dict, offsets: np.ndarray) -> dict:
    """The merged plan's ``memory`` entry: the predicted peaks of all its shapes."""
    from ..memory.budget import plan_memory_metadata

    return plan_memory_metadata(memory, cols["batch_size"], cols["seqlen"], cols["shape_id"], len(shapes), packed,
                                items.get("sample_lengths"), offsets)
