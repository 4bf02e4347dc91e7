"""accelerate on a varlen plan: ``prepare_plan_dataloader(accelerator, loader)`` instead of ``prepare(loader)``.

``accelerator.prepare(loader)`` wraps the plan's per-rank batch sampler in its own sharding, so each
rank keeps every other microbatch of its stream and accumulation pairs the wrong micros;
varlen's fetch-order guard now stops that with a :class:`PlanError`. ``prepare_plan_dataloader``
keeps the loader as it is (this rank's stream, in order), moves batches to the accelerator's
device, checks the world size and gradient accumulation against the plan, and registers the
loader for ``accelerator.save_state`` / ``load_state`` (the position of the last *consumed*
microbatch: accelerate's read-ahead does not shift it).

Two more things differ from a plain accelerate loop (docs/integrations.md):

* ``accelerator.backward`` divides the loss by the gradient accumulation steps: use
  :func:`plan_loss` (summed token loss x world size x grad-accum / the step's targets);
* ``accelerator.prepare(scheduler)`` steps the scheduler once per process per optimizer step:
  do not prepare ``VariableBatchSizeLR``; register it (``accelerator.register_for_checkpointing``)
  and call its ``step()`` when ``accelerator.sync_gradients``.
"""

from __future__ import annotations

from typing import Any

from ..loader.plan_file import PlanError
from ..loader.view import LoaderView


class PlanLoader(LoaderView):
    """The plan's loader as accelerate sees it after :func:`prepare_plan_dataloader`: its batches on
    the accelerator's device, the rest the plan loader's (:class:`~varlen_cli.loader.view.LoaderView`)."""

    def __init__(self, loader: Any, accelerator: Any):
        super().__init__(loader)
        self.accelerator = accelerator

    def __iter__(self):
        from accelerate.utils import send_to_device

        device = self.accelerator.device
        for batch in self.loader:
            yield send_to_device(batch, device)


def prepare_plan_dataloader(accelerator: Any, loader: Any, *, register: bool = True) -> PlanLoader:
    """Use the plan's loader under ``accelerator`` without re-sharding it (see the module docstring)."""
    from ..loader.dataloader import PlanLoaderMixin

    if not isinstance(loader, PlanLoaderMixin):
        raise PlanError("prepare_plan_dataloader takes the loader made by varlen_cli.loader.dataloader_for_plan")
    plan = loader.plan
    plan.validate(world_size=accelerator.num_processes)
    if loader.batch_sampler.rank != accelerator.process_index:
        raise PlanError(f"the loader was made for rank {loader.batch_sampler.rank} but this is process "
                        f"{accelerator.process_index}")
    ga = int(accelerator.gradient_accumulation_steps)
    if ga != plan.grad_accum:
        raise PlanError(f"Accelerator(gradient_accumulation_steps={ga}) but the plan was made with --grad-accum "
                        f"{plan.grad_accum}: pass gradient_accumulation_steps={plan.grad_accum}")
    wrapped = PlanLoader(loader, accelerator)
    if register:
        accelerator.register_for_checkpointing(wrapped)
    return wrapped


def plan_loss(loss_sum: Any, batch: dict, accelerator: Any):
    """The loss to pass to ``accelerator.backward`` from a microbatch's *summed* token loss.

    ``backward`` divides by the gradient accumulation steps and DDP averages over processes, so
    this multiplies both back and divides by the step's target count (from the plan): the
    accumulated gradient is exactly that of the mean token loss over the whole step.
    """
    targets = batch["step_loss_tokens"]
    return loss_sum * (accelerator.num_processes * accelerator.gradient_accumulation_steps / targets)
