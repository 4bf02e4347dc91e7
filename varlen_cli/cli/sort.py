"""``varlen sort``: adapter over :func:`varlen_cli.sort.sort`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.runtime.choices import Device, NanPolicy, Ties


def sort_command(
    metrics_dir: str = typer.Argument(
        ..., metavar="METRICS_DIR", show_default=False,
        help="Metrics directory from `varlen analyze` (or a sorted directory) to sort.",
    ),
    output: str = typer.Option(
        ..., "-o", "--output", show_default=False,
        help="Sorted directory to write (part-*.parquet + _manifest.json); or an s3://... prefix (published manifest "
        "last).",
    ),
    by: str = typer.Option("difficulty", "--by", help="Key column(s), comma-separated, most significant first."),
    descending: bool = typer.Option(
        False, "--descending",
        help="Largest keys first (ties still ascending by sample_id).",
    ),
    ties: Ties = typer.Option(
        "id", "--ties",
        help="Order of equal keys: id (ascending sample_id) or shuffle (seeded hash of sample_id).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of --ties shuffle."),
    nan: NanPolicy = typer.Option("error", "--nan", help="NaN keys: error (refuse) or last (after all other keys)."),
    single_file: bool = typer.Option(
        False, "--single-file",
        help="Write one part-00000.parquet, streamed in rank order, instead of one part per worker.",
    ),
    nproc: int = common.NPROC,
    device: Device = common.DEVICE,
    overwrite: bool = common.OVERWRITE,
    progress: bool = common.PROGRESS,
    allow_stale: bool = common.ALLOW_STALE,
    json_output: bool = common.JSON,
) -> None:
    """Sort a metrics directory globally by key, distributed over workers (sample sort)."""
    from varlen_cli.cli import report
    from varlen_cli.sort import SortConfig, sort

    config = SortConfig(
        metrics_dir=metrics_dir, output=output, by=by, descending=descending, ties=ties, seed=seed, nan=nan,
        single_file=single_file, nproc=nproc, device=device, overwrite=overwrite, progress=progress,
        allow_stale=allow_stale,
    )
    result = common.run(sort, config)
    if result is not None and json_output:
        report.print_json(report.sort_json(result))
    elif result is not None:
        report.print_sort(result)


def register(app: typer.Typer) -> None:
    app.command("sort", no_args_is_help=True)(sort_command)
