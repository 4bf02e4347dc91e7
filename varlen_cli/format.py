"""The one definition of every varlen artifact's format (``docs/formats.md`` describes it in prose).

Names, format names and versions, required columns and their types, metadata keys, metadata
read/write helpers and the per-step straggler cost. The plan writer, ``varlen validate``,
``varlen inspect``, the runtime's manifest reader and the loader all import it, so they cannot
disagree. Imports only pyarrow, numpy and json (the loader may use it: no torch, typer or rich).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .storage.files import check_regular

# -- metrics and sorted directories ------------------------------------------------------------------
MANIFEST_NAME = "_manifest.json"  # "_" so pyarrow datasets skip it
METRICS_FORMAT = "varlen-metrics"
METRICS_FORMAT_VERSION = 1
#: A `varlen run` output directory: its manifest (written last: the directory is complete when it exists).
RUN_MANIFEST_NAME = "_run.json"
RUN_FORMAT = "varlen-run"
RUN_FORMAT_VERSION = 1
#: A `varlen export deepspeed` output directory (varlen_cli/export.py): its manifest, written last.
EXPORT_MANIFEST_NAME = "_export.json"
DEEPSPEED_EXPORT_FORMAT = "varlen-deepspeed-export"
#: Metrics column of the tokens that carry loss (``varlen analyze --target-length``); a plan made from
#: such metrics counts them as its loss tokens (metadata ``loss_tokens``: this name).
TARGET_LENGTH_COLUMN = "target_length"
#: Columns of every part of a metrics or sorted directory, in order.
METRICS_COLUMNS = (("sample_id", pa.int64()), ("length", pa.int64()), ("difficulty", pa.float64()))


def part_name(index: int) -> str:
    """File name of part ``index`` of a metrics or sorted directory."""
    return f"part-{index:05d}.parquet"


def metrics_schema() -> pa.Schema:
    return pa.schema(list(METRICS_COLUMNS))


#: A memory profile (``varlen calibrate -o profile.json``, docs/memory.md): a JSON object with this "format".
MEMORY_PROFILE_FORMAT = "varlen-memory-profile"
MEMORY_PROFILE_FORMAT_VERSION = 1

# -- plan files --------------------------------------------------------------------------------------
REPORT_GENERATOR = "varlen report"  # the generator mark of `varlen report`'s pages and images (--overwrite)
TRACE_FORMAT = "varlen-trace"  # the "format" of a `varlen simulate --trace` file (Chrome trace events), its first key
#: what ``--overwrite`` looks for in the first 4 KiB of an output before replacing it, any one of (runtime/safety.py):
#: a report's generator as its page's ``<meta name="generator">`` or its image's PNG ``Software`` text (not the words
#: alone: a page of the user's may mention ``varlen report``), a trace's first key
OUTPUT_MARKS = {"report": (f'<meta name="generator" content="{REPORT_GENERATOR} ',
                           f"tEXtSoftware\0{REPORT_GENERATOR} "),
                "trace": (f'{{"format": "{TRACE_FORMAT}"',)}

PLAN_FORMAT = "varlen-plan"
PLAN_FORMAT_VERSION = 1
#: Schema-metadata key holding the plan's JSON metadata.
PLAN_METADATA_KEY = "varlen"
#: Columns of every plan, in file order.
PLAN_COLUMNS = (
    ("epoch", pa.int32()), ("step", pa.int64()), ("rank", pa.int32()), ("micro", pa.int32()),
    ("sample_ids", pa.list_(pa.int64())), ("num_samples", pa.int32()), ("seqlen", pa.int32()),
    ("batch_size", pa.int32()), ("tokens", pa.int64()), ("lr_scale", pa.float64()), ("shape_id", pa.int32()),
    ("step_samples", pa.int64()), ("step_tokens", pa.int64()),
)
#: Extra columns of packed plans (metadata ``packing`` is not null), after :data:`PLAN_COLUMNS`.
PACKED_PLAN_COLUMNS = (
    ("sample_lengths", pa.list_(pa.int32())), ("sample_rows", pa.list_(pa.int32())),
    ("sample_starts", pa.list_(pa.int32())),
)
#: Extra column of mixture plans (metadata ``mixture`` is not null, ``varlen plan --mix``): the source of each
#: entry of ``sample_ids``, an index into the metadata's ``mixture.sources``.
MIXTURE_PLAN_COLUMNS = (("source", pa.list_(pa.int32())),)
#: Extra columns of two-budget plans (metadata ``budget.max_target_tokens`` is not null, ``varlen plan
#: --max-target-tokens``): each microbatch's padded target length T_target, the length its decoder inputs
#: and labels are padded to (``B x target_seqlen`` is within ``max_target_tokens``), and its real target
#: tokens, the sum of its samples' ``target_length`` (a step's sum is its ``step_loss_tokens``; the loader
#: checks the dataset's targets against it).
TARGET_SEQLEN_COLUMN = "target_seqlen"
TARGET_TOKENS_COLUMN = "target_tokens"
TARGET_PLAN_COLUMNS = ((TARGET_SEQLEN_COLUMN, pa.int32()), (TARGET_TOKENS_COLUMN, pa.int64()))
#: Columns new plans write after those above, which readers use when present (older plans lack them):
#: ``step_loss_tokens``, the loss targets of the whole step with shifted labels, counted from the
#: lengths: ``max(l - 1, 0)`` per sample, ``l`` for a non-final chunk of a split sample.
PLAN_OPTIONAL_COLUMNS = (("step_loss_tokens", pa.int64()),)
#: Largest value of the int32 columns (seqlen, sample_lengths, sample_starts, ...): the planner refuses more.
INT32_MAX = 2**31 - 1
PLAN_LIST_COLUMNS = tuple(name for name, t in PLAN_COLUMNS + PACKED_PLAN_COLUMNS + MIXTURE_PLAN_COLUMNS
                          if pa.types.is_list(t))
PLAN_SCALAR_COLUMNS = tuple(name for name, t in PLAN_COLUMNS if not pa.types.is_list(t))
PACKED_COLUMN_NAMES = tuple(name for name, _ in PACKED_PLAN_COLUMNS)
#: Metadata keys a reader needs to lay the rows out.
PLAN_LAYOUT_KEYS = ("dp", "grad_accum", "num_steps", "steps_per_epoch")


class FormatError(ValueError):
    """A file is not the artifact it should be (one line; callers turn it into their error type)."""


def plan_columns(packed: bool, mixture: bool = False, target: bool = False) -> tuple:
    """``(name, type)`` of every column a plan has (packed or padded; a mixture plan adds ``source``, a
    two-budget plan ``target_seqlen`` and ``target_tokens``)."""
    return (PLAN_COLUMNS + (PACKED_PLAN_COLUMNS if packed else ()) + (MIXTURE_PLAN_COLUMNS if mixture else ())
            + (TARGET_PLAN_COLUMNS if target else ()))


def has_target_budget(meta: dict) -> bool:
    """Whether a plan's metadata says it has two budgets (``budget.max_target_tokens``: ``target_seqlen``,
    ``target_tokens``)."""
    budget = meta.get("budget")
    return isinstance(budget, dict) and budget.get("max_target_tokens") is not None


def plan_schema(packed: bool, metadata: dict | None = None, mixture: bool = False,
                target: bool = False) -> pa.Schema:
    """The schema the plan writer writes, with ``metadata`` encoded under :data:`PLAN_METADATA_KEY`."""
    schema = pa.schema(list(plan_columns(packed, mixture, target) + PLAN_OPTIONAL_COLUMNS))
    if metadata is not None:
        schema = schema.with_metadata(encode_plan_metadata(metadata))
    return schema


def encode_plan_metadata(metadata: dict) -> dict:
    return {PLAN_METADATA_KEY: json.dumps(metadata, default=str)}


def raw_plan_metadata(schema: pa.Schema) -> bytes | None:
    """The undecoded metadata bytes (hashed by :func:`plan_fingerprint` to identify a plan)."""
    return (schema.metadata or {}).get(PLAN_METADATA_KEY.encode())


def is_plan_schema(schema: pa.Schema) -> bool:
    """Whether a Parquet schema carries varlen plan metadata (of any version)."""
    raw = raw_plan_metadata(schema)
    if raw is None:
        return False
    try:
        return json.loads(raw).get("format") == PLAN_FORMAT
    except (ValueError, AttributeError):
        return False


def plan_fingerprint(schema: pa.Schema) -> str:
    """A short hash of a plan's metadata: identifies the plan in sampler states and in lineage."""
    import hashlib

    return hashlib.sha256(raw_plan_metadata(schema) or b"").hexdigest()[:16]


