"""``dataloader_for_stream``: this rank's collated microbatches of a stream planned step by step.

Every rank reads the same stream (the same items in the same order) and feeds the same
:class:`~varlen_cli.online.OnlinePlanner`, so every rank plans the same steps with no collective; each
keeps the items of its own microbatches. The batches come from the plan loaders' collates
(:class:`~varlen_cli.loader.PadCollate`, :class:`~varlen_cli.loader.PackedCollate`) with the same
plan row (``batch["info"]``: step, rank, micro, ``lr_scale``, ``step_loss_tokens``), so exact loss
normalisation and the LR scale work as with a plan (:class:`StreamLR`, a
:class:`~varlen_cli.loader.VariableBatchSizeLR` fed by the stream). A stream where ranks read
different shards plans with :func:`~varlen_cli.online.plan_step` on all-gathered lengths instead
(``examples/train_rl_stream.py``).

``state_dict()`` holds the planner's state as of the start of the step in progress, the items it
buffers, and how many microbatches of that step were handed out: a loader loaded from it re-plans
that step (the same plan: planning is deterministic) and goes on at the next microbatch, every
sample trained once. Imports torch (through the collates); :mod:`varlen_cli.online` itself does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ..loader.collate import PadCollate, Samples
from ..loader.lr import VariableBatchSizeLR
from ..loader.microbatch import Microbatch
from ..loader.packed import PackedCollate
from ..loader.plan_file import PlanError
from ..loader.sampler import resolve_rank
from .planner import OnlinePlanner, Step, item_length
from .step import StepPlan

RESUMES = ("skip", "continue")
STATE_VERSION = 1


class StreamLoader:
    """This rank's microbatches of a planned stream (see the module docstring). Iterate it for the
    microbatches (``batch["info"].step`` / ``.micro``), or :meth:`steps` for one list per step."""

    def __init__(self, iterable: Iterable, planner: OnlinePlanner, collate: Callable | None = None, *,
                 length: Callable[[Any], int] | None = None, group: Callable[[Any], Any] | None = None,
                 rank: int | None = None, world_size: int | None = None, resume: str | None = None,
                 check_ranks: bool = True):
        self.iterable, self.planner = iterable, planner
        self.rank, self.world_size = resolve_rank(rank, world_size)
        if planner.spec.dp != self.world_size:
            raise PlanError(f"the OnlinePlanner plans for dp {planner.spec.dp} ranks but this job has "
                            f"{self.world_size}: make it with dp={self.world_size}")
        if resume is not None and resume not in RESUMES:
            raise PlanError(f"resume must be 'skip' or 'continue' (got {resume!r})")
        self.collate = collate if collate is not None else (PackedCollate() if planner.spec.packed else PadCollate())
        self.length = length or item_length
        self.group = group
        self.resume = resume
        self.check_ranks = check_ranks
        self._held: dict[int, Any] = {}  # items of the buffered samples (and of the step in progress)
        self._step_start: dict | None = None  # the planner's state before the step in progress was planned
        self._step: Step | None = None
        self._micro = 0  # microbatches of the step in progress handed out
        self._skip = 0  # items to skip when the iterable restarts (resume="skip")
        self._source: Iterator | None = None  # the stream, read across iterations
        self._scales: dict[int, float] = {}
        self._lrs: list[StreamLR] = []

    # -- iteration --------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        for batches in self.steps():
            yield from batches

    def steps(self) -> Iterator[StreamStep]:
        """One :class:`StreamStep` per step: iterate it for the step's collated microbatches."""
        if self._source is None:  # the first iteration (or the first after a load_state_dict)
            self._source = iter(self.iterable)
            for _ in range(self._skip):
                if next(self._source, _END) is _END:
                    raise PlanError(f"resume='skip': the stream holds fewer than the {self._skip:,} items read "
                                    "before the state was saved")
            self._skip = 0
        source = self._source
        if self._step is not None:  # resumed inside a step: plan it again (the same plan), then go on
            self.planner.load_state_dict(self._step_start)
        ended = False
        while True:
            before = self.planner.state_dict()
            step = self.planner.next_step(flush=ended)
            if step is None:
                if ended:
                    return
                item = next(source, _END)
                if item is _END:
                    ended = True
                    continue
                sid = self.planner.add(self.length(item), None if self.group is None else self.group(item))
                self._held[sid] = item
                continue
            self._begin(step, before)
            yield StreamStep(step, self._microbatches(step))
            if self._micro < step.plan.num_microbatches:
                return  # the consumer stopped inside the step: keep it for the next iteration or the state
            self._end(step)

    def _begin(self, step: Step, before: dict) -> None:
        if self._step is None or self._step.step != step.step:
            self._micro = 0
        self._step, self._step_start = step, before
        self._scales[step.step] = step.plan.lr_scale
        if self.check_ranks:
            _check_same_stream(step)
        for lr in self._lrs:
            lr.refresh()

    def _end(self, step: Step) -> None:
        for sid in step.ids.tolist():
            self._held.pop(sid, None)
        self._step, self._step_start, self._micro = None, None, 0

    def _microbatches(self, step: Step) -> Iterator[dict]:
        plan = step.plan
        while self._micro < plan.num_microbatches:
            m = self._micro
            info = microbatch_info(step.plan, self.rank, m, step=step.step, ids=step.ids)
            items = [self._held[int(sid)] for sid in info.sample_ids.tolist()]
            batch = self.collate(Samples(items, info))
            self._micro += 1
            yield batch

    # -- LR ----------------------------------------------------------------------------------------------
    def lr_scale(self, step: int) -> float:
        """The ``lr_scale`` of a planned step (1.0 for a step not planned yet)."""
        return self._scales.get(step, 1.0)

    def attach(self, lr: StreamLR) -> None:
        self._lrs.append(lr)

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The planner's state at the start of the step in progress (or now, between steps), the
        items it holds and the microbatches of that step handed out."""
        planner = self._step_start if self._step is not None else self.planner.state_dict()
        ids = planner["ids"]
        return {"version": STATE_VERSION, "planner": planner, "micro": self._micro if self._step is not None else 0,
                "rank": self.rank, "items": {int(i): self._held[int(i)] for i in ids}}

    def load_state_dict(self, state: dict) -> None:
        """Go on from :meth:`state_dict` (refused in one line for another rank or planner, or without
        ``resume``: how the iterable goes on must be said)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise PlanError("not a stream loader state (or one of another version)")
        if self.resume is None:
            raise PlanError("a resumed stream loader needs resume='skip' (the iterable starts again from its first "
                            "item) or resume='continue' (it yields the items after those read before)")
        if state.get("rank") != self.rank:
            raise PlanError(f"the stream loader state is rank {state.get('rank')}'s; this is rank {self.rank}")
        self.planner.load_state_dict(state["planner"])
        self._held = {int(k): v for k, v in state["items"].items()}
        self._step, self._step_start, self._micro = None, None, 0
        if state["micro"]:  # inside a step: planned again at the next iteration, then skipped to "micro"
            self._step_start = state["planner"]
            self._step = _Resumed(int(state["planner"]["step"]))
            self._micro = int(state["micro"])
        self._skip = self.planner.next_id if self.resume == "skip" else 0
        self._source = None


