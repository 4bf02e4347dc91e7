"""Phase 3: the plan file written row group by row group from the epochs' rows and the chunk files.

A row group holds ``writer.rows_per_group(slots)`` consecutive plan rows (whole steps). For each group,
the items of its rows are read from the chunk files: the rows of one chunk are sorted by their first
item and merged into runs (rows whose items lie within
:data:`GAP` items of each other), and each run is read with one ``pread``; then one gather puts the
items in row order. Bucket-shuffle windows and the interleaving take each chunk's units in sequence,
so a group reads one short run per chunk; the warm-up's few moved microbatches cost a read each.
Memory: a group's items and the runs read for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import format
from ...checks import PlanArrays, PlanChecks, segment_reduce
from ...errors import InternalConsistencyError, OutputError
from .. import batching, writer
from .epoch import EpochRows
from .finish import Finished, row_positions
from .spill import ItemReader

GAP = 1 << 16  # items between two rows of a chunk read in one run rather than two


_CHUNK_SHIFT = 40  # a (chunk, item) key: chunk << 40 | item (items of a chunk < 2^40, chunks < 2^23)


def _runs(chunk: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge the item ranges ``[lo, hi)`` of chunks ``chunk`` (any order) into runs of one chunk each: in
    (chunk, lo) order, a range starts a new run when it lies more than :data:`GAP` items beyond the
    furthest end so far (or in the next chunk). Returns each run's chunk, start and end, in (chunk,
    start) order, and the run of each range."""
    base = chunk.astype(np.int64) << _CHUNK_SHIFT
    s_all = base + lo
    order = np.argsort(s_all, kind="stable")
    s, e = s_all[order], (base + hi)[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > reach[:-1] + GAP
    first = np.flatnonzero(new)
    starts = s[first]
    ends = np.maximum.reduceat(e, first) if len(s) else np.zeros(0, np.int64)
    run = np.empty(len(lo), np.int64)
    run[order] = np.cumsum(new) - 1
    run_chunk = starts >> _CHUNK_SHIFT
    return run_chunk, starts - (run_chunk << _CHUNK_SHIFT), ends - (run_chunk << _CHUNK_SHIFT), run


class GroupItems:
    """The items of a set of rows (``chunk``, ``item_lo``, ``count``), in row order, read by runs."""

    def __init__(self, readers: list[ItemReader], names: tuple):
        self.readers, self.names = readers, names

    def read(self, chunk: np.ndarray, item_lo: np.ndarray, count: np.ndarray) -> tuple[dict, np.ndarray]:
        count = count.astype(np.int64)
        offsets = np.zeros(len(count) + 1, np.int64)
        np.cumsum(count, out=offsets[1:])
        lo = item_lo.astype(np.int64)
        run_chunk, starts, ends, run = _runs(chunk, lo, lo + count)
        run_at = np.zeros(len(starts) + 1, np.int64)
        np.cumsum(ends - starts, out=run_at[1:])
        flat = {name: np.empty(int(run_at[-1]), self.readers[0].dtype_of(name) if self.readers else np.int64)
                for name in self.names}
        for k, s, e, at in zip(run_chunk.tolist(), starts.tolist(), ends.tolist(), run_at[:-1].tolist()):
            for name in self.names:
                self.readers[k].read_into(name, s, e, flat[name][at:at + e - s])
        idx = batching.segment_gather(run_at[:-1][run] + (lo - starts[run]), count, offsets)
        return {name: flat[name][idx] for name in self.names}, offsets


@dataclass
class RowSpec:
    """What plan rows ``[lo, lo + len(count))`` of epoch ``epoch`` (epoch-local rows) are made of
    besides their items: each row's unit columns and item address (``chunk``, ``item_lo``, ``count``),
    and for packed microbatches of R > 1 chunk rows each row's chunk rows and their item counts
    (``nrows``, ``per_row``). Small (about 30 bytes a row): rank 0 hands them to the other workers."""

    epoch: int
    lo: int
    count: np.ndarray
    batch: np.ndarray
    seqlen: np.ndarray
    tokens: np.ndarray
    chunk: np.ndarray
    item_lo: np.ndarray
    nrows: np.ndarray | None = None
    per_row: np.ndarray | None = None
    target_seqlen: np.ndarray | None = None  # two budgets: each row's padded T_target


def row_specs(epochs: list[EpochRows], starts: np.ndarray, lo: int, hi: int) -> list[RowSpec]:
    """The :class:`RowSpec` of plan rows ``[lo, hi)`` (one per epoch they span)."""
    out = []
    for e, ep in enumerate(epochs):
        a, b = max(lo, int(starts[e])), min(hi, int(starts[e + 1]))
        if b <= a:
            continue
        lo_e, hi_e = a - int(starts[e]), b - int(starts[e])
        spec = RowSpec(e, lo_e, ep.column("count", lo_e, hi_e), ep.column("batch", lo_e, hi_e),
                       ep.column("seqlen", lo_e, hi_e), ep.column("tokens", lo_e, hi_e),
                       ep.column("chunk", lo_e, hi_e), ep.column("item_lo", lo_e, hi_e))
        if ep.rows is not None and not ep.item_rows:
            spec.nrows, spec.per_row = _chunk_rows(ep, lo_e, hi_e)
        if ep.budget is not None and ep.budget.two_sided:
            spec.target_seqlen = ep.column("tseqlen", lo_e, hi_e)
        out.append(spec)
    return out


def _chunk_rows(ep: EpochRows, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk rows of each of plan rows ``[lo, hi)`` (packed microbatches of R > 1 chunk rows), and the
    items of each chunk row."""
    k = ep.column("chunk", lo, hi).astype(np.int64)
    first = ep.row_seq_start[k] + ep.column("row_lo", lo, hi).astype(np.int64)
    nrows = ep.column("rows", lo, hi).astype(np.int64)
    row_off = np.concatenate([[0], np.cumsum(nrows)])
    positions = batching.segment_gather(first, nrows, row_off)
    return nrows, ep.rows.take("count", ep.rows.ids(positions)).astype(np.int64)


def _local_rows(spec: RowSpec) -> np.ndarray:
    """Row of each item inside its microbatch (from the chunk rows' item counts; with R = 1 every item
    is in row 0)."""
    if spec.nrows is None:
        return np.zeros(int(spec.count.astype(np.int64).sum()), np.int32)
    row_off = np.concatenate([[0], np.cumsum(spec.nrows)])
    local = np.arange(len(spec.per_row), dtype=np.int64) - np.repeat(row_off[:-1], spec.nrows)
    out = np.repeat(local, spec.per_row)
    if len(out) != int(spec.count.astype(np.int64).sum()):  # pragma: no cover - the tables disagree with the items
        raise OutputError("a packed microbatch's rows do not hold its items")
    return out.astype(np.int32)


@dataclass
class RowGroups:
    """What every row group of a plan needs besides its rows' specs and the chunk files: the step
    columns and shapes (``fin``), the item arrays to read and whether each epoch's chunk files hold
    the items' rows. Picklable: the workers that write segments get it from rank 0."""

    fin: Finished
    names: tuple
    packed: bool
    item_rows: list
    dp: int
    grad_accum: int
    total: int  # plan rows

    @property
    def group(self) -> int:
        return writer.rows_per_group(self.dp * self.grad_accum)

    def bounds(self) -> list[int]:
        """First row of each row group."""
        return list(range(0, max(self.total, 1), self.group))

    def schema(self):
        return format.plan_schema(self.packed, writer.plan_metadata(self.fin.metadata),
                                  mixture="source" in self.names, target=format.has_target_budget(self.fin.metadata))


def row_groups_of(epochs: list[EpochRows], fin: Finished, dp: int, grad_accum: int, packed: bool) -> RowGroups:
    names = ("ids", "sample_length", "item_length", "item_start") if packed else ("ids", "sample_length")
    if fin.metadata.get("loss_tokens") == format.TARGET_LENGTH_COLUMN or format.has_target_budget(fin.metadata):
        names += ("sample_target",)  # the check counts the metrics' targets; two budgets: target_tokens sums them
    if "mixture" in fin.metadata:  # each entry's source
        names += ("source",)
    return RowGroups(fin, names, packed, [bool(ep.item_rows) for ep in epochs], dp, grad_accum,
                  sum(ep.count for ep in epochs))


def write(path: str, overwrite: bool, epochs: list[EpochRows], fin: Finished, readers: list[list[ItemReader]],
          dp: int, grad_accum: int, packed: bool, tmp_path: str) -> None:
    """Stream the plan into ``tmp_path`` (the caller swaps it in), checking it on the way."""
    rg = row_groups_of(epochs, fin, dp, grad_accum, packed)
    starts = np.concatenate([[0], np.cumsum([ep.count for ep in epochs])])
    checks = PlanChecks(fin.metadata, lengths=True)  # the plan's own check, row group by row group
    groups = [(lo, min(rg.total, lo + rg.group)) for lo in rg.bounds()]
    write_groups(path, tmp_path, rg, readers, checks, ((lo, lambda lo=lo, hi=hi: row_specs(epochs, starts, lo, hi))
                                                        for lo, hi in groups))
    raise_failed(checks)


def raise_failed(checks: PlanChecks) -> None:
    """The planner's refusal of a plan that fails its own check (a bug)."""
    bad = [check for check in checks.results() if not check.ok]
    if bad:
        raise InternalConsistencyError("the plan fails its own check: " + "; ".join(f"{x.name}: {x.detail}"
                                                                                  for x in bad))


def write_groups(path: str, tmp_path: str, rg: RowGroups, readers: list[list[ItemReader]], checks: PlanChecks,
                 groups) -> None:
    """Write row groups into a Parquet file ``tmp_path`` (``path``: the output, for messages), each
    checked by ``checks``; ``groups``: (first plan row, a function returning its row specs) per row group."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..arrow_io import list_array, to_arrow

    schema = rg.schema()
    types = {f.name: f.type for f in schema}

    def prepare(item):
        first_row, specs = item
        return (first_row,) + _group(rg, readers, specs())

    groups = iter(groups)
    # one thread reads and gathers the next row group while this one is encoded (pyarrow and the
    # reads release the GIL: the two overlap on two cores)
    try:
        with pq.ParquetWriter(tmp_path, schema, **writer.parquet_options(schema)) as w, \
                ThreadPoolExecutor(1) as pool:
            nxt = next(groups, None)
            pending = pool.submit(prepare, nxt) if nxt is not None else None
            while pending is not None:
                first_row, cols, items, offsets = pending.result()
                nxt = next(groups, None)
                pending = pool.submit(prepare, nxt) if nxt is not None else None
                checks.update(PlanArrays(cols, offsets, items["sample_ids"], items.get("sample_lengths"),
                                         items.get("sample_rows"), items.get("sample_starts"), items.get("source"),
                                         items.pop("sample_length"), sample_target=items.pop("sample_target", None),
                                         first_row=first_row))
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


def _group(rg: RowGroups, readers, specs: list[RowSpec]):
    """Columns and list items of the plan rows of ``specs`` (one row group; it may span epochs)."""
    fin, dp, grad_accum = rg.fin, rg.dp, rg.grad_accum
    parts_cols, parts_items, parts_counts = [], [], []
    for spec in specs:
        e, n = spec.epoch, len(spec.count)
        step, rank, micro = row_positions(n, dp, grad_accum, spec.lo)
        gstep = step + fin.step_start[e]
        count, batch, seqlen = spec.count, spec.batch, spec.seqlen
        cols = {"epoch": np.full(n, e, np.int32), "step": gstep, "rank": rank.astype(np.int32),
                "micro": micro.astype(np.int32), "num_samples": count.astype(np.int32),
                "seqlen": seqlen.astype(np.int32), "batch_size": batch.astype(np.int32),
                "tokens": spec.tokens.astype(np.int64), "lr_scale": fin.scales[gstep],
                "shape_id": fin.shape_id(batch, seqlen.astype(np.int64)), "step_samples": fin.step_samples[gstep],
                "step_tokens": fin.step_tokens[gstep], "step_loss_tokens": fin.step_loss_tokens[gstep]}
        if spec.target_seqlen is not None:
            cols[format.TARGET_SEQLEN_COLUMN] = spec.target_seqlen.astype(np.int32)
        item_rows = rg.packed and rg.item_rows[e]
        got, offsets = GroupItems(readers[e], rg.names + (("item_row",) if item_rows else ())).read(
            spec.chunk, spec.item_lo, count)
        items = {"sample_ids": got["ids"], "sample_length": got["sample_length"].astype(np.int64)}
        if "sample_target" in got:
            items["sample_target"] = got["sample_target"].astype(np.int64)
        if spec.target_seqlen is not None:  # two budgets: each row's real target tokens
            cols[format.TARGET_TOKENS_COLUMN] = segment_reduce(np.add, items["sample_target"], offsets)
        if "source" in got:
            items["source"] = got["source"]
        if rg.packed:
            items["sample_lengths"] = got["item_length"]
            items["sample_starts"] = got["item_start"]
            items["sample_rows"] = got["item_row"] if item_rows else _local_rows(spec)
        parts_cols.append(cols)
        parts_items.append(items)
        parts_counts.append(count.astype(np.int64))
    if len(specs) == 1:  # a row group inside one epoch
        return parts_cols[0], parts_items[0], offsets
    cols = {name: np.concatenate([p[name] for p in parts_cols]) for name in parts_cols[0]} if parts_cols else {}
    items = {name: np.concatenate([p[name] for p in parts_items]) for name in parts_items[0]} if parts_items else {}
    counts = np.concatenate(parts_counts) if parts_counts else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return cols, items, offsets
