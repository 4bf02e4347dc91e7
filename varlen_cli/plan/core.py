"""``varlen plan``: dispatch to the plain planner, ``--mix`` (:mod:`.mixture`) or ``--extend``
(:mod:`.extend`). The plain planner reads the input (:mod:`.reader`), forms and lays out every epoch
(:mod:`.pipeline`), then assembles the columns and writes the plan (:mod:`.assemble`)."""

from __future__ import annotations

import time

from .. import storage
from ..errors import UsageError
from ..runtime import rank0, safety
from . import writer
from .assemble import assemble_columns, finish, input_info
from .config import ORDERS, TAILS, PlanConfig, PlanResult, check
from .cost_model import resolve_budget
from .orders import CURRICULAR
from .pipeline import Rows, check_plan_size, epoch_inputs, plan_epochs
from .progress import PlanProgress
from .reader import read_input, read_targets

__all__ = ["ORDERS", "TAILS", "PlanConfig", "PlanResult", "check", "plan"]


def plan(config: PlanConfig) -> PlanResult:
    """Run ``varlen plan``: read the input, plan every epoch, write the plan; returns the summary."""
    if rank0.needs_group():  # under torchrun: rank 0 plans and writes, the others wait
        return rank0.on_rank0(plan, config)
    storage.configure(config.storage_options)  # inputs and the output may be in object storage
    if config.extend is not None:  # varlen plan --extend PLAN --epochs E (plan/replan.py)
        from .extend import run_extend

        return run_extend(config)
    if config.mix is not None:  # varlen plan --mix a=DIR:w,... (plan/mixture.py)
        from .mixture import plan_mixture

        return plan_mixture(config)
    t0 = time.perf_counter()
    c = config
    check(c)
    safety.check_no_overlap(c.output, safety.stage_inputs(c))
    writer.check_output(c.output, c.overwrite)
    budget = resolve_budget(c)
    with PlanProgress(c.progress, c.epochs) as bar:
        bar.phase("read")
        manifest, sample_id, length = read_input(c.input, c.allow_stale)
        target = read_targets(c, c.input, manifest)
        kind = manifest.get("kind", "metrics")
        if c.order in CURRICULAR and kind != "sorted":
            raise UsageError(f"--order {c.order} needs a sorted input, but {c.input} is a {kind} directory "
                             f"(sample_id order); sort it first: `varlen sort {c.input} -o SORTED_DIR`")
        check_plan_size(len(sample_id), c.epochs, c.packing, f"{len(sample_id):,} samples")
        rows = Rows(sample_id, length, target=target)
        inputs, long_pos = epoch_inputs(c, rows, budget)
        epochs, fixed_batch = plan_epochs(c, inputs, bar=bar)
        bar.phase("columns")
        cols, items = assemble_columns(c, rows, epochs, inputs.slots)
        bar.phase("write")
        result = finish(c, rows, epochs, cols, items, long_pos, inputs, fixed_batch, t0,
                        source={"input": input_info(c, manifest, len(sample_id))})
    result.phases = dict(bar.seconds)
    return result
