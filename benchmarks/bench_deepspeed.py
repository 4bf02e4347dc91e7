"""DeepSpeed on a varlen plan vs DeepSpeed's own variable-batch path (results: benchmarks/README.md, "DeepSpeed").

    # plan time, padding and over-budget microbatches: `varlen plan` vs DeepSpeed's batch_by_seqlens
    # (its best case, samples in length order), on the token lengths of sample_data/tokenized.parquet
    # (2,000 samples; larger N: the same lengths drawn again, seeded); batch_by_seqlens only up to
    # --deepspeed-max samples, its time extrapolated beyond (power law through its two largest runs)
    PYTHONPATH=. python benchmarks/bench_deepspeed.py plan --sizes 2000,5000,339000 --deepspeed-max 5000

    # CPU tokens/s of a tiny Llama under the DeepSpeed engine, ZeRO-2, 2 processes (real torchrun), all in
    # the same run, interleaved: the varlen plan (varlen_cli.integrations.deepspeed), the varlen plan with
    # --max-tokens = batch_by_seqlens' largest padded microbatch (the same peak size), batch_by_seqlens'
    # microbatches through DeepSpeed's dataloader_for_variable_batch_size, and fixed random padded
    # batches (the plan's mean batch size, padded to the batch's longest sample)
    PYTHONPATH=. python benchmarks/bench_deepspeed.py train --samples 2000 --repeats 3

Same budget for all: --max-tokens padded tokens per microbatch for varlen (B x T, never exceeded);
batch_by_seqlens bounds the sum of real lengths by the same number (its padded size may exceed it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT, os.path.join(ROOT, "examples")]
DATA = os.path.join(ROOT, "sample_data", "tokenized.parquet")


def sample_lengths(n: int) -> np.ndarray:
    """The token lengths of sample_data/tokenized.parquet; beyond its 2,000 rows, drawn from them (seeded)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    base = pc.list_value_length(pq.read_table(DATA, columns=["input_ids"]).column("input_ids")).to_numpy()
    base = base.astype(np.int64)
    if n <= len(base):
        return base[:n]
    return np.random.default_rng(0).choice(base, n)


# -- plan: time and padding --------------------------------------------------------------------------
def plan_bench(args) -> None:
    import bench_plan

    print(f"# {' '.join(sys.argv)}")
    print(f"# {os.cpu_count()} CPUs (shared), load {os.getloadavg()[0]:.1f}; budget {args.max_tokens} padded tokens, "
          f"dp {args.dp}; lengths: sample_data/tokenized.parquet")
    print(f"{'N':>8} {'method':<34} {'CPU s':>10} {'wall s':>8} {'microbatches':>12} {'padding %':>9} "
          f"{'over budget':>11} {'straggler':>9}")
    ds_times = {}
    bench_plan.peer_deepspeed(sample_lengths(200), args.max_tokens, args.dp)  # imports DeepSpeed outside the timing
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            lengths = sample_lengths(n)
            runs = [_timed(bench_plan.varlen_plan, lengths, args.max_tokens, args.dp, "bucket-shuffle", tmp)
                    for _ in range(args.repeats)]
            _row(n, "varlen plan (bucket-shuffle)", runs, runs[0][0][0])
            if n <= args.deepspeed_max:
                ds = [_timed(bench_plan.peer_deepspeed, lengths, args.max_tokens, args.dp) for _ in range(args.repeats)]
                ds_times[n] = _row(n, "deepspeed batch_by_seqlens", ds,
                                   bench_plan.metrics_of(ds[0][0], lengths, args.max_tokens, args.dp))
            elif len(ds_times) >= 2:
                (n1, t1), (n2, t2) = sorted(ds_times.items())[-2:]
                k = np.log(t2 / t1) / np.log(n2 / n1)
                est = t2 * (n / n2) ** k
                print(f"{n:>8,} {'deepspeed batch_by_seqlens':<34} {est:>10.3g} (extrapolated: t ~ N^{k:.2f} from "
                      f"{n1:,} and {n2:,}; {est / 86400:.1f} days)", flush=True)


