"""``varlen plan --extend``: a plan's rows, unchanged, followed by the rows of more epochs.

:func:`merge` appends the rows of a plan of the new epochs (written by the planner, steps and epochs
numbered from 0) to the parent's: steps and epochs shifted, shape ids remapped onto the parent's
``shapes`` list (new shapes appended), metadata and statistics recomputed for the whole.
"""

from __future__ import annotations

import json
import time

import numpy as np

from .. import format
from . import stats, writer
from .config import PlanConfig, PlanResult


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
    return {"count": int(old.get("count", 0)) + int(new.get("count", 0)), "reason": reasons, "sample_ids": ids,
            "too_long_ids": old.get("too_long_ids", []), "tail": tail}


def _packing(old: dict | None, new: dict | None, old_tokens: int, new_tokens: int) -> dict | None:
    if old is None or new is None:
        return old
    rows = old_tokens / old["efficiency"] + new_tokens / new["efficiency"]  # used rows x T
    return {**old, "efficiency": (old_tokens + new_tokens) / rows if rows else 1.0,
            "split_samples": int(old.get("split_samples", 0)) + int(new.get("split_samples", 0)),
            "samples_per_row_max": max(old.get("samples_per_row_max", 0), new.get("samples_per_row_max", 0))}


def _summary(c: PlanConfig, cols: dict, meta: dict, shapes: list, dropped: dict, samples_per_epoch: list,
             warmup_steps: int, t0: float) -> dict:
    step, b, t = cols["step"].astype(np.int64), cols["batch_size"].astype(np.int64), cols["seqlen"].astype(np.int64)
    tokens = cols["tokens"].astype(np.int64)
    cost = format.microbatch_cost(meta[format.STRAGGLER_COST_KEY], tokens, b, t)
    slots = c.dp * c.grad_accum
    budget = float(c.max_tokens) if c.max_tokens is not None else float(meta["packing"]["rows_per_microbatch"]
                                                                        * meta["packing"]["seq_len"])
    return stats.summary(
        num_steps=len(step) // slots, num_microbatches=len(step), samples=int(cols["num_samples"].sum()),
        tokens=int(tokens.sum()), padded_tokens=int((b * t).sum()), budget_tokens=budget,
        strag=format.straggler(step, cols["rank"].astype(np.int64), cost, c.dp), shapes=len(shapes),
        lr=cols["lr_scale"][::slots], dropped=dropped["count"], over_budget=0, warmup_steps=warmup_steps,
        epochs=c.epochs, samples_per_epoch=samples_per_epoch, seconds=time.perf_counter() - t0)


def merge(parent, more: PlanResult, c: PlanConfig, lineage: dict, t0: float) -> PlanResult:
    """Write ``c.output``: the rows of ``parent`` (a loader ``Plan``), then those of ``more`` (the new
    epochs, written to ``more.output``), as one plan of ``c.epochs`` epochs."""
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
    summary = _summary(c, cols, old_meta, shapes, dropped, samples_per_epoch, old_meta.get("warmup_steps", 0), t0)
    packing = _packing(old_meta.get("packing"), new_meta.get("packing"), int(old_cols["tokens"].sum()),
                       int(new_cols["tokens"].sum()))
    from ..runtime import artifacts

    meta = {**old_meta, "config": artifacts.config_dict(c), "epochs": c.epochs, "num_steps": summary["steps"],
            "steps_per_epoch": list(old_meta["steps_per_epoch"]) + list(new_meta["steps_per_epoch"]),
            "num_microbatches": summary["microbatches"], "orders": old_meta.get("orders", []) +
            new_meta.get("orders", []), "shapes": shapes, "dropped": dropped, "packing": packing,
            "stats": summary, "lineage": lineage,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    meta.pop("schedule", None)  # the schedule report covered the parent's steps only
    writer.write_plan(c.output, c.overwrite, cols, offsets, items, meta, c.dp * c.grad_accum)
    summary["seconds"] = time.perf_counter() - t0
    ids = np.asarray(dropped["sample_ids"], np.int64)
    return PlanResult(output=c.output, order=c.order, num_steps=summary["steps"],
                      num_microbatches=summary["microbatches"], stats=summary, packing=packing, dropped_ids=ids,
                      seconds=summary["seconds"], metadata=meta)
