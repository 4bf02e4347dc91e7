"""Lightning on a varlen plan: ``PlanDataModule(dataset, plan)`` (which arms ``PlanCallback``) + ``plan_lr_scheduler``.

    dm = PlanDataModule(dataset, "plan.parquet")
    trainer = L.Trainer(max_epochs=dm.plan.epochs, accumulate_grad_batches=dm.plan.grad_accum,
                        use_distributed_sampler=False, ...)
    trainer.fit(model, datamodule=dm)                       # ckpt_path=... resumes mid-epoch exactly

    # in the LightningModule:
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return plan_lr_scheduler(opt, self.trainer.datamodule.plan, base=LambdaLR(opt, warmup_cosine))

What each piece fixes (docs/integrations.md): the batch ``info`` is a plain object, so
``transfer_batch_to_device`` works; ``set_epoch`` reaches the plan's batch sampler through
``batch_sampler.sampler``; the loader's state (Lightning saves it in its checkpoint, the loader
being stateful) is the position of the last batch *trained*, not the one Lightning prefetched,
so a mid-epoch resume seeks to exactly the next microbatch; the callback (added to the Trainer by
the data module itself) refuses a Trainer whose ``use_distributed_sampler``,
``accumulate_grad_batches``, ``limit_train_batches``, ``max_epochs`` or ``max_steps`` disagree with the
plan and an LR scheduler that is not the plan's (or not stepped per optimizer step), and logs the
plan's figures of every optimizer step (``varlen/*``, ``global_seqlen/*``) through ``pl_module.log``.
A plan made by ``varlen replan`` resumes from the checkpoint it was made from, on the new number
of processes.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as L

from ..loader import VariableBatchSizeLR, dataloader_for_plan, plan_metrics
from ..loader.guard import bind
from ..loader.plan_file import Plan, PlanError
from ..loader.replan import first_epoch, first_step, lineage
from . import open_plan


def plan_lr_scheduler(optimizer, plan: Plan | str | os.PathLike, base: Any = None) -> dict:
    """``configure_optimizers``' return value: ``optimizer`` with ``base`` (or a constant LR) x the
    plan's ``lr_scale``, stepped once per optimizer step."""
    plan = open_plan(plan)
    scheduler = VariableBatchSizeLR(base if base is not None else optimizer, plan)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


class PlanCallback(L.Callback):
    """Checks the Trainer against the plan and records each batch trained (for exact resume).

    ``PlanDataModule`` adds it to the Trainer by itself (``setup``); passing ``dm.callback()`` in
    ``callbacks=`` as well is harmless.
    """

    def __init__(self, datamodule: PlanDataModule):
        self.datamodule = datamodule
        self.step_start: StepStart | None = None  # where the optimizer step being trained began

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            check_trainer(trainer, self.datamodule.plan)

    def on_train_start(self, trainer, pl_module) -> None:
        plan = self.datamodule.plan
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
                bind(config.scheduler, loader.guard)
        if trainer.global_step < first_step(plan):
            raise PlanError(f"{plan.path} continues a job from its global step {first_step(plan)} (made by `varlen "
                            f"replan`) but the Trainer is at step {trainer.global_step}: resume from the checkpoint it "
                            f"was made from (trainer.fit(..., ckpt_path=...))")

        refuse_mid_step_start(self.datamodule.loader, plan, trainer)
        keep_resumed_checkpoint(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        loader = self.datamodule.loader
        if loader is not None:
            if int(batch["plan_position"][3]) == 0:  # a step starts: what a checkpoint saved in it holds
                self.step_start = StepStart(loader.state_dict(), trainer)
            loader.mark_consumed(batch)  # Lightning fetched ahead: this is the batch being trained

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        """The plan's figures of the step (:func:`~varlen_cli.loader.plan_metrics`) through
        ``pl_module.log``, once per optimizer step (after its last microbatch): Lightning sends them to
        its loggers at the step, every ``log_every_n_steps``."""
        info = batch.get("info") if isinstance(batch, dict) else None
        if not self.datamodule.plan_metrics or getattr(info, "figures", None) is None or \
                info.micro != self.datamodule.plan.grad_accum - 1:
            return
        for name, value in plan_metrics(batch).items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        loader, start = self.datamodule.loader, self.step_start
        if loader is not None and start is not None and trainer.global_step == start.global_step:
            start.rewind(checkpoint, loader.state_dict())  # saved before the optimizer step: mid-step


def check_trainer(trainer, plan: Plan) -> None:
    """Refuse Trainer settings that would train other data, steps or epochs than the plan's."""
    if trainer._accelerator_connector.use_distributed_sampler:
        raise PlanError("Trainer(use_distributed_sampler=True) would re-shard the plan's per-rank batches: pass "
                        "use_distributed_sampler=False")
    if trainer.accumulate_grad_batches != plan.grad_accum:
        raise PlanError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) but the plan was made "
                        f"with --grad-accum {plan.grad_accum}: pass accumulate_grad_batches={plan.grad_accum}")
    if trainer.limit_train_batches not in (1.0, None):
        raise PlanError(f"Trainer(limit_train_batches={trainer.limit_train_batches}) would cut every epoch of the plan "
                        f"short: stop early with max_steps instead")
    job_epochs, job_steps = first_epoch(plan) + plan.epochs, first_step(plan) + plan.num_steps
    max_epochs, max_steps = trainer.fit_loop.max_epochs, trainer.max_steps
    if max_steps is not None and max_steps > job_steps:
        raise PlanError(f"Trainer(max_steps={max_steps}) but the plan ends at step {job_steps}: re-plan with more "
                        f"--epochs")
    stops_in_time = max_steps is not None and max_steps > 0
    if max_epochs is None or (max_epochs < 0 and not stops_in_time) or max_epochs > job_epochs:
        raise PlanError(f"Trainer(max_epochs={max_epochs}) but the plan has {job_epochs} epoch(s): pass "
                        f"max_epochs={job_epochs} (or re-plan with more --epochs)")
    if len(set(plan.steps_per_epoch)) > 1 and trainer.reload_dataloaders_every_n_epochs != 1:
        raise PlanError(f"the plan's epochs have different step counts {list(plan.steps_per_epoch)}: pass "
                        f"Trainer(reload_dataloaders_every_n_epochs=1) so Lightning re-reads each epoch's length")


