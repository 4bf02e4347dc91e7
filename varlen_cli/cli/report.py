"""``varlen report``: adapter over :func:`varlen_cli.report.report` (options: ``ReportConfig``'s fields).

Not the stages' end-of-run summary tables: those are ``varlen_cli/cli/summary.py``."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import OUTPUT, STORAGE_OPTION, Cli, config_command
from varlen_cli.report.core import ReportConfig


@config_command(ReportConfig, fields={"plan": Cli(argument=True), "output": OUTPUT, "storage_options": STORAGE_OPTION})
def report_command(
    config: ReportConfig,
    json_output: bool = typer.Option(False, "--json", help="Print what was written as one JSON object on stdout "
                                                           "(output, format, plots, bytes, seconds)."),
) -> None:
    """Draw a plan as one self-contained HTML page (or a PNG): every plot with a caption of what to look for."""
    from varlen_cli.report import report

    result = common.run(report, config)
    if not common.prints():
        return
    if json_output:
        from varlen_cli.cli.summary import print_json

        print_json({"output": result.output, "format": result.format, "plots": result.figures, "bytes": result.bytes,
                    "seconds": result.seconds})
        return
    from varlen_cli.cli.summary import console

    console().print(f"[bold]varlen report[/] → {result.output}: {len(result.figures)} plots "
                    f"({', '.join(result.figures)}), {result.bytes / 1024:,.0f} KiB in {result.seconds:.2f} s")


def register(app: typer.Typer) -> None:
    app.command("report", no_args_is_help=True)(report_command)
