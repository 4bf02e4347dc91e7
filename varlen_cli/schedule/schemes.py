"""Parallelisation schemes as the seed defines them: two functions and a priority rule.

A training step is a set of jobs ``(stage, batch, direction)``: stage ``s`` in ``0 .. S-1``, batch
``b`` in ``0 .. N-1`` (the step's microbatches in the plan's ``(rank, micro)`` order) and direction
``"F"`` (forward) or ``"B"`` (backward). A scheme is

* ``compute(stage, batch, direction) -> worker``: who runs the job;
* ``store(stage) -> worker or workers``: who holds the stage's weights (a worker that computes a
  stage it does not store fetches the weights first);
* ``priority(stage, batch, direction) -> tuple``: which ready job an idle worker starts (smallest
  first);
* optional extra dependencies: ``flush`` (backward starts when the whole unit's forward is done,
  GPipe) and ``in_flight(stage)`` (at most that many microbatches between forward and backward on
  the stage, 1F1B).

``units``: the step's microbatches split into that many contiguous blocks that share no worker
(data-parallel groups; DDP/FSDP workers); each block is scheduled on its own. See docs/schedules.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UsageError
from ..runtime import user_code

FORWARD = "F"
BACKWARD = "B"

SCHEDULES = ("ddp", "fsdp", "gpipe", "1f1b", "lpp", "fslpp")

Workers = int | tuple


@dataclass(frozen=True)
class Scheme:
    """One parallelisation scheme for steps of ``microbatches`` microbatches over ``stages`` stages."""

    name: str
    stages: int
    microbatches: int
    workers: int
    compute: Callable[[int, int, str], int]
    store: Callable[[int], Workers]
    priority: Callable[[int, int, str], tuple]
    flush: bool = False
    in_flight: Callable[[int], int | None] | None = None
    units: int = 1
    groups: int = 1  # data-parallel groups (reporting only)
    closed_form: str | None = None  # "chain" (DDP/FSDP) or "gpipe": a vectorised exact form exists
    chains: bool = False  # True only if the jobs of one (worker, stage, direction) become ready in priority order

    def stored_on(self, stage: int) -> frozenset:
        where = self.store(stage)
        return frozenset([int(where)]) if isinstance(where, int) else frozenset(int(w) for w in where)


def depth_first(stages: int) -> Callable[[int, int, str], tuple]:
    """One microbatch at a time: lowest batch first, its forward then its backward."""
    return lambda s, b, d: (b, 0, s) if d == FORWARD else (b, 1, stages - 1 - s)


def breadth_first(stages: int) -> Callable[[int, int, str], tuple]:
    """Forwards before backwards; forwards by lowest stage, backwards by highest; then lowest batch."""
    return lambda s, b, d: (0, s, b) if d == FORWARD else (1, stages - 1 - s, b)


def backward_first(stages: int) -> Callable[[int, int, str], tuple]:
    """1F1B: a ready backward before a ready forward; then lowest batch."""
    return lambda s, b, d: (1, b, s) if d == FORWARD else (0, b, stages - 1 - s)


def _check_divides(what: str, n: int, total: int, of: str) -> int:
    if n < 1:
        raise UsageError(f"{what} must be >= 1 (got {n})")
    if total % n:
        raise UsageError(f"{what} {n} does not divide {of} ({total})")
    return total // n


def data_parallel(name: str, stages: int, microbatches: int, workers: int) -> Scheme:
    """DDP (weights replicated) or FSDP (stage s stored on worker s mod W); batch b on its worker."""
    per = _check_divides("--workers", workers, microbatches, "the microbatches of a step (dp x grad_accum)")
    everyone = tuple(range(workers))
    store = (lambda s: everyone) if name == "ddp" else (lambda s: s % workers)
    return Scheme(name=name, stages=stages, microbatches=microbatches, workers=workers,
                  compute=lambda s, b, d: b // per, store=store, priority=depth_first(stages),
                  units=workers, groups=workers, closed_form="chain", chains=True)


def pipeline(name: str, stages: int, microbatches: int, groups: int, per_group: int | None = None) -> Scheme:
    """GPipe, 1F1B, LPP, FSLPP: G groups of R workers; stage s on worker s mod R of batch b's group.

    GPipe and 1F1B have R = S. LPP/FSLPP loop over the R workers when S > R (breadth first).
    Weights: replicated across groups (GPipe, 1F1B, LPP) or stored once, on group (s // R) mod G
    (FSLPP), which the other groups fetch. With R = S, LPP and FSLPP schedule exactly as GPipe (closed form).
    """
    n = _check_divides("--groups", groups, microbatches, "the microbatches of a step (dp x grad_accum)")
    r = stages if per_group is None else per_group
    if r < 1:
        raise UsageError(f"workers per group must be >= 1 (got {r})")
    if name == "fslpp":
        def store(s: int) -> Workers:
            return ((s // r) % groups) * r + s % r
    else:
        def store(s: int) -> Workers:
            return tuple(g * r + s % r for g in range(groups))
    kw = {}
    if name == "1f1b":
        kw = {"priority": backward_first(stages), "in_flight": lambda s: stages - s}
    else:
        kw = {"priority": breadth_first(stages), "flush": True}
    return Scheme(name=name, stages=stages, microbatches=microbatches, workers=groups * r,
                  compute=lambda s, b, d: (b // n) * r + s % r, store=store, units=groups, groups=groups,
                  closed_form="gpipe" if name != "1f1b" and r == stages else None, chains=True, **kw)


def load_user_scheme(spec: str, stages: int, microbatches: int, workers: int) -> Scheme:
    """``module:function``: ``function(stages=S, microbatches=N, workers=W)`` returns a :class:`Scheme`."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--schedule {spec!r} is not one of {', '.join(SCHEDULES)}, all, or MODULE:FUNCTION")
    factory = user_code.load_function(spec, "--schedule")
    try:
        inspect.signature(factory).bind(stages=stages, microbatches=microbatches, workers=workers)
    except (TypeError, ValueError):
        raise UsageError(f"--schedule {spec}: {attr}() must accept stages=, microbatches=, workers= keywords") from None
    scheme = factory(stages=stages, microbatches=microbatches, workers=workers)
    if not isinstance(scheme, Scheme):
        raise UsageError(f"--schedule {spec}: {attr}() returned {type(scheme).__name__}, not a "
                         "varlen_cli.schedule.Scheme")
    if scheme.stages != stages or scheme.microbatches != microbatches or scheme.workers < 1:
        raise UsageError(f"--schedule {spec}: the scheme must have stages={stages}, microbatches={microbatches} "
                         f"and workers >= 1 (got {scheme.stages}, {scheme.microbatches}, {scheme.workers})")
    if scheme.units < 1 or microbatches % scheme.units:
        raise UsageError(f"--schedule {spec}: units={scheme.units} must divide the {microbatches} microbatches")
    return scheme


