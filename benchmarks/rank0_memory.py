"""Where rank 0's memory goes in phases 2 and 3 of a chunked plan (issue 25).

    python benchmarks/rank0_memory.py METRICS -o PLAN.parquet --spill DIR [plan options as for varlen plan]

Phase 1 (forming the chunks) runs once into ``--spill DIR``, which is kept, so later runs start at
phase 2 from the same chunk files. Phases 2 and 3 then run in this process with ``tracemalloc``
(numpy reports its buffers to it) and a thread sampling this process's resident memory every 10 ms,
with freed memory kept for reuse as ``varlen plan`` keeps it (``plan/heap.py``).
Each step (loading the tables, concatenating them, the tail, the order across chunks, the ranks,
finish, the writer) is timed and its peaks reported: the tracemalloc peak during the step, what
tracemalloc holds after it, and the peak RSS during it. Prints a table and one JSON line.

Options after the three above are ``varlen plan``'s (``--packing --seq-len 8192 --split-long --dp 64``
or ``--max-tokens 16384 --dp 64 --drop-long``). The plan written is ``varlen plan``'s own bytes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import threading
import time
import tracemalloc


class Sampler:
    """Peak RSS and tracemalloc peak per labelled step."""

    def __init__(self):
        self.label = "start"
        self.rows: list[dict] = []
        self._peak_rss = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t = time.perf_counter()
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self._page

    def _run(self):
        while not self._stop.wait(0.01):
            self._peak_rss = max(self._peak_rss, self.rss())

    def step(self, label: str) -> None:
        """Close the current step, start ``label``."""
        now = time.perf_counter()
        current, peak = tracemalloc.get_traced_memory()
        self.rows.append({"step": self.label, "seconds": round(now - self._t, 2), "traced_peak": peak,
                          "traced_after": current, "rss_peak": max(self._peak_rss, self.rss()),
                          "rss_after": self.rss()})
        tracemalloc.reset_peak()
        self._peak_rss = self.rss()
        self.label, self._t = label, now

    def stop(self):
        self.step("end")
        self._stop.set()


def wrap(module, name: str, sampler: Sampler, label: str):
    """Make ``module.name`` a labelled step (nested calls: the outer label resumes after)."""
    fn = getattr(module, name)

    @functools.wraps(fn)
    def inner(*a, **k):
        outer = sampler.label
        sampler.step(label)
        try:
            return fn(*a, **k)
        finally:
            sampler.step(outer + "'")

    setattr(module, name, inner)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--spill", required=True, help="chunk files of phase 1 (made once, kept)")
    args, rest = ap.parse_known_args(argv)

    from varlen_cli.plan import config as pc
    from varlen_cli.plan import tail
    from varlen_cli.plan.chunked import emit, epoch, run, spill
    from varlen_cli.plan.chunked.chunks import ChunkSpec
    from varlen_cli.plan.chunked.output import PlanOutput
    from varlen_cli.plan.progress import PlanProgress
    from varlen_cli.runtime.dist import Dist

    c = pc.PlanConfig(input=args.input, output=args.output, overwrite=True, progress=False,
                      **_options(rest))
    pc.check(c)
    plan_input = run.FRESH.open(c)
    spec = ChunkSpec(plan_input.num_rows, int(c.chunk_samples))
    d = Dist()
    t0 = time.perf_counter()
    ctx = run.context(c, plan_input, spec, d)
    with PlanProgress(False, c.epochs) as bar:
        if not os.path.exists(os.path.join(args.spill, "done")):
            os.makedirs(args.spill, exist_ok=True)
            plan_input.prepare(spec, args.spill, d, c.order not in ("curriculum", "reverse"))
            run._phase1(c, ctx, plan_input, spec, d, args.spill, bar)
            open(os.path.join(args.spill, "done"), "w").close()
            print(f"phase 1: {time.perf_counter() - t0:.1f} s into {args.spill}", flush=True)
        run._trim()
        from varlen_cli.plan.heap import reuse_freed_memory  # as `varlen plan` runs (cli/plan.py)

        heap = reuse_freed_memory()
        heap.__enter__()
        tracemalloc.start()
        s = Sampler()
        wrap(spill, "read_table", s, "read tables")
        wrap(epoch, "_concat", s, "concat")
        wrap(tail, "fix", s, "tail")
        wrap(epoch, "cross_chunk_order", s, "cross-chunk order")
        wrap(epoch, "_ranks", s, "ranks (layout)")
        wrap(run, "finish", s, "finish")
        wrap(emit, "write", s, "write")
        from varlen_cli import checks

        wrap(checks.PlanChecks, "results", s, "write: plan check results")
        t1 = time.perf_counter()
        run._phase23(c, ctx, plan_input, spec, args.spill, PlanOutput(c.output, True), t0, bar)
        s.stop()
        heap.__exit__(None, None, None)
    total = time.perf_counter() - t1
    print(f"{'step':<22} {'s':>6} {'traced peak MB':>15} {'traced after MB':>16} {'RSS peak MB':>12} "
          f"{'RSS after MB':>13}")
    for r in s.rows:
        print(f"{r['step']:<22} {r['seconds']:>6} {r['traced_peak'] / 1e6:>15.0f} {r['traced_after'] / 1e6:>16.0f} "
              f"{r['rss_peak'] / 1e6:>12.0f} {r['rss_after'] / 1e6:>13.0f}")
    print(json.dumps({"seconds_phase23": round(total, 1),
                      "traced_peak": max(r["traced_peak"] for r in s.rows),
                      "rss_peak": max(r["rss_peak"] for r in s.rows), "steps": s.rows}))


def _options(rest: list[str]) -> dict:
    """``--name value`` / ``--flag`` pairs as PlanConfig fields (ints where they parse)."""
    out, i = {}, 0
    while i < len(rest):
        name = rest[i].lstrip("-").replace("-", "_")
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            value = rest[i + 1]
            out[name] = int(value) if value.lstrip("-").isdigit() else value
            i += 2
        else:
            out[name] = True
            i += 1
    return out


if __name__ == "__main__":
    main()
