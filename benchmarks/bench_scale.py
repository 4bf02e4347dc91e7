"""Plans at scale (issue 25): analyze, plan and validate of generated heavy-tailed lengths at 100M-1B.

    python benchmarks/bench_scale.py --samples 100000000 --work /work/bench-data/s100m --nproc 1,2
    python benchmarks/bench_scale.py --samples 1000000000 --work /work/bench-data/s1b --nproc 2 --repeats 1
    python benchmarks/bench_scale.py --samples 10000000 --work /work/bench-data/s10m --nproc 1,2 --reference

For each step the whole command runs in a fresh process under ``benchmarks/treepeak.py``: wall seconds
and the peak resident memory of its whole process tree (launcher and workers together), with the load
average before and after and a same-run machine reference (``np.sort`` of 10M random int64 in a fresh
process, ~0.6 s on an idle core of the development VM). Steps:

* ``generate`` (once, kept in WORK/src): ``benchmarks/gen_lengths.py`` (lognormal body, Pareto tail);
* ``analyze``: ``varlen analyze WORK/src -o WORK/metrics --nproc P`` (P = the largest of --nproc);
* ``plan``: per configuration and per --nproc, ``varlen plan WORK/metrics -o WORK/plan-CFG-P.parquet``:
  ``padded`` = bucket-shuffle ``--max-tokens 16384 --dp 64 --drop-long``, ``packed`` =
  ``--packing --seq-len 8192 --split-long --dp 64``; its quality from the plan's statistics;
* ``validate``: ``varlen validate`` of each plan made with the largest --nproc;
* ``--reference``: the same plans as one chunk (``--chunk-samples`` > N, the single-process planner),
  for the quality comparison (10M: the issue's reference).

Plans made by different --nproc are compared byte for byte (``--compare``). Medians of --repeats
runs; the plans of one configuration take turns (--nproc 1, 2, 1, 2, ...) and the speed-up is the
median of each turn's ratio, so that the shared machine's changing load falls on both alike.
Prints one JSON line per run and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.treepeak import run as treepeak  # noqa: E402

CONFIGS = {
    "padded": ["--max-tokens", "16384", "--dp", "64", "--drop-long"],
    "packed": ["--packing", "--seq-len", "8192", "--split-long", "--dp", "64"],
}
REF = ("import numpy as np, time; a = np.random.default_rng(0).integers(0, 2**62, 10_000_000); "
       "t = time.perf_counter(); np.sort(a); print(time.perf_counter() - t)")


def reference() -> float:
    out = subprocess.run([sys.executable, "-c", REF], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def varlen(*args: str) -> list[str]:
    return [sys.executable, "-m", "varlen_cli", *args]


def timed(name: str, cmd: list[str], repeats: int) -> dict:
    return timed_together([(name, cmd)], repeats)[0]


def timed_together(steps: list[tuple[str, list[str]]], repeats: int) -> list[dict]:
    """Each ``(name, cmd)`` run ``repeats`` times, the steps taking turns (1, 2, 1, 2, ...), so that a
    change of the shared machine's load falls on all of them alike; medians per step."""
    env = dict(os.environ, VARLEN_NO_PROGRESS="1")
    runs: dict = {name: [] for name, _ in steps}
    for _ in range(repeats):
        for name, cmd in steps:
            ref = reference()
            r = treepeak(cmd, env=env)
            r["ref_s"] = round(ref, 3)
            if r["rc"] != 0:
                raise SystemExit(f"{name} failed ({r['rc']}): {' '.join(cmd)}")
            print(json.dumps({"step": name, **r}), flush=True)
            runs[name].append(r)
    out = []
    for name, cmd in steps:
        rs = runs[name]
        out.append({"step": name, "cmd": " ".join(cmd[2:]), "runs": rs,
                    "seconds": statistics.median(r["seconds"] for r in rs),
                    "peak_gib": statistics.median(r["peak_rss_gib"] for r in rs),
                    "ref_s": statistics.median(r["ref_s"] for r in rs),
                    "load": [rs[0]["load_avg"][0], rs[-1]["load_avg"][1]]})
    return out


