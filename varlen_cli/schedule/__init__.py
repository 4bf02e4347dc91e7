"""``varlen_cli.schedule``: simulate parallel training schedules over a plan (numpy + pyarrow, no torch).

Every scheme is the seed's pair of functions ``compute(stage, batch, direction) -> worker`` and
``store(stage) -> worker(s)`` plus a priority rule; a greedy master scheduler runs each optimizer
step's jobs, and latency, bubble, peak activations and transfers follow. See docs/schedules.md.
"""

from __future__ import annotations

from .engine import Jobs, build_jobs, greedy
from .schemes import BACKWARD, FORWARD, SCHEDULES, Scheme, backward_first, breadth_first, depth_first, make_scheme
from .simulate import (
                      PlanCosts,
                      ScheduleResult,
                      SimulateConfig,
                      SimulateResult,
                      read_plan_costs,
                      simulate,
                      simulate_scheme,
)

__all__ = [
    "BACKWARD", "FORWARD", "Jobs", "PlanCosts", "SCHEDULES", "ScheduleResult", "Scheme", "SimulateConfig",
    "SimulateResult", "backward_first", "breadth_first", "build_jobs", "depth_first", "greedy", "make_scheme",
    "read_plan_costs", "simulate", "simulate_scheme",
]
