"""Memory-aware budgets: ``varlen calibrate`` writes a memory profile ``peak(B, T) = c0 + c1*B*T +
c2*B*T^2`` (measured per shape, or computed from a Hugging Face config), and ``varlen plan
--memory-profile P --max-memory 70GiB`` turns it into the planner's budget. See docs/memory.md.

torch is imported only by :mod:`varlen_cli.memory.measure` (measuring), never by this package's
import.
"""

from __future__ import annotations

from .budget import budget_for_memory, budget_from_profile, memory_check, memory_limit, predicted_peaks
from .calibrate import CalibrateConfig, calibrate, parse_shapes
from .fit import fit_nnls, fit_points, predict
from .profile import PROFILE_FORMAT, check_profile, coefficients, load_profile
from .sizes import format_size, parse_size

__all__ = [
    "PROFILE_FORMAT", "CalibrateConfig", "budget_from_profile", "calibrate", "check_profile", "coefficients",
    "memory_check", "fit_nnls", "fit_points", "format_size", "load_profile", "parse_shapes", "parse_size",
    "budget_for_memory", "memory_limit", "predict", "predicted_peaks",
]
