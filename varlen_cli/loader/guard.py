"""The desync guard: what a trainer consumes from one rank's loader is checked against the plan.

Four checks, each raising a one-line :class:`PlanError` before the wrong microbatch is trained:

* fetch order (:mod:`varlen_cli.loader.fetch`, run by :class:`~varlen_cli.loader.collate.PlanDataset`):
  the microbatches a DataLoader fetches must be its sampler's, in order (a wrapper that re-shards
  the batch sampler, ``accelerator.prepare(loader)``, fails on its first out-of-place microbatch);
* consumption order and the ledger (:meth:`ConsumptionGuard.consume`, fed by the loader or by
  ``loader.mark_consumed(batch)``): this rank's microbatches in plan order, none trained twice in a
  job (resumes included), none skipped, no epoch started while an earlier one is incomplete
  (:mod:`varlen_cli.loader.ledger`);
* the LR pace: the data may run at most one step ahead of the plan's ``VariableBatchSizeLR``
  (prefetching), never behind it;
* LR coverage (:func:`_before_optimizer_step`, a global ``torch.optim`` step pre-hook): a plan whose
  ``lr_scale`` is not all 1 needs a ``VariableBatchSizeLR``, checked at the first optimizer step taken
  on its microbatches, before that step runs (``lr_scale="ignore"`` opts out). Iterating a loader
  without an optimizer step (a notebook, a benchmark) is never refused for it;
* step membership (:meth:`ConsumptionGuard.check_step`, run by ``VariableBatchSizeLR.step()``): the
  update being applied is that of the step whose micros ``0..grad_accum-1`` were consumed, and no
  step lies past the plan's end.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np

from .ledger import LOOP_HINT, Ledger
from .plan_file import Plan, PlanError
from .position import batch_position, describe

LR_SCALE_CHOICES = ("check", "ignore")


def position_after(plan: Plan, pos) -> tuple[int, int, int, int] | None:
    """The position of the microbatch that follows ``pos`` in the same rank's stream (None at the end)."""
    epoch, step, rank, micro = pos
    if micro + 1 < plan.grad_accum:
        return (epoch, step, rank, micro + 1)
    if step + 1 >= plan.num_steps:
        return None
    end = plan.epoch_start(epoch) + plan.steps_per_epoch[epoch]
    return (epoch if step + 1 < end else epoch + 1, step + 1, rank, 0)


