"""What ``varlen replan`` and ``varlen plan --extend`` start from: the parent plan (its metadata,
options and budget as recorded), the rows it was planned from (its input, or a mixture's virtual
rows), the entries of an epoch left after a step (:func:`remaining_rows`), and planning epochs from
there (:func:`plan_epochs_from`), with the ordinary planner's pipeline."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from .. import format, storage
from ..budget import Budget
from ..errors import InputError
from ..runtime import artifacts
from .assemble import assemble_columns, finish, input_info
from .config import PlanConfig, PlanResult, check
from .layout import Remedies
from .orders import EpochInputs
from .pipeline import PlannedEpoch, Rows, check_plan_size, epoch_inputs, plan_epochs
from .reader import read_input, read_targets

REPLAN_REMEDIES = Remedies(tail=False, drop_long=False)  # replan keeps the parent's --tail and --drop-long


@dataclass
class Parent:
    """What replan/extend read of the parent plan: its metadata and fingerprint (footer only; no torch)."""

    path: str
    meta: dict
    fingerprint: str  # as ``varlen_cli.loader.Plan.fingerprint`` and sampler states

    @property
    def dp(self) -> int:
        return int(self.meta["dp"])

    @property
    def grad_accum(self) -> int:
        return int(self.meta["grad_accum"])

    @property
    def num_steps(self) -> int:
        return int(self.meta["num_steps"])

    @property
    def config(self) -> dict:
        return self.meta.get("config") or {}

    @property
    def input(self) -> dict:
        return self.meta.get("input") or {}

    @property
    def packing(self) -> dict:
        return self.meta.get("packing") or {}

    @property
    def mixture(self) -> dict | None:
        return self.meta.get("mixture")

    @property
    def steps_per_epoch(self) -> list[int]:
        return [int(s) for s in self.meta["steps_per_epoch"]]

    @property
    def epochs(self) -> int:
        return len(self.steps_per_epoch)

    @property
    def lineage(self) -> dict:
        return self.meta.get("lineage") or {}

    @property
    def budget(self) -> Budget:
        return format.plan_budget(self.meta)

    def epoch_of(self, step: int) -> int:
        return int(np.searchsorted(np.cumsum(self.steps_per_epoch), step, side="right"))


def open_parent(path: str) -> Parent:
    """The parent plan; an unreadable one is an input error."""
    if storage.is_remote(path):  # its rows are read with pyarrow's local readers (filters by epoch)
        raise InputError(f"plan {path} is in object storage: replan and --extend read a local plan file; copy it "
                         "to a local file first (its metrics may stay in object storage)")
    if not os.path.isfile(path):
        raise InputError(f"plan {path} does not exist" if not os.path.exists(path) else
                         f"plan {path} is not a file")
    try:
        meta, schema = format.read_plan_metadata(path)
        problems = format.plan_schema_problems(schema, meta)
        if problems:
            raise InputError(f"{path} {problems[0]}")
        parent = Parent(path, meta, format.plan_fingerprint(schema))
        format.plan_budget(meta)  # a malformed budget entry: one line now
    except format.FormatError as exc:
        raise InputError(str(exc)) from None
    if sum(parent.steps_per_epoch) != parent.num_steps:
        raise InputError(f"{path} is inconsistent: steps_per_epoch adds up to {sum(parent.steps_per_epoch)}, "
                         f"num_steps is {parent.num_steps} (varlen validate tells more)")
    return parent


def recorded_input(parent: Parent) -> str | None:
    """The parent's input directory: its recorded path, or, when that is gone (the plan and its input
    moved together, as `varlen run` does when it swaps OUT in), the same place relative to the plan."""
    recorded = parent.input or {}
    path, relative = recorded.get("path"), recorded.get("relative_path")
    if path and os.path.exists(path) or not relative:
        return path
    moved = os.path.join(os.path.dirname(os.path.abspath(parent.path)), relative)
    return moved if os.path.exists(moved) else path


def parent_config(parent: Parent, **overrides) -> PlanConfig:
    """The parent's PlanConfig with ``overrides`` (None values keep the parent's), checked."""
    recorded = parent.config
    names = {f.name for f in dataclasses.fields(PlanConfig)}
    values = {k: v for k, v in recorded.items() if k in names and k != "storage_options"}  # recorded redacted
    if parent.mixture:
        values["input"] = values.get("input") or ""
    else:
        values["input"] = recorded_input(parent) or values.get("input")
    values["base_batch_size"] = parent.meta.get("base_batch_size")
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        c = PlanConfig(**values)
    except TypeError as exc:
        raise InputError(f"{parent.path} has an unreadable config: {exc}") from None
    check(dataclasses.replace(c, input=c.input or "mixture", mix=None, extend=None))
    return c


def check_parent_size(parent: Parent, epochs: int, command: str) -> None:
    """Refuse, before reading any sample, a replan/extension planned in one process that would not fit
    in memory (a replan of a split sample started before the step, the extension of a mixture, which
    its caller sizes once its sources are read): it holds every sample of the parent's input, so a
    plan of a billion samples is refused in one line instead of an out-of-memory kill. Every other
    replan and extension uses the chunked planner's bounded memory."""
    n = parent.input.get("num_rows")
    if parent.mixture or n is None:
        return  # a mixture's rows are counted (and checked) once its sources are read
    check_plan_size(int(n), epochs, bool(parent.meta.get("packing")), f"{int(n):,} samples",
                    remedy=f"`{command}` plans in one process (unlike `varlen plan --nproc`): run it on a machine "
                           "with more memory, or plan the rest afresh with `varlen plan`")


