"""``varlen plan --extend PLAN --epochs E``: a plan's rows, unchanged, followed by the rows of more epochs.

:func:`extend` plans the new epochs with the parent's options and budget (:mod:`.parent`), numbered
after the parent's, and appends their rows to the parent's: steps and epochs shifted, shape ids
remapped onto the parent's ``shapes`` list (new shapes appended), metadata and statistics recomputed
for the whole, which then passes the plan's own check (:mod:`varlen_cli.plan_checks`) before it is
swapped in.

A plan of one metrics or sorted directory is extended in bounded memory (:mod:`.extend_stream`: the
chunked planner, ``--nproc`` workers, and the parent's row groups copied as they are); a mixture
(``--mix``) in one process holding every sample (:func:`merge`, refused in one line when too big).
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
from ..errors import UsageError
from ..runtime import safety
from ..runtime.choices import ALLOW_MEMORY_EXTRAPOLATION_HELP, NPROC_HELP, STORAGE_OPTION_HELP, doc
from ..runtime.dist import check_nproc
from . import writer
from .assemble import self_check
from .config import PlanConfig, PlanResult
from .extend_meta import budget_tokens, merged_dropped, merged_metadata, merged_packing, merged_shapes
from .parent import (
    Parent,
    check_parent_size,
    check_same_input,
    config_record,
    open_parent,
    parent_config,
    parent_rows,
    plan_epochs_from,
    recorded_input,
)
from .pipeline import Rows, check_plan_size
from .totals import Totals


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
    nproc: int = doc(1, NPROC_HELP)
    progress: bool = doc(True, "Show a progress bar on rank 0 (only on a terminal).")


def extend(config: ExtendConfig) -> PlanResult:
    """Run ``varlen plan --extend``: the plan's rows unchanged, then epochs up to ``config.epochs``."""
    t0 = time.perf_counter()
    storage.configure(config.storage_options)  # the plan's input and the output may be in object storage
    check_nproc(config.nproc)
    parent = open_parent(config.plan)
    if config.epochs <= parent.epochs:
        raise UsageError(f"--epochs {config.epochs} must be more than the {parent.epochs} epoch(s) of "
                         f"{parent.path} to extend it")
    if parent.mixture and config.input:
        raise UsageError("INPUT_DIR does not apply to a mixture plan: its sources are recorded in it")
    if parent.mixture and config.nproc != 1:
        raise UsageError("--nproc applies to plans of one metrics or sorted directory: a mixture plan (--mix) is "
                         "extended in one process")
    inputs = [s.get("path") for s in parent.mixture["sources"]] if parent.mixture else \
        [config.input or recorded_input(parent)]
    safety.check_no_overlap(config.output, [config.plan] + [p for p in inputs if p])
    writer.check_output(config.output, config.overwrite)
    c = parent_config(parent, input=config.input, output=config.output, epochs=config.epochs - parent.epochs,
                      overwrite=config.overwrite, allow_stale=config.allow_stale,
                      storage_options=config.storage_options)
    c = dataclasses.replace(c, nproc=config.nproc, progress=config.progress)
    if config.allow_memory_extrapolation:  # this run's opt-in, recorded like the parent's (config_record)
        c = dataclasses.replace(c, allow_memory_extrapolation=True)
    budget = parent.budget
    if budget.memory:  # the recorded limit, re-checked as every planning command checks it
        from ..memory.budget import check_calibrated_range

        check_calibrated_range(budget.memory, c.allow_memory_extrapolation)
    before = parent.lineage
    whole = dataclasses.replace(c, epochs=config.epochs)  # the options the extended plan records
    record = config_record(whole, budget)
    lineage = {**before, "kind": "extend", "parent": parent.fingerprint,
               "parent_path": os.path.abspath(parent.path), "parent_steps": parent.num_steps,
               "parent_epochs": parent.epochs}
    first_epoch = int(before.get("first_epoch", 0)) + parent.epochs
    if not parent.mixture:  # bounded: the chunked planner, the parent's row groups copied (extend_stream.py)
        from .extend_stream import extend_streamed

        check_same_input(parent, c.input, c.allow_stale)
        return extend_streamed(parent, c, budget, record, lineage, first_epoch, t0)
    return _extend_in_memory(parent, c, budget, record, lineage, first_epoch, whole, t0)


