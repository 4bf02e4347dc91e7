"""Fitting ``mem(B, T) = c0 + c1*B*T + c2*B*T^2`` with non-negative coefficients.

Three unknowns: the non-negative least-squares solution is the best unconstrained solution over
the 2^3 subsets of free coefficients (the others fixed at 0) that is non-negative, which is exact
(NNLS's optimum has some active set, and on it it is the unconstrained optimum of the free ones).
Residuals are relative (each point weighted by 1 / its measured peak) so small shapes count as
much as large ones.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np


def design(batch, seqlen) -> np.ndarray:
    b = np.asarray(batch, dtype=np.float64)
    t = np.asarray(seqlen, dtype=np.float64)
    return np.stack([np.ones_like(b * t), b * t, b * t * t], axis=-1)


def fit_nnls(batch, seqlen, peak) -> tuple[float, float, float]:
    """Non-negative ``(c0, c1, c2)`` minimising the relative squared error over the points."""
    y = np.asarray(peak, dtype=np.float64)
    x = design(batch, seqlen)
    w = 1.0 / np.maximum(y, 1.0)
    xw, yw = x * w[:, None], y * w
    best, best_err = np.zeros(3), float(np.sum(yw**2))
    for k in (1, 2, 3):
        for free in combinations(range(3), k):
            cols = list(free)
            coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(3)
            full[cols] = coef
            err = float(np.sum((xw @ full - yw) ** 2))
            if err < best_err:
                best, best_err = full, err
    return float(best[0]), float(best[1]), float(best[2])


def predict(coefficients, batch, seqlen, span=None) -> np.ndarray:
    """Predicted peak bytes of ``batch`` rows of ``seqlen`` tokens; ``span`` (default ``seqlen``) is
    how many tokens each token attends over (packed rows: see docs/memory.md)."""
    c0, c1, c2 = coefficients
    b = np.asarray(batch, dtype=np.float64)
    t = np.asarray(seqlen, dtype=np.float64)
    s = t if span is None else np.asarray(span, dtype=np.float64)
    return c0 + c1 * b * t + c2 * b * t * s


def heldout_split(batch, seqlen) -> np.ndarray:
    """A boolean mask of the held-out points: every third point in (T, B) order, starting with the
    second, provided at least 3 points with 2 distinct T stay for fitting (else none held out)."""
    b = np.asarray(batch)
    t = np.asarray(seqlen)
    order = np.lexsort((b, t))
    held = np.zeros(len(b), dtype=bool)
    held[order[1::3]] = True
    kept = ~held
    if kept.sum() < 3 or len(np.unique(t[kept])) < 2 or held.sum() == 0:
        return np.zeros(len(b), dtype=bool)
    return held


def relative_errors(coefficients, batch, seqlen, peak) -> np.ndarray:
    y = np.asarray(peak, dtype=np.float64)
    return (predict(coefficients, batch, seqlen) - y) / np.maximum(y, 1.0)


def fit_points(points: list) -> tuple[dict, dict]:
    """``(fit, fit_error)`` of a profile's points (dicts with batch_size, seqlen, peak_bytes); the
    coefficients come from the fitting points only, the error is reported on the held-out ones."""
    b = np.array([p["batch_size"] for p in points], dtype=np.int64)
    t = np.array([p["seqlen"] for p in points], dtype=np.int64)
    y = np.array([p["peak_bytes"] for p in points], dtype=np.float64)
    held = heldout_split(b, t)
    for p, h in zip(points, held.tolist()):
        p["heldout"] = bool(h)
    coef = fit_nnls(b[~held], t[~held], y[~held])
    err_fit = relative_errors(coef, b[~held], t[~held], y[~held])
    err_held = relative_errors(coef, b[held], t[held], y[held])
    for p, e in zip(points, relative_errors(coef, b, t, y).tolist()):
        p["predicted_bytes"] = float(predict(coef, p["batch_size"], p["seqlen"]))
        p["relative_error"] = float(e)
    fit = {"form": "c0 + c1*B*T + c2*B*T^2", "c0": coef[0], "c1": coef[1], "c2": coef[2],
           "fit_points": int((~held).sum()), "heldout_points": int(held.sum())}
    error = {
        "fit_max_abs_rel": float(np.abs(err_fit).max()) if len(err_fit) else 0.0,
        "heldout_max_abs_rel": float(np.abs(err_held).max()) if len(err_held) else None,
        "heldout_mean_abs_rel": float(np.abs(err_held).mean()) if len(err_held) else None,
        "heldout_max_under": float(max(0.0, -err_held.min())) if len(err_held) else None,
    }
    return fit, error
