"""Benchmark ``varlen simulate``: seconds per schedule on a synthetic plan of 1M microbatches.

    PYTHONPATH=. python benchmarks/bench_simulate.py --microbatches 1000000 --dp 8 --grad-accum 8 \
        --stages 4 --repeats 3

The plan is a real plan file (the columns and metadata of docs/formats.md, written with pyarrow):
microbatches of random padded shapes (T log-uniform in 64 .. 8192, B = budget // T), so every step
has different costs. Prints, per schedule, the median of ``--repeats`` runs of the library call
(plan reading included) and two same-run references: the time to read the plan's costs alone, and
a step-by-step peer (the same scheduler, job tables built once, called once per step with rows = 1
on ``--peer-steps`` steps, schedule only, no metrics, extrapolated to the plan): what the
vectorisation over steps buys.

    PYTHONPATH=. python benchmarks/bench_simulate.py --order-gain --samples 200000 --dp 4 --grad-accum 8 \
        --stages 4

``--order-gain``: schedule-aware plans (``varlen plan --schedule``). Writes lognormal lengths,
runs ``varlen analyze`` and ``varlen plan`` (random and bucket-shuffle orders) without and with
``--schedule`` for 1F1B, GPipe and DDP, and prints the simulated makespan and peak activation of
both, and the planner's time with and without the reordering.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_synthetic_plan(path: str, *, microbatches: int, dp: int, grad_accum: int, budget: int = 16384,
                         seed: int = 0) -> str:
    """A plan file with ``microbatches`` rows of random shapes under a token budget."""
    per_step = dp * grad_accum
    steps = microbatches // per_step
    rows = steps * per_step
    rng = np.random.default_rng(seed)
    seqlen = np.exp(rng.uniform(np.log(64), np.log(8192), rows)).astype(np.int32)
    batch = np.maximum(1, budget // seqlen).astype(np.int32)
    position = np.arange(rows)
    offsets = np.arange(rows + 1, dtype=np.int32)  # one (fake) sample id per microbatch
    table = pa.table({
        "epoch": pa.array(np.zeros(rows, np.int32)), "step": pa.array(position // per_step),
        "rank": pa.array((position % per_step // grad_accum).astype(np.int32)),
        "micro": pa.array((position % grad_accum).astype(np.int32)),
        "sample_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(position)),
        "num_samples": pa.array(np.ones(rows, np.int32)), "seqlen": pa.array(seqlen),
        "batch_size": pa.array(batch), "tokens": pa.array(batch.astype(np.int64) * seqlen),
        "lr_scale": pa.array(np.ones(rows)), "shape_id": pa.array(np.zeros(rows, np.int32)),
        "step_samples": pa.array(np.full(rows, per_step, np.int64)),
        "step_tokens": pa.array(np.zeros(rows, np.int64)),
    })
    meta = {"format": "varlen-plan", "format_version": 1, "dp": dp, "grad_accum": grad_accum, "epochs": 1,
            "num_steps": steps, "steps_per_epoch": [steps], "num_microbatches": rows, "shapes": [[0, 0]]}
    table = table.replace_schema_metadata({b"varlen": json.dumps(meta).encode()})
    pq.write_table(table, path, row_group_size=max(per_step, 65536 // per_step * per_step))
    return path


def order_gain(args) -> None:
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.plan import PlanConfig, plan

    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        lengths = np.clip(rng.lognormal(6.0, 1.0, args.samples), 8, 16384).astype(np.int64)
        pq.write_table(pa.table({"n": lengths}), os.path.join(tmp, "lengths.parquet"))
        metrics = os.path.join(tmp, "m")
        analyze(AnalyzeConfig(sources=(os.path.join(tmp, "lengths.parquet"),), output=metrics, length="value:n",
                              progress=False))
        print(f"{args.samples:,} samples, lognormal lengths (median {int(np.median(lengths))}), --max-tokens 16384, "
              f"dp={args.dp}, grad_accum={args.grad_accum}, stages={args.stages}")
        print(f"{'order':15s} {'schedule':9s} {'makespan plan order':>20s} {'reordered':>12s} {'gain':>7s} "
              f"{'peak before':>12s} {'peak after':>11s} {'plan s':>7s} {'+order s':>9s}")
        for order in ("random", "bucket-shuffle"):
            common = {"input": metrics, "max_tokens": 16384, "dp": args.dp, "grad_accum": args.grad_accum,
                      "order": order, "overwrite": True}
            t0 = time.perf_counter()
            plan(PlanConfig(output=os.path.join(tmp, "p.parquet"), **common))
            base_s = time.perf_counter() - t0
            for name in ("1f1b", "gpipe", "ddp"):
                t0 = time.perf_counter()
                res = plan(PlanConfig(output=os.path.join(tmp, "q.parquet"), schedule=name, stages=args.stages,
                                      **common))
                sched_s = time.perf_counter() - t0
                g = res.metadata["schedule"]
                print(f"{order:15s} {name:9s} {g['makespan_plan_order']:20.4g} {g['makespan']:12.4g} "
                      f"{g['gain']:7.2%} {g['peak_activation_plan_order']:12,.0f} {g['peak_activation']:11,.0f} "
                      f"{base_s:7.2f} {sched_s - base_s:9.2f}")


def main() -> None:
    from varlen_cli.schedule import SCHEDULES, SimulateConfig, build_jobs, make_scheme, read_plan_costs, simulate
    from varlen_cli.schedule.engine import unit_starts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, default=1_000_000)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--peer-steps", type=int, default=200)
    ap.add_argument("--loop-workers", type=int, default=None,
                    help="R workers per group for lpp/fslpp (default S // 2: two loops; R = S is GPipe)")
    ap.add_argument("--order-gain", action="store_true", help="measure varlen plan --schedule instead")
    ap.add_argument("--samples", type=int, default=200_000)
    args = ap.parse_args()
    if args.order_gain:
        return order_gain(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic_plan(os.path.join(tmp, "plan.parquet"), microbatches=args.microbatches, dp=args.dp,
                                    grad_accum=args.grad_accum)

        def median(fn) -> float:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        read = median(lambda: read_plan_costs(path))
        loop = args.loop_workers or max(1, args.stages // 2)
        print(f"plan: {args.microbatches:,} microbatches, dp={args.dp}, grad_accum={args.grad_accum}, "
              f"stages={args.stages} (lpp/fslpp: {loop} workers per group); median of {args.repeats}")
        costs = read_plan_costs(path)
        print(f"{'schedule':10s} {'seconds':>8s} {'x read':>8s} {'per-step peer s':>16s} {'speedup':>8s} "
              f"{'bubble':>7s}")
        print(f"{'(read)':10s} {read:8.2f} {1.0:8.1f}")
        for name in args.schedules.split(","):
            looped = name in ("lpp", "fslpp")
            workers = costs.dp * loop if looped else None
            cfg = SimulateConfig(plan=path, schedule=name, stages=args.stages, workers=workers)
            out = {}
            seconds = median(lambda cfg=cfg, out=out: out.setdefault("r", simulate(cfg)))
            bubble = out["r"].results[0].bubble
            scheme = make_scheme(name, stages=args.stages, microbatches=costs.per_step, dp=costs.dp, workers=workers)
            k = min(args.peer_steps, costs.num_steps)
            units = [build_jobs(scheme, u) for u in range(scheme.units)]  # built once, outside the timing
            n = costs.per_step // scheme.units
            t0 = time.perf_counter()
            for step in range(k):
                for jobs in units:
                    unit_starts(scheme, jobs, costs.cost[step:step + 1, jobs.first:jobs.first + n], 2.0)
            peer = (time.perf_counter() - t0) / k * costs.num_steps
            print(f"{name:10s} {seconds:8.2f} {seconds / read:8.1f} {peer:16.1f} {peer / seconds:8.0f} {bubble:7.1%}")


if __name__ == "__main__":
    main()
