"""``varlen plan --mix name1=DIR1:w1,name2=DIR2:w2,...``: one plan over several metrics directories.

Each source's samples enter every epoch ``floor(w)`` times, plus a seeded subset of
``round(frac(w) x n)`` of them (the same subset in every epoch; :func:`varlen_cli.checks.mixture_copies`):
weight 2 = every sample twice per epoch, 0.5 = a seeded half. The chunked planner then plans these
*virtual rows* (one per copy, :class:`~varlen_cli.plan.chunked.sources.MixtureInput`) as it plans one
directory, in bounded memory, on ``--nproc`` workers or the ranks of a torchrun job; the plan's
``sample_ids`` hold each source's own sample ids and the ``source`` list column the index of the
source (into the metadata's ``mixture.sources``). With ``--order curriculum``/``reverse`` the
virtual rows are ordered by difficulty over the union (ties by source, then sample id). Every other
option works as without ``--mix`` (``--split-long`` cuts every copy alike; ``--drop-long`` and
``--tail drop`` list each dropped copy with its source); ``varlen replan`` and ``--extend`` plan the
same virtual rows from the sources the metadata records (:func:`varlen_cli.plan.parent.recorded_sources`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

from ..errors import UsageError
from ..runtime import artifacts, safety
from ..runtime.dist import check_nproc
from . import writer
from .chunked.sources import MixSource
from .config import PlanConfig, PlanResult, check

_ENTRY = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)=(?P<dir>.+):(?P<weight>[^:]+)")


def parse_mix(spec: str) -> list[MixSource]:
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
        if not (weight > 0 and math.isfinite(weight)):
            raise UsageError(f"--mix weight of {m['name']!r} must be a finite number > 0 (got {m['weight']})")
        if any(s.name == m["name"] for s in sources):
            raise UsageError(f"--mix names source {m['name']!r} twice")
        sources.append(MixSource(m["name"], m["dir"], weight))
    if not sources:
        raise UsageError("--mix needs at least one name=DIR:weight")
    return sources


def copies_per_epoch(n: int, weight: float) -> int:
    """Virtual rows of a source of ``n`` samples per epoch (Python ints: no overflow for huge weights)."""
    whole = int(weight // 1)
    return whole * int(n) + int(round((weight - whole) * n))


def check_size(sources: list[MixSource]) -> None:
    """The mixture's size from the manifests, before anything is read: one line instead of a
    MemoryError for a huge weight, or a source a tiny weight leaves out of every epoch."""
    total = 0
    for s in sources:
        manifest = artifacts.read_manifest(s.path, what="metrics or sorted directory",
                                           hint="create one with `varlen analyze` (and `varlen sort` for curriculum "
                                                "order)")
        n = sum(int(p["rows"]) for p in manifest.get("parts", []))
        copies = copies_per_epoch(n, s.weight)
        if n and not copies:
            raise UsageError(f"--mix weight {s.weight:g} of {s.name!r} gives none of its {n:,} samples a place in an "
                             f"epoch (round({s.weight:g} x {n:,}) = 0); give it a weight of at least {1 / n:.3g}, or "
                             "leave it out")
        total += copies
    if total >= 1 << 31:
        raise UsageError(f"--mix makes {total:,} samples per epoch, more than a plan holds (2^31); lower the weights")


def plan_mixture(config: PlanConfig, t0: float | None = None) -> PlanResult:
    """``varlen plan --mix``: the sources' virtual rows planned by the chunked planner."""
    from .chunked.run import Continuation, plan_chunked

    t0 = time.perf_counter() if t0 is None else t0
    if config.input:
        raise UsageError("--mix names the directories itself: give no INPUT_DIR")
    sources = parse_mix(config.mix)
    c = dataclasses.replace(config, input=sources[0].path)
    check(c)
    check_nproc(c.nproc)
    safety.check_no_overlap(c.output, [s.path for s in sources])
    check_size(sources)
    record = writer.recorded_config(config)  # the options as given (no INPUT_DIR: the sources are in --mix)
    return plan_chunked(c, t0, Continuation(mixture=tuple(sources), metadata={"config": record}))