def plan_stats(path: str) -> dict:
    import pyarrow.parquet as pq

    meta = json.loads(pq.read_schema(path).metadata[b"varlen"])
    s = meta["stats"]
    out = {"steps": s["steps"], "microbatches": s["microbatches"], "padding_pct": s["padding_pct"],
           "budget_fill_pct": s["budget_fill_pct"], "straggler_mean": s["straggler_mean"],
           "straggler_max": s["straggler_max"], "dropped": s["dropped"]}
    if meta.get("packing"):
        out["efficiency_pct"] = 100 * meta["packing"]["efficiency"]
    return out


def same_plan(a: str, b: str) -> bool:
    """Whether two plan files are the same bytes (a plan records no time, host or worker count)."""
    import filecmp

    return filecmp.cmp(a, b, shallow=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--configs", default="padded,packed")
    ap.add_argument("--steps", default="generate,analyze,plan,validate")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--reference", action="store_true", help="also plan as one chunk (quality reference)")
    ap.add_argument("--compare", action="store_true", help="compare the plans of the different --nproc")
    args = ap.parse_args()
    nprocs = [int(x) for x in args.nproc.split(",")]
    steps = args.steps.split(",")
    os.makedirs(args.work, exist_ok=True)
    src, metrics = os.path.join(args.work, "src"), os.path.join(args.work, "metrics")
    results = []
    if "generate" in steps and not os.path.isdir(src):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gen_lengths.py"), "-o", src, "--samples",
                        str(args.samples), "--jobs", "2"], check=True)
        print(json.dumps({"step": "generate", "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    if "analyze" in steps:
        results.append(timed("analyze", varlen("analyze", src, "-o", metrics, "--nproc", str(max(nprocs)),
                                               "--overwrite", "--no-progress"), args.repeats))
    for cfg in args.configs.split(","):
        if "plan" in steps:
            variants = [(p, []) for p in nprocs] + ([("ref", ["--chunk-samples", str(args.samples + 1)])]
                                                    if args.reference else [])
            steps_ = []
            for p, extra in variants:
                out = os.path.join(args.work, f"plan-{cfg}-{p}.parquet")
                nproc = ["--nproc", str(p)] if p != "ref" else []
                steps_.append((f"plan {cfg} nproc {p}", varlen("plan", metrics, "-o", out, *CONFIGS[cfg], *nproc,
                                                              *extra, "--overwrite", "--no-progress")))
            for (p, _), r in zip(variants, timed_together(steps_, args.repeats)):
                r.update(plan_stats(os.path.join(args.work, f"plan-{cfg}-{p}.parquet")))
                results.append(r)
            if len(nprocs) > 1:  # the speed-up of each turn (same load), and its median
                one, many = (next(r for r in results[-len(variants):] if r["step"] == f"plan {cfg} nproc {p}")
                             for p in (nprocs[0], nprocs[-1]))
                ratios = [a["seconds"] / b["seconds"] for a, b in zip(one["runs"], many["runs"])]
                print(json.dumps({"speedup": cfg, "nproc": [nprocs[0], nprocs[-1]],
                                  "per_turn": [round(x, 3) for x in ratios],
                                  "median": round(statistics.median(ratios), 3)}), flush=True)
            if args.compare and len(nprocs) > 1:
                base = os.path.join(args.work, f"plan-{cfg}-{nprocs[0]}.parquet")
                for p in nprocs[1:]:
                    same = same_plan(base, os.path.join(args.work, f"plan-{cfg}-{p}.parquet"))
                    print(json.dumps({"compare": cfg, "nproc": [nprocs[0], p], "same": same}), flush=True)
        if "validate" in steps:
            out = os.path.join(args.work, f"plan-{cfg}-{max(nprocs)}.parquet")
            results.append(timed(f"validate {cfg}", varlen("validate", out), args.repeats))
    print("\n| step | seconds | peak tree RSS GiB | np.sort ref s | load | quality |")
    print("|---|---:|---:|---:|---|---|")
    for r in results:
        q = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
             if k in ("padding_pct", "budget_fill_pct", "straggler_mean", "efficiency_pct", "microbatches")}
        print(f"| {r['step']} | {r['seconds']:.1f} | {r['peak_gib']:.2f} | {r['ref_s']:.2f} | "
              f"{r['load'][0]:.1f}-{r['load'][1]:.1f} | {json.dumps(q) if q else ''} |")


if __name__ == "__main__":
    main()
