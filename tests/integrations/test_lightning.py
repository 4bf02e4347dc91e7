"""Lightning on a plan (varlen_cli.integrations.lightning): 2-process DDP on CPU (gloo) with exact stream,
LR, first-step gradient and a mid-epoch resume from Lightning's own checkpoint; the plain setup's
silent failures prevented or refused with a one-line PlanError."""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from tests.integration_helpers import (  # noqa: E402
    assert_grads_close,
    check_lr,
    check_stream,
    check_tracker_figures,
    load_example,
    logs,
    make_plan,
    reference_grads,
    small_dataset,
    tokens,
    torchrun,
)
from varlen_cli.errors import PlanError  # noqa: E402
from varlen_cli.loader import Plan, dataloader_for_plan  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pl")
    data = small_dataset(folder)
    return folder, data, make_plan(folder, data, "padded", max_tokens=512, dp=2, grad_accum=2, epochs=2)


@pytest.mark.slow
def test_lightning_two_ranks_exact_stream_lr_gradient_and_mid_epoch_resume(setup):
    folder, data, plan_path = setup
    plan = Plan.open(plan_path)
    every = 3
    common = ["--plan", plan_path, "--data", data, "--lr", "3e-3", "--warmup-steps", "2"]
    torchrun("train_lightning.py", *common, "--ckpt-dir", folder / "ck", "--save-every", every, "--log-dir",
             folder / "full", "--tensorboard", folder / "tb")  # tests/launcher.py, checked against the real
    full = logs(folder / "full")  # torchrun (tests/test_launcher.py)
    check_stream(plan, full)
    # TensorBoardLogger: the plan's figures of every step through pl_module.log, at Lightning's step (0-based)
    check_tracker_figures(plan_path, folder / "tb", "", 0, range(plan.num_steps))
    check_lr(plan, full, 3e-3, load_example("tiny_lm").warmup_cosine(2, plan.num_steps))
    data_tokens = tokens(data)
    vocab = max(int(t.max()) for t in data_tokens) + 1
    model = load_example("train_hf_trainer").tiny_llama(vocab, max(t for _, t in plan.shapes))
    assert_grads_close(torch.load(os.path.join(folder / "full", "grad0.pt")), reference_grads(model, plan, data_tokens))
    # a checkpoint strictly inside epoch 0 (Lightning's own file, saved after optimizer step k)
    start1 = plan.epoch_start(1)
    k = next(s for s in range(every, start1 - 1, every))
    source = folder / "ck" / f"step={k}.ckpt"
    source_bytes = source.read_bytes()
    # crash twice in the middle of a step, with Lightning's OnExceptionCheckpoint (written as of the step's
    # start): inside epoch 0, then in the first step of epoch 1; the source is never re-saved, and each
    # crash's checkpoint resumes exactly
    crashes = (k + 1, start1)
    for crash, resume_from in zip(crashes, (source, folder / "ck" / "on-exception.ckpt")):
        proc = torchrun("train_lightning.py", *common, "--ckpt-dir", folder / "ck", "--save-every", every,
                        "--resume", resume_from, "--crash-at-step", crash, "--save-on-crash", expect_ok=False)
        assert proc.returncode != 0 and f"a crash in the middle of optimizer step {crash}" in proc.stderr
        assert source.read_bytes() == source_bytes
        files = os.listdir(folder / "ck")
        assert sorted(f for f in files if "-v" not in f) == sorted(
            ["on-exception.ckpt"] + [f"step={s}.ckpt" for s in range(every, plan.num_steps + 1, every)])
        # steps saved again after the resume get Lightning's own version suffix; never the source's step
        assert all(int(f.split("=")[1].split("-")[0]) > k for f in files if "-v" in f), files
    torchrun("train_lightning.py", *common, "--resume", folder / "ck" / "on-exception.ckpt", "--log-dir",
             folder / "resumed", "--tensorboard", folder / "tb2")
    resumed = logs(folder / "resumed")
    check_tracker_figures(plan_path, folder / "tb2", "", 0, range(start1, plan.num_steps))
    for a, b in zip(full, resumed):
        assert b["steps"] == a["steps"][start1:] and b["lr"] == a["lr"][start1:]
        assert b["micro"] == a["micro"][start1 * plan.grad_accum:]  # positions, samples, losses: bit-identical