class PlanDataModule(L.LightningDataModule):
    """The plan's per-rank loader as a ``LightningDataModule`` (rank from the process group Lightning made).

    ``collate_fn``, ``num_workers`` and other keyword arguments go to
    :func:`~varlen_cli.loader.dataloader_for_plan`. Its checks (:class:`PlanCallback`) are armed in
    ``setup``: the Trainer needs no callback from the user. ``plan_metrics``: log the plan's figures of
    every optimizer step through ``pl_module.log`` (default True).
    """

    def __init__(self, dataset, plan: Plan | str | os.PathLike, *, collate_fn: Any = None, num_workers: int = 0,
                 plan_metrics: bool = True, **loader_kwargs: Any):
        super().__init__()
        self.dataset = dataset
        self.plan = open_plan(plan)
        self.plan_metrics = plan_metrics
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.loader_kwargs = loader_kwargs
        self.loader = None
        self._callback: PlanCallback | None = None

    @property
    def max_epochs(self) -> int:
        """``Trainer(max_epochs=...)``: the job's epochs (a plan made by ``varlen replan`` continues a job)."""
        return first_epoch(self.plan) + self.plan.epochs

    def callback(self) -> PlanCallback:
        if self._callback is None:
            self._callback = PlanCallback(self)
        return self._callback

    def _arm(self, trainer, run_setup: bool) -> None:
        """Put this module's PlanCallback among the Trainer's callbacks (once)."""
        if trainer is None or any(isinstance(c, PlanCallback) and c.datamodule is self for c in trainer.callbacks):
            return
        trainer.callbacks.append(self.callback())
        if run_setup:  # the Trainer has already run the callbacks' setup hooks
            self.callback().setup(trainer, trainer.lightning_module, "fit")

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self._arm(self.trainer, run_setup=False)  # Lightning runs the callbacks' setup right after this

    def train_dataloader(self):
        trainer = self.trainer
        self._arm(trainer, run_setup=True)  # a subclass whose setup() did not call ours
        if self.loader is None:
            self.loader = dataloader_for_plan(self.dataset, self.plan, collate_fn=self.collate_fn,
                                              num_workers=self.num_workers, **self.loader_kwargs)
            self.loader.consumed_by_trainer = True  # Lightning fetches ahead: PlanCallback reports trained batches
        epoch = trainer.current_epoch if trainer is not None else first_epoch(self.plan)
        if epoch < first_epoch(self.plan) + self.plan.epochs:
            self.loader.batch_sampler.sampler.set_epoch(epoch)  # the job's epoch; keeps a resume position in it
        self.loader.len_before = 0
        if trainer is not None and trainer.fit_loop.restarting and first_step(self.plan) > 0:
            # a replanned plan continues an epoch Lightning counted batches of: they are part of its length
            self.loader.len_before = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return self.loader

    def state_dict(self) -> dict:
        return {"plan": self.plan.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("plan") not in (None, self.plan.fingerprint, lineage(self.plan).get("parent")):
            raise PlanError("the checkpoint was saved with another plan; resume with the same plan file")


def plan_loss(loss_sum, batch: dict, trainer) -> Any:
    """The loss to return from ``training_step`` for a microbatch's *summed* token loss.

    Lightning divides it by ``accumulate_grad_batches`` and DDP averages over processes: this
    multiplies both back and divides by the step's target count (from the plan), so the
    accumulated gradient is exactly that of the mean token loss over the whole step.
    """
    return loss_sum * (trainer.world_size * trainer.accumulate_grad_batches / batch["step_loss_tokens"])


# -- checkpoints: every one Lightning writes resumes exactly ------------------------------------------
class StepStart:
    """Where the optimizer step being trained began: the loader's state, Lightning's global step and
    batch counts there. A checkpoint saved in the middle of a step (a time interval, a validation, an
    exception, ``trainer.save_checkpoint``) holds weights, optimizer and LR schedulers as of the step's
    start already (the optimizer has not stepped); only the gradient its first microbatches accumulated
    is not saved. :meth:`rewind` puts the loader's state and Lightning's batch counters back to the
    step's start too, so the resumed job trains that step's microbatches again: the checkpoint resumes
    exactly, as one saved at the step's start would."""

    def __init__(self, loader_state: dict, trainer):
        loop = trainer.fit_loop.epoch_loop
        progress = loop.batch_progress  # counted already for the step's first batch
        self.loader_state = loader_state
        self.global_step = int(trainer.global_step)
        self.batches = {"total": int(progress.total.ready) - 1, "current": int(progress.current.ready) - 1}
        # the optimizer's and schedulers' counters, untouched by the step's first batch so far
        self.counters = {"epoch_loop.automatic_optimization.optim_progress":
                         loop.automatic_optimization.optim_progress.state_dict(),
                         "epoch_loop.scheduler_progress": loop.scheduler_progress.state_dict()}

    def rewind(self, checkpoint: dict, loader_state_now: dict) -> None:
        fit = checkpoint.get("loops", {}).get("fit_loop", {})
        progress = fit.get("epoch_loop.batch_progress")
        counters = fit.get("epoch_loop.state_dict")
        states = fit.get("state_dict", {}).get("combined_loader")
        if not (isinstance(progress, dict) and isinstance(counters, dict) and isinstance(states, list)):
            import warnings

            warnings.warn("varlen: this Lightning version's checkpoint layout is unknown: a checkpoint saved in the "
                          "middle of an optimizer step keeps that position and cannot be resumed", stacklevel=2)
            return
        fit["state_dict"]["combined_loader"] = [self.loader_state if _same(s, loader_state_now) else s
                                                for s in states]
        after_a_batch = self.batches["current"] > 0
        for part, done in self.batches.items():  # as saved at the end of the step's previous batch
            progress[part] = {"ready": done, "started": done, "processed": done,
                              "completed": done - 1 if after_a_batch else done}
        progress["is_last_batch"] = False
        fit.update((key, state) for key, state in self.counters.items() if key in fit)
        # Lightning adds one optimizer step to this (logging) counter when it restarts after a batch's end
        counters["_batches_that_stepped"] = self.global_step - (1 if after_a_batch else 0)


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values that do not compare (tensors)
        return a is b


def refuse_mid_step_start(loader, plan: Plan, trainer) -> None:
    """A resumed loader must start where the restored optimizer step starts: a Lightning checkpoint
    holds no accumulated gradient (the ones written under PlanDataModule hold the step's start)."""
    if loader is None or trainer.ckpt_path is None:
        return
    step, micro, _ = loader.batch_sampler.bounds()
    done = (first_step(plan) + step - trainer.global_step) * plan.grad_accum + micro  # microbatches of the step
    if not 0 < done <= plan.grad_accum:
        return  # at the step's start (or another desync, which the loader's guard names)
    raise PlanError(f"{trainer.ckpt_path} was saved in the middle of optimizer step {trainer.global_step} ({done} of "
                    f"its {plan.grad_accum} microbatches trained, the optimizer not yet stepped) and a Lightning "
                    f"checkpoint does not hold the gradient they accumulated, so training cannot continue exactly "
                    f"from it (checkpoints written under PlanDataModule by this varlen hold the step's start): resume "
                    f"from an earlier checkpoint")


def keep_resumed_checkpoint(trainer) -> None:
    """A resumed job does not save its first global step again: that step's checkpoint is the one it
    resumed from (Lightning's ModelCheckpoint forgets what it saved, and would overwrite the source with
    a save taken after the first resumed microbatch)."""
    if trainer.ckpt_path is None:
        return
    for callback in trainer.checkpoint_callbacks:
        if hasattr(callback, "_last_global_step_saved"):
            callback._last_global_step_saved = trainer.global_step