def microbatch_info(plan: StepPlan, rank: int, micro: int, *, step: int = 0,
                    ids: np.ndarray | None = None) -> Microbatch:
    """The plan row of rank ``rank``'s microbatch ``micro`` of a step (what the collates read):
    ``ids`` are the step's sample ids (default: the indices into its lengths)."""
    where = plan.ranks[rank][micro]
    packed = plan.packed
    return Microbatch(
        epoch=0, step=step, rank=rank, micro=micro, sample_ids=where if ids is None else ids[where],
        num_samples=len(where), seqlen=int(plan.seqlens[rank, micro]), batch_size=int(plan.batch_sizes[rank, micro]),
        tokens=int(plan.tokens[rank, micro]), lr_scale=plan.lr_scale, shape_id=0, step_samples=plan.num_samples,
        step_tokens=plan.num_tokens, sample_lengths=plan.entry_lengths[rank][micro] if packed else None,
        sample_rows=plan.entry_rows[rank][micro] if packed else None,
        sample_starts=plan.entry_starts[rank][micro] if packed else None, step_loss_tokens=plan.loss_tokens)


def rank_batches(plan: StepPlan, items, rank: int, collate: Callable | None = None, *, step: int = 0) -> Iterator[dict]:
    """Rank ``rank``'s collated microbatches of a :func:`~varlen_cli.online.plan_step` plan over ``items``
    (one per length it was planned on; the batches' ``sample_ids`` index them), with the plan loaders'
    collates (padded or packed by default) and plan rows, so ``step_loss_tokens`` and ``lr_scale`` are
    there as with a plan."""
    collate = collate if collate is not None else (PackedCollate() if plan.packed else PadCollate())
    for m in range(plan.num_microbatches):
        info = microbatch_info(plan, rank, m, step=step)
        yield collate(Samples([items[i] for i in info.sample_ids.tolist()], info))