def _under_transformers_trainer() -> bool:
    """True when a ``transformers.Trainer`` method is on the call stack (the plain-Trainer setup)."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), trainer_module.Trainer):
            return True
        frame = frame.f_back
    return False


class ConsumptionGuard:
    """Checks the microbatches a trainer consumes from one rank's loader against the plan.

    :meth:`consume` is called for every batch the loader hands out (or the trainer reports) in
    order; :meth:`check_step` when an optimizer step's LR is advanced. A new iteration of the loader
    calls :meth:`restart` with the position it starts at; a restored state calls :meth:`resumed`.
    ``lr_scale="ignore"`` trains a plan whose ``lr_scale`` is not all 1 without ``VariableBatchSizeLR``.
    """

    def __init__(self, plan: Plan, rank: int, ledger: Ledger | None = None, *, lr_scale: str = "check"):
        if lr_scale not in LR_SCALE_CHOICES:
            raise ValueError(f"lr_scale must be one of {', '.join(LR_SCALE_CHOICES)}, not {lr_scale!r}")
        self.plan = plan
        self.rank = int(rank)
        self.ledger = ledger if ledger is not None else Ledger(plan, rank)
        self.lr_scale = lr_scale
        self.expected: tuple[int, int, int, int] | None = None
        self.last: tuple[int, int, int, int] | None = None  # the last position consumed in this job
        self.pending: list[tuple[int, int, int, int]] = []  # consumed, update not applied yet
        self.applied: int | None = None  # the last step VariableBatchSizeLR.step() checked
        self.stepped_after: tuple | None = None  # the last position consumed before the latest optimizer step
        self.iterating = 0  # iterations of the loader in progress (a loop that finished or broke off is none)
        self.enabled = True
        self._lr: weakref.ReferenceType | None = None
        self._needs_lr: bool | None = None
        _install_optimizer_hook()

    # -- iterations and resumes -----------------------------------------------------------------
    def restart(self, position: tuple[int, int, int, int] | None) -> None:
        self.expected = position

    def resumed(self) -> None:
        """A state was loaded: what this process consumed before belongs to no step of the new position."""
        self.last, self.expected, self.pending, self.stepped_after = None, None, [], None

    # -- consuming ------------------------------------------------------------------------------
    def consume(self, batch: Any) -> tuple[int, int, int, int]:
        pos = batch_position(batch)
        if self.enabled:
            self._check_order(pos)
            self.ledger.record(pos[0], pos[1], pos[3])
            self._check_pace(pos)
        self.last = pos
        self.expected = position_after(self.plan, pos)
        self.pending.append(pos)
        _FEEDING.add(self)
        return pos

    def _check_order(self, pos) -> None:
        if pos[2] != self.rank:
            raise PlanError(f"desync: rank {self.rank} consumed the microbatch of rank {pos[2]} at {describe(pos)}: "
                            f"the loader was re-sharded or built for another rank")
        if self.expected is not None and pos != self.expected:
            raise PlanError(f"desync: the trainer consumed the microbatch at {describe(pos)} where the plan's next one "
                            f"is {describe(self.expected)}: a wrapper dropped or reordered microbatches")

    def _check_pace(self, pos) -> None:
        """The data may lead the plan's VariableBatchSizeLR by one step (read-ahead), never lag it."""
        epoch, step, _, micro = pos
        lr = self.lr()
        if lr is None:
            return  # without one, LR coverage is checked at the optimizer step (_before_optimizer_step)
        s = lr.step_index
        ahead_ok = step == s + 1 and micro == 0 and self.last is not None and self.last[1] == s \
            and self.last[3] == self.plan.grad_accum - 1
        if step > s and not ahead_ok and self._ended_before(s, pos):
            lr.skip_to(step)  # the rest of an epoch ended on purpose (loader.end_epoch()) is never trained
            self.pending = []
            return  # (with check=False too: it turns the checks off, not the plan's LR scale)
        if not lr.check:
            return
        if step < s:
            raise PlanError(f"desync: the microbatch at {describe(pos)} is consumed but VariableBatchSizeLR is already "
                            f"at optimizer step {s}: the scheduler was stepped more often than the optimizer, or the "
                            f"loader's and the scheduler's states come from different checkpoints")
        if step > s and not ahead_ok:
            if self.last is None:
                raise PlanError(f"desync: the loader resumes at {describe(pos)} but VariableBatchSizeLR at optimizer "
                                f"step {s}: the loader's and the scheduler's states were saved at different points "
                                f"(save both after scheduler.step())")
            raise PlanError(self._unfinished_step_message(pos, s))
        if micro > 0 and self.last != (epoch, step, self.rank, micro - 1):
            raise PlanError(f"desync: the microbatch at {describe(pos)} is the first of optimizer step {step} this "
                            f"job trains, but micros 0..{micro - 1} of that step were consumed before its checkpoint "
                            f"and their gradient is lost: the loader's state was saved in the middle of a step (a "
                            f"framework that reads ahead, such as Lightning, saves it early: use PlanDataModule, or "
                            f"report trained batches with loader.mark_consumed(batch))")

    def _ended_before(self, s: int, pos) -> bool:
        """Whether the data moved from optimizer step ``s`` to ``pos``, an epoch's first microbatch, over
        the rest of epochs ended on purpose (``loader.end_epoch()``): every epoch from ``s``'s to the one
        before ``pos``'s was ended early."""
        epoch, step, _, micro = pos
        if micro != 0 or not 0 <= s < self.plan.num_steps or step != self.plan.epoch_start(epoch):
            return False
        return all(e in self.ledger.ended for e in range(self.plan.epoch_of(s), epoch))

    def _unfinished_step_message(self, pos, s: int) -> str:
        """The data moved past optimizer step ``s`` that VariableBatchSizeLR never finished: name what
        happened after the step's last microbatch (the optimizer stepped without the scheduler, or
        nothing stepped: that microbatch was skipped by the loop)."""
        end = (self.plan.epoch_of(s), s, self.rank, self.plan.grad_accum - 1) if s < self.plan.num_steps else None
        if end is None or self.ledger.index(pos[1], pos[3]) <= self.ledger.index(s, end[3]):
            return (f"desync: the microbatch at {describe(pos)} is consumed but VariableBatchSizeLR is at optimizer "
                    f"step {s}: call VariableBatchSizeLR.step() once per optimizer step")
        if self.stepped_after in (end, position_after(self.plan, end)):  # (a trainer that reads one ahead)
            return (f"desync: the loader hands out {describe(pos)} but VariableBatchSizeLR is still at optimizer step "
                    f"{s}: optimizer.step() ran after {describe(end)}, the step's last microbatch, but "
                    f"VariableBatchSizeLR.step() did not (call it right after every optimizer.step(), in place of "
                    f"the base scheduler's)")
        return (f"desync: the loader hands out {describe(pos)} but optimizer step {s} was never taken: nothing "
                f"stepped after {describe(end)}, the step's last microbatch (was that microbatch skipped, e.g. by a "
                f"`continue` before the optimizer step? train every microbatch the loader hands out and end each "
                f"step with optimizer.step() and VariableBatchSizeLR.step())")

    def before_optimizer_step(self) -> None:
        """An optimizer step is about to run on what this loader handed out: refuse it when the plan's
        ``lr_scale`` is not all 1 and no VariableBatchSizeLR of the plan applies it."""
        self.stepped_after = self.last
        if not self.iterating or not self.enabled or self.lr_scale == "ignore" or not self.needs_lr \
                or self.lr() is not None:
            return  # (a loader looked at and left is not what the optimizer trains on)
        scales = self.plan.lr_scales()
        where = (" Under transformers.Trainer use varlen_cli.integrations.hf.PlanTrainer (it also fixes the label "
                 "shift and the loss normalisation)." if _under_transformers_trainer() else "")
        at = f" after {describe(self.last)}" if self.last is not None else ""
        raise PlanError(f"the plan's lr_scale ({float(scales.min()):.3g} to {float(scales.max()):.3g}) is not "
                        f"applied: an optimizer step is about to run{at} on rank {self.rank} with no "
                        f"VariableBatchSizeLR of this plan (wrap the LR scheduler in VariableBatchSizeLR(scheduler, "
                        f"plan) and call its step() once per optimizer step, or pass lr_scale='ignore' to "
                        f"dataloader_for_plan to train without it).{where}")

    @property
    def needs_lr(self) -> bool:
        if self._needs_lr is None:
            self._needs_lr = bool(np.any(self.plan.lr_scales() != 1.0))
        return self._needs_lr

    # -- the optimizer step ---------------------------------------------------------------------
    def check_step(self, step: int, strict: bool = True) -> None:
        """The update of global ``step`` is being applied: its micros must be exactly what was consumed
        (a read-ahead of the next step stays pending)."""
        got = [p for p in self.pending if p[1] <= step]
        self.pending = [p for p in self.pending if p[1] > step]
        previous, self.applied = self.applied, step
        if not self.enabled or not strict:
            return
        if step >= self.plan.num_steps:
            raise PlanError(f"desync: optimizer step {step} is past the plan's end ({self.plan.num_steps} steps, "
                            f"{self.plan.epochs} epoch(s)): the trainer runs longer than the plan (re-plan with more "
                            f"--epochs, or `varlen plan --extend PLAN --epochs N`)")
        epoch = self.plan.epoch_of(step) if step >= 0 else 0
        want = [(epoch, step, self.rank, m) for m in range(self.plan.grad_accum)]
        if got == want:
            return
        if not got and previous == step - 1:
            raise PlanError(f"desync: VariableBatchSizeLR.step() is called for optimizer step {step} but none of that "
                            f"step's microbatches was consumed: the scheduler is stepped more than once per optimizer "
                            f"step (do not accelerator.prepare() it, and step it in one place only)")
        if not got:
            raise PlanError(f"desync: optimizer step {step} is applied but no microbatch was consumed from the plan's "
                            f"loader since the last step: the batches come from another loader (with accelerate use "
                            f"varlen_cli.integrations.accelerate.prepare_plan_dataloader, not prepare(loader))")
        have = ", ".join(describe(p) for p in got[:3]) + (", ..." if len(got) > 3 else "")
        raise PlanError(f"desync: optimizer step {step} (epoch {epoch}) needs micros 0..{self.plan.grad_accum - 1} of "
                        f"rank {self.rank} but the trainer consumed {len(got)} microbatch(es): {have} (gradient "
                        f"accumulation must be the plan's {self.plan.grad_accum}; {LOOP_HINT})")

    # -- the plan's LR scheduler ----------------------------------------------------------------
    def lr(self):
        """The ``VariableBatchSizeLR`` bound to this guard (None when none is)."""
        lr = self._lr() if self._lr is not None else None
        if lr is None:
            lr = _unclaimed_lr(self.plan, self.ledger.continued)
            if lr is not None:
                bind(lr, self)
        return lr

    def state_dict(self) -> dict:
        return {"last": list(self.last) if self.last is not None else None}


