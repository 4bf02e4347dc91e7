"""``varlen plan``: dispatch to the plain planner, ``--mix`` (:mod:`.mixture`) or ``--extend``
(:mod:`.replan`). The plain planner reads the input (:mod:`.reader`), forms and lays out every epoch
(:mod:`.pipeline`), then assembles the columns and writes the plan (:mod:`.assemble`)."""

from __future__ import annotations

import time

from ..errors import UsageError
from ..runtime import rank0, safety
from . import cost_model, writer
from .assemble import assemble_columns, finish
from .config import ORDERS, TAILS, PlanConfig, PlanResult, check
from .orders import CURRICULAR
from .pipeline import epoch_inputs, plan_epochs
from .progress import PlanProgress
from .reader import read_input
from .shapes import Budget

__all__ = ["ORDERS", "TAILS", "PlanConfig", "PlanResult", "check", "plan"]


def plan(config: PlanConfig) -> PlanResult:
    """Run ``varlen plan``: read the input, plan every epoch, write the plan; returns the summary."""
    if rank0.needs_group():  # under torchrun: rank 0 plans and writes, the others wait
        return rank0.on_rank0(plan, config)
    if config.extend is not None:  # varlen plan --extend PLAN --epochs E (plan/replan.py)
        from .replan import run_extend

        return run_extend(config)
    if config.mix is not None:  # varlen plan --mix a=DIR:w,... (plan/mixture.py)
        from .mixture import plan_mixture

        return plan_mixture(config)
    t0 = time.perf_counter()
    c = config
    if c.memory_profile is not None or c.max_memory is not None:  # budget = max_tokens/attention_cost from memory
        from varlen_cli.memory.budget import plan_config_for_memory

        c = plan_config_for_memory(c)
    check(c)
    safety.check_no_overlap(c.output, [c.input])
    writer.check_output(c.output, c.overwrite)
    with PlanProgress(c.progress, c.epochs) as bar:
        bar.phase("read")
        manifest, sample_id, length = read_input(c.input, c.allow_stale)
        kind = manifest.get("kind", "metrics")
        if c.order in CURRICULAR and kind != "sorted":
            raise UsageError(f"--order {c.order} needs a sorted input, but {c.input} is a {kind} directory "
                             f"(sample_id order); sort it first: `varlen sort {c.input} -o SORTED_DIR`")
        budget = Budget(c.max_tokens, c.max_samples, cost_model.attention_cost(c))
        inputs, long_pos = epoch_inputs(c, sample_id, length, budget)
        epochs, fixed_batch = plan_epochs(c, inputs, bar=bar)
        bar.phase("columns")
        cols, items = assemble_columns(c, sample_id, length, epochs, inputs.slots)
        bar.phase("write")
        result = finish(c, manifest, sample_id, epochs, cols, items, long_pos, inputs, fixed_batch, t0)
    result.phases = dict(bar.seconds)
    return result
