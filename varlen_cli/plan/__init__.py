"""``varlen plan``: a Parquet batch plan from a metrics or sorted directory.

Single process and vectorised (numpy): the whole length column is read once, microbatches are
formed under the budget by a *former* (greedy consecutive for curriculum/reverse/bucket-shuffle,
fixed-size for the random baseline, shape-grouped for ``--same-shape-per-step``, packed rows for
``--packing``), then one shared back end lays them out as steps x ranks x micro (tail split,
compile warm-up, cost balancing across ranks), computes LR scales and statistics, and writes the
plan atomically. See ``docs/plan.md`` and ``docs/formats.md``.

    from varlen_cli.plan import PlanConfig, plan
    result = plan(PlanConfig(input="sorted", output="plan.parquet", max_tokens=16384, dp=8))
"""

from __future__ import annotations

from .core import ORDERS, TAILS, PlanConfig, PlanResult, check, plan

__all__ = ["ORDERS", "TAILS", "PlanConfig", "PlanResult", "check", "plan"]
