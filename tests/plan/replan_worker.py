"""One rank of the elastic-restart test (tests/plan/test_replan.py): consumes a plan's epoch 0 through
``dataloader_for_plan`` under real torch.distributed (gloo), with an optimizer driven by
``VariableBatchSizeLR``, and writes what it saw to OUT/rank-R.json.

    python replan_worker.py PLAN OUT NUM_SAMPLES --stop-step N            # phase 1: steps < N, save state
    python replan_worker.py PLAN OUT NUM_SAMPLES --resume-from OUT1       # phase 2: resume on a replanned plan
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from varlen_cli.loader import Plan, VariableBatchSizeLR, dataloader_for_plan
from varlen_cli.loader.replan import lr_state_from_parent


def collate(samples):
    return {"ids": [int(i) for i in samples], "info": samples.info}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("out")
    ap.add_argument("num_samples", type=int)
    ap.add_argument("--stop-step", type=int)
    ap.add_argument("--resume-from")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = Plan.open(a.plan)
    loader = dataloader_for_plan(list(range(a.num_samples)), plan, collate_fn=collate)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = VariableBatchSizeLR(optimizer, plan)
    if a.resume_from:
        with open(os.path.join(a.resume_from, "sampler_state.json")) as f:
            loader.batch_sampler.load_state_dict(json.load(f))  # a state of the parent plan
        with open(os.path.join(a.resume_from, "lr_state.json")) as f:
            sched.load_state_dict(lr_state_from_parent(plan, json.load(f)))
    log = {"ids": [], "steps": [], "lr": [], "step_samples": [], "step_loss_tokens": []}
    for batch in loader:
        info = batch["info"]
        log["ids"] += batch["ids"]
        if info.micro + 1 < plan.grad_accum:
            continue
        count = torch.tensor([len(batch["ids"])])  # every rank agrees on the step (a real collective)
        dist.all_reduce(count)
        log["steps"].append(info.step)
        log["lr"].append(optimizer.param_groups[0]["lr"])
        log["step_samples"].append(info.step_samples)
        log["step_loss_tokens"].append(info.step_targets)
        sched.step()
        if a.stop_step is not None and info.step + 1 == a.stop_step:
            if rank == 0:
                with open(os.path.join(a.out, "sampler_state.json"), "w") as f:
                    json.dump(loader.batch_sampler.state_dict(after=batch), f)
                with open(os.path.join(a.out, "lr_state.json"), "w") as f:
                    json.dump(sched.state_dict(), f)
            break
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump(log, f)
    finish()


def finish() -> None:
    """A deterministic end (a rank once died here with SIGABRT, "terminate called without an active
    exception", under load): every rank is done with the group before any tears it down, and the
    process then exits at once, without the interpreter's teardown of gloo's threads and torch."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
