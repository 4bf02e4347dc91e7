"""Summary statistics of a length column across all workers (exact percentiles, no gather of rows)."""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError
from ..runtime.dist import Dist

EXACT_MAX = 1 << 22  # lengths up to 4M: exact percentiles from an all-reduced bincount
LOG_BINS = 64
INT64_MAX = (1 << 63) - 1


def log2_histogram(values: np.ndarray) -> np.ndarray:
    """Counts per power-of-two bin: bin 0 holds 0, bin k holds [2**(k-1), 2**k)."""
    v = np.asarray(values, dtype=np.int64)
    # frexp's exponent of v > 0 is floor(log2 v) + 1 (exact: no rounding of a log), and 0 for 0.
    bins = np.frexp(v.astype(np.float64))[1] if len(v) else np.zeros(0, dtype=np.int64)
    return np.bincount(bins, minlength=LOG_BINS)[:LOG_BINS].astype(np.int64)


def _log2_from_counts(counts: np.ndarray) -> np.ndarray:
    """The log2 histogram of the values whose exact counts (value -> count) are ``counts``."""
    hist = np.zeros(LOG_BINS, dtype=np.int64)
    if len(counts) == 0:
        return hist
    edges = [0] + [1 << k for k in range(LOG_BINS - 1) if (1 << k) < len(counts)]  # bin k starts at 2**(k-1)
    sums = np.add.reduceat(counts, edges)
    hist[: len(sums)] = sums
    return hist


def distribution(local: np.ndarray, d: Dist, quantiles=(0.5, 0.9, 0.99)) -> dict:
    """count, total, min, mean, percentiles, max and a log2 histogram of integer lengths over all ranks."""
    local = np.asarray(local, dtype=np.int64)
    n = len(local)
    # The total as an exact integer (an int64 sum could wrap): every rank learns every rank's total,
    # so all refuse together when it does not fit int64.
    safe = not n or int(local.max()) <= INT64_MAX // n
    # x == (x >> 32) * 2**32 + (x & 0xFFFFFFFF): the two halves summed apart cannot wrap for n < 2**31
    local_total = int(local.sum()) if safe else (int((local >> 32).sum()) << 32) + int((local & 0xFFFFFFFF).sum())
    count = int(d.all_reduce(np.array([n], dtype=np.int64))[0])
    total = sum(d.all_gather_object(local_total))
    if total > INT64_MAX:
        raise InputError(f"the lengths add up to {total}, more than 2**63-1; their total must fit int64")
    lo = d.all_reduce(np.array([local.min() if n else np.iinfo(np.int64).max], dtype=np.int64), op="min")[0]
    hi = d.all_reduce(np.array([local.max() if n else -1], dtype=np.int64), op="max")[0]
    out = {"count": count, "total": total, "min": int(lo) if count else 0, "max": int(hi) if count else 0,
           "mean": total / count if count else 0.0}
    if count and hi <= EXACT_MAX and lo >= 0:
        # One exact bincount gives the percentiles and the histogram.
        counts = d.all_reduce(np.bincount(local, minlength=int(hi) + 1))
        hist = _log2_from_counts(counts)
        cum = np.cumsum(counts)
        for q in quantiles:
            out[f"p{round(q * 100)}"] = int(np.searchsorted(cum, q * count, side="left"))
    else:
        # Huge lengths: percentiles from the log2 histogram's upper bin edges (approximate).
        hist = d.all_reduce(log2_histogram(local))
        cum = np.cumsum(hist)
        for q in quantiles:
            k = int(np.searchsorted(cum, q * count, side="left")) if count else 0
            out[f"p{round(q * 100)}"] = (1 << k) - 1 if k else 0
        out["approximate_percentiles"] = True
    last = int(np.max(np.flatnonzero(hist))) + 1 if hist.any() else 1
    out["histogram"] = {"log2_bins": hist[:last].tolist()}
    return out


def float_summary(unit_values, count: int, d: Dist) -> dict:
    """count, min, max and mean of float values held as per-unit arrays (``unit_values``) on each rank.

    The same for any number of workers, to the last bit: each unit's values (divided by ``count``
    first, so no sum can overflow) are summed within the unit (units do not depend on the worker
    count), and the per-unit sums of all ranks are added with ``math.fsum`` (exact, so the order of
    ranks does not matter).
    """
    local = [float(np.sum(np.asarray(v, dtype=np.float64) / count)) for v in unit_values if len(v)] if count else []
    sums = [s for rank_sums in d.all_gather_object(local) for s in rank_sums]
    lo = min((float(np.min(v)) for v in unit_values if len(v)), default=math.inf)
    hi = max((float(np.max(v)) for v in unit_values if len(v)), default=-math.inf)
    lo = float(d.all_reduce(np.array([lo]), op="min")[0])
    hi = float(d.all_reduce(np.array([hi]), op="max")[0])
    if not count:
        return {"count": int(count), "min": 0.0, "max": 0.0, "mean": 0.0}
    return {"count": int(count), "min": lo, "max": hi, "mean": math.fsum(sums)}
