"""``varlen inspect``: adapter over :func:`varlen_cli.inspect.inspect_artifact` (options: ``InspectConfig``'s
fields)."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import STORAGE_OPTION, Cli, config_command
from varlen_cli.inspect import InspectConfig


@config_command(InspectConfig, fields={"path": Cli(argument=True), "storage_options": STORAGE_OPTION})
def inspect_command(
    config: InspectConfig,
    json_output: bool = typer.Option(False, "--json", help="Print everything as JSON (for scripts)."),
) -> None:
    """Show an artifact's config, provenance and statistics, with terminal histograms."""
    from varlen_cli.cli.summary import print_tables
    from varlen_cli.inspect import inspect_artifact, tables

    info = common.run(inspect_artifact, config)
    if not common.prints():
        return
    if json_output:
        import json

        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        print_tables(tables(info))


def register(app: typer.Typer) -> None:
    app.command("inspect", no_args_is_help=True)(inspect_command)
