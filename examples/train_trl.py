"""Train a tiny Llama (from a config) with TRL's ``SFTTrainer`` on a varlen plan, through ``PlanTrainerMixin``.

    varlen analyze sample_data/tokenized.parquet -o /tmp/m --length list:input_ids
    varlen plan /tmp/m -o /tmp/plan.parquet --max-tokens 2048 --dp 2 --grad-accum 2 --epochs 2
    torchrun --nproc-per-node 2 examples/train_trl.py --plan /tmp/plan.parquet --out /tmp/trl --save-steps 4
    torchrun --nproc-per-node 2 examples/train_trl.py --plan /tmp/plan.parquet --out /tmp/trl --resume

The recipe: ``class PlanSFTTrainer(PlanTrainerMixin, SFTTrainer)``, an already tokenised
``datasets.Dataset`` whose row i is the plan's sample i, and ``SFTConfig(dataset_kwargs={"skip_prepare_dataset":
True})`` so that TRL keeps the rows as they are (its preparation may filter, truncate or reorder
them, and the plan indexes them). The plan's loader, LR scale, loss normalisation and resume are
the mixin's, as for ``PlanTrainer``; TRL's fused LM head scores the exact ``shift_labels``.
``--log-dir`` writes rank-R.json (per microbatch: plan position, sample ids, loss; per step: LRs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import datasets  # noqa: E402
from train_hf_trainer import MicrobatchRecorder, Recorder, end_group, tiny_llama  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from varlen_cli.errors.entry import exit_on_error  # noqa: E402
from varlen_cli.integrations.hf import PlanTrainerMixin  # noqa: E402
from varlen_cli.loader import Plan  # noqa: E402
from varlen_cli.runtime.dist import collective_timeout  # noqa: E402


class PlanSFTTrainer(MicrobatchRecorder, PlanTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer on a varlen plan (recording each microbatch when ``record`` is a dict)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, help="plan file from `varlen plan`")
    p.add_argument("--data", default=os.path.join(ROOT, "sample_data", "tokenized.parquet"),
                   help="Parquet file with an input_ids list column (the dataset the plan was made for)")
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "sample_data", "tokenizer.json"),
                   help="tokenizer.json of the data (TRL needs its special tokens)")
    p.add_argument("--out", required=True, help="SFTConfig output_dir (checkpoints)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--scheduler", default="cosine", help="SFTConfig.lr_scheduler_type")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after N steps (default: the whole plan)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    p.add_argument("--log-dir", default=None, help="write rank-R.json and (rank 0) grad0.pt here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    plan = Plan.open(args.plan)
    dataset = datasets.Dataset.from_parquet(args.data, keep_in_memory=True)  # row i = sample i
    vocab = max(max(ids) for ids in dataset["input_ids"]) + 1
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer, pad_token="[PAD]", eos_token="[EOS]",
                                        bos_token="[BOS]", unk_token="[UNK]")
    model = tiny_llama(vocab, max(t for _, t in plan.shapes))
    config = SFTConfig(
        output_dir=args.out, learning_rate=args.lr, lr_scheduler_type=args.scheduler, warmup_steps=args.warmup_steps,
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        bf16=False,  # TRL's default is bf16 mixed precision; fp32 here so the tests compare gradients exactly
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, max_steps=args.max_steps,
        save_only_model=False, ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        max_length=None, dataset_kwargs={"skip_prepare_dataset": True},
        ddp_timeout=int(collective_timeout()),  # a collective waits at most VARLEN_TIMEOUT s for a peer
    )
    trainer = PlanSFTTrainer(plan=plan, model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    log = {"steps": [], "lr": [], "unscaled_lr": [], "lr_scale": [], "micro": []}
    grad_path = os.path.join(args.log_dir, "grad0.pt") if args.log_dir else None
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        trainer.record = log
    trainer.add_callback(Recorder(trainer, log, grad_path))
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    rank = trainer.args.process_index
    if args.log_dir:
        with open(os.path.join(args.log_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(log, fh)
    if rank == 0:
        print(f"rank 0: {result.global_step} steps, train loss {result.training_loss:.4f}", flush=True)
    accelerator = trainer.accelerator
    del trainer, model  # the trainer holds the wrapped (DDP) model, which holds the process group
    end_group(accelerator)  # release, meet, end the group: the same on every rank (train_hf_trainer.py)


if __name__ == "__main__":
    exit_on_error(main)  # a PlanError: its one line (also in torchrun's summary), not a traceback per rank