def parent_rows(parent: Parent, c: PlanConfig) -> tuple[Rows, dict, list | None]:
    """The rows the parent was planned from: ``(rows, its input's manifest or {}, a mixture's source
    entries or None)``; refused if the input is not the one the parent was planned from."""
    if parent.mixture:
        from .mixture import rows_of

        rows, info = rows_of(c, parent.meta, parent.path)
        return rows, {}, info
    manifest, sample_id, length = read_input(c.input, c.allow_stale)
    _same_input(parent, c.input, manifest, len(sample_id))
    return Rows(sample_id, length, target=read_targets(c, c.input, manifest)), manifest, None


def check_same_input(parent: Parent, path: str, allow_stale: bool) -> int:
    """Refuse (from its manifest, reading no sample) an input other than the one the parent was planned
    from; its number of samples."""
    from ..runtime import freshness

    manifest = artifacts.read_manifest(path, what="metrics or sorted directory",
                                       hint="create one with `varlen analyze` (and `varlen sort` for curriculum order)")
    freshness.check_inputs(path, manifest, allow_stale, rerun="varlen sort")
    num_rows = sum(int(p["rows"]) for p in manifest.get("parts", []))
    _same_input(parent, path, manifest, num_rows)
    return num_rows


def _same_input(parent: Parent, path: str, manifest: dict, num_rows: int) -> None:
    recorded = parent.input or {}
    if recorded.get("num_rows") is not None and int(recorded["num_rows"]) != num_rows:
        raise InputError(f"{path} changed since {parent.path} was planned: it has {num_rows:,} samples, "
                         f"the plan was made for {int(recorded['num_rows']):,}")
    if recorded.get("artifact_id") and manifest.get("artifact_id") != recorded["artifact_id"]:
        raise InputError(f"{path} changed since {parent.path} was planned (artifact_id "
                         f"{manifest.get('artifact_id')}, the plan was made from {recorded['artifact_id']})")


# -- what an epoch has left after a step -------------------------------------------------------------
@dataclass
class Remaining:
    """The entries of the parent's epoch ``epoch`` in steps >= the resume step, as rows: ``keep``
    marks the input rows left whole; ``pieces`` are the chunks left of split samples; ``consumed``
    counts the samples (first chunks) done before the step."""

    epoch: int
    keep: np.ndarray
    pieces: Rows | None
    piece_base: np.ndarray | None  # the input row of each piece's sample
    consumed: int


def row_keys(rows: Rows, num_sources: int) -> tuple[np.ndarray, int]:
    """A key per input row, ``source * (max id + 1) + id``, and the key space's size."""
    base = rows.base
    ids = rows.sample_id[:base].astype(np.int64)
    span = int(ids.max()) + 1 if base else 1
    src = rows.source[:base].astype(np.int64) if rows.source is not None else 0
    return src * span + ids, span * max(num_sources, 1)


