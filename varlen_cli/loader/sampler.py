"""A batch sampler that yields this rank's microbatches of a plan, resumable in O(1)."""

from __future__ import annotations

import os
import sys
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from ..format import loader_state_problem
from .fetch import new_iteration_id
from .ledger import Ledger
from .plan_file import Microbatch, Plan, PlanError
from .position import PlanRow, batch_position
from .replan import first_epoch, state_from_parent


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: explicit arguments, else torch.distributed, else ``RANK``/``WORLD_SIZE``, else 0/1."""
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    found = None
    if "torch.distributed" in sys.modules or "torch" in sys.modules:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            found = (tdist.get_rank(), tdist.get_world_size())
    if found is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        found = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    if found is None:
        found = (0, 1)
    return (int(rank) if rank is not None else found[0], int(world_size) if world_size is not None else found[1])


class MicrobatchIndices(list):
    """The sample ids of one microbatch (a plain ``list`` of ints), with the plan row as ``.info``.

    ``DataLoader`` hands this to the dataset's ``__getitems__`` (see :class:`PlanDataset`), which is
    how the collate function learns the microbatch's padded shape and token counts. It pickles
    with its ``.info``, so it survives the trip to DataLoader worker processes.
    """

    info: Microbatch
    order: tuple[str, int] | None  # (sampler iteration id, index in it): the fetch-order check
    ahead: list | None  # sample ids of the microbatches the same consumer fetches next (read-ahead)

    def __init__(self, ids, info: Microbatch, order: tuple[str, int] | None = None, ahead: list | None = None):
        super().__init__(ids)
        self.info = info
        self.order = order
        self.ahead = ahead


def _with_ahead(items: Iterable, depth: int, stride: int) -> Iterator[tuple[Any, list | None]]:
    """``(item, [sample ids of items k+stride, k+2*stride, ... k+depth*stride])`` for each item k:
    with ``stride`` DataLoader workers taking microbatches in turn, what the same worker gets next."""
    if depth <= 0:
        for item in items:
            yield item, None
        return
    window: deque = deque()
    span = depth * stride
    for item in items:
        window.append(item)
        if len(window) > span:
            yield _ahead_of(window, stride)
    while window:
        yield _ahead_of(window, stride)


def _ahead_of(window: deque, stride: int) -> tuple[Any, list]:
    head = window.popleft()
    return head, [window[j].sample_ids for j in range(stride - 1, len(window), stride)]


def _as_info(obj: Any) -> Microbatch:
    obj = obj.get("info", obj) if isinstance(obj, dict) and obj.get("info") is not None else obj
    obj = getattr(obj, "info", obj) if not isinstance(obj, (Microbatch, PlanRow)) else obj
    if isinstance(obj, PlanRow):
        return obj.microbatch
    if isinstance(obj, (Microbatch, MicrobatchPosition)):
        return obj
    if isinstance(obj, dict) and obj.get("plan_position") is not None:  # only the position survived
        epoch, step, rank, micro = batch_position(obj)
        return MicrobatchPosition(epoch, step, rank, micro)
    raise TypeError("expected a Microbatch, MicrobatchIndices or a collated batch with an 'info' entry")


class MicrobatchPosition:
    """The position fields of a Microbatch (what ``state_dict(after=...)`` needs)."""

    def __init__(self, epoch, step, rank, micro):
        self.epoch, self.step, self.rank, self.micro = epoch, step, rank, micro


class _EpochSetter:
    """``batch_sampler.sampler``: what frameworks that call ``batch_sampler.sampler.set_epoch(e)``
    (Lightning, accelerate) reach; it forwards to the plan's batch sampler. Frameworks count the
    job's epochs: on a plan made by ``varlen replan`` from the middle of a job, the plan's epoch 0
    is the job's epoch ``first_epoch(plan)``."""

    def __init__(self, batch_sampler: PlanBatchSampler):
        self._batch_sampler = weakref.ref(batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        sampler = self._batch_sampler()
        offset = first_epoch(sampler.plan)
        if epoch < offset:
            raise PlanError(f"the framework starts epoch {epoch} but this plan continues a job at its epoch {offset} "
                            f"(made by `varlen replan`): resume from the checkpoint the plan was made from")
        sampler.set_epoch(epoch - offset)

    def __len__(self) -> int:
        return len(self._batch_sampler())


class PlanBatchSampler:
    """Yields this rank's microbatches (lists of sample ids) of one epoch, in plan order.

    Use as ``DataLoader(dataset, batch_sampler=sampler)``; every rank yields exactly
    ``grad_accum`` microbatches per step and the same number of steps. All ranks share one
    position ``(epoch, step, micro)``, so one rank's :meth:`state_dict` resumes every rank.

    ``read_ahead``/``read_ahead_stride``: attach to each microbatch (``.ahead``) the sample ids of the
    next ``read_ahead`` microbatches its consumer fetches, for a dataset's ``prefetch`` (set by
    :func:`~varlen_cli.loader.dataloader_for_plan` when the dataset has one; stride = DataLoader workers).
    """

    read_ahead = 0
    read_ahead_stride = 1

    def __init__(self, plan: Plan | str | os.PathLike, rank: int | None = None,
                 world_size: int | None = None, *, num_samples: int | None = None, epoch: int = 0):
        self.plan = plan if isinstance(plan, Plan) else Plan.open(plan)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.plan.validate(num_samples=num_samples, world_size=self.world_size)
        self.plan.check_rank(self.rank)
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (step, micro) to start the epoch at
        self._next: tuple[int, int, int] | None = None  # position after the last yielded microbatch
        self.ledger: Ledger | None = None  # the consumption ledger of the loader this sampler feeds
        self.ledger_in_state = True  # False: the loader keeps the ledger in its own state (torchdata)
        self.moved_on = False  # the last state loaded was in an epoch ended early: resumed at the next one
        self.sampler = _EpochSetter(self)
        self.set_epoch(epoch)

    # -- epochs ----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration yields (a resume position in that epoch is kept)."""
        self.plan.check_epoch(epoch)
        if epoch != self.epoch:
            self._resume = None
            self._next = None
        self.epoch = int(epoch)

    def bounds(self) -> tuple[int, int, int]:
        start = self.plan.epoch_start(self.epoch)
        stop = start + self.plan.steps_per_epoch[self.epoch]
        if self._resume is not None:
            return self._resume[0], self._resume[1], stop
        return start, 0, stop

    def __len__(self) -> int:
        """Microbatches the next iteration yields (fewer after a mid-epoch resume)."""
        step, micro, stop = self.bounds()
        return max(0, (stop - step) * self.plan.grad_accum - micro)

    def __iter__(self) -> Iterator[MicrobatchIndices]:
        step, micro, stop = self.bounds()
        iteration = new_iteration_id()
        microbatches = self.plan.microbatches(self.rank, step, micro, stop)
        for k, (mb, ahead) in enumerate(_with_ahead(microbatches, self.read_ahead, self.read_ahead_stride)):
            self._next = self._after(mb)
            yield MicrobatchIndices(mb.sample_ids.tolist(), mb, (iteration, k), ahead)
        self._resume = None  # the epoch is done: the next iteration starts the epoch from its beginning

    # -- resuming --------------------------------------------------------------------------
    def _after(self, mb) -> tuple[int, int, int]:
        """The position right after ``mb``: the next micro, the next step, or the next epoch."""
        if mb.micro + 1 < self.plan.grad_accum:
            return (mb.epoch, mb.step, mb.micro + 1)
        step = mb.step + 1
        end = self.plan.epoch_start(mb.epoch) + self.plan.steps_per_epoch[mb.epoch]
        if step < end:
            return (mb.epoch, step, 0)
        return (mb.epoch + 1, step, 0)

    def state_dict(self, after: Any = None) -> dict:
        """The position to resume at, as a small dict.

        Without ``after``: right after the last microbatch this sampler yielded (exact with
        ``num_workers=0``). A DataLoader with worker processes runs the sampler ahead of training
        (prefetching), so there pass the last batch the model consumed: ``state_dict(after=batch)``
        (a collated batch with an ``info`` entry, a :class:`Microbatch` or :class:`MicrobatchIndices`).
        The sampler of a loader also saves the loader's ledger of consumed positions up to there.
        """
        if after is not None:
            info = _as_info(after)
            epoch, step, micro = self._after(info)
        elif self._next is not None:
            epoch, step, micro = self._next
        else:
            step, micro, _ = self.bounds()
            epoch = self.epoch
        state = {"plan": self.plan.fingerprint, "epoch": int(epoch), "step": int(step), "micro": int(micro),
                 "dp": self.plan.dp}
        if self.ledger is not None and self.ledger_in_state:
            state["ledger"] = self.ledger.state(upto=self.ledger.index(step, micro))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position: the next iteration starts there (no fast-forwarding).
        The ledger of the loader this sampler feeds is restored too (a state without one: every
        position before it was trained). A malformed state is refused with one line
        (:func:`varlen_cli.format.loader_state_problem`, the same check ``varlen replan --state`` runs)."""
        problem = loader_state_problem(state)
        if problem is not None:
            raise PlanError(f"invalid loader state: {problem}")
        if state.get("plan") != self.plan.fingerprint:  # a state of the plan's parent (varlen replan/--extend)?
            state = state_from_parent(self.plan, state) or state
        if state.get("plan") != self.plan.fingerprint:
            raise PlanError("the sampler state was saved with a different plan file; resume with the same plan")
        epoch, step, micro = int(state["epoch"]), int(state["step"]), int(state["micro"])
        finished = epoch == self.plan.epochs and micro == 0 and step == self.plan.num_steps
        self.moved_on = False
        if not finished:
            self.plan.check_epoch(epoch)
            start = self.plan.epoch_start(epoch)
            if not (start <= step < start + self.plan.steps_per_epoch[epoch]) or not 0 <= micro < self.plan.grad_accum:
                raise PlanError(f"invalid sampler state: (epoch {epoch}, step {step}, micro {micro}) is not in the "
                                f"plan")
            ledger = state.get("ledger") if self.ledger_in_state else None
            self.moved_on = isinstance(ledger, dict) and epoch in ledger.get("ended", [])
            if self.moved_on:  # saved after loader.end_epoch(): the next epoch
                epoch, step, micro = epoch + 1, sum(self.plan.steps_per_epoch[:epoch + 1]), 0
                finished = epoch == self.plan.epochs
        if finished:
            self.epoch, self._resume, self._next = self.plan.epochs - 1, (step, 0), None  # the plan is finished
        else:
            self.epoch = epoch
            self._resume = (step, micro)
            self._next = None
        if self.ledger is not None and self.ledger_in_state:
            self.ledger.restore(state.get("ledger"), self.ledger.index(step, micro))
