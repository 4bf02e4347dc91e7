"""Resuming on a plan derived from another (``varlen replan``, ``varlen plan --extend``).

A replanned plan's metadata ``lineage`` names its parent (``parent``: the parent's fingerprint) and
the parent's step it starts at (``from_step``); an extended plan (``kind: "extend"``) keeps every
parent step unchanged. :func:`state_from_parent` turns a sampler state saved on the parent into one
of the derived plan, which :meth:`PlanBatchSampler.load_state_dict` does by itself.
"""

from __future__ import annotations

from .plan_file import Plan, PlanError


def lineage(plan: Plan) -> dict:
    """The plan's ``lineage`` metadata (empty for a plan made by ``varlen plan``)."""
    return plan.meta.get("lineage") or {}


def first_step(plan: Plan) -> int:
    """The global step of the plan's step 0: its steps are numbered from 0 in the file, the job's
    steps continue from the parent's (``global step = first_step(plan) + step``)."""
    return int(lineage(plan).get("first_step", 0))


def first_epoch(plan: Plan) -> int:
    """The job's epoch number of the plan's epoch 0 (``epoch + first_epoch(plan)``)."""
    return int(lineage(plan).get("first_epoch", 0))


def state_from_parent(plan: Plan, state: dict) -> dict | None:
    """``state`` (saved on the plan's parent) as a state of ``plan``; None if ``plan`` has no parent
    ``state`` belongs to. A replanned plan starts at the parent's ``from_step``: a state at another
    step is refused (the replanned epoch would repeat or skip samples)."""
    info = lineage(plan)
    if not info or state.get("plan") != info.get("parent"):
        return None
    if info.get("kind") == "extend":
        return {**state, "plan": plan.fingerprint}
    step = int(state.get("step", -1))
    if step != int(info["from_step"]):
        raise PlanError(f"the sampler state is at step {step} of the parent plan, but this plan was replanned from "
                        f"step {int(info['from_step'])}; replan from the state (`varlen replan --state`)")
    return {"plan": plan.fingerprint, "epoch": 0, "step": 0, "micro": 0, "dp": plan.dp}


def lr_state_from_parent(plan: Plan, lr_state: dict) -> dict:
    """A ``VariableBatchSizeLR.state_dict()`` saved on the parent, for ``plan``: its step index counts
    from the plan's step 0 (the base scheduler's own state is kept, so the schedule continues).
    ``VariableBatchSizeLR.load_state_dict`` does this by itself for a state that names the parent."""
    info = lineage(plan)
    if info.get("kind") != "replan" or "from_step" not in info or lr_state.get("plan") == plan.fingerprint:
        return lr_state  # (a state already converted says so: converting twice would shift it again)
    return {**lr_state, "step": int(lr_state["step"]) - int(info["from_step"]), "plan": plan.fingerprint}
