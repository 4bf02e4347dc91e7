"""``varlen plan --extend`` in bounded memory (issue 25): the parent's rows, then the new epochs' rows,
streamed row group by row group.

1. The new epochs are planned by the chunked planner (:mod:`.chunked`, ``--nproc`` workers if given)
   as a :class:`~.chunked.run.Continuation` of the parent: epochs numbered from the parent's, with its
   recorded budget, into a temporary plan in a work directory beside the output
   (``.NAME.varlen-tmp-extend-*``, removed at the end or by the next run after a kill).
2. The new plan's row groups are rewritten one at a time into the part ``rows.parquet`` with the
   parent's schema: ``step``/``epoch`` shifted by the parent's steps and epochs, ``shape_id`` remapped
   onto the parent's ``shapes`` (new shapes appended); every other column unchanged.
3. The statistics and metadata of the whole are summed part by part (:class:`~.totals.Totals`: the
   parent's per-row columns read window by window, the new rows as they are written) and written
   as the footer of an empty file of the same schema.
4. The output is the parent's row groups and the part's, their bytes copied under that footer
   (:func:`varlen_cli.runtime.parquet_concat.concat`), so the parent's rows are its own bytes; a parent
   of another Parquet schema (an older writer) has its row groups re-encoded one at a time instead.
5. The written file is checked window by window with the plan's own check (what ``varlen validate``
   runs) before it is swapped in; any failure leaves an existing output as it was.

Memory: one row group or check window at a time, the chunked planner's own bound, and the per-step
values the checks keep; never a whole column of either plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time

import numpy as np

from .. import format
from ..budget import Budget
from ..errors import InternalConsistencyError, OutputError, PlanError
from ..runtime import parquet_concat, safety
from ..runtime.faults import fault_point
from . import writer
from .chunked.output import PlanOutput
from .config import PlanConfig, PlanResult
from .extend_meta import budget_tokens, merged_dropped, merged_metadata, merged_packing, merged_shapes
from .parent import REPLAN_REMEDIES, Parent
from .totals import Totals

WORK_TAG = safety.TMP_TAG + "-extend"  # .NAME.varlen-tmp-extend-<random>: a leftover the next run cleans
TOO_BIG = "extend the plan by fewer epochs at a time (a smaller --epochs, then extend its output again)"


def extend_streamed(parent: Parent, c: PlanConfig, budget: Budget, record: dict, lineage: dict, first_epoch: int,
                    t0: float, mixture: tuple | None = None, recorded: tuple | None = None) -> PlanResult:
    """Write ``c.output``: ``parent``'s rows, then ``c.epochs`` epochs numbered from ``first_epoch``
    planned by the chunked planner (``c.nproc`` workers) with ``budget``, as one plan (a mixture's:
    its ``mixture`` sources, the parent's ``recorded`` entries of them)."""
    from .chunked.run import Continuation, plan_chunked

    cont = Continuation(first_epoch, budget, REPLAN_REMEDIES, too_big=TOO_BIG, mixture=mixture, recorded=recorded)
    out = PlanOutput(c.output, c.overwrite)
    out.check([parent.path] + cont.inputs(c))
    held: dict = {}
    with out.locked():
        work = _work_dir(out)
        try:
            epochs = os.path.join(work, "epochs.parquet")
            more = plan_chunked(dataclasses.replace(c, output=epochs, overwrite=False), t0, cont)
            t1 = time.perf_counter()
            out.write(lambda tmp: held.update(result=join(parent, epochs, c, record, lineage, tmp, work, t0)),
                      before_commit=lambda: fault_point("extend.write"))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = held["result"]
    result.phases = {**more.phases, "join": time.perf_counter() - t1}  # the new epochs' phases, then the join
    return result


def _work_dir(out: PlanOutput) -> str:
    if out.remote:
        return tempfile.mkdtemp(prefix="varlen-extend-")
    path = safety.sibling(out.local.path, WORK_TAG, unique=True)
    os.makedirs(path)
    return path


def join(parent: Parent, epochs: str, c: PlanConfig, record: dict, lineage: dict, tmp: str, work: str,
         t0: float) -> PlanResult:
    """Write ``tmp``: the rows of ``parent`` then those of the plan ``epochs`` (its epochs and steps
    numbered after the parent's), metadata recomputed, checked (module docstring, steps 2-5)."""
    import pyarrow.parquet as pq

    old_meta, new_meta = parent.meta, json.loads(pq.read_schema(epochs).metadata[format.PLAN_METADATA_KEY.encode()])
    shapes, remap = merged_shapes(old_meta["shapes"], new_meta["shapes"])
    schema = pq.read_schema(parent.path).remove_metadata()
    memory = new_meta.get("memory")
    budget = format.plan_budget(new_meta)

    def totals() -> Totals:
        return Totals(budget, c.dp, c.grad_accum, memory, len(shapes))

    rows, footer = os.path.join(work, "rows.parquet"), os.path.join(work, "footer.parquet")
    old, whole = totals(), dataclasses.replace(c, epochs=parent.epochs + c.epochs)
    try:
        new = _write_rows(epochs, rows, schema, parent, remap, totals())
        for cols, lengths, offsets in _windows(parent.path, old, c.dp * c.grad_accum):
            old.update(cols, lengths, offsets)
        meta, summary = _metadata(old_meta, new_meta, old, new, shapes, whole, record, lineage, t0)
        full = schema.with_metadata(format.encode_plan_metadata(writer.plan_metadata(meta)))
        pq.ParquetWriter(footer, full, **writer.parquet_options(full)).close()
    except OSError as exc:  # a full disk beside the output
        raise OutputError(f"cannot write {c.output}: {exc.strerror or exc}") from None
    if parquet_concat.same_schema(parent.path, footer) and parquet_concat.same_schema(rows, footer):
        parquet_concat.concat([parent.path, rows], tmp, what=c.output, footer=footer)
    else:  # a parent written with another Parquet schema: its row groups re-encoded, one at a time
        _rewrite([parent.path, rows], tmp, full, c.output)
    _check(tmp, parent.path)
    summary["seconds"] = time.perf_counter() - t0
    ids = np.asarray(meta["dropped"].get("sample_ids", []), np.int64)
    return PlanResult(output=whole.output, order=c.order, num_steps=summary["steps"],
                      num_microbatches=summary["microbatches"], stats=summary, packing=meta.get("packing"),
                      dropped_ids=ids, seconds=summary["seconds"], metadata=meta)


def _write_rows(epochs: str, path: str, schema, parent: Parent, remap: np.ndarray, totals: Totals) -> Totals:
    """The plan ``epochs``' rows, numbered after the parent's, written to ``path`` with ``schema`` (the
    parent's) row group by row group; ``totals`` fed each group (returned)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .arrow_io import to_arrow

    pf = pq.ParquetFile(epochs)
    slots = parent.dp * parent.grad_accum
    with pq.ParquetWriter(path, schema, **writer.parquet_options(schema)) as w:
        for cols, lengths, offsets, table in _groups(pf, totals, slots, keep=schema.names):
            cols["step"] = cols["step"] + parent.num_steps
            cols["epoch"] = cols["epoch"] + parent.epochs
            cols["shape_id"] = remap[cols["shape_id"].astype(np.int64)]
            totals.update(cols, lengths, offsets)
            arrays = [to_arrow(cols[f.name], f.type) if f.name in ("step", "epoch", "shape_id")
                      else table.column(f.name).cast(f.type) for f in schema]
            w.write_table(pa.Table.from_arrays(arrays, schema=schema))
    return totals


def _groups(pf, totals: Totals, slots: int, keep):
    """Per row group of ``pf`` (whole steps, as plans are written): the columns ``totals`` reads as numpy,
    its ``sample_lengths`` as CSR (when it needs them), and the group's table of the columns ``keep``."""
    from .arrow_io import flat_list, to_numpy

    for g in range(pf.metadata.num_row_groups):
        table = pf.read_row_group(g, columns=list(keep))
        if table.num_rows % slots:  # pragma: no cover - the chunked writer writes whole steps a group
            raise InternalConsistencyError(f"row group {g} of the new epochs does not hold whole steps")
        cols = {name: to_numpy(table.column(name).combine_chunks()) for name in totals.columns}
        off, values = flat_list(table.column("sample_lengths")) if totals.needs_lengths else (None, None)
        yield cols, values, off, table


def _windows(path: str, totals: Totals, slots: int):
    """Windows of whole steps of the plan ``path``: the columns ``totals`` reads, and ``sample_lengths`` as CSR."""
    import pyarrow.parquet as pq

    from ..checks import scan

    pf = pq.ParquetFile(path)
    lengths = totals.needs_lengths
    for w in scan.windows(pf, totals.columns, ["sample_lengths"] if lengths else [], slots):
        off, values = w.lists["sample_lengths"] if lengths else (None, None)
        yield w.cols, values, off


def _metadata(old_meta: dict, new_meta: dict, old: Totals, new: Totals, shapes: list, c: PlanConfig, record: dict,
              lineage: dict, t0: float) -> tuple[dict, dict]:
    """The metadata of the whole and its summary, from the two parts' metadata and totals."""
    dropped = merged_dropped(old_meta.get("dropped") or {}, new_meta.get("dropped") or {},
                             len(old_meta["steps_per_epoch"]))
    packing = merged_packing(old_meta.get("packing"), new_meta.get("packing"), old.tokens, new.tokens)
    whole = Totals(old.budget, c.dp, c.grad_accum, old.memory, len(shapes))
    whole.merge(old)
    whole.merge(new)
    samples_per_epoch = list(old_meta["stats"]["samples_per_epoch"]) + list(new_meta["stats"]["samples_per_epoch"])
    summary = whole.summary(budget_tokens=budget_tokens(new_meta), shapes=len(shapes), dropped=dropped["count"],
                            warmup_steps=old_meta.get("warmup_steps", 0), epochs=c.epochs,
                            samples_per_epoch=samples_per_epoch, seconds=time.perf_counter() - t0)
    meta = merged_metadata(old_meta, new_meta, summary, shapes, dropped, packing, c.epochs, record, lineage)
    if new_meta.get("memory"):
        meta["memory"] = whole.memory_entry()
        summary["predicted_peak_max"] = meta["memory"]["predicted_peak_max"]
    return meta, summary


def _rewrite(paths: list[str], tmp: str, schema, what: str) -> None:
    """``tmp``: the row groups of ``paths`` re-encoded one at a time with ``schema``."""
    import pyarrow.parquet as pq

    try:
        with pq.ParquetWriter(tmp, schema, **writer.parquet_options(schema)) as w:
            for path in paths:
                pf = pq.ParquetFile(path)
                for g in range(pf.metadata.num_row_groups):
                    w.write_table(pf.read_row_group(g).cast(schema))
    except OSError as exc:
        raise OutputError(f"cannot write {what}: {exc.strerror or exc}") from None


def _check(path: str, parent: str) -> None:
    """The plan's own check (``varlen validate``'s, window by window) on the written file, which is not
    swapped in when it fails: a parent that fails it too is refused (exit 6, ``varlen validate``'s
    verdict: its rows are the extended plan's), else the violation is a varlen bug."""
    from ..validate import check_file

    bad = [check for check in check_file(path) if not check.ok]
    if not bad:
        return
    inherited = [check for check in check_file(parent) if not check.ok]
    if inherited:
        raise PlanError(f"{parent} is not a valid plan, so neither would its extension be: violation: " + "; ".join(
            f"{x.name}: {x.detail}" for x in inherited) + f" (see `varlen validate {parent}`)")
    raise InternalConsistencyError("the extended plan fails its own check: " + "; ".join(
        f"{x.name}: {x.detail}" for x in bad))