class StreamStep:
    """One step of the stream: ``step``, ``num_microbatches`` (this rank's, the same on every rank),
    ``lr_scale``, ``loss_tokens`` (the step's loss targets over all ranks), ``samples`` (stream ids of
    the whole step); iterating it yields this rank's collated microbatches (from the first not yet
    handed out)."""

    def __init__(self, step: Step, batches: Iterator[dict]):
        self.step = step.step
        self.num_microbatches = step.plan.num_microbatches
        self.lr_scale = step.plan.lr_scale
        self.loss_tokens = step.plan.loss_tokens
        self.samples = step.ids
        self._batches = batches

    def __iter__(self) -> Iterator[dict]:
        return self._batches


class _Resumed:
    """Stands for the step in progress of a loaded state until it is planned again."""

    def __init__(self, step: int):
        self.step = step


_END = object()


def _check_same_stream(step: Step) -> None:
    """Under torch.distributed, every rank's step must hold the same samples: one all-gather of a
    fingerprint per step (a rank that read another stream would train a different plan)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mix = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        key = int(((step.ids.astype(np.uint64) * mix) ^ step.lengths.astype(np.uint64)).sum()) & ((1 << 62) - 1)
    mine = torch.tensor([step.step, key, len(step.ids)], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if any(not torch.equal(other, mine) for other in every):
        raise PlanError(f"step {step.step}: the ranks planned different samples; every rank must read the same "
                        "stream in the same order (or plan with plan_step on all-gathered lengths)")


class StreamLR(VariableBatchSizeLR):
    """:class:`~varlen_cli.loader.VariableBatchSizeLR` over a stream: the ``lr_scale`` of each step as
    the loader plans it (a step's scale applies once its first microbatch is handed out, before its
    optimizer step). Call ``step()`` once per optimizer step, as with a plan."""

    def __init__(self, scheduler_or_optimizer: Any, loader: StreamLoader, start_step: int = 0):
        self.loader = loader
        super().__init__(scheduler_or_optimizer, np.zeros(0), start_step, check=False)
        loader.attach(self)

    def scale(self, step: int | None = None) -> float:
        return self.loader.lr_scale(self.step_index if step is None else step)

    def refresh(self) -> None:
        """Apply the current step's scale again (the loader just planned it)."""
        self._apply()


def dataloader_for_stream(iterable: Iterable, planner: OnlinePlanner, collate: Callable | None = None, *,
                          length: Callable[[Any], int] | None = None, group: Callable[[Any], Any] | None = None,
                          rank: int | None = None, world_size: int | None = None, resume: str | None = None,
                          check_ranks: bool = True) -> StreamLoader:
    """This rank's collated microbatches of ``iterable`` planned by ``planner`` (see :class:`StreamLoader`).

    ``collate``: :class:`~varlen_cli.loader.PadCollate` (padded) or
    :class:`~varlen_cli.loader.PackedCollate` (packed) by default. ``length(item)``: its tokens
    (default ``len(item["input_ids"])`` or ``len(item)``); ``group(item)``: its group id (a GRPO
    group, a DPO pair: consecutive items of one id stay in one microbatch). ``rank`` / ``world_size``
    from torch.distributed or the environment by default; ``planner.dp`` must be the world size.
    ``resume`` (needed to load a state): ``"skip"`` when the iterable starts again from its first item
    (those read before are skipped), ``"continue"`` when it goes on after them. ``check_ranks``: one
    small all-gather per step checks that every rank planned the same samples."""
    return StreamLoader(iterable, planner, collate, length=length, group=group, rank=rank, world_size=world_size,
                        resume=resume, check_ranks=check_ranks)
