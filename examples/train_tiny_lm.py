"""Train a tiny GPT on a varlen plan under DDP: the plan's sampler, LR scale and padded shapes.

Make a plan, then train (one process, torchrun, or local workers with --nproc):

    varlen analyze sample_data/tokenized.parquet -o /tmp/m --length list:input_ids
    varlen plan /tmp/m -o /tmp/plan.parquet --max-tokens 2048 --dp 2 --grad-accum 2
    python examples/train_tiny_lm.py --plan /tmp/plan.parquet --nproc 2
    torchrun --nproc-per-node 2 examples/train_tiny_lm.py --plan /tmp/plan.parquet

A packed plan (`varlen plan --packing --seq-len 512`) trains on rows of concatenated samples
with a block-diagonal causal mask (one static shape, no padding between samples).

With torch.compile on a static-shapes plan (every shape compiled during the warm-up steps):

    varlen plan /tmp/m -o /tmp/static.parquet --max-tokens 2048 --static-shapes --num-shapes 3 --compile-warmup
    python examples/train_tiny_lm.py --plan /tmp/static.parquet --compile

Loss normalisation: every microbatch's summed token loss is divided by the step's target count
(from the plan, known before the step runs) and multiplied by the world size (DDP averages
gradients over ranks), so the accumulated gradient is exactly that of the mean token loss of
the whole step, whatever the split of tokens across ranks and microbatches.

--log-dir writes rank-R.json per rank (steps, sample ids, LRs, losses, compile counts) and
--save-state/--save-at/--resume checkpoint and resume mid-epoch (model, optimizer, LR, sampler).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import torch  # noqa: E402
from tiny_lm import TinyGPT, TokenDataset, loss_sum, warmup_cosine  # noqa: E402

from varlen_cli.errors.entry import exit_on_error  # noqa: E402
from varlen_cli.loader import PadCollate, Plan, VariableBatchSizeLR, dataloader_for_plan  # noqa: E402
from varlen_cli.loader.replan import first_step  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, help="plan file from `varlen plan`")
    p.add_argument("--data", default=os.path.join(ROOT, "sample_data", "tokenized.parquet"),
                   help="Parquet file with a list column of token ids (the dataset the plan was made for)")
    p.add_argument("--column", default="input_ids", help="token id column of --data")
    p.add_argument("--nproc", type=int, default=1, help="start this many local DDP workers (gloo on CPU)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--lr", type=float, default=3e-3, help="base learning rate (before the plan's lr_scale)")
    p.add_argument("--warmup-steps", type=int, default=2, help="LR warm-up steps of the base schedule")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many global steps")
    p.add_argument("--total-steps", type=int, default=None,
                   help="length of the base LR schedule (default: the job's last step, the plan's end)")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--log-dir", default=None, help="write rank-R.json logs here")
    p.add_argument("--save-state", default=None, help="checkpoint file written after step --save-at")
    p.add_argument("--save-at", type=int, default=None, help="global step after which to write --save-state")
    p.add_argument("--resume", default=None,
                   help="checkpoint to resume from (this plan's, or its parent's: `varlen replan`)")
    p.add_argument("--packing", action="store_true",
                   help="expect a packed plan (packed plans are detected anyway): rows of concatenated samples, "
                        "position ids restarting per sample and a block-diagonal causal mask")
    p.add_argument("--compile", action="store_true", help="torch.compile(dynamic=False) the model")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    p.add_argument("--max-compiled-shapes", type=int, default=16,
                   help="at most this many shapes stay compiled; a new shape beyond it calls torch.compiler.reset()")
    return p.parse_args(argv)


def compile_mode(world_size: int, device: str):
    """CUDA graphs (reduce-overhead) only for one CUDA process; DDP's collectives cannot be captured."""
    if device != "cuda":
        return None
    return "reduce-overhead" if world_size == 1 else "max-autotune-no-cudagraphs"


