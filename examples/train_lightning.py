"""Train a tiny Llama (from a config) with Lightning on a varlen plan.

    varlen plan /tmp/m -o /tmp/plan.parquet --max-tokens 2048 --dp 2 --grad-accum 2 --epochs 2
    torchrun --nproc-per-node 2 examples/train_lightning.py --plan /tmp/plan.parquet --ckpt-dir /tmp/pl --save-every 3
    torchrun --nproc-per-node 2 examples/train_lightning.py --plan /tmp/plan.parquet --resume /tmp/pl/<file>.ckpt

The recipe: ``PlanDataModule(dataset, plan)`` (it arms its own checks), ``use_distributed_sampler=False``,
``accumulate_grad_batches=plan.grad_accum``, ``max_epochs=dm.max_epochs``; ``plan_lr_scheduler`` in
``configure_optimizers``; ``plan_loss`` in ``training_step``. Resuming from Lightning's own mid-epoch
checkpoint continues exactly, also on a plan `varlen replan` made for another number of processes, and so
does one saved in the middle of an optimizer step (``--crash-at-step N --save-on-crash``: Lightning's
``OnExceptionCheckpoint``, which PlanDataModule writes as of the step's start).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from tiny_lm import TokenDataset, warmup_cosine  # noqa: E402
from train_hf_trainer import tiny_llama  # noqa: E402

from varlen_cli.errors.entry import exit_on_error  # noqa: E402
from varlen_cli.integrations.lightning import PlanDataModule, plan_loss, plan_lr_scheduler  # noqa: E402
from varlen_cli.loader import Plan, to_model_inputs  # noqa: E402
from varlen_cli.loader.replan import first_step  # noqa: E402
from varlen_cli.runtime.dist import collective_timeout  # noqa: E402


class TinyLlamaModule(L.LightningModule):
    def __init__(self, vocab_size: int, max_len: int, lr: float, warmup_steps: int, total_steps: int,
                 log_dir: str | None = None, crash_at_step: int | None = None):
        super().__init__()
        self.model = tiny_llama(vocab_size, max_len)
        self.lr, self.warmup_steps, self.total_steps = lr, warmup_steps, total_steps
        self.log_dir, self.crash_at_step = log_dir, crash_at_step
        self.record = {"steps": [], "lr": [], "unscaled_lr": [], "lr_scale": [], "micro": []}

    def training_step(self, batch, batch_idx):
        epoch, step, rank, micro = batch["plan_position"].tolist()
        if step == self.crash_at_step and micro == 1:
            raise RuntimeError(f"--crash-at-step {step}: a crash in the middle of optimizer step {step}")
        logits = self.model(**to_model_inputs(batch, labels=False)).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
        self.record["micro"].append({"position": batch["plan_position"].tolist(),
                                     "samples": batch["sample_ids"][: batch["num_samples"]].tolist(),
                                     "loss": float(loss_sum.detach()) / batch["step_loss_tokens"]})
        return plan_loss(loss_sum, batch, self.trainer)

    def on_before_optimizer_step(self, optimizer):
        sched = self.lr_schedulers()
        self.record["steps"].append(int(sched.global_step))  # the job's step (a replanned plan continues it)
        self.record["lr"].append(optimizer.param_groups[0]["lr"])
        self.record["unscaled_lr"].append(sched.get_unscaled_lr()[0])
        self.record["lr_scale"].append(sched.scale())
        if sched.step_index == 0 and self.log_dir and self.global_rank == 0:
            grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
            torch.save(grads, os.path.join(self.log_dir, "grad0.pt"))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)
        base = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(self.warmup_steps, self.total_steps))
        return plan_lr_scheduler(opt, self.trainer.datamodule.plan, base=base)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--data", default=os.path.join(ROOT, "sample_data", "tokenized.parquet"))
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint folder")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N optimizer steps")
    p.add_argument("--resume", default=None,
                   help="a Lightning checkpoint to resume from (this plan's, or its parent's: `varlen replan`)")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this global step (default: the plan's end)")
    p.add_argument("--total-steps", type=int, default=None,
                   help="length of the base LR schedule (default: the job's last step, the plan's end)")
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="raise in the second microbatch of this global step (to try a resume)")
    p.add_argument("--save-on-crash", action="store_true",
                   help="Lightning's OnExceptionCheckpoint: CKPT_DIR/on-exception.ckpt when training fails")
    p.add_argument("--distributed-sampler", action="store_true", help="the plain Trainer default (refused)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--tensorboard", default=None,
                   help="a TensorBoardLogger writing here, every step (the plan's varlen/* figures)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    plan = Plan.open(args.plan)
    dataset = TokenDataset(args.data)
    dm = PlanDataModule(dataset, plan)
    total = args.total_steps or first_step(plan) + plan.num_steps  # a replanned plan continues the job's steps
    module = TinyLlamaModule(dataset.vocab_size, max(t for _, t in plan.shapes), args.lr, args.warmup_steps,
                             total, args.log_dir, args.crash_at_step)
    callbacks = []  # PlanDataModule adds its own checks (PlanCallback)
    if args.save_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1,
                                         filename="{step}"))
    if args.save_on_crash:
        from lightning.pytorch.callbacks import OnExceptionCheckpoint

        callbacks.append(OnExceptionCheckpoint(dirpath=args.ckpt_dir, filename="on-exception"))
    world = int(os.environ.get("WORLD_SIZE", 1))
    # a collective waits at most VARLEN_TIMEOUT seconds (default 1800) for a peer, then this rank fails
    strategy = DDPStrategy(timeout=datetime.timedelta(seconds=collective_timeout())) if world > 1 else "auto"
    logger = False
    if args.tensorboard:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(save_dir=args.tensorboard, name="", version="")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, log_every_n_steps=1,
                        max_epochs=dm.max_epochs, max_steps=args.max_steps, accumulate_grad_batches=plan.grad_accum,
                        use_distributed_sampler=args.distributed_sampler, reload_dataloaders_every_n_epochs=1,
                        callbacks=callbacks, logger=logger, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(args.save_every or args.save_on_crash), num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm, ckpt_path=args.resume)
    if args.log_dir:
        with open(os.path.join(args.log_dir, f"rank-{trainer.global_rank}.json"), "w") as fh:
            json.dump(module.record, fh)
    if trainer.global_rank == 0:
        print(f"rank 0: {trainer.global_step} steps", flush=True)
    del trainer, strategy, module, dm  # the strategy holds the DDP model; the data module holds the trainer
    end_group()


def end_group() -> None:
    """End the process group here, the same way on every rank. Lightning leaves a gloo group up (it
    destroys only nccl ones), and the DDP model holds it: ``destroy_process_group()`` alone only
    unregisters the group while the model lives on (in the trainer's reference cycles), and the garbage
    collector then tears it down at any later point, while a peer may already have exited (a hang at
    exit under load). So: once the caller dropped trainer and module, collect, meet, end the group."""
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    exit_on_error(main)  # a PlanError: its one line (also in torchrun's summary), not a traceback per rank