def decode_plan_metadata(schema: pa.Schema, path: str) -> dict:
    """The plan metadata of a Parquet schema; :class:`FormatError` when it is not a supported plan."""
    raw = raw_plan_metadata(schema)
    if raw is None:
        raise FormatError(f"{path} is not a varlen plan: no '{PLAN_METADATA_KEY}' schema metadata "
                          "(make one with `varlen plan`)")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise FormatError(f"{path} has unreadable '{PLAN_METADATA_KEY}' schema metadata (not JSON)") from None
    if not isinstance(meta, dict) or meta.get("format") != PLAN_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise FormatError(f"{path} is not a varlen plan (format {fmt!r}, expected {PLAN_FORMAT!r})")
    version = meta.get("format_version")
    if version != PLAN_FORMAT_VERSION:
        raise FormatError(f"{path} has plan format version {version}; this loader reads version {PLAN_FORMAT_VERSION}")
    problem = plan_metadata_type_problem(meta)
    if problem:
        raise FormatError(f"{path} has malformed plan metadata: {problem}")
    return meta


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


#: Metadata keys whose type readers rely on, with a test and what it should be.
_METADATA_TYPES = {
    "dp": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "grad_accum": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "num_steps": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "epochs": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "steps_per_epoch": (_int_list, "a list of integers"),
    "shapes": (lambda v: isinstance(v, list) and all(_int_list(s) and len(s) == 2 for s in v), "a list of [B, T]"),
    "base_batch_size": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                and np.isfinite(v)), "a finite number or null"),
    "config": (lambda v: isinstance(v, dict), "an object"),
    "input": (lambda v: isinstance(v, dict), "an object"),
    "budget": (lambda v: isinstance(v, dict) and _budget_ok(v), "an object with integer max_tokens/max_samples/"
               "max_target_tokens (or null) and a finite attention_cost >= 0"),
    "memory": (lambda v: v is None or _memory_ok(v), "null or an object with an integer max_memory, a margin in "
               "[0, 1), predicted peaks and a profile fit of finite c0, c1, c2 >= 0"),
    "mixture": (lambda v: v is None or _mixture_ok(v), "null or an object with sources of a name, integer num_rows "
                "and a finite weight > 0, and an integer seed"),
    "lineage": (lambda v: v is None or (isinstance(v, dict) and all(
        _is_int(v.get(k, 0)) and v.get(k, 0) >= 0 for k in ("consumed_samples", "first_step", "first_epoch"))),
        "null or an object with integer consumed_samples, first_step and first_epoch"),
    "packing": (lambda v: v is None or (isinstance(v, dict) and _is_int(v.get("seq_len"))), "null or an object "
                "with an integer seq_len"),
    "dropped": (lambda v: isinstance(v, dict) and _int_list(v.get("sample_ids", []))
                and _int_list(v.get("too_long_ids", [])) and isinstance(v.get("tail", []), list)
                and all(isinstance(t, dict) and _is_int(t.get("epoch")) and _int_list(t.get("sample_ids"))
                        for t in v.get("tail", [])), "an object of sample id lists"),
}


