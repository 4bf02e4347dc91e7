"""Which per-step LR scaling suits the loss the loader computes: the tiny LM's loss curves under
``--lr-scaling none``, ``--lr-scale-by loss-tokens`` (the default) and ``--lr-scale-by samples``.

    PYTHONPATH=. python benchmarks/bench_lr_scaling.py [--lrs 1e-3,3e-3,1e-2] [--seeds 0,1,2] [--json out.json]

Data: sample_data/tokenized.parquet (2,000 samples of 5-404 tokens); the first 1,800 are planned
(bucket-shuffle, --max-tokens 1024, 3 epochs by default: steps of near-constant tokens and 1-102 samples), the
last 200 are held out. Model: examples/tiny_lm.py's TinyGPT (d 64, 2 layers), AdamW, linear warm-up
and cosine decay over the plan, the loss the loader's recipes use (the exact mean token loss over
the step's targets). The three plans are the same batches; only ``lr_scale`` differs, and its mean
over the steps is 1 in each (the base is the mean step size), so the same base LR means the same
average LR. Reported: each scaling's lr_scale range, its held-out loss at the end (mean over the
seeds, and its spread), the best base LR of the sweep, and the roughness of its training curve
(the mean absolute step-to-step change of the training loss).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

SCALINGS = {"none": {"lr_scaling": "none"}, "loss-tokens": {"lr_scale_by": "loss-tokens"},
            "samples": {"lr_scale_by": "samples"}}
TRAIN, HELD_OUT = 1800, 200


def make_plans(work: str, max_tokens: int, epochs: int) -> tuple[dict, str]:
    """The training slice, its metrics and one plan per scaling (same batches, other lr_scale)."""
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.plan import PlanConfig, plan

    data = os.path.join(work, "train.parquet")
    pq.write_table(pq.read_table(os.path.join(ROOT, "sample_data", "tokenized.parquet")).slice(0, TRAIN), data)
    metrics = os.path.join(work, "metrics")
    analyze(AnalyzeConfig(sources=(data,), output=metrics, length="list:input_ids", progress=False))
    plans = {}
    for name, options in SCALINGS.items():
        plans[name] = os.path.join(work, f"plan-{name}.parquet")
        plan(PlanConfig(input=metrics, output=plans[name], max_tokens=max_tokens, epochs=epochs, progress=False,
                        **options))
    return plans, data


def held_out_loss(model, samples: list) -> float:
    """Mean next-token loss over every target of the held-out samples (each sample alone)."""
    import torch.nn.functional as F

    total = count = 0.0
    with torch.no_grad():
        for ids in samples:
            x = torch.as_tensor(ids)[None]
            logits = model(x, torch.ones_like(x, dtype=torch.bool))
            total += float(F.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="sum"))
            count += len(ids) - 1
    return total / count


def train(plan_path: str, data: str, lr: float, seed: int, held_out: list) -> dict:
    """One run: the loader's recipe (docs/loader.md) on one process; returns the losses."""
    from tiny_lm import TinyGPT, TokenDataset, loss_sum, warmup_cosine

    from varlen_cli.loader import Plan, VariableBatchSizeLR, dataloader_for_plan

    torch.manual_seed(seed)
    plan = Plan.open(plan_path)
    dataset = TokenDataset(data)
    model = TinyGPT(dataset.vocab_size, max(max(t for _, t in plan.shapes), max(map(len, held_out))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = VariableBatchSizeLR(torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(max(1, plan.num_steps // 20), plan.num_steps)), plan)
    loader = dataloader_for_plan(dataset, plan, rank=0, world_size=1)
    curve = []
    for epoch in range(plan.epochs):
        loader.set_epoch(epoch)
        step_loss = 0.0
        for batch in loader:
            loss = loss_sum(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
            (loss / batch["step_loss_tokens"]).backward()
            step_loss += float(loss.detach()) / batch["step_loss_tokens"]
            if batch["info"].micro == plan.grad_accum - 1:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                curve.append(step_loss)
                step_loss = 0.0
    return {"curve": curve, "held_out": held_out_loss(model, held_out)}


def run(args) -> dict:
    from varlen_cli.loader import Plan

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="varlen-bench-lr-")
    plans, data = make_plans(work, args.max_tokens, args.epochs)
    table = pq.read_table(os.path.join(ROOT, "sample_data", "tokenized.parquet")).slice(TRAIN, HELD_OUT)
    held_out = [np.asarray(x, np.int64) for x in table.column("input_ids").to_pylist() if len(x) > 1]
    out = {"config": vars(args), "scalings": {}}
    for name, path in plans.items():
        scales = Plan.open(path).lr_scales()
        runs = {}
        for lr in args.lrs:
            for seed in args.seeds:  # interleaved order would not change anything: one process, one thread
                result = train(path, data, lr, seed, held_out)
                runs[f"{lr:g}/{seed}"] = result
                print(f"{name:12s} lr {lr:<7g} seed {seed}: held-out {result['held_out']:.4f}", flush=True)
        out["scalings"][name] = {"lr_scale_min": float(scales.min()), "lr_scale_max": float(scales.max()),
                                 "runs": runs}
    return out


def summary(out: dict) -> list[str]:
    """The markdown table benchmarks/README.md shows."""
    lrs, seeds = out["config"]["lrs"], out["config"]["seeds"]
    lines = ["| scaling | lr_scale min / max | " + " | ".join(f"held-out loss, LR {lr:g}" for lr in lrs)
             + " | curve roughness (best LR) |", "|---|---|" + "---|" * len(lrs) + "---|"]
    for name, s in out["scalings"].items():
        cells, best = [], None
        for lr in lrs:
            losses = [s["runs"][f"{lr:g}/{seed}"]["held_out"] for seed in seeds]
            mean = statistics.mean(losses)
            spread = (max(losses) - min(losses)) / 2
            cells.append(f"{mean:.4f} ± {spread:.4f}")
            best = (mean, lr) if best is None or mean < best[0] else best
        rough = statistics.mean(float(np.mean(np.abs(np.diff(s["runs"][f"{best[1]:g}/{seed}"]["curve"]))))
                                for seed in seeds)
        lines.append(f"| {name} | {s['lr_scale_min']:.3f} / {s['lr_scale_max']:.3f} | " + " | ".join(cells)
                     + f" | {rough:.4f} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="base LRs (comma-separated)")
    ap.add_argument("--seeds", default="0,1,2", help="model seeds (comma-separated)")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--json", default=None, help="write every curve here")
    args = ap.parse_args(argv)
    args.lrs = [float(x) for x in args.lrs.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    out = run(args)
    print("\n".join(summary(out)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    main()
