"""Does ``--max-memory`` bound the real training process? (issue 22's acceptance run; results in
benchmarks/memory.md)

    python benchmarks/bench_memory_verify.py --model benchmarks.memory_models:decoder_2x96 --max-memory 1.5GiB

1. a real corpus (``benchmarks/corpora.py``, default ``manpages-paragraphs``: Debian's manual pages
   cut into paragraphs) analysed with ``sample_data/tokenizer.json``;
2. ``varlen calibrate --model M --max-memory X`` (timed, wall and CPU seconds; ``--calibrate`` other options);
3. ``varlen plan --memory-profile P --max-memory X --drop-long`` (samples whose B = 1 step does not
   fit the limit are dropped and counted);
4. the plan's biggest microbatches: for every padded T its largest B, the ``--shapes`` of them with the
   largest predicted peak, plus the largest T and the largest B x T, each run as ONE training step in
   a fresh Python process that does not import varlen (``--step``: import torch and the model's
   module, build, AdamW, a 1x8 warm-up step, then the step; ``outputs = model(input_ids=ids,
   labels=ids); outputs.loss.backward(); opt.step(); opt.zero_grad()``), its peak resident memory
   read from ``getrusage`` (``ru_maxrss``).

Printed: a markdown table (B x T, measured, predicted, limit, % of limit) and the verdict: every
measured peak <= the limit, and the biggest >= 75% of it.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_main(spec: str, batch: int, seqlen: int) -> None:
    """One training step in this fresh process; prints its peak resident memory in bytes."""
    import importlib
    import resource

    import torch

    sys.path.insert(0, os.getcwd())
    module, _, function = spec.rpartition(":")
    model = getattr(importlib.import_module(module), function)()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size

    def step(b: int, t: int) -> None:
        ids = torch.randint(0, vocab, (b, t))
        outputs = model(input_ids=ids, labels=ids)
        outputs.loss.backward()
        opt.step()
        opt.zero_grad()

    step(1, 8)
    step(batch, seqlen)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def measure_step(spec: str, batch: int, seqlen: int) -> int:
    import subprocess

    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--step", spec, str(batch), str(seqlen)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, check=True)
    return int(out.stdout.split()[-1])


def biggest(plan_path: str, coef, count: int) -> list[tuple[int, int, list[str]]]:
    """(B, T, why): per T its largest B; the ``count`` largest by predicted peak, the largest T, the largest B x T."""
    import numpy as np
    import pyarrow.parquet as pq

    t = pq.read_table(plan_path, columns=["batch_size", "seqlen"])
    b, s = t.column("batch_size").to_numpy().astype(np.int64), t.column("seqlen").to_numpy().astype(np.int64)
    per_t = {}
    for bb, ss in zip(b.tolist(), s.tolist()):
        per_t[ss] = max(per_t.get(ss, 0), bb)
    shapes = sorted(per_t.items(), key=lambda kv: kv[0])
    pred = {(bb, ss): coef[0] + coef[1] * bb * ss + coef[2] * bb * ss * ss for ss, bb in shapes}
    chosen = {}
    for bt in sorted(pred, key=pred.get, reverse=True)[:count]:
        chosen.setdefault(bt, []).append("predicted peak")
    chosen.setdefault(max(pred, key=lambda k: (k[1], k[0])), []).append("T")
    chosen.setdefault(max(pred, key=lambda k: (k[0] * k[1], k[1])), []).append("B x T")
    return [(bt[0], bt[1], why) for bt, why in sorted(chosen.items(), key=lambda kv: -pred[kv[0]])]


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="benchmarks.memory_models:decoder_2x96")
    ap.add_argument("--max-memory", default="1.5GiB")
    ap.add_argument("--corpus", default="manpages-paragraphs")
    ap.add_argument("--shapes", type=int, default=8, help="how many of the largest-by-prediction shapes to run")
    ap.add_argument("--workdir", default="/tmp/varlen-bench-memory")
    ap.add_argument("--extra", default="", help="extra `varlen plan` options, e.g. '--num-shapes 8'")
    ap.add_argument("--calibrate", default="--max-memory {max_memory}",
                    help="`varlen calibrate` options besides --model and -o (default: around the limit; '' for the "
                         "default grid up to the calibration memory)")
    args = ap.parse_args()

    import shlex
    import subprocess
    import time

    sys.path.insert(0, ROOT)
    from benchmarks.corpora import build_corpus
    from varlen_cli.memory import load_profile, parse_size
    from varlen_cli.memory.sizes import format_size

    os.makedirs(args.workdir, exist_ok=True)
    corpus = build_corpus(args.corpus, os.path.join(args.workdir, "corpora"))
    metrics = os.path.join(args.workdir, f"metrics-{args.corpus}")
    tag = args.model.rpartition(":")[2]
    tag += "-grid" if "--max-memory" not in args.calibrate else ""
    profile_path = os.path.join(args.workdir, f"profile-{tag}.json")
    plan_path = os.path.join(args.workdir, f"plan-{tag}.parquet")

    def varlen(*argv: str) -> str:
        cmd = [sys.executable, "-m", "varlen_cli", *argv]
        print("$", shlex.join(["varlen", *argv]), flush=True)
        return subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout

    if not os.path.exists(metrics):
        varlen("analyze", corpus, "-o", metrics, "--length", "tokens:text", "--tokenizer",
               os.path.join(ROOT, "sample_data", "tokenizer.json"))
    load0, cpu0, t0 = os.getloadavg()[0], _cpu_seconds(), time.perf_counter()
    varlen("calibrate", "--model", args.model, "-o", profile_path, "--overwrite",
           *shlex.split(args.calibrate.format(max_memory=args.max_memory)))
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    varlen("plan", metrics, "-o", plan_path, "--memory-profile", profile_path, "--max-memory", args.max_memory,
           "--drop-long", "--overwrite", *shlex.split(args.extra))
    profile = load_profile(profile_path)
    fit = profile["fit"]
    coef = (fit["c0"], fit["c1"], fit["c2"])
    limit = parse_size(args.max_memory)
    from varlen_cli import format

    stats = format.read_plan_metadata(plan_path)[0]["stats"]
    print(f"\ncalibrate: {wall:.1f} s wall, {cpu:.1f} s CPU (load average {load0:.1f} at the start); "
          f"{len(profile['points'])} shapes; c0 {format_size(coef[0])}, c1 {coef[1]:,.0f} B, c2 {coef[2]:,.2f} B; "
          f"plan: {stats['samples']:,} samples, {stats.get('dropped', 0):,} dropped as too long for the limit\n")
    print("| B x T | largest by | measured | predicted | limit | % of limit |")
    print("|---|---|---|---|---|---|")
    peaks = []
    for b, t, why in biggest(plan_path, coef, args.shapes):
        peak = measure_step(args.model, b, t)
        peaks.append(peak)
        predicted = coef[0] + coef[1] * b * t + coef[2] * b * t * t
        print(f"| {b}x{t} | {', '.join(why)} | {format_size(peak)} | {format_size(predicted)} | "
              f"{format_size(limit)} | {100 * peak / limit:.1f}% |", flush=True)
    over = sum(p > limit for p in peaks)
    print(f"\n{len(peaks)} microbatches: {over} over the limit; the biggest at {100 * max(peaks) / limit:.1f}% of it "
          f"({'PASS' if over == 0 and max(peaks) >= 0.75 * limit else 'FAIL'}: all <= 100%, biggest >= 75%)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--step":
        step_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
