"""Benchmark ``varlen simulate``: seconds per schedule on a synthetic plan of 1M microbatches.

    PYTHONPATH=. python benchmarks/bench_simulate.py --microbatches 1000000 --dp 8 --grad-accum 8 \
        --stages 4 --repeats 3

The plan is a real plan file (the columns and metadata of docs/formats.md, written with pyarrow):
microbatches of random padded shapes (T log-uniform in 64 .. 8192, B = budget // T), so every step
has different costs. Prints, per schedule, the median of ``--repeats`` runs of the library call
(plan reading included) and two same-run references: the time to read the plan's costs alone, and
a step-by-step peer (the same scheduler called once per step, rows = 1, on ``--peer-steps`` steps,
extrapolated to the plan): what the vectorisation over steps buys.
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


def main() -> None:
    from varlen_cli.schedule import (
        SCHEDULES,
        PlanCosts,
        SimulateConfig,
        make_scheme,
        read_plan_costs,
        simulate,
        simulate_scheme,
    )

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, default=1_000_000)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--peer-steps", type=int, default=200)
    args = ap.parse_args()
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
        print(f"plan: {args.microbatches:,} microbatches, dp={args.dp}, grad_accum={args.grad_accum}, "
              f"stages={args.stages}; median of {args.repeats}")
        costs = read_plan_costs(path)
        print(f"{'schedule':10s} {'seconds':>8s} {'x read':>8s} {'per-step peer s':>16s} {'speedup':>8s} "
              f"{'bubble':>7s}")
        print(f"{'(read)':10s} {read:8.2f} {1.0:8.1f}")
        for name in args.schedules.split(","):
            cfg = SimulateConfig(plan=path, schedule=name, stages=args.stages)
            out = {}
            seconds = median(lambda cfg=cfg, out=out: out.setdefault("r", simulate(cfg)))
            bubble = out["r"].results[0].bubble
            scheme = make_scheme(name, stages=args.stages, microbatches=costs.per_step, dp=costs.dp)
            k = min(args.peer_steps, costs.num_steps)
            t0 = time.perf_counter()
            for step in range(k):
                one = PlanCosts(path=path, dp=costs.dp, grad_accum=costs.grad_accum,
                                cost=costs.cost[step:step + 1], tokens=costs.tokens[step:step + 1])
                simulate_scheme(scheme, one, 2.0)
            peer = (time.perf_counter() - t0) / k * costs.num_steps
            print(f"{name:10s} {seconds:8.2f} {seconds / read:8.1f} {peer:16.1f} {peer / seconds:8.0f} {bubble:7.1%}")


if __name__ == "__main__":
    main()
