"""Heavy-tailed, real-like sample lengths at any N, written as Parquet sources (issue 25).

    python benchmarks/gen_lengths.py -o /work/bench-data/src-1b --samples 1000000000
    varlen analyze /work/bench-data/src-1b -o /work/bench-data/m-1b --length value:num_tokens --nproc 2

The lengths imitate the documents of a web pretraining corpus (FineWeb-Edu-like token counts):

* 97%: a lognormal body, median ``--median`` tokens (400), sigma 1.1 (most documents 100-3,000);
* 3%: a Pareto tail (alpha 1.3) from 4,000 tokens on: long articles, books and code files, up to
  ``--max-length`` (131,072; longer ones are clipped there);
* lengths are at least 1.

Each file holds ``--rows-per-file`` rows (64M) in row groups of 1M rows, one ``num_tokens`` int32
column (what `varlen analyze` picks by itself); file ``k`` is drawn from its own seeded stream
(``--seed``, k), so any N is the same prefix of the same data set and files are generated in parallel
(``--jobs``). About 1.7 bytes a row on disk (1B rows: ~1.7 GB).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

ROW_GROUP = 1 << 20
BODY_SIGMA = 1.1
TAIL_SHARE = 0.03
TAIL_START = 4000
TAIL_ALPHA = 1.3


def lengths(n: int, rng: np.random.Generator, median: float = 400.0, max_length: int = 131072) -> np.ndarray:
    """``n`` heavy-tailed lengths (int32, 1..max_length): a lognormal body and a Pareto tail."""
    body = rng.lognormal(np.log(median), BODY_SIGMA, n)
    tail = rng.random(n) < TAIL_SHARE
    k = int(np.count_nonzero(tail))
    body[tail] = TAIL_START * (1.0 + rng.pareto(TAIL_ALPHA, k))
    np.clip(body, 1, max_length, out=body)
    return body.astype(np.int32)


def write_file(path: str, rows: int, seed: int, index: int, median: float, max_length: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng([seed, index])
    schema = pa.schema([("num_tokens", pa.int32())])
    tmp = path + ".tmp"
    with pq.ParquetWriter(tmp, schema, compression="zstd", compression_level=1) as w:
        for lo in range(0, rows, ROW_GROUP):
            n = min(ROW_GROUP, rows - lo)
            w.write_table(pa.table({"num_tokens": lengths(n, rng, median, max_length)}, schema=schema))
    os.replace(tmp, path)
    return path


def generate(out: str, samples: int, rows_per_file: int, seed: int = 0, median: float = 400.0,
             max_length: int = 131072, jobs: int = 1) -> list[str]:
    """Write ``samples`` rows as ``part-NNNNN.parquet`` files in ``out``; returns their paths."""
    os.makedirs(out, exist_ok=True)
    files = []
    for k, lo in enumerate(range(0, samples, rows_per_file)):
        files.append((os.path.join(out, f"part-{k:05d}.parquet"), min(rows_per_file, samples - lo), seed, k))
    if jobs <= 1:
        return [write_file(p, n, s, k, median, max_length) for p, n, s, k in files]
    with ProcessPoolExecutor(jobs) as pool:
        futures = [pool.submit(write_file, p, n, s, k, median, max_length) for p, n, s, k in files]
        return [f.result() for f in futures]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", required=True, help="directory to write part-*.parquet into")
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--rows-per-file", type=int, default=64 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--median", type=float, default=400.0)
    ap.add_argument("--max-length", type=int, default=131072)
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    if os.path.exists(args.output) and os.listdir(args.output):
        sys.exit(f"{args.output} is not empty")
    t0 = time.perf_counter()
    paths = generate(args.output, args.samples, args.rows_per_file, args.seed, args.median, args.max_length,
                     args.jobs)
    size = sum(os.path.getsize(p) for p in paths)
    print(f"{args.samples:,} rows in {len(paths)} files, {size / 1e9:.2f} GB, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
