"""Per-step learning-rate scales: lr_scale = b / base (linear), sqrt(b / base) (sqrt) or 1 (none);
b is the step's real sample count (or token count with ``--lr-scale-by tokens``)."""

from __future__ import annotations

import numpy as np

SCALINGS = ("linear", "sqrt", "none")
SCALE_BY = ("samples", "tokens")


def lr_scales(step_samples: np.ndarray, step_tokens: np.ndarray, scaling: str, scale_by: str,
              base: float | None) -> tuple[np.ndarray, float]:
    """(lr_scale per step, the base used). The base defaults to the mean step size in the same unit."""
    b = np.asarray(step_tokens if scale_by == "tokens" else step_samples, dtype=np.float64)
    if base is None:
        base = float(b.mean()) if len(b) else 1.0
    base = float(base)
    if scaling == "none" or base == 0:  # base 0: only empty samples; nothing to scale by
        return np.ones(len(b), np.float64), base
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # a tiny base: inf, refused by the caller
        ratio = b / base
    return (np.sqrt(ratio) if scaling == "sqrt" else ratio), base
