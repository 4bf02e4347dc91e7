"""torchtitan 0.3 on a plan: ``PlanDataLoader`` built through its ``Config.build`` as torchtitan's Trainer
builds it, checkpointed by torchtitan's own ``CheckpointManager`` (DCP).

The 2-rank test (tests/integrations/torchtitan_ranks.py; the full run under the real torchrun, the
rest under tests/launcher.py): each rank's stream is its plan rows; positions restart at every document
and labels never cross one (checked against the data); torchtitan's global target count equals the
plan's; a fresh pair of processes resumes mid-epoch from the checkpoint exactly; 3 ranks loading the
2-rank checkpoint with the same plan are refused naming ``varlen replan``, and accepted with the plan it
writes (every sample once per epoch across both plans). torchtitan's Trainer itself needs a GPU, so its
training loop is not run here; the in-process tests cover padded plans, torchtitan main's folded
batches and the refusals.
"""

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("torchtitan.components.dataloader")

from typer.testing import CliRunner  # noqa: E402

from tests.integration_helpers import check_stream, logs, make_plan, real_torchrun, small_dataset, tokens  # noqa: E402
from tests.launcher import launch  # noqa: E402
from varlen_cli.cli import app  # noqa: E402
from varlen_cli.errors import PlanError  # noqa: E402
from varlen_cli.integrations.torchtitan import PlanDataLoader  # noqa: E402
from varlen_cli.loader import Plan  # noqa: E402
from varlen_cli.loader.replan import first_step  # noqa: E402

RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchtitan_ranks.py")
IMPORTS = ("torchtitan.components.checkpoint", "torchtitan.components.optimizer", "varlen_cli.integrations.torchtitan")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torchtitan")
    data = small_dataset(folder)
    packed = make_plan(folder, data, "packed", packing=True, seq_len=512, max_tokens=512, dp=2, grad_accum=2,
                       epochs=2, lr_scaling="none")
    return folder, data, Plan.open(packed)


def build(plan, dataset, rank=0, world=2, **kwargs):
    """``Config.build`` with the arguments torchtitan 0.3's Trainer passes (no process group needed)."""
    extra = dict(dict(tokenizer=None, seq_len=512, local_batch_size=1, snapshot_every_n_steps=None), **kwargs)
    return PlanDataLoader.Config(plan=plan, dataset=dataset).build(dp_world_size=world, dp_rank=rank, **extra)


def check_documents(plan: Plan, micro: dict, data_tokens: list) -> None:
    """A packed microbatch as torchtitan reads it: each row is its plan entries back to back, positions
    restart at 0 at each entry and at the padding tail, labels are the next token inside an entry and
    -100 on an entry's last token and on padding."""
    _, step, rank, m = micro["position"]
    row = plan.microbatch(step, rank, m)
    inputs, positions, labels = (np.array(micro[k]) for k in ("input", "positions", "labels"))
    assert inputs.shape == (row.batch_size, row.seqlen)
    starts = np.zeros_like(positions, dtype=bool)
    want_labels = np.full(inputs.shape, -100)
    col = np.zeros(row.batch_size, dtype=int)
    for sid, length, r in zip(row.sample_ids, row.sample_lengths, row.sample_rows):
        doc, c = data_tokens[sid], col[r]
        assert len(doc) == length and inputs[r, c:c + length].tolist() == doc.tolist()
        assert positions[r, c:c + length].tolist() == list(range(length))
        want_labels[r, c:c + length - 1] = doc[1:]
        starts[r, c] = True
        col[r] += length
    for r in range(row.batch_size):
        if col[r] < row.seqlen:
            starts[r, col[r]] = True  # the padding tail: a segment of its own
    assert np.array_equal(positions == 0, starts)  # torchtitan's document boundaries
    assert np.array_equal(labels, want_labels)


