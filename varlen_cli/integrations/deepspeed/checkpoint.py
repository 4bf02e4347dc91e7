"""``save_checkpoint`` / ``load_checkpoint``: DeepSpeed's own checkpoints, with the plan position inside.

The loader's position and ledger ride in DeepSpeed's ``client_state`` (key ``"varlen"``); the plan's
``VariableBatchSizeLR`` is the engine's scheduler, so DeepSpeed saves and loads it itself. A
checkpoint is taken at a step boundary (after ``engine.step()`` of a step's last microbatch), with
every rank at the same plan position. It loads into the same plan (a mid-epoch resume continues
bit for bit) or into a plan made from it by ``varlen replan --from-step N --dp M`` (the elastic
restart: the loader converts the parent's position, the scheduler its step).
"""

from __future__ import annotations

import torch.distributed as dist

from ...loader.plan_file import PlanError
from ...loader.replan import first_step
from .binding import binding_of, sync_lr

CLIENT_KEY = "varlen"


def _check_loader(binding, loader) -> None:
    if loader is not binding.loader and loader is not getattr(binding.loader, "loader", None):
        raise PlanError("this loader is not the one varlen_cli.integrations.deepspeed.initialize returned with the "
                        "engine: save and load the engine together with its own loader")


def save_checkpoint(engine, loader, save_dir: str, tag=None, **kwargs):
    """``engine.save_checkpoint(save_dir, tag, client_state=...)`` with the plan position of ``loader``
    (all ranks call it, at a step boundary). Other keyword arguments go to DeepSpeed."""
    binding = binding_of(engine)
    _check_loader(binding, loader)
    sync_lr(engine, binding)  # a skipped last step: the scheduler's state says the step the data is at
    mine = loader.state_dict() if binding.loads_data else None
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    positions = {(s["epoch"], s["step"], s["micro"]) for s in states if s is not None}
    if len(positions) != 1:
        raise PlanError(f"the ranks are at different plan positions {sorted(positions)} (epoch, step, micro): save the "
                        f"checkpoint on every rank after the same engine.step()")
    state = next(s for s in states if s is not None)
    step = engine.global_steps - first_step(binding.plan)
    if state["micro"] != 0 or state["step"] != step:
        raise PlanError(f"the loader is at step {state['step']}, micro {state['micro']} but the engine at the start of "
                        f"step {step}: save the checkpoint at a step boundary, after engine.step() of the step's last "
                        f"microbatch")
    client_state = dict(kwargs.pop("client_state", None) or {})
    client_state[CLIENT_KEY] = {"plan": binding.plan.fingerprint, "loader": state}
    return engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, **kwargs)


def load_checkpoint(engine, loader, load_dir: str, tag=None, **kwargs):
    """``engine.load_checkpoint(load_dir, tag)`` (model, optimizer, the plan's LR scheduler, DeepSpeed's
    counters) and the loader's plan position from the same checkpoint. Returns ``(load_path,
    client_state)`` as DeepSpeed does; a missing checkpoint, or one saved without a plan position, is
    refused. Other keyword arguments go to DeepSpeed."""
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    binding = binding_of(engine)
    _check_loader(binding, loader)
    try:
        path, client_state = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    except ZeRORuntimeException as exc:
        raise PlanError(f"DeepSpeed cannot load {load_dir} here: {str(exc).splitlines()[0]} (to change the number of "
                        f"data-parallel ranks of a ZeRO 1-3 checkpoint, convert it with DeepSpeed's "
                        f"ds_to_universal and load it with \"checkpoint\": {{\"load_universal\": true}})") from None
    if path is None:
        raise PlanError(f"no DeepSpeed checkpoint in {load_dir}" + (f" with tag {tag}" if tag is not None else "")
                        + ": nothing to resume from")
    ours = (client_state or {}).get(CLIENT_KEY)
    if not isinstance(ours, dict) or not isinstance(ours.get("loader"), dict):
        raise PlanError(f"{path} holds no plan position: it was not saved by "
                        f"varlen_cli.integrations.deepspeed.save_checkpoint")
    loader.load_state_dict(ours["loader"])  # refuses another plan; converts its parent's position
    step = engine.global_steps - first_step(binding.plan)
    position = loader.state_dict()
    if (position["step"], position["micro"], binding.lr.step_index) != (step, 0, step):
        raise PlanError(f"{path} does not fit this plan: the engine resumes at plan step {step}, the loader at step "
                        f"{position['step']} micro {position['micro']}, the LR scheduler at step "
                        f"{binding.lr.step_index}")
    return path, client_state
