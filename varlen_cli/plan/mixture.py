"""``varlen plan --mix name1=DIR1:w1,name2=DIR2:w2,...``: one plan over several metrics directories.

Each source's samples enter every epoch ``floor(w)`` times, plus a seeded subset of
``round(frac(w) x n)`` of them (the same subset in every epoch; :func:`varlen_cli.plan_checks.mixture_copies`):
weight 2 = every sample twice per epoch, 0.5 = a seeded half. The planner then runs unchanged on these
*virtual rows* (one per copy, :class:`~varlen_cli.plan.pipeline.Rows` with a ``source``); the plan's
``sample_ids`` hold each source's own sample ids and the ``source`` list column the index of the
source (into the metadata's ``mixture.sources``). With ``--order curriculum``/``reverse`` the
virtual rows are ordered by difficulty over the union (ties by source, then sample id). Every other
option works as without ``--mix`` (``--split-long`` cuts every copy alike; ``--drop-long`` and
``--tail drop`` list each dropped copy with its source); ``varlen replan`` and ``--extend`` rebuild
the same virtual rows from the metadata (:func:`rows_of`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from .. import format
from ..checks import mixture_extra
from ..errors import InputError, UsageError
from ..runtime import artifacts, safety
from . import writer
from .assemble import assemble_columns, finish, location_record
from .config import PlanConfig, PlanResult, check
from .cost_model import resolve_budget
from .pipeline import Rows, check_plan_size, epoch_inputs, plan_epochs
from .reader import read_input, read_targets

_ENTRY = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)=(?P<dir>.+):(?P<weight>[^:]+)")


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float


def parse_mix(spec: str) -> list[Source]:
    """``name=DIR:weight,...`` -> sources; one-line UsageErrors for malformed entries."""
    sources = []
    for entry in [e.strip() for e in spec.split(",") if e.strip()]:
        m = _ENTRY.fullmatch(entry)
        if m is None:
            raise UsageError(f"--mix entry {entry!r} is not name=DIR:weight")
        try:
            weight = float(m["weight"])
        except ValueError:
            raise UsageError(f"--mix weight of {m['name']!r} is not a number (got {m['weight']!r})") from None
        if not weight > 0 or weight == float("inf"):
            raise UsageError(f"--mix weight of {m['name']!r} must be > 0 (got {m['weight']})")
        if any(s.name == m["name"] for s in sources):
            raise UsageError(f"--mix names source {m['name']!r} twice")
        sources.append(Source(m["name"], m["dir"], weight))
    if not sources:
        raise UsageError("--mix needs at least one name=DIR:weight")
    return sources


def copies_per_epoch(n: int, weight: float) -> int:
    """Virtual rows of a source of ``n`` samples per epoch (Python ints: no overflow for huge weights)."""
    whole = int(weight // 1)
    return whole * int(n) + int(round((weight - whole) * n))


def _check_size(c: PlanConfig, sources: list[Source]) -> None:
    """The mixture's size from the manifests, before anything is read: one line instead of a
    MemoryError for a huge weight."""
    total = 0
    for s in sources:
        manifest = artifacts.read_manifest(s.path, what="metrics or sorted directory",
                                           hint="create one with `varlen analyze` (and `varlen sort` for curriculum "
                                                "order)")
        total += copies_per_epoch(sum(int(p["rows"]) for p in manifest.get("parts", [])), s.weight)
    if total >= 1 << 31:
        raise UsageError(f"--mix makes {total:,} samples per epoch, more than a plan holds (2^31); lower the weights")
    check_plan_size(total, c.epochs, c.packing, f"{total:,} samples of the mixture")


def _difficulty(path: str, manifest: dict) -> np.ndarray:
    parts = [artifacts.open_part(artifacts.part_location(path, p)).read(columns=["difficulty"]).column(0).to_numpy()
             for p in manifest.get("parts", [])]
    return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)


def _positions(sample_id: np.ndarray, weight: float, seed: int, index: int) -> np.ndarray:
    """Row positions of one source's virtual rows: ``floor(w)`` full copies, then the rows of the
    seeded subset of sample ids (:func:`~varlen_cli.plan_checks.mixture_extra`; a sorted source's rows
    are not in id order)."""
    n = len(sample_id)
    whole = int(np.floor(weight))
    extra = mixture_extra(n, weight, seed, index)
    if len(extra) and not (int(sample_id[0]) == 0 and bool(np.all(sample_id[1:] > sample_id[:-1]))):
        row_of = np.empty(n, np.int64)
        row_of[sample_id] = np.arange(n)
        extra = np.sort(row_of[extra])
    return np.concatenate([np.tile(np.arange(n, dtype=np.int64), whole), extra.astype(np.int64)])


def virtual_rows(c: PlanConfig, sources: list[Source],
                 recorded: list[dict] | None = None) -> tuple[Rows, list[dict], list[dict]]:
    """The union of the sources' samples, each repeated by its weight; in curriculum order if asked.
    Returns the rows, the metadata entry of each source and each source's manifest. ``recorded``:
    the entries a replan's parent recorded (each source must still be the one planned)."""
    src, ids, lens, targets, diff, info, manifests = [], [], [], [], [], [], []
    for k, s in enumerate(sources):
        manifest, sample_id, length = read_input(s.path, c.allow_stale)
        if recorded is not None:
            _same_source(s, recorded[k], manifest, len(sample_id))
        pos = _positions(sample_id, s.weight, c.seed, k)
        src.append(np.full(len(pos), k, np.int32))
        ids.append(sample_id[pos])
        lens.append(length[pos])
        target = read_targets(c, s.path, manifest)
        targets.append(target[pos] if target is not None else None)
        if c.order in ("curriculum", "reverse"):
            diff.append(_difficulty(s.path, manifest)[pos])
        info.append({"name": s.name, **location_record(s.path, c.output), "weight": s.weight,
                     "num_rows": int(len(sample_id)), "artifact_id": manifest.get("artifact_id"),
                     "dataset_digest": (manifest.get("dataset") or {}).get("digest"),
                     "samples_per_epoch": int(len(pos))})
        manifests.append(manifest)
    rows = Rows(np.concatenate(ids), np.concatenate(lens), np.concatenate(src), target=_mixture_targets(targets, lens))
    if diff:  # curriculum over the union: difficulty, then source, then sample id
        order = np.lexsort((rows.sample_id, rows.source, np.concatenate(diff)))
        rows = Rows(rows.sample_id[order], rows.length[order], rows.source[order],
                    target=rows.target[order] if rows.target is not None else None)
    return rows, info, manifests


