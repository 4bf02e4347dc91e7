"""Lightning on a varlen plan: ``PlanDataModule(dataset, plan)`` + ``PlanCallback`` + ``plan_lr_scheduler``.

    dm = PlanDataModule(dataset, "plan.parquet")
    trainer = L.Trainer(max_epochs=dm.plan.epochs, accumulate_grad_batches=dm.plan.grad_accum,
                        use_distributed_sampler=False, callbacks=[dm.callback()], ...)
    trainer.fit(model, datamodule=dm)                       # ckpt_path=... resumes mid-epoch exactly

    # in the LightningModule:
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return plan_lr_scheduler(opt, self.trainer.datamodule.plan, base=LambdaLR(opt, warmup_cosine))

What each piece fixes (docs/integrations.md): the batch ``info`` is a plain object, so
``transfer_batch_to_device`` works; ``set_epoch`` reaches the plan's batch sampler through
``batch_sampler.sampler``; the loader's state (Lightning saves it in its checkpoint, the loader
being stateful) is the position of the last batch *trained*, not the one Lightning prefetched,
so a mid-epoch resume seeks to exactly the next microbatch; the callback refuses a Trainer whose
``use_distributed_sampler``, ``accumulate_grad_batches`` or ``max_epochs`` disagree with the plan
and an LR scheduler that is not the plan's (or not stepped per optimizer step).
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as L

from ..loader import VariableBatchSizeLR, dataloader_for_plan
from ..loader.plan_file import Plan, PlanError
from . import open_plan


def plan_lr_scheduler(optimizer, plan: Plan | str | os.PathLike, base: Any = None) -> dict:
    """``configure_optimizers``' return value: ``optimizer`` with ``base`` (or a constant LR) x the
    plan's ``lr_scale``, stepped once per optimizer step."""
    plan = open_plan(plan)
    scheduler = VariableBatchSizeLR(base if base is not None else optimizer, plan)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


class PlanCallback(L.Callback):
    """Checks the Trainer against the plan and records each batch trained (for exact resume)."""

    def __init__(self, datamodule: PlanDataModule):
        self.datamodule = datamodule

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        plan = self.datamodule.plan
        if trainer._accelerator_connector.use_distributed_sampler:
            raise PlanError("Trainer(use_distributed_sampler=True) would re-shard the plan's per-rank batches: pass "
                            "use_distributed_sampler=False")
        if trainer.accumulate_grad_batches != plan.grad_accum:
            raise PlanError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) but the plan was made "
                            f"with --grad-accum {plan.grad_accum}: pass accumulate_grad_batches={plan.grad_accum}")
        max_epochs = trainer.fit_loop.max_epochs
        if max_epochs is None or max_epochs < 0 or max_epochs > plan.epochs:
            raise PlanError(f"Trainer(max_epochs={max_epochs}) but the plan has {plan.epochs} epoch(s): pass "
                            f"max_epochs={plan.epochs} (or re-plan with more --epochs)")
        if len(set(plan.steps_per_epoch)) > 1 and trainer.reload_dataloaders_every_n_epochs != 1:
            raise PlanError(f"the plan's epochs have different step counts {list(plan.steps_per_epoch)}: pass "
                            f"Trainer(reload_dataloaders_every_n_epochs=1) so Lightning re-reads each epoch's length")

    def on_train_start(self, trainer, pl_module) -> None:
        configs = trainer.lr_scheduler_configs
        ok = [c for c in configs if isinstance(c.scheduler, VariableBatchSizeLR)]
        if not ok:
            raise PlanError("no VariableBatchSizeLR among the LR schedulers: the plan's lr_scale would not be applied "
                            "(return plan_lr_scheduler(optimizer, plan, base) from configure_optimizers)")
        for config in ok:
            if config.interval != "step" or config.frequency != 1:
                raise PlanError("VariableBatchSizeLR must step once per optimizer step: interval='step', frequency=1")
            loader = self.datamodule.loader
            if loader is not None:
                config.scheduler._guard = loader.guard

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        loader = self.datamodule.loader
        if loader is not None:
            loader.mark_consumed(batch)  # Lightning fetched ahead: this is the batch being trained


class PlanDataModule(L.LightningDataModule):
    """The plan's per-rank loader as a ``LightningDataModule`` (rank from the process group Lightning made).

    ``collate_fn``, ``num_workers`` and other keyword arguments go to
    :func:`~varlen_cli.loader.dataloader_for_plan`. Add :meth:`callback` to the Trainer's callbacks.
    """

    def __init__(self, dataset, plan: Plan | str | os.PathLike, *, collate_fn: Any = None, num_workers: int = 0,
                 **loader_kwargs: Any):
        super().__init__()
        self.dataset = dataset
        self.plan = open_plan(plan)
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.loader_kwargs = loader_kwargs
        self.loader = None
        self._callback: PlanCallback | None = None

    def callback(self) -> PlanCallback:
        if self._callback is None:
            self._callback = PlanCallback(self)
        return self._callback

    def train_dataloader(self):
        if self.loader is None:
            self.loader = dataloader_for_plan(self.dataset, self.plan, collate_fn=self.collate_fn,
                                              num_workers=self.num_workers, **self.loader_kwargs)
            self.loader.full_epoch_len = True  # Lightning counts batches per epoch, also after a resume
            self.loader.consumed_by_trainer = True  # Lightning fetches ahead: PlanCallback reports trained batches
        trainer = self.trainer
        epoch = trainer.current_epoch if trainer is not None else 0
        if epoch < self.plan.epochs:
            self.loader.set_epoch(epoch)  # keeps a resume position in that epoch
        return self.loader

    def state_dict(self) -> dict:
        return {"plan": self.plan.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("plan") not in (None, self.plan.fingerprint):
            raise PlanError("the checkpoint was saved with another plan; resume with the same plan file")


def plan_loss(loss_sum, batch: dict, trainer) -> Any:
    """The loss to return from ``training_step`` for a microbatch's *summed* token loss.

    Lightning divides it by ``accumulate_grad_batches`` and DDP averages over processes: this
    multiplies both back and divides by the step's target count (from the plan), so the
    accumulated gradient is exactly that of the mean token loss over the whole step.
    """
    return loss_sum * (trainer.world_size * trainer.accumulate_grad_batches / batch["step_loss_tokens"])
