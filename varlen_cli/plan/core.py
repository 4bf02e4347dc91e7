"""``varlen plan``: dispatch to the chunked planner (:mod:`.chunked`: a metrics or sorted directory,
on one process, ``--nproc`` workers or the ranks of a torchrun job), ``--mix`` (:mod:`.mixture`) or
``--extend`` (:mod:`.extend`). Every path forms epochs with the formers (:mod:`.orders`), lays them
out (:mod:`.layout`) and writes the plan (:mod:`.writer`); the plain planner reads the input by
chunks, so its memory is bounded by a chunk (docs/plan.md, "Plans at scale")."""

from __future__ import annotations

import time

from .. import storage
from ..errors import UsageError
from ..runtime import rank0
from ..runtime.dist import check_nproc
from .config import ORDERS, TAILS, PlanConfig, PlanResult, check

__all__ = ["ORDERS", "TAILS", "PlanConfig", "PlanResult", "check", "plan"]


def plan(config: PlanConfig) -> PlanResult:
    """Run ``varlen plan``: plan every epoch and write the plan; returns the summary (on every rank)."""
    storage.configure(config.storage_options)  # inputs and the output may be in object storage
    if config.extend is not None or config.mix is not None:
        if config.nproc != 1 and config.extend is None:
            raise UsageError("--nproc applies to plans of one metrics or sorted directory, not to --mix")
        if rank0.needs_group():  # under torchrun: rank 0 plans and writes, the others wait
            return rank0.on_rank0(plan, config)
        if config.extend is not None:  # varlen plan --extend PLAN --epochs E (plan/extend.py)
            from .extend import run_extend

            return run_extend(config)
        from .mixture import plan_mixture  # varlen plan --mix a=DIR:w,... (plan/mixture.py)

        return plan_mixture(config)
    t0 = time.perf_counter()
    check(config)
    check_nproc(config.nproc)
    from .chunked.run import plan_chunked

    return plan_chunked(config, t0)


def plan_in_group(config: PlanConfig, d) -> PlanResult | None:
    """``plan`` by every rank of an existing process group ``d`` (``varlen run``); rank 0's result."""
    t0 = time.perf_counter()
    check(config)
    from .chunked.run import plan_in_group as chunked

    return chunked(config, d, t0)
