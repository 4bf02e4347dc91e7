"""Issue 21's five "Done when" resume scenarios, through the documented loops, on sample_data/.

    python benchmarks/resume_scenarios.py [--work /tmp/resume-scenarios] [--rows 2000]

Analyses and plans ``sample_data/tokenized.parquet`` (1 rank, grad-accum 2, 2 epochs, the planner's
linear lr_scale), then runs each scenario with a tiny model, AdamW and ``VariableBatchSizeLR``:

1. torchdata (``stateful=True``) resumed mid-epoch 1 from its own state;
2. an epoch loop without ``set_epoch``;
3. half an epoch, then the next epoch;
4. one more pass after the plan's end;
5. Lightning ``PlanDataModule`` without its callback, resumed from Lightning's own checkpoint.

Each must train exactly the plan's remaining microbatches, or stop with a ``PlanError`` before an
optimizer step applies other microbatches than the plan's next step. Prints one line per scenario
and exits 1 if any trained wrong data. Before issue 21, 3 of the 5 trained wrong data with exit 0.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from varlen_cli.errors import PlanError  # noqa: E402
from varlen_cli.loader import Plan, VariableBatchSizeLR, dataloader_for_plan  # noqa: E402

VOCAB = 2000  # sample_data/tokenizer.json


class Run:
    """A model, its optimizer and the plan's LR, recording what each optimizer step trained."""

    def __init__(self, plan: Plan, done: int = 0):
        torch.manual_seed(0)
        self.plan = plan
        self.model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scheduler = VariableBatchSizeLR(torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0), plan)
        self.done, self.micros, self.wrong, self.trained = done, [], 0, []

    def micro(self, batch) -> bool:
        """One microbatch of the documented loop; True when it completed an optimizer step."""
        pos = tuple(batch["plan_position"].tolist())
        self.micros.append(pos)
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        (loss / batch["step_loss_tokens"]).backward()
        if batch["info"].micro < self.plan.grad_accum - 1:
            return False
        s = self.done
        want = [(self.plan.epoch_of(s), s, 0, m) for m in range(self.plan.grad_accum)] \
            if s < self.plan.num_steps else None
        self.wrong += self.micros != want  # an update of other microbatches than the plan's next step
        self.trained += self.micros
        self.micros = []
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.done += 1
        return True


def positions(plan: Plan, first_step: int = 0) -> list:
    return [(plan.epoch_of(s), s, 0, m) for s in range(first_step, plan.num_steps) for m in range(plan.grad_accum)]


def documented_loop(run: Run, loader, stop_after: int | None = None, set_epoch: bool = True,
                    break_half: bool = False) -> None:
    plan = run.plan
    for epoch in range(loader.epoch, plan.epochs):
        if set_epoch:
            loader.set_epoch(epoch)
        for batch in loader:
            stepped = run.micro(batch)
            if stepped and stop_after is not None and run.done == stop_after:
                return
            if stepped and break_half and epoch == 0 and run.done == plan.steps_per_epoch[0] // 2:
                break


def outcome(run: Run, want: list, error: PlanError | None) -> tuple[bool, str]:
    if run.wrong:
        return False, f"WRONG: {run.wrong} optimizer step(s) trained other microbatches than the plan's"
    if error is not None:
        return True, f"stopped with PlanError before a wrong step ({len(run.trained)} microbatches trained): {error}"
    if run.trained != want:
        return False, f"WRONG: trained {len(run.trained)} microbatches, the plan's remaining are {len(want)}"
    return True, f"trained exactly the {len(want)} remaining microbatches"


def scenario_torchdata(plan: Plan, data) -> tuple[bool, str]:
    cut = plan.epoch_start(1) + plan.steps_per_epoch[1] // 2
    first = Run(plan)
    loader = dataloader_for_plan(data, plan, stateful=True)
    documented_loop(first, loader, stop_after=cut)
    state, lr_state = copy.deepcopy(loader.state_dict()), first.scheduler.state_dict()
    run = Run(plan, done=cut)  # a new process: model and optimizer restored are not this check's subject
    loader = dataloader_for_plan(data, plan, stateful=True)
    loader.load_state_dict(state)
    run.scheduler.load_state_dict(lr_state)
    return _guarded(run, lambda: documented_loop(run, loader), positions(plan, cut))


def scenario_no_set_epoch(plan: Plan, data) -> tuple[bool, str]:
    run = Run(plan)
    loader = dataloader_for_plan(data, plan)
    return _guarded(run, lambda: documented_loop(run, loader, set_epoch=False), positions(plan))


