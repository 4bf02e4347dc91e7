"""Issue 21's framework cases, each of which trained the wrong data with exit 0 (a 1-rank plan in
process, grad-accum 2, 2 epochs; the 2-process case under torchrun, gloo):

2. Lightning ``PlanDataModule`` without its callback, resumed from Lightning's own checkpoint;
3. Lightning with the plain plan loader (``use_distributed_sampler=False``), resumed;
5. ``PlanTrainer`` under ``torchrun --nproc-per-node 2`` whose ``TrainingArguments`` see world size 1;
6. a plain ``transformers.Trainer`` whose ``get_train_dataloader`` returns ``dataloader_for_plan``.

Now each trains exactly the plan's remaining microbatches or stops with a one-line PlanError before
a wrong optimizer step.
"""

import re

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from tests.integration_helpers import make_plan, small_dataset, tokens, torchrun  # noqa: E402
from varlen_cli.errors import PlanError  # noqa: E402
from varlen_cli.integrations.lightning import PlanDataModule, plan_loss, plan_lr_scheduler  # noqa: E402
from varlen_cli.loader import Plan, VariableBatchSizeLR, dataloader_for_plan  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cases")
    data = str(folder / "rows.parquet")
    pq.write_table(pq.read_table(small_dataset(folder)).slice(0, 160), data)
    plan = make_plan(folder, data, "one", max_tokens=512, dp=1, grad_accum=2, epochs=2)
    return folder, data, tokens(data), Plan.open(plan)


class Recorder(L.LightningModule):
    """A tiny next-token model that records the plan position of every microbatch it trains."""

    def __init__(self, plan: Plan, dataset=None):
        super().__init__()
        self.plan, self.dataset = plan, dataset
        self.embed, self.head = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)  # token ids mod 64: cheap
        self.positions: list = []

    def training_step(self, batch, batch_idx):
        self.positions.append(tuple(batch["plan_position"].tolist()))
        logits = self.head(self.embed(batch["input_ids"] % 64))
        labels = torch.where(batch["labels"] >= 0, batch["labels"] % 64, batch["labels"])
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return plan_loss(loss_sum, batch, self.trainer)

    def configure_optimizers(self):
        return plan_lr_scheduler(torch.optim.SGD(self.parameters(), lr=0.01), self.plan)


class PlainLoaderRecorder(Recorder):
    """Case 3: the module returns the plain plan loader (what Lightning's own error message suggests)."""

    def train_dataloader(self):
        return dataloader_for_plan(self.dataset, self.plan)


def _trainer(folder=None, **kwargs):
    callbacks = [ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1, save_top_k=-1, filename="{step}")] \
        if folder else []
    kwargs.setdefault("reload_dataloaders_every_n_epochs", 1)
    return L.Trainer(accelerator="cpu", devices=1, use_distributed_sampler=False, accumulate_grad_batches=2,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=bool(folder), num_sanity_val_steps=0, callbacks=callbacks, **kwargs)


def _all(plan: Plan):
    return [(plan.epoch_of(s), s, 0, m) for s in range(plan.num_steps) for m in range(plan.grad_accum)]


