"""Run a command and report its wall time and the peak resident memory of its whole process tree.

    python benchmarks/treepeak.py -- varlen plan M -o P.parquet --max-tokens 16384 --nproc 2

The tree (the command and every descendant, found through /proc/PID/task/*/children) is sampled
every ``--interval`` seconds (0.05); its resident memory is the sum of VmRSS over the live
processes of a sample, the peak the largest sum. Linux only, no dependencies. Prints one JSON
line: ``{"seconds", "peak_rss_bytes", "peak_rss_gib", "samples", "rc", "load_avg"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    out += [int(x) for x in fh.read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(root: int) -> int:
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += rss(pid)
        todo += children(pid)
    return total


def run(cmd: list[str], interval: float = 0.05, env: dict | None = None) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    peak, samples = 0, 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        samples += 1
        time.sleep(interval)
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 2), "peak_rss_bytes": peak, "peak_rss_gib": round(peak / 2**30, 3),
            "samples": samples, "rc": proc.returncode, "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        sys.exit("give a command after --")
    print(json.dumps({"cmd": " ".join(cmd), **run(cmd, args.interval)}))


if __name__ == "__main__":
    main()
