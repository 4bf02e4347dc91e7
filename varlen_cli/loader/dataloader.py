"""``PlanDataLoader``: a DataLoader that frameworks understand, with exact consumed-position state.

* ``len(loader)`` is the epoch's microbatches, whatever the resume position (``len(loader.batch_sampler)``
  those the next iteration yields);
* ``set_epoch(epoch)`` reaches the plan's batch sampler (as do ``batch_sampler.set_epoch`` and
  ``batch_sampler.sampler.set_epoch``, which Lightning and accelerate call); ``epoch`` is right
  after every ``load_state_dict``, so ``for epoch in range(loader.epoch, plan.epochs)`` resumes;
* ``state_dict()`` / ``load_state_dict()`` hold the position right after the last batch the
  loader *handed out* (or the trainer reported with ``mark_consumed``: not the sampler's read-ahead,
  so it is exact with worker processes and prefetching), the plan fingerprint and the ledger of
  consumed positions (:mod:`varlen_cli.loader.ledger`);
* every batch handed out is checked by the loader's :class:`~varlen_cli.loader.guard.ConsumptionGuard`
  (plan order for this rank, the ledger, the pace of ``VariableBatchSizeLR``);
* ``all_epochs=True`` makes one iteration run every remaining epoch of the plan (for trainers,
  such as Hugging Face's, that assume equal epochs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from ..format import loader_state_problem
from .collate import PadCollate, PlanDataset
from .guard import ConsumptionGuard, register
from .packed import PackedCollate
from .plan_file import Plan, PlanError
from .sampler import MicrobatchPosition, PlanBatchSampler

STATE_KEY = "varlen"  # the loader's own state inside torchdata's state dict


class PlanLoaderMixin:
    """What :class:`PlanDataLoader` and :class:`PlanStatefulDataLoader` add to their DataLoader base."""

    batch_sampler: PlanBatchSampler
    _defer_start = False  # torchdata restores its state inside __iter__: accept any start there

    def _plan_setup(self, all_epochs: bool, lr_scale: str) -> None:
        sampler = self.batch_sampler
        self.plan = sampler.plan
        self.all_epochs = bool(all_epochs)
        self.full_epoch_len = True  # len() = the whole epoch, also after a mid-epoch resume (what frameworks count)
        self.consumed_by_trainer = False  # True: the trainer calls mark_consumed (it fetches ahead of training)
        self.len_before = 0  # microbatches a framework counted before this loader's first one (added to len())
        self.guard = ConsumptionGuard(sampler.plan, sampler.rank, lr_scale=lr_scale)
        sampler.ledger = self.guard.ledger
        register(self.guard)
        self._last: tuple | None = None  # (epoch, step, rank, micro) of the last batch handed out / reported
        self._unreported = 0  # batches handed out since the trainer last reported one (consumed_by_trainer)

    # -- epochs --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the plan epoch the next iteration yields (ignored with ``all_epochs``)."""
        if not self.all_epochs:
            self.batch_sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.batch_sampler.epoch

    def end_epoch(self) -> None:
        """Stop the current epoch early on purpose: the next epoch may then start (the ledger otherwise
        refuses an epoch started while the previous one is incomplete)."""
        self.guard.ledger.end_epoch(self.batch_sampler.epoch)

    def __len__(self) -> int:
        """Microbatches of the current epoch, also after a mid-epoch resume (Lightning counts an epoch's
        batches from its own restored progress: a shorter length would cut every later epoch short);
        with ``all_epochs``, of the whole plan (as Trainer-style loops expect). ``len_before`` is added:
        what a framework counted before this loader (the job's steps before a plan made by ``varlen
        replan``). ``full_epoch_len = False``: the microbatches the next iteration yields, as
        ``len(loader.batch_sampler)``."""
        if self.all_epochs:
            return self.len_before + self.plan.num_steps * self.plan.grad_accum
        if self.full_epoch_len:
            return self.len_before + self.plan.steps_per_epoch[self.batch_sampler.epoch] * self.plan.grad_accum
        return self.len_before + len(self.batch_sampler)

    def mark_consumed(self, batch: Any) -> None:
        """Report ``batch`` as trained, at the point where the model gets it (after any wrapper or
        read-ahead). Set ``consumed_by_trainer = True`` before iterating: the guard then checks the
        reported batches (so a wrapper that drops or reorders microbatches fails on the first one out
        of place) and ``state_dict()`` is the position after the last batch reported."""
        if not self.consumed_by_trainer:
            raise RuntimeError("set loader.consumed_by_trainer = True before iterating to report consumed batches")
        self._last = self.guard.consume(batch)
        self._unreported = 0

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
        self.guard.iterating += 1  # an optimizer step now trains on this loader's batches (guard.py)
        try:
            yield from self._batches(epochs)
        finally:
            self.guard.iterating -= 1

    def _batches(self, epochs):
        base_iter = super().__iter__
        limit = 2 * self.plan.grad_accum + 2  # what a trainer may fetch ahead of the batch it trains
        for i, epoch in enumerate(epochs):
            if epoch is not None and i > 0:
                self.batch_sampler.set_epoch(epoch)
            self.guard.restart(None if self._defer_start else self._start_position())
            for batch in base_iter():
                if not self.consumed_by_trainer:
                    self._last = self.guard.consume(batch)
                else:
                    self._unreported += 1
                    if self._unreported > limit:
                        raise PlanError(f"the trainer took {self._unreported} batches from the plan's loader without "
                                        f"reporting one as trained (loader.consumed_by_trainer is True: call "
                                        f"loader.mark_consumed(batch) where the model gets each batch; with "
                                        f"Lightning use PlanDataModule, which does)")
                yield batch

    # -- state -----------------------------------------------------------------------------------
    def _position_state(self) -> dict:
        """The position after the last batch handed out (or reported), with the ledger up to it."""
        sampler = self.batch_sampler
        if self._last is not None:
            epoch, step, micro = sampler._after(MicrobatchPosition(*self._last))
        else:
            step, micro, _ = sampler.bounds()
            epoch = sampler.epoch
        k = self.guard.ledger.index(step, micro)
        return {"plan": self.plan.fingerprint, "epoch": int(epoch), "step": int(step), "micro": int(micro),
                "dp": self.plan.dp, "rank": sampler.rank, "ledger": self.guard.ledger.state(upto=k)}

    def _restore_position(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)  # converts a state of the plan's parent; restores the ledger
        self._last = None
        self._unreported = 0
        self.guard.resumed()

    def state_dict(self) -> dict:
        """The position after the last batch this loader handed out (exact with workers/prefetching)
        and the ledger of the positions consumed up to there."""
        return self._position_state()

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position (seeks; refuses a state from another plan)."""
        self._restore_position(state)

    @property
    def _is_accelerate_prepared(self) -> bool:
        """What ``accelerator.prepare(loader)`` asks first: refused in one line. accelerate would rebuild
        the loader over a re-sharded batch sampler (each rank training every other microbatch of its
        stream) as a plain DataLoader (``loader.epoch``: an AttributeError)."""
        raise PlanError("accelerator.prepare(loader) would re-shard the plan's per-rank loader: use "
                        "varlen_cli.integrations.accelerate.prepare_plan_dataloader(accelerator, loader) for it (and "
                        "prepare the model and optimizer as usual)")


class PlanDataLoader(PlanLoaderMixin, DataLoader):
    """A ``torch.utils.data.DataLoader`` over a plan (made by :func:`dataloader_for_plan`)."""

    def __init__(self, dataset, batch_sampler: PlanBatchSampler, *, all_epochs: bool = False,
                 lr_scale: str = "check", **kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._plan_setup(all_epochs, lr_scale)


def dataloader_for_plan(dataset, plan: Plan | str, rank: int | None = None,
                        world_size: int | None = None, collate_fn: Callable[[Any], Any] | None = None,
                        num_workers: int = 0, pin_memory: bool = False, epoch: int = 0, check_length: bool = True,
                        stateful: bool = False, all_epochs: bool = False, read_ahead: int = 4,
                        lr_scale: str = "check", **kwargs):
    """A :class:`PlanDataLoader` over ``dataset`` that yields this rank's microbatches of ``plan``, collated.

    The loader has ``set_epoch``, ``epoch``, ``end_epoch``, ``state_dict``/``load_state_dict`` (the
    position after the last batch it handed out, exact with workers, and the ledger of consumed
    positions) and checks that batches are consumed in plan order, once per job (``loader.guard``;
    ``VariableBatchSizeLR.step()`` checks each step's micros against it). A plan whose ``lr_scale``
    is not all 1 must be trained with a ``VariableBatchSizeLR``: ``lr_scale="ignore"`` opts out.
    ``stateful=True`` builds it over torchdata's ``StatefulDataLoader`` instead (torchdata's own
    state, with the loader's inside). ``all_epochs=True``: one iteration runs every remaining epoch.

    The dataset is wrapped in :class:`PlanDataset` so that ``collate_fn`` (default
    :class:`PadCollate`, or ``PackedCollate`` for a packed plan) sees each microbatch's plan row.
    ``loader.batch_sampler`` is the :class:`PlanBatchSampler`. With ``check_length`` the plan is
    validated against ``len(dataset)``. Extra keyword arguments go to ``DataLoader``
    (``prefetch_factor``, ``persistent_workers``, ...). A dataset with a ``prefetch(sample_ids)``
    method (:class:`~varlen_cli.loader.SourceDataset`) is told the sample ids of the next
    ``read_ahead`` microbatches each DataLoader worker (or the main process) fetches.
    """
    check_map_style(dataset, check_length)
    plan = plan if isinstance(plan, Plan) else Plan.open(plan)
    sampler = PlanBatchSampler(plan, rank, world_size, num_samples=len(dataset) if check_length else None,
                               epoch=epoch)
    if hasattr(dataset, "prefetch"):
        sampler.read_ahead, sampler.read_ahead_stride = max(0, int(read_ahead)), max(1, int(num_workers))
    if collate_fn is None:  # packed plans: rows of concatenated samples, cu_seqlens, position ids
        collate_fn = PackedCollate() if plan.packing else PadCollate()
    cls = stateful_loader_class() if stateful else PlanDataLoader
    return cls(PlanDataset(dataset), sampler, collate_fn=collate_fn, num_workers=num_workers, pin_memory=pin_memory,
               all_epochs=all_epochs, lr_scale=lr_scale, **kwargs)


def check_map_style(dataset, check_length: bool = True) -> None:
    """Refuse, in one line, a dataset a plan cannot index: an iterable one, or one without ``len()``
    when the plan is to be checked against it."""
    from torch.utils.data import IterableDataset

    name = type(dataset).__name__
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise PlanError(f"a plan indexes a map-style dataset (dataset[sample_id]), but {name} is iterable only: write "
                        f"the data to files, run `varlen analyze` and `varlen plan` on them and read them with "
                        f"SourceDataset (a streaming planner for iterable datasets, varlen_cli.online, is to come)")
    if check_length and not hasattr(dataset, "__len__"):
        raise PlanError(f"{name} has no len(): the plan is checked against the dataset's size (give the dataset a "
                        f"__len__, or pass check_length=False)")


def stateful_loader_class():
    """``PlanStatefulDataLoader``: the same over torchdata's ``StatefulDataLoader`` (imported lazily).

    Its ``state_dict()`` is torchdata's own (exact with workers) plus, under ``"varlen"``, the
    loader's position and ledger; ``load_state_dict`` applies that part at once (so ``loader.epoch``
    is the state's epoch before the next iteration) and hands the rest to torchdata.
    """
    global _STATEFUL
    if _STATEFUL is None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        class PlanStatefulDataLoader(PlanLoaderMixin, StatefulDataLoader):
            _defer_start = True

            def __init__(self, dataset, batch_sampler: PlanBatchSampler, *, all_epochs: bool = False,
                         lr_scale: str = "check", **kwargs):
                super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
                self._plan_setup(all_epochs, lr_scale)
                batch_sampler.ledger_in_state = False  # torchdata restores the sampler: the ledger is ours

            def state_dict(self) -> dict:
                state = dict(StatefulDataLoader.state_dict(self))
                state[STATE_KEY] = self._position_state()
                return state

            def load_state_dict(self, state: dict) -> None:
                if not isinstance(state, dict):
                    raise PlanError(f"invalid loader state: {loader_state_problem(state)}")
                state = dict(state)
                if STATE_KEY in state and not isinstance(state[STATE_KEY], dict):  # else a silent fresh start
                    raise PlanError(f"invalid loader state: its '{STATE_KEY}' entry is {state[STATE_KEY]!r}, not the "
                                    "loader's state (pass what loader.state_dict() returned)")
                ours = state.pop(STATE_KEY, None) or _legacy_position(state)
                if ours is not None:
                    self.batch_sampler.ledger_in_state = True
                    try:
                        self._restore_position(ours)
                    finally:
                        self.batch_sampler.ledger_in_state = False
                    other_workers = saved_workers(state) not in (None, self.num_workers)
                    if ours.get("plan") != self.plan.fingerprint or other_workers or self.batch_sampler.moved_on:
                        # a state of the plan's parent (torchdata's part indexes the parent), of another number
                        # of worker processes (torchdata's part cannot be restored: an AssertionError at the next
                        # iteration), or one moved past an ended epoch: torchdata's part is stale; the loader's
                        # own position is exact, the sampler seeks to it
                        state = {}
                StatefulDataLoader.load_state_dict(self, state)

        _STATEFUL = PlanStatefulDataLoader
    return _STATEFUL


def saved_workers(state: dict) -> int | None:
    """The DataLoader worker processes a torchdata state was saved with (None: not a torchdata state)."""
    if isinstance(state.get("_snapshot"), dict):
        return len(state["_snapshot"].get("_worker_snapshots") or {})
    return 0 if "_num_yielded" in state else None


def _legacy_position(state: dict) -> dict | None:
    """The sampler position of a torchdata state saved without the loader's part (exact only without
    worker processes, whose snapshot holds the sampler's read-ahead position)."""
    if "_snapshot" in state:
        return None
    sampler_state = state.get("_index_sampler_state")
    return sampler_state if isinstance(sampler_state, dict) and "step" in sampler_state else None


_STATEFUL = None