def _timed(fn, *args):
    """``(fn(*args), CPU seconds of this process, wall seconds)``: on a shared machine CPU time, not wall
    time, is what a single-threaded planner costs."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.process_time() - c0, time.perf_counter() - t0


def _row(n: int, name: str, runs: list, m: dict) -> float:
    """Print one row (medians of the runs); returns the median CPU seconds."""
    cpu, wall = statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs)
    print(f"{n:>8,} {name:<34} {cpu:>10.3f} {wall:>8.3f} {m['microbatches']:>12,} {m['padding_pct']:>9.2f} "
          f"{m['over_budget']:>11,} {m['straggler_mean']:>9.3f}", flush=True)
    return cpu


# -- train: tokens/s under the DeepSpeed engine ----------------------------------------------------------
def train_bench(args) -> None:
    """Make the plan and batch_by_seqlens' microbatches here, then train under the real torchrun."""
    import bench_plan

    lengths = sample_lengths(args.samples)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        data = os.path.join(tmp, "data.parquet")
        import pyarrow.parquet as pq

        pq.write_table(pq.read_table(DATA).slice(0, args.samples), data)
        from varlen_cli.plan import PlanConfig, plan

        metrics = bench_plan.write_metrics_dir(os.path.join(tmp, "metrics"), lengths)
        bench_plan.peer_deepspeed(sample_lengths(200), args.max_tokens, 2)  # imports DeepSpeed outside the timing
        ds, ds_seconds, _ = _timed(bench_plan.peer_deepspeed, lengths, args.max_tokens, 2)
        peak = max(len(b) * int(lengths[b].max()) for b in ds)  # DeepSpeed's largest padded microbatch
        for name, budget in (("plan.parquet", args.max_tokens), ("plan-peak.parquet", peak)):
            plan(PlanConfig(input=metrics, output=os.path.join(tmp, name), max_tokens=budget, dp=2, grad_accum=1,
                            lr_scaling="linear", overwrite=True, progress=False))
        with open(os.path.join(tmp, "ds.json"), "w") as fh:
            json.dump([b.tolist() for b in ds], fh)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "_train", "--tmp", tmp, "--repeats", str(args.repeats), "--hidden", str(args.hidden)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        print(f"# {' '.join(sys.argv)}")
        print(f"# {os.cpu_count()} CPUs (shared), load {os.getloadavg()[0]:.1f} before; {args.samples:,} samples of "
              f"sample_data/tokenized.parquet, budget {args.max_tokens}, tiny Llama hidden {args.hidden}, fp32, "
              f"ZeRO-2, 2 processes x 1 thread; batch_by_seqlens planned in {ds_seconds:.2f} CPU s, its largest padded "
              f"microbatch {peak} tokens", flush=True)
        subprocess.run(cmd, check=True, env=env)


# the varlen plans: at the budget, and at DeepSpeed's largest padded microbatch (the same peak size)
PLANS = {"varlen plan": "plan.parquet", "varlen plan, DS's peak budget": "plan-peak.parquet"}