def compile_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def train(args: argparse.Namespace) -> dict:
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda"
              else torch.device("cpu"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    dist = torch.distributed.is_initialized()
    done = False
    try:
        result = _train(args, rank, world, device, dist)
        done = True
        return result
    finally:
        if dist:
            if done:  # every rank meets before the group goes (none tears down connections a peer still uses)
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _train(args, rank, world, device, dist) -> dict:
    dataset = TokenDataset(args.data, args.column)
    plan = Plan.open(args.plan)
    packed = bool(plan.packing)
    if args.packing and not packed:
        raise SystemExit(f"--packing: {args.plan} is not a packed plan (make one with `varlen plan --packing`)")
    if packed:  # rows of concatenated samples; a block-diagonal causal mask keeps samples apart
        from varlen_cli.loader.packed import PackedCollate

        collate = PackedCollate(pad_id=0, attention_mask_3d=True)
    else:
        collate = PadCollate(pad_id=0)
    loader = dataloader_for_plan(dataset, plan, collate_fn=collate, num_workers=args.num_workers)
    sampler = loader.batch_sampler
    torch.manual_seed(args.seed)
    max_len = max(t for _, t in plan.shapes)
    model = TinyGPT(dataset.vocab_size, max_len, args.d_model, args.layers, args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.total_steps or first_step(plan) + plan.num_steps  # a replanned plan continues the job's steps
    base = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup_steps, total))
    scheduler = VariableBatchSizeLR(base, plan)
    if args.resume:
        state = torch.load(args.resume, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["lr"])
        sampler.load_state_dict(state["sampler"])
    net = torch.nn.parallel.DistributedDataParallel(model) if dist else model
    resets = 0
    if args.compile:
        from torch import _dynamo

        if not plan.static_shapes:
            print(f"warning: {args.plan} has varying batch sizes; --compile works best on a --static-shapes plan",
                  file=sys.stderr)
        _dynamo.config.recompile_limit = max(8, min(len(plan.shapes), args.max_compiled_shapes) + 1)
        mode = compile_mode(world, args.device)
        net = torch.compile(net, dynamic=False, backend=args.compile_backend,
                            **({"mode": mode} if mode and args.compile_backend == "inductor" else {}))

    ga = plan.grad_accum
    log = {"rank": rank, "world_size": world, "plan": os.path.abspath(args.plan), "steps": [], "samples": [],
           "lr": [], "unscaled_lr": [], "lr_scale": [], "loss": [], "warmup_steps": plan.warmup_steps,
           "resumed": bool(args.resume)}
    shapes_seen, compiled_shapes = set(), set()
    step_ids: list[int] = []
    step_loss = 0.0
    real = padded = 0
    steps_run = 0
    compiles_at_warmup_end = None
    t_start = time.perf_counter()
    t_warm = None
    tokens_after_warm = 0
    done = False
    for epoch in range(sampler.epoch, plan.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            info = batch["info"]
            shape = tuple(batch["input_ids"].shape)
            if args.compile and shape not in compiled_shapes:
                if len(compiled_shapes) >= args.max_compiled_shapes:  # policy for plans with many shapes
                    torch.compiler.reset()
                    compiled_shapes.clear()
                    resets += 1
                compiled_shapes.add(shape)
            shapes_seen.add(shape)
            last = info.micro == ga - 1
            sync = contextlib.nullcontext() if (last or not dist) else net.no_sync()
            with sync:
                extra = ({"position_ids": batch["position_ids"].to(device),
                          "attention_mask_3d": batch["attention_mask_3d"].to(device)} if packed else {})
                logits = net(batch["input_ids"].to(device), batch["attention_mask"].to(device), **extra)
                loss = loss_sum(logits, batch["labels"].to(device))
                (loss * world / batch["step_loss_tokens"]).backward()
            step_loss += float(loss.detach()) / batch["step_loss_tokens"]
            step_ids += batch["sample_ids"][: batch["num_samples"]].tolist()
            real += batch["num_tokens"]
            padded += batch["input_ids"].numel()
            if t_warm is not None:
                tokens_after_warm += batch["num_tokens"]
            if not last:
                continue
            log["lr"].append(optimizer.param_groups[0]["lr"])
            log["unscaled_lr"].append(scheduler.get_unscaled_lr()[0])
            log["lr_scale"].append(info.lr_scale)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            log["steps"].append(first_step(plan) + info.step)  # the job's global step
            log["samples"].append(step_ids)
            log["loss"].append(step_loss)
            step_ids, step_loss = [], 0.0
            steps_run += 1
            if compiles_at_warmup_end is None and info.step + 1 >= plan.warmup_steps:
                compiles_at_warmup_end = compile_count()
                t_warm = time.perf_counter()
            if args.save_state and args.save_at == info.step and rank == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "lr": scheduler.state_dict(), "sampler": sampler.state_dict(after=batch)}
                torch.save(state, args.save_state + ".tmp")
                os.replace(args.save_state + ".tmp", args.save_state)
            if args.max_steps is not None and steps_run >= args.max_steps:
                done = True
                break
        if done:
            break
    seconds = time.perf_counter() - t_start
    warm_seconds = time.perf_counter() - t_warm if t_warm is not None else 0.0
    total_compiles = compile_count()
    log.update({
        "steps_run": steps_run, "seconds": seconds, "real_tokens": real, "padded_tokens": padded,
        "tokens_per_s": real / seconds if seconds else 0.0,
        "tokens_per_s_after_warmup": tokens_after_warm / warm_seconds if warm_seconds else None,
        "padding_pct": 100.0 * (1 - real / padded) if padded else 0.0,
        "shapes": sorted(list(s) for s in shapes_seen), "compiled_shapes": len(shapes_seen) if args.compile else 0,
        "compiles": total_compiles,
        "compiles_after_warmup": (total_compiles - compiles_at_warmup_end
                                  if compiles_at_warmup_end is not None else None),
        "compiler_resets": resets,
    })
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(log, fh)
    if rank == 0:
        extra = ""
        if args.compile:
            extra = (f", compiled shapes {log['compiled_shapes']}, graphs compiled {total_compiles} "
                     f"({log['compiles_after_warmup']} after the {plan.warmup_steps} warm-up steps)")
        print(f"rank 0: {steps_run} steps, {log['tokens_per_s']:.0f} tokens/s, padding {log['padding_pct']:.1f}%"
              f"{extra}, final loss {log['loss'][-1] if log['loss'] else float('nan'):.3f}", flush=True)
    return {k: v for k, v in log.items() if k not in ("samples",)}


def _worker(argv) -> dict:
    return exit_on_error(train, parse_args(argv))  # --nproc: the launcher shows a worker's PlanError line


def launch_local(nproc: int, argv) -> None:
    """Start ``nproc`` workers with torch's elastic launcher (what torchrun uses) on a free port; forked on
    Linux (this process has imported torch but run nothing on it yet: no threads, no CUDA context), which
    spares each worker the interpreter start and imports a spawned one repeats."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"tiny-lm-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          start_method="fork" if sys.platform.startswith("linux") else "spawn",
                          local_addr="127.0.0.1")
    elastic_launch(config, _worker)(argv)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.nproc > 1 and "RANK" not in os.environ:
        rest = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")]
        rest = [a for a in rest if not a.startswith("--nproc=")]
        launch_local(args.nproc, rest)
    else:
        train(args)


if __name__ == "__main__":
    exit_on_error(main)  # a PlanError: its one line (also in torchrun's summary), not a traceback per rank
