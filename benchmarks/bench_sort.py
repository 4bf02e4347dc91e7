"""Benchmark ``varlen sort`` end to end (read, sort, write) against a single-process reference.

For each row count it writes a metrics directory (Zipf-distributed integer lengths, difficulty =
length, like ``varlen analyze`` makes), then, in fresh processes, alternating, ``--repeat`` times:

* ``ref-lexsort``: read the directory with pyarrow, ``np.lexsort((sample_id, difficulty))``, take
  the columns, write one Parquet file (zstd level 1, 1M-row row groups, as varlen writes);
* ``ref-packed``: the same with one packed int64 key (difficulty << 32 | sample_id) and
  ``np.argsort``, the fastest obvious single-process script;
* ``varlen sort --nproc W`` for each W in ``--workers``; ``W:torch`` runs the same with
  ``VARLEN_LAUNCHER=torch`` (torch's elastic launcher and a gloo group, what varlen used before its
  torch-free local group), as the same-run reference for the launcher's fixed cost.

It prints median wall seconds (the whole command, interpreter and torch start included), the
seconds inside the stage as varlen reports them, rows/s, the ratio to the best reference, and peak
RSS per worker from the OS (``ru_maxrss``) against the worker's share of the data's in-memory size
(24 bytes a row). Optional: ``--deepspeed-python PY`` times DeepSpeed's ``sample_sort`` on the same
keys with one rank (see ``bench_sort_deepspeed.py`` beside this file).

    python benchmarks/bench_sort.py --rows 10000000,50000000 --workers 1,2 --repeat 3
    python benchmarks/bench_sort.py --rows 30000000 --workers 1,2,2:torch --refs "" --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

REFERENCE = r'''
import json, os, resource, sys, time
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
src, dst, how = sys.argv[1:4]
t0 = time.perf_counter()
table = pq.read_table(src)
ids = table.column("sample_id").to_numpy()
diff = table.column("difficulty").to_numpy()
if how == "lexsort":
    order = np.lexsort((ids, diff))
else:  # packed: integral difficulty < 2**31 and sample_id < 2**32 fit one int64
    order = np.argsort((diff.astype(np.int64) << 32) | ids)
out = pa.table({name: pa.array(table.column(name).to_numpy()[order]) for name in table.column_names})
del table
pq.write_table(out, dst, row_group_size=1 << 20, compression="zstd", compression_level=1)
secs = time.perf_counter() - t0
t = os.times()
print(json.dumps({"seconds": secs, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "cpu": [t.user + t.system]}))
'''


def make_metrics(path: str, rows: int, parts: int, seed: int = 0) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, ROOT)
    from varlen_cli.runtime import artifacts

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries = []
    for k in range(parts):
        a, b = artifacts.row_bounds(rows, parts, k)
        lengths = np.minimum(rng.zipf(1.3, b - a), 100_000).astype(np.int64)
        table = pa.table({"sample_id": np.arange(a, b, dtype=np.int64), "length": lengths,
                          "difficulty": lengths.astype(np.float64)})
        pq.write_table(table, os.path.join(path, artifacts.part_name(k)), row_group_size=1 << 20,
                       compression="zstd", compression_level=1)
        entries.append({"file": artifacts.part_name(k), "rows": b - a})
    manifest = {"format": artifacts.METRICS_FORMAT, "format_version": 1, "kind": "metrics", "stage": "analyze",
                "config": {"bench": True}, "world_size": parts,
                "dataset": {"digest": f"bench-{rows}-{seed}", "root": "/", "num_files": 0, "num_rows": rows,
                            "files": []},
                "artifact_id": f"bench-{rows}-{seed}", "order": {"by": ["sample_id"], "descending": False},
                "columns": {"sample_id": "int64", "length": "int64", "difficulty": "float64"},
                "num_rows": rows, "parts": entries, "stats": {}}
    with open(os.path.join(path, artifacts.MANIFEST_NAME), "w") as fh:
        json.dump(manifest, fh)


def run_reference(src: str, dst: str, how: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", REFERENCE, src, dst, how], check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return {"wall": wall, "stage": info["seconds"], "peak_rss": [info["peak_rss"]], "cpu": info["cpu"]}


def run_varlen(src: str, dst: str, workers: str, extra: list) -> dict:
    nproc, _, launcher = workers.partition(":")
    cmd = [sys.executable, "-m", "varlen_cli", "sort", src, "-o", dst, "--nproc", nproc, "--overwrite",
           "--no-progress", *extra]
    env = dict(os.environ, VARLEN_NO_PROGRESS="1", VARLEN_LAUNCHER=launcher or "auto")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    with open(os.path.join(dst, "_manifest.json")) as fh:
        m = json.load(fh)
    return {"wall": wall, "stage": sum(m["seconds"].values()), "peak_rss": m["peak_rss_bytes"], "cpu": m["cpu_seconds"],
            "balance": m["balance"], "phases": m["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="10000000,50000000", help="comma-separated row counts")
    ap.add_argument("--workers", default="1,2",
                    help="comma-separated --nproc values; W:torch = W workers under torch's elastic launcher")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each variant (medians are reported)")
    ap.add_argument("--parts", type=int, default=4, help="parts of the generated metrics directory")
    ap.add_argument("--workdir", default=None, help="where to put the data (default: a temporary directory)")
    ap.add_argument("--extra", default="", help="extra arguments for varlen sort, e.g. '--ties shuffle'")
    ap.add_argument("--json", default=None, help="also write the raw results to this JSON file")
    ap.add_argument("--refs", default="ref-lexsort,ref-packed",
                    help="references to run ('' for none: the first --workers variant is then the reference)")
    args = ap.parse_args()

    rows_list = [int(float(x)) for x in args.rows.split(",")]
    workers = args.workers.split(",")
    work = args.workdir or tempfile.mkdtemp(prefix="varlen-bench-sort-")
    print("command: python " + " ".join(sys.argv))
    print(f"machine: {os.cpu_count()} cores; {os.uname().sysname} {os.uname().release}; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    raw = {}
    try:
        for rows in rows_list:
            src = os.path.join(work, f"metrics-{rows}")
            if not os.path.exists(os.path.join(src, "_manifest.json")):
                make_metrics(src, rows, args.parts)
            refs = [r for r in args.refs.split(",") if r]
            variants = [(r, None) for r in refs] + [
                (f"varlen nproc={w.split(':')[0]}" + (" (torch launcher)" if ":" in w else ""), w) for w in workers]
            results = {name: [] for name, _ in variants}
            loads = []
            for _ in range(args.repeat):
                loads.append(os.getloadavg()[0])
                for name, w in variants:
                    dst = os.path.join(work, "out-ref.parquet" if w is None else "out-varlen")
                    if w is None:
                        results[name].append(run_reference(src, dst, name.split("-")[1]))
                    else:
                        results[name].append(run_varlen(src, dst, w, args.extra.split()))
            raw[rows] = results
            share_bytes = 24 * rows
            best_ref = min(statistics.median(r["wall"] for r in results[n]) for n in (refs or [variants[0][0]]))
            print(f"\n## {rows:,} rows ({share_bytes / 2**20:,.0f} MiB in memory), medians of {args.repeat}; "
                  f"load average {min(loads):.1f}-{max(loads):.1f}; reference: {', '.join(refs or [variants[0][0]])}")
            print("| variant | wall s | stage s | rows/s (wall) | vs best ref | CPU s (sum / max worker) | "
                  "peak RSS / worker MiB | RSS / share | balance |")
            print("|---|---|---|---|---|---|---|---|---|")
            for name, w in variants:
                rs = results[name]
                wall = statistics.median(r["wall"] for r in rs)
                stage = statistics.median(r["stage"] for r in rs)
                peak = max(max(p for p in r["peak_rss"] if p) for r in rs)
                share = share_bytes / int((w or "1").split(":")[0])
                bal = f"{rs[0]['balance']:.4f}" if "balance" in rs[0] else "-"
                cpu_sum = statistics.median(sum(r["cpu"]) for r in rs)
                cpu_max = statistics.median(max(r["cpu"]) for r in rs)
                print(f"| {name} | {wall:.2f} | {stage:.2f} | {rows / wall:,.0f} | {wall / best_ref:.2f}x | "
                      f"{cpu_sum:.1f} / {cpu_max:.1f} | {peak / 2**20:,.0f} | {peak / share:.2f} | {bal} |")
            for name, w in variants:
                if w is not None:
                    ph = {k: round(statistics.median(r["phases"][k] for r in results[name]), 2)
                          for k in results[name][0]["phases"]}
                    print(f"phases {name}: {ph}")
    finally:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(raw, fh, indent=1, default=str)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