def _number(value, low: float = 0.0) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))
            and value >= low)


def _budget_ok(v: dict) -> bool:
    ints = all(v.get(k) is None or (_is_int(v[k]) and v[k] >= 1) for k in ("max_tokens", "max_samples",
                                                                            "max_target_tokens"))
    return ints and _number(v.get("attention_cost", 0.0)) and v.get("cost", "padded") in ("padded", "packed")


def _memory_ok(v) -> bool:
    if not isinstance(v, dict) or not _is_int(v.get("max_memory")) or v["max_memory"] < 1:
        return False
    if not _number(v.get("margin", 0.0)) or v.get("margin", 0.0) >= 1:
        return False
    fit = (v.get("profile") or {}).get("fit") if isinstance(v.get("profile"), dict) else None
    if not isinstance(fit, dict) or not all(_number(fit.get(k)) for k in ("c0", "c1", "c2")):
        return False
    peaks = v.get("predicted_peak_per_shape", [])
    return _number(v.get("predicted_peak_max", 0.0)) and isinstance(peaks, list) and all(_number(p) for p in peaks)


def _mixture_ok(v) -> bool:
    sources = v.get("sources") if isinstance(v, dict) else None
    return (isinstance(sources, list) and _is_int(v.get("seed", 0)) and all(
        isinstance(s, dict) and isinstance(s.get("name"), str) and _is_int(s.get("num_rows")) and s["num_rows"] >= 0
        and _number(s.get("weight")) and s["weight"] > 0 and _is_int(s.get("samples_per_epoch", 0)) for s in sources))