def test_case2_datamodule_without_its_callback_resumes_exactly(setup):
    """It resumed a step-31-of-42 checkpoint by training steps 21-31 again and never 32-41."""
    folder, _, data, plan = setup
    module = Recorder(plan)
    _trainer(folder / "dm", max_epochs=plan.epochs).fit(module, datamodule=PlanDataModule(data, plan))
    assert module.positions == _all(plan)
    for k in (plan.epoch_start(1) + plan.steps_per_epoch[1] // 2, 3):  # inside epoch 1, inside epoch 0
        resumed = Recorder(plan)
        _trainer(max_epochs=plan.epochs).fit(resumed, datamodule=PlanDataModule(data, plan),
                                             ckpt_path=str(folder / "dm" / f"step={k}.ckpt"))
        assert resumed.positions == _all(plan)[k * plan.grad_accum:], k


@pytest.mark.parametrize("reload", [0, 1])
def test_case3_the_plain_loader_under_lightning_resumes_exactly(setup, reload):
    """A fresh run was right; a resume from step 10 ended at step 14 of 24: Lightning fixes an epoch's
    length from len(loader) after loading its state, and the loader's length was the rest of the epoch,
    so every later epoch was cut to that. Now len() is the epoch's; a loader made per epoch
    (reload_dataloaders_every_n_epochs=1) continues the previous one's ledger."""
    folder, _, data, plan = setup
    module = PlainLoaderRecorder(plan, data)
    _trainer(folder / f"plain{reload}", max_epochs=plan.epochs, reload_dataloaders_every_n_epochs=reload).fit(module)
    assert module.positions == _all(plan)
    for k in (plan.steps_per_epoch[0] // 2, plan.epoch_start(1) + 1):
        resumed = PlainLoaderRecorder(plan, data)
        _trainer(max_epochs=plan.epochs, reload_dataloaders_every_n_epochs=reload).fit(
            resumed, ckpt_path=str(folder / f"plain{reload}" / f"step={k}.ckpt"))
        assert resumed.positions == _all(plan)[k * plan.grad_accum:], k


def test_case3_a_loader_state_saved_mid_step_is_refused_before_training(setup):
    """A framework that reads ahead saves the loader's state a microbatch early; the scheduler's state
    says the step was not applied: refused at the first microbatch, nothing trained."""
    _, _, data, plan = setup
    loader = dataloader_for_plan(data, plan)
    sched = VariableBatchSizeLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), plan)
    batches = iter(loader)
    for _ in range(2 * plan.grad_accum):
        next(batches)
        if _ % plan.grad_accum == plan.grad_accum - 1:
            sched.step()
    next(batches)  # read ahead: micro 0 of step 2 handed out, not trained
    state, lr_state = loader.state_dict(), sched.state_dict()
    resumed = dataloader_for_plan(data, plan)
    sched = VariableBatchSizeLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), plan)
    resumed.load_state_dict(state)
    sched.load_state_dict(lr_state)
    with pytest.raises(PlanError, match=r"^desync: the microbatch at \(epoch 0, step 2, rank 0, micro 1\) is the "
                                        r"first of optimizer step 2 this job trains, but micros 0\.\.0 of that step "
                                        r"were consumed before its checkpoint and their gradient is lost: the loader's "
                                        r"state was saved in the middle of a step \(a framework that reads ahead, such "
                                        r"as Lightning, saves it early: use PlanDataModule"):
        next(iter(resumed))


def test_case6_a_plain_transformers_trainer_is_stopped_and_pointed_to_plan_trainer(setup, tmp_path):
    """It applied no lr_scale (LR off by up to 2.88x) and shifted the labels twice."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tests.integration_helpers import load_example

    _, _, data, plan = setup

    class PlainTrainer(Trainer):
        def get_train_dataloader(self):
            return dataloader_for_plan(self.train_dataset, plan)

    steps = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    args = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], disable_tqdm=True,
                             gradient_accumulation_steps=plan.grad_accum, save_strategy="no", learning_rate=1e-3)
    trainer = PlainTrainer(model=load_example("train_hf_trainer").tiny_llama(4096, 512), args=args,
                           train_dataset=data, callbacks=[Record()])
    scales = plan.lr_scales()
    with pytest.raises(PlanError, match=rf"^the plan's lr_scale \({scales.min():.3g} to {scales.max():.3g}\) is not "
                                        r"applied: an optimizer step is about to run after \(epoch 0, step 0, rank 0, "
                                        r"micro 1\) on rank 0 with no VariableBatchSizeLR "
                                        r".* Under transformers\.Trainer use varlen_cli\.integrations\.hf\.PlanTrainer "
                                        r"\(it also fixes the label shift and the loss normalisation\)\.$"):
        trainer.train()
    assert steps == []  # refused before the first optimizer step (issue 37: it was after two steps)


@pytest.mark.slow
def test_case5_plan_trainer_refuses_a_world_size_transformers_does_not_see(setup):
    """Under torchrun on CPU without use_cpu=True, transformers runs no DDP (world size 1, or 2 with
    ddp_backend="gloo" but parallel mode not_parallel): two independent models trained and wrote
    checkpoints into one directory (only a transformers warning)."""
    folder, data_path, _, _ = setup
    plan = make_plan(folder, data_path, "two", max_tokens=512, dp=2, grad_accum=2, epochs=2)
    proc = torchrun("train_hf_trainer.py", "--plan", plan, "--data", data_path, "--out", folder / "ws",
                    "--no-use-cpu", expect_ok=False, timeout=300)
    assert proc.returncode != 0
    lines = re.findall(r"^varlen: error: \[rank [01]\] (.*)$", proc.stderr, re.M)  # one line per rank, no traceback
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    want = (r"TrainingArguments see world size 2 \(process [01], parallel mode not_parallel\) but the launcher "
            r"started 2 processes \(this is rank [01]\): transformers is not running data-parallel here, so each "
            r"process would train its own model \(on CPU pass TrainingArguments\(use_cpu=True\)\)")
    assert len({line for line in lines if re.fullmatch(want, line)}) == 2, lines  # both ranks, one line each
