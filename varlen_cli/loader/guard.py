"""The desync guard: every batch carries its plan position, and what a trainer consumes is checked.

A collated batch holds ``plan_position`` (an int64 tensor ``[epoch, step, rank, micro]``, which
survives ``.to(device)``, ``apply_to_collection`` and pickling to and from DataLoader workers) and
``info`` (a :class:`PlanRow`: the plan row, a plain object that recursive batch movers leave alone).

Three checks use it, each raising a one-line :class:`PlanError`:

* fetch order (:func:`check_fetch_order`, run by :class:`~varlen_cli.loader.collate.PlanDataset`):
  the microbatches a DataLoader fetches must be the sampler's, in its order, none left out. A
  wrapper that re-shards the batch sampler (``accelerator.prepare(loader)``) fails on its first
  out-of-place microbatch;
* consumption order (:class:`ConsumptionGuard`, fed by :class:`~varlen_cli.loader.PlanDataLoader`):
  the batches a trainer takes from the loader must follow the plan's ``(epoch, step, micro)``
  order for this rank;
* step membership (:meth:`ConsumptionGuard.check_step`, run by ``VariableBatchSizeLR.step()``, and
  :func:`check_batch`, also ``Plan.check(batch, step)``): the microbatches consumed since the last
  optimizer step must be exactly micros ``0..grad_accum-1`` of the step whose update is applied.
"""

from __future__ import annotations

import itertools
import os
import weakref
from typing import Any

import torch

from .plan_file import Microbatch, Plan, PlanError

#: Batch keys that are bookkeeping, not model inputs (:func:`~varlen_cli.loader.to_model_inputs` drops them).
POSITION_KEY = "plan_position"


class PlanRow:
    """The plan row of a batch (``batch["info"]``): every :class:`Microbatch` attribute, read-only.

    Not a dataclass and without a ``to`` method, so Lightning's ``apply_to_collection``,
    accelerate's ``send_to_device`` and Trainer's ``_prepare_input`` pass it through unchanged.
    """

    __slots__ = ("microbatch",)

    def __init__(self, microbatch: Microbatch):
        object.__setattr__(self, "microbatch", microbatch)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "microbatch"), name)

    def __setattr__(self, name, value):
        raise AttributeError("PlanRow is read-only")

    def __getstate__(self):
        return self.microbatch

    def __setstate__(self, state):
        object.__setattr__(self, "microbatch", state)

    def __eq__(self, other):
        other = other.microbatch if isinstance(other, PlanRow) else other
        return self.microbatch == other

    __hash__ = None

    def __repr__(self) -> str:
        mb = self.microbatch
        return f"PlanRow(epoch={mb.epoch}, step={mb.step}, rank={mb.rank}, micro={mb.micro}, shape={mb.shape})"


def stamp(out: dict, info: Microbatch | None) -> dict:
    """Put the plan position and row into a collated batch (no-op without a plan row)."""
    if info is None:
        out.setdefault(POSITION_KEY, None)
        return out
    mb = info.microbatch if isinstance(info, PlanRow) else info
    out[POSITION_KEY] = torch.tensor([mb.epoch, mb.step, mb.rank, mb.micro], dtype=torch.int64)
    out["info"] = PlanRow(mb)
    return out


def batch_position(batch: Any) -> tuple[int, int, int, int]:
    """``(epoch, step, rank, micro)`` of a collated batch (or a Microbatch / PlanRow / indices)."""
    for obj in (batch, getattr(batch, "info", None)):
        if isinstance(obj, (Microbatch, PlanRow)):
            return (int(obj.epoch), int(obj.step), int(obj.rank), int(obj.micro))
    if isinstance(batch, dict):
        info = batch.get("info")
        if isinstance(info, (Microbatch, PlanRow)):
            return (int(info.epoch), int(info.step), int(info.rank), int(info.micro))
        pos = batch.get(POSITION_KEY)
        if pos is not None:
            values = pos.tolist() if isinstance(pos, torch.Tensor) else list(pos)
            if len(values) == 4:
                return tuple(int(v) for v in values)
    raise PlanError("this batch carries no plan position: collate it with varlen's PadCollate or PackedCollate "
                    "over PlanDataset (dataloader_for_plan does)")


def describe(pos) -> str:
    epoch, step, rank, micro = pos
    return f"(epoch {epoch}, step {step}, rank {rank}, micro {micro})"


def position_after(plan: Plan, pos) -> tuple[int, int, int, int]:
    """The position of the microbatch that follows ``pos`` in the same rank's stream."""
    epoch, step, rank, micro = pos
    if micro + 1 < plan.grad_accum:
        return (epoch, step, rank, micro + 1)
    end = plan.epoch_start(epoch) + plan.steps_per_epoch[epoch]
    if step + 1 < end:
        return (epoch, step + 1, rank, 0)
    return (epoch + 1, step + 1, rank, 0)


