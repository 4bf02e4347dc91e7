"""The DeepSpeed runs of tests/integrations/test_deepspeed.py, one after another in one 2-rank launch
(each rank imports DeepSpeed once, and the launcher's zygote already did): ``examples/train_deepspeed.py``'s
``train`` for ZeRO 0-3 (ZeRO-0 and ZeRO-2/3 also checkpoint mid-epoch), the ZeRO-2 and ZeRO-3 resumes
from DeepSpeed's own checkpoint in fresh engines, bf16 with an overflowing step (the engine, and Hugging
Face's Trainer through PlanTrainer), the 2-stage pipeline (and its resume), and the refusals, whose
one-line messages go to ``refusals.json``.

    python -m tests.launcher ... deepspeed_runs.py FOLDER DATA
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import train_deepspeed as example  # noqa: E402

from varlen_cli.errors import PlanError  # noqa: E402
from varlen_cli.integrations import deepspeed as varlen_ds  # noqa: E402

SAVE_AT = {0: 3, 2: 6, 3: 6, "pipe": 4}  # checkpoint after this global step (ZeRO-0: the elastic restart's parent)
OVERFLOW_STEP = 1
HF_LR = 3e-3


def train(folder: str, data: str, name: str, plan: str, *extra, hook=None) -> dict:
    argv = ["--plan", os.path.join(folder, plan), "--data", data, "--log-dir", os.path.join(folder, name), *extra]
    return example.train(example.parse_args(argv), loss_hook=hook)


def overflow(loss_sum, batch):
    """One step's gradient overflows (an inf loss on rank 0): bf16's overflow check skips that update."""
    if batch["info"].step == OVERFLOW_STEP and batch["info"].micro == 0 and dist.get_rank() == 0:
        return loss_sum * float("inf")
    return loss_sum


def runs(folder: str, data: str) -> None:
    for stage in (0, 1, 2, 3):
        save = ["--ckpt", os.path.join(folder, f"ckpt-z{stage}"), "--save-at", str(SAVE_AT[stage])] \
            if stage in SAVE_AT else []
        monitor = ["--tensorboard", os.path.join(folder, "tb-z2")] if stage == 2 else []  # engine.monitor
        train(folder, data, f"z{stage}", "padded.parquet", "--zero", str(stage), *save, *monitor)
    for stage in (2, 3):
        monitor = ["--tensorboard", os.path.join(folder, "tb-z2-resumed")] if stage == 2 else []
        train(folder, data, f"z{stage}-resumed", "padded.parquet", "--zero", str(stage), "--resume", "--ckpt",
              os.path.join(folder, f"ckpt-z{stage}"), *monitor)
    train(folder, data, "bf16", "padded.parquet", "--zero", "2", "--bf16", "--max-steps", "4", hook=overflow)


def hf_overflow(folder: str, data: str) -> None:
    """PlanTrainer with a bf16 ZeRO-2 DeepSpeed config, step 1 overflowing: Trainer does not step the scheduler
    after a skipped update; PlanTrainer's plan scheduler steps anyway (rank-R.json: the LR of each step)."""
    import train_hf_trainer as hf_example
    from transformers import TrainerCallback, TrainingArguments

    class OverflowingTrainer(hf_example.LoggingPlanTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return overflow(loss, inputs)

    config = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    args = TrainingArguments(output_dir=os.path.join(folder, "hf-bf16-out"), learning_rate=HF_LR,
                             lr_scheduler_type="constant", bf16=True, use_cpu=True, deepspeed=config, max_steps=4,
                             report_to=[], save_strategy="no", disable_tqdm=True, max_grad_norm=0.0)
    dataset = example.TokenDataset(data)
    trainer = OverflowingTrainer(plan=os.path.join(folder, "padded.parquet"), model=example.tiny_llama(
        dataset.vocab_size, 512), args=args, train_dataset=dataset)
    log = {"steps": [], "lr": [], "unscaled_lr": [], "lr_scale": [], "micro": [], "skipped": []}
    trainer.add_callback(hf_example.Recorder(trainer, log, None))

    class Skips(TrainerCallback):
        def __init__(self, accelerator):
            self.accelerator = accelerator

        def on_step_end(self, args, state, control, **kwargs):
            log["skipped"].append(bool(self.accelerator.optimizer_step_was_skipped))

    trainer.add_callback(Skips(trainer.accelerator))
    trainer.train()
    os.makedirs(os.path.join(folder, "hf-bf16"), exist_ok=True)
    with open(os.path.join(folder, "hf-bf16", f"rank-{dist.get_rank()}.json"), "w") as fh:
        json.dump(log, fh)
    del trainer


def pipe_runs(folder: str, data: str) -> None:
    """After the other engines: DeepSpeed keeps a pipeline's topology for the engines made after it."""
    pipe = ["--pipe", "--zero", "0", "--ckpt", os.path.join(folder, "ckpt-pipe")]
    train(folder, data, "pipe", "pipe.parquet", *pipe, "--save-at", str(SAVE_AT["pipe"]))
    train(folder, data, "pipe-resumed", "pipe.parquet", *pipe, "--resume")


def refused(action) -> str | None:
    try:
        action()
    except PlanError as exc:
        return str(exc)
    return None


def refusals(folder: str, data: str) -> dict:
    """Each refusal's message (None where nothing was refused)."""
    dataset = example.TokenDataset(data)
    padded, rank = os.path.join(folder, "padded.parquet"), dist.get_rank()
    config = example.ds_config(example.parse_args(["--plan", padded, "--zero", "2"]))

    def model():
        return example.tiny_llama(dataset.vocab_size, 64)

    def build(plan, **kwargs):
        net = model()
        return varlen_ds.initialize(plan, dataset, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                    config=kwargs.pop("config", config), **kwargs)

    def plain_engine_with_training_data():
        net = model()
        engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                          config={**config, "train_micro_batch_size_per_gpu": 1}, training_data=dataset)
        varlen_ds.backward(engine, torch.zeros(()), {})

    def pipe_with_other_shapes():
        layers = example.pipe_layers(dataset.vocab_size, 512)
        module = example.PipelineModule(layers=layers, num_stages=2, loss_fn=varlen_ds.pipe_loss)
        varlen_ds.initialize(os.path.join(folder, "pipebad.parquet"), dataset, model=module,
                             config={**config, "zero_optimization": {"stage": 0}})

    found = {
        "training_data": refused(lambda: build(padded, training_data=dataset)),
        "engine_with_training_data": refused(plain_engine_with_training_data),
        "grad_accum": refused(lambda: build(padded, config={**config, "gradient_accumulation_steps": 3})),
        "implied_grad_accum": refused(lambda: build(padded, config={**config, "train_batch_size": 64,
                                                                    "train_micro_batch_size_per_gpu": 4})),
        "other_plan": refused(lambda: build(os.path.join(folder, "padded.parquet" if rank == 0 else "other.parquet"))),
        "no_checkpoint": refused(lambda: varlen_ds.load_checkpoint(*_engine_and_loader(build(padded)),
                                                                   os.path.join(folder, "empty"))),
    }
    pipe_runs(folder, data)
    found["pipe_shapes"] = refused(pipe_with_other_shapes)
    return found


def _engine_and_loader(built) -> tuple:
    return built[0], built[2]


def main() -> None:
    folder, data = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    runs(folder, data)
    hf_overflow(folder, data)
    found = refusals(folder, data)  # and the pipeline runs
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "refusals.json"), "w") as fh:
            json.dump(found, fh)
    example.end_group()


if __name__ == "__main__":
    main()