def make_scheme(name: str, *, stages: int, microbatches: int, dp: int, workers: int | None = None,
                groups: int | None = None) -> Scheme:
    """The built-in scheme ``name`` (or ``module:function``) for a plan with ``dp`` ranks.

    Defaults: DDP/FSDP run on ``dp`` workers; GPipe/1F1B on ``dp`` groups of S workers; LPP/FSLPP on
    ``--groups`` (default dp) groups of ``--workers / groups`` workers (default S per group).
    """
    if stages < 1:
        raise UsageError(f"--stages must be >= 1 (got {stages})")
    if name in ("ddp", "fsdp"):
        if groups is not None:
            raise UsageError(f"--groups does not apply to --schedule {name} (use --workers)")
        return data_parallel(name, stages, microbatches, dp if workers is None else workers)
    if name in ("gpipe", "1f1b", "lpp", "fslpp"):
        g = dp if groups is None else groups
        if g < 1:
            raise UsageError(f"--groups must be >= 1 (got {g})")
        if name in ("gpipe", "1f1b"):
            if workers is not None and workers != g * stages:
                raise UsageError(f"--schedule {name} runs on groups x stages = {g * stages} workers, not "
                                 f"--workers {workers} (use --schedule lpp for fewer workers than stages)")
            return pipeline(name, stages, microbatches, g)
        if workers is None:
            return pipeline(name, stages, microbatches, g)
        if workers < 1 or workers % g:
            raise UsageError(f"--groups {g} does not divide --workers {workers}")
        return pipeline(name, stages, microbatches, g, workers // g)
    return load_user_scheme(name, stages, microbatches, dp if workers is None else workers)
