"""What ties an engine to its plan: the binding :func:`~.engine.initialize` records, the position check
and the LR sync that :func:`~.engine.backward`, the pipeline loader and the checkpoints share."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ...loader import VariableBatchSizeLR, plan_metric_events
from ...loader.plan_file import Plan, PlanError
from ...loader.position import batch_position, describe
from ...loader.replan import first_step

TRAINING_DATA = ("deepspeed.initialize(training_data=...) wraps the dataset in DeepSpeed's own loader, whose "
                 "DistributedSampler re-shards it across the ranks: its batches are not the plan's. Pass the dataset "
                 "to varlen_cli.integrations.deepspeed.initialize(plan, dataset, ...) and train on the loader it "
                 "returns")


@dataclass
class PlanBinding:
    """What :func:`~.engine.initialize` ties to an engine: the plan, this rank's loader, the plan's LR scheduler."""

    plan: Plan
    loader: Any  # the plan loader (PipeLoader for a PipelineModule)
    lr: VariableBatchSizeLR
    rank: int  # data-parallel rank and size: the engine's data-parallel group
    dp: int
    loads_data: bool  # False on the middle stages of a pipeline


_BINDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bind(engine, binding: PlanBinding) -> None:
    """Record ``binding`` as ``engine``'s plan; follow the updates DeepSpeed skips (:func:`follow_skipped_steps`)."""
    _BINDINGS[engine] = binding
    follow_skipped_steps(engine, binding)


def binding_of(engine) -> PlanBinding:
    """The plan an engine was made for by :func:`~.engine.initialize` (refuses any other engine)."""
    binding = _BINDINGS.get(engine)
    if binding is not None:
        return binding
    if getattr(engine, "training_dataloader", None) is not None:
        raise PlanError(TRAINING_DATA)
    raise PlanError("this DeepSpeed engine was not made by varlen_cli.integrations.deepspeed.initialize(plan, dataset, "
                    "...): its gradient accumulation, LR schedule and loader do not follow the plan")


def check_position(engine, binding: PlanBinding, batch: Any, micro: bool) -> tuple[int, int, int, int]:
    """The batch is the microbatch the engine is at: the plan's step (the engine's global step minus the
    steps before a replanned plan) and, with ``micro``, its micro index."""
    pos = batch_position(batch)
    plan = binding.plan
    step = engine.global_steps - first_step(plan)
    at = engine.micro_steps % plan.grad_accum if micro else pos[3]
    if (pos[1], pos[3]) == (step, at):
        return pos
    if engine.global_steps < first_step(plan):
        raise PlanError(f"{plan.path} continues a job from its global step {first_step(plan)} (made by `varlen "
                        f"replan`) but the engine is at step {engine.global_steps}: load the checkpoint it was made "
                        f"from (varlen_cli.integrations.deepspeed.load_checkpoint)")
    raise PlanError(f"desync: the microbatch at {describe(pos)} reaches the DeepSpeed engine at plan step {step}"
                    + (f", micro {at}" if micro else "") + ": call engine.step() after every microbatch, and resume "
                    "the engine and the loader together (varlen_cli.integrations.deepspeed.load_checkpoint)")


def sync_lr(engine, binding: PlanBinding) -> None:
    """Bring the plan's ``VariableBatchSizeLR`` to the engine's step. DeepSpeed steps the scheduler only
    after an update it applied; an update it skipped (fp16 or bf16 gradient overflow) leaves it one
    step behind the data. Here the scheduler steps for each skipped step too, so the LR at every step
    the engine applies is the base schedule there x the plan's ``lr_scale`` there (the skipped step's
    microbatches were consumed; its update is lost, as always with a skipped step)."""
    lr = binding.lr
    behind = engine.global_steps - first_step(binding.plan) - lr.step_index
    if behind == 0:
        return
    if behind < 0 or behind > engine.skipped_steps:
        raise PlanError(f"desync: the plan's LR scheduler is at step {lr.step_index} but the DeepSpeed engine at plan "
                        f"step {lr.step_index + behind} ({engine.skipped_steps} skipped): step the scheduler only "
                        f"through the engine, and resume both from one checkpoint")
    for _ in range(behind):
        lr.step()


def follow_skipped_steps(engine, binding: PlanBinding) -> None:
    """Also sync the LR right before every update the engine applies (a torch optimizer step pre-hook):
    the middle stages of a pipeline load no data, so nothing else of theirs runs between steps."""
    optimizer = engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer) and getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    ref = weakref.ref(engine)

    def before_update(*_) -> None:
        if ref() is not None:
            sync_lr(ref(), binding)

    optimizer.register_step_pre_hook(before_update)


def write_step_figures(engine, binding: PlanBinding, batch: Any) -> None:
    """The plan's figures of the batch's optimizer step (``varlen/*`` and ``global_seqlen/*``:
    :func:`varlen_cli.loader.plan_metric_events`) to DeepSpeed's monitor when its config enables one
    (TensorBoard, W&B, CSV, Comet; DeepSpeed writes on rank 0): once per step, at the step's last
    microbatch, at x = ``engine.global_steps`` once the step's update is applied (DeepSpeed's own axis:
    the plan's step + 1, counting the steps before a replanned plan)."""
    monitor = getattr(engine, "monitor", None)
    info = batch.get("info") if isinstance(batch, dict) else None
    if monitor is None or not monitor.enabled or info is None or info.micro != binding.plan.grad_accum - 1:
        return
    monitor.write_events(plan_metric_events(batch, engine.global_steps + 1))
