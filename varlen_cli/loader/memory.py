"""Predicted peak memory of a plan's steps, for logging next to what the trainer measures.

Imports numpy only (and the profile's coefficients come from the plan's metadata, written by
``varlen plan --memory-profile P --max-memory X``)::

    from varlen_cli.loader import predicted_memory
    predicted = predicted_memory(plan, step, rank=rank)          # bytes
    log(predicted=predicted, measured=torch.cuda.max_memory_allocated())
"""

from __future__ import annotations

import numpy as np

from .. import format
from .plan_file import Plan, PlanError


def predicted_memory(plan, step: int, rank: int | None = None, profile: dict | None = None,
                     attention: str = "row") -> int:
    """The predicted peak bytes of ``step``: the largest ``c0 + c1*B*T + c2*B*T^2`` over the step's
    microbatches (those of ``rank`` only when given). ``profile`` (a loaded memory profile) defaults
    to the one recorded in the plan. Packed plans: R rows x T tokens, with attention over whole rows
    (``attention="row"``: eager attention with a block-diagonal mask; what the plan's budget
    guarantees) or within each segment (``"segment"``: varlen/flash attention, ``c2 * sum(s_i^2)``)."""
    if attention not in ("row", "segment"):
        raise ValueError(f"attention must be 'row' or 'segment' (got {attention!r})")
    plan = plan if isinstance(plan, Plan) else Plan.open(plan)
    if profile is None:
        try:
            profile = (format.plan_budget(plan.meta).memory or {}).get("profile")  # the one budget reader
        except format.FormatError as exc:
            raise PlanError(f"{plan.path}: {exc}") from None
    source = profile
    if not source or "fit" not in source:
        raise PlanError(f"{plan.path} records no memory profile (make it with `varlen plan --memory-profile P "
                        "--max-memory X`), and no profile was given")
    fit = source["fit"]
    c0, c1, c2 = float(fit["c0"]), float(fit["c1"]), float(fit["c2"])
    plan.check_step(step)
    if rank is None:
        micro = plan.step(step)
    else:
        plan.check_rank(rank)
        micro = [plan.microbatch(step, rank, m) for m in range(plan.grad_accum)]
    b = np.array([m.batch_size for m in micro], dtype=np.float64)
    t = np.array([m.seqlen for m in micro], dtype=np.float64)
    if attention == "segment" and plan.packing:
        attended = np.array([float(np.square(m.sample_lengths.astype(np.float64)).sum()) for m in micro])
    else:
        attended = b * t * t
    return int(np.ceil((c0 + c1 * b * t + c2 * attended).max()))
