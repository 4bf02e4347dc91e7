"""``varlen plan --mix name1=DIR1:w1,name2=DIR2:w2,...``: one plan over several metrics directories.

Each source's samples enter every epoch ``floor(w)`` times, plus a seeded subset of
``round(frac(w) x n)`` of them (the same subset in every epoch): weight 2 = every sample twice per
epoch, 0.5 = a seeded half. The planner then runs unchanged on these *virtual rows* (one per copy);
the plan's ``sample_ids`` hold each source's own sample ids and the ``source`` list column the index
of the source (into the metadata's ``mixture.sources``). With ``--order curriculum``/``reverse`` the
virtual rows are ordered by difficulty over the union (ties by source, then sample id).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from ..runtime import artifacts, safety
from . import assemble, pipeline, reader, writer
from .config import PlanConfig, PlanResult, check

_ENTRY = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)=(?P<dir>.+):(?P<weight>[^:]+)")
_MIX_SEED = 0x6D6978  # seed stream of the fractional subsets ("mix")


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


def _difficulty(path: str, manifest: dict) -> np.ndarray:
    import pyarrow.parquet as pq

    parts = [pq.read_table(os.path.join(path, p["file"]), columns=["difficulty"]).column("difficulty").to_numpy()
             for p in manifest.get("parts", [])]
    return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)


def _copies(n: int, weight: float, seed: int, index: int) -> np.ndarray:
    """Positions of one source's virtual rows: ``floor(w)`` full copies plus a seeded subset."""
    whole = int(np.floor(weight))
    extra_n = int(round((weight - whole) * n))
    extra = np.sort(np.random.default_rng([seed, _MIX_SEED, index]).choice(n, extra_n, replace=False))
    return np.concatenate([np.tile(np.arange(n, dtype=np.int64), whole), extra.astype(np.int64)])


@dataclass
class VirtualRows:
    source: np.ndarray  # int32 per virtual row
    sample_id: np.ndarray  # the source's own sample id
    length: np.ndarray
    info: list  # per source: metadata entry


def virtual_rows(c: PlanConfig, sources: list[Source]) -> VirtualRows:
    """The union of the sources' samples, each repeated by its weight; in curriculum order if asked."""


    src, ids, lens, diff, info = [], [], [], [], []
    for k, s in enumerate(sources):
        manifest, sample_id, length = reader.read_input(s.path, c.allow_stale)
        pos = _copies(len(sample_id), s.weight, c.seed, k)
        src.append(np.full(len(pos), k, np.int32))
        ids.append(sample_id[pos])
        lens.append(length[pos])
        if c.order in ("curriculum", "reverse"):
            diff.append(_difficulty(s.path, manifest)[pos])
        info.append({"name": s.name, "path": os.path.abspath(s.path), "weight": s.weight,
                     "num_rows": int(len(sample_id)), "artifact_id": manifest.get("artifact_id"),
                     "dataset_digest": (manifest.get("dataset") or {}).get("digest"),
                     "samples_per_epoch": int(len(pos))})
    rows = VirtualRows(np.concatenate(src), np.concatenate(ids), np.concatenate(lens), info)
    if diff:  # curriculum over the union: difficulty, then source, then sample id
        order = np.lexsort((rows.sample_id, rows.source, np.concatenate(diff)))
        rows = VirtualRows(rows.source[order], rows.sample_id[order], rows.length[order], info)
    return rows


def plan_mixture(config: PlanConfig) -> PlanResult:
    """``varlen plan --mix``: plan the virtual rows of the sources with the ordinary planner."""

    from .shapes import Budget

    t0 = time.perf_counter()
    if config.input:
        raise UsageError("--mix names the directories itself: give no INPUT_DIR")
    sources = parse_mix(config.mix)
    if config.split_long:
        raise UsageError("--split-long cannot be combined with --mix (a sample's chunks must be told apart from "
                         "its copies)")
    c = dataclasses.replace(config, input=sources[0].path)
    check(c)
    safety.check_no_overlap(c.output, [s.path for s in sources])
    writer.check_output(c.output, c.overwrite)
    rows = virtual_rows(c, sources)
    vid = np.arange(len(rows.length), dtype=np.int64)  # the planner's ids: virtual rows
    budget = Budget(c.max_tokens, c.max_samples, float(c.attention_cost))
    inputs, long_pos = pipeline.epoch_inputs(c, vid, rows.length, budget)
    epochs, fixed_batch = pipeline.plan_epochs(c, inputs)
    tokens = [np.bincount(rows.source[ep.mb.samples], weights=rows.length[ep.mb.samples],
                          minlength=len(sources)).astype(np.int64) for ep in epochs]
    for k, entry in enumerate(rows.info):
        entry["tokens_per_epoch"] = [int(t[k]) for t in tokens]
    source = np.concatenate([rows.source[ep.mb.samples] for ep in epochs])
    cols, items = assemble.assemble_columns(c, rows.sample_id, rows.length, epochs, inputs.slots)
    items["source"] = source
    mixture = {"sources": rows.info, "seed": c.seed}
    input_info = {"path": None, "kind": "mixture", "artifact_id": None, "num_rows": None, "dataset_digest": None}
    result = assemble.finish(c, {}, rows.sample_id, epochs, cols, items, long_pos, inputs, fixed_batch, t0,
                          extra_metadata={"mixture": mixture, "input": input_info,
                                          "config": {**artifacts.config_dict(config)}})
    result.stats["tokens_per_source_per_epoch"] = {e["name"]: e["tokens_per_epoch"] for e in rows.info}
    return result


def coverage_problems(ids: np.ndarray, source: np.ndarray, epoch: np.ndarray, meta: dict) -> list[str]:
    """``varlen validate`` of a mixture plan: per epoch and source, every sample ``floor(w)`` or
    ``ceil(w)`` times and the source's recorded ``samples_per_epoch`` in all."""
    problems = []
    for k, entry in enumerate(meta["mixture"]["sources"]):
        n, w = int(entry["num_rows"]), float(entry["weight"])
        mine = source == k
        if mine.any() and (ids[mine].min() < 0 or ids[mine].max() >= n):
            problems.append(f"source {entry['name']!r} has sample ids outside 0..{n - 1}")
            continue
        for e in range(int(meta["epochs"])):
            sel = mine & (epoch == e)
            counts = np.bincount(ids[sel], minlength=n)
            if counts.min() < np.floor(w) or counts.max() > np.ceil(w) or sel.sum() != entry["samples_per_epoch"]:
                problems.append(f"source {entry['name']!r} epoch {e}: {int(sel.sum())} samples, expected "
                                f"{entry['samples_per_epoch']} with each sample {w:g} times")
    return problems