def remaining_rows(parent: Parent, step: int, rows: Rows) -> Remaining:
    """The parent's entries of the epoch of ``step`` in steps >= ``step`` (:class:`Remaining`)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    epoch = parent.epoch_of(step)
    cols = ["step", "sample_ids"] + [c for c in ("source", "sample_starts", "sample_lengths")
                                     if c in pq.read_schema(parent.path).names]
    table = pq.read_table(parent.path, columns=cols, filters=[("epoch", "=", epoch)])
    later = pc.greater_equal(table.column("step"), step)

    def flat(t, name):
        return pc.list_flatten(t.column(name)).to_numpy(zero_copy_only=False).astype(np.int64) if name in cols else None

    done, rest = table.filter(pc.invert(later)), table.filter(later)
    starts_done = flat(done, "sample_starts")
    consumed = int(np.count_nonzero(starts_done == 0)) if starts_done is not None else \
        int(pc.sum(pc.list_value_length(done.column("sample_ids"))).as_py() or 0)
    ids, src = flat(rest, "sample_ids"), flat(rest, "source")
    starts, lens = flat(rest, "sample_starts"), flat(rest, "sample_lengths")
    keys, size = row_keys(rows, len(parent.mixture["sources"]) if parent.mixture else 1)
    span = int(rows.sample_id[:rows.base].max()) + 1 if rows.base else 1
    if len(ids) and (ids.min() < 0 or ids.max() >= span):
        raise InputError(f"{parent.path} holds sample ids its input does not have; re-plan from the input")
    entry_key = (src if src is not None else 0) * span + ids
    row_of_key = np.full(size, -1, np.int64)
    row_of_key[keys] = np.arange(rows.base)
    if (row_of_key[entry_key] < 0).any():
        raise InputError(f"{parent.path} holds sample ids its input does not have; re-plan from the input")
    whole = np.ones(len(ids), bool)
    if starts is not None:
        whole = (starts == 0) & (lens == rows.length[row_of_key[entry_key]])
    keep = _rows_for_keys(keys, entry_key[whole], size)
    pieces = piece_base = None
    if not whole.all():
        piece_base = row_of_key[entry_key[~whole]]
        pieces = Rows(ids[~whole], lens[~whole], rows.source[piece_base] if rows.source is not None else None,
                      starts[~whole], rows.length[piece_base])
    return Remaining(epoch, keep, pieces, piece_base, consumed)


def _rows_for_keys(keys: np.ndarray, wanted: np.ndarray, size: int) -> np.ndarray:
    """Mask of the input rows to keep: for each key, as many of its rows (copies) as ``wanted`` names it."""
    want = np.bincount(wanted, minlength=size)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    rank = np.arange(len(sk)) - np.searchsorted(sk, sk, side="left")  # copy number within the key
    keep = np.zeros(len(keys), bool)
    keep[order] = rank < want[sk]
    return keep


# -- planning from a parent ---------------------------------------------------------------------------
def first_epoch_inputs(inputs: EpochInputs, rows: Rows, left: Remaining) -> EpochInputs:
    """The first epoch's inputs: the input rows left whole, in the inputs' orders, and the pieces left
    of split samples next to their sample's place."""
    def restrict(seq: np.ndarray | None) -> np.ndarray | None:
        if seq is None:
            return None
        kept = seq[left.keep[seq]]
        if left.pieces is None:
            return kept
        place = np.full(rows.base, len(seq), np.int64)
        place[seq] = np.arange(len(seq))
        piece_pos = rows.base + np.arange(len(left.pieces))
        where = np.concatenate([place[kept], place[left.piece_base]])
        start = np.concatenate([np.zeros(len(kept), np.int64), left.pieces.start + 1])
        return np.concatenate([kept, piece_pos])[np.lexsort((start, where))]

    return dataclasses.replace(inputs, ordered=restrict(inputs.ordered), canon=restrict(inputs.canon))


def with_pieces(rows: Rows, left: Remaining | None) -> Rows:
    """``rows`` with a replan's pieces appended (rows ``[base, len)``), or ``rows`` itself."""
    if left is None or left.pieces is None:
        return rows
    p = left.pieces
    n = rows.base

    def cat(a, b, fill):
        return np.concatenate([a if a is not None else fill(n), b])

    return Rows(np.concatenate([rows.sample_id, p.sample_id]), np.concatenate([rows.length, p.length]),
                None if rows.source is None else np.concatenate([rows.source, p.source]),
                cat(rows.start, p.start, lambda k: np.zeros(k, np.int64)),
                cat(rows.full_length, p.full_length, lambda k: rows.length), base=n)


