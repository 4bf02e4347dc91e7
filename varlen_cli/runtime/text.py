"""Plain-text formatting of values and histograms, shared by library tables (``inspect``) and the
CLI's summaries (``cli/summary.py``)."""

from __future__ import annotations

from typing import Any

LOG_BINS = 64  # bins of a log2 length histogram (bin 0: length 0, bin k: [2**(k-1), 2**k))


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


def log2_histogram(values):
    """Counts per power-of-two bin (numpy int64, :data:`LOG_BINS` bins): bin 0 holds 0, bin k holds
    [2**(k-1), 2**k)."""
    import numpy as np

    v = np.asarray(values, dtype=np.int64)
    # frexp's exponent of v > 0 is floor(log2 v) + 1 (exact: no rounding of a log), and 0 for 0.
    bins = np.frexp(v.astype(np.float64))[1] if len(v) else np.zeros(0, dtype=np.int64)
    return np.bincount(bins, minlength=LOG_BINS)[:LOG_BINS].astype(np.int64)
