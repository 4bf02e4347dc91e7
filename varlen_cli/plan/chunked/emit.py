"""Phase 3: the plan file written row group by row group from the epochs' rows and the chunk files.

A row group holds ``writer.rows_per_group(slots)`` consecutive plan rows (as the single-process
writer groups them). For each group, the items of its rows are read from the chunk files: the rows
of one chunk are sorted by their first item and merged into runs (rows whose items lie within
:data:`GAP` items of each other), and each run is read with one ``pread``; then one gather puts the
items in row order. Bucket-shuffle windows and the interleaving take each chunk's units in sequence,
so a group reads one short run per chunk; the warm-up's few moved microbatches cost a read each.
Memory: a group's items and the runs read for it.
"""

from __future__ import annotations

import numpy as np

from ... import format
from ...errors import InternalConsistencyError, OutputError
from ...plan_checks import PlanArrays, PlanChecks
from .. import batching, writer
from .epoch import EpochRows
from .finish import Finished, row_positions
from .spill import ItemReader

GAP = 1 << 16  # items between two rows of a chunk read in one run rather than two


def _runs(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge item ranges ``[lo, hi)`` (any order) into runs; returns run starts, run ends and the run
    of each range."""
    order = np.argsort(lo, kind="stable")
    s, e = lo[order], hi[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > reach[:-1] + GAP
    run_of_sorted = np.cumsum(new) - 1
    starts = s[new]
    ends = np.maximum.reduceat(e, np.flatnonzero(new)) if len(s) else np.zeros(0, np.int64)
    run = np.empty(len(lo), np.int64)
    run[order] = run_of_sorted
    return starts, ends, run


class GroupItems:
    """The items of a set of rows (``chunk``, ``item_lo``, ``count``), in row order, read by runs."""

    def __init__(self, readers: list[ItemReader], names: tuple):
        self.readers, self.names = readers, names

    def read(self, chunk: np.ndarray, item_lo: np.ndarray, count: np.ndarray) -> tuple[dict, np.ndarray]:
        count = count.astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
        buffers = {name: [] for name in self.names}
        src_start = np.zeros(len(chunk), np.int64)
        at = 0
        for k in np.unique(chunk).tolist():
            rows = np.flatnonzero(chunk == k)
            lo = item_lo[rows].astype(np.int64)
            starts, ends, run = _runs(lo, lo + count[rows])
            run_at = at + np.concatenate([[0], np.cumsum(ends - starts)])[:-1]
            src_start[rows] = run_at[run] + (lo - starts[run])
            for s, e in zip(starts.tolist(), ends.tolist()):
                for name in self.names:
                    buffers[name].append(self.readers[k].read(name, s, e))
            at += int((ends - starts).sum())
        idx = batching.segment_gather(src_start, count, offsets)
        out = {}
        for name in self.names:
            flat = np.concatenate(buffers[name]) if buffers[name] else np.zeros(0, np.int64)
            out[name] = flat[idx] if len(idx) else flat[:0]
        return out, offsets


def _local_rows(ep: EpochRows, lo: int, hi: int, counts: np.ndarray) -> np.ndarray:
    """Row of each item inside its microbatch, for microbatches of R > 1 chunk rows (from the rows' item
    counts; with R = 1 every item is in row 0)."""
    if ep.rows is None:
        return np.zeros(int(counts.sum()), np.int32)
    k = ep.column("chunk", lo, hi).astype(np.int64)
    first = ep.row_seq_start[k] + ep.column("row_lo", lo, hi).astype(np.int64)
    nrows = ep.column("rows", lo, hi).astype(np.int64)
    row_off = np.concatenate([[0], np.cumsum(nrows)])
    positions = batching.segment_gather(first, nrows, row_off)
    per_row = ep.rows.take("count", ep.rows.ids(positions)).astype(np.int64)
    local = np.arange(len(positions), dtype=np.int64) - np.repeat(row_off[:-1], nrows)
    out = np.repeat(local, per_row)
    if len(out) != int(counts.sum()):  # pragma: no cover - the tables disagree with the items
        raise OutputError("a packed microbatch's rows do not hold its items")
    return out.astype(np.int32)


def write(path: str, overwrite: bool, epochs: list[EpochRows], fin: Finished, readers: list[list[ItemReader]],
          dp: int, grad_accum: int, packed: bool, tmp_path: str) -> None:
    """Stream the plan into ``tmp_path`` (the caller swaps it in)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..arrow_io import list_array, to_arrow

    schema = format.plan_schema(packed, writer.plan_metadata(fin.metadata))
    types = {f.name: f.type for f in schema}
    slots = dp * grad_accum
    group = writer.rows_per_group(slots)
    names = ("ids", "sample_length", "item_length", "item_start") if packed else ("ids", "sample_length")
    if fin.metadata.get("loss_tokens") == format.TARGET_LENGTH_COLUMN:  # the check counts the metrics' targets
        names += ("sample_target",)
    starts = np.concatenate([[0], np.cumsum([ep.count for ep in epochs])])
    total = int(starts[-1])
    from concurrent.futures import ThreadPoolExecutor

    def prepare(lo: int):
        return _group(epochs, fin, readers, names, starts, lo, min(total, lo + group), dp, grad_accum, packed)

    bounds = list(range(0, max(total, 1), group))
    # one thread reads and gathers the next row group while this one is encoded (pyarrow and the
    # reads release the GIL: the two overlap on two cores)
    checks = PlanChecks(fin.metadata, lengths=True)  # the plan's own check, row group by row group
    try:
        with pq.ParquetWriter(tmp_path, schema, **writer.parquet_options(schema)) as w, \
                ThreadPoolExecutor(1) as pool:
            pending = pool.submit(prepare, bounds[0])
            for i in range(len(bounds)):
                cols, items, offsets = pending.result()
                if i + 1 < len(bounds):
                    pending = pool.submit(prepare, bounds[i + 1])
                checks.update(PlanArrays(cols, offsets, items["sample_ids"], items.get("sample_lengths"),
                                         items.get("sample_rows"), items.get("sample_starts"), None,
                                         items.pop("sample_length"), sample_target=items.pop("sample_target", None),
                                         first_row=bounds[i]))
                local = offsets.astype(np.int32)
                arrays = []
                for name in schema.names:
                    if name in items:
                        arrays.append(list_array(local, items[name], types[name]))
                    else:
                        arrays.append(to_arrow(cols[name], types[name]))
                w.write_table(pa.Table.from_arrays(arrays, schema=schema))
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    bad = [check for check in checks.results() if not check.ok]
    if bad:
        raise InternalConsistencyError("the plan fails its own check: " + "; ".join(f"{x.name}: {x.detail}"
                                                                                  for x in bad))


def _group(epochs, fin: Finished, readers, names, starts, lo: int, hi: int, dp: int, grad_accum: int, packed: bool):
    """Columns and list items of plan rows ``[lo, hi)`` (they may span epochs)."""
    parts_cols, parts_items, parts_counts = [], [], []
    for e, ep in enumerate(epochs):
        a, b = max(lo, int(starts[e])), min(hi, int(starts[e + 1]))
        if b <= a:
            continue
        lo_e, hi_e = a - int(starts[e]), b - int(starts[e])
        step, rank, micro = row_positions(b - a, dp, grad_accum, lo_e)
        gstep = step + fin.step_start[e]
        count = ep.column("count", lo_e, hi_e)
        batch, seqlen = ep.column("batch", lo_e, hi_e), ep.column("seqlen", lo_e, hi_e)
        cols = {"epoch": np.full(b - a, e, np.int32), "step": gstep, "rank": rank.astype(np.int32),
                "micro": micro.astype(np.int32), "num_samples": count.astype(np.int32),
                "seqlen": seqlen.astype(np.int32), "batch_size": batch.astype(np.int32),
                "tokens": ep.column("tokens", lo_e, hi_e).astype(np.int64), "lr_scale": fin.scales[gstep],
                "shape_id": fin.shape_id(batch, seqlen.astype(np.int64)), "step_samples": fin.step_samples[gstep],
                "step_tokens": fin.step_tokens[gstep], "step_loss_tokens": fin.step_loss_tokens[gstep]}
        got, _ = GroupItems(readers[e], names + (("item_row",) if packed and ep.item_rows else ())).read(
            ep.column("chunk", lo_e, hi_e), ep.column("item_lo", lo_e, hi_e), count)
        items = {"sample_ids": got["ids"], "sample_length": got["sample_length"].astype(np.int64)}
        if "sample_target" in got:
            items["sample_target"] = got["sample_target"].astype(np.int64)
        if packed:
            items["sample_lengths"] = got["item_length"]
            items["sample_starts"] = got["item_start"]
            items["sample_rows"] = got["item_row"] if ep.item_rows else _local_rows(ep, lo_e, hi_e, count)
        parts_cols.append(cols)
        parts_items.append(items)
        parts_counts.append(count.astype(np.int64))
    cols = {name: np.concatenate([p[name] for p in parts_cols]) for name in parts_cols[0]} if parts_cols else {}
    items = {name: np.concatenate([p[name] for p in parts_items]) for name in parts_items[0]} if parts_items else {}
    counts = np.concatenate(parts_counts) if parts_counts else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return cols, items, offsets
