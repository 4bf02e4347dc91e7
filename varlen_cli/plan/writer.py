"""Writing the plan: a plan file's Parquet settings, row groups of whole steps and schema metadata
under the key ``varlen`` (docs/formats.md; the chunked planner streams the file, :mod:`.chunked.emit`),
and the metadata's entries: :func:`build_metadata` (what the plan records of its options, input,
budget, layout and statistics), :func:`memory_entry` (its predicted peaks under a memory limit)."""

from __future__ import annotations

import os

import numpy as np

from .. import __version__, format, storage
from ..errors import UsageError
from ..runtime import artifacts

ROW_GROUP_TARGET = 4096  # microbatches per row group (rounded to whole steps)
# dictionary-encode the low-cardinality columns only (trying it on sample ids costs 2x the write)
DICTIONARY_COLUMNS = frozenset({"epoch", "rank", "micro", "num_samples", "seqlen", "batch_size", "lr_scale", "shape_id",
                                "step_samples", "step_tokens"})


def rows_per_group(slots: int) -> int:
    return slots * max(1, ROW_GROUP_TARGET // slots)


def plan_metadata(metadata: dict) -> dict:
    """``metadata`` with the keys the format owns filled in: format name and version."""
    return {"format": format.PLAN_FORMAT, "format_version": format.PLAN_FORMAT_VERSION, **metadata}


def check_output(path: str, overwrite: bool) -> None:
    """Refuse an output that exists (without --overwrite), is not a varlen plan, is a link or a directory."""
    artifacts.AtomicFile(path, overwrite).check()


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


# -- the metadata --------------------------------------------------------------------------------------
def location_record(path: str, output: str) -> dict:
    """An input of the plan ``output`` as its metadata records it: ``path``, absolute (a URL as given),
    and ``relative_path``, the input as seen from the plan's folder: still right after a move of both
    (varlen run's swap); null when the input or the plan is in object storage."""
    where = storage.absolute(path)
    if storage.is_remote(path) or storage.is_remote(output):
        return {"path": where, "relative_path": None}
    return {"path": where, "relative_path": os.path.relpath(where, os.path.dirname(os.path.abspath(output)))}


def input_location(c) -> dict:
    """:func:`location_record` of ``c.input`` as the plan records it: with ``PlanConfig.recorded_input``
    (varlen run builds the input in a temporary directory) its final path; ``relative_path`` holds as
    it is, since the input and the plan move together."""
    where = location_record(c.input, c.output)
    if getattr(c, "recorded_input", None):
        where["path"] = storage.absolute(c.recorded_input)
    return where


def recorded_config(c) -> dict:
    """The options a plan records: what it is made of, not how the command ran (no output, overwrite,
    progress, nproc, allow_stale: ``artifacts.RUNTIME_FIELDS``), so the same input and options give
    the same file, whatever the number of workers and wherever it is written."""
    recorded = {k: v for k, v in artifacts.config_dict(c).items()
                if k not in artifacts.RUNTIME_FIELDS and not (k in RECORDED_WHEN_SET and v is None)}
    if getattr(c, "recorded_input", None):  # varlen run: the input's final path, not its temporary's
        recorded["input"] = storage.absolute(c.recorded_input)
    return recorded


RECORDED_WHEN_SET = ("max_target_tokens",)
"""Options a plan records only when given: plans without them are the files they were before the option."""


def build_metadata(c, *, config: dict, input: dict, num_steps: int, num_microbatches: int, steps_per_epoch: list,
                   orders: list, shapes: list, warmup_steps: int, base_batch_size, budget, shape_map: dict,
                   fixed_batch: int | None, packing: dict | None, dropped: dict, summary: dict) -> dict:
    """The plan's key-value metadata (see docs/formats.md): ``config`` the options it records
    (:func:`recorded_config`, or a derived plan's), ``input`` what it was planned from."""
    return {
        "format": format.PLAN_FORMAT, "format_version": format.PLAN_FORMAT_VERSION,
        "varlen_version": __version__,
        "config": config, "input": input,
        "dp": c.dp, "grad_accum": c.grad_accum, "epochs": c.epochs, "num_steps": num_steps,
        "steps_per_epoch": steps_per_epoch, "num_microbatches": num_microbatches,
        "orders": orders,
        "shapes": shapes, "warmup_steps": warmup_steps,
        "base_batch_size": base_batch_size, "lr_scaling": c.lr_scaling, "lr_scale_by": c.lr_scale_by,
        "budget": budget.to_metadata(),
        "shape_map": shape_map, "fixed_batch_size": fixed_batch,
        "packing": packing,
        "dropped": dropped,
        "stats": {key: value for key, value in summary.items() if key != "seconds"},
    }


def memory_entry(c, budget, b: np.ndarray, t: np.ndarray, shape_id: np.ndarray, num_shapes: int,
                 sum_squares=None) -> dict:
    """The ``memory`` entry of a plan kept under a memory limit; refused (one line) when a microbatch's
    predicted peak exceeds it (a replan given another --max-tokens than the limit allows)."""
    from ..memory.budget import over_limit, plan_memory_metadata
    from ..memory.sizes import format_size

    over, worst = over_limit(budget.memory, b, t, bool(c.packing))
    if over:
        raise UsageError(f"{over:,} microbatches are predicted above the plan's --max-memory "
                         f"{format_size(budget.memory['max_memory'])} (up to {format_size(worst)}) with "
                         f"{budget.describe()}; give a smaller --max-tokens, or --max-memory for a new limit")
    return plan_memory_metadata(budget.memory, b, t, shape_id, num_shapes, bool(c.packing), None, None, sum_squares)
