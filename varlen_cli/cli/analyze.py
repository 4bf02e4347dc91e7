"""``varlen analyze``: adapter over :func:`varlen_cli.analyze.analyze` (options: ``AnalyzeConfig``'s fields)."""

from __future__ import annotations

import typer

from varlen_cli.analyze import AnalyzeConfig
from varlen_cli.cli import common
from varlen_cli.cli.options import OUTPUT, STORAGE_OPTION, Cli, config_command


@config_command(
    AnalyzeConfig,
    fields={"sources": Cli(argument=True, metavar="SOURCE", type=list[str], convert=tuple), "output": OUTPUT,
            "storage_options": STORAGE_OPTION},
    library_only=("chunk_bytes",),
)
def analyze_command(config: AnalyzeConfig, json_output: bool = common.JSON) -> None:
    """Compute each sample's length and difficulty, distributed over workers."""
    from varlen_cli.analyze import analyze
    from varlen_cli.cli import summary

    result = common.run(analyze, config)
    if result is not None and json_output:
        summary.print_json(summary.analyze_json(result))
        summary.warn_empty(result)
    elif result is not None:
        summary.print_analyze(result)


def register(app: typer.Typer) -> None:
    app.command("analyze", no_args_is_help=True)(analyze_command)