# -- the optimizer step ---------------------------------------------------------------------------------
# Guards that handed out a batch since the last optimizer step in this process: the next optimizer
# step (any torch.optim optimizer, through torch's global step pre-hook, installed with the first guard)
# is taken on their microbatches when their loader's iteration is still in progress.
_FEEDING: weakref.WeakSet = weakref.WeakSet()
_HOOK: Any = None


def _install_optimizer_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    """torch's global optimizer step pre-hook: the guards that fed this step check it before it runs."""
    guards = list(_FEEDING)
    _FEEDING.clear()
    for guard in guards:
        guard.before_optimizer_step()


# -- linking loaders and LR schedulers of one plan in one process -------------------------------------
# A VariableBatchSizeLR checks the guard it is bound to: explicitly (guard=loader, the integrations),
# else the first loader of its plan to consume a batch while the scheduler is unbound and has not
# stepped (made before or after the loader, both orders), else at its first step() the plan's latest
# loader that consumed; a loader that continues the previous loader's ledger (one loader per epoch)
# takes over its scheduler. Loaders and schedulers left over from earlier runs in the process (kept
# alive by a traceback) are never bound: they consumed nothing, or stepped.
_GUARDS: dict[str, weakref.ReferenceType[ConsumptionGuard]] = {}
_LRS: dict[str, weakref.ReferenceType] = {}


