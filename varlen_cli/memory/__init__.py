"""Memory-aware budgets: ``varlen calibrate`` writes a memory profile ``peak(B, T) = c0 + c1*B*T +
c2*B*T^2`` (the peak of a fresh training process, measured per shape, or computed from a Hugging Face
config), ``varlen plan --memory-profile P --max-memory 70GiB`` turns it into the planner's budget,
and ``varlen calibrate --verify PLAN`` runs the plan's largest microbatches. See docs/memory.md.

The names below are imported on first use: the measuring process (:mod:`varlen_cli.memory.child`)
imports this package, and a training process does not import pyarrow for it, so neither may the
measurement (it would count ~40 MB that the user's process does not have). torch is imported only
by :mod:`varlen_cli.memory.measure` (measuring).
"""

from __future__ import annotations

import importlib

_WHERE = {
    "budget_for_memory": "budget", "budget_from_profile": "budget", "memory_check": "budget",
    "memory_limit": "budget", "predicted_peaks": "budget",
    "CalibrateConfig": "calibrate", "calibrate": "calibrate", "parse_shapes": "calibrate",
    "fit_envelope": "fit", "fit_nnls": "fit", "fit_points": "fit", "predict": "fit",
    "PROFILE_FORMAT": "profile", "check_profile": "profile", "coefficients": "profile", "load_profile": "profile",
    "format_size": "sizes", "parse_size": "sizes",
    "VerifyResult": "verify", "verify_plan": "verify",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
