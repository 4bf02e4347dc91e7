"""``varlen replan`` and ``varlen plan --extend``: new plans derived from a plan being trained.

- :func:`replan`: the rest of a plan from global step N on, for another number of ranks (``--dp``),
  microbatches per rank or budget. Its first epoch holds exactly the samples of the epoch in
  progress that steps < N did not consume, formed by the parent's order strategy (curriculum
  continues where it stopped, bucket-shuffle reshuffles the remainder); the parent's later epochs
  follow, planned afresh for the new layout. LR scales keep the parent's ``base_batch_size``.
- :func:`extend`: the same plan with more epochs; the existing rows are copied unchanged.

Both reuse the planner (``core.epoch_inputs``, ``core.plan_epochs``, ``core.assemble_columns``,
``core.finish``) and record where they come from in the metadata's ``lineage``
(docs/plan.md, "Re-planning a running job").
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, UsageError
from ..runtime import rank0, safety
from ..runtime.choices import doc
from . import core
from .core import PlanConfig, PlanResult
from .shapes import Budget


@dataclass(frozen=True)
class ReplanConfig:
    """Options of ``varlen replan`` (see ``varlen replan --help`` and docs/plan.md)."""

    plan: str = doc(help="The plan being trained (the parent).")
    output: str = doc(help="The new plan file to write.")
    dp: int = doc(help="Data-parallel ranks of the restarted job.")
    from_step: int | None = doc(None, "Global step of the parent to resume at: steps < N are done.")
    state: str | None = doc(None, "A sampler state JSON (PlanBatchSampler.state_dict()) of the parent: resume at "
                                  "its step.")
    grad_accum: int | None = doc(None, "Microbatches per rank per step (default: the parent's).")
    max_tokens: int | None = doc(None, "Budget of the new plan (default: the parent's).")
    overwrite: bool = doc(False, "Replace an existing output (written atomically either way).")
    allow_stale: bool = doc(False, "Use metrics even if their source files changed since `varlen analyze`.")


@dataclass(frozen=True)
class ExtendConfig:
    """Options of ``varlen plan --extend PLAN --epochs E``."""

    plan: str = doc(help="The plan to lengthen.")
    output: str = doc(help="The extended plan file to write.")
    epochs: int = doc(help="Epochs of the extended plan (more than the plan has).")
    input: str | None = doc(None, "The plan's metrics/sorted directory, if it moved (default: the recorded path).")
    overwrite: bool = doc(False, "Replace an existing output (written atomically either way).")
    allow_stale: bool = doc(False, "Use metrics even if their source files changed since `varlen analyze`.")


# -- the parent ------------------------------------------------------------------------------------
@dataclass
class Parent:
    """What replan/extend read of the parent plan: its metadata and fingerprint (footer only; no torch)."""

    path: str
    meta: dict
    fingerprint: str  # as ``varlen_cli.loader.Plan.fingerprint`` and sampler states

    @property
    def dp(self) -> int:
        return int(self.meta["dp"])

    @property
    def grad_accum(self) -> int:
        return int(self.meta["grad_accum"])

    @property
    def num_steps(self) -> int:
        return int(self.meta["num_steps"])

    @property
    def config(self) -> dict:
        return self.meta.get("config") or {}

    @property
    def input(self) -> dict:
        return self.meta.get("input") or {}

    @property
    def packing(self) -> dict:
        return self.meta.get("packing") or {}

    @property
    def steps_per_epoch(self) -> list[int]:
        return [int(s) for s in self.meta["steps_per_epoch"]]

    @property
    def epochs(self) -> int:
        return len(self.steps_per_epoch)

    def epoch_of(self, step: int) -> int:
        return int(np.searchsorted(np.cumsum(self.steps_per_epoch), step, side="right"))


def open_parent(path: str) -> Parent:
    """The parent plan; an unreadable one is an input error."""

    from .. import format

    if not os.path.isfile(path):
        raise InputError(f"plan {path} does not exist")
    try:
        meta, schema = format.read_plan_metadata(path)
    except format.FormatError as exc:
        raise InputError(str(exc)) from None
    problems = format.plan_schema_problems(schema, meta)
    if problems:
        raise InputError(f"{path} {problems[0]}")
    plan = Parent(path, meta, format.plan_fingerprint(schema))
    if plan.meta.get("mixture"):
        raise UsageError(f"{path} is a mixture plan (--mix): replan and --extend do not support mixtures yet; "
                         "plan afresh")
    return plan


def recorded_input(parent) -> str | None:
    """The parent's input directory: its recorded path, or, when that is gone (the plan and its input
    moved together, as `varlen run` does when it swaps OUT in), the same place relative to the plan."""
    recorded = parent.input or {}
    path, relative = recorded.get("path"), recorded.get("relative_path")
    if path and os.path.exists(path) or not relative:
        return path
    moved = os.path.join(os.path.dirname(os.path.abspath(parent.path)), relative)
    return moved if os.path.exists(moved) else path


def parent_config(parent, **overrides) -> PlanConfig:
    """The parent's PlanConfig with ``overrides`` (None values keep the parent's)."""
    recorded = parent.config
    names = {f.name for f in dataclasses.fields(PlanConfig)}
    values = {k: v for k, v in recorded.items() if k in names}
    values["input"] = recorded_input(parent) or values.get("input")
    values["base_batch_size"] = parent.meta.get("base_batch_size")
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return PlanConfig(**values)
    except TypeError as exc:
        raise InputError(f"{parent.path} has an unreadable config: {exc}") from None


def read_parent_input(parent, c: PlanConfig) -> tuple[dict, np.ndarray, np.ndarray]:
    """The parent's metrics/sorted directory; refused if it is not the one the parent was planned from."""
    manifest, sample_id, length = core.read_input(c.input, c.allow_stale)
    recorded = parent.input or {}
    if recorded.get("num_rows") is not None and int(recorded["num_rows"]) != len(sample_id):
        raise InputError(f"{c.input} changed since {parent.path} was planned: it has {len(sample_id):,} samples, "
                         f"the plan was made for {int(recorded['num_rows']):,}")
    if recorded.get("artifact_id") and manifest.get("artifact_id") != recorded["artifact_id"]:
        raise InputError(f"{c.input} changed since {parent.path} was planned (artifact_id "
                         f"{manifest.get('artifact_id')}, the plan was made from {recorded['artifact_id']})")
    return manifest, sample_id, length


