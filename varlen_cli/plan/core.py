"""``varlen plan``: dispatch to the chunked planner (:mod:`.chunked`), which plans every plan on one
process, ``--nproc`` workers or the ranks of a torchrun job: a metrics or sorted directory, a mixture
(``--mix``, :mod:`.mixture`), and the epochs ``--extend`` (:mod:`.extend`) appends. Its memory is bounded
by a chunk and the microbatch tables (docs/plan.md, "Plans at scale")."""

from __future__ import annotations

import time

from .. import storage
from ..runtime import rank0
from ..runtime.dist import check_nproc
from .config import ORDERS, TAILS, PlanConfig, PlanResult, check

__all__ = ["ORDERS", "TAILS", "PlanConfig", "PlanResult", "check", "plan"]


def plan(config: PlanConfig) -> PlanResult:
    """Run ``varlen plan``: plan every epoch and write the plan; returns the summary (on every rank)."""
    storage.configure(config.storage_options)  # inputs and the output may be in object storage
    if config.extend is not None:  # varlen plan --extend PLAN --epochs E (plan/extend.py)
        if rank0.needs_group():  # under torchrun: rank 0 extends and writes, the others wait
            return rank0.on_rank0(plan, config)
        from .extend import run_extend

        return run_extend(config)
    t0 = time.perf_counter()
    if config.mix is not None:  # varlen plan --mix a=DIR:w,... (plan/mixture.py)
        from .mixture import plan_mixture

        return plan_mixture(config, t0)
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
