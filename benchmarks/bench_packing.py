"""Benchmark padding-free packing (``varlen_cli.plan.packing.pack``) against other packers, same inputs.

For each length distribution (synthetic; ``heavy``: 60% tiny samples + fortunes + man paragraphs;
and the Debian corpora tokenised when
``benchmarks/corpora.py`` can build them) and each ``--max-per-row`` cap it packs the same
lengths into rows of ``--seq-len`` tokens with:

* ``varlen shuffle``: ``pack()`` in-process (BFD; under a cap the cap-aware packer), rows in seeded
  random order;
* ``varlen plan (command)`` (``--packers ...,whole``): the whole ``varlen plan --packing`` command;
  ``--whole-ratio N`` instead times it uncapped and per cap in N interleaved rounds;
* ``varlen curriculum``: the same, windows of the (length-sorted) input order;
* ``next-fit``: the streaming baseline (input order, start a new row when the sample does not fit);
* ``trl bfd`` / ``trl bfd global``: TRL's ``pack_dataset(strategy="bfd")`` with its default
  ``map`` batches of 1,000 samples, and with one batch over the whole dataset (``--trl-python``);
* ``axolotl multipack``: Axolotl's ``MultipackBatchSampler`` (first-fit over a random order in
  groups of 100k samples, numba), ``bin_size`` = the cap (``--axolotl-python``).

Peers run in their own virtual environments (a subprocess given the lengths as ``.npy``); TRL
works on real token lists, so it gets at most ``--trl-max`` samples (default 200k). Printed per
row: rows, efficiency (real tokens / rows x T), the best possible efficiency (rows >= max(tokens/T,
samples/cap, samples longer than T/2)), samples per row (mean, max), seconds (median of
``--repeat``; numba compilation excluded) and seconds per 1M samples. Samples longer than T are
dropped for every packer (varlen: ``drop_long``) so all pack the same tokens.

    python benchmarks/bench_packing.py --samples 1000000 --seq-len 4096 --max-per-row none,64 \\
        --trl-python /work/venvs/packing-trl/bin/python --axolotl-python /work/venvs/packing-axolotl/bin/python
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


# ---- distributions -------------------------------------------------------------------------------

def synthetic(name: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "sft":  # lognormal chat / instruction lengths, median ~250 tokens
        x = rng.lognormal(5.5, 1.0, n)
    elif name == "sft-wide":  # heavier tail and many very short samples
        x = rng.lognormal(5.0, 1.5, n)
    elif name == "asr":  # utterances of 0.5-30 s (gamma, mean 7 s) at 50 frames/s
        x = np.clip(rng.gamma(2.0, 3.5, n), 0.5, 30.0) * 50
    elif name == "bimodal":  # 70% short answers, 30% long documents
        short = rng.random(n) < 0.7
        x = np.where(short, rng.normal(150, 50, n), rng.normal(2000, 600, n))
    else:
        raise ValueError(name)
    return np.maximum(1, x).astype(np.int64)


def corpus_lengths(name: str, work: str, n: int) -> np.ndarray | None:
    """Token counts of a Debian corpus (sample_data/tokenizer.json), tiled to ``n`` samples."""
    try:
        from corpora import build_corpus  # benchmarks/corpora.py
    except Exception as e:  # pragma: no cover - depends on the other benchmark helpers
        print(f"# corpus {name}: benchmarks/corpora.py unavailable ({e})", file=sys.stderr)
        return None
    try:
        import pyarrow.parquet as pq
        from tokenizers import Tokenizer

        path = build_corpus(name, os.path.join(work, "corpora"))
        texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
        tok = Tokenizer.from_file(os.path.join(ROOT, "sample_data", "tokenizer.json"))
        tok.no_truncation()  # the file pads / truncates to 128 tokens: count every token
        tok.no_padding()
        lengths = np.array([len(e.ids) for e in tok.encode_batch(texts)], dtype=np.int64)
    except Exception as e:
        print(f"# corpus {name}: could not build or tokenise ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    reps = -(-n // len(lengths))
    rng = np.random.default_rng(0)
    return rng.permutation(np.tile(lengths, reps))[:n]


def heavy_tailed(n: int, T: int, work: str, seed: int = 0) -> tuple[np.ndarray, str]:
    """Heavy-tailed corpus with many tiny samples: 60% synthetic tiny samples under 1% of T
    (lognormal around T/400: chat turns, glosses), 22% fortunes and 18% manual-page paragraphs.
    The fortunes and paragraphs are the real Debian texts tokenised with sample_data/tokenizer.json
    when ``corpora.py`` can build them (else lognormal stand-ins, said in the returned note)."""
    rng = np.random.default_rng(seed)
    kind = rng.random(n)
    tiny_hi = max(2, T // 100)
    tiny = np.minimum(rng.lognormal(np.log(tiny_hi / 4), 0.8, n).astype(np.int64) + 1, tiny_hi - 1)
    fortunes = corpus_lengths("fortunes", work, n)
    paragraphs = corpus_lengths("manpages-paragraphs", work, n)
    note = "real fortunes + man paragraphs"
    if fortunes is None or paragraphs is None:
        fortunes = rng.lognormal(np.log(75), 0.8, n).astype(np.int64)
        paragraphs = rng.lognormal(np.log(110), 1.0, n).astype(np.int64)
        note = "synthetic stand-ins for fortunes / man paragraphs (corpora unavailable)"
    out = np.where(kind < 0.6, tiny, np.where(kind < 0.82, fortunes, paragraphs))
    return np.clip(out, 1, T).astype(np.int64), note


# ---- packers -----------------------------------------------------------------------------------

def run_varlen(lengths, T, cap, order):
    from varlen_cli.plan.packing import pack

    t0 = time.perf_counter()
    p = pack(lengths, T, max_per_row=cap, order=order, seed=0, drop_long=True)
    secs = time.perf_counter() - t0
    spr = p.samples_per_row()
    return {"rows": p.num_rows, "tokens": p.tokens, "spr_mean": float(spr.mean()), "spr_max": int(spr.max()),
            "seconds": secs}


def run_whole_command(lengths, T, cap, tmp, repeat, cpu=False):
    """``varlen plan METRICS -o PLAN --packing --seq-len T [--max-per-row K]`` as a subprocess
    (start-up, read, pack, write): median wall seconds of ``repeat`` runs; with ``cpu`` also the
    median CPU seconds (user + sys) of the process, which other load on the machine disturbs less."""
    from bench_plan import write_metrics_dir  # benchmarks/bench_plan.py

    mdir = os.path.join(tmp, "metrics")
    if not os.path.exists(mdir):
        write_metrics_dir(mdir, lengths)
    cmd = [sys.executable, "-m", "varlen_cli", "plan", mdir, "-o", os.path.join(tmp, "plan.parquet"), "--packing",
           "--seq-len", str(T), "--overwrite"] + ([] if cap is None else ["--max-per-row", str(cap)])
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    import resource

    secs, cpus = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
        secs.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return (statistics.median(secs), statistics.median(cpus)) if cpu else statistics.median(secs)


def next_fit(lengths, seq_len, max_per_row=None):
    """Next-fit in input order (streaming packers without splitting): the row of each sample.
    Sequential by nature, so a plain loop over samples."""
    cap = max_per_row or (1 << 62)
    rows = np.empty(len(lengths), dtype=np.int64)
    row, used, cnt = 0, 0, 0
    for i, L in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        if used + L > seq_len or cnt >= cap:
            row, used, cnt = row + 1, 0, 0
        rows[i] = row
        used += L
        cnt += 1
    return rows


def run_next_fit(lengths, T, cap):
    t0 = time.perf_counter()
    rows = next_fit(lengths, T, cap)
    secs = time.perf_counter() - t0
    spr = np.bincount(rows)
    return {"rows": int(rows.max()) + 1, "tokens": int(lengths.sum()), "spr_mean": float(spr.mean()),
            "spr_max": int(spr.max()), "seconds": secs}


WORKER_TRL = r'''
import json, sys, time
import numpy as np, pyarrow as pa
from datasets import Dataset
from trl import pack_dataset
lengths = np.load(sys.argv[1]); T = int(sys.argv[2]); whole = sys.argv[3] == "global"
offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(int(offsets[-1]), dtype=np.int32)))
ds = Dataset(pa.table({"input_ids": ids}))
kw = {"batch_size": len(lengths)} if whole else {}
t0 = time.perf_counter()
out = pack_dataset(ds, T, strategy="bfd", map_kwargs=kw)
sl = out.with_format("arrow")[:]["seq_lengths"]
secs = time.perf_counter() - t0
import pyarrow.compute as pc
spr = pc.list_value_length(sl).to_numpy()
tokens = int(pc.sum(pc.list_flatten(sl)).as_py())
print(json.dumps({"rows": len(out), "tokens": tokens, "spr_mean": float(spr.mean()), "spr_max": int(spr.max()),
                  "seconds": secs}))
'''

WORKER_AXOLOTL = r'''
import json, sys, time, logging
import numpy as np, torch
from axolotl.utils.samplers.multipack import MultipackBatchSampler
from torch.utils.data import RandomSampler
lengths = np.load(sys.argv[1]); T = int(sys.argv[2]); cap = int(sys.argv[3]) or T
def sampler(n):
    return MultipackBatchSampler(RandomSampler(range(n), generator=torch.Generator().manual_seed(0)), batch_size=1,
                                 batch_max_len=T, lengths=lengths[:n], bin_size=cap, drop_last=False,
                                 num_processes=1)
sampler(min(len(lengths), 1000)).generate_batches()  # numba compilation, not timed
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 1
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    batches = sampler(len(lengths)).generate_batches()
    times.append(time.perf_counter() - t0)
secs = sorted(times)[len(times) // 2]
spr = np.array([len(b[0]) for b in batches])
tokens = int(sum(int(lengths[i].sum()) for b in batches for i in [np.asarray(b[0])]))
print(json.dumps({"rows": len(batches), "tokens": tokens, "spr_mean": float(spr.mean()), "spr_max": int(spr.max()),
                  "seconds": secs}))
'''


def run_worker(python, code, args, timeout):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
        script = f.name
    try:
        r = subprocess.run([python, script, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    finally:
        os.unlink(script)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- main --------------------------------------------------------------------------------------

def bound_rows(lengths, T, cap):
    big = int(np.count_nonzero(2 * lengths > T))
    rows = max(-(-int(lengths.sum()) // T), big, 1)
    return max(rows, -(-len(lengths) // cap)) if cap else rows


def parse_cap(text: str, lengths: np.ndarray, T: int) -> int | None:
    """'none', an integer, or 'F x' = F times the mean samples per row at the lower bound (rounded up)."""
    text = text.strip().lower()
    if text == "none":
        return None
    if text.endswith("x"):
        return int(np.ceil(float(text[:-1]) * len(lengths) / bound_rows(lengths, T, None)))
    return int(text)


def load_dist(dist: str, args, T: int) -> np.ndarray | None:
    if dist in ("sft", "sft-wide", "asr", "bimodal"):
        return synthetic(dist, args.samples)
    if dist == "heavy":
        lengths, note = heavy_tailed(args.samples, T, args.work)
        print(f"# heavy at T={T}: {note}")
        return lengths
    return corpus_lengths(dist, args.work, args.samples)


def packer_runs(args, lengths, T, cap, tmp, npy, npy_small, small):
    """(name, function, lengths) per packer asked for with ``--packers``."""
    want = set(args.packers.split(","))
    runs = []
    if "shuffle" in want:
        runs.append(("varlen shuffle", lambda: run_varlen(lengths, T, cap, "shuffle"), lengths))
    if "whole" in want:
        runs.append(("varlen plan (command)",
                     lambda: {**run_varlen(lengths, T, cap, "shuffle"),
                              "seconds": run_whole_command(lengths, T, cap, tmp, 1)},
                     lengths))
    if "curriculum" in want:
        runs.append(("varlen curriculum", lambda: run_varlen(np.sort(lengths), T, cap, "curriculum"), lengths))
    if "next-fit" in want:
        runs.append(("next-fit", lambda: run_next_fit(lengths, T, cap), lengths))
    if args.axolotl_python and "axolotl" in want:
        runs.append(("axolotl multipack", lambda: run_worker(args.axolotl_python, WORKER_AXOLOTL,
                                                             [npy, T, cap or 0, args.repeat], args.peer_timeout),
                     lengths))
    if args.trl_python and cap is None and "trl" in want:  # TRL has no cap
        for mode in ("batches", "global"):
            name = "trl bfd" + (" global" if mode == "global" else "")
            runs.append((name, (lambda m=mode: run_worker(args.trl_python, WORKER_TRL,
                                                          [npy_small, T, m], args.peer_timeout)), small))
    return runs


def measure(name, fn, lens, T, cap, dist, args, results):
    outs = []
    reps = 1 if name in ("next-fit",) or name.startswith(("trl", "axolotl")) else args.repeat
    for _ in range(reps):
        outs.append(fn())
        if "error" in outs[-1]:
            break
    label = str(cap or "-")
    if "error" in outs[-1]:
        print(f"{dist:<20} {T:>6} {label:>4} {name:<22} failed: {outs[-1]['error']}")
        results.append({"dist": dist, "seq_len": T, "cap": cap, "packer": name, "error": outs[-1]["error"]})
        return
    o = outs[-1]
    secs = statistics.median(x["seconds"] for x in outs)
    eff = o["tokens"] / (o["rows"] * T)
    best = int(lens.sum()) / (bound_rows(lens, T, cap) * T)
    row = {"dist": dist, "seq_len": T, "cap": cap, "packer": name, "samples": len(lens), "rows": o["rows"],
           "bound_rows": bound_rows(lens, T, cap), "efficiency": eff, "best": best, "spr_mean": o["spr_mean"],
           "spr_max": o["spr_max"], "seconds": secs, "seconds_per_1m": secs * 1e6 / len(lens)}
    results.append(row)
    print(f"{dist:<20} {T:>6} {label:>4} {name:<22} {len(lens):>9,} {o['rows']:>8,} {row['bound_rows']:>8,} "
          f"{100 * eff:>8.3f} {100 * best:>8.3f} {o['spr_mean']:>8.1f} {o['spr_max']:>7} "
          f"{secs:>7.2f} {secs * 1e6 / len(lens):>7.2f}", flush=True)


def whole_command_ratios(args) -> None:
    """``--whole-ratio N``: the whole ``varlen plan --packing`` command uncapped and with every cap,
    interleaved round by round (so machine load hits all alike), N rounds; prints the median
    wall and CPU seconds per cap and the medians of the per-round ratios to the uncapped command."""
    print(f"\n# whole command, {args.whole_ratio} interleaved rounds (median s; ratio = median of per-round "
          f"capped / uncapped; cpu = user + sys of the process)")
    print(f"{'distribution':<20} {'T':>6} {'cap':>5} {'median s':>9} {'ratio':>7} {'cpu s':>7} {'cpu ratio':>9}  "
          "per-round s")
    for T in [int(t) for t in args.seq_len.split(",")]:
        for dist in args.dists.split(","):
            lengths = load_dist(dist, args, T)
            if lengths is None:
                continue
            lengths = lengths[lengths <= T]
            caps = [parse_cap(c, lengths, T) for c in args.max_per_row.split(",")]
            caps = [None] + [c for c in caps if c is not None]
            with tempfile.TemporaryDirectory() as tmp:
                run_whole_command(lengths, T, None, tmp, 1)  # warm the page cache and imports
                secs = {c: [] for c in caps}
                cpus = {c: [] for c in caps}
                for _ in range(args.whole_ratio):
                    for c in caps:
                        wall, cpu = run_whole_command(lengths, T, c, tmp, 1, cpu=True)
                        secs[c].append(wall)
                        cpus[c].append(cpu)
            for c in caps:
                ratio = statistics.median(a / b for a, b in zip(secs[c], secs[None], strict=True))
                cpu_ratio = statistics.median(a / b for a, b in zip(cpus[c], cpus[None], strict=True))
                print(f"{dist:<20} {T:>6} {str(c or '-'):>5} {statistics.median(secs[c]):>9.2f} {ratio:>7.2f} "
                      f"{statistics.median(cpus[c]):>7.2f} {cpu_ratio:>9.2f}  "
                      + " ".join(f"{x:.2f}" for x in secs[c]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000, help="samples per distribution")
    ap.add_argument("--seq-len", default="4096", help="comma-separated packed row lengths T")
    ap.add_argument("--max-per-row", default="none,64",
                    help="comma-separated caps: 'none' = uncapped, an integer, or '1.5x' = 1.5 x mean samples per row")
    ap.add_argument("--dists", default="sft,sft-wide,asr,bimodal,fortunes,manpages-paragraphs",
                    help="synthetic: sft, sft-wide, asr, bimodal; corpora: fortunes, manpages, manpages-paragraphs; "
                         "heavy (60%% tiny + fortunes + man paragraphs)")
    ap.add_argument("--packers", default="shuffle,curriculum,next-fit,axolotl,trl",
                    help="any of: shuffle, whole (the whole `varlen plan --packing` command), curriculum, "
                         "next-fit, axolotl, trl")
    ap.add_argument("--repeat", type=int, default=3, help="timing runs per packer (median reported)")
    ap.add_argument("--trl-python", help="python of a venv with trl + datasets")
    ap.add_argument("--trl-max", type=int, default=200_000, help="at most this many samples for TRL (token lists)")
    ap.add_argument("--axolotl-python", help="python of a venv with axolotl + numba")
    ap.add_argument("--peer-timeout", type=int, default=900, help="seconds per peer run")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "varlen-bench"), help="cache folder")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--whole-ratio", type=int, default=0,
                    help="instead of the table: N interleaved rounds of the whole command, uncapped and per cap")
    args = ap.parse_args()
    print("# " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    print(f"# {os.cpu_count()} cpus, numpy {np.__version__}, python {sys.version.split()[0]}, "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.whole_ratio:
        whole_command_ratios(args)
        return
    results = []
    hdr = (f"{'distribution':<20} {'T':>6} {'cap':>4} {'packer':<22} {'samples':>9} {'rows':>8} {'bound':>8} "
           f"{'eff %':>8} {'best %':>8} {'spr mean':>8} {'spr max':>7} {'s':>7} {'s/1M':>7}")
    print(hdr)
    print("-" * len(hdr))
    for T in [int(t) for t in args.seq_len.split(",")]:
        for dist in args.dists.split(","):
            lengths = load_dist(dist, args, T)
            if lengths is None:
                continue
            lengths = lengths[lengths <= T]  # every packer packs the same samples
            with tempfile.TemporaryDirectory() as tmp:
                npy = os.path.join(tmp, "lengths.npy")
                np.save(npy, lengths.astype(np.int64))
                small = lengths[: args.trl_max]
                npy_small = os.path.join(tmp, "small.npy")
                np.save(npy_small, small.astype(np.int64))
                for cap_text in args.max_per_row.split(","):
                    cap = parse_cap(cap_text, lengths, T)
                    for name, fn, lens in packer_runs(args, lengths, T, cap, tmp, npy, npy_small, small):
                        measure(name, fn, lens, T, cap, dist, args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
