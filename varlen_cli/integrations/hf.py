"""Hugging Face ``Trainer`` on a varlen plan: ``PlanTrainer(plan=..., model=..., args=..., train_dataset=...)``.

``PlanTrainerMixin`` puts the same behaviour on any ``Trainer`` subclass (TRL's ``SFTTrainer``:
``class PlanSFTTrainer(PlanTrainerMixin, SFTTrainer)``). What it changes, and why
(docs/integrations.md lists the silent failures of the plain setup):

* the train dataloader is the plan's (this rank's microbatches, every plan epoch in one Trainer
  epoch), not re-sharded by accelerate; ``gradient_accumulation_steps`` comes from the plan (a
  different explicit value is refused) and the epochs too;
* Trainer's LR scheduler is wrapped in :class:`VariableBatchSizeLR` (base LR x the plan's
  ``lr_scale``), whose ``step()`` also checks that the step's microbatches were the ones consumed;
  it also steps for an update Trainer skipped (an overflow), so the LR stays on the plan's step;
* exact loss normalisation: ``num_items_in_batch`` is the step's target count from the plan (all
  ranks and micros), with labels in the model's convention (``labels`` + exact ``shift_labels``);
* packed plans run padding-free (no 2D mask, ``position_ids`` restarting per sample, ``use_cache=False``);
* checkpoints hold the plan position and fingerprint (``varlen_plan_state.json``); resuming seeks
  there (no fast-forward) and refuses a checkpoint of another plan;
* logs get ``tokens_per_second`` (real tokens, all ranks, from the plan) and ``padding_pct``;
* every optimizer step logs the plan's figures of that step (:func:`~varlen_cli.loader.plan_metrics`:
  ``varlen/*``, ``global_seqlen/*``) through ``Trainer.log``, so they reach whatever ``report_to``
  names (TensorBoard shows them as ``train/varlen/...``), at the step's ``global_step``, without
  printing a line per step (``plan_metrics=False``: not logged).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from ..loader import PadCollate, VariableBatchSizeLR, dataloader_for_plan, to_model_inputs
from ..loader.packed import PackedCollate
from ..loader.plan_file import Plan, PlanError
from ..loader.replan import first_step, lineage
from ..storage.files import open_regular
from . import open_plan

STATE_FILE = "varlen_plan_state.json"
DEFAULT_EPOCHS = 3.0  # TrainingArguments' default num_train_epochs: taken as "not given"


def _check_args(args, plan: Plan) -> None:
    """Take gradient accumulation and epochs from the plan (refuse a conflicting explicit value)."""
    ga = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    if ga not in (1, plan.grad_accum):
        raise PlanError(f"gradient_accumulation_steps={ga} but the plan was made with --grad-accum "
                        f"{plan.grad_accum}: leave it at 1 (PlanTrainer takes it from the plan) or re-plan")
    job_steps = first_step(plan) + plan.num_steps
    if getattr(args, "max_steps", -1) > job_steps:
        raise PlanError(f"max_steps={args.max_steps} but the plan ends at step {job_steps}: re-plan with more "
                        f"--epochs")
    epochs = getattr(args, "num_train_epochs", DEFAULT_EPOCHS)
    if epochs not in (DEFAULT_EPOCHS, plan.epochs) and getattr(args, "max_steps", -1) <= 0:
        raise PlanError(f"num_train_epochs={epochs:g} but the plan has {plan.epochs} epoch(s): leave it out "
                        f"(PlanTrainer trains the plan's epochs), pass {plan.epochs}, or stop early with max_steps")
    _check_trl_args(args)
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(args, "group_by_length", False) or strategy not in (None, "random"):
        raise PlanError(f"train_sampling_strategy={strategy!r} with a plan: the plan already makes and orders the "
                        f"batches; leave the Trainer's sampler at its default")
    args.gradient_accumulation_steps = plan.grad_accum
    args.num_train_epochs = 1  # one Trainer epoch runs every epoch of the plan (the loader's all_epochs)
    args.ignore_data_skip = True  # resume seeks to the plan position instead of fast-forwarding


def _check_trl_args(args) -> None:
    """TRL's own batching options, which the plan's batches would silently replace."""
    if getattr(args, "packing", False):
        raise PlanError("SFTConfig(packing=True) with a plan: the plan makes the batches, so TRL's packing would be "
                        "ignored; pack with `varlen plan --packing --seq-len T` (PlanTrainer trains the packed rows) "
                        "and leave packing=False")
    if getattr(args, "padding_free", False):
        raise PlanError("SFTConfig(padding_free=True) with a plan: PlanTrainer collates the plan's batches itself, "
                        "so TRL's padding-free collation would be ignored; a plan made with `varlen plan --packing` "
                        "is padding-free: leave padding_free=False")


def _check_world(args, plan: Plan) -> None:
    """The Trainer's world size and process index must be the process group's and the plan's."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        group = (torch.distributed.get_world_size(), torch.distributed.get_rank())
    world, index = int(args.world_size), int(args.process_index)
    mode = str(getattr(args.parallel_mode, "value", args.parallel_mode))
    launched_many = launched > 1 or (group is not None and group[0] > 1)
    if (group is not None and group != (world, index)) or (group is None and launched != world) or \
            (launched_many and mode != "distributed"):
        have = f"{group[0]} processes (this is rank {group[1]})" if group else f"WORLD_SIZE={launched}"
        raise PlanError(f"TrainingArguments see world size {world} (process {index}, parallel mode {mode}) but the "
                        f"launcher started {have}: transformers is not running data-parallel here, so each process "
                        f"would train its own model (on CPU pass TrainingArguments(use_cpu=True))")
    if world != plan.dp:
        raise PlanError(f"the plan was made for {plan.dp} data-parallel rank(s) but the Trainer runs {world} "
                        f"process(es): re-plan with --dp {world}, or launch {plan.dp} processes")


