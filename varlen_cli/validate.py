"""``varlen validate``: re-check every invariant of a plan file.

This module reads the plan (and optionally the metrics directory it was built from) in windows of
whole steps (:mod:`varlen_cli.checks.scan`); the checks themselves are :mod:`varlen_cli.checks`,
which the planner also runs on every plan before writing it. Everything is recomputed from
scratch, vectorised, in bounded memory: one window at a time and one bit per sample for
exactly-once (a 1B-sample plan: 125 MB a epoch).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from . import format, storage
from .checks import Check, PlanArrays
from .errors import InputError, UsageError
from .runtime import artifacts, freshness, rank0
from .runtime.choices import ALLOW_STALE_HELP, PANEL_RUN, STORAGE_OPTION_HELP, doc

TARGET_COLUMN = format.TARGET_LENGTH_COLUMN

__all__ = ["Check", "ValidateConfig", "ValidateResult", "validate"]


@dataclass(frozen=True)
class ValidateConfig:
    """Options of ``varlen validate``."""

    plan: str = doc(help="Plan Parquet file written by `varlen plan` (local or an s3://... object).")
    metrics: str | None = doc(None, "Metrics or sorted directory the plan was built from (local or an s3://... "
                                    "prefix): also checks the fingerprint, seqlens, token counts and loss tokens.")
    max_memory: str | None = doc(None, "Also check that no microbatch's predicted peak exceeds this (e.g. 70GiB; "
                                       "default: the plan's own --max-memory).")
    memory_profile: str | None = doc(None, "Memory profile for --max-memory (default: the one the plan was made "
                                           "with).")
    allow_stale: bool = doc(False, ALLOW_STALE_HELP, panel=PANEL_RUN)
    storage_options: tuple = doc((), STORAGE_OPTION_HELP, panel=PANEL_RUN)


@dataclass
class ValidateResult:
    plan: str
    checks: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def violations(self) -> list:
        return [c for c in self.checks if not c.ok]


def _open_plan(path: str):
    """The plan's open Parquet file and metadata (:func:`varlen_cli.format.open_plan_file`; local or in
    object storage); an :class:`InputError` for anything else."""
    if not storage.is_remote(path) and not os.path.exists(path):
        raise InputError(f"plan {path} does not exist")
    try:
        return format.open_plan_file(path)
    except format.FormatError as exc:
        raise InputError(str(exc)) from None


def validate(config: ValidateConfig) -> ValidateResult:
    """Check a plan; returns every check's outcome (``result.ok`` when all hold)."""
    if rank0.needs_group():  # under torchrun: rank 0 checks, the others wait for its result
        return rank0.on_rank0(validate, config)
    storage.configure(config.storage_options)
    pf, meta = _open_plan(config.plan)
    result = ValidateResult(config.plan)
    result.checks.append(_columns(pf, meta))
    if not result.checks[-1].ok:
        return result
    per_id = None
    if config.metrics:
        if meta.get("mixture"):
            raise UsageError("--metrics does not apply to a mixture plan (varlen plan --mix): it has one input per "
                             "source")
        manifest = artifacts.read_manifest(config.metrics)
        freshness.check_inputs(config.metrics, manifest, config.allow_stale, rerun="varlen sort")
        fp = _check_fingerprint(meta, manifest, config.metrics)
        result.checks.append(fp)
        if fp.ok and int(manifest["num_rows"]) > LENGTHS_IN_MEMORY:
            result.checks.append(Check("lengths", True, f"the samples' lengths are read for up to "
                                       f"{LENGTHS_IN_MEMORY:,} samples; {config.metrics} has "
                                       f"{int(manifest['num_rows']):,}: checked without them", skipped=True))
        elif fp.ok:  # lengths of another dataset would only produce noise
            per_id = _metrics_per_id(meta, config.metrics, manifest)
    result.checks += _scan(config, pf, meta, per_id)
    return result


