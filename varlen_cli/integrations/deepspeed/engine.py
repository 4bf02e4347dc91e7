"""``initialize`` and ``backward``: the DeepSpeed engine on a plan (see the package docstring)."""

from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from ...loader import VariableBatchSizeLR, dataloader_for_plan
from ...loader.plan_file import Plan, PlanError
from ...loader.replan import first_step
from .. import open_plan
from .binding import TRAINING_DATA, PlanBinding, bind, binding_of, check_position, sync_lr, write_step_figures
from .config import check_engine, engine_config
from .pipe import PipeLoader, check_pipe_plan


def initialize(plan: Plan | str | os.PathLike, dataset, *, model, config, optimizer=None, model_parameters=None,
               lr_scheduler=None, collate_fn=None, mpu=None, pipe_inputs: tuple[str, ...] = ("input_ids",),
               **loader_kwargs):
    """``deepspeed.initialize`` for a plan: ``(engine, optimizer, loader, lr_scheduler)``.

    The config gets the plan's ``gradient_accumulation_steps`` and micro batch size (a contradicting
    one is refused); ``loader`` is the plan loader of this rank of the engine's data-parallel group
    (``collate_fn`` and ``loader_kwargs`` go to :func:`~varlen_cli.loader.dataloader_for_plan`; for a
    ``PipelineModule``, a :class:`~.pipe.PipeLoader` of ``(inputs, labels)`` tuples);
    ``lr_scheduler`` (yours, the config's, or a constant LR) is wrapped in the plan's
    :class:`~varlen_cli.loader.VariableBatchSizeLR`, which the engine steps. ``mpu``: a model-parallel
    unit, as for DeepSpeed; ``pipe_inputs``: the batch keys a pipeline's first stage gets.
    """
    if "training_data" in loader_kwargs:
        raise PlanError(TRAINING_DATA)
    if isinstance(dataset, torch.utils.data.DataLoader):
        raise PlanError("initialize takes the map-style dataset (item i = sample i), not a DataLoader: varlen builds "
                        "the plan's loader over it")
    plan = open_plan(plan)
    pipe = isinstance(model, PipelineModule)
    if pipe:
        check_pipe_plan(plan, model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model_parameters,
                                           lr_scheduler=lr_scheduler, mpu=mpu, config=engine_config(config, plan, pipe))
    check_engine(engine)
    rank, dp = data_parallel(engine)
    check_same_plan(plan)
    loader = dataloader_for_plan(dataset, plan, rank=rank, world_size=dp, collate_fn=collate_fn, **loader_kwargs)
    loads_data = not pipe or engine.is_first_stage() or engine.is_last_stage()
    base = engine.lr_scheduler if engine.lr_scheduler is not None else engine.optimizer
    lr = VariableBatchSizeLR(base, plan, guard=loader if loads_data else None, check=loads_data)
    engine.lr_scheduler = lr  # stepped by the engine after every optimizer step it applies
    binding = PlanBinding(plan=plan, loader=loader, lr=lr, rank=rank, dp=dp, loads_data=loads_data)
    if pipe:
        binding.loader = PipeLoader(loader, engine, binding, inputs=pipe_inputs)
    bind(engine, binding)
    return engine, engine.optimizer, binding.loader, lr


def data_parallel(engine) -> tuple[int, int]:
    """``(rank, size)`` of this process in the engine's data-parallel group (not the world, when pipeline
    or tensor parallelism is on)."""
    group = engine.data_parallel_group
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size != engine.dp_world_size:
        raise PlanError(f"the engine's data-parallel group has {size} ranks but it averages gradients over "
                        f"{engine.dp_world_size}: not supported")
    return rank, size


def check_same_plan(plan: Plan) -> None:
    """Every rank runs the same plan: ranks with other plans would run unequal microbatch counts per step,
    on which ZeRO 2/3's per-microbatch gradient reduction (and a pipeline's sends) hang."""
    mine = (plan.fingerprint, plan.num_steps, plan.grad_accum, first_step(plan), plan.path)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    other = next((r for r, theirs in enumerate(everyone) if theirs[:4] != mine[:4]), None)
    if other is not None:
        theirs = everyone[other]
        raise PlanError(f"rank {other} trains another plan ({theirs[4]}: {theirs[1]} steps x grad_accum {theirs[2]}) "
                        f"than rank {dist.get_rank()} ({plan.path}: {plan.num_steps} steps x grad_accum "
                        f"{plan.grad_accum}): every rank must train the same plan (unequal microbatch counts per step "
                        f"hang ZeRO 2/3 and pipelines)")


def backward(engine, loss_sum: torch.Tensor, batch: dict):
    """``engine.backward`` of a microbatch's *summed* token loss, normalised to the exact mean over the
    whole step's loss targets across ranks: ``loss_sum * dp / batch["step_loss_tokens"]``, with the
    engine's own division by ``gradient_accumulation_steps`` off (``scale_wrt_gas=False``). Call
    ``engine.step()`` after every microbatch, as usual; the engine applies the update at the plan's
    step boundary. Returns what ``engine.backward`` returns."""
    binding = binding_of(engine)
    check_position(engine, binding, batch, micro=True)
    sync_lr(engine, binding)
    targets = max(int(batch["step_loss_tokens"]), 1)  # a step without targets: loss_sum is 0
    out = engine.backward(loss_sum * (binding.dp / targets), scale_wrt_gas=False)
    write_step_figures(engine, binding, batch)
    return out


