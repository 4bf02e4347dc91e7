"""Benchmark ``varlen report``: seconds and peak memory against the plan's size (issue 35: bounded in
memory on a 1B-sample plan, read in windows as ``varlen inspect`` does).

    PYTHONPATH=. python benchmarks/bench_report.py --samples 1000000 10000000 --dp 8 --repeats 3

For each size: synthetic lognormal lengths written as a metrics directory, one padded plan (``--dp``,
``--max-tokens``), then, each in a fresh process, timed and with its peak resident memory (the
child's ``ru_maxrss``): ``varlen report PLAN -o r.html``, ``varlen report --format png``,
``varlen inspect PLAN --json`` (the same reading code, no drawing) and, as the peer that reads
the whole plan, ``pyarrow.parquet.read_table(PLAN)``. Medians of ``--repeats`` runs. Then the
reading alone (``inspect_artifact``, what the report draws from) in a fresh process: its peak
Python/numpy allocations (tracemalloc) and Arrow allocations (a proxy memory pool), bounded by one
window of the plan (``checks/scan.py``: up to 2^21 sample entries of rows) and the buckets. Memory
flat in the samples (and far below the whole-plan read) is the claim; the plan's sample ids alone
take 8 bytes a sample.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# A small fresh interpreter starts the command and reports its peak RSS: a child forked from this
# process (which planned 10M samples) would count this process's memory as its own until it execs.
WRAPPER = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
           "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
           "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")


def run_child(args: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command in a fresh process."""
    out = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"{args} failed: {out.stderr[-2000:]}")
    seconds, rss = out.stdout.split()
    return float(seconds), float(rss)


# The reading part alone, in a fresh process (its second read: imports not counted): Python/numpy allocations
# (tracemalloc) and Arrow's (a proxy pool: its peak over both reads).
PEAKS = ("import sys, tracemalloc, pyarrow as pa; pool = pa.proxy_memory_pool(pa.default_memory_pool()); "
         "pa.set_memory_pool(pool); from varlen_cli.inspect import InspectConfig, inspect_artifact; "
         "inspect_artifact(InspectConfig(sys.argv[1]))  # once: the modules it imports are not counted\n"
         "tracemalloc.start(); inspect_artifact(InspectConfig(sys.argv[1])); "
         "print(tracemalloc.get_traced_memory()[1] / 2**20, pool.max_memory() / 2**20)")


def reading_peaks(path: str) -> tuple[float, float]:
    """(Python MiB, Arrow MiB): the peaks of reading the plan as ``varlen report`` does."""
    out = subprocess.run([sys.executable, "-c", PEAKS, path], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    python, arrow = out.stdout.split()
    return float(python), float(arrow)


def make_plan(folder: str, samples: int, dp: int, max_tokens: int) -> str:
    sys.path.insert(0, HERE)
    from bench_plan import write_metrics_dir

    from varlen_cli.plan import PlanConfig, plan

    lengths = np.clip(np.random.default_rng(0).lognormal(5.5, 1.0, samples).astype(np.int64) + 1, 1, max_tokens)
    metrics = write_metrics_dir(os.path.join(folder, f"m{samples}"), lengths)
    out = os.path.join(folder, f"plan{samples}.parquet")
    t0 = time.perf_counter()
    plan(PlanConfig(input=metrics, output=out, max_tokens=max_tokens, dp=dp, lr_scaling="linear",
                    lr_scale_by="samples", overwrite=True, progress=False))
    print(f"# planned {samples:,} samples in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    py = sys.executable
    print(f"# {' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}; load {os.getloadavg()[0]:.1f}")
    print("| samples | microbatches | steps | plan MiB | command | seconds (median) | peak RSS MiB (median) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="varlen-bench-report-") as folder:
        for samples in args.samples:
            path = make_plan(folder, samples, args.dp, args.max_tokens)
            import pyarrow.parquet as pq

            md = pq.ParquetFile(path).metadata
            rows, steps = md.num_rows, md.num_rows // args.dp
            commands = {
                "varlen report": [py, "-m", "varlen_cli", "report", path, "-o", os.path.join(folder, "r.html"),
                                  "--overwrite"],
                "varlen report --format png": [py, "-m", "varlen_cli", "report", path, "-o",
                                               os.path.join(folder, "r.png"), "--format", "png", "--overwrite"],
                "varlen inspect --json": [py, "-m", "varlen_cli", "inspect", path, "--json"],
                "peer: pq.read_table(plan)": [py, "-c", f"import pyarrow.parquet as pq; pq.read_table({path!r})"],
            }
            for name, command in commands.items():
                runs = [run_child(command) for _ in range(args.repeats)]
                print(f"| {samples:,} | {rows:,} | {steps:,} | {os.path.getsize(path) / 2**20:,.1f} | {name} | "
                      f"{statistics.median(r[0] for r in runs):.2f} | {statistics.median(r[1] for r in runs):,.0f} |",
                      flush=True)
            python, arrow = reading_peaks(path)
            print(f"| {samples:,} | {rows:,} | {steps:,} | {os.path.getsize(path) / 2**20:,.1f} | reading the plan "
                  f"(inspect_artifact): Python peak {python:.1f} MiB, Arrow peak {arrow:.1f} MiB | | |", flush=True)


if __name__ == "__main__":
    main()