def _columns(pf, meta: dict) -> Check:
    problems = format.plan_schema_problems(pf.schema_arrow, meta)
    return Check("columns", not problems, "; ".join(problems) if problems else f"{len(pf.schema_arrow.names)} columns")


def check_file(path: str) -> list[Check]:
    """Every check ``varlen validate PLAN`` (no ``--metrics``) runs on a local plan file, in bounded
    memory; what a planner runs on a plan it wrote before swapping it in (``varlen plan --extend``)."""
    pf, meta = _open_plan(path)
    columns = _columns(pf, meta)
    return [columns] + (_scan(ValidateConfig(plan=path), pf, meta, None) if columns.ok else [])


LENGTHS_IN_MEMORY = 1 << 28  # --metrics lengths held for the checks (int32: 1 GiB)
WINDOW_VALUES = 1 << 19  # sample entries a window holds (both passes): its reads and temporaries are most of
# the peak (2^21: 0.54 GiB for the first pass alone at 100M, 2^19: 0.35 GiB), and no slower


def _scan(config: ValidateConfig, pf, meta: dict, per_id: dict | None) -> list[Check]:
    """Every check of :mod:`varlen_cli.checks`, the plan read in windows of whole steps (bounded
    memory: one window, a bitmap per epoch; issue 25). ``per_id``: the metrics' columns by sample id
    (:func:`_metrics_per_id`), or None."""
    import pyarrow as pa

    from .checks import PlanChecks, scan, split_info

    try:
        slots = int(meta["dp"]) * int(meta["grad_accum"])
        names = pf.schema_arrow.names
        scalars = [c for c in names if c not in format.PLAN_LIST_COLUMNS]
        lists = [c for c in names if c in format.PLAN_LIST_COLUMNS]

        def arrays():
            for w in scan.windows(pf, scalars, lists, slots, WINDOW_VALUES):
                yield window_arrays(w, per_id)

        split = None
        if "sample_starts" in names and per_id is None:  # which chunk ends a split sample, without lengths
            first = [c for c in ("sample_ids", "sample_starts", "source") if c in lists]  # what split_info reads
            split = split_info((window_arrays(w, None) for w in
                                scan.windows(pf, ["epoch"], first, slots, WINDOW_VALUES)), meta)
        with tempfile.TemporaryDirectory(prefix="varlen-validate-") as spill:
            checks = PlanChecks(meta, split=split, lengths=per_id is not None, max_memory=config.max_memory,
                                profile_path=config.memory_profile, spill=spill if "sample_starts" in names else None,
                                background=True)
            del split  # the checks hold what they need of it
            try:
                over = (meta.get("dropped") or {}).get("too_long_over")
                if per_id is not None and over is not None and checks.error is None:  # too-long: counted, not listed
                    checks.coverage.long_samples(np.flatnonzero(_too_long(per_id, meta["dropped"])))
                for a in arrays():
                    checks.update(a)
                return checks.results()
            finally:
                checks.close()  # its thread done before the spill directory goes
    except (OSError, pa.ArrowException) as exc:  # corrupted pages: the file, not varlen
        raise InputError(f"cannot read plan {config.plan}: {str(exc).strip().splitlines()[0] if str(exc) else exc}") \
            from None


def _too_long(per_id: dict, dropped: dict) -> np.ndarray:
    """The samples the plan counted as too long (``dropped.too_long_over``; two budgets: or a target longer
    than ``too_long_target_over``)."""
    out = per_id["length"] > int(dropped["too_long_over"])
    if dropped.get("too_long_target_over") is not None and TARGET_COLUMN in per_id:
        out |= per_id[TARGET_COLUMN] > int(dropped["too_long_target_over"])
    return out


