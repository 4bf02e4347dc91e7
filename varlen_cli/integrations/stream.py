"""One rank's stream of a plan for trainers that pull microbatches themselves (torchtitan, Megatron).

Both trainers call ``next()`` once per microbatch, ``grad_accum`` times per optimizer step, and
know nothing of epochs: :class:`PlanStream` is the plan's loader
(:func:`~varlen_cli.loader.dataloader_for_plan`: guard, ledger, collate) iterating every remaining
epoch in one pass, with the position and ledger of the last microbatch handed out as its state.

What both integrations share beyond the loader:

* a job restarted on another number of data-parallel ranks with the plan it was saved with is
  refused where the checkpoint's step is known (loading the state), in one line naming
  ``varlen replan PLAN --from-step N --dp M``; the plan that command writes accepts the same
  checkpoint (the elastic restart, :func:`varlen_cli.loader.replan.state_from_parent`);
* a plan made by ``varlen replan`` started without the checkpoint it continues is refused;
* ``last`` is the plan row of the microbatch handed out last (its ``step_loss_tokens``: the
  step's loss targets over all ranks and micros).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterator
from typing import Any

from ..loader import dataloader_for_plan, resolve_rank
from ..loader.plan_file import Plan, PlanError
from ..loader.replan import first_step, lineage
from . import open_plan


def replan_hint(plan: Plan, state: dict, world_size: int) -> str | None:
    """The ``varlen replan`` command that makes ``state``'s plan (this plan or its parent) continue
    on ``world_size`` ranks from ``state``'s step, or None for a state of another plan."""
    if state.get("plan") == plan.fingerprint:
        path = plan.path
    elif state.get("plan") is not None and state.get("plan") == lineage(plan).get("parent"):
        path = lineage(plan).get("parent_path") or "PARENT_PLAN"
    else:
        return None
    stem = os.path.splitext(os.path.basename(path))[0]
    out = f"{stem}-dp{world_size}.parquet"
    return (f"varlen replan {shlex.quote(path)} --from-step {int(state.get('step', 0))} --dp {world_size} "
            f"-o {out}")


def other_dp_error(plan: Plan, state: dict, world_size: int) -> PlanError:
    """The refusal of a checkpoint loaded on ``world_size`` data-parallel ranks into ``plan`` (made for
    another number): names the ``varlen replan`` command whose plan accepts the checkpoint."""
    command = replan_hint(plan, state, world_size)
    if command is None:
        return PlanError("the checkpoint's loader state was saved with another plan; resume with the same plan file "
                         "(or one made from it by `varlen replan`)")
    saved = int(state.get("dp", plan.dp))
    return PlanError(f"the checkpoint was saved at step {int(state.get('step', 0))} on {saved} data-parallel rank(s) "
                     f"but this job has {world_size}: make the rest of the plan for {world_size} with `{command}` "
                     f"and resume from this checkpoint with that plan")


class PlanStream:
    """This rank's collated microbatches of every remaining plan epoch, with exact resume state.

    ``world_size`` other than the plan's ``dp`` is accepted here and refused when the stream is
    resumed (naming the ``varlen replan`` command) or started. Keyword arguments go to
    :func:`~varlen_cli.loader.dataloader_for_plan`.
    """

    def __init__(self, dataset, plan: Plan | str | os.PathLike, *, collate_fn: Callable, rank: int | None = None,
                 world_size: int | None = None, **loader_kwargs: Any):
        self.plan = open_plan(plan)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.loader = None
        if self.world_size == self.plan.dp:
            self.loader = dataloader_for_plan(dataset, self.plan, self.rank, self.world_size, collate_fn=collate_fn,
                                              all_epochs=True, **loader_kwargs)
        self.resumed = False
        self.last = None  # the PlanRow of the microbatch handed out last

    def __iter__(self) -> Iterator[dict]:
        if self.loader is None:
            self.plan.validate(world_size=self.world_size)  # refuses: re-plan with --dp W
        if not self.resumed and first_step(self.plan) > 0:
            raise PlanError(f"{self.plan.path} continues a job from its global step {first_step(self.plan)} (made by "
                            f"`varlen replan`): resume from the checkpoint it was made from")
        self.resumed = True  # a second pass continues this one
        for batch in self.loader:
            self.last = batch["info"]
            yield batch

    def state_dict(self) -> dict:
        """The position after the last microbatch handed out, with the ledger (the loader's state)."""
        if self.loader is None:
            return {}
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (saved on this plan, or on the plan ``varlen replan`` made this one from)."""
        if self.loader is None:
            raise other_dp_error(self.plan, state, self.world_size)
        self.loader.load_state_dict(state)
        self.resumed = True
        self.last = None
