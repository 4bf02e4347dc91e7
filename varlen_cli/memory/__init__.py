"""Memory-aware budgets: ``varlen calibrate`` writes a memory profile ``peak(B, T) = c0 + c1*B*T +
c2*B*T^2`` (the peak of a fresh training process, measured per shape, or computed from a Hugging Face
config), ``varlen plan --memory-profile P --max-memory 70GiB`` turns it into the planner's budget,
and ``varlen calibrate --verify PLAN`` runs the plan's largest microbatches. See docs/memory.md.

torch is imported only by :mod:`varlen_cli.memory.measure` (measuring), never by this package's
import.
"""

from __future__ import annotations

from .budget import budget_from_profile, memory_check, plan_config_for_memory, predicted_peaks
from .calibrate import CalibrateConfig, calibrate, parse_shapes
from .fit import fit_envelope, fit_nnls, fit_points, predict
from .profile import PROFILE_FORMAT, check_profile, coefficients, load_profile
from .sizes import format_size, parse_size
from .verify import VerifyResult, verify_plan

__all__ = [
    "PROFILE_FORMAT", "CalibrateConfig", "VerifyResult", "budget_from_profile", "calibrate", "check_profile",
    "coefficients", "fit_envelope", "fit_nnls", "fit_points", "format_size", "load_profile", "memory_check",
    "parse_shapes", "parse_size", "plan_config_for_memory", "predict", "predicted_peaks", "verify_plan",
]
