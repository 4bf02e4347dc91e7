"""Train a tiny Llama (from a config) with an accelerate loop on a varlen plan.

    varlen plan /tmp/m -o /tmp/plan.parquet --max-tokens 2048 --dp 2 --grad-accum 2 --epochs 2
    torchrun --nproc-per-node 2 examples/train_accelerate.py --plan /tmp/plan.parquet --ckpt /tmp/acc --save-at 3
    torchrun --nproc-per-node 2 examples/train_accelerate.py --plan /tmp/plan.parquet --ckpt /tmp/acc --resume

The recipe: ``prepare_plan_dataloader(accelerator, loader)`` (not ``prepare(loader)``),
``accelerator.backward(plan_loss(loss_sum, batch, accelerator))``, ``VariableBatchSizeLR``
registered for checkpointing (not prepared), ``save_state``/``load_state`` for exact resume.
``--prepare-directly`` shows the plain ``accelerator.prepare(loader)``: it now stops with a PlanError.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs  # noqa: E402
from tiny_lm import TokenDataset, warmup_cosine  # noqa: E402
from train_hf_trainer import tiny_llama  # noqa: E402

from varlen_cli.errors.entry import exit_on_error  # noqa: E402
from varlen_cli.integrations.accelerate import plan_loss, prepare_plan_dataloader  # noqa: E402
from varlen_cli.loader import Plan, VariableBatchSizeLR, dataloader_for_plan, to_model_inputs  # noqa: E402
from varlen_cli.runtime.dist import collective_timeout  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--data", default=os.path.join(ROOT, "sample_data", "tokenized.parquet"))
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--ckpt", default=None, help="accelerate save_state folder")
    p.add_argument("--save-at", type=int, default=None, help="save_state after this global step")
    p.add_argument("--resume", action="store_true", help="load_state from --ckpt first")
    p.add_argument("--prepare-directly", action="store_true", help="the plain accelerator.prepare(loader)")
    p.add_argument("--log-dir", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    plan = Plan.open(args.plan)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    # a collective waits at most VARLEN_TIMEOUT seconds (default 1800) for a peer, then this rank fails
    group = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=collective_timeout()))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=plan.grad_accum, kwargs_handlers=[group])
    dataset = TokenDataset(args.data)
    model = tiny_llama(dataset.vocab_size, max(t for _, t in plan.shapes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loader = dataloader_for_plan(dataset, plan)  # this rank's microbatches (rank from torch.distributed)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = VariableBatchSizeLR(torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup_steps,
                                                                                                plan.num_steps)), plan)
    accelerator.register_for_checkpointing(scheduler)
    if args.prepare_directly:
        loader = accelerator.prepare(loader)  # would re-shard the per-rank stream: refused in one line
    else:
        loader = prepare_plan_dataloader(accelerator, loader)
    if args.resume:
        accelerator.load_state(args.ckpt)
    log = {"steps": [], "lr": [], "unscaled_lr": [], "lr_scale": [], "micro": []}
    for epoch in range(getattr(loader, "epoch", 0), plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(model):
                logits = model(**to_model_inputs(batch, labels=False)).logits
                loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
                accelerator.backward(plan_loss(loss_sum, batch, accelerator))
                log["micro"].append({"position": batch["plan_position"].tolist(),
                                     "samples": batch["sample_ids"][: batch["num_samples"]].tolist(),
                                     "loss": float(loss_sum.detach()) / batch["step_loss_tokens"]})
                if accelerator.sync_gradients:
                    step = scheduler.step_index
                    log["steps"].append(scheduler.global_step)
                    log["lr"].append(optimizer.param_groups[0]["lr"])
                    log["unscaled_lr"].append(scheduler.get_unscaled_lr()[0])
                    log["lr_scale"].append(scheduler.scale())
                    if step == 0 and args.log_dir and accelerator.is_main_process:
                        named = accelerator.unwrap_model(model).named_parameters()
                        grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
                        torch.save(grads, os.path.join(args.log_dir, "grad0.pt"))
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and args.save_at is not None and scheduler.step_index == args.save_at + 1:
                accelerator.save_state(args.ckpt)
    if args.log_dir:
        with open(os.path.join(args.log_dir, f"rank-{accelerator.process_index}.json"), "w") as fh:
            json.dump(log, fh)
    if accelerator.is_main_process:
        print(f"rank 0: {len(log['steps'])} steps", flush=True)
    del model, optimizer, scheduler, loader  # the accelerator's own references go in end_group
    end_group(accelerator)


def end_group(accelerator) -> None:
    """End the process group here, the same way on every rank. The prepared (DDP) model holds the
    group, and the accelerator lives in reference cycles: ``destroy_process_group()`` alone leaves the
    gloo group up until the garbage collector frees the model, at any later point, while a peer may
    already have exited (a rank then hung at exit, 1 run in ~40 under load). So: release the
    prepared objects (``free_memory`` collects them), meet, then destroy the group for real."""
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy_process_group


if __name__ == "__main__":
    exit_on_error(main)  # a PlanError: its one line (also in torchrun's summary), not a traceback per rank
