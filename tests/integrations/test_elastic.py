"""Elastic restart end to end (issue 21): a 2-rank job trained to step N is re-planned with
``varlen replan --from-step N --dp 3`` and continued on 3 ranks through each framework's own resume
(plain DDP: examples/train_tiny_lm.py; Hugging Face PlanTrainer; Lightning PlanDataModule). Across
both plans every sample is trained exactly once per epoch, the job's global steps run 0..end without
a gap or repeat, and the LR at every global step is the base schedule there times the plan's lr_scale.
"""

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.integration_helpers import load_example, logs, make_plan, small_dataset, torchrun
from varlen_cli.cli import app
from varlen_cli.loader import Plan
from varlen_cli.loader.replan import first_epoch, first_step

ROWS = 160  # a slice of sample_data/tokenized.parquet: a few steps per epoch on 2 and on 3 ranks


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("elastic")
    data = str(folder / "rows.parquet")
    pq.write_table(pq.read_table(small_dataset(folder)).slice(0, ROWS), data)
    parent = make_plan(folder, data, "parent", max_tokens=512, dp=2, grad_accum=2, epochs=2)
    return folder, data, Plan.open(parent)


def _replan(parent: Plan, step: int, out) -> Plan:
    """``varlen replan PARENT --from-step STEP --dp 3 -o OUT`` (the CLI, in this process)."""
    res = CliRunner().invoke(app, ["replan", parent.path, "--from-step", str(step), "--dp", "3", "-o", str(out)])
    assert res.exit_code == 0, res.output
    new = Plan.open(str(out))
    assert (first_step(new), new.dp, new.grad_accum) == (step, 3, parent.grad_accum)
    return new


def _job_epoch(parent: Plan, new: Plan, step: int) -> int:
    n = first_step(new)
    return parent.epoch_of(step) if step < n else first_epoch(new) + new.epoch_of(step - n)


def _scale(parent: Plan, new: Plan, step: int) -> float:
    n = first_step(new)
    return float(parent.lr_scales()[step] if step < n else new.lr_scales()[step - n])


def _check_job(parent: Plan, new: Plan, before: list, after: list, base_lr: float, factor) -> None:
    """``before``/``after``: per rank logs of the 2-rank and the 3-rank run. Steps, samples, LR."""
    n, end = first_step(new), first_step(new) + new.num_steps
    for log in before:
        assert log["steps"] == list(range(n))
    for log in after:
        assert log["steps"] == list(range(n, end))
    per_epoch: dict = {}
    for log in before + after:
        for step, samples in _samples_by_step(log, parent, new, log in after):
            per_epoch.setdefault(_job_epoch(parent, new, step), []).extend(samples)
        expected = [base_lr * factor(s) * _scale(parent, new, s) for s in log["steps"]]
        assert np.allclose(log["lr"], expected, rtol=1e-9, atol=1e-15), (log["lr"][:4], expected[:4])
    dropped = set(parent.dropped.get("sample_ids", []))
    assert sorted(per_epoch) == list(range(parent.epochs))
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == sorted(set(range(ROWS)) - dropped), epoch  # exactly once per epoch, both plans


def _samples_by_step(log: dict, parent: Plan, new: Plan, replanned: bool):
    """(global step, sample ids) of each microbatch (or step) a rank trained."""
    if "micro" in log:  # HF / Lightning: per microbatch, plan-relative position
        offset = first_step(new) if replanned else 0
        return [(m["position"][1] + offset, m["samples"]) for m in log["micro"]]
    return list(zip(log["steps"], log["samples"]))  # train_tiny_lm: per step, global steps


@pytest.mark.slow
def test_plain_ddp_restart_on_three_ranks(setup):
    folder, data, parent = setup
    n = parent.steps_per_epoch[0] // 2
    state = folder / "ddp-state.pt"
    common = ["--data", data, "--lr", "0.01", "--warmup-steps", "2", "--total-steps", str(parent.num_steps),
              "--d-model", "32", "--layers", "1"]
    torchrun("train_tiny_lm.py", "--plan", parent.path, "--max-steps", n, "--save-state", state, "--save-at", n - 1,
             "--log-dir", folder / "ddp1", *common)
    new = _replan(parent, n, folder / "ddp-new.parquet")
    torchrun("train_tiny_lm.py", "--plan", new.path, "--resume", state, "--log-dir", folder / "ddp2", *common, nproc=3)
    factor = load_example("tiny_lm").warmup_cosine(2, parent.num_steps)
    _check_job(parent, new, logs(folder / "ddp1", 2), logs(folder / "ddp2", 3), 0.01, factor)


@pytest.mark.slow
def test_hf_plan_trainer_restart_on_three_ranks(setup):
    folder, data, parent = setup
    n = parent.steps_per_epoch[0] // 2
    warmup = n + 3  # the warm-up ramp runs across the restart: a restarted schedule would show
    common = ["--data", data, "--lr", "3e-3", "--scheduler", "constant_with_warmup", "--warmup-steps", warmup,
              "--max-grad-norm", "0"]
    torchrun("train_hf_trainer.py", "--plan", parent.path, "--out", folder / "hf1", "--max-steps", n,
             "--save-steps", n, "--log-dir", folder / "hflog1", *common)
    new = _replan(parent, n, folder / "hf-new.parquet")
    os.makedirs(folder / "hf2")
    os.rename(folder / "hf1" / f"checkpoint-{n}", folder / "hf2" / f"checkpoint-{n}")
    torchrun("train_hf_trainer.py", "--plan", new.path, "--out", folder / "hf2", "--resume",
             "--log-dir", folder / "hflog2", *common, nproc=3)
    _check_job(parent, new, logs(folder / "hflog1", 2), logs(folder / "hflog2", 3), 3e-3,
               lambda s: min(1.0, s / warmup))  # transformers' constant_with_warmup, written out


@pytest.mark.slow
def test_lightning_restart_on_three_ranks(setup):
    folder, data, parent = setup
    n = parent.steps_per_epoch[0] // 2
    common = ["--data", data, "--lr", "3e-3", "--warmup-steps", "2", "--total-steps", str(parent.num_steps)]
    torchrun("train_lightning.py", "--plan", parent.path, "--max-steps", n, "--ckpt-dir", folder / "pl",
             "--save-every", n, "--log-dir", folder / "pllog1", *common)
    new = _replan(parent, n, folder / "pl-new.parquet")
    torchrun("train_lightning.py", "--plan", new.path, "--resume", folder / "pl" / f"step={n}.ckpt",
             "--log-dir", folder / "pllog2", *common, nproc=3)
    factor = load_example("tiny_lm").warmup_cosine(2, parent.num_steps)
    _check_job(parent, new, logs(folder / "pllog1", 2), logs(folder / "pllog2", 3), 3e-3, factor)
