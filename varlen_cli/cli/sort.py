"""``varlen sort``: adapter over :func:`varlen_cli.sort.sort` (options: ``SortConfig``'s fields)."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import OUTPUT, STORAGE_OPTION, Cli, config_command
from varlen_cli.sort import SortConfig


@config_command(
    SortConfig,
    fields={"metrics_dir": Cli(argument=True), "output": OUTPUT, "by": Cli(type=str, show=",".join),
            "storage_options": STORAGE_OPTION},
    library_only=("row_group_size", "engine"),
)
def sort_command(config: SortConfig, json_output: bool = common.JSON) -> None:
    """Sort a metrics directory globally by key, distributed over workers (sample sort)."""
    from varlen_cli.cli import summary
    from varlen_cli.sort import sort

    result = common.run(sort, config)
    if result is not None and json_output:
        summary.print_json(summary.sort_json(result))
    elif result is not None:
        summary.print_sort(result)


def register(app: typer.Typer) -> None:
    app.command("sort", no_args_is_help=True)(sort_command)