def _extend_in_memory(parent: Parent, c: PlanConfig, budget, record: dict, lineage: dict, first_epoch: int,
                      whole: PlanConfig, t0: float) -> PlanResult:
    """A mixture's extension: every sample of its sources in this process (refused when too big)."""
    check_parent_size(parent, whole.epochs, "varlen plan --extend")
    # the new epochs' plan, a local temporary (beside the output, or in the temporary folder for an object)
    out_dir = (tempfile.gettempdir() if storage.is_remote(c.output) else os.path.dirname(os.path.abspath(c.output)))
    tmp = os.path.join(out_dir, f".{storage.name(c.output)}.extend-{os.getpid()}-{time.time_ns()}")
    new = dataclasses.replace(c, output=tmp, overwrite=False)
    rows, manifest, mixture_info = parent_rows(parent, new)
    check_plan_size(rows.base, whole.epochs, c.packing, f"{rows.base:,} samples")
    try:
        more = plan_epochs_from(new, parent, rows, budget, first_epoch=first_epoch, left=None, manifest=manifest,
                                mixture_info=mixture_info, config_record=record, lineage=None, t0=t0)
        return merge(parent, more, whole, record, lineage, rows, t0)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


EXTEND_KEEPS = ("input", "output", "epochs", "overwrite", "allow_stale", "allow_memory_extrapolation", "extend",
                "progress", "storage_options", "nproc")  # others: refused


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
                               storage_options=given.storage_options, nproc=given.nproc, progress=given.progress))


# -- merging in memory (mixtures) --------------------------------------------------------------------
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
    shapes, remap = merged_shapes(old_meta["shapes"], new_meta["shapes"])
    new_cols["step"] = new_cols["step"] + parent.num_steps
    new_cols["epoch"] = new_cols["epoch"] + parent.epochs
    new_cols["shape_id"] = remap[new_cols["shape_id"].astype(np.int64)].astype(np.int32)
    cols = {n: np.concatenate([old_cols[n], new_cols[n].astype(old_cols[n].dtype)]) for n in old_cols}
    items = {n: np.concatenate([old_items[n], new_items[n]]) for n in old_items}
    offsets = np.concatenate([old_off, new_off[1:] + old_off[-1]])
    dropped = merged_dropped(old_meta.get("dropped") or {}, new_meta.get("dropped") or {}, parent.epochs)
    samples_per_epoch = list(old_meta["stats"]["samples_per_epoch"]) + list(new_meta["stats"]["samples_per_epoch"])
    whole = Totals(format.plan_budget(new_meta), c.dp, c.grad_accum, new_meta.get("memory"), len(shapes))
    whole.update(cols, items.get("sample_lengths") if whole.needs_lengths else None, offsets)
    summary = whole.summary(budget_tokens=budget_tokens(new_meta), shapes=len(shapes), dropped=dropped["count"],
                            warmup_steps=old_meta.get("warmup_steps", 0), epochs=c.epochs,
                            samples_per_epoch=samples_per_epoch, seconds=time.perf_counter() - t0)
    packing = merged_packing(old_meta.get("packing"), new_meta.get("packing"), int(old_cols["tokens"].sum()),
                             int(new_cols["tokens"].sum()))
    meta = merged_metadata(old_meta, new_meta, summary, shapes, dropped, packing, c.epochs, record, lineage)
    if new_meta.get("memory"):
        meta["memory"] = whole.memory_entry()
        summary["predicted_peak_max"] = meta["memory"]["predicted_peak_max"]
    self_check(cols, offsets, items, _sample_lengths(rows, items, meta), meta)
    writer.write_plan(c.output, c.overwrite, cols, offsets, items, meta, c.dp * c.grad_accum)
    summary["seconds"] = time.perf_counter() - t0
    ids = np.asarray(dropped["sample_ids"], np.int64)
    return PlanResult(output=c.output, order=c.order, num_steps=summary["steps"],
                      num_microbatches=summary["microbatches"], stats=summary, packing=packing, dropped_ids=ids,
                      seconds=summary["seconds"], metadata=meta)