def lineage_of(parent) -> dict:
    return parent.meta.get("lineage") or {}


# -- shared engine ---------------------------------------------------------------------------------
def _keep(positions: np.ndarray | None, keep: np.ndarray) -> np.ndarray | None:
    return None if positions is None else positions[keep[positions]]


def plan_epochs_from(c: PlanConfig, manifest: dict, sample_id: np.ndarray, length: np.ndarray, *, first_epoch: int,
                     first_keep: np.ndarray | None, lineage: dict | None, t0: float) -> PlanResult:
    """Plan ``c.epochs`` epochs numbered from ``first_epoch`` (seed streams, curriculum switch); the first
    one restricted to the input positions where ``first_keep`` is true (if given). Writes ``c.output``."""
    core.check(c)
    budget = Budget(c.max_tokens, c.max_samples, float(c.attention_cost))
    inputs, long_pos = core.epoch_inputs(c, sample_id, length, budget)
    epochs, fixed_batch = [], None
    if first_keep is not None:
        first = dataclasses.replace(inputs, ordered=_keep(inputs.ordered, first_keep),
                                    canon=_keep(inputs.canon, first_keep))
        epochs, fixed_batch = core.plan_epochs(dataclasses.replace(c, epochs=1), first, first_epoch)
    if c.epochs > len(epochs):
        more, fixed_more = core.plan_epochs(dataclasses.replace(c, epochs=c.epochs - len(epochs)), inputs,
                                             first_epoch + len(epochs))
        epochs += more
        fixed_batch = fixed_batch if fixed_batch is not None else fixed_more
    cols, items = core.assemble_columns(c, sample_id, length, epochs, inputs.slots,
                                        core.read_targets(c, c.input, manifest))
    return core.finish(c, manifest, sample_id, epochs, cols, items, long_pos, inputs, fixed_batch, t0,
                        extra_metadata={"lineage": lineage} if lineage is not None else None)


