"""``varlen inspect``: adapter over :func:`varlen_cli.inspect.inspect_artifact`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common


def inspect_command(
    path: str = typer.Argument(
        ..., show_default=False,
        help="A metrics directory, a sorted directory or a plan file (local or in object storage: s3://...).",
    ),
    step: int | None = typer.Option(
        None, "--step", show_default=False,
        help="Plans: also show the microbatches of step N.",
    ),
    json_output: bool = typer.Option(False, "--json", help="Print everything as JSON (for scripts)."),
    storage_options: list[str] = common.STORAGE_OPTION,
) -> None:
    """Show an artifact's config, provenance and statistics, with terminal histograms."""
    from varlen_cli.cli.report import print_tables
    from varlen_cli.inspect import InspectConfig, inspect_artifact, tables

    info = common.run(inspect_artifact, InspectConfig(path=path, step=step,
                                                              storage_options=tuple(storage_options)))
    if json_output:
        import json

        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        print_tables(tables(info))


def register(app: typer.Typer) -> None:
    app.command("inspect", no_args_is_help=True)(inspect_command)