def _mixture_targets(targets: list, lens: list) -> np.ndarray | None:
    """Each virtual row's loss tokens when some source counts them (its ``target_length``); a source
    without that column counts its samples' from their lengths (:func:`varlen_cli.format.loss_targets`).
    None when no source has ``target_length`` (the planner then counts every row from its length)."""
    if all(t is None for t in targets):
        return None
    return np.concatenate([t.astype(np.int64) if t is not None else format.loss_targets(n)
                           for t, n in zip(targets, lens)])


def _same_source(s: Source, recorded: dict, manifest: dict, num_rows: int) -> None:
    if int(recorded.get("num_rows", -1)) != num_rows or (recorded.get("artifact_id") and
                                                          recorded["artifact_id"] != manifest.get("artifact_id")):
        raise InputError(f"source {s.name!r} ({s.path}) changed since the plan was made: it has {num_rows:,} samples "
                         f"(artifact {manifest.get('artifact_id')}), the plan was made for "
                         f"{int(recorded.get('num_rows', -1)):,} (artifact {recorded.get('artifact_id')})")


def plan_mixture(config: PlanConfig) -> PlanResult:
    """``varlen plan --mix``: plan the virtual rows of the sources with the ordinary planner."""
    t0 = time.perf_counter()
    if config.input:
        raise UsageError("--mix names the directories itself: give no INPUT_DIR")
    sources = parse_mix(config.mix)
    c = dataclasses.replace(config, input=sources[0].path)
    check(c)
    safety.check_no_overlap(c.output, [s.path for s in sources])
    writer.check_output(c.output, c.overwrite)
    _check_size(c, sources)
    budget = resolve_budget(c)
    rows, info, _ = virtual_rows(c, sources)
    inputs, long_pos = epoch_inputs(c, rows, budget)
    epochs, fixed_batch = plan_epochs(c, inputs)
    return finish_mixture(c, artifacts.config_dict(config), rows, info, epochs, inputs, long_pos, fixed_batch, t0)


def finish_mixture(c: PlanConfig, config_record: dict, rows: Rows, info: list[dict], epochs: list, inputs,
                   long_pos: np.ndarray, fixed_batch, t0: float, lineage: dict | None = None) -> PlanResult:
    """Columns, metadata (``mixture``: the sources, their tokens per epoch) and the written plan."""
    tokens = [np.bincount(rows.source[ep.mb.samples], weights=ep.mb.item_length if c.packing else
                          rows.length[ep.mb.samples], minlength=len(info)).astype(np.int64) for ep in epochs]
    info = [{**entry, "tokens_per_epoch": [int(t[k]) for t in tokens]} for k, entry in enumerate(info)]
    cols, items = assemble_columns(c, rows, epochs, inputs.slots)
    mixture = {"sources": info, "seed": c.seed}
    input_info = {"path": None, "kind": "mixture", "artifact_id": None, "num_rows": None, "dataset_digest": None}
    extra = {"mixture": mixture, **({"lineage": lineage} if lineage is not None else {})}
    result = finish(c, rows, epochs, cols, items, long_pos, inputs, fixed_batch, t0,
                    source={"input": input_info, "config": config_record}, extra_metadata=extra)
    result.stats["tokens_per_source_per_epoch"] = {e["name"]: e["tokens_per_epoch"] for e in info}
    return result


def recorded_sources(meta: dict, plan_path: str) -> list[Source]:
    """A mixture plan's sources as it recorded them (a moved source found beside the plan, as the input is)."""
    out = []
    for entry in meta["mixture"]["sources"]:
        path, relative = entry.get("path"), entry.get("relative_path")
        if not (path and os.path.exists(path)) and relative:
            moved = os.path.join(os.path.dirname(os.path.abspath(plan_path)), relative)
            path = moved if os.path.exists(moved) else path
        out.append(Source(entry["name"], path, float(entry["weight"])))
    return out


def rows_of(c: PlanConfig, meta: dict, plan_path: str) -> tuple[Rows, list[dict]]:
    """The virtual rows a mixture plan was made from (for ``varlen replan`` and ``--extend``)."""
    rows, info, _ = virtual_rows(c, recorded_sources(meta, plan_path), meta["mixture"]["sources"])
    return rows, info