def plan_epochs_from(c: PlanConfig, parent: Parent, rows: Rows, budget: Budget, *, first_epoch: int,
                     left: Remaining | None, manifest: dict, mixture_info: list | None, config_record: dict,
                     lineage: dict | None, t0: float) -> PlanResult:
    """Plan ``c.epochs`` epochs numbered from ``first_epoch`` (seed streams, curriculum switch); the first
    one holds only what ``left`` names (if given). Writes ``c.output``."""
    rows = with_pieces(rows, left)
    inputs, long_pos = epoch_inputs(c, rows, budget, REPLAN_REMEDIES)
    epochs: list[PlannedEpoch] = []
    fixed_batch = None
    if left is not None:
        epochs, fixed_batch = plan_epochs(dataclasses.replace(c, epochs=1), first_epoch_inputs(inputs, rows, left),
                                          first_epoch)
    if c.epochs > len(epochs):
        more, fixed_more = plan_epochs(dataclasses.replace(c, epochs=c.epochs - len(epochs)), inputs,
                                       first_epoch + len(epochs))
        epochs += more
        fixed_batch = fixed_batch if fixed_batch is not None else fixed_more
    if mixture_info is not None:
        from .mixture import finish_mixture

        return finish_mixture(c, config_record, rows, mixture_info, epochs, inputs, long_pos, fixed_batch, t0,
                              lineage)
    cols, items = assemble_columns(c, rows, epochs, inputs.slots)
    source = {"input": input_info(c, manifest, rows.base), "config": config_record}
    return finish(c, rows, epochs, cols, items, long_pos, inputs, fixed_batch, t0, source=source,
                  extra_metadata={"lineage": lineage} if lineage is not None else None)


def config_record(c: PlanConfig, budget: Budget) -> dict:
    """The options a derived plan records: ``c``'s (as a fresh plan records them: no output path or worker
    count), with the budget's own options where it changed."""
    from .assemble import recorded_config

    values = recorded_config(c)  # what the plan computed from, not how this run ran (output, --nproc, ...)
    if budget.source == "memory" and budget.memory is not None:
        values.update(max_tokens=None, max_memory=budget.memory.get("max_memory"),
                      memory_profile=budget.memory.get("profile_path"), memory_margin=budget.memory.get("margin"))
    else:
        values.update(max_tokens=budget.max_tokens, max_memory=None, memory_profile=None,
                      allow_memory_extrapolation=False)
    return values


# -- what an epoch has left, streamed (the chunked replan) ------------------------------------------
@dataclass
class Left:
    """The parent's epoch ``epoch`` at the resume step: the samples its steps >= the step hold, one
    bit per sample id (``bits``: what the replan's first epoch holds, as :func:`remaining_rows` keeps
    them), ``consumed`` (the first chunks of steps < the step, as :class:`Remaining` counts them), and
    whether a split sample has chunks on both sides of the step (``started``: such a remainder is
    replanned in one process, :func:`remaining_rows`)."""

    epoch: int
    bits: object  # plan_checks.Bitmap
    consumed: int
    started: bool


def left_samples(parent: Parent, step: int, num_rows: int) -> Left:
    """:class:`Left`, read from the parent window by window (bounded: a window and two bitmaps of
    ``num_rows`` bits, the ids of a metrics or sorted directory of ``num_rows`` samples)."""
    import pyarrow.parquet as pq

    from ..checks import Bitmap, scan

    epoch = parent.epoch_of(step)
    pf = pq.ParquetFile(parent.path)
    split = "sample_starts" in pf.schema_arrow.names
    before, after, consumed = Bitmap(num_rows) if split else None, Bitmap(num_rows), 0
    lists = ["sample_ids"] + (["sample_starts"] if split else [])
    for w in scan.windows(pf, ["epoch", "step"], lists, parent.dp * parent.grad_accum):
        e = w.cols["epoch"]
        if int(e[0]) > epoch:
            break
        if int(e[-1]) < epoch:
            continue
        row_step = np.repeat(w.cols["step"].astype(np.int64), np.diff(w.offsets()))
        entry_epoch = np.repeat(e.astype(np.int64), np.diff(w.offsets()))
        ids = w.values("sample_ids").astype(np.int64)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
            raise InputError(f"{parent.path} holds sample ids its input does not have; re-plan from the input")
        mine = entry_epoch == epoch
        done, rest = mine & (row_step < step), mine & (row_step >= step)
        after.set(ids[rest])
        if split:
            before.set(ids[done])
            consumed += int(np.count_nonzero(w.values("sample_starts")[done] == 0))
        else:
            consumed += int(np.count_nonzero(done))
    started = bool(split and np.any(before.bits & after.bits))
    return Left(epoch, after, consumed, started)