def window_arrays(w, per_id: dict | None) -> PlanArrays:
    """A window of a plan file (:mod:`varlen_cli.checks.scan`) as :class:`~varlen_cli.checks.PlanArrays`;
    ``per_id``: the metrics' ``length`` (and ``target_length``) per sample id (``--metrics``)."""
    offsets, ids = w.lists["sample_ids"]
    ids = ids.astype(np.int64, copy=False)

    def flat(name: str) -> np.ndarray | None:
        if name not in w.lists:
            return None
        off, values = w.lists[name]
        values = values.astype(np.int64, copy=False)
        if not np.array_equal(off, offsets):
            return np.full(len(values) + 1, -1, np.int64)  # a list column that disagrees with sample_ids
        return values

    a = PlanArrays(w.cols, offsets, ids, flat("sample_lengths"), flat("sample_rows"), flat("sample_starts"),
                   flat("source"), first_row=w.first_row)
    if per_id is not None and (not len(ids) or (int(ids.min()) >= 0 and int(ids.max()) < len(per_id["length"]))):
        # else ids outside the metrics: the coverage check says so
        a.sample_length = per_id["length"][ids].astype(np.int64)
        if TARGET_COLUMN in per_id:
            a.sample_target = per_id[TARGET_COLUMN][ids].astype(np.int64)
    return a


def _check_fingerprint(meta: dict, manifest: dict, metrics_path: str) -> Check:
    inp = meta.get("input", {})
    want_digest = inp.get("dataset_digest")
    have_digest = manifest.get("dataset", {}).get("digest")
    if want_digest and have_digest and want_digest != have_digest:
        return Check("fingerprint", False, f"plan was built from dataset {want_digest}, {metrics_path} describes "
                     f"{have_digest}; re-run `varlen analyze` and `varlen plan`")
    if int(inp.get("num_rows", -1)) != int(manifest.get("num_rows", -2)):
        return Check("fingerprint", False, f"plan input had {inp.get('num_rows')} samples, {metrics_path} has "
                     f"{manifest.get('num_rows')}; re-run `varlen plan`")
    if inp.get("artifact_id") not in (None, manifest.get("artifact_id")) and manifest.get("kind") == inp.get("kind"):
        return Check("fingerprint", False, f"plan was built from another {inp.get('kind')} artifact "
                     f"({inp.get('artifact_id')}, now {manifest.get('artifact_id')}); re-run `varlen plan`")
    return Check("fingerprint", True, f"dataset {have_digest}")


def _metrics_per_id(meta: dict, path: str, manifest: dict) -> dict[str, np.ndarray]:
    """The metrics' ``length`` by sample id (and its ``target_length``, for plans that count it as their
    loss tokens; a plan that says so without such a column is an input error)."""
    columns = ["length"]
    if meta.get("loss_tokens") == TARGET_COLUMN:
        if TARGET_COLUMN not in (manifest.get("columns") or {}):
            raise InputError(f"the plan counts the metrics' {TARGET_COLUMN} as its loss tokens, but {path} has no "
                             f"{TARGET_COLUMN} column (analyze --target-length); pass the metrics the plan was made "
                             "from")
        columns.append(TARGET_COLUMN)
    return _metrics_columns(path, manifest, columns)


def _metrics_columns(path: str, manifest: dict, columns: list[str]) -> dict[str, np.ndarray]:
    """``columns`` of a metrics or sorted directory indexed by sample id; an InputError when its ids are
    not 0..N-1."""
    n = int(manifest["num_rows"])
    table = artifacts.read_row_range(path, manifest, 0, n, ["sample_id", *columns])
    ids = table.column("sample_id").to_numpy()
    if len(ids) != n or (n and (int(ids.min()) < 0 or int(ids.max()) >= n)) or \
            (n and len(np.unique(ids)) != n):
        raise InputError(f"{path} does not hold each sample_id 0..{n - 1} once: it is not the metrics of a plan's "
                         "input (re-run `varlen analyze`)")
    out = {}
    for name in columns:
        values = table.column(name).to_numpy()
        fits = not n or (int(values.min()) >= -(1 << 31) and int(values.max()) < 1 << 31)
        out[name] = np.zeros(n, dtype=np.int32 if fits else np.int64)  # int32: 4 bytes a sample at 1B
        out[name][ids] = values
    return out
