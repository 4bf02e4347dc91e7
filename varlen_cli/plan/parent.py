"""What ``varlen replan`` and ``varlen plan --extend`` start from: the parent plan (its metadata,
options and budget as recorded, :func:`open_parent`, :func:`parent_config`), the input it was planned
from (refused if it changed), and what its epoch in progress has left after a step
(:func:`left_samples`), which the chunked planner plans the replan's first epoch from."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from .. import format, storage
from ..budget import Budget
from ..errors import InputError
from ..runtime import artifacts
from .chunked.sources import Left, MixSource
from .config import PlanConfig, check
from .layout import Remedies

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


def config_record(c: PlanConfig, budget: Budget) -> dict:
    """The options a derived plan records: ``c``'s (as a fresh plan records them: no output path or worker
    count), with the budget's own options where it changed."""
    from .writer import recorded_config

    values = recorded_config(c)  # what the plan computed from, not how this run ran (output, --nproc, ...)
    if budget.source == "memory" and budget.memory is not None:
        values.update(max_tokens=None, max_memory=budget.memory.get("max_memory"),
                      memory_profile=budget.memory.get("profile_path"), memory_margin=budget.memory.get("margin"))
    else:
        values.update(max_tokens=budget.max_tokens, max_memory=None, memory_profile=None,
                      allow_memory_extrapolation=False)
    return values


def continued_input(parent: Parent, c: PlanConfig) -> tuple[list[int], dict]:
    """The parent's input, refused if it changed since (from its manifests, reading no sample): the
    samples of each source (one for a directory), and the :class:`~.chunked.run.Continuation` entries
    that name a mixture's sources."""
    if not parent.mixture:
        return [check_same_input(parent, c.input, c.allow_stale)], {}
    from .chunked.sources import check_same_source, open_manifest

    sources, recorded, sizes = recorded_sources(parent), parent.mixture["sources"], []
    for s, entry in zip(sources, recorded):
        manifest = open_manifest(s.path, c.allow_stale)
        sizes.append(sum(int(p["rows"]) for p in manifest.get("parts", [])))
        check_same_source(s, entry, manifest, sizes[-1])
    return sizes, {"mixture": tuple(sources), "recorded": tuple(recorded)}


def recorded_sources(parent: Parent) -> list[MixSource]:
    """A mixture plan's sources as it recorded them (a moved source found beside the plan, as the input is)."""
    out = []
    for entry in parent.mixture["sources"]:
        path, relative = entry.get("path"), entry.get("relative_path")
        if not (path and os.path.exists(path)) and relative:
            moved = os.path.join(os.path.dirname(os.path.abspath(parent.path)), relative)
            path = moved if os.path.exists(moved) else path
        out.append(MixSource(entry["name"], path, float(entry["weight"])))
    return out


# -- what an epoch has left -----------------------------------------------------------------------------
def left_samples(parent: Parent, step: int, sizes: list[int]) -> Left:
    """What the parent's epoch in progress has left at ``step`` (:class:`~.chunked.sources.Left`), read
    from the parent window by window: a bitmap (a mixture: a count per sample) of what is left whole,
    and, when a ``--split-long`` sample has chunks on both sides of the step (or the epoch is a
    replan's first, which may hold such chunks already), the chunks left of every split sample as
    pieces, which keep their cuts. ``sizes``: the samples of the input (of each mixture source)."""
    import pyarrow.parquet as pq

    epoch = parent.epoch_of(step)
    names = pq.read_schema(parent.path).names
    split = "sample_starts" in names
    keys = _Keys(parent, sizes)
    scan = _scan(parent, epoch, step, keys, split, pieces=False)
    started = split and bool(np.any(scan.before.bits & scan.after.bits))
    if split and (started or (epoch == 0 and parent.lineage.get("kind") == "replan")):
        scan = _scan(parent, epoch, step, keys, split, pieces=True)
    return Left(epoch, scan.consumed, scan.whole if keys.offsets is None else None,
                scan.whole if keys.offsets is not None else None, keys.offsets, scan.pieces,
                _tail_dropped(parent, epoch))


def _tail_dropped(parent: Parent, epoch: int) -> dict | None:
    """What the parent's ``--tail drop`` left out of epoch ``epoch`` (ids, a mixture's sources): never in
    the epoch, so the replan's first epoch lists them as dropped too."""
    for entry in (parent.meta.get("dropped") or {}).get("tail", []):
        if int(entry.get("epoch", -1)) == epoch and entry.get("sample_ids"):
            sources = entry.get("sources")
            return {"ids": np.asarray(entry["sample_ids"], np.int64),
                    "sources": np.asarray(sources, np.int64) if sources is not None else None}
    return None


