"""Schedule-aware microbatch order (``varlen plan --schedule S --stages K``).

Within each step the planner's microbatches may be laid out in any order over the ``dp x
grad_accum`` slots (rank = slot // grad_accum, micro = slot % grad_accum): every rank still gets
``grad_accum`` microbatches and the step keeps its samples, tokens and LR scale. For pipelines the
rank is the data-parallel group, and the microbatches pass through the stages in ``micro`` order.

A few candidate orders are simulated for every step at once (:func:`simulate_scheme`, vectorised
over steps) and each step keeps the candidate with the smallest simulated makespan, then the
smallest peak activation; plan order wins ties, so the simulated total never gets worse:

* ``plan``: the planner's order;
* ``ascending`` / ``descending``: each rank's microbatches by cost;
* ``zigzag``: each rank's microbatches largest, smallest, 2nd largest, 2nd smallest, ... (spreads the
  large activations of 1F1B's in-flight window);
* ``snake``: the step's microbatches by decreasing cost dealt to the ranks 0..dp-1, dp-1..0, ...
  (balances the ranks), each rank's in decreasing order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schemes import make_scheme
from .simulate import PlanCosts, simulate_scheme

CANDIDATES = ("plan", "ascending", "descending", "zigzag", "snake")


def candidate_orders(cost: np.ndarray, dp: int, grad_accum: int) -> dict:
    """Each candidate as ``(steps, N)`` permutations: new slot ``p`` holds old slot ``perm[:, p]``."""
    steps, n = cost.shape
    blocks = cost.reshape(steps, dp, grad_accum)
    base = (np.arange(dp) * grad_accum)[None, :, None]
    ascending = np.argsort(blocks, axis=2, kind="stable")
    descending = np.argsort(-blocks, axis=2, kind="stable")
    half = np.arange(grad_accum)
    zig = np.where(half % 2 == 0, half // 2, grad_accum - 1 - half // 2)
    by_cost = np.argsort(-cost, axis=1, kind="stable")
    k = np.arange(n)
    lap, pos = np.divmod(k, dp)
    rank = np.where(lap % 2 == 0, pos, dp - 1 - pos)
    snake = np.empty_like(by_cost)
    snake[:, rank * grad_accum + lap] = by_cost
    return {
        "plan": np.broadcast_to(np.arange(n), (steps, n)),
        "ascending": (ascending + base).reshape(steps, n),
        "descending": (descending + base).reshape(steps, n),
        "zigzag": (descending[:, :, zig] + base).reshape(steps, n),
        "snake": snake,
    }


@dataclass(frozen=True)
class OrderResult:
    perm: np.ndarray  # (steps, N): new slot p of step k holds old slot perm[k, p]
    choice: np.ndarray  # (steps,) index into CANDIDATES
    makespan_plan_order: float
    makespan: float
    peak_activation_plan_order: float
    peak_activation: float

    def report(self) -> dict:
        counts = np.bincount(self.choice, minlength=len(CANDIDATES))
        return {"makespan_plan_order": self.makespan_plan_order, "makespan": self.makespan,
                "gain": 1.0 - self.makespan / self.makespan_plan_order if self.makespan_plan_order else 0.0,
                "peak_activation_plan_order": self.peak_activation_plan_order,
                "peak_activation": self.peak_activation,
                "steps_by_order": {name: int(c) for name, c in zip(CANDIDATES, counts)}}


def schedule_order(cost: np.ndarray, tokens: np.ndarray, *, dp: int, grad_accum: int, schedule: str, stages: int,
                   backward_ratio: float = 2.0, keep_steps: int = 0) -> OrderResult:
    """The best candidate order of every step of ``cost``/``tokens`` ``(steps, dp * grad_accum)`` under
    ``schedule``; the first ``keep_steps`` steps (a compile warm-up) keep plan order."""
    steps, n = cost.shape
    scheme = make_scheme(schedule, stages=stages, microbatches=n, dp=dp)
    best = None
    for index, (_name, perm) in enumerate(candidate_orders(cost, dp, grad_accum).items()):
        if index and keep_steps:
            perm = perm.copy()
            perm[:keep_steps] = np.arange(n)
        costs = PlanCosts(path="", dp=dp, grad_accum=grad_accum, cost=np.take_along_axis(cost, perm, axis=1),
                          tokens=np.take_along_axis(tokens, perm, axis=1))
        res = simulate_scheme(scheme, costs, backward_ratio)
        if best is None:
            best = [res.steps.copy(), res.step_peak.copy(), np.array(perm), np.zeros(steps, np.int64)]
            plan_makespan, plan_peak = res.makespan, float(res.step_peak.max(initial=0.0))
            continue
        better = (res.steps < best[0]) | ((res.steps == best[0]) & (res.step_peak < best[1]))
        best[0] = np.where(better, res.steps, best[0])
        best[1] = np.where(better, res.step_peak, best[1])
        best[2][better] = perm[better]
        best[3][better] = index
    return OrderResult(perm=best[2], choice=best[3], makespan_plan_order=plan_makespan,
                       makespan=float(best[0].sum()), peak_activation_plan_order=plan_peak,
                       peak_activation=float(best[1].max(initial=0.0)))


def reorder_layout(lay, cost: np.ndarray, tokens: np.ndarray, *, dp: int, grad_accum: int, schedule: str,
                   stages: int) -> tuple:
    """A planner layout (``varlen_cli.plan.layout.EpochLayout``) with each step's rows reordered for
    ``schedule``; ``cost`` and ``tokens`` are per microbatch in the planner's (pre-layout) order.
    Returns ``(layout, OrderResult)``."""
    import dataclasses

    slots = dp * grad_accum
    order = lay.order.reshape(-1, slots)
    result = schedule_order(cost[order], tokens[order], dp=dp, grad_accum=grad_accum, schedule=schedule,
                            stages=stages, keep_steps=lay.warmup_steps)
    new_order = np.take_along_axis(order, result.perm, axis=1).reshape(-1)
    return dataclasses.replace(lay, order=new_order), result


def combined_report(schedule: str, stages: int, results) -> dict:
    """The plan metadata's ``schedule`` entry: the simulated gain over all epochs."""
    before = sum(r.makespan_plan_order for r in results)
    after = sum(r.makespan for r in results)
    counts = np.sum([np.bincount(r.choice, minlength=len(CANDIDATES)) for r in results], axis=0)
    return {"name": schedule, "stages": stages, "backward_ratio": 2.0, "makespan_plan_order": before,
            "makespan": after, "gain": 1.0 - after / before if before else 0.0,
            "peak_activation_plan_order": max(r.peak_activation_plan_order for r in results),
            "peak_activation": max(r.peak_activation for r in results),
            "steps_by_order": {name: int(c) for name, c in zip(CANDIDATES, counts)}}
