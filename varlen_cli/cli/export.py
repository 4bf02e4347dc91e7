"""``varlen export``: adapter over :func:`varlen_cli.export.export` (options: ``ExportConfig``'s fields)."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import OUTPUT, STORAGE_OPTION, Cli, config_command
from varlen_cli.export import ExportConfig


@config_command(ExportConfig, fields={"target": Cli(argument=True), "plan": Cli(argument=True), "output": OUTPUT,
                                      "storage_options": STORAGE_OPTION})
def export_command(config: ExportConfig, json_output: bool = common.JSON) -> None:
    """Write a plan in another framework's own format.

    deepspeed: DeepSpeed's (microbatch_ids, batch_sizes, batch_max_seqlens) (docs/integrations.md).
    """
    from varlen_cli.cli import summary
    from varlen_cli.export import export

    result = common.run(export, config)
    if not common.prints():
        return
    rows = [("output", result.output), ("microbatches", result.microbatches), ("steps", result.steps),
            ("sample ids", result.samples), ("dp", result.dp), ("grad accum", result.grad_accum),
            ("lr scaling", f"{result.lr_scaling_method} by {result.batch_size_unit}, base {result.base_batch_size:g}"),
            ("seconds", round(result.seconds, 3))]
    if json_output:
        import json

        typer.echo(json.dumps(dict(rows)))
        return
    from rich.table import Table

    table = Table(title=f"varlen export {config.target} → {result.output}", show_header=False)
    for label, value in rows:
        table.add_row(label, f"{value:,}" if isinstance(value, int) else str(value))
    summary.console().print(table)


def register(app: typer.Typer) -> None:
    app.command("export", no_args_is_help=True)(export_command)
