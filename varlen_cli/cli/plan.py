"""``varlen plan``: adapter over :func:`varlen_cli.plan.plan` (options: ``PlanConfig``'s fields)."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import OUTPUT, STORAGE_OPTION, Cli, config_command
from varlen_cli.plan import PlanConfig


def _attention_cost(value: str) -> float | str:
    from varlen_cli.plan.cost_model import from_cli

    return from_cli(value)


@config_command(
    PlanConfig,
    fields={
        # optional here: --extend PLAN and --mix take their inputs from elsewhere
        "input": Cli(argument=True, metavar="INPUT_DIR", optional=True),
        "output": OUTPUT,
        "attention_cost": Cli(type=str, convert=_attention_cost, show=lambda a: f"{a:g}"),
        "storage_options": STORAGE_OPTION,
    },
    library_only=("recorded_input",),
)
def plan_command(config: PlanConfig, json_output: bool = common.JSON) -> None:
    """Write a token-budget batch plan (Parquet): microbatches, ranks, steps, shapes and LR scales."""
    from varlen_cli.cli import summary
    from varlen_cli.plan import plan
    from varlen_cli.plan.heap import reuse_freed_memory

    with reuse_freed_memory():  # large plans: freed arrays reused, not unmapped and zeroed again (plan/heap.py)
        result = common.run(plan, config)
    if result is not None and json_output:
        summary.print_json(summary.plan_json(result))
        summary.warn_zero_loss(result)
    elif result is not None:
        summary.print_plan(result)
    if result is not None:
        summary.warn_plan_units(result)


def register(app: typer.Typer) -> None:
    app.command("plan", no_args_is_help=True)(plan_command)