def _batches(method: str, tmp: str, rank: int, dataset) -> list:
    """This rank's microbatches (lists of sample ids) of one epoch, for the two non-varlen methods."""
    if method == "deepspeed batch_by_seqlens":
        from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
            dataloader_for_variable_batch_size,
        )

        with open(os.path.join(tmp, "ds.json")) as fh:
            microbatches = [(i // 2, ids) for i, ids in enumerate(json.load(fh))]
        loader, _ = dataloader_for_variable_batch_size(list(range(len(dataset))), microbatches, [0] * len(microbatches),
                                                       dataloader_rank=rank, dataloader_num_replicas=2,
                                                       dataloader_batch_size=1, dataloader_num_workers=0)
        return [list(b) for b in loader]  # DeepSpeed's own loader deals them to the ranks
    from varlen_cli.loader import Plan

    plan = Plan.open(os.path.join(tmp, "plan.parquet"))
    size = max(1, round(plan.stats["samples"] / plan.num_microbatches))
    perm = np.random.default_rng(0).permutation(len(dataset))
    fixed = [perm[i:i + size].tolist() for i in range(0, len(perm) - len(perm) % (2 * size), size)]
    return fixed[rank::2]


def _pad(dataset, ids: list) -> dict:
    """Right-padded batch at its longest sample, next-token labels."""
    from varlen_cli.loader import PadCollate

    return PadCollate()([dataset[i] for i in ids])


def _train_one(method: str, tmp: str, hidden: int) -> tuple[float, float, int, int]:
    """One epoch of ``method`` on a fresh engine: (seconds, CPU seconds, real tokens, padded tokens) of this rank."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from tiny_lm import TokenDataset
    from train_hf_trainer import tiny_llama

    from varlen_cli.integrations import deepspeed as varlen_ds
    from varlen_cli.loader import Plan, to_model_inputs

    dataset = TokenDataset(os.path.join(tmp, "data.parquet"))
    plan = Plan.open(os.path.join(tmp, PLANS.get(method, "plan.parquet")))
    model = tiny_llama(dataset.vocab_size, 512, hidden=hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if method in PLANS:
        engine, _, loader, _ = varlen_ds.initialize(plan, dataset, model=model, config=config, optimizer=optimizer)
        batches = loader
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config={**config, "train_micro_batch_size_per_gpu": 1})
        batches = (_pad(dataset, ids) for ids in _batches(method, tmp, dist.get_rank(), dataset))
    real = padded = 0
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for batch in batches:
        logits = engine(**to_model_inputs(batch, labels=False)).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        if method in PLANS:
            varlen_ds.backward(engine, loss_sum, batch)
        else:
            engine.backward(loss_sum / max(int(batch["loss_tokens"]), 1))
        engine.step()
        real += int(batch["num_tokens"])
        padded += int(batch["input_ids"].numel())
    cpu = time.process_time() - c0
    dist.barrier()
    return time.perf_counter() - t0, cpu, real, padded


def _train_ranks(args) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    methods = [*PLANS, "deepspeed batch_by_seqlens", "fixed random batches"]
    seen = {m: [] for m in methods}
    for r in range(args.repeats):
        for method in methods[r % len(methods):] + methods[:r % len(methods)]:  # rotate the order each round
            totals = [None] * dist.get_world_size()
            dist.all_gather_object(totals, _train_one(method, args.tmp, args.hidden))
            seen[method].append((max(t[0] for t in totals), sum(t[1] for t in totals), sum(t[2] for t in totals),
                                 sum(t[3] for t in totals)))
    if dist.get_rank() == 0:
        _report(seen)
    dist.barrier()
    dist.destroy_process_group()


def _report(seen: dict) -> None:
    """Per method: real tokens per second (wall, slowest rank) and per CPU-second (both ranks), medians;
    padding; the ratios to the varlen plan."""
    print(f"{'method':<30} {'tokens/s':>9} {'runs':<24} {'tokens/CPU-s':>12} {'runs':<24} {'padding %':>9} "
          f"{'vs varlen (s, CPU-s)':>20}")
    rate = {m: [real / s for s, _, real, _ in runs] for m, runs in seen.items()}
    per_cpu = {m: [real / c for _, c, real, _ in runs] for m, runs in seen.items()}
    base, base_cpu = statistics.median(rate["varlen plan"]), statistics.median(per_cpu["varlen plan"])
    for method, runs in seen.items():
        pad = 100 * (1 - runs[0][2] / runs[0][3])
        r, c = statistics.median(rate[method]), statistics.median(per_cpu[method])
        print(f"{method:<30} {r:>9,.0f} {', '.join(f'{x:,.0f}' for x in rate[method]):<24} {c:>12,.0f} "
              f"{', '.join(f'{x:,.0f}' for x in per_cpu[method]):<24} {pad:>9.2f} "
              f"{r / base:>10.2f}x {c / base_cpu:>7.2f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("plan")
    s.add_argument("--sizes", default="2000,5000,339000")
    s.add_argument("--deepspeed-max", type=int, default=5000, help="largest N batch_by_seqlens runs on")
    s.add_argument("--max-tokens", type=int, default=2048)
    s.add_argument("--dp", type=int, default=2)
    s.add_argument("--repeats", type=int, default=3, help="runs per N and method (median)")
    s.add_argument("--work", default=tempfile.gettempdir())
    t = sub.add_parser("train")
    t.add_argument("--samples", type=int, default=2000)
    t.add_argument("--max-tokens", type=int, default=2048)
    t.add_argument("--hidden", type=int, default=64)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--work", default=tempfile.gettempdir())
    r = sub.add_parser("_train")
    r.add_argument("--tmp", required=True)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--hidden", type=int, default=64)
    args = p.parse_args()
    {"plan": plan_bench, "train": train_bench, "_train": _train_ranks}[args.cmd](args)


if __name__ == "__main__":
    main()
