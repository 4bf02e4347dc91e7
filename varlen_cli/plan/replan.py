"""``varlen replan``: the rest of a plan being trained, from global step N on, for another number of
ranks (``--dp``), microbatches per rank or budget.

Its first epoch holds exactly what the epoch in progress had left at step N (whole samples, and
the chunks left of samples a ``--split-long`` plan had started), formed by the parent's order
strategy (curriculum continues where it stopped, bucket-shuffle reshuffles the remainder); the
parent's later epochs follow, planned afresh for the new layout. LR scales keep the parent's
``base_batch_size``; the budget is the parent's (:mod:`.cost_model`, :func:`rebudget`), with a
``--max-memory`` limit re-checked. Works for every plan ``varlen plan`` writes, mixtures included,
in bounded memory: the epoch in progress's rest is read window by window (:func:`.parent.left_samples`:
a bitmap of the samples left whole, a count per sample for a mixture's copies, and the chunks left of
``--split-long`` samples cut across step N, which keep their cuts), and the chunked planner
(``--nproc`` workers) plans from its chunks (:class:`.chunked.run.Continuation`).
``varlen plan --extend`` is :mod:`.extend`. Both record where they come from in
the metadata's ``lineage`` (docs/plan.md, "Re-planning a running job").
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass

from .. import format, storage
from ..errors import InputError, UsageError
from ..runtime import rank0, safety
from ..runtime.choices import (
    ALLOW_MEMORY_EXTRAPOLATION_HELP,
    ALLOW_STALE_HELP,
    NPROC_HELP,
    OVERWRITE_HELP,
    PANEL_RUN,
    STORAGE_OPTION_HELP,
    doc,
)
from ..storage.files import open_regular
from . import writer
from .chunked.run import Continuation, plan_chunked
from .config import MEMORY, PlanResult
from .cost_model import rebudget
from .extend import ExtendConfig, extend
from .parent import (
    REPLAN_REMEDIES,
    Parent,
    config_record,
    continued_input,
    left_samples,
    open_parent,
    parent_config,
)

__all__ = ["ExtendConfig", "ReplanConfig", "extend", "replan"]
TOO_BIG = ("run it on a machine with more memory (`varlen replan` holds the microbatch tables of the epochs it "
           "plans and one chunk)")


@dataclass(frozen=True)
class ReplanConfig:
    """Options of ``varlen replan`` (see ``varlen replan --help`` and docs/plan.md)."""

    plan: str = doc(help="The plan being trained (the parent).")
    output: str = doc(help="The new plan file to write.")
    dp: int = doc(help="Data-parallel ranks of the restarted job.")
    from_step: int | None = doc(None, "Global step of the parent to resume at: steps < N are done (or pass --state).")
    state: str | None = doc(None, "A sampler state JSON of the parent (PlanBatchSampler.state_dict()): resume at "
                                  "its step.")
    grad_accum: int | None = doc(None, "Microbatches per rank per step (default: the parent's).")
    max_tokens: int | None = doc(None, "Budget of the new plan (default: the parent's; a parent's --max-memory limit "
                                       "is re-checked).")
    max_memory: str | None = doc(None, "New peak memory limit, e.g. 70GiB (default: the parent's); the budget comes "
                                       "from --memory-profile or the profile the parent recorded.", panel=MEMORY)
    memory_profile: str | None = doc(None, "Memory profile for --max-memory (default: the one the parent recorded).",
                                     panel=MEMORY)
    allow_memory_extrapolation: bool = doc(False, ALLOW_MEMORY_EXTRAPOLATION_HELP, panel=MEMORY)
    overwrite: bool = doc(False, OVERWRITE_HELP, panel=PANEL_RUN)
    allow_stale: bool = doc(False, ALLOW_STALE_HELP, panel=PANEL_RUN)
    storage_options: tuple = doc((), STORAGE_OPTION_HELP, panel=PANEL_RUN)
    nproc: int = doc(1, NPROC_HELP, panel=PANEL_RUN)
    progress: bool = doc(True, "Show a progress bar on rank 0 (only on a terminal).", panel=PANEL_RUN)


def resume_step(config: ReplanConfig, parent: Parent) -> int:
    """The parent's global step to resume at, from ``--from-step`` or ``--state``."""
    if (config.from_step is None) == (config.state is None):
        raise UsageError("give exactly one of --from-step N and --state SAMPLER_STATE.json")
    if config.state is not None:
        return _state_step(config.state, parent)
    step = config.from_step
    if step < 0:
        raise UsageError(f"--from-step must be >= 0 (got {step})")
    if step >= parent.num_steps:
        raise UsageError(f"step {step} is beyond the plan: {parent.path} has {parent.num_steps} steps "
                         f"(0..{parent.num_steps - 1}), nothing is left to replan")
    return int(step)