class PlanTrainerMixin:
    """Trainer behaviour for a varlen plan (see the module docstring). Keyword arguments:

    ``plan``: a plan file or :class:`Plan`; ``plan_collate``: the collate (default
    ``PadCollate``/``PackedCollate`` with shifted labels); ``attention``: ``"hf"`` (default: packed
    rows through transformers' position-id packing detection, sdpa or eager), ``"flash"`` or ``"sdpa"``
    (float block mask), see :func:`~varlen_cli.loader.to_model_inputs`; ``plan_metrics``: log the
    plan's figures of every optimizer step (default True).
    """

    def __init__(self, *args: Any, plan: Plan | str | os.PathLike, plan_collate: Any = None,
                 attention: str = "hf", plan_metrics: bool = True, **kwargs: Any):
        self.plan = open_plan(plan)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None:
            raise PlanError("PlanTrainer needs args=TrainingArguments(...)")
        _check_args(training_args, self.plan)
        self.plan_collate = plan_collate or (PackedCollate() if self.plan.packing else PadCollate())
        self.plan_attention = attention
        self.plan_loader = None
        self._plan_resume: str | None = None
        self._plan_tokens = 0  # real tokens of the steps run (all ranks, from the plan)
        self._plan_slots = 0  # padded tokens this rank ran
        self._plan_real_local = 0
        self._plan_t0: float | None = None
        self._plan_figures = None  # the figures of the step being trained (its microbatches carry them)
        super().__init__(*args, **kwargs)
        _check_world(self.args, self.plan)
        if plan_metrics:
            self.add_callback(PlanMetricsCallback(self))

    # -- data ----------------------------------------------------------------------------------
    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args = self.args
        extra = {}
        if args.dataloader_num_workers > 0:
            extra = {"prefetch_factor": args.dataloader_prefetch_factor,
                     "persistent_workers": args.dataloader_persistent_workers}
        loader = dataloader_for_plan(self.train_dataset, self.plan, collate_fn=self.plan_collate,
                                     num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
                                     all_epochs=True, **extra)
        loader.consumed_by_trainer = True  # compute_loss reports each batch the model gets
        loader.len_before = first_step(self.plan) * self.plan.grad_accum  # a replanned plan continues the job
        if self._plan_resume:
            loader.load_state_dict(load_plan_state(self._plan_resume, self.plan)["loader"])
        elif first_step(self.plan):
            raise PlanError(f"{self.plan.path} continues a job from its global step {first_step(self.plan)} (made by "
                            f"`varlen replan`): resume from the checkpoint it was made from "
                            f"(trainer.train(resume_from_checkpoint=...))")
        self.plan_loader = loader
        return loader

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None, *rest, **kwargs):
        self._plan_resume = resume_from_checkpoint
        self._plan_t0 = None
        self._plan_tokens = self._plan_slots = self._plan_real_local = 0
        return super()._inner_training_loop(batch_size, args, resume_from_checkpoint, *rest, **kwargs)

    # -- LR ------------------------------------------------------------------------------------
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, VariableBatchSizeLR):
            guard = self.plan_loader.guard if self.plan_loader is not None else None
            self.lr_scheduler = VariableBatchSizeLR(scheduler, self.plan, guard=guard)
        return self.lr_scheduler

    # -- loss ----------------------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device):
        if not batch_samples or batch_samples[0].get("num_items_in_batch") is None:
            return super()._get_num_items_in_batch(batch_samples, device)
        targets = float(batch_samples[0]["num_items_in_batch"])  # the whole step, all ranks and micros
        if not self.args.average_tokens_across_devices:  # Trainer then does not multiply by the world size
            targets /= max(1, self.args.world_size)
        return torch.tensor(targets, device=device)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        if inputs.get("plan_position") is None:  # evaluation batches and the like
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if self.plan_loader is not None and self.model.training:
            self._follow_skipped_steps()
            self.plan_loader.mark_consumed(inputs)  # checked against the plan's order here, where the model gets it
        self._account(inputs)
        model_inputs = to_model_inputs(inputs, style=self.plan_attention)
        if self.model_accepts_loss_kwargs or self.compute_loss_func is not None or self.label_smoother is not None:
            return super().compute_loss(model, model_inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # a model without loss kwargs would average per microbatch: compute the exact summed loss here
        shift = model_inputs.pop("shift_labels", None)
        labels = model_inputs.pop("labels")
        outputs = model(**model_inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if shift is None:
            shift = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift.reshape(-1).to(logits.device),
                               ignore_index=-100, reduction="sum") / num_items_in_batch
        if self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes
        self.loss_is_scaled_for_ga = True
        return (loss, outputs) if return_outputs else loss

    def _follow_skipped_steps(self) -> None:
        """Trainer steps the LR scheduler only after an update that was applied (``optimizer_step_was_skipped``:
        an fp16 or bf16 overflow under DeepSpeed, or AMP's scaler): the plan's scheduler steps for a skipped
        update too, so every later step runs at base x its own ``lr_scale``, not the previous step's."""
        lr = self.lr_scheduler
        if isinstance(lr, VariableBatchSizeLR):
            for _ in range(self.state.global_step - lr.global_step):
                lr.step()

    def _account(self, batch: dict) -> None:
        if self._plan_t0 is None:
            self._plan_t0 = time.perf_counter()
        self._plan_figures = getattr(batch.get("info"), "figures", None)
        if int(batch["plan_position"][3]) == 0:
            self._plan_tokens += int(batch["step_tokens"])
        self._plan_slots += int(batch["input_ids"].numel())
        self._plan_real_local += int(batch["num_tokens"])

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs and self._plan_t0 is not None:
            elapsed = time.perf_counter() - self._plan_t0
            logs["tokens_per_second"] = round(self._plan_tokens / elapsed, 2) if elapsed > 0 else 0.0
            if self._plan_slots:
                logs["padding_pct"] = round(100.0 * (1 - self._plan_real_local / self._plan_slots), 2)
        return super().log(logs, *args, **kwargs)

    def log_plan_figures(self) -> None:
        """Log the figures of the optimizer step just taken through ``Trainer.log`` itself (not a
        subclass's: TRL's would flush its own metrics), to every callback but the console printers,
        keeping the Trainer's own decision to log this step."""
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        figures, self._plan_figures = self._plan_figures, None
        if figures is None:
            return
        handler, should_log = self.callback_handler, self.control.should_log
        shown = handler.callbacks
        handler.callbacks = [cb for cb in shown if not isinstance(cb, (PrinterCallback, ProgressCallback))]
        try:
            Trainer.log(self, figures.metrics())
        finally:
            handler.callbacks = shown
            self.control.should_log = should_log

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.plan_loader is None or not self.args.should_save:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        save_plan_state(folder, self.plan, self.plan_loader.state_dict(), self.state.global_step)


class PlanMetricsCallback(TrainerCallback):
    """After every optimizer step: :meth:`PlanTrainerMixin.log_plan_figures` (added by the mixin)."""

    def __init__(self, trainer: PlanTrainerMixin):
        import weakref

        self.trainer = weakref.ref(trainer)  # no cycle through the Trainer's callbacks

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer()
        if trainer is not None:
            trainer.log_plan_figures()


def save_plan_state(folder: str, plan: Plan, loader_state: dict, global_step: int) -> str:
    """Write the plan position into a checkpoint folder (atomically)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    state = {"plan": plan.fingerprint, "plan_path": os.path.abspath(plan.path), "global_step": int(global_step),
             "loader": loader_state}
    with open(path + ".tmp", "w") as fh:
        json.dump(state, fh)
    os.replace(path + ".tmp", path)
    return path


def load_plan_state(folder: str, plan: Plan) -> dict:
    """Read a checkpoint's plan position; refuse a checkpoint without one or from another plan (a
    checkpoint of the plan's parent, ``varlen replan`` / ``--extend``, is the plan's own start)."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        raise PlanError(f"{folder} has no {STATE_FILE}: it was not saved by a PlanTrainer, so the plan position "
                        f"is unknown")
    try:
        with open_regular(path, what="plan state", error=PlanError) as fh:  # a FIFO is refused, never read
            state = json.load(fh)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from None
    if not isinstance(state, dict):
        raise PlanError(f"{path} is not a plan state (a JSON object)")
    if state.get("plan") not in (plan.fingerprint, lineage(plan).get("parent")):
        raise PlanError(f"{folder} was saved with another plan ({state.get('plan_path')}); resume with the same "
                        f"plan file")
    return state


class PlanTrainer(PlanTrainerMixin, Trainer):
    """``transformers.Trainer`` on a varlen plan: ``PlanTrainer(plan=PATH, model=..., args=..., train_dataset=...)``."""
