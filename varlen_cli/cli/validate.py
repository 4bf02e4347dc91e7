"""``varlen validate``: adapter over :func:`varlen_cli.validate.validate`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common


def validate_command(
    plan: str = typer.Argument(..., help="Plan Parquet file written by `varlen plan` (local or an s3://... object).",
                               show_default=False),
    metrics: str | None = typer.Option(
        None, "--metrics", show_default=False,
        help="Metrics or sorted directory the plan was built from (local or an s3://... prefix): also checks the "
        "fingerprint, seqlens, token counts and loss tokens.",
    ),
    max_memory: str | None = typer.Option(
        None, "--max-memory", show_default=False,
        help="Also check that no microbatch's predicted peak exceeds this (e.g. 70GiB; default: the plan's own "
             "--max-memory).",
    ),
    memory_profile: str | None = typer.Option(
        None, "--memory-profile", show_default=False,
        help="Memory profile for --max-memory (default: the one the plan was made with).",
    ),
    json_output: bool = typer.Option(False, "--json", help="Print the checks as JSON instead of a table."),
    allow_stale: bool = common.ALLOW_STALE,
    storage_options: list[str] = common.STORAGE_OPTION,
) -> None:
    """Re-check every invariant of a plan; exit 0 only when all hold (6 when any is violated)."""
    from varlen_cli.errors import VALIDATION_FAILED
    from varlen_cli.validate import ValidateConfig, validate

    result = common.run(validate, ValidateConfig(plan=plan, metrics=metrics, allow_stale=allow_stale,
                                                 max_memory=max_memory, memory_profile=memory_profile,
                                                 storage_options=tuple(storage_options)))
    if json_output:
        import json

        typer.echo(json.dumps({"plan": result.plan, "ok": result.ok,
                               "checks": [c.__dict__ for c in result.checks]}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"varlen validate {plan}")
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
