"""``VariableBatchSizeLR``: the plan's per-step ``lr_scale`` on top of any LR schedule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .guard import bind, lookup, register_lr
from .plan_file import Plan, PlanError
from .replan import first_step, lineage, lr_state_from_parent


class VariableBatchSizeLR(torch.optim.lr_scheduler.LRScheduler):
    """Multiply the learning rate of a base schedule (or a bare optimizer) by the plan's ``lr_scale``.

    Each :meth:`step` restores the unscaled LRs into the optimizer, steps the base scheduler (so
    warm-up, cosine and chainable schedulers see their own values), then applies the scale of the
    new global step. Create it *after* the base scheduler, and call ``step()`` once per optimizer
    step, in place of the base scheduler's ``step()``. Steps beyond the plan use a scale of 1.

    ``state_dict()`` holds the global step, the unscaled LRs and the base scheduler's state; load
    it after the optimizer's state (it rewrites the param groups' ``lr``).

    A real ``torch.optim.lr_scheduler.LRScheduler`` (Lightning and Trainer accept it; ``last_epoch``
    is the global step). Desync guard: with a :class:`Plan`, each ``step()`` checks that the
    microbatches consumed from the plan's loader since the last step are exactly micros
    ``0..grad_accum-1`` of the step being applied, and raises :class:`PlanError` otherwise
    (``guard``: the loader's guard, default: the latest loader of the same plan in this process;
    ``check=False`` turns it off).
    """

    def __init__(self, scheduler_or_optimizer: Any, plan: Plan | Sequence[float] | np.ndarray,
                 start_step: int = 0, *, guard: Any = None, check: bool = True):
        if hasattr(scheduler_or_optimizer, "param_groups"):
            self.optimizer, self.scheduler = scheduler_or_optimizer, None
        elif hasattr(scheduler_or_optimizer, "optimizer") and hasattr(scheduler_or_optimizer, "step"):
            self.optimizer, self.scheduler = scheduler_or_optimizer.optimizer, scheduler_or_optimizer
        else:
            raise TypeError("VariableBatchSizeLR wraps a torch optimizer or an LR scheduler")
        scales = plan.lr_scales() if isinstance(plan, Plan) else plan
        self.scales = np.asarray(scales, dtype=np.float64)
        self.plan = plan if isinstance(plan, Plan) else None
        self.check = bool(check)
        self._guard = None  # the loader's ConsumptionGuard this scheduler checks (guard.bind)
        self.steps_taken = 0  # step() calls since this scheduler was made
        self.step_index = int(start_step)
        self._unscaled = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.base_lrs = list(self._unscaled)
        self._step_count = 1
        self._apply()
        if self.plan is not None:
            register_lr(self, getattr(guard, "guard", guard))  # a loader or its guard

    @property
    def last_epoch(self) -> int:  # LRScheduler's step counter: the global step
        return self.step_index

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self.step_index = int(value)

    @property
    def global_step(self) -> int:
        """The job's global step: :attr:`step_index` plus the steps before a plan made by ``varlen replan``."""
        return self.step_index + (first_step(self.plan) if self.plan is not None else 0)

    def get_lr(self) -> list[float]:
        return list(self._last_lr)

    def _check_step(self) -> None:
        if self.plan is None:
            return
        guard = self._guard
        if guard is None:
            guard = lookup(self.plan)
            if guard is None or guard.last is None or guard.lr() not in (None, self):
                return  # no loader of this plan has handed out a batch (or it has its own scheduler)
            bind(self, guard)
        guard.check_step(self.step_index, strict=self.check)

    def scale(self, step: int | None = None) -> float:
        """The plan's ``lr_scale`` at ``step`` (default: the current step); 1.0 past the plan's end."""
        step = self.step_index if step is None else step
        return float(self.scales[step]) if 0 <= step < len(self.scales) else 1.0

    def _apply(self) -> None:
        s = self.scale()
        for group, lr in zip(self.optimizer.param_groups, self._unscaled):
            group["lr"] = lr * s
        self._last_lr = [lr * s for lr in self._unscaled]

    def step(self, *args, **kwargs) -> None:
        """Advance one optimizer step: restore, step the base schedule, apply the new step's scale.

        Arguments go to the base scheduler's ``step`` (e.g. the metric of ``ReduceLROnPlateau``).
        Raises :class:`PlanError` when the consumed microbatches are not the step's (see the class).
        """
        self._check_step()
        self.steps_taken += 1
        for group, lr in zip(self.optimizer.param_groups, self._unscaled):
            group["lr"] = lr
        if self.scheduler is not None:
            self.scheduler.step(*args, **kwargs)
        self._unscaled = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.step_index += 1
        self._apply()

    def skip_to(self, step: int) -> None:
        """Move to plan step ``step`` without stepping the base schedule: the steps between were skipped
        on purpose (the rest of an epoch ended with ``loader.end_epoch()``), so they take no optimizer
        step; the LR from now on is the base schedule's x the scale of ``step``."""
        self.step_index = int(step)
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The LRs in use now (scaled)."""
        return list(self._last_lr)

    def get_unscaled_lr(self) -> list[float]:
        """The base schedule's LRs now (before the plan's scale)."""
        return list(self._unscaled)

    def state_dict(self) -> dict:
        state = {"step": self.step_index, "unscaled": list(self._unscaled),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        if self.plan is not None:
            state["plan"] = self.plan.fingerprint
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (what :meth:`state_dict` returned, on this plan or its parent); a
        malformed one is refused with one line (:class:`PlanError`) before anything changes."""
        problem = _state_problem(state, len(self.optimizer.param_groups))
        if problem is not None:
            raise PlanError(f"invalid VariableBatchSizeLR state: {problem}")
        saved_with = state.get("plan")
        if self.plan is not None and saved_with not in (None, self.plan.fingerprint):
            if saved_with != lineage(self.plan).get("parent"):
                raise PlanError("the VariableBatchSizeLR state was saved with another plan; resume with the same plan "
                                "(or one made from it by `varlen replan` / `varlen plan --extend`)")
            saved_at = int(state["step"])
            state = lr_state_from_parent(self.plan, state)  # the step index counts from this plan's step 0
            if int(state["step"]) < 0:
                raise PlanError(f"the VariableBatchSizeLR state is at step {saved_at} of the parent plan, before the "
                                f"step this plan was replanned from ({saved_at - int(state['step'])}): resume from "
                                "the checkpoint the plan was made from")
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step_index = int(state["step"])
        self._unscaled = [float(x) for x in state["unscaled"]]
        if self._guard is not None:
            self._guard.pending = []
        self._apply()


def _state_problem(state: Any, groups: int) -> str | None:
    """What is wrong with the shape of a :meth:`VariableBatchSizeLR.state_dict`, or None: a dict whose
    ``step`` is an integer >= 0 and whose ``unscaled`` holds one finite LR per param group."""
    if not isinstance(state, dict):
        return f"it is a {type(state).__name__}, not a dict (pass what VariableBatchSizeLR.state_dict() returned)"
    step, unscaled = state.get("step"), state.get("unscaled")
    if not isinstance(step, (int, np.integer)) or isinstance(step, (bool, np.bool_)) or step < 0:
        return f"its 'step' is {step!r}, not an integer >= 0"
    if not isinstance(unscaled, (list, tuple)) or len(unscaled) != groups or not all(
            isinstance(x, (int, float, np.number)) and not isinstance(x, (bool, np.bool_)) and np.isfinite(x)
            for x in unscaled):
        shown = repr(unscaled) if len(repr(unscaled)) <= 40 else repr(unscaled)[:37] + "..."
        return f"its 'unscaled' is {shown}, not {groups} finite learning rate(s) (one per param group)"
    return None