class _Keys:
    """A sample's key: its id (one input), or ``offsets[source] + id`` (a mixture's sources)."""

    def __init__(self, parent: Parent, sizes: list[int]):
        self.path = parent.path
        self.sizes = np.asarray(sizes, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]) if parent.mixture else None
        self.size = int(self.sizes.sum())
        self.seq_len = int(parent.packing.get("seq_len") or 0)

    def of(self, ids: np.ndarray, source: np.ndarray | None) -> np.ndarray:
        bad = len(ids) and (int(ids.min()) < 0 or
                            (self.offsets is None and int(ids.max()) >= self.size))
        if self.offsets is not None and not bad and len(ids):
            src = source.astype(np.int64)
            bad = int(src.min()) < 0 or int(src.max()) >= len(self.sizes) or bool(np.any(ids >= self.sizes[src]))
        if bad:
            raise InputError(f"{self.path} holds sample ids its input does not have; re-plan from the input")
        return ids if self.offsets is None else self.offsets[source.astype(np.int64)] + ids


@dataclass
class _Scan:
    consumed: int = 0
    before: object = None  # Bitmap of keys with an entry before the step (split plans)
    after: object = None  # ... after the step
    whole: object = None  # Bitmap (one input) or counts (a mixture) of the copies left whole
    pieces: dict | None = None  # the chunks left of split samples: ids, source, start, length


def _scan(parent: Parent, epoch: int, step: int, keys: _Keys, split: bool, pieces: bool) -> _Scan:
    """One pass over the parent's epoch ``epoch``: what it holds before and after ``step``. ``pieces``:
    the entries of split samples (a start inside the sample, or a first chunk: a length of at least
    ``--seq-len``) are kept as pieces, not counted as whole copies."""
    import pyarrow.parquet as pq

    from ..checks import Bitmap, scan

    pf = pq.ParquetFile(parent.path)
    mixture = keys.offsets is not None
    out = _Scan(before=Bitmap(keys.size) if split else None, after=Bitmap(keys.size) if split else None,
                whole=np.zeros(keys.size, _count_dtype(parent)) if mixture else Bitmap(keys.size))
    found: dict = {name: [] for name in ("ids", "source", "start", "length")}
    lists = ["sample_ids"] + (["source"] if mixture else []) + (["sample_starts", "sample_lengths"] if split else [])
    for w in scan.windows(pf, ["epoch", "step"], lists, parent.dp * parent.grad_accum):
        e = w.cols["epoch"]
        if int(e[0]) > epoch:
            break
        if int(e[-1]) < epoch:
            continue
        counts = np.diff(w.offsets())
        row_step = np.repeat(w.cols["step"].astype(np.int64), counts)
        mine = np.repeat(e.astype(np.int64), counts) == epoch
        ids = w.values("sample_ids").astype(np.int64)
        source = w.values("source") if mixture else None
        key = keys.of(ids, source)
        start = w.values("sample_starts").astype(np.int64) if split else np.zeros(len(ids), np.int64)
        done, rest = mine & (row_step < step), mine & (row_step >= step)
        out.consumed += int(np.count_nonzero(done & (start == 0)))
        if split:
            out.before.set(key[done])
            out.after.set(key[rest])
        length = w.values("sample_lengths").astype(np.int64) if split else None
        piece = (start > 0) | (length >= keys.seq_len) if pieces else np.zeros(len(ids), bool)
        _count_whole(out.whole, key[rest & (start == 0) & ~piece])
        take = rest & piece
        for name, values in (("ids", ids), ("source", source), ("start", start), ("length", length)):
            if values is not None and pieces:
                found[name].append(values[take].astype(np.int64))
    if pieces:
        out.pieces = {name: np.concatenate(v) if v else np.zeros(0, np.int64) for name, v in found.items() if v}
    return out


def _count_dtype(parent: Parent):
    top = max(int(np.ceil(float(s["weight"]))) for s in parent.mixture["sources"])
    return np.uint8 if top < 1 << 8 else np.uint16 if top < 1 << 16 else np.int64


def _count_whole(whole, keys: np.ndarray) -> None:
    if isinstance(whole, np.ndarray):
        np.add.at(whole, keys, 1)
    else:
        whole.set(keys)
