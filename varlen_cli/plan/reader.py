"""The planner's input's sample ids: checked to be the rows' indices (:func:`check_ids`), and the
canonical order random orders start from (:func:`canonical_order`)."""

from __future__ import annotations

import numpy as np

from ..errors import InputError


def check_ids(sample_id: np.ndarray, path: str) -> None:
    """The ids must be ``0..N-1``, each once (the row index of the dataset the plan indexes): one pass
    for a metrics directory (increasing ids), a table of N flags for a sorted one."""
    n = len(sample_id)
    if n and bool(np.all(sample_id[1:] > sample_id[:-1])) and int(sample_id[0]) == 0 and int(sample_id[-1]) == n - 1:
        return
    lo, hi = int(sample_id.min()), int(sample_id.max())
    if lo < 0 or hi >= n:
        raise InputError(f"{path} has sample_id {lo if lo < 0 else hi:,}, outside 0..{n - 1:,}: sample ids must be the "
                         "rows' indices 0..N-1 (re-run `varlen analyze`)")
    seen = np.zeros(n, bool)
    seen[sample_id] = True
    if not seen.all():
        twice = int(np.argmax(np.bincount(sample_id, minlength=n) > 1))
        raise InputError(f"{path} has sample_id {twice:,} more than once (and {int(np.argmin(seen)):,} never): "
                         "sample ids must be the rows' indices 0..N-1, each once (re-run `varlen analyze`)")


def canonical_order(sample_id: np.ndarray) -> np.ndarray:
    """Positions in increasing sample_id: random and bucket-shuffle plans then do not depend on
    whether the input was a metrics or a sorted directory."""
    n = len(sample_id)
    if n < 2 or bool(np.all(sample_id[1:] > sample_id[:-1])):
        return np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64)  # positions: 4 bytes a sample
    lo, hi = int(sample_id.min()), int(sample_id.max())
    if lo >= 0 and hi < 2 * n:
        inv = np.full(hi + 1, -1, np.int64)
        inv[sample_id] = np.arange(n, dtype=np.int64)
        out = inv[inv >= 0]
        if len(out) == n:
            return out
    return np.argsort(sample_id, kind="stable").astype(np.int64)
