"""Rich summary tables printed at the end of each stage (rank 0 only)."""

from __future__ import annotations

from typing import Any


def console():
    from rich.console import Console

    return Console()


def fmt(x: Any) -> str:
    """A value as a table cell: thousands separators, 2 decimals, lower-case booleans and none."""
    if isinstance(x, bool) or x is None:
        return str(x).lower()
    if isinstance(x, float):
        return f"{x:,.2f}" if abs(x) < 1e6 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


_fmt = fmt  # the old name, until every caller uses fmt


def print_tables(tables) -> None:
    """Print :class:`varlen_cli.inspect.TextTable` s as rich tables (first column bold)."""
    from rich.table import Table

    out = console()
    for spec in tables:
        t = Table(title=spec.title, show_header=spec.show_header)
        for k, (name, justify) in enumerate(spec.columns):
            t.add_column(name, justify=justify, style="bold" if k == 0 and not spec.show_header else None)
        for row in spec.rows:
            t.add_row(*row)
        out.print(t)


def histogram_lines(log2_bins: list, width: int = 30) -> list[tuple[str, str, str]]:
    """(range, count, bar) rows of a log2 length histogram."""
    peak = max(log2_bins) if log2_bins else 0
    rows = []
    for k, n in enumerate(log2_bins):
        if k == 0:
            label = "0"
        else:
            lo, hi = 1 << (k - 1), (1 << k) - 1
            label = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
        bar = "█" * (round(width * n / peak) if peak else 0)
        rows.append((label, f"{n:,}", bar))
    return rows


def print_analyze(result) -> None:
    from rich.table import Table

    s = result.stats
    t = Table(title=f"varlen analyze → {result.output}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    for label, value in [
        ("samples", result.num_samples), ("files", result.num_files), ("parts", result.num_parts),
        ("length", result.length), ("difficulty", result.difficulty), ("total length", s["total"]),
        ("min / p50 / p90 / p99 / max", f"{s['min']:,} / {s['p50']:,} / {s['p90']:,} / {s['p99']:,} / {s['max']:,}"),
        ("mean length", s["mean"]), ("seconds", result.seconds),
    ]:
        t.add_row(label, _fmt(value))
    h = Table(title="lengths (log2 bins)", show_header=True)
    h.add_column("length")
    h.add_column("samples", justify="right")
    h.add_column("")
    for row in histogram_lines(s["histogram"]["log2_bins"]):
        h.add_row(*row)
    c = console()
    c.print(t)
    c.print(h)
    empty = s["histogram"]["log2_bins"][0] if s["histogram"]["log2_bins"] else 0
    if empty:
        import sys

        sys.stderr.write(f"varlen: warning: {empty:,} samples have length 0; they are kept "
                         "(plans still schedule them; they add no tokens)\n")