def _launch(*args, nproc=2, real=False):
    if real:
        proc = real_torchrun(RANKS, *args, nproc=nproc)
    else:
        proc = launch(RANKS, *args, nproc=nproc, imports=IMPORTS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_two_ranks_stream_resume_and_elastic_restart(setup):
    folder, data, plan = setup
    n = plan.steps_per_epoch[0] // 2  # a checkpoint in the middle of epoch 0
    common = [str(folder / "metrics"), str(folder / "run"), "--interval", str(n)]
    os.makedirs(folder / "log1")
    _launch(plan.path, common[0], common[1], str(folder / "log1"), *common[2:], real=False)
    full = logs(folder / "log1")
    check_stream(plan, full)
    data_tokens = tokens(data)
    for log in full:
        assert log["steps"] == list(range(1, plan.num_steps + 1))
        assert all(got == want for got, want in log["valid"])  # torchtitan's global_valid_tokens = the plan's
        for micro in log["micro"]:
            check_documents(plan, micro, data_tokens)
    # a fresh pair of processes resumes from torchtitan's checkpoint at step n
    os.makedirs(folder / "log2")
    _launch(plan.path, common[0], common[1], str(folder / "log2"), *common[2:], "--load-step", str(n))
    for a, b in zip(full, logs(folder / "log2")):
        assert b["loaded_step"] == n and b["steps"] == a["steps"][n:]
        assert b["micro"] == a["micro"][n * plan.grad_accum:]
    # 3 ranks: the 2-rank plan is refused, the plan `varlen replan` writes resumes from the same checkpoint
    out = folder / "packed-dp3.parquet"
    res = CliRunner().invoke(app, ["replan", plan.path, "--from-step", str(n), "--dp", "3", "-o", str(out)])
    assert res.exit_code == 0, res.output
    new = Plan.open(str(out))
    os.makedirs(folder / "log3")
    _launch(new.path, common[0], common[1], str(folder / "log3"), *common[2:], "--load-step", str(n),
            "--refused-plan", plan.path, nproc=3)
    after = logs(folder / "log3", 3)
    command = f"varlen replan {plan.path} --from-step {n} --dp 3 -o packed-dp3.parquet"
    for log in after:
        assert log["refused"] == (f"the checkpoint was saved at step {n} on 2 data-parallel rank(s) but this job has "
                                  f"3: make the rest of the plan for 3 with `{command}` and resume from this "
                                  f"checkpoint with that plan")
        assert log["loaded_step"] == n and log["steps"] == list(range(n + 1, n + new.num_steps + 1))
    _check_elastic(plan, new, full, after)


def _check_elastic(parent: Plan, new: Plan, before: list, after: list) -> None:
    """The 3-rank runs are the new plan's rows; every sample once per job epoch across both plans."""
    n = first_step(new)
    per_epoch: dict = {}
    for rank, log in enumerate(after):
        want = [(new.epoch_of(s), s, rank, m) for s in range(new.num_steps) for m in range(new.grad_accum)]
        assert [tuple(m["position"]) for m in log["micro"]] == want
        for m in log["micro"]:
            assert m["samples"] == new.microbatch(m["position"][1], rank, m["position"][3]).sample_ids.tolist()
            per_epoch.setdefault(new.meta["lineage"]["first_epoch"] + m["position"][0], []).extend(m["samples"])
    for log in before:
        for m in log["micro"]:
            if m["position"][1] < n:
                per_epoch.setdefault(m["position"][0], []).extend(m["samples"])
    dropped = set(parent.dropped.get("sample_ids", []))
    for ids in per_epoch.values():
        assert sorted(ids) == sorted(set(range(300)) - dropped)


# -- in one process (explicit ranks, no process group) --------------------------------------------------
@pytest.fixture(scope="module")
def padded(setup):
    folder, data, _ = setup
    return Plan.open(make_plan(folder, data, "padded", max_tokens=512, dp=2, grad_accum=2, epochs=1,
                               lr_scaling="none"))


def test_padded_plan_batches(setup, padded):
    folder, data, _ = setup
    rows = pq.read_table(data).column("input_ids").to_pylist()
    loader = build(padded.path, rows, rank=1)
    inputs, labels = next(iter(loader))
    row = loader.last
    ids, positions = inputs["input"], inputs["positions"]
    assert ids.shape == (row.batch_size, row.seqlen) and (row.rank, row.step, row.micro) == (1, 0, 0)
    for r, sid in enumerate(row.sample_ids):
        doc = rows[sid]
        assert ids[r, :len(doc)].tolist() == doc and labels[r, :len(doc) - 1].tolist() == doc[1:]
        assert (labels[r, len(doc) - 1:] == -100).all()
    assert torch.equal(positions, torch.arange(row.seqlen).expand(row.batch_size, -1))


def test_torchtitan_main_contract_folds_and_pads(setup):
    """torchtitan main (pytorch/torchtitan#4088) builds with max_context_length and num_tokens_per_batch
    and takes 1-D batches of exactly num_tokens_per_batch token slots."""
    folder, _, plan = setup
    main_args = dict(tokenizer=None, max_context_length=512, num_tokens_per_batch=600)
    loader = PlanDataLoader.Config(plan=plan.path, dataset=str(folder / "metrics")).build(
        dp_world_size=2, dp_rank=0, **main_args)
    inputs, labels = next(iter(loader))
    slots = loader.last.batch_size * loader.last.seqlen
    assert inputs["input"].shape == labels.shape == inputs["positions"].shape == (600,)
    assert (labels[slots:] == -100).all() and inputs["positions"][slots:].tolist() == list(range(600 - slots))
    small = PlanDataLoader.Config(plan=plan.path, dataset=str(folder / "metrics")).build(
        dp_world_size=2, dp_rank=0, **dict(main_args, num_tokens_per_batch=100))
    with pytest.raises(PlanError, match=r"^the plan's microbatch at step 0 \(rank 0, micro 0\) has 1 x 512 = 512 "
                                        r"token slots, more than training.num_tokens_per_microbatch_per_dp_rank 100$"):
        next(iter(small))


def test_refusals(setup):
    folder, data, plan = setup
    metrics = str(folder / "metrics")
    with pytest.raises(PlanError, match=r"^the plan has rows of 512 tokens but torchtitan's context length is 256: "
                                        r"set training.seq_len \(max_context_length on torchtitan main\) to at "
                                        r"least 512$"):
        build(plan.path, metrics, seq_len=256)
    scaled = make_plan(folder, data, "scaled", max_tokens=512, dp=2, grad_accum=2, epochs=1, lr_scaling="linear")
    ignored = PlanDataLoader.Config(plan=scaled, dataset=metrics, lr_scale="ignore").build(dp_world_size=2, dp_rank=0)
    assert ignored.stream.loader.guard.lr_scale == "ignore"  # the loader's LR-coverage check, told to let it pass
    assert len(list(ignored)) == Plan.open(scaled).num_steps * 2
    with pytest.raises(PlanError, match=r"^PlanDataLoader.Config needs dataset= "):
        PlanDataLoader.Config(plan=plan.path).build(dp_world_size=2, dp_rank=0)
    loader = build(plan.path, metrics)
    batches = iter(loader)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizers = [torch.optim.SGD([weight], lr=0.1), torch.optim.SGD([weight], lr=0.1)]  # torchtitan's container
    next(batches)
    with pytest.raises(PlanError, match=r"^an optimizer step follows 1 microbatch\(es\) up to micro 0 of the "
                                        r"plan's step 0, whose steps have 2: torchtitan's gradient accumulation is not "
                                        r"the plan's --grad-accum 2 \(set training.global_batch_size = "
                                        r"local_batch_size x dp x 2\)$"):
        optimizers[0].step()  # before the update: the weight is untouched
    assert weight.detach().tolist() == [0.0, 0.0] and json.loads(loader.state_dict()["varlen"])["micro"] == 1
    next(batches)
    for opt in optimizers:  # one plan step, every optimizer of the container
        weight.grad = torch.ones(2)
        opt.step()
    next(batches), next(batches), next(batches)
    with pytest.raises(PlanError, match=r"^an optimizer step follows 3 microbatch\(es\) up to micro 0 of the plan's "
                                        r"step 2"):
        optimizers[0].step()
    loader.close()
    optimizers[0].step()  # the hook went with close()
    fresh = build(plan.path, metrics)
    fresh.load_state_dict({})  # torchtitan's checkpoint without a loader state: nothing to load
    fresh.load_state_dict({"varlen": "{}"})  # a loader that had handed out nothing
    for bad in ({"varlen": "not json"}, {"varlen": "[]"}, {"varlen": "0"}, {"other": 1}, ["varlen"], {"varlen": 3}):
        with pytest.raises(PlanError, match=r"^invalid loader state: torchtitan's data loader state must be "
                                            r"\{'varlen': the JSON text PlanDataLoader.state_dict\(\) wrote\}, not "):
            fresh.load_state_dict(bad)
    with pytest.raises(PlanError, match=r"^invalid loader state: "):
        fresh.load_state_dict({"varlen": json.dumps({"epoch": "x"})})  # the loader's own schema check


def test_replanned_plan_without_its_checkpoint_is_refused(setup):
    folder, _, plan = setup
    out = folder / "fresh-dp3.parquet"
    res = CliRunner().invoke(app, ["replan", plan.path, "--from-step", "1", "--dp", "3", "-o", str(out)])
    assert res.exit_code == 0, res.output
    loader = build(str(out), str(folder / "metrics"), world=3)
    with pytest.raises(PlanError, match=r"continues a job from its global step 1 \(made by `varlen replan`\): resume "
                                        r"from the checkpoint it was made from$"):
        next(iter(loader))
