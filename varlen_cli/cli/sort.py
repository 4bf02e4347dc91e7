"""``varlen sort``: adapter over :func:`varlen_cli.sort.sort`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common


def sort_command(
    metrics_dir: str = typer.Argument(..., metavar="METRICS_DIR", help="Metrics directory from `varlen analyze` (or a sorted directory) to sort.", show_default=False),
    output: str = typer.Option(..., "-o", "--output", help="Sorted directory to write (part-*.parquet + _manifest.json).", show_default=False),
    by: str = typer.Option("difficulty", "--by", help="Key column(s), comma-separated, most significant first."),
    descending: bool = typer.Option(False, "--descending", help="Largest keys first (ties still ascending by sample_id)."),
    ties: str = typer.Option("id", "--ties", help="Order of equal keys: id (ascending sample_id) or shuffle (seeded hash of sample_id)."),
    seed: int = typer.Option(0, "--seed", help="Seed of --ties shuffle."),
    nan: str = typer.Option("error", "--nan", help="NaN keys: error (refuse) or last (after all other keys)."),
    single_file: bool = typer.Option(False, "--single-file", help="Write one part-00000.parquet, streamed in rank order, instead of one part per worker."),
    nproc: int = common.NPROC,
    device: str = common.DEVICE,
    overwrite: bool = common.OVERWRITE,
    progress: bool = common.PROGRESS,
    allow_stale: bool = common.ALLOW_STALE,
) -> None:
    """Sort a metrics directory globally by key, distributed over workers (sample sort)."""
    from varlen_cli.sort import SortConfig, sort

    config = SortConfig(
        metrics_dir=metrics_dir, output=output, by=by, descending=descending, ties=ties, seed=seed, nan=nan,
        single_file=single_file, nproc=nproc, device=device, overwrite=overwrite, progress=progress,
        allow_stale=allow_stale,
    )
    result = common.run(sort, config)
    if result is not None:
        print_sort(result)


def print_sort(result) -> None:
    """The summary table: rows, rows per worker, balance, seconds per phase."""
    from rich.table import Table

    from varlen_cli.cli import report

    o = result.order
    rows = result.rows_per_worker
    order = ",".join(o["by"]) + (" descending" if o["descending"] else "") + f", ties {o['ties']}"
    if o["ties"] == "shuffle":
        order += f" (seed {o['seed']})"
    t = Table(title=f"varlen sort → {result.output}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    for label, value in [
        ("rows", result.num_rows), ("order", order), ("workers", result.world_size), ("parts", result.num_parts),
        ("rows per worker (min / max)", f"{min(rows):,} / {max(rows):,}"),
        ("balance (max / mean)", f"{result.balance:.3f}"),
        ("seconds", result.seconds),
    ]:
        t.add_row(label, report._fmt(value))
    peaks = [p for p in result.peak_rss_bytes if p]
    if peaks:
        t.add_row("peak memory per worker (max)", f"{max(peaks) / 2**20:,.0f} MiB")
    p = Table(title="seconds per phase (slowest worker)", show_header=True)
    p.add_column("phase")
    p.add_column("seconds", justify="right")
    for phase, secs in result.phases.items():
        p.add_row(phase.replace("_", " "), f"{secs:.2f}")
    c = report.console()
    c.print(t)
    c.print(p)


def register(app: typer.Typer) -> None:
    app.command("sort", no_args_is_help=True)(sort_command)
