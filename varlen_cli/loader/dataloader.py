"""``PlanDataLoader``: a DataLoader that frameworks understand, with exact consumed-position state.

* ``set_epoch(epoch)`` reaches the plan's batch sampler (as do ``batch_sampler.set_epoch`` and
  ``batch_sampler.sampler.set_epoch``, which Lightning and accelerate call);
* ``state_dict()`` / ``load_state_dict()`` hold the position right after the last batch the
  loader *handed out* (not the sampler's read-ahead position, so it is exact with worker
  processes and prefetching), plus the plan fingerprint;
* every batch handed out is checked by the loader's :class:`~varlen_cli.loader.guard.ConsumptionGuard`
  (plan order for this rank), which ``VariableBatchSizeLR.step()`` consults;
* ``all_epochs=True`` makes one iteration run every remaining epoch of the plan (for trainers,
  such as Hugging Face's, that assume equal epochs).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from .guard import ConsumptionGuard, register
from .sampler import PlanBatchSampler, _Position


class _PlanLoaderMixin:
    """What :class:`PlanDataLoader` and :class:`PlanStatefulDataLoader` add to their DataLoader base."""

    batch_sampler: PlanBatchSampler
    _defer_start = False  # torchdata restores its state inside __iter__: accept any start there

    def _plan_setup(self, all_epochs: bool) -> None:
        sampler = self.batch_sampler
        self.plan = sampler.plan
        self.all_epochs = bool(all_epochs)
        self.full_epoch_len = False  # len() = the whole epoch even after a mid-epoch resume (Lightning's count)
        self.consumed_by_trainer = False  # True: the trainer calls mark_consumed (it fetches ahead of training)
        self.guard = ConsumptionGuard(sampler.plan, sampler.rank)
        register(self.guard)
        self._last: tuple | None = None  # (epoch, step, rank, micro) of the last batch handed out

    # -- epochs --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the plan epoch the next iteration yields (ignored with ``all_epochs``)."""
        if not self.all_epochs:
            self.batch_sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.batch_sampler.epoch

    def __len__(self) -> int:
        """Microbatches of the next iteration; with ``all_epochs``, of the whole plan (constant, as
        Trainer-style loops that count steps per epoch expect, whatever the resume position)."""
        if self.all_epochs:
            return self.plan.num_steps * self.plan.grad_accum
        if self.full_epoch_len:
            return self.plan.steps_per_epoch[self.batch_sampler.epoch] * self.plan.grad_accum
        return len(self.batch_sampler)

    def mark_consumed(self, batch: Any) -> None:
        """Report ``batch`` as trained, at the point where the model gets it (after any wrapper or
        read-ahead). Set ``consumed_by_trainer = True`` before iterating: the guard then checks the
        reported batches (so a wrapper that drops or reorders microbatches fails on the first one out
        of place) and ``state_dict()`` is the position after the last batch reported."""
        if not self.consumed_by_trainer:
            raise RuntimeError("set loader.consumed_by_trainer = True before iterating to report consumed batches")
        self._last = self.guard.consume(batch)

    def _start_position(self) -> tuple | None:
        sampler = self.batch_sampler
        step, micro, stop = sampler.bounds()
        if step >= stop:
            return None
        return (sampler.epoch, step, sampler.rank, micro)

    def __iter__(self):
        epochs = range(self.batch_sampler.epoch, self.plan.epochs) if self.all_epochs else [None]
        return self._iterate(epochs)

    def _iterate(self, epochs):
        base_iter = super().__iter__
        for i, epoch in enumerate(epochs):
            if epoch is not None and i > 0:
                self.batch_sampler.set_epoch(epoch)
            self.guard.restart(None if self._defer_start else self._start_position())
            for batch in base_iter():
                if not self.consumed_by_trainer:
                    self._last = self.guard.consume(batch)
                yield batch

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position after the last batch this loader handed out (exact with workers/prefetching)."""
        sampler = self.batch_sampler
        if self._last is not None:
            state = sampler.state_dict(after=_Position(*[self._last[i] for i in (0, 1, 2, 3)]))
        else:
            step, micro, _ = sampler.bounds()
            state = {"plan": self.plan.fingerprint, "epoch": sampler.epoch, "step": int(step), "micro": int(micro),
                     "dp": self.plan.dp}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position (seeks; refuses a state from another plan)."""
        self.batch_sampler.load_state_dict(state)
        self._last = None
        self.guard.pending = []
        self.guard.restart(None)


class PlanDataLoader(_PlanLoaderMixin, DataLoader):
    """A ``torch.utils.data.DataLoader`` over a plan (made by :func:`~varlen_cli.loader.dataloader_for_plan`)."""

    def __init__(self, dataset, batch_sampler: PlanBatchSampler, *, all_epochs: bool = False, **kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._plan_setup(all_epochs)


def stateful_loader_class():
    """``PlanStatefulDataLoader``: the same over torchdata's ``StatefulDataLoader`` (imported lazily).

    Its ``state_dict``/``load_state_dict`` are torchdata's own (exact with workers); the rest as
    :class:`PlanDataLoader`.
    """
    global _STATEFUL
    if _STATEFUL is None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        class PlanStatefulDataLoader(_PlanLoaderMixin, StatefulDataLoader):
            _defer_start = True
            state_dict = StatefulDataLoader.state_dict
            load_state_dict = StatefulDataLoader.load_state_dict

            def __init__(self, dataset, batch_sampler: PlanBatchSampler, *, all_epochs: bool = False, **kwargs):
                super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
                self._plan_setup(all_epochs)

        _STATEFUL = PlanStatefulDataLoader
    return _STATEFUL


_STATEFUL = None
