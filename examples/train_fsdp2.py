"""Train a tiny Llama (from a config) sharded with FSDP2 (``fully_shard``) on a varlen plan.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --plan /tmp/plan.parquet --ckpt /tmp/fsdp --save-at 3
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --plan /tmp/plan.parquet --ckpt /tmp/fsdp --resume

FSDP2 needs no glue: the plan's loader, ``VariableBatchSizeLR`` and the exact loss normalisation
work as with DDP (FSDP2 averages gradients over ranks like DDP: multiply the summed loss by the
world size and divide by the step's targets). Gradient accumulation: ``set_requires_gradient_sync``
off for all but the last microbatch. Checkpoints: model and optimizer through
``torch.distributed.checkpoint`` (sharded), LR scheduler and loader state (the consumed position)
in the same folder.
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tiny_lm import TokenDataset, warmup_cosine  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from train_hf_trainer import tiny_llama  # noqa: E402

from varlen_cli.errors.entry import exit_on_error  # noqa: E402
from varlen_cli.loader import Plan, VariableBatchSizeLR, dataloader_for_plan, to_model_inputs  # noqa: E402
from varlen_cli.runtime.dist import collective_timeout  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--data", default=os.path.join(ROOT, "sample_data", "tokenized.parquet"))
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--save-at", type=int, default=None, help="checkpoint after this global step")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--log-dir", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    # a collective waits at most VARLEN_TIMEOUT seconds (default 1800) for a peer, then this rank fails
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=collective_timeout()))
    train(args)  # returns holding nothing of FSDP: its locals (model, optimizer, the loop's values) die with it
    end_group()


def train(args) -> None:
    """Train on the plan. Its own function so that everything holding the sharded model is gone when it
    returns: besides ``model`` and ``optimizer``, the last ``layer`` that ``fully_shard`` wrapped (its FSDP
    state shares one context with the root's) and the last microbatch's ``logits`` and ``loss_sum`` (their
    autograd graph carries FSDP's pre-backward hooks, bound to its state) each keep all FSDP modules, and
    with them the process group, alive."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = Plan.open(args.plan)
    dataset = TokenDataset(args.data)
    model = tiny_llama(dataset.vocab_size, max(t for _, t in plan.shapes))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = VariableBatchSizeLR(torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup_steps,
                                                                                                plan.num_steps)), plan)
    loader = dataloader_for_plan(dataset, plan)
    if args.resume:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        extra = torch.load(os.path.join(args.ckpt, "plan_state.pt"), weights_only=False)
        scheduler.load_state_dict(extra["lr"])
        loader.load_state_dict(extra["loader"])
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    log = {"steps": [], "lr": [], "unscaled_lr": [], "lr_scale": [], "micro": []}
    ga = plan.grad_accum
    for epoch in range(loader.epoch, plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            micro = batch["info"].micro
            model.set_requires_gradient_sync(micro == ga - 1)  # reduce-scatter once per step
            logits = model(**to_model_inputs(batch, labels=False)).logits
            loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
            (loss_sum * world / batch["step_loss_tokens"]).backward()
            log["micro"].append({"position": batch["plan_position"].tolist(),
                                 "samples": batch["sample_ids"][: batch["num_samples"]].tolist(),
                                 "loss": float(loss_sum.detach()) / batch["step_loss_tokens"]})
            if micro != ga - 1:
                continue
            step = scheduler.step_index
            log["steps"].append(step)
            log["lr"].append(optimizer.param_groups[0]["lr"])
            log["unscaled_lr"].append(scheduler.get_unscaled_lr()[0])
            log["lr_scale"].append(scheduler.scale())
            if step == 0 and args.log_dir:
                grads = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()
                         if p.grad is not None}
                if rank == 0:
                    torch.save(grads, os.path.join(args.log_dir, "grad0.pt"))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if args.save_at is not None and step == args.save_at:
                model_state, optim_state = get_state_dict(model, optimizer)
                dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=args.ckpt)
                if rank == 0:
                    torch.save({"lr": scheduler.state_dict(), "loader": loader.state_dict()},
                               os.path.join(args.ckpt, "plan_state.pt"))
                dist.barrier()
    if args.log_dir:
        with open(os.path.join(args.log_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(log, fh)
    if rank == 0:
        print(f"rank 0: {len(log['steps'])} steps", flush=True)


def end_group() -> None:
    """End the process group here, the same way on every rank: ``destroy_process_group()`` alone only
    unregisters a gloo group while a model holding it lives on, and the garbage collector then tears it
    down at any later point, while a peer may already have exited (a hang at exit under load). So: once
    nothing holds the model (``train`` returned), collect, meet, end the group."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_error(main)  # a PlanError: its one line (also in torchrun's summary), not a traceback per rank