def plan_metadata_type_problem(meta: dict) -> str | None:
    """The first metadata key (of those present) whose value has the wrong type, described; else None."""
    for key, (ok, want) in _METADATA_TYPES.items():
        if key in meta and not ok(meta[key]):
            return f"'{key}' is {json.dumps(meta[key], default=str)[:60]}, expected {want}"
    return None


def open_plan_file(path: str) -> tuple[pq.ParquetFile, dict]:
    """A plan file opened for reading and its metadata; :class:`FormatError` for anything else. A
    plan in object storage (``s3://...``) is read by range requests (footer, then row groups)."""
    from . import storage

    if storage.is_remote(path):
        return _open_remote_plan_file(path)
    if not os.path.exists(path):
        raise FormatError(f"plan file not found: {path}")
    if os.path.isdir(path):
        raise FormatError(f"{path} is a directory, not a plan file (make one with `varlen plan`)")
    check_regular(path, "plan", FormatError)
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a non-Parquet file
        raise FormatError(f"{path} is not a readable Parquet file: {exc}") from None
    return parquet, decode_plan_metadata(parquet.schema_arrow, path)


def _open_remote_plan_file(path: str) -> tuple[pq.ParquetFile, dict]:
    from . import storage
    from .errors import InputError

    try:
        info = storage.stat(path)
    except InputError as exc:  # missing, unreachable, denied: one line
        raise FormatError(exc.message) from None
    if info.is_dir:
        raise FormatError(f"{path} is a directory, not a plan file (make one with `varlen plan`)")
    try:
        parquet = storage.parquet_file(path, size=info.size)
    except InputError as exc:  # the object is there (stat): it is no Parquet
        detail = exc.message.removeprefix(f"cannot read {path}: ")
        raise FormatError(f"{path} is not a readable Parquet file: {detail}") from None
    return parquet, decode_plan_metadata(parquet.schema_arrow, path)


def read_plan_metadata(path: str) -> tuple[dict, pa.Schema]:
    """A plan's metadata and Parquet schema (footer only); :class:`FormatError` for anything else."""
    parquet, meta = open_plan_file(path)
    return meta, parquet.schema_arrow


def _same_kind(have: pa.DataType, want: pa.DataType) -> bool:
    """Integer for integer, float for float, list of integers for list of integers (any width)."""
    if pa.types.is_list(want) or pa.types.is_large_list(want):
        return (pa.types.is_list(have) or pa.types.is_large_list(have)) and _same_kind(have.value_type,
                                                                                         want.value_type)
    if pa.types.is_integer(want):
        return pa.types.is_integer(have)
    return pa.types.is_floating(have)


def plan_schema_problems(schema: pa.Schema, meta: dict) -> list[str]:
    """What makes a plan's columns or layout metadata unusable, each phrased after the file's name
    (``f"{path} {problem}"``); empty when every required column and key is there with its type."""
    packed = bool(meta.get("packing"))
    names = set(schema.names)
    columns = plan_columns(packed, bool(meta.get("mixture")), has_target_budget(meta))
    missing = [name for name, _ in columns if name not in names]
    problems = []
    if missing:
        problems.append(f"lacks plan columns: {', '.join(missing)}")
    for name, want in columns + PLAN_OPTIONAL_COLUMNS:
        if name in names and not _same_kind(schema.field(name).type, want):
            problems.append(f"has column {name} of type {schema.field(name).type}, expected {want}")
    problems += [f"lacks '{key}' in its plan metadata" for key in PLAN_LAYOUT_KEYS if key not in meta]
    return problems


# -- cost, straggler and loss targets ---------------------------------------------------------------
def plan_budget(meta: dict):
    """The :class:`varlen_cli.budget.Budget` a plan was made with (its ``budget`` entry; older plans'
    ``straggler_cost``/``packing``): the one cost model every reader uses. :class:`FormatError` when
    the entry is malformed."""
    from .budget import Budget

    try:
        return Budget.from_metadata(meta)
    except ValueError as exc:
        raise FormatError(f"malformed plan metadata: {exc}") from None


