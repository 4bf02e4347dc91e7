"""One rank of tests/integrations/test_torchtitan.py: torchtitan 0.3's data side of a training job.

The ``PlanDataLoader`` is built through its ``Config.build`` with the arguments torchtitan's Trainer
passes, and checkpointed by torchtitan's own ``CheckpointManager`` (DCP) with a model, torchtitan's
``OptimizersContainer`` and ``LRSchedulersContainer`` and a train state, as the Trainer does. Each step
fetches ``grad_accum`` microbatches first and counts their targets the Trainer's way (labels != -100,
all-reduced), then steps torchtitan's optimizers and LR schedulers and saves. torchtitan's Trainer
needs a GPU; everything here is its CPU data path.

    torchrun ... torchtitan_ranks.py PLAN DATA FOLDER LOG [--interval K] [--load-step N] [--refused-plan P]
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from varlen_cli.errors import PlanError
from varlen_cli.integrations.torchtitan import PlanDataLoader


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``: its step."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def build(plan, data, folder, interval, rank, world):
    loader = PlanDataLoader.Config(plan=plan, dataset=data).build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=512, local_batch_size=1,
        snapshot_every_n_steps=None)
    model = torch.nn.Linear(4, 4)
    optimizers = default_adamw(lr=1e-3, implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=1000)
    state = TrainState()
    checkpointer = CheckpointManager.Config(enable=True, folder="ckpt", interval=interval, keep_latest_k=0).build(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=folder)
    return loader, checkpointer, state, (model, optimizers, schedulers)


def train(loader, checkpointer, state, parts, log):
    model, optimizers, schedulers = parts
    grad_accum = loader.plan.grad_accum
    data = iter(loader)
    while True:
        fetched, valid = [], torch.tensor(0)
        for _ in range(grad_accum):  # torchtitan's train_step fetches the step's microbatches first
            try:
                inputs, labels = next(data)
            except StopIteration:
                return
            valid += (labels != -100).sum()
            row = loader.last
            fetched.append({"position": [row.epoch, row.step, row.rank, row.micro],
                            "samples": row.sample_ids.tolist(), "input": inputs["input"].tolist(),
                            "positions": inputs["positions"].tolist(), "labels": labels.tolist()})
        dist.all_reduce(valid)  # torchtitan's global_valid_tokens
        for param in model.parameters():
            param.grad = torch.full_like(param, float(valid))
        optimizers.step()  # the loader's optimizer hook checks that a whole plan step was fetched
        schedulers.step()
        optimizers.zero_grad()
        state.step += 1
        log["micro"] += fetched
        log["steps"].append(state.step)
        log["valid"].append([int(valid), int(loader.last.step_loss_tokens)])
        checkpointer.save(state.step)


def main():
    parser = argparse.ArgumentParser()
    for name in ("plan", "data", "folder", "log"):
        parser.add_argument(name)
    parser.add_argument("--interval", type=int, default=1000)
    parser.add_argument("--load-step", type=int)
    parser.add_argument("--refused-plan")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = {"micro": [], "steps": [], "valid": [], "refused": None}
    if args.refused_plan:  # the checkpoint's own plan on another number of ranks
        loader, checkpointer, _, _ = build(args.refused_plan, args.data, args.folder, args.interval, rank, world)
        try:
            checkpointer.load(step=args.load_step)
        except PlanError as exc:
            log["refused"] = str(exc)
        checkpointer.close()
    loader, checkpointer, state, parts = build(args.plan, args.data, args.folder, args.interval, rank, world)
    if args.load_step is not None:
        assert checkpointer.load(step=args.load_step)
        log["loaded_step"] = state.step
    train(loader, checkpointer, state, parts, log)
    checkpointer.close()
    with open(os.path.join(args.log, f"rank-{rank}.json"), "w") as fh:
        json.dump(log, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
