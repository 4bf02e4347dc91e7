"""Train a tiny Llama (built from a config, no download) with Hugging Face's Trainer on a varlen plan.

    varlen analyze sample_data/tokenized.parquet -o /tmp/m --length list:input_ids
    varlen plan /tmp/m -o /tmp/plan.parquet --max-tokens 2048 --dp 2 --grad-accum 2 --epochs 2
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --plan /tmp/plan.parquet --out /tmp/hf
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --plan /tmp/plan.parquet --out /tmp/hf --resume

    varlen plan /tmp/m -o /tmp/packed.parquet --packing --seq-len 512 --rows-per-microbatch 2 --dp 2
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --plan /tmp/packed.parquet --out /tmp/hfp

The whole recipe is ``PlanTrainer(plan=..., model=..., args=TrainingArguments(...), train_dataset=...)``:
gradient accumulation and epochs come from the plan, the LR is Trainer's schedule x the plan's
lr_scale, the loss is normalised by the step's exact target count, checkpoints resume exactly.
``--log-dir`` writes rank-R.json (per microbatch: plan position, sample ids, loss; per step: LRs)
and, on rank 0, the gradient of the first step (the tests compare them with references).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import torch  # noqa: E402
from tiny_lm import TokenDataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments  # noqa: E402

from varlen_cli.errors.entry import exit_on_error  # noqa: E402
from varlen_cli.integrations.hf import PlanTrainer  # noqa: E402
from varlen_cli.runtime.dist import collective_timeout  # noqa: E402


def tiny_llama(vocab_size: int, max_len: int, seed: int = 0, hidden: int = 32, layers: int = 2,
               attn: str = "sdpa") -> LlamaForCausalLM:
    """A 2-layer Llama from a config (fp32, no dropout), the same weights for the same seed."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(max_len, 16), attn_implementation=attn, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class Recorder(TrainerCallback):
    """Per optimizer step: the LR in use, the base schedule's LR, the plan's scale; step 0's gradient."""

    def __init__(self, trainer, log: dict, grad_path: str | None):
        self.trainer, self.log, self.grad_path = trainer, log, grad_path

    def on_train_begin(self, args, state, control, **kwargs):
        engine = getattr(self.trainer, "deepspeed", None)
        if self.grad_path and engine is not None and state.global_step == 0:
            self.record_deepspeed_gradient(engine)

    def record_deepspeed_gradient(self, engine) -> None:
        """Under DeepSpeed the update happens inside ``accelerator.backward``, before the optimizer-step
        callbacks: record step 0's gradient between the engine's backward (which reduced it) and its
        step (which applies and clears it), with DeepSpeed's ``safe_get_full_grad`` (any ZeRO stage)."""
        from deepspeed.utils import safe_get_full_grad

        step = engine.step

        def step_after_recording(*a, **kw):
            if engine.global_steps == 0 and engine.is_gradient_accumulation_boundary():
                grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
                if self.trainer.args.process_index == 0:
                    torch.save({n: g.detach().clone() for n, g in grads.items() if g is not None}, self.grad_path)
            return step(*a, **kw)

        engine.step = step_after_recording

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        sched = self.trainer.lr_scheduler
        self.log["steps"].append(int(sched.global_step))  # the job's step (a replanned plan continues it)
        self.log["lr"].append(self.trainer.optimizer.param_groups[0]["lr"])
        self.log["unscaled_lr"].append(sched.get_unscaled_lr()[0])
        self.log["lr_scale"].append(sched.scale())
        if self.grad_path and state.global_step == 0 and args.process_index == 0 and not args.deepspeed:
            grads = {n: p.grad.detach().clone() for n, p in self.trainer.model.named_parameters() if p.grad is not None}
            torch.save(grads, self.grad_path)


class MicrobatchRecorder:
    """A Trainer mixin (before the Trainer class in the bases) that records what each microbatch was
    when ``record`` is a dict: its plan position, sample ids and loss (for the tests and the curious)."""

    record: dict | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.record is not None and inputs.get("plan_position") is not None:
            value = loss[0] if isinstance(loss, tuple) else loss
            self.record["micro"].append({"position": inputs["plan_position"].tolist(),
                                         "samples": inputs["sample_ids"][: inputs["num_samples"]].tolist(),
                                         "loss": float(value.detach())})
        return loss