def plan_straggler_cost(meta: dict) -> dict:
    """The cost a plan's straggler statistics use, as ``{"kind", "attention_cost"}`` (for display)."""
    return plan_budget(meta).straggler_spec()


def plan_cost_columns(budget) -> list[str]:
    """The plan columns :func:`table_cost` reads under ``budget``."""
    return (["tokens", "batch_size", "seqlen"] + (["sample_lengths"] if budget.needs_segment_lengths else [])
            + ([TARGET_SEQLEN_COLUMN] if budget.two_sided else []))


def table_cost(table: pa.Table, budget) -> np.ndarray:
    """Per-microbatch cost of a plan table (with :func:`plan_cost_columns`) under ``budget``."""
    import pyarrow.compute as pc

    from .budget import segment_sum_squares

    tokens = table.column("tokens").to_numpy()
    sum_squares = None
    if budget.needs_segment_lengths:
        col = table.column("sample_lengths").combine_chunks()
        flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        offsets = np.zeros(len(tokens) + 1, np.int64)
        np.cumsum(pc.list_value_length(col).to_numpy(zero_copy_only=False), out=offsets[1:])
        sum_squares = segment_sum_squares(flat, offsets)
    target = table.column(TARGET_SEQLEN_COLUMN).to_numpy() if budget.two_sided else None
    return budget.microbatch_cost(tokens, table.column("batch_size").to_numpy(), table.column("seqlen").to_numpy(),
                                  sum_squares, target)


def loss_targets(entry_length, final=None, target=None) -> np.ndarray:
    """Next-token loss targets of each sample entry of a plan (``step_loss_tokens`` sums them per
    step): ``max(l - 1, 0)`` for a whole sample or the last chunk of a split one (``final``, None:
    every entry), ``l`` for an earlier chunk (its last token's target is the next chunk's first).
    ``target``: per entry, the tokens that carry loss as the metrics counted them (their
    ``target_length`` column, ``varlen analyze --target-length``; every entry is then a whole
    sample): those, instead of the ones counted from the lengths."""
    if target is not None:
        return np.asarray(target, dtype=np.int64)
    length = np.asarray(entry_length, dtype=np.int64)
    whole = np.maximum(length - 1, 0)
    return whole if final is None else np.where(final, whole, length)


def step_loads(step: np.ndarray, rank: np.ndarray, cost: np.ndarray, dp: int) -> np.ndarray:
    """(steps x dp) matrix: the cost each rank carries in each step."""
    if not len(step):
        return np.zeros((0, dp))
    steps = int(step.max()) + 1
    return np.bincount(step * dp + rank, weights=cost, minlength=steps * dp).reshape(steps, dp)


def straggler(step: np.ndarray, rank: np.ndarray, cost: np.ndarray, dp: int) -> np.ndarray:
    """Per step: the busiest rank's cost / the mean rank cost (1.0 = balanced)."""
    if not len(step):
        return np.zeros(0)
    load = step_loads(step, rank, cost, dp)
    mean = load.mean(axis=1)
    return np.where(mean > 0, load.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)


def step_figures(step: np.ndarray, rank: np.ndarray, cols: dict, cost: np.ndarray, dp: int) -> dict:
    """Per step of rows holding whole steps (``step`` numbered from 0 in them, ``cols``: the plan's
    ``tokens``, ``batch_size``, ``seqlen`` and ``num_samples`` of each row, ``cost`` its cost under
    the plan's budget): what ``varlen inspect``, ``varlen report`` and the trackers show of a step,
    computed here once. Arrays of one value a step: ``tokens`` (real), ``padded_tokens`` (B x T),
    ``samples`` (sample entries), ``seqlen_max`` (the largest T), ``straggler`` (:func:`straggler`),
    ``rank_tokens_min``/``max``/``mean`` (the real tokens each rank runs in the step), and ``loads``
    (:func:`step_loads`: steps x dp)."""
    steps = int(step.max()) + 1 if len(step) else 0
    tokens = cols["tokens"].astype(np.float64)
    loads = step_loads(step, rank, cost, dp)
    mean = loads.mean(axis=1) if steps else np.zeros(0)
    per_rank = step_loads(step, rank, tokens, dp)
    seqlen_max = np.zeros(steps)
    np.maximum.at(seqlen_max, step, cols["seqlen"].astype(np.float64))
    return {
        "tokens": np.bincount(step, weights=tokens, minlength=steps),
        "padded_tokens": np.bincount(step, weights=cols["batch_size"].astype(np.float64) * cols["seqlen"],
                                     minlength=steps),
        "samples": np.bincount(step, weights=cols["num_samples"].astype(np.float64), minlength=steps),
        "seqlen_max": seqlen_max,
        "straggler": np.where(mean > 0, loads.max(axis=1, initial=0.0) / np.where(mean > 0, mean, 1), 1.0),
        "rank_tokens_min": per_rank.min(axis=1, initial=np.inf) if steps else np.zeros(0),
        "rank_tokens_max": per_rank.max(axis=1, initial=0.0),
        "rank_tokens_mean": per_rank.mean(axis=1) if steps else np.zeros(0),
        "loads": loads,
    }


