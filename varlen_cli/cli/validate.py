"""``varlen validate``: adapter over :func:`varlen_cli.validate.validate`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import STORAGE_OPTION, Cli, config_command
from varlen_cli.validate import ValidateConfig


@config_command(ValidateConfig, fields={"plan": Cli(argument=True), "storage_options": STORAGE_OPTION})
def validate_command(
    config: ValidateConfig,
    json_output: bool = typer.Option(False, "--json", help="Print the checks as JSON instead of a table."),
) -> None:
    """Re-check every invariant of a plan; exit 0 only when all hold (6 when any is violated)."""
    from varlen_cli.errors import VALIDATION_FAILED
    from varlen_cli.validate import validate

    result = common.run(validate, config)
    if not common.prints():  # every rank exits with rank 0's answer; rank 0 says it
        if not result.ok:
            raise typer.Exit(VALIDATION_FAILED)
        return
    if json_output:
        import json

        typer.echo(json.dumps({"plan": result.plan, "ok": result.ok,
                               "checks": [c.__dict__ for c in result.checks]}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"varlen validate {config.plan}")
        t.add_column("check", style="bold")
        t.add_column("result")
        t.add_column("detail")
        for c in result.checks:
            mark = "[yellow]skipped[/]" if c.skipped else ("[green]ok[/]" if c.ok else "[red]VIOLATED[/]")
            t.add_row(c.name, mark, c.detail)
        Console().print(t)
    if not result.ok:
        import sys

        for c in result.violations:
            sys.stderr.write(f"varlen: violation: {c.name}: {c.detail}\n")
        raise typer.Exit(VALIDATION_FAILED)


def register(app: typer.Typer) -> None:
    app.command("validate", no_args_is_help=True)(validate_command)
