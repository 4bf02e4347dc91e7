"""Plain-text formatting of values and histograms, shared by library tables (``inspect``) and the
CLI's summaries (``cli/report.py``)."""

from __future__ import annotations

from typing import Any


def fmt(x: Any) -> str:
    """A value as a table cell: thousands separators, 2 decimals, lower-case booleans and none."""
    if isinstance(x, bool) or x is None:
        return str(x).lower()
    if isinstance(x, float):
        return f"{x:,.2f}" if abs(x) < 1e6 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


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