def check_batch(plan: Plan, batch: Any, step: int, rank: int | None = None) -> tuple[int, int, int, int]:
    """Raise :class:`PlanError` unless ``batch`` is a microbatch of global ``step`` (and of ``rank``)."""
    pos = batch_position(batch)
    epoch, got_step, got_rank, micro = pos
    if got_step != step:
        want_epoch = plan.epoch_of(step) if 0 <= step < plan.num_steps else "?"
        raise PlanError(f"desync: the trainer is applying optimizer step {step} (epoch {want_epoch}) but consumed "
                        f"the microbatch at {describe(pos)}: the data stream and the step count disagree (was "
                        f"set_epoch missed, a batch skipped, or the gradient accumulation changed?)")
    if rank is not None and got_rank != rank:
        raise PlanError(f"desync: rank {rank} consumed the microbatch of rank {got_rank} at {describe(pos)}: the "
                        f"loader was re-sharded (pass the plan's loader through prepare_plan_dataloader)")
    if not 0 <= micro < plan.grad_accum or (0 <= step < plan.num_steps and plan.epoch_of(step) != epoch):
        raise PlanError(f"desync: {describe(pos)} is not a position of this plan")
    return pos


class ConsumptionGuard:
    """Checks the microbatches a trainer consumes from one rank's loader against the plan.

    :meth:`consume` is called for every batch the loader hands out (in order); :meth:`check_step`
    when an optimizer step's LR is advanced. A new iteration of the loader calls :meth:`restart`
    with the position it starts at.
    """

    def __init__(self, plan: Plan, rank: int):
        self.plan = plan
        self.rank = int(rank)
        self.expected: tuple[int, int, int, int] | None = None
        self.last: tuple[int, int, int, int] | None = None
        self.pending: list[tuple[int, int, int, int]] = []
        self.enabled = True

    def restart(self, position: tuple[int, int, int, int] | None) -> None:
        self.expected = position

    def consume(self, batch: Any) -> tuple[int, int, int, int]:
        pos = batch_position(batch)
        if self.enabled:
            if pos[2] != self.rank:
                raise PlanError(f"desync: rank {self.rank} consumed the microbatch of rank {pos[2]} at "
                                f"{describe(pos)}: the loader was re-sharded or built for another rank")
            if self.expected is not None and pos != self.expected:
                raise PlanError(f"desync: the trainer consumed the microbatch at {describe(pos)} where the plan's "
                                f"next one is {describe(self.expected)}: a wrapper dropped or reordered microbatches")
        self.last = pos
        self.expected = position_after(self.plan, pos)
        self.pending.append(pos)
        return pos

    def check_step(self, step: int) -> None:
        """The update of global ``step`` is being applied: its micros must be exactly what was consumed."""
        got, self.pending = self.pending, []
        if not self.enabled or not 0 <= step < self.plan.num_steps:
            return
        epoch = self.plan.epoch_of(step)
        want = [(epoch, step, self.rank, m) for m in range(self.plan.grad_accum)]
        if got == want:
            return
        if not got:
            raise PlanError(f"desync: optimizer step {step} is applied but no microbatch was consumed from the "
                            f"plan's loader since the last step (was the loader re-wrapped, e.g. by "
                            f"accelerator.prepare()? use varlen_cli.integrations.accelerate.prepare_plan_dataloader)")
        have = ", ".join(describe(p) for p in got[:3]) + (", ..." if len(got) > 3 else "")
        raise PlanError(f"desync: optimizer step {step} (epoch {epoch}) needs micros 0..{self.plan.grad_accum - 1} of "
                        f"rank {self.rank} but the trainer consumed {len(got)} microbatch(es): {have} (gradient "
                        f"accumulation must be the plan's {self.plan.grad_accum}, and set_epoch must reach the loader)")

    def state_dict(self) -> dict:
        return {"last": list(self.last) if self.last is not None else None}


# -- linking loaders and LR schedulers of one plan in one process -------------------------------------
_GUARDS: dict[str, weakref.ReferenceType[ConsumptionGuard]] = {}


def register(guard: ConsumptionGuard) -> None:
    """Make ``guard`` the one ``VariableBatchSizeLR`` objects of the same plan check (latest loader wins)."""
    _GUARDS[guard.plan.fingerprint] = weakref.ref(guard)


def lookup(plan: Plan) -> ConsumptionGuard | None:
    ref = _GUARDS.get(plan.fingerprint)
    return ref() if ref is not None else None


# -- fetch order -------------------------------------------------------------------------------------
_ITERATIONS = itertools.count()
_NONCE = os.urandom(4).hex()


def new_iteration_id() -> str:
    """A process-unique id for one iteration of a batch sampler."""
    return f"{_NONCE}-{os.getpid()}-{next(_ITERATIONS)}"


class FetchOrder:
    """Per-process record of the microbatches a DataLoader fetched, for :func:`check_fetch_order`."""

    def __init__(self):
        self.last: dict[str, int] = {}

    def check(self, indices: Any) -> None:
        order = getattr(indices, "order", None)
        info = getattr(indices, "info", None)
        if order is None or info is None:
            return
        iteration, k = order
        worker = torch.utils.data.get_worker_info()
        stride = 1 if worker is None else worker.num_workers
        last = self.last.get(iteration)
        ok = (k == 0) if (last is None and worker is None) else (last is None or k == last + stride)
        if not ok:
            raise PlanError(f"desync: the DataLoader fetched the microbatch at "
                            f"{describe((info.epoch, info.step, info.rank, info.micro))} out of the plan's order "
                            f"(its batch sampler was re-sharded or wrapped, e.g. by accelerator.prepare(): use "
                            f"varlen_cli.integrations.accelerate.prepare_plan_dataloader)")
        if len(self.last) > 64:
            self.last.clear()
        self.last[iteration] = k
