"""Fitting ``mem(B, T) = c0 + c1*B*T + c2*B*T^2`` with non-negative coefficients.

A measured profile is the **upper envelope** of its points (:func:`fit_envelope`): the non-negative
coefficients that predict at least every measured peak and over-predict them least (the sum of
relative over-predictions). It is a linear program in three unknowns, solved exactly by visiting
its vertices. Why an envelope: the peak per token is a maximum of linear functions of T (the
loss's transient or the attention backward's, docs/memory.md), i.e. convex in T, and linear in B;
a prediction linear in T that is above the measured points at a range of T is then above the
peaks between them, where least squares would under-predict half the points.

The analytic profile's term model is fitted by least squares (:func:`fit_nnls`): for three unknowns
the non-negative least-squares solution is the best unconstrained solution over the 2^3 subsets of
free coefficients (the others fixed at 0) that is non-negative, which is exact. Residuals are
relative (each point weighted by 1 / its peak) so small shapes count as much as large ones.
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


def fit_envelope(batch, seqlen, peak) -> tuple[float, float, float]:
    """Non-negative ``(c0, c1, c2)`` with ``predict >= peak`` at every point and the least sum of
    relative over-predictions: the best vertex of ``{c >= 0, X c >= peak}``, each vertex the solution
    of three of its constraints taken as equalities."""
    y = np.asarray(peak, dtype=np.float64)
    x = design(batch, seqlen)
    scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # columns of comparable size: better conditioned
    xs = x / scale
    rows = np.vstack([xs, np.eye(3)])
    rhs = np.concatenate([y, np.zeros(3)])
    triples = np.array(list(combinations(range(len(rows)), 3)))
    mats = rows[triples]
    ok = np.abs(np.linalg.det(mats)) > 1e-12
    coef = np.linalg.solve(mats[ok], rhs[triples[ok]][..., None])[..., 0]
    tol = 1e-9 * max(float(y.max()), 1.0)
    feasible = (coef >= -1e-12).all(axis=1) & ((coef @ xs.T) >= y - tol).all(axis=1)
    if not feasible.any():  # pragma: no cover - c0 = max(peak) is always a vertex candidate
        raise ValueError("no envelope")
    weight = (xs / np.maximum(y, 1.0)[:, None]).sum(axis=0)
    best = np.maximum(coef[feasible][np.argmin(coef[feasible] @ weight)], 0.0) / scale
    best[0] += max(0.0, float((y - x @ best).max()))  # rounding: at or above every point, exactly
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


def fit_points(points: list, method: str = "nnls") -> tuple[dict, dict]:
    """``(fit, fit_error)`` of a profile's points (dicts with batch_size, seqlen, peak_bytes).

    ``method`` ``nnls`` (analytic term models): least squares on the fitting points, the error
    reported on the held-out ones. ``envelope`` (measured): the error is that of the envelope of the
    fitting points on the held-out ones (how far a shape that was not measured can exceed the
    envelope); the coefficients are the envelope of all points, its c0 raised by the largest amount
    a held-out peak exceeded the others' envelope (``fit["allowance"]``, bytes): the allocator can
    make the peak jump between shapes, and the held-out shapes say by how much."""
    b = np.array([p["batch_size"] for p in points], dtype=np.int64)
    t = np.array([p["seqlen"] for p in points], dtype=np.int64)
    y = np.array([p["peak_bytes"] for p in points], dtype=np.float64)
    held = heldout_split(b, t)
    for p, h in zip(points, held.tolist()):
        p["heldout"] = bool(h)
    fitter = fit_envelope if method == "envelope" else fit_nnls
    coef = fitter(b[~held], t[~held], y[~held])
    err_held = relative_errors(coef, b[held], t[held], y[held])
    allowance = 0.0
    if method == "envelope":
        under = y[held] - predict(coef, b[held], t[held])
        allowance = float(max(0.0, under.max())) if len(under) else 0.0
        c0, c1, c2 = fit_envelope(b, t, y)
        coef = (c0 + allowance, c1, c2)
        held = np.zeros(len(b), dtype=bool)
    err_fit = relative_errors(coef, b[~held], t[~held], y[~held])
    for p, e in zip(points, relative_errors(coef, b, t, y).tolist()):
        p["predicted_bytes"] = float(predict(coef, p["batch_size"], p["seqlen"]))
        p["relative_error"] = float(e)
    fit = {"form": "c0 + c1*B*T + c2*B*T^2", "c0": coef[0], "c1": coef[1], "c2": coef[2], "method": method,
           "fit_points": int((~held).sum()), "heldout_points": len(err_held)}
    if method == "envelope":
        fit["allowance"] = allowance
    error = {
        "fit_max_abs_rel": float(np.abs(err_fit).max()) if len(err_fit) else 0.0,
        "heldout_max_abs_rel": float(np.abs(err_held).max()) if len(err_held) else None,
        "heldout_mean_abs_rel": float(np.abs(err_held).mean()) if len(err_held) else None,
        "heldout_max_under": float(max(0.0, -err_held.min())) if len(err_held) else None,
    }
    return fit, error
