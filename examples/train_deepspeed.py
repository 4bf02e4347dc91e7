"""Train a tiny Llama (from a config) with the DeepSpeed engine on a varlen plan: ZeRO 0-3, or a 2-stage pipeline.

    varlen plan /tmp/m -o /tmp/plan.parquet --max-tokens 2048 --dp 2 --grad-accum 2 --epochs 2
    torchrun --nproc-per-node 2 examples/train_deepspeed.py --plan /tmp/plan.parquet --zero 2 --ckpt /tmp/ds --save-at 3
    torchrun --nproc-per-node 2 examples/train_deepspeed.py --plan /tmp/plan.parquet --zero 2 --ckpt /tmp/ds --resume

    varlen plan /tmp/m -o /tmp/pipe.parquet --max-tokens 2048 --grad-accum 4 --same-shape-per-step
    torchrun --nproc-per-node 2 examples/train_deepspeed.py --plan /tmp/pipe.parquet --pipe

The recipe (varlen_cli.integrations.deepspeed): ``initialize(plan, dataset, model=..., config=...)``
instead of ``deepspeed.initialize`` (gradient accumulation from the plan, the plan's loader for this
data-parallel rank, the LR scheduler wrapped in the plan's ``VariableBatchSizeLR``),
``backward(engine, loss_sum, batch)`` then ``engine.step()`` for every microbatch (the exact mean
over the step's targets), ``save_checkpoint``/``load_checkpoint`` (DeepSpeed's own checkpoints,
with the plan position inside). With ``--pipe`` the model is a ``PipelineModule`` of 2 stages fed
by ``engine.train_batch(data_iter=iter(loader))``. ``--log-dir`` writes rank-R.json (per microbatch:
plan position, sample ids, loss; per step: LRs) and, on rank 0, the first step's gradient.
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

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from tiny_lm import TokenDataset, warmup_cosine  # noqa: E402
from train_hf_trainer import tiny_llama  # noqa: E402

from varlen_cli.errors.entry import exit_on_error  # noqa: E402
from varlen_cli.integrations import deepspeed as varlen_ds  # noqa: E402
from varlen_cli.loader import Plan, to_model_inputs  # noqa: E402
from varlen_cli.loader.replan import first_step  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--data", default=os.path.join(ROOT, "sample_data", "tokenized.parquet"))
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage (default 2; with --pipe 0: the pipeline engine runs ZeRO 0 or 1)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (DeepSpeed's bf16 optimizer)")
    p.add_argument("--pipe", action="store_true", help="a 2-stage PipelineModule (ZeRO 0 or 1)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--total-steps", type=int, default=None, help="the LR schedule's length (default: the job's)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this global step count")
    p.add_argument("--ckpt", default=None, help="DeepSpeed checkpoint folder")
    p.add_argument("--save-at", type=int, default=None, help="checkpoint after this global step")
    p.add_argument("--resume", action="store_true", help="load the checkpoint in --ckpt first")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--tensorboard", default=None, help="DeepSpeed's TensorBoard monitor writes here (the plan's "
                   "varlen/* figures of every step among them)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    train(args)
    end_group()


def ds_config(args) -> dict:
    """The DeepSpeed config: no batch sizes or gradient accumulation (they come from the plan)."""
    stage = args.zero if args.zero is not None else 0 if args.pipe else 2
    config = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.tensorboard:
        config["tensorboard"] = {"enabled": True, "output_path": args.tensorboard, "job_name": "varlen"}
    return config


def train(args, loss_hook=None) -> dict:
    """Train (or resume) on the plan; returns the log. ``loss_hook(loss_sum, batch)`` may change the
    summed loss of a microbatch before its backward (the tests make one overflow)."""
    plan = Plan.open(args.plan)
    dataset = TokenDataset(args.data)
    max_len = max(t for _, t in plan.shapes)
    total = args.total_steps or first_step(plan) + plan.num_steps
    if args.pipe:
        model = PipelineModule(layers=pipe_layers(dataset.vocab_size, max_len), num_stages=2,
                               loss_fn=varlen_ds.pipe_loss, partition_method="uniform")
    else:
        model = tiny_llama(dataset.vocab_size, max_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    base = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup_steps, total))
    engine, _, loader, scheduler = varlen_ds.initialize(plan, dataset, model=model, config=ds_config(args),
                                                        optimizer=optimizer, lr_scheduler=base)
    if args.resume:
        varlen_ds.load_checkpoint(engine, loader, args.ckpt)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    log = {"steps": [], "lr": [], "unscaled_lr": [], "lr_scale": [], "micro": [], "loss": [], "applied": []}
    loop = pipe_steps if args.pipe else engine_steps
    loop(engine, loader, scheduler, plan, args, log, loss_hook)
    if args.log_dir:
        with open(os.path.join(args.log_dir, f"rank-{dist.get_rank()}.json"), "w") as fh:
            json.dump(log, fh)
    if dist.get_rank() == 0:
        print(f"rank 0: trained to step {scheduler.global_step}", flush=True)
    return log


def engine_steps(engine, loader, scheduler, plan, args, log, loss_hook) -> None:
    """The usual DeepSpeed loop: forward, ``varlen_ds.backward``, ``engine.step()`` per microbatch."""
    for epoch in range(loader.epoch, plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            logits = engine(**to_model_inputs(batch, labels=False)).logits
            loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
            if loss_hook is not None:
                loss_sum = loss_hook(loss_sum, batch)
            varlen_ds.backward(engine, loss_sum, batch)
            log["micro"].append({"position": batch["plan_position"].tolist(),
                                 "samples": batch["sample_ids"][: batch["num_samples"]].tolist(),
                                 "loss": float(loss_sum.detach()) / batch["step_loss_tokens"]})
            last = batch["info"].micro == plan.grad_accum - 1
            if last:
                record_step(engine, scheduler, args, log)
            engine.step()
            if last:
                log["applied"].append(engine.was_step_applied())
                if after_step(engine, loader, scheduler, args):
                    return


def pipe_steps(engine, loader, scheduler, plan, args, log, loss_hook) -> None:
    """A ``PipelineModule``: ``engine.train_batch`` pulls grad_accum ``(inputs, labels)`` per step."""
    for epoch in range(loader.epoch, plan.epochs):
        loader.set_epoch(epoch)
        batches = recorded(iter(loader), log)
        for _ in range(len(loader.batch_sampler) // plan.grad_accum):
            record_step(engine, scheduler, args, log)
            log["loss"].append(float(engine.train_batch(data_iter=batches)))
            log["applied"].append(engine.was_step_applied())
            if after_step(engine, loader, scheduler, args):
                return


def recorded(batches, log):
    """The pipeline's ``(inputs, labels)`` items, each one's plan position and samples logged (first stage)."""
    for batch in batches:
        info = batch.info
        log["micro"].append({"position": [info.epoch, info.step, info.rank, info.micro],
                             "samples": info.sample_ids.tolist()})
        yield batch


def record_step(engine, scheduler, args, log) -> None:
    """The LR this step's update uses (and, at step 0, its gradient, on rank 0)."""
    log["steps"].append(scheduler.global_step)
    log["lr"].append(engine.get_lr()[0])
    log["unscaled_lr"].append(scheduler.get_unscaled_lr()[0])
    log["lr_scale"].append(scheduler.scale())
    if scheduler.global_step == 0 and args.log_dir and not args.pipe:
        grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}  # all ranks (ZeRO-3 gathers)
        if dist.get_rank() == 0:
            torch.save({n: g.detach().clone().float() for n, g in grads.items() if g is not None},
                       os.path.join(args.log_dir, "grad0.pt"))


def after_step(engine, loader, scheduler, args) -> bool:
    """Checkpoint after step ``--save-at``; True to stop (``--max-steps`` reached)."""
    done = engine.global_steps  # the job's steps (also past a skipped update)
    if args.save_at is not None and done == args.save_at + 1:
        varlen_ds.save_checkpoint(engine, loader, args.ckpt)
    return args.max_steps is not None and done >= args.max_steps


# -- the pipeline model: embeddings, causal blocks, head (right padding never reaches a real token) ----
class Embed(nn.Module):
    def __init__(self, vocab: int, max_len: int, d: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))[None]


class CausalBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def pipe_layers(vocab: int, max_len: int, d: int = 32, blocks: int = 2, seed: int = 0) -> list:
    """The layers (the same weights for the same seed on every rank): embeddings, blocks, head."""
    torch.manual_seed(seed)
    return [Embed(vocab, max_len, d), *(CausalBlock(d, 4) for _ in range(blocks)), Head(d, vocab)]


def end_group() -> None:
    """End the process group the same way on every rank, once nothing holds the engine (``train``
    returned): collect, meet, destroy."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_error(main)  # a PlanError: its one line (also in torchrun's summary), not a traceback per rank