def scenario_half_epoch(plan: Plan, data) -> tuple[bool, str]:
    run = Run(plan)
    loader = dataloader_for_plan(data, plan)
    return _guarded(run, lambda: documented_loop(run, loader, break_half=True), positions(plan))


def scenario_past_end(plan: Plan, data) -> tuple[bool, str]:
    run = Run(plan)
    loader = dataloader_for_plan(data, plan)

    def go():
        documented_loop(run, loader)
        for batch in loader:  # one more pass
            run.micro(batch)
    return _guarded(run, go, positions(plan))


def scenario_lightning(plan: Plan, data, work: str) -> tuple[bool, str]:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from varlen_cli.integrations.lightning import PlanDataModule, plan_loss, plan_lr_scheduler

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
            self.positions = []

        def training_step(self, batch, batch_idx):
            self.positions.append(tuple(batch["plan_position"].tolist()))
            logits = self.net(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            return plan_loss(loss, batch, self.trainer)

        def configure_optimizers(self):
            return plan_lr_scheduler(torch.optim.AdamW(self.parameters(), lr=1e-3), plan)

    def trainer(callbacks=()):
        return L.Trainer(accelerator="cpu", devices=1, max_epochs=plan.epochs, accumulate_grad_batches=plan.grad_accum,
                         use_distributed_sampler=False, reload_dataloaders_every_n_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         enable_checkpointing=bool(callbacks), callbacks=list(callbacks))

    k = plan.epoch_start(1) + plan.steps_per_epoch[1] // 2
    folder = os.path.join(work, "lightning")
    save = ModelCheckpoint(dirpath=folder, every_n_train_steps=k, save_top_k=-1, filename="{step}")
    trainer(callbacks=[save]).fit(Module(), datamodule=PlanDataModule(data, plan))  # no dm.callback()
    resumed = Module()
    run = Run(plan, done=k)
    try:
        trainer().fit(resumed, datamodule=PlanDataModule(data, plan), ckpt_path=os.path.join(folder, f"step={k}.ckpt"))
    except PlanError as exc:
        return True, f"stopped with PlanError: {exc}"
    want = positions(plan, k)
    if resumed.positions != want:
        return False, f"WRONG: trained {len(resumed.positions)} microbatches, the plan's remaining are {len(want)}"
    run.trained = resumed.positions
    return True, f"trained exactly the {len(want)} remaining microbatches"


def _guarded(run: Run, go, want: list) -> tuple[bool, str]:
    try:
        go()
    except PlanError as exc:
        return outcome(run, want, exc)
    return outcome(run, want, None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    p.add_argument("--rows", type=int, default=2000, help="rows of sample_data/tokenized.parquet to use")
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="resume-scenarios-")
    os.makedirs(work, exist_ok=True)
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.plan import PlanConfig
    from varlen_cli.plan import plan as make_plan

    data_path = os.path.join(work, "data.parquet")
    pq.write_table(pq.read_table(os.path.join(ROOT, "sample_data", "tokenized.parquet")).slice(0, args.rows), data_path)
    metrics, plan_path = os.path.join(work, "metrics"), os.path.join(work, "plan.parquet")
    analyze(AnalyzeConfig(sources=(data_path,), output=metrics, length="list:input_ids", progress=False,
                          overwrite=True))
    make_plan(PlanConfig(input=metrics, output=plan_path, max_tokens=2048, dp=1, grad_accum=2, epochs=2,
                         overwrite=True))
    plan = Plan.open(plan_path)
    data = pq.read_table(data_path, columns=["input_ids"]).column("input_ids").to_pylist()
    print(f"plan: {plan.num_steps} steps ({list(plan.steps_per_epoch)} per epoch), grad-accum {plan.grad_accum}, "
          f"lr_scale {plan.lr_scales().min():.3g}..{plan.lr_scales().max():.3g}; {args.rows} samples")
    scenarios = [("1 torchdata resumed mid-epoch 1", lambda: scenario_torchdata(plan, data)),
                 ("2 epoch loop without set_epoch", lambda: scenario_no_set_epoch(plan, data)),
                 ("3 half an epoch, then the next", lambda: scenario_half_epoch(plan, data)),
                 ("4 a pass past the end", lambda: scenario_past_end(plan, data)),
                 ("5 Lightning PlanDataModule, no callback, resumed", lambda: scenario_lightning(plan, data, work))]
    ok_all = True
    for name, run in scenarios:
        ok, text = run()
        ok_all &= ok
        print(f"{'ok ' if ok else 'BAD'} {name}: {text}", flush=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
