"""``varlen replan``: adapter over :func:`varlen_cli.plan.replan.replan` (options: ``ReplanConfig``'s fields)."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import OUTPUT, STORAGE_OPTION, Cli, config_command
from varlen_cli.plan.replan import ReplanConfig


@config_command(ReplanConfig, fields={"plan": Cli(argument=True), "output": OUTPUT, "storage_options": STORAGE_OPTION})
def replan_command(config: ReplanConfig) -> None:
    """Re-plan the rest of a running job from step N for another number of ranks.

    The epoch in progress goes on with exactly its unconsumed samples, the LR schedule too (same base batch size).
    """
    from varlen_cli.cli import summary
    from varlen_cli.plan.replan import replan

    result = common.run(replan, config)
    if result is not None:
        summary.print_plan(result)
        lineage = result.metadata["lineage"]
        summary.console().print(f"replanned from step {lineage['from_step']} of plan {lineage['parent']} "
                               f"({lineage['consumed_samples']:,} samples of epoch {lineage['first_epoch']} done); "
                               f"global step = {lineage['first_step']} + step")


def register(app: typer.Typer) -> None:
    app.command("replan", no_args_is_help=True)(replan_command)
