"""From a memory profile and a limit to the planner's budget, and back to predicted peaks.

The profile says ``peak(B, T) = c0 + c1*B*T + c2*B*T^2``. A microbatch fits the limit
``L = max_memory * (1 - margin)`` when ``c0 + c1*B*T + c2*B*T^2 <= L``, i.e. (dividing by c1)
``B*T + (c2/c1)*B*T^2 <= (L - c0)/c1``: exactly the planner's padded budget
``B*T + A*B*T^2 <= max_tokens`` with ``A = c2/c1`` and ``max_tokens = floor((L - c0)/c1)`` (the
floor only tightens it). So ``--max-memory`` reuses the planner unchanged.

A measured profile is only known where it was measured: a limit beyond its measured peaks
(:func:`calibrated_range`) is refused by :func:`check_calibrated_range`, the one check every planning
command makes through :func:`budget_for_memory` (``--extend`` on its recorded limit).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import UsageError
from . import fit as fitting
from .profile import coefficients, load_profile
from .sizes import format_size, parse_size


def budget_from_profile(profile: dict, max_memory, margin: float = 0.05) -> tuple[int, float]:
    """``(max_tokens, attention_cost)`` such that every (B, T) within the planner's budget has a
    predicted peak <= ``max_memory * (1 - margin)``."""
    if not (0 <= margin < 1):
        raise UsageError(f"--memory-margin must be in [0, 1) (got {margin})")
    limit = parse_size(max_memory) * (1.0 - margin)
    c0, c1, c2 = coefficients(profile)
    if limit <= c0:
        raise UsageError(f"--max-memory {max_memory} (minus the {margin:g} margin: {format_size(limit)}) is below "
                         f"the profile's fixed memory c0 = {format_size(c0)} (parameters, gradients, optimizer "
                         "states): no microbatch fits")
    # c1 = 0 (pure attention growth): use c1' = c2 (one token's worth), a slightly tighter budget
    c1_eff = c1 if c1 > 0 else c2
    max_tokens = int(math.floor((limit - c0) / c1_eff))
    if max_tokens < 1:
        raise UsageError(f"--max-memory {max_memory} leaves {format_size(limit - c0)} above the fixed memory: "
                         f"less than one token ({format_size(c1_eff)})")
    return max_tokens, c2 / c1_eff


EXTRAPOLATION_TOLERANCE = 0.05
"""How far (a fraction) the planned limit may exceed the profile's measured range: the calibration's
auto grid itself takes points up to 5% over its limit (memory/grid.py ``BEYOND``)."""


def calibrated_range(profile: dict) -> int | None:
    """Bytes up to which a measured profile's measurements reach: the larger of the limit its grid walked
    along (``measure.limit``) and its largest measured peak (``points``); a plan records it as its
    profile's ``measured_range``. None for an analytic profile (a formula of the tensors: nothing was
    measured, nothing is extrapolated) and for a profile that records neither."""
    if profile.get("mode") == "analytic":
        return None
    if _positive(profile.get("measured_range")):
        return int(profile["measured_range"])
    measure = profile.get("measure") if isinstance(profile.get("measure"), dict) else {}
    points = profile.get("points") if isinstance(profile.get("points"), list) else []
    values = [measure.get("limit")] + [p.get("peak_bytes") for p in points if isinstance(p, dict)]
    values = [v for v in values if _positive(v)]
    return int(max(values)) if values else None


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_calibrated_range(memory: dict, allow_extrapolation: bool = False) -> None:
    """Refuse in one line a memory limit whose planned peak (``max_memory x (1 - margin)``) lies beyond
    the profile's :func:`calibrated_range` by more than :data:`EXTRAPOLATION_TOLERANCE`: predictions
    there are extrapolated (a larger B x T than any measured step; the allocator's jumps are unseen)
    and can under-predict. ``allow_extrapolation`` (``--allow-memory-extrapolation``) accepts it."""
    reach = calibrated_range(memory.get("profile") or {})
    if allow_extrapolation or reach is None:
        return
    margin = float(memory["margin"])
    planned = int(memory["max_memory"]) * (1.0 - margin)
    if planned <= reach * (1.0 + EXTRAPOLATION_TOLERANCE):
        return
    given = memory.get("given") or format_size(int(memory["max_memory"])).replace(" ", "")  # an option's value
    where = f"the memory profile {memory['profile_path']}" if memory.get("profile_path") else "the plan's profile"
    raise UsageError(f"--max-memory {given} (minus the {margin:g} margin: {format_size(planned)}) is beyond what "
                     f"{where} measured (peaks up to {format_size(reach)}): its predictions there are extrapolated "
                     f"and can fall short; re-run `varlen calibrate --max-memory {given}` (or pass "
                     "--allow-memory-extrapolation)")


def fit_shortfall(profile: dict) -> float | None:
    """How far (a fraction of the peak) the profile's coefficients can fall below the peaks it was fitted
    to, which ``--memory-margin`` has to cover. An envelope (measured profiles: ``fit.method`` envelope
    with ``fit.allowance``) is at or above every measured point and its ``c0`` already includes the
    largest held-out excess: 0. A least-squares fit (analytic profiles, ``nnls``): ``fit_error.max_under``
    over all its points, or, in profiles written before that key, ``heldout_max_under``. None: unknown."""
    fit = profile.get("fit") if isinstance(profile.get("fit"), dict) else {}
    if fit.get("method") == "envelope" and "allowance" in fit:
        return 0.0
    error = profile.get("fit_error") if isinstance(profile.get("fit_error"), dict) else {}
    for key in ("max_under", "heldout_max_under"):
        value = error.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return max(0.0, float(value))
    return None


PROFILE_KEYS = ("mode", "model", "device", "dtype", "torch_version", "optimizer", "fit", "fit_error", "created_at",
                "varlen_version")
"""What a plan keeps of its memory profile (provenance and the fit): enough to re-derive its budget
and re-check its limit without the profile file (``varlen replan``, ``--extend``, ``validate``)."""


def memory_limit(profile_path: str, max_memory, margin: float) -> dict:
    """The memory part of a ``--max-memory`` budget: the limit in bytes, the margin and the profile
    (read from ``profile_path``; provenance and fit only)."""
    profile = load_profile(profile_path)
    kept = {k: profile.get(k) for k in PROFILE_KEYS}
    kept["measured_range"] = calibrated_range(profile)  # the points are not kept: their reach is
    return {"max_memory": parse_size(max_memory), "margin": float(margin), "profile": kept,
            "profile_path": profile_path,
            "given": str(max_memory)}  # as the user wrote it, for messages (not recorded in the plan)


def budget_for_memory(memory: dict, max_memory=None, allow_extrapolation: bool = False) -> tuple[int, float]:
    """``(max_tokens, attention_cost)`` of a :func:`memory_limit` (``max_memory``: the limit as the
    user wrote it, for messages; default its bytes), refused beyond the profile's measured range
    unless ``allow_extrapolation`` (:func:`check_calibrated_range`)."""
    limit = memory["max_memory"] if max_memory is None else max_memory
    max_tokens, a = budget_from_profile(memory["profile"], limit, memory["margin"])
    check_calibrated_range(memory, allow_extrapolation)
    return max_tokens, a


def predicted_peaks(coef, batch, seqlen, packed: bool = False) -> np.ndarray:
    """Per microbatch: padded ``B x T``; packed: R rows x T with attention over whole rows (the
    budget's form; an upper bound for per-segment attention, see :func:`segment_peaks`)."""
    del packed  # a packed row's tokens attend over at most T tokens: the same bound (docs/memory.md)
    return fitting.predict(coef, batch, seqlen)


def segment_peaks(coef, batch, seqlen, segment_lengths, offsets) -> np.ndarray:
    """Packed microbatches with per-segment (varlen) attention: ``c0 + c1*R*T + c2*sum(s_i^2)``
    over the segments ``s_i`` of each microbatch (``offsets``: CSR into ``segment_lengths``)."""
    c0, c1, c2 = coef
    counts = np.diff(np.asarray(offsets, dtype=np.int64))
    parent = np.repeat(np.arange(len(counts)), counts)
    s = np.asarray(segment_lengths, dtype=np.float64)
    squares = np.bincount(parent, weights=s * s, minlength=len(counts)) if len(s) else np.zeros(len(counts))
    return c0 + c1 * np.asarray(batch, dtype=np.float64) * np.asarray(seqlen, dtype=np.float64) + c2 * squares


def plan_memory_metadata(memory: dict, batch, seqlen, shape_id, num_shapes: int, packed: bool,
                         segment_lengths=None, offsets=None, sum_squares=None) -> dict:
    """The plan metadata's ``memory`` entry of a :func:`memory_limit`: the profile used, the limit,
    and the predicted peak of every shape (the largest over its microbatches when B varies) and of
    the whole plan; packed plans also get the per-segment-attention maximum."""
    coef = coefficients(memory["profile"])
    peak = predicted_peaks(coef, batch, seqlen, packed)
    per_shape = np.zeros(num_shapes)
    if len(peak):
        np.maximum.at(per_shape, np.asarray(shape_id, dtype=np.int64), peak)
    max_memory, margin = int(memory["max_memory"]), float(memory["margin"])
    out = {
        "max_memory": max_memory, "margin": margin, "limit": max_memory * (1.0 - margin),
        "profile": dict(memory["profile"]), "profile_path": memory.get("profile_path"),
        "packed_attention": "row" if packed else None,
        "predicted_peak_per_shape": [float(v) for v in per_shape],
        "predicted_peak_max": float(peak.max()) if len(peak) else float(coef[0]),
    }
    if packed and sum_squares is not None and len(peak):  # per microbatch sum(s_i^2) given (chunked plans)
        c0, c1, c2 = coef
        seg = c0 + c1 * np.asarray(batch, np.float64) * np.asarray(seqlen, np.float64) + c2 * np.asarray(sum_squares)
        out["predicted_peak_max_per_segment"] = float(seg.max())
    elif packed and segment_lengths is not None and len(peak):
        out["predicted_peak_max_per_segment"] = float(segment_peaks(coef, batch, seqlen, segment_lengths,
                                                                    offsets).max())
    return out


def over_limit(memory: dict, batch, seqlen, packed: bool) -> tuple[int, float]:
    """``(microbatches predicted above the limit, the largest predicted peak)`` of a :func:`memory_limit`."""
    peak = predicted_peaks(coefficients(memory["profile"]), batch, seqlen, packed)
    return int(np.count_nonzero(peak > int(memory["max_memory"]))), float(peak.max()) if len(peak) else 0.0


def memory_check(batch, seqlen, budget, max_memory, profile_path: str | None):
    """``(ok, detail)``: does every microbatch's predicted peak stay <= ``max_memory``? Each of the
    two defaults to what the plan's budget recorded (a plan made with ``--max-memory``:
    :attr:`varlen_cli.budget.Budget.memory`, read by :func:`varlen_cli.format.plan_budget`)."""
    recorded = budget.memory or {}
    if max_memory is None and "max_memory" not in recorded:
        raise UsageError("--memory-profile needs --max-memory (the plan records no memory limit)")
    if profile_path is None and not recorded.get("profile"):
        raise UsageError("--max-memory needs --memory-profile (the plan records no memory profile)")
    limit = parse_size(max_memory) if max_memory is not None else int(recorded["max_memory"])
    coef = coefficients(load_profile(profile_path) if profile_path is not None else recorded["profile"])
    peak = predicted_peaks(coef, batch, seqlen, budget.packed)
    over = peak > limit
    worst = float(peak.max()) if len(peak) else 0.0
    if over.any():
        rows = ", ".join(str(int(i)) for i in np.flatnonzero(over)[:5])
        return False, (f"{int(over.sum())} microbatches predicted above {format_size(limit)} (largest "
                       f"{format_size(worst)}; e.g. rows {rows})")
    return True, f"predicted peak <= {format_size(worst)} <= {format_size(limit)} in every microbatch"


def memory_rows(memory: dict, shapes: list) -> list[tuple[str, str]]:
    """Summary rows of a plan made with ``--max-memory`` (its budget's ``memory`` entry and its
    ``shapes``): the limit, the profile's fit, and the predicted peak of the plan and of each shape
    (``B x T``; ``*`` where B varies); a warning when the margin is below :func:`fit_shortfall`."""
    mem = memory
    profile = mem.get("profile") or {}
    rows = [("max memory (margin)", f"{format_size(mem['max_memory'])} ({100 * mem['margin']:g}%)"),
            ("predicted peak max", f"{format_size(mem['predicted_peak_max'])} "
             f"({100 * mem['predicted_peak_max'] / mem['max_memory']:.1f}% of max memory)")]
    fit = profile.get("fit") or {}
    reach = calibrated_range(profile)
    if fit.get("method") == "envelope" and "allowance" in fit:
        reached = f", measured up to {format_size(reach)}" if reach else ""
        rows.append(("profile fit", f"envelope of the measured peaks, c0 including {format_size(fit['allowance'])} "
                                    f"for held-out shapes{reached}"))
    under = fit_shortfall(profile)
    if under is not None and under > mem["margin"]:
        rows.append(("warning", f"the profile's fit is up to {100 * under:.1f}% below the peaks it was fitted to "
                                f"(> the {100 * mem['margin']:g}% margin); "
                                f"consider --memory-margin {under + 0.01:.2f}"))
    for (b, t), peak in list(zip(shapes, mem["predicted_peak_per_shape"]))[:16]:
        rows.append((f"  predicted peak {b or '*'}x{t}", format_size(peak)))
    if len(shapes) > 16:
        rows.append(("  ...", f"{len(shapes) - 16} more shapes (varlen inspect --json)"))
    return rows