def _state_step(path: str, parent: Parent) -> int:
    """The step of the sampler state ``path``, checked as the loader checks a state (its shape, then
    the parent's plan: fingerprint, micro and step in range)."""
    state = _read_state(path)
    problem = format.loader_state_problem(state)
    if problem is not None:
        raise InputError(f"the sampler state {path} is not a loader state: {problem}")
    if state.get("plan") != parent.fingerprint:
        raise InputError(f"the sampler state {path} was saved with another plan (fingerprint "
                         f"{state.get('plan')}, {parent.path} has {parent.fingerprint})")
    step, micro = int(state["step"]), int(state["micro"])
    if micro >= parent.grad_accum:
        raise InputError(f"the sampler state {path} is at micro {micro} of step {step}, but {parent.path} has "
                         f"grad_accum {parent.grad_accum} (micros 0..{parent.grad_accum - 1})")
    if step >= parent.num_steps:
        where = "the end" if step == parent.num_steps else "beyond the end"
        raise InputError(f"the sampler state {path} is at step {step}, {where} of {parent.path} "
                         f"({parent.num_steps} steps): nothing is left to replan")
    epoch = int(state["epoch"])
    if epoch != parent.epoch_of(step):
        raise InputError(f"the sampler state {path} says epoch {epoch} at step {step}, but step {step} of "
                         f"{parent.path} is in epoch {parent.epoch_of(step)}")
    _check_history(state, path, parent, step * parent.grad_accum + micro)
    if epoch in (state.get("ledger") or {}).get("ended", []):  # saved after loader.end_epoch()
        nxt = sum(parent.steps_per_epoch[:epoch + 1])  # the next epoch's first step
        then = (f"replan from there with --from-step {nxt}" if nxt < parent.num_steps else
                f"nothing is left to replan ({parent.path} has {parent.num_steps} steps)")
        raise InputError(f"the sampler state {path} is in epoch {epoch}, which its ledger says was ended early "
                         f"(loader.end_epoch()): its loader resumes at the next epoch, step {nxt}; {then}")
    return step


def _check_history(state: dict, path: str, parent: Parent, position: int) -> None:
    """The state's ledger must be a history of the parent, as the loader checks it (a gap would be
    replanned away, never trained)."""
    ledger = state.get("ledger")
    if ledger is None:
        return
    ga = parent.grad_accum

    def describe(k: int) -> str:
        return f"(step {k // ga}, micro {k % ga})"

    problem = format.ledger_history_problem([[int(a), int(b)] for a, b in ledger.get("consumed", [])],
                                            {int(e) for e in ledger.get("ended", [])}, position, ga,
                                            list(parent.meta["steps_per_epoch"]), describe)
    if problem is not None:
        raise InputError(f"the sampler state {path} is not a loader state of {parent.path}: {problem}")


def _read_state(path: str) -> dict:
    if os.path.isdir(path):
        raise InputError(f"sampler state {path} is a directory, not a JSON file")
    try:
        with open_regular(path, what="sampler state") as f:
            state = json.load(f)
    except FileNotFoundError:
        raise InputError(f"sampler state {path} does not exist") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested past Python's limit
        raise InputError(f"cannot read sampler state {path}: {exc}") from None
    if not isinstance(state, dict):
        raise InputError(f"sampler state {path} is not a JSON object")
    return state


def replan(config: ReplanConfig) -> PlanResult:
    """Run ``varlen replan``: write the rest of ``config.plan`` from its step N on for ``config.dp`` ranks."""
    if rank0.needs_group():  # under torchrun: rank 0 replans and writes, the others wait
        return rank0.on_rank0(replan, config)
    t0 = time.perf_counter()
    storage.configure(config.storage_options)  # the plan's input and the output may be in object storage
    safety.check_no_overlap(config.output, safety.stage_inputs(config))
    parent = open_parent(config.plan)
    step = resume_step(config, parent)
    c = parent_config(parent, output=config.output, dp=config.dp, grad_accum=config.grad_accum,
                      overwrite=config.overwrite, allow_stale=config.allow_stale,
                      storage_options=config.storage_options)
    budget = rebudget(parent.budget, max_tokens=config.max_tokens, max_memory=config.max_memory,
                      memory_profile=config.memory_profile,
                      allow_memory_extrapolation=config.allow_memory_extrapolation)
    if c.drop_long and budget != parent.budget:
        raise UsageError(f"{config.plan} drops the samples that fit no microbatch (--drop-long), and replan cannot "
                         "move it to another budget: the samples a new budget drops or lets in cannot be told apart "
                         "from those the epoch in progress already trained; replan with the plan's budget, or plan "
                         "the rest afresh (`varlen plan --drop-long` with the new budget)")
    if config.allow_memory_extrapolation:  # recorded with the new limit (config_record), for --extend
        c = dataclasses.replace(c, allow_memory_extrapolation=True)
    inputs = [c.input] if not parent.mixture else [s["path"] for s in parent.mixture["sources"] if s.get("path")]
    safety.check_no_overlap(c.output, inputs)
    writer.check_output(c.output, c.overwrite)
    sizes, mixture = continued_input(parent, c)  # the parent's input, unchanged (from the manifests)
    left = left_samples(parent, step, sizes)
    lineage = _lineage(parent, step, left.epoch, left.consumed)
    c = dataclasses.replace(c, epochs=parent.epochs - left.epoch, nproc=config.nproc, progress=config.progress)
    cont = Continuation(lineage["first_epoch"], budget, REPLAN_REMEDIES, too_big=TOO_BIG, first=left,
                        metadata={"lineage": lineage, "config": config_record(c, budget)}, **mixture)
    return plan_chunked(c, t0, cont)


def _lineage(parent: Parent, step: int, epoch: int, consumed: int) -> dict:
    """Where the replanned plan sits in the job (docs/plan.md, "Re-planning a running job")."""
    before = parent.lineage
    # the parent's first epoch may itself lack what an earlier replan consumed: counted together
    earlier = int(before.get("consumed_samples") or 0) if epoch == 0 else 0
    return {"kind": "replan", "parent": parent.fingerprint, "parent_path": os.path.abspath(parent.path),
            "from_step": step, "consumed_samples": consumed + earlier,
            "first_step": int(before.get("first_step", 0)) + step,
            "first_epoch": int(before.get("first_epoch", 0)) + epoch,
            "parent_dp": parent.dp, "parent_grad_accum": parent.grad_accum}