def straggler_overhead(step: np.ndarray, rank: np.ndarray, cost: np.ndarray, dp: int) -> float:
    """The time every rank waits for the slowest: sum over steps of the max rank cost / sum of the
    mean rank cost, minus 1 (0.0 = balanced)."""
    load = step_loads(step, rank, cost, dp)
    mean = float(load.mean(axis=1).sum()) if len(load) else 0.0
    return float(load.max(axis=1).sum()) / mean - 1.0 if mean > 0 else 0.0


# -- metrics / sorted manifest field types ----------------------------------------------------------
def check_manifest_fields(path: str, manifest: dict, name: str = MANIFEST_NAME) -> None:
    """Field types of a metrics or sorted directory's manifest, checked before anything uses them:
    :class:`FormatError` naming the first field whose type is wrong (``"num_rows": "x"``, a part
    without ``rows``). Only the fields stages read are checked; unknown fields are left alone."""

    def bad(field: str, want: str, got) -> FormatError:
        shown = repr(got) if len(repr(got)) <= 40 else repr(got)[:37] + "..."
        return FormatError(f"{path} has a malformed {name}: '{field}' must be {want}, got {shown}")

    if not _is_manifest_count(manifest.get("format_version", 0)):
        raise bad("format_version", "a non-negative integer", manifest.get("format_version"))
    if "num_rows" in manifest and not _is_manifest_count(manifest["num_rows"]):
        raise bad("num_rows", "a non-negative integer", manifest["num_rows"])
    parts = manifest.get("parts", [])
    if not isinstance(parts, list):
        raise bad("parts", "a list", parts)
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise bad(f"parts[{i}]", "an object", part)
        file = part.get("file")
        if not isinstance(file, str) or not file or "/" in file or "\\" in file or file.startswith("."):
            raise bad(f"parts[{i}].file", "a file name inside the directory", file)
        if not _is_manifest_count(part.get("rows")):
            raise bad(f"parts[{i}].rows", "a non-negative integer", part.get("rows"))
    for key in ("dataset", "input", "order", "columns", "stats"):
        if manifest.get(key) is not None and not isinstance(manifest[key], dict):
            raise bad(key, "an object", manifest[key])
    for key in ("artifact_id", "kind"):
        if manifest.get(key) is not None and not isinstance(manifest[key], str):
            raise bad(key, "a string", manifest[key])
    _check_manifest_dataset(manifest.get("dataset") or {}, bad)


def _check_manifest_dataset(dataset: dict, bad) -> None:
    for key in ("digest", "root"):
        if dataset.get(key) is not None and not isinstance(dataset[key], str):
            raise bad(f"dataset.{key}", "a string", dataset[key])
    files = dataset.get("files", [])
    if not isinstance(files, list):
        raise bad("dataset.files", "a list", files)
    for i, entry in enumerate(files):
        _check_file_entry(entry, f"dataset.files[{i}]", bad)
        companions = entry.get("companions", [])
        if not isinstance(companions, list):
            raise bad(f"dataset.files[{i}].companions", "a list", companions)
        for j, companion in enumerate(companions):
            _check_file_entry(companion, f"dataset.files[{i}].companions[{j}]", bad)


