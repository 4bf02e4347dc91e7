"""varlen replan / plan --extend / plan --mix vs varlen plan on the same data, in the same run.

    PYTHONPATH=. python benchmarks/bench_replan.py [--samples 1000000] [--repeats 3]

Lognormal lengths (mu 5, sigma 1, clipped to 4000), budget 16384, dp 8. Prints the median of
``--repeats`` runs of each and its ratio to ``varlen plan`` of the same data (1 epoch):
replan from the middle of epoch 0 onto dp 6; extend the 1-epoch plan to 2 epochs; a 2-source
mixture (weights 1 and 0.5) of the same total size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_plan import write_metrics_dir  # noqa: E402
from varlen_cli.plan import PlanConfig, plan  # noqa: E402
from varlen_cli.plan.replan import ExtendConfig, ReplanConfig, extend, replan  # noqa: E402


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5, 1, a.samples).astype(np.int64), 1, 4000)
    with tempfile.TemporaryDirectory() as d:
        metrics = write_metrics_dir(os.path.join(d, "m"), lengths)
        half = write_metrics_dir(os.path.join(d, "h"), lengths[: a.samples // 2])
        other = write_metrics_dir(os.path.join(d, "o"), lengths[a.samples // 2:])
        out = lambda name: os.path.join(d, name)  # noqa: E731
        base = PlanConfig(input=metrics, output=out("p.parquet"), max_tokens=16384, dp=8, overwrite=True)
        steps = plan(base).num_steps
        runs = {
            "plan": lambda: plan(base),
            "replan": lambda: replan(ReplanConfig(plan=out("p.parquet"), output=out("r.parquet"), dp=6,
                                                  from_step=steps // 2, overwrite=True)),
            "extend 1->2": lambda: extend(ExtendConfig(plan=out("p.parquet"), output=out("e.parquet"), epochs=2,
                                                       overwrite=True)),
            "mix (w 1, 0.5)": lambda: plan(PlanConfig(input="", output=out("x.parquet"), max_tokens=16384, dp=8,
                                                      overwrite=True, mix=f"a={half}:1,b={other}:0.5")),
        }
        times = {name: [] for name in runs}
        for _ in range(a.repeats):
            for name, fn in runs.items():
                times[name].append(_timed(fn))
    ref = statistics.median(times["plan"])
    print(f"{a.samples:,} samples, {steps:,} steps, medians of {a.repeats}")
    print(f"{'command':<16} {'median s':>9} {'vs plan':>8}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<16} {m:9.2f} {m / ref:8.2f}")


if __name__ == "__main__":
    main()
