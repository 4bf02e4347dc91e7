"""Benchmark of ``varlen calibrate`` + ``varlen plan --max-memory`` (results: benchmarks/memory.md).

    python benchmarks/bench_calibrate.py --model benchmarks.tiny_models:lm_4k --max-memory 640MiB \\
        --buckets 64,128,256,512 --runs 3

Per run, on CPU (peak = the peak resident memory of the training process, docs/memory.md; both
methods measure the same way: a child forked from an imported server plus the fresh-process offset):

1. varlen: ``calibrate --max-memory`` with the auto grid (timed; every measured shape is one trial step), then
   for every length bucket T the planner's largest B under ``--max-memory`` (margin 0.05) from the
   profile alone; that (B, T) is then measured once to check it (not counted as a trial).
2. Trial and error, NeMo OOMptimizer's method: per bucket, B doubles from 1 while the step fits the
   limit, then a binary search between the last fit and the first miss; every try is one trial step
   (here "does not fit" = measured peak above the limit, instead of a CUDA out-of-memory).

Reported: calibration seconds, the profile's held-out fit error, per bucket the B each method
chooses, its measured peak as a share of the limit ("budget use"), and the trial steps each needed.
Times are medians over ``--runs``; shapes and peaks are those of the last run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from varlen_cli.memory import CalibrateConfig, budget_from_profile, calibrate, parse_size  # noqa: E402
from varlen_cli.memory.measure import MeasureSetup  # noqa: E402
from varlen_cli.memory.procs import Measurer  # noqa: E402
from varlen_cli.plan.shapes import Budget  # noqa: E402


def trial_and_error(m: Measurer, seqlen: int, limit: int) -> tuple[int, int, float]:
    """OOMptimizer-style search: ``(largest B that fits, trial steps, its peak)``."""
    trials = 0
    peaks = {}

    def fits(b: int) -> bool:
        nonlocal trials
        trials += 1
        r = m.measure(b, seqlen)
        peaks[b] = float("inf") if r.get("oom") else r["peak_bytes"]
        return peaks[b] <= limit

    good, bad = 0, None
    b = 1
    while bad is None:
        if fits(b):
            good, b = b, 2 * b
        else:
            bad = b
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, trials, peaks.get(good, 0.0)


def one_run(args, workdir: str, run: int) -> dict:
    setup = MeasureSetup(model=args.model)
    limit = parse_size(args.max_memory)
    t0 = time.perf_counter()
    profile = calibrate(CalibrateConfig(output=os.path.join(workdir, f"profile{run}.json"), model=args.model,
                                        max_memory=args.max_memory))
    calib_seconds = time.perf_counter() - t0
    max_tokens, attention = budget_from_profile(profile, limit, args.margin)
    budget = Budget(max_tokens, None, attention)
    rows = []
    t1 = time.perf_counter()
    with Measurer(setup, (1, args.buckets[0])) as m:
        search = {t: trial_and_error(m, t, limit) for t in args.buckets}
        search_seconds = time.perf_counter() - t1
        checks = {t: m.measure(int(budget.cap([t])[0]), t)["peak_bytes"] if budget.cap([t])[0] else 0.0
                  for t in args.buckets}
    for t in args.buckets:
        b = int(budget.cap([t])[0])
        peak = checks[t]
        sb, strials, speak = search[t]
        rows.append({"T": t, "varlen_B": b, "varlen_use": peak / limit, "search_B": sb, "search_use": speak / limit,
                     "search_trials": strials})
    return {"calib_seconds": calib_seconds, "calib_trials": len(profile["points"]), "search_seconds": search_seconds,
            "fit_error": profile["fit_error"], "points": profile["points"], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks.tiny_models:lm_4k")
    ap.add_argument("--max-memory", default="640MiB")
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--buckets", default="64,128,256,512")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    args.buckets = [int(x) for x in args.buckets.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        runs = [one_run(args, workdir, r) for r in range(args.runs)]
    last = runs[-1]
    print(f"command: python benchmarks/bench_calibrate.py {' '.join(sys.argv[1:])}")
    print(f"load average: {os.getloadavg()[0]:.1f}")
    med = {k: statistics.median(r[k] for r in runs) for k in ("calib_seconds", "search_seconds")}
    print(f"\ncalibration: {med['calib_seconds']:.1f} s median of {args.runs} ({last['calib_trials']} shapes); "
          f"trial-and-error search of {len(args.buckets)} buckets: {med['search_seconds']:.1f} s median "
          f"(ratio search / calibration: {med['search_seconds'] / med['calib_seconds']:.2f}x)")
    e = last["fit_error"]
    print(f"\nfit error (last run): held-out max {100 * e['heldout_max_abs_rel']:.1f}%, mean "
          f"{100 * e['heldout_mean_abs_rel']:.1f}%, fitting points max {100 * e['fit_max_abs_rel']:.1f}%")
    print("\n| B | T | measured | predicted | error | held out |\n|---|---|---|---|---|---|")
    for p in last["points"]:
        print(f"| {p['batch_size']} | {p['seqlen']} | {p['peak_bytes'] / 2**20:.1f} MiB | "
              f"{p['predicted_bytes'] / 2**20:.1f} MiB | {100 * p['relative_error']:+.1f}% | "
              f"{'yes' if p['heldout'] else ''} |")
    print("\n| bucket T | varlen B | varlen budget use | search B | search budget use | search trials |"
          "\n|---|---|---|---|---|---|")
    for r in last["rows"]:
        print(f"| {r['T']} | {r['varlen_B']} | {100 * r['varlen_use']:.1f}% | {r['search_B']} | "
              f"{100 * r['search_use']:.1f}% | {r['search_trials']} |")
    total = sum(r["search_trials"] for r in last["rows"])
    mean_v = statistics.mean(r["varlen_use"] for r in last["rows"])
    mean_s = statistics.mean(r["search_use"] for r in last["rows"])
    over = sum(r["varlen_use"] > 1 for r in last["rows"])
    print(f"\ntrial steps: varlen {last['calib_trials']} (calibration, any number of buckets) vs search {total} "
          f"({len(args.buckets)} buckets); mean budget use varlen {100 * mean_v:.1f}% vs search {100 * mean_s:.1f}%; "
          f"varlen shapes over the limit: {over}")


if __name__ == "__main__":
    main()