class LoggingPlanTrainer(MicrobatchRecorder, PlanTrainer):
    """PlanTrainer that also records what each microbatch was (for the tests and the curious)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, help="plan file from `varlen plan`")
    p.add_argument("--data", default=os.path.join(ROOT, "sample_data", "tokenized.parquet"),
                   help="Parquet file with a list column of token ids (the dataset the plan was made for)")
    p.add_argument("--out", required=True, help="Trainer output_dir (checkpoints)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--scheduler", default="cosine", help="TrainingArguments.lr_scheduler_type")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after N steps (default: the whole plan)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    p.add_argument("--attention", default="hf", choices=["hf", "sdpa"], help="packed rows: how samples are kept apart")
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--log-dir", default=None, help="write rank-R.json and (rank 0) grad0.pt here")
    p.add_argument("--tensorboard", default=None,
                   help="report_to TensorBoard, event files here (the plan's varlen/* figures every step)")
    p.add_argument("--deepspeed", default=None, help="a DeepSpeed config (JSON file): Trainer runs the DeepSpeed "
                   "engine (no batch sizes or gradient accumulation in it: they come from the plan)")
    p.add_argument("--use-cpu", action=argparse.BooleanOptionalAction, default=True,
                   help="TrainingArguments(use_cpu=...); --no-use-cpu shows the plain setup on CPU, where "
                        "transformers runs no data parallelism under torchrun (PlanTrainer refuses it)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    dataset = TokenDataset(args.data)
    from varlen_cli.loader import Plan

    plan = Plan.open(args.plan)
    max_len = max(t for _, t in plan.shapes)
    model = tiny_llama(dataset.vocab_size, max_len, hidden=args.hidden, attn=args.attn_implementation)
    if args.tensorboard:  # where transformers' TensorBoardCallback writes
        os.environ["TENSORBOARD_LOGGING_DIR"] = args.tensorboard
    targs = TrainingArguments(
        output_dir=args.out, learning_rate=args.lr, lr_scheduler_type=args.scheduler, warmup_steps=args.warmup_steps,
        weight_decay=0.0, max_grad_norm=args.max_grad_norm, logging_steps=1,
        report_to=["tensorboard"] if args.tensorboard else [], use_cpu=args.use_cpu,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, max_steps=args.max_steps,
        dataloader_num_workers=args.num_workers, ddp_backend="gloo" if torch.distributed.is_available() else None,
        seed=0, disable_tqdm=True, save_only_model=False, deepspeed=args.deepspeed,
        ddp_timeout=int(collective_timeout()),  # a collective waits at most VARLEN_TIMEOUT s for a peer
    )
    trainer = LoggingPlanTrainer(plan=plan, model=model, args=targs, train_dataset=dataset, attention=args.attention)
    log = {"steps": [], "lr": [], "unscaled_lr": [], "lr_scale": [], "micro": []}
    grad_path = os.path.join(args.log_dir, "grad0.pt") if args.log_dir else None
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        trainer.record = log
    trainer.add_callback(Recorder(trainer, log, grad_path))
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    rank = targs.process_index
    speed = [h["tokens_per_second"] for h in trainer.state.log_history if "tokens_per_second" in h]
    if args.log_dir:
        log.update(world_size=targs.world_size, global_step=result.global_step,
                   tokens_per_second=speed[-1] if speed else None)
        with open(os.path.join(args.log_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(log, fh)
    if rank == 0:
        print(f"rank 0: {result.global_step} steps, train loss {result.training_loss:.4f}, "
              f"{speed[-1] if speed else 0:.0f} tokens/s", flush=True)
    accelerator = trainer.accelerator
    del trainer, model  # the trainer holds the wrapped (DDP) model, which holds the process group
    end_group(accelerator)


def end_group(accelerator) -> None:
    """End the process group here, the same way on every rank. The wrapped (DDP) model holds the
    group: ``destroy_process_group()`` alone only unregisters a gloo group while the model lives on (in
    the trainer's and accelerator's reference cycles), and the garbage collector then tears it down at
    any later point, while a peer may already have exited (a rank hung at exit, about 1 run in 40 under
    load). So: release what holds the group (the caller dropped its trainer and model), collect, meet,
    then end the group."""
    accelerator.free_memory()  # the accelerator's own references to the prepared model and optimizer
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy_process_group

if __name__ == "__main__":
    exit_on_error(main)  # a PlanError: its one line (also in torchrun's summary), not a traceback per rank
