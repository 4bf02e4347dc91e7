"""torchdata's StatefulDataLoader over a plan (dataloader_for_plan(..., stateful=True)): exact
mid-epoch resume from torchdata's own state with 0 and 2 workers (and from one to the other), every sample
once per epoch, and the fetch/consumption guards still on."""

import pytest

pytest.importorskip("torchdata")

from tests.integration_helpers import NUM_SAMPLES, make_plan, small_dataset, tokens  # noqa: E402
from varlen_cli.errors import PlanError  # noqa: E402
from varlen_cli.loader import Plan, dataloader_for_plan  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("td")
    data = small_dataset(folder)
    return tokens(data), make_plan(folder, data, "padded", max_tokens=512, dp=2, grad_accum=2, epochs=2)


def _ids(batch):
    return batch["sample_ids"][: batch["num_samples"]].tolist()


def _workers(n: int) -> dict:
    return {"num_workers": n, **({"prefetch_factor": 2} if n else {})}


@pytest.mark.parametrize("workers, resume_workers", [(0, 0), (2, 2), (2, 0), (0, 2)])
def test_stateful_dataloader_exact_resume_and_exactly_once(setup, workers, resume_workers):
    """Also resumed with another number of worker processes (torchdata's own part of the state then
    cannot be restored: it was torchdata's AssertionError; the loader's position is exact)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data, plan_path = setup
    plan = Plan.open(plan_path)
    extra = _workers(workers)
    per_epoch = {0: [], 1: []}
    for rank in range(2):
        loader = dataloader_for_plan(data, plan, rank=rank, world_size=2, stateful=True, lr_scale="ignore", **extra)
        assert isinstance(loader, StatefulDataLoader)
        full, cut, state = [], plan.steps_per_epoch[0] * 2 + 3, None
        for epoch in range(plan.epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                full.append((batch["plan_position"].tolist(), _ids(batch)))
                per_epoch[epoch] += _ids(batch)
                if len(full) == cut:
                    state = loader.state_dict()  # torchdata's own state, mid-epoch 1
        want = [[plan.epoch_of(s), s, rank, m] for s in range(plan.num_steps) for m in range(plan.grad_accum)]
        assert [p for p, _ in full] == want
        resumed = dataloader_for_plan(data, plan, rank=rank, world_size=2, stateful=True, lr_scale="ignore",
                                      **_workers(resume_workers))
        resumed.load_state_dict(state)
        assert resumed.epoch == 1  # right after load_state_dict: the documented loop resumes as written
        rest = []
        for epoch in range(resumed.epoch, plan.epochs):
            resumed.set_epoch(epoch)
            rest += [(b["plan_position"].tolist(), _ids(b)) for b in resumed]
        assert rest == full[cut:]
    dropped = set(plan.dropped.get("sample_ids", []))
    for ids in per_epoch.values():
        assert sorted(ids) == sorted(set(range(NUM_SAMPLES)) - dropped)


def test_a_wrapper_that_drops_microbatches_raises(setup):
    """Any wrapper around the loader that drops or reorders microbatches stops at the first one out of place."""
    data, plan_path = setup
    loader = dataloader_for_plan(data, plan_path, rank=0, world_size=2)
    it = iter(loader)
    next(it)
    with pytest.raises(PlanError, match=r"^desync: the DataLoader fetched the microbatch at \(epoch 0, step 1, rank 0, "
                                        r"micro 0\) out of the plan's order"):
        # a batch sampler wrapper keeping every other microbatch (what accelerate's sharding does)
        import torch

        every_other = [b for i, b in enumerate(loader.batch_sampler) if i % 2 == 0]
        list(torch.utils.data.DataLoader(loader.dataset, batch_sampler=every_other, collate_fn=loader.collate_fn))
    # a wrapper around the loader's iteration that drops a microbatch (e.g. a broken skip_first_batches): the
    # trainer reports what the model gets, and the first batch out of place stops it
    loader = dataloader_for_plan(data, plan_path, rank=0, world_size=2)
    loader.consumed_by_trainer = True
    with pytest.raises(PlanError, match=r"^desync: the trainer consumed the microbatch at \(epoch 0, step 1, rank 0, "
                                        r"micro 0\) where the plan's next one is \(epoch 0, step 0, rank 0, "
                                        r"micro 1\): a "
                                        r"wrapper dropped or reordered microbatches$"):
        for i, batch in enumerate(loader):
            if i != 1:
                loader.mark_consumed(batch)


def test_plan_check_batch_against_the_step(setup):
    data, plan_path = setup
    plan = Plan.open(plan_path)
    batch = next(iter(dataloader_for_plan(data, plan, rank=1, world_size=2)))
    assert plan.check(batch, 0, rank=1) == (0, 0, 1, 0)
    moved = {k: (v.to("cpu") if hasattr(v, "to") else v) for k, v in batch.items() if k != "info"}  # only tensors
    assert plan.check(moved, 0) == (0, 0, 1, 0)
    with pytest.raises(PlanError, match=r"^desync: the trainer is applying optimizer step 3 \(epoch 0\) but consumed "
                                        r"the microbatch at \(epoch 0, step 0, rank 1, micro 0\): the data stream "
                                        r"and the step count disagree"):
        plan.check(batch, 3)
    with pytest.raises(PlanError, match=r"^desync: rank 0 consumed the microbatch of rank 1 at"):
        plan.check(batch, 0, rank=0)
