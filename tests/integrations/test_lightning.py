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
             folder / "full", "--tensorboard", folder / "tb", real=True)  # the real torchrun; the resume under
    full = logs(folder / "full")  # tests/launcher.py
    check_stream(plan, full)
    # TensorBoardLogger: the plan's figures of every step through pl_module.log, at Lightning's step (0-based)
    check_tracker_figures(plan_path, folder / "tb", "", 0, range(plan.num_steps))
    check_lr(plan, full, 3e-3, load_example("tiny_lm").warmup_cosine(2, plan.num_steps))
    data_tokens = tokens(data)
    vocab = max(int(t.max()) for t in data_tokens) + 1
    model = load_example("train_hf_trainer").tiny_llama(vocab, max(t for _, t in plan.shapes))
    assert_grads_close(torch.load(os.path.join(folder / "full", "grad0.pt")), reference_grads(model, plan, data_tokens))
    # a checkpoint strictly inside an epoch (Lightning's own file, saved after optimizer step k)
    start1 = plan.epoch_start(1)
    k = next(s for s in range(every, plan.num_steps, every)
             if s not in (start1, plan.num_steps) and s % plan.steps_per_epoch[0] != 0)
    torchrun("train_lightning.py", *common, "--resume", folder / "ck" / f"step={k}.ckpt", "--log-dir",
             folder / "resumed", "--tensorboard", folder / "tb2")
    resumed = logs(folder / "resumed")
    check_tracker_figures(plan_path, folder / "tb2", "", 0, range(k, plan.num_steps))
    for a, b in zip(full, resumed):
        assert b["steps"] == a["steps"][k:] and b["lr"] == a["lr"][k:]
        assert b["micro"] == a["micro"][k * plan.grad_accum:]  # positions, samples, losses: bit-identical


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
