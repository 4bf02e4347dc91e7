"""Megatron ``.idx`` lengths per second, one worker: varlen's reader against ``np.fromfile``.

Writes an index of ``--sequences`` sequences (and a sparse all-zero ``.bin`` of the size it needs;
lengths 1..4096, one to four sequences a document) with :func:`varlen_cli.analyze.formats.megatron.write_index`, then
times, in one process, alternating, ``--repeats`` times each (medians reported):

* ``np.fromfile``: the reference, the lengths' bytes read into an int32 array (what any reader
  has to do at least);
* ``varlen lengths``: every work unit (default 32 MiB of lengths) read through the analyze
  reader, column ``length`` (what ``--length value:length`` reads);
* ``np.fromfile lengths+boundaries``: a second reference, the bytes the ``document`` column needs
  read too (the index's int64 document boundaries), without computing anything from them;
* ``varlen lengths+document``: the reader with the ``document`` column (the unit's boundaries in
  one interpolated read, then a running sum of boundary marks: one int64 per sequence written),
  what ``varlen analyze`` reads when every source is a Megatron index;
* ``varlen analyze`` (``--analyze``): the whole command on one worker (also computes statistics
  and writes the metrics Parquet), on the same index.

The page cache is warm for every method (the file is read once before timing).

    python benchmarks/bench_megatron_idx.py --sequences 20000000 --repeats 5
    python benchmarks/bench_megatron_idx.py --sequences 20000000 --repeats 5 --max-per-document 1
    python benchmarks/bench_megatron_idx.py --sequences 100000000 --repeats 3 --analyze
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from varlen_cli.analyze import formats  # noqa: E402
from varlen_cli.analyze.formats import megatron  # noqa: E402


def write(path: str, n: int, seed: int = 0, max_per_document: int = 4) -> None:
    """An index of n sequences, 1 to ``max_per_document`` a document, written in 10M-sequence tiles of
    one random block (fast to make)."""
    rng = np.random.default_rng(seed)
    tile = min(n, 10_000_000)
    lengths = rng.integers(1, 4097, tile).astype(np.int32)
    per_doc = rng.integers(1, max_per_document + 1, tile)
    doc_starts = np.concatenate([[0], np.cumsum(per_doc)])
    doc_starts = doc_starts[doc_starts < tile]
    reps = -(-n // tile)
    all_lengths = np.tile(lengths, reps)[:n]
    starts = np.concatenate([doc_starts + k * tile for k in range(reps)])
    starts = np.append(starts[starts < n], n)
    megatron.write_index(path, all_lengths, starts)


def read_units(path: str, chunk_bytes: int, columns: list[str]) -> int:
    size = os.path.getsize(path)
    reader = formats.Reader()
    total = 0

    class U:  # a work unit as sources.Unit (part, start, stop)
        __slots__ = ("part", "start", "stop")

    for part, start, stop, _rows, _w in formats.units(path, "megatron", size, chunk_bytes):
        u = U()
        u.part, u.start, u.stop = part, start, stop
        t = reader.read(path, "megatron", size, u, columns)
        total += len(t.column("length").chunk(0).to_numpy(zero_copy_only=False))
    return total


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=20_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=32 << 20)
    ap.add_argument("--analyze", action="store_true", help="also time `varlen analyze` on one worker")
    ap.add_argument("--max-per-document", type=int, default=4,
                    help="sequences a document: 1 to this many (1: Megatron's usual one sequence a document)")
    ap.add_argument("--dir", default=None, help="where to write the index (default: a temporary folder)")
    args = ap.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="bench-idx-")
    path = os.path.join(folder, "corpus.idx")
    n = args.sequences
    t0 = time.perf_counter()
    write(path, n, max_per_document=args.max_per_document)
    gib = os.path.getsize(path) / 2**30
    print(f"index: {n:,} sequences, 1-{args.max_per_document} a document, {gib:.2f} GiB, written in "
          f"{time.perf_counter() - t0:.1f} s")
    idx = megatron.read_index(path, os.path.getsize(path))
    np.fromfile(path, np.uint8)  # warm the page cache
    methods = {
        "np.fromfile": lambda: np.fromfile(path, np.int32, count=n, offset=megatron.HEADER_BYTES),
        "np.fromfile lengths+boundaries": lambda: (
            np.fromfile(path, np.int32, count=n, offset=megatron.HEADER_BYTES),
            np.fromfile(path, np.int64, count=idx.doc_entries, offset=idx.documents_at)),
        "varlen lengths": lambda: read_units(path, args.chunk_bytes, ["length"]),
        "varlen lengths+document": lambda: read_units(path, args.chunk_bytes, ["length", "document"]),
    }
    assert read_units(path, args.chunk_bytes, ["length"]) == idx.sequences
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            times[name].append(timed(fn))
    if args.analyze:
        from varlen_cli.analyze import AnalyzeConfig, analyze

        out = os.path.join(folder, "metrics")
        times["varlen analyze (1 worker)"] = []
        for _ in range(args.repeats):
            t = timed(lambda: analyze(AnalyzeConfig(sources=(path,), output=out, overwrite=True, progress=False)))
            times["varlen analyze (1 worker)"].append(t)
    ref = statistics.median(times["np.fromfile"])
    print(f"{'method':32s} {'seconds (median)':>16s} {'M lengths/s':>12s} {'vs np.fromfile':>15s}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:32s} {t:16.3f} {n / t / 1e6:12.0f} {ref / t:15.2f}x")
    if args.dir is None:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
