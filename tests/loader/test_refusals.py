"""Refusals a new user meets in the loader (issue 37), each one line, before the wrong step and
naming the cause: a restart on a replanned plan without the parent's state, a skipped microbatch,
a dataset a plan cannot index."""

import re

import numpy as np
import pytest
import torch

from tests.loader_helpers import SyntheticTokens, write_plan
from varlen_cli.loader import Plan, PlanError, VariableBatchSizeLR, dataloader_for_plan

LENGTHS = np.random.default_rng(5).integers(1, 90, size=120)
PARENT = "feedfacefeedface"  # the parent plan's fingerprint, as `varlen replan` records it


def _plan(tmp_path, name="p", **options) -> Plan:
    path = str(tmp_path / f"{name}.parquet")
    opts = dict(dp=1, grad_accum=2, epochs=1, max_tokens=384, row_group_steps=2)
    opts.update(options)
    write_plan(path, LENGTHS, **opts)
    return Plan.open(path)


def _child(tmp_path) -> Plan:
    """A plan as `varlen replan --from-step 3` writes it: its lineage continues the job at global step 3."""
    lineage = {"kind": "replan", "parent": PARENT, "parent_path": "/x/parent.parquet", "from_step": 3,
               "consumed_samples": 10, "first_step": 3, "first_epoch": 0, "parent_dp": 2, "parent_grad_accum": 2}
    return _plan(tmp_path, "child", extra_meta={"lineage": lineage})


def _train(loader, plan, steps=None):
    """docs/loader.md's loop (a model that learns nothing: the data and LR path is what is checked)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = VariableBatchSizeLR(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), plan)
    for epoch in range(loader.epoch, plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            if batch["info"].micro == plan.grad_accum - 1:
                optimizer.step()
                scheduler.step()
    return scheduler.step_index


@pytest.mark.parametrize("stateful", [False, True])
def test_a_replanned_plan_started_fresh_is_refused(tmp_path, stateful):
    """The plain loop and torchdata trained a fresh model on the rest of the data, exit 0."""
    plan = _child(tmp_path)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1, stateful=stateful)
    with pytest.raises(PlanError, match="^" + re.escape(
            f"{plan.path} continues a job from its global step 3 (made by `varlen replan` from step 3 of its parent), "
            f"but this loader starts fresh: load the checkpoint the plan was made from (loader.load_state_dict(its "
            f"loader state)) before iterating, or a new model trains on the rest of the data only") + "$"):
        _train(loader, plan)
    # with the parent's state loaded (saved at its step 3), the same loop trains the whole plan
    resumed = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1, stateful=stateful)
    state = {"plan": PARENT, "epoch": 0, "step": 3, "micro": 0, "dp": 2}
    resumed.load_state_dict({"varlen": state} if stateful else state)
    assert _train(resumed, plan) == plan.num_steps


def test_a_skipped_microbatch_is_named(tmp_path):
    """A loop that skips a microbatch (a `continue`) blamed VariableBatchSizeLR.step()."""
    plan = _plan(tmp_path)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = VariableBatchSizeLR(optimizer, plan)
    with pytest.raises(PlanError, match="^" + re.escape(
            "desync: the loader hands out (epoch 0, step 2, rank 0, micro 1) but optimizer step 1 was never taken: "
            "nothing stepped after (epoch 0, step 1, rank 0, micro 1), the step's last microbatch (was that "
            "microbatch skipped, e.g. by a `continue` before the optimizer step? train every microbatch the loader "
            "hands out and end each step with optimizer.step() and VariableBatchSizeLR.step())") + "$"):
        for i, _batch in enumerate(loader):
            if i == 3:  # (step 1, micro 1): skipped, and with it the step's end
                continue
            if (i + 1) % plan.grad_accum == 0:
                optimizer.step()
                scheduler.step()
    assert scheduler.step_index == 1


def test_an_optimizer_step_without_the_scheduler_is_named(tmp_path):
    plan = _plan(tmp_path)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = VariableBatchSizeLR(optimizer, plan)
    with pytest.raises(PlanError, match="^" + re.escape(
            "desync: the loader hands out (epoch 0, step 2, rank 0, micro 1) but VariableBatchSizeLR is still at "
            "optimizer step 1: optimizer.step() ran after (epoch 0, step 1, rank 0, micro 1), the step's last "
            "microbatch, but VariableBatchSizeLR.step() did not (call it right after every optimizer.step(), in "
            "place of the base scheduler's)") + "$"):
        for i, _batch in enumerate(loader):
            if (i + 1) % plan.grad_accum == 0:
                optimizer.step()
                if i != 3:
                    scheduler.step()


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


class NoLen:
    def __getitem__(self, i):
        return SyntheticTokens(LENGTHS)[i]


def test_a_dataset_a_plan_cannot_index(tmp_path):
    """An IterableDataset gave `TypeError: ... has no len()`."""
    plan = _plan(tmp_path)
    with pytest.raises(PlanError, match="^" + re.escape(
            "a plan indexes a map-style dataset (dataset[sample_id]), but Stream is iterable only: write the data to "
            "files, run `varlen analyze` and `varlen plan` on them and read them with SourceDataset (a streaming "
            "planner for iterable datasets, varlen_cli.online, is to come)") + "$"):
        dataloader_for_plan(Stream(), plan, rank=0, world_size=1)
    with pytest.raises(PlanError, match="^" + re.escape(
            "NoLen has no len(): the plan is checked against the dataset's size (give the dataset a __len__, or pass "
            "check_length=False)") + "$"):
        dataloader_for_plan(NoLen(), plan, rank=0, world_size=1)
    assert next(iter(dataloader_for_plan(NoLen(), plan, rank=0, world_size=1, check_length=False)))
