"""Where a batch sits in the plan: every collated batch carries its ``(epoch, step, rank, micro)``.

A collated batch holds ``plan_position`` (an int64 tensor ``[epoch, step, rank, micro]``, which
survives ``.to(device)``, ``apply_to_collection`` and pickling to and from DataLoader workers) and
``info`` (a :class:`PlanRow`: the plan row, a plain object that recursive batch movers leave alone).
:func:`batch_position` reads it back; :func:`check_batch` (also ``Plan.check(batch, step)``) checks
a batch against the optimizer step being applied.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PlanError
from .microbatch import Microbatch

#: The batch key of the position tensor (bookkeeping, dropped by :func:`~varlen_cli.loader.to_model_inputs`).
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


def check_batch(plan: Any, batch: Any, step: int, rank: int | None = None) -> tuple[int, int, int, int]:
    """Raise :class:`PlanError` unless ``batch`` is a microbatch of global ``step`` (and of ``rank``).
    ``plan`` is a :class:`~varlen_cli.loader.Plan` (not imported here: plan_file imports this module)."""
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