def bind(lr, guard: ConsumptionGuard) -> None:
    """Make ``lr`` check ``guard`` (and ``guard`` pace its consumption against ``lr``)."""
    lr._guard = guard
    guard._lr = weakref.ref(lr)


def register(guard: ConsumptionGuard) -> None:
    """Make ``guard`` the plan's latest loader in this process."""
    _GUARDS[guard.plan.fingerprint] = weakref.ref(guard)


def lookup(plan: Plan) -> ConsumptionGuard | None:
    ref = _GUARDS.get(plan.fingerprint)
    return ref() if ref is not None else None


def register_lr(lr, guard: ConsumptionGuard | None = None) -> None:
    """A new VariableBatchSizeLR of ``lr.plan``: bound to ``guard`` when given, else to the plan's
    loader that next consumes a batch (or that it checks first)."""
    if guard is not None:
        bind(lr, guard)
    _LRS[lr.plan.fingerprint] = weakref.ref(lr)


def _unclaimed_lr(plan: Plan, continued: Ledger | None):
    """The plan's latest VariableBatchSizeLR if no guard has it and it never stepped, or if it checks
    the loader whose ledger this guard's continues (a framework that makes a loader per epoch)."""
    ref = _LRS.get(plan.fingerprint)
    lr = ref() if ref is not None else None
    if lr is None:
        return None
    if lr._guard is None and not lr.steps_taken:
        return lr
    if continued is not None and lr._guard is not None and lr._guard.ledger is continued:
        return lr
    return None
