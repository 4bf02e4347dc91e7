"""Two budgets (issue 36): ``varlen plan --max-target-tokens`` against the same plan with one budget, in the
same run: seconds (median of ``--repeats``), microbatches and padding of each side.

    python benchmarks/bench_two_budgets.py --samples 2000000 --repeats 3

The input: lognormal source lengths (median ~400, up to 8,000: speech frames) and target lengths of 5-20%
of them plus 0-19 (transcript tokens), written once under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_metrics(path: str, src: np.ndarray, tgt: np.ndarray, sorted_by_length: bool = False) -> str:
    """A metrics (or, ``sorted_by_length``, sorted) directory with a ``target_length`` column, as
    ``varlen analyze --target-length`` (and ``varlen sort``) write one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from varlen_cli.runtime import artifacts

    ids = np.arange(len(src), dtype=np.int64)
    if sorted_by_length:
        ids = np.lexsort((ids, src))
    os.makedirs(path, exist_ok=True)
    pq.write_table(pa.table({"sample_id": ids, "length": src[ids], "difficulty": src[ids].astype(np.float64),
                             "target_length": tgt[ids]}), os.path.join(path, artifacts.part_name(0)))
    kind = "sorted" if sorted_by_length else "metrics"
    manifest = {"format": artifacts.METRICS_FORMAT, "format_version": 1, "kind": kind, "stage": "bench",
                "config": {}, "artifact_id": f"bench-two-{kind}", "dataset": {"digest": "bench"},
                "num_rows": int(len(ids)), "order": {"by": ["length" if sorted_by_length else "sample_id"]},
                "columns": {"sample_id": "int64", "length": "int64", "difficulty": "float64",
                            "target_length": "int64"},
                "parts": [{"file": artifacts.part_name(0), "rows": int(len(ids))}]}
    with open(os.path.join(path, artifacts.MANIFEST_NAME), "w") as fh:
        json.dump(manifest, fh)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default="/tmp/varlen-bench-two-budgets")
    args = p.parse_args()
    from varlen_cli.plan import PlanConfig, plan

    rng = np.random.default_rng(0)
    src = np.minimum(rng.lognormal(6.0, 0.8, args.samples).astype(np.int64) + 1, 8000)
    tgt = np.minimum((src * rng.uniform(0.05, 0.2, args.samples)).astype(np.int64) + rng.integers(0, 20, args.samples),
                     4000)
    metrics = write_metrics(os.path.join(args.work, "m"), src, tgt)
    print("| order | budgets | seconds | microbatches | padding % | target padding % | two / one |")
    print("|-------|---------|---------|--------------|-----------|------------------|-----------|")
    for order in ("bucket-shuffle", "curriculum (sorted by length)", "random"):
        o = "bucket-shuffle" if order == "bucket-shuffle" else "random" if order == "random" else "curriculum"
        inp = metrics if o != "curriculum" else write_metrics(os.path.join(args.work, "s"), src, tgt, True)
        seconds = {}
        for name, extra in (("one", {}), ("two", {"max_target_tokens": 4096})):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                r = plan(PlanConfig(input=inp, output=os.path.join(args.work, f"{name}.parquet"), max_tokens=32768,
                                    dp=8, order=o, overwrite=True, progress=False, **extra))
                times.append(time.perf_counter() - t)
            seconds[name] = float(np.median(times))
            target = r.stats.get("target_padding_pct")
            ratio = f"{seconds['two'] / seconds['one']:.2f}" if name == "two" else ""
            print(f"| {order} | {name} | {seconds[name]:.2f} | {r.num_microbatches:,} | {r.stats['padding_pct']:.2f} | "
                  f"{'' if target is None else f'{target:.2f}'} | {ratio} |")


if __name__ == "__main__":
    main()
