"""Compute-balanced packed plans (issue 17): the straggler in the attention-aware cost, before and after.

A packed row costs its tokens plus ``A x sum(l_i^2)`` over its segments. For each row length T and
dp it plans the same corpus (long documents mixed with many short samples, ``--split-long``) with

* ``before``: ``--attention-cost 0`` (today's plan: rows spread evenly, ranks balanced on tokens),
  measured in the attention-aware cost;
* ``round-robin`` / ``lpt``: the same plan's rows, each step's rows re-dealt to its dp x grad-accum
  microbatches by a sorted round-robin deal (rows by decreasing cost, row i to microbatch i mod M) or
  a greedy longest-processing-time deal (largest row onto the least-loaded microbatch with room),
  then ranks by the planner's LPT: what dealing inside today's steps can do;
* ``after``: ``--attention-cost A`` (varlen_cli.plan.balance: rows dealt across the epoch, steps
  chosen from microbatches of like cost, ranks by LPT).

Printed per case: steps, straggler mean / max and the overhead sum(max)/sum(mean) - 1 in the
attention-aware cost, the worst step other than an epoch's last, packing efficiency vs the
whole-step bound (ceil(tokens / T) rows rounded up to a multiple of dp x grad-accum), and planning
seconds (median of ``--repeat``).

The corpus (``corpus()``): manual pages of this machine (``/usr/share/man``, bytes / 4 as tokens;
a lognormal stand-in when absent) for 40% of the tokens, short fortune-like samples (lognormal,
median ~90 tokens) for 35%, and a synthetic long tail log-uniform in [T/4, 4T] for 25%; about
``--steps`` steps at each dp (grad-accum 1; 1/grad-accum as many with grad-accum).

    PYTHONPATH=. python benchmarks/bench_balance.py --seq-len 4096,16384,65536 --dp 8,64 --repeat 3
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

A_SMALL = 1 / (2 * 12_800)


def man_lengths(cache: str) -> np.ndarray:
    """Token estimates (bytes / 4) of the manual pages under /usr/share/man, cached as .npy."""
    path = os.path.join(cache, "man_lengths.npy")
    if os.path.exists(path):
        return np.load(path)
    out = []
    for root, _, files in os.walk("/usr/share/man"):
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p):
                continue
            try:
                if f.endswith(".gz"):
                    with gzip.open(p, "rb") as fh:
                        out.append(len(fh.read()))
                else:
                    out.append(os.path.getsize(p))
            except OSError:
                continue
    lengths = np.maximum(1, np.asarray(out, dtype=np.int64) // 4)
    if len(lengths) < 1000:  # no manual pages here: a stand-in with their shape (median ~800, long tail)
        lengths = np.maximum(1, np.random.default_rng(7).lognormal(6.7, 1.1, 20_000)).astype(np.int64)
    os.makedirs(cache, exist_ok=True)
    np.save(path, lengths)
    return lengths


def corpus(seq_len: int, steps: int, man: np.ndarray, seed: int = 0) -> np.ndarray:
    """Sample lengths: 40% of the tokens manual pages, 35% short samples, 25% long tail [T/4, 4T]."""
    rng = np.random.default_rng(seed)
    total = steps * 8 * seq_len

    def take(draw, tokens):
        parts, have = [], 0
        while have < tokens:
            x = draw(max(16, int((tokens - have) / 500)))
            parts.append(x)
            have += int(x.sum())
        x = np.concatenate(parts)
        return x[: int(np.searchsorted(np.cumsum(x), tokens)) + 1]

    pages = take(lambda k: man[rng.integers(0, len(man), k)], 0.40 * total)
    short = take(lambda k: np.maximum(1, rng.lognormal(4.5, 1.0, k)).astype(np.int64), 0.35 * total)
    lo, hi = np.log(seq_len / 4), np.log(4 * seq_len)
    long = take(lambda k: np.exp(rng.uniform(lo, hi, k)).astype(np.int64), 0.25 * total)
    x = np.concatenate([pages, short, long])
    return x[rng.permutation(len(x))]


def plan_once(metrics: str, out: str, seq_len: int, dp: int, grad_accum: int, attention: float):
    from varlen_cli.plan import PlanConfig, plan

    t0 = time.perf_counter()
    res = plan(PlanConfig(input=metrics, output=out, dp=dp, grad_accum=grad_accum, packing=True, seq_len=seq_len,
                          split_long=True, attention_cost=attention, overwrite=True))
    return res, time.perf_counter() - t0


def read_rows(path: str, attention: float):
    """Per microbatch: step, rank, epoch; per row: microbatch and attention-aware cost."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["step", "rank", "epoch", "sample_lengths", "sample_rows"])
    lens = t.column("sample_lengths").combine_chunks()
    flat = pc.list_flatten(lens).to_numpy().astype(np.float64)
    parent = pc.list_parent_indices(lens).to_numpy()
    local = pc.list_flatten(t.column("sample_rows").combine_chunks()).to_numpy().astype(np.int64)
    key = parent * (int(local.max()) + 1) + local
    uniq, row = np.unique(key, return_inverse=True)
    cost = np.bincount(row, weights=flat + attention * flat * flat)
    return (t.column("step").to_numpy(), t.column("rank").to_numpy(), t.column("epoch").to_numpy(),
            uniq // (int(local.max()) + 1), cost)


def redeal(step, mb_of_row, cost, dp: int, grad_accum: int, how: str):
    """Rows of each step re-dealt to the step's microbatches (same row counts), ranks by the planner's LPT."""
    from varlen_cli.plan.layout import assign_ranks

    slots = dp * grad_accum
    m = len(step)
    counts = np.bincount(mb_of_row, minlength=m)
    row_step = step[mb_of_row]
    load = np.zeros(m)
    for s in range(int(step.max()) + 1):
        rows = np.flatnonzero(row_step == s)
        rows = rows[np.argsort(-cost[rows], kind="stable")]
        mbs = np.arange(s * slots, (s + 1) * slots)
        room = counts[mbs].copy()
        if how == "round-robin":
            k = np.arange(len(rows))
            order = np.concatenate([np.flatnonzero(room > j) for j in range(int(room.max()))])
            np.add.at(load, mbs[order[k]], cost[rows])
        else:
            local = np.zeros(slots)
            for r in rows:
                b = int(np.argmin(np.where(room > 0, local, np.inf)))
                local[b] += cost[r]
                room[b] -= 1
            load[mbs] = local
    rank = assign_ranks(load.reshape(-1, slots), dp, grad_accum).reshape(-1)
    return np.repeat(np.arange(m // slots), slots), rank, load


def measure(step, rank, epoch, load, dp: int) -> dict:
    from varlen_cli import format

    per_step = format.straggler(step, rank, load, dp)
    last = np.zeros(len(per_step), bool)  # the last step of every epoch
    ends = np.flatnonzero(np.diff(epoch))
    last[step[ends]] = True
    last[-1] = True
    return {"steps": len(per_step), "mean": float(per_step.mean()), "max": float(per_step.max()),
            "max_not_last": float(per_step[~last].max()) if (~last).any() else 1.0,
            "overhead": format.straggler_overhead(step, rank, load, dp)}


def whole_step_bound(tokens: int, seq_len: int, slots: int) -> float:
    rows = -(-tokens // seq_len)
    rows = slots * -(-rows // slots)
    return tokens / (rows * seq_len)


def run_case(metrics: str, tmp: str, seq_len: int, dp: int, grad_accum: int, attention: float, repeat: int):
    out = []
    times = {}
    for label, a in (("before", 0.0), ("after", attention)):
        secs = []
        for _ in range(repeat):
            res, s = plan_once(metrics, os.path.join(tmp, f"{label}.parquet"), seq_len, dp, grad_accum, a)
            secs.append(s)
        times[label] = statistics.median(secs)
        step, rank, epoch, mb_of_row, cost = read_rows(os.path.join(tmp, f"{label}.parquet"), attention)
        load = np.bincount(mb_of_row, weights=cost, minlength=len(step))
        tokens = int(res.stats["tokens"])
        row = {"case": label, **measure(step, rank, epoch, load, dp), "seconds": times[label],
               "efficiency": res.packing["efficiency"],
               "bound": whole_step_bound(tokens, seq_len, dp * grad_accum)}
        out.append(row)
        if label == "before":
            for how in ("round-robin", "lpt"):
                t0 = time.perf_counter()
                st, rk, ld = redeal(step, mb_of_row, cost, dp, grad_accum, how)
                out.append({"case": how, **measure(st, rk, epoch, ld, dp), "seconds": time.perf_counter() - t0,
                            "efficiency": row["efficiency"], "bound": row["bound"]})
    return out


def main(argv=None) -> None:
    from benchmarks.bench_plan import write_metrics_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", default="4096,16384,65536")
    ap.add_argument("--dp", default="8,64")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--attention-cost", type=float, default=A_SMALL)
    ap.add_argument("--steps", type=int, default=300, help="corpus size: about this many steps (grad-accum 1)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "varlen-bench-balance"))
    args = ap.parse_args(argv)
    man = man_lengths(args.cache)
    print("| T | dp | deal | steps | straggler mean / max | max except last | overhead | efficiency / bound "
          "| plan s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seq_len in [int(x) for x in args.seq_len.split(",")]:
        for dp in [int(x) for x in args.dp.split(",")]:
            lengths = corpus(seq_len, args.steps * dp // 8, man)  # about --steps steps at every dp
            with tempfile.TemporaryDirectory() as tmp:
                metrics = write_metrics_dir(os.path.join(tmp, "metrics"), lengths)
                for r in run_case(metrics, tmp, seq_len, dp, args.grad_accum, args.attention_cost, args.repeat):
                    print(f"| {seq_len:,} | {dp} | {r['case']} | {r['steps']} | {r['mean']:.3f} / {r['max']:.3f} "
                          f"| {r['max_not_last']:.3f} | {100 * r['overhead']:.2f}% "
                          f"| {100 * r['efficiency']:.3f}% / {100 * r['bound']:.3f}% | {r['seconds']:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
