"""Fixed cost of ``--nproc 2``: what a 2-worker ``varlen sort`` pays before and around its work.

For each launcher (``local``: varlen's torch-free local group, the default on the CPU; ``torch``:
torch's elastic launcher and a gloo group, ``VARLEN_LAUNCHER=torch``, what ``--device cuda`` uses),
in a fresh process (``--repeats`` times, medians): seconds to import what the launcher needs
(torch.distributed and the elastic launcher for ``torch``; nothing more for ``local``), then
``run_distributed`` of an empty stage on 2 forked workers: when the workers run their first line,
when their process group is ready, after one barrier, and the whole launch until rank 0's result
is back. Reference in the same process: importing numpy and pyarrow.parquet (what every command
imports).

    python benchmarks/bench_launch.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import numpy, pyarrow.parquet
t1 = time.perf_counter()
os.environ.setdefault("VARLEN_START_METHOD", "fork")
from varlen_cli.runtime.dist import run_distributed, session
if os.environ["VARLEN_LAUNCHER"] == "torch":
    import torch.distributed
    from torch.distributed.launcher.api import elastic_launch
t2 = time.perf_counter()

def entry(start):
    t_in = time.perf_counter()
    with session("cpu") as d:
        t_pg = time.perf_counter()
        d.barrier()
        t_b = time.perf_counter()
    return t_in - start, t_pg - start, t_b - start

t3 = time.perf_counter()
first, ready, barrier = run_distributed(entry, t3, 2)
t4 = time.perf_counter()
print(json.dumps({"import numpy+pyarrow": t1 - t0, "import the launcher": t2 - t1,
                  "workers running": first, "process group ready": ready, "after a barrier": barrier,
                  "launch total": t4 - t3}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), VARLEN_NO_PROGRESS="1")
    runs, loads = {"local": [], "torch": []}, []
    for _ in range(args.repeats):
        for launcher, got in runs.items():  # interleaved, so both see the same load
            loads.append(os.getloadavg()[0])
            out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                                 env=dict(env, VARLEN_LAUNCHER=launcher))
            got.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"# python benchmarks/bench_launch.py --repeats {args.repeats}; {os.cpu_count()} CPUs, load average "
          f"{min(loads):.1f}-{max(loads):.1f}; medians, seconds")
    print("| what | local group | torch elastic + gloo |")
    print("|---|---:|---:|")
    for key in runs["local"][0]:
        print(f"| {key} | {statistics.median(r[key] for r in runs['local']):.3f} | "
              f"{statistics.median(r[key] for r in runs['torch']):.3f} |")


if __name__ == "__main__":
    main()