def test_a_checkpoint_saved_in_the_middle_of_a_step_without_its_start_is_refused(setup, tmp_path, monkeypatch):
    """A mid-step checkpoint that holds its mid-step position (one varlen did not rewind: written by an
    older varlen) is refused in one line that names the cause, not gradient accumulation."""
    from varlen_cli.integrations import lightning as plan_lightning

    folder, data, _ = setup
    one = make_plan(folder, data, "dp1", max_tokens=512, dp=1, grad_accum=2, epochs=2)
    example = load_example("train_lightning")
    common = ["--plan", one, "--data", data, "--ckpt-dir", str(tmp_path), "--max-steps", "3"]
    monkeypatch.setattr(plan_lightning.StepStart, "rewind", lambda *args: None)
    with pytest.raises(RuntimeError, match="a crash in the middle of optimizer step 1"):
        example.main([*common, "--crash-at-step", "1", "--save-on-crash"])
    monkeypatch.undo()
    ckpt = tmp_path / "on-exception.ckpt"
    with pytest.raises(PlanError) as error:
        example.main([*common, "--resume", str(ckpt)])
    assert str(error.value) == (
        f"{ckpt} was saved in the middle of optimizer step 1 (2 of its 2 microbatches trained, the optimizer not yet "
        f"stepped) and a Lightning checkpoint does not hold the gradient they accumulated, so training cannot "
        f"continue exactly from it (checkpoints written under PlanDataModule by this varlen hold the step's start): "
        f"resume from an earlier checkpoint")


def test_batches_survive_lightning_transfer_and_set_epoch_reaches_the_plan(setup):
    """The plain setup broke transfer_batch_to_device (a frozen dataclass in the batch) and replayed
    epoch 0 (set_epoch reached only batch_sampler.sampler)."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.pytorch.utilities import move_data_to_device

    folder, data, plan_path = setup
    loader = dataloader_for_plan(tokens(data), plan_path, rank=1, world_size=2, lr_scale="ignore")
    batch = next(iter(loader))
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert moved["plan_position"].tolist() == [0, 0, 1, 0] and moved["info"].step == 0
    assert not dataclasses.is_dataclass(moved["info"])
    loader.end_epoch()  # one batch of epoch 0 is all this test trains
    _set_sampler_epoch(loader, 1)
    assert loader.batch_sampler.epoch == 1
    assert next(iter(loader))["plan_position"].tolist() == [1, Plan.open(plan_path).epoch_start(1), 1, 0]


def test_trainer_settings_that_disagree_with_the_plan_are_refused(setup):
    import lightning.pytorch as L

    from varlen_cli.integrations.lightning import PlanDataModule

    folder, data, _ = setup
    one = make_plan(folder, data, "dp1", max_tokens=512, dp=1, grad_accum=2, epochs=2)
    module = load_example("train_lightning").TinyLlamaModule(2000, 512, 1e-3, 1, 10)
    cases = [
        (dict(use_distributed_sampler=True, accumulate_grad_batches=2, max_epochs=2),
         r"^Trainer\(use_distributed_sampler=True\) would re-shard the plan's per-rank batches: pass "
         r"use_distributed_sampler=False$"),
        (dict(use_distributed_sampler=False, accumulate_grad_batches=1, max_epochs=2),
         r"^Trainer\(accumulate_grad_batches=1\) but the plan was made with --grad-accum 2: pass "
         r"accumulate_grad_batches=2$"),
        (dict(use_distributed_sampler=False, accumulate_grad_batches=2, max_epochs=3),
         r"^Trainer\(max_epochs=3\) but the plan has 2 epoch\(s\): pass max_epochs=2 "
         r"\(or re-plan with more --epochs\)$"),
    ]
    for kwargs, message in cases:
        dm = PlanDataModule(tokens(data), one)
        trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[dm.callback()], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            reload_dataloaders_every_n_epochs=1, **kwargs)
        with pytest.raises(PlanError, match=message):
            trainer.fit(module, datamodule=dm)
