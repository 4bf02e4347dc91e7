"""``varlen replan``: adapter over :func:`varlen_cli.plan.replan.replan`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common


def replan_command(
    plan: str = typer.Argument(..., show_default=False, help="The plan being trained (the parent)."),
    output: str = typer.Option(..., "-o", "--output", show_default=False, help="The new plan file to write."),
    dp: int = typer.Option(..., "--dp", show_default=False, help="Data-parallel ranks of the restarted job."),
    from_step: int | None = typer.Option(
        None, "--from-step", show_default=False,
        help="Global step of the parent to resume at: steps < N are done (or pass --state).",
    ),
    state: str | None = typer.Option(
        None, "--state", show_default=False,
        help="A sampler state JSON of the parent (PlanBatchSampler.state_dict()): resume at its step.",
    ),
    grad_accum: int | None = typer.Option(None, "--grad-accum", show_default=False,
                                          help="Microbatches per rank per step (default: the parent's)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", show_default=False,
                                          help="Budget of the new plan (default: the parent's; a parent's "
                                               "--max-memory limit is re-checked)."),
    max_memory: str | None = typer.Option(None, "--max-memory", show_default=False,
                                          help="New peak memory limit, e.g. 70GiB (default: the parent's); the "
                                               "budget comes from --memory-profile or the profile the parent "
                                               "recorded."),
    memory_profile: str | None = typer.Option(None, "--memory-profile", show_default=False,
                                              help="Memory profile for --max-memory (default: the one the parent "
                                                   "recorded)."),
    overwrite: bool = common.OVERWRITE,
    allow_stale: bool = common.ALLOW_STALE,
) -> None:
    """Re-plan the rest of a running job from step N for another number of ranks: the epoch in progress
    continues with exactly its unconsumed samples, the LR schedule continues (same base batch size)."""
    from varlen_cli.cli import report
    from varlen_cli.plan.replan import ReplanConfig, replan

    config = ReplanConfig(plan=plan, output=output, dp=dp, from_step=from_step, state=state, grad_accum=grad_accum,
                          max_tokens=max_tokens, max_memory=max_memory, memory_profile=memory_profile,
                          overwrite=overwrite, allow_stale=allow_stale)
    result = common.run(replan, config)
    if result is not None:
        report.print_plan(result)
        lineage = result.metadata["lineage"]
        report.console().print(f"replanned from step {lineage['from_step']} of plan {lineage['parent']} "
                               f"({lineage['consumed_samples']:,} samples of epoch {lineage['first_epoch']} done); "
                               f"global step = {lineage['first_step']} + step")


def register(app: typer.Typer) -> None:
    app.command("replan", no_args_is_help=True)(replan_command)