def _check_file_entry(entry, where: str, bad) -> None:
    """One file's fingerprint (runtime.freshness.record): a path, counts, hashes as strings."""
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise bad(where, "an object with a 'path'", entry)
    for key in ("size", "rows", "mtime_ns"):
        if key in entry and not _is_manifest_count(entry[key]):
            raise bad(f"{where}.{key}", "a non-negative integer", entry[key])
    for key in ("footer", "sample", "etag", "version"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise bad(f"{where}.{key}", "a string", entry[key])


def _is_manifest_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# -- loader states ------------------------------------------------------------------------------------
#: The position keys of a loader or sampler state (``PlanBatchSampler.state_dict()``,
#: ``PlanDataLoader.state_dict()``, the file ``varlen replan --state`` reads); ``ledger`` is optional.
STATE_POSITION_KEYS = ("epoch", "step", "micro")


def _state_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def loader_state_problem(state) -> str | None:
    """What is wrong with the shape of a loader or sampler state, or None: a dict whose ``epoch``,
    ``step`` and ``micro`` are integers >= 0, and whose ``ledger`` (when present) holds ``consumed``,
    a list of ``[start, stop]`` integer pairs with ``0 <= start < stop``, and ``ended``, a list of
    integers >= 0. Whether the position and the ledger fit a plan is the plan's to say (the loader)."""
    if not isinstance(state, dict):
        return f"it is a {type(state).__name__}, not a dict (pass what loader.state_dict() returned)"
    for key in STATE_POSITION_KEYS:
        if key not in state:
            return f"it has no '{key}'"
        if not _state_int(state[key]) or state[key] < 0:
            return f"its '{key}' is {_shown(state[key])}, not an integer >= 0"
    ledger = state.get("ledger")
    if ledger is None:
        return None
    if not isinstance(ledger, dict):
        return f"its 'ledger' is {_shown(ledger)}, not a dict"
    consumed, ended = ledger.get("consumed", []), ledger.get("ended", [])
    if not isinstance(consumed, list):
        return f"its ledger's 'consumed' is {_shown(consumed)}, not a list of [start, stop] pairs"
    for span in consumed:
        if not isinstance(span, (list, tuple)) or len(span) != 2 or not all(map(_state_int, span)) \
                or not 0 <= span[0] < span[1]:
            return f"its ledger's 'consumed' holds {_shown(span)}, not a [start, stop] pair with 0 <= start < stop"
    if not isinstance(ended, list) or not all(_state_int(e) and e >= 0 for e in ended):
        return f"its ledger's 'ended' is {_shown(ended)}, not a list of epoch numbers"
    return None


def ledger_history_problem(spans: list[list[int]], ended: set[int], position: int, grad_accum: int,
                           steps_per_epoch: list[int], describe) -> str | None:
    """Why a ledger (consumed ``spans`` of positions ``step * grad_accum + micro``, the epochs ``ended``
    early) cannot be the history of a job at ``position`` of a plan with these ``steps_per_epoch``
    (None if it can): spans past the position or out of order, an ended epoch the plan does not have
    or that lies ahead, or untrained positions outside the epochs ended early. ``describe(k)`` names
    position k in messages. One rule for the loader (``Ledger.restore``) and ``varlen replan --state``."""
    starts = np.cumsum([0, *steps_per_epoch])
    epochs, num_steps = len(steps_per_epoch), int(starts[-1])

    def epoch_of(step: int) -> int:
        return int(np.searchsorted(starts[1:], min(step, num_steps - 1), side="right"))

    for a, b in spans:
        if b > position:
            return (f"its ledger holds positions [{a}, {b}) but its position {describe(position)} is "
                    f"position {position}: the ledger and the position come from different points")
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        return f"its ledger's spans {spans[:4]} overlap or are out of order"
    last = epoch_of(position // grad_accum)
    for e in sorted(ended):
        if e >= epochs or e > last:
            return f"its ledger says epoch {e} was ended early, but the plan has {epochs} epoch(s) and the state is " \
                   f"at epoch {last}"
    for lo, hi in zip([0] + [b for _, b in spans], [a for a, _ in spans] + [position]):
        if lo < hi:
            open_epochs = [e for e in range(epoch_of(lo // grad_accum), epoch_of((hi - 1) // grad_accum) + 1)
                           if e not in ended]
            if open_epochs:
                return (f"its ledger leaves {describe(lo)} to {describe(hi - 1)} untrained, in epoch {open_epochs[0]}, "
                        "which was not ended with end_epoch(): those positions would never be trained (was the state "
                        "edited, or put together from two jobs?)")
    return None
