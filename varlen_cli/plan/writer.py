"""Writing the plan: one Parquet file per docs/formats.md, row groups of whole steps, schema
metadata under the key ``varlen``, written to a temporary file then renamed (atomic)."""

from __future__ import annotations

import numpy as np

from .. import format
from ..errors import OutputError
from ..runtime import artifacts

PLAN_FORMAT = format.PLAN_FORMAT  # the names the planner uses; format.py defines them
PLAN_FORMAT_VERSION = format.PLAN_FORMAT_VERSION
ROW_GROUP_TARGET = 4096  # microbatches per row group (rounded to whole steps)
# dictionary-encode the low-cardinality columns only (trying it on sample ids costs 2x the write)
DICTIONARY_COLUMNS = frozenset({"epoch", "rank", "micro", "num_samples", "seqlen", "batch_size", "lr_scale", "shape_id",
                                "step_samples", "step_tokens"})
plan_schema = format.plan_schema


def rows_per_group(slots: int) -> int:
    return slots * max(1, ROW_GROUP_TARGET // slots)


def plan_metadata(metadata: dict) -> dict:
    """``metadata`` with the keys the format owns filled in: format name and version."""
    return {"format": format.PLAN_FORMAT, "format_version": format.PLAN_FORMAT_VERSION, **metadata}


def check_output(path: str, overwrite: bool) -> None:
    """Refuse an output that exists (without --overwrite), is not a varlen plan, is a link or a directory."""
    artifacts.AtomicFile(path, overwrite).check()


def write_plan(path: str, overwrite: bool, cols: dict, offsets: np.ndarray, items: dict, metadata: dict,
               slots: int) -> None:
    """``cols``: per-row numpy arrays; ``offsets`` (rows + 1) and ``items`` (``sample_ids`` and, for
    packed plans, ``sample_lengths``/``sample_rows``/``sample_starts``) the list columns as CSR."""
    packed = "sample_lengths" in items
    schema = format.plan_schema(packed, plan_metadata(metadata), mixture="source" in items)
    n = len(offsets) - 1
    group = rows_per_group(slots)
    types = {f.name: f.type for f in schema}
    with artifacts.atomic_file(path, overwrite) as out:
        _write_rows(out.tmp, path, schema, types, cols, offsets, items, n, group)


def _write_rows(tmp: str, path: str, schema, types: dict, cols: dict, offsets: np.ndarray, items: dict, n: int,
                group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .arrow_io import list_array, to_arrow

    try:
        with pq.ParquetWriter(tmp, schema, **parquet_options(schema)) as w:
            for lo in range(0, max(n, 1), group):
                hi = min(n, lo + group)
                a, b = int(offsets[lo]), int(offsets[hi])
                local = (offsets[lo:hi + 1] - a).astype(np.int32)
                arrays = []
                for name in schema.names:
                    if name in items:
                        arrays.append(list_array(local, items[name][a:b], types[name]))
                    else:
                        arrays.append(to_arrow(cols[name][lo:hi], types[name]))
                w.write_table(pa.Table.from_arrays(arrays, schema=schema))
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None


def parquet_options(schema) -> dict:
    """Writer settings: the low-cardinality columns dictionary-encoded and zstd-compressed; the list
    columns' values (sample ids: 10M+ per plan) delta-encoded and not compressed, which bit-packs
    them to about as small as zstd does in a third of the time, and reads faster."""
    import pyarrow as pa

    dict_cols = [c for c in schema.names if c in DICTIONARY_COLUMNS]
    leaves = [f"{f.name}.list.element" for f in schema if pa.types.is_list(f.type)]
    zstd = [f.name for f in schema if not pa.types.is_list(f.type)]
    return {"compression": {**{c: "zstd" for c in zstd}, **{leaf: "none" for leaf in leaves}},
            "compression_level": {c: 1 for c in zstd}, "use_dictionary": dict_cols,
            "column_encoding": {leaf: "DELTA_BINARY_PACKED" for leaf in leaves}}