# -- replan ----------------------------------------------------------------------------------------
def resume_step(config: ReplanConfig, parent) -> int:
    """The parent's global step to resume at, from ``--from-step`` or ``--state``."""
    if (config.from_step is None) == (config.state is None):
        raise UsageError("give exactly one of --from-step N and --state SAMPLER_STATE.json")
    if config.state is not None:
        state = _read_state(config.state)
        if state.get("plan") != parent.fingerprint:
            raise InputError(f"the sampler state {config.state} was saved with another plan (fingerprint "
                             f"{state.get('plan')}, {parent.path} has {parent.fingerprint})")
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise InputError(f"the sampler state {config.state} has no integer 'step'")
    else:
        step = config.from_step
    if step < 0:
        raise UsageError(f"--from-step must be >= 0 (got {step})")
    if step >= parent.num_steps:
        raise UsageError(f"step {step} is beyond the plan: {parent.path} has {parent.num_steps} steps "
                         f"(0..{parent.num_steps - 1}), nothing is left to replan")
    return int(step)


def _read_state(path: str) -> dict:
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise InputError(f"sampler state {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read sampler state {path}: {exc}") from None
    if not isinstance(state, dict):
        raise InputError(f"sampler state {path} is not a JSON object")
    return state


def remaining_positions(parent, step: int, sample_id: np.ndarray) -> tuple[int, np.ndarray, int]:
    """``(epoch, keep, consumed)``: the epoch of ``step``, a mask of the input positions of that epoch's
    samples not consumed in steps < ``step``, and how many were consumed."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    epoch = parent.epoch_of(step)
    table = pq.read_table(parent.path, columns=["step", "sample_ids"], filters=[("epoch", "=", epoch)])
    later = pc.greater_equal(table.column("step"), step)
    rest_ids = pc.list_flatten(table.filter(later).column("sample_ids")).to_numpy(zero_copy_only=False)
    consumed = int(pc.sum(pc.list_value_length(table.filter(pc.invert(later)).column("sample_ids"))).as_py() or 0)
    pos = _positions(sample_id, rest_ids)
    if pos is None:
        raise InputError(f"{parent.path} holds sample ids its input does not have; re-plan from the input")
    keep = np.zeros(len(sample_id), bool)
    keep[pos] = True
    return epoch, keep, consumed


def _positions(sample_id: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
    """Input positions of ``ids`` (None if one is not in the input): a direct table for dense ids."""
    if not len(ids):
        return np.zeros(0, np.int64)
    lo, hi = int(sample_id.min()), int(sample_id.max())
    if lo >= 0 and hi < 2 * len(sample_id) + 1024:
        table = np.full(max(hi, int(ids.max())) + 1, -1, np.int64)
        table[sample_id] = np.arange(len(sample_id), dtype=np.int64)
        pos = table[ids] if int(ids.min()) >= 0 else np.array([-1])
        return None if bool((pos < 0).any()) else pos
    order = np.argsort(sample_id, kind="stable")
    found = np.minimum(np.searchsorted(sample_id[order], ids), len(order) - 1)
    return order[found] if np.array_equal(sample_id[order[found]], ids) else None


def replan(config: ReplanConfig) -> PlanResult:
    """Run ``varlen replan``: write the rest of ``config.plan`` from its step N on for ``config.dp`` ranks."""
    if rank0.needs_group():  # under torchrun: rank 0 replans and writes, the others wait
        return rank0.on_rank0(replan, config)
    t0 = time.perf_counter()
    safety.check_no_overlap(config.output, [config.plan])
    parent = open_parent(config.plan)
    step = resume_step(config, parent)
    if (parent.packing or {}).get("split_long"):
        raise UsageError(f"{parent.path} splits long samples (--split-long): a step may hold part of a sample, "
                         "so it cannot be replanned at a step; plan afresh")
    c = parent_config(parent, output=config.output, dp=config.dp, grad_accum=config.grad_accum,
                      max_tokens=config.max_tokens, overwrite=config.overwrite, allow_stale=config.allow_stale)
    safety.check_no_overlap(c.output, [c.input])
    core.writer.check_output(c.output, c.overwrite)
    manifest, sample_id, length = read_parent_input(parent, c)
    epoch, keep, consumed = remaining_positions(parent, step, sample_id)
    before = lineage_of(parent)
    lineage = {"kind": "replan", "parent": parent.fingerprint, "parent_path": os.path.abspath(parent.path),
               "from_step": step, "consumed_samples": consumed,
               "first_step": int(before.get("first_step", 0)) + step,
               "first_epoch": int(before.get("first_epoch", 0)) + epoch,
               "parent_dp": parent.dp, "parent_grad_accum": parent.grad_accum}
    c = dataclasses.replace(c, epochs=parent.epochs - epoch)
    return plan_epochs_from(c, manifest, sample_id, length, first_epoch=int(before.get("first_epoch", 0)) + epoch,
                            first_keep=keep, lineage=lineage, t0=t0)


# -- extend ----------------------------------------------------------------------------------------
def extend(config: ExtendConfig) -> PlanResult:
    """Run ``varlen plan --extend``: the plan's rows unchanged, then epochs up to ``config.epochs``."""
    t0 = time.perf_counter()
    parent = open_parent(config.plan)
    if config.epochs <= parent.epochs:
        raise UsageError(f"--epochs {config.epochs} must be more than the {parent.epochs} epoch(s) of "
                         f"{parent.path} to extend it")
    safety.check_no_overlap(config.output, [config.plan, config.input or recorded_input(parent)])
    core.writer.check_output(config.output, config.overwrite)
    out_dir = os.path.dirname(os.path.abspath(config.output))
    tmp = os.path.join(out_dir, f".{os.path.basename(config.output)}.extend-{os.getpid()}-{time.time_ns()}")
    c = parent_config(parent, input=config.input, output=tmp, epochs=config.epochs - parent.epochs,
                      overwrite=False, allow_stale=config.allow_stale)
    manifest, sample_id, length = read_parent_input(parent, c)
    before = lineage_of(parent)
    try:
        more = plan_epochs_from(c, manifest, sample_id, length, first_epoch=int(before.get("first_epoch", 0)) +
                                parent.epochs, first_keep=None, lineage=None, t0=t0)
        from .extend import merge

        lineage = {**before, "kind": "extend", "parent": parent.fingerprint,
                   "parent_path": os.path.abspath(parent.path), "parent_steps": parent.num_steps,
                   "parent_epochs": parent.epochs}
        return merge(parent, more, dataclasses.replace(c, output=config.output, overwrite=config.overwrite,
                                                       epochs=config.epochs), lineage, t0)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


EXTEND_KEEPS = ("input", "output", "epochs", "overwrite", "allow_stale", "extend")  # others: refused


def run_extend(given: PlanConfig) -> PlanResult:
    """``plan(PlanConfig(extend=PLAN, epochs=E, output=OUT))``: refuses options that would change the plan."""
    defaults = PlanConfig(input="", output="")
    for f in dataclasses.fields(PlanConfig):
        if f.name not in EXTEND_KEEPS and getattr(given, f.name) != getattr(defaults, f.name):
            option = "--" + f.name.replace("_", "-")
            raise UsageError(f"{option} cannot be combined with --extend: the extended plan keeps the plan's options "
                             "(use `varlen replan` to change the layout)")
    return extend(ExtendConfig(plan=given.extend, output=given.output, epochs=given.epochs, input=given.input or None,
                               overwrite=given.overwrite, allow_stale=given.allow_stale))
