"""Readers of issue 36 against their own libraries: lengths of every sample, one process.

Writes ``--items`` samples (token ids, int32, lengths 1..``--max-len``) in three forms, each with its
own library, then times, alternating, ``--repeats`` times each (medians reported):

* **LitData** (``BinaryWriter``, what ``optimize()`` runs): ``litdata.StreamingDataset`` iterated,
  ``len(item["input_ids"])`` per item (how its users bucket by length today), against varlen's
  chunk reader over every work unit (``list:input_ids``'s column, ``pyarrow.compute.list_value_length``);
* **Lance** (``lance.write_dataset``): Lance's own scan of the column (``dataset.to_table``) with the same
  vectorised length, against varlen's reader over every unit (fragment row ranges);
* an in-memory ``datasets.Dataset``: ``dataset.with_format("arrow")[:]`` with the same length, against
  varlen's reader over every unit;

and, for each, the whole command on one worker (``analyze`` / ``analyze_dataset``, Parquet written).

    python benchmarks/bench_readers.py --items 200000 --repeats 3
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

from varlen_cli.analyze import AnalyzeConfig, analyze, analyze_dataset  # noqa: E402
from varlen_cli.analyze.memory import DatasetSource  # noqa: E402
from varlen_cli.analyze.sources import Reader, discover, make_units  # noqa: E402


def lengths_of(n: int, max_len: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, max_len + 1, n)


def write_litdata(folder: str, lengths: np.ndarray) -> None:
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(cache_dir=folder, chunk_bytes="64MB")
    ids = np.arange(int(lengths.max()), dtype=np.int32)
    for i, n in enumerate(lengths.tolist()):
        writer[i] = {"input_ids": ids[:n], "n": i}
    writer.done()
    writer.merge()


def table_of(lengths: np.ndarray):
    import pyarrow as pa

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = pa.array(np.zeros(int(offsets[-1]), np.int32))
    return pa.table({"input_ids": pa.LargeListArray.from_arrays(pa.array(offsets), values),
                     "n": np.arange(len(lengths))})


def varlen_reader(source) -> np.ndarray:
    """Every unit read through analyze's reader, with the length analyze computes."""
    import pyarrow.compute as pc

    files = discover([source] if isinstance(source, str) else [DatasetSource(source)])
    reader = Reader()
    out = [pc.list_value_length(reader.read(files[u.file], u, ["input_ids"]).column("input_ids"))
           .to_numpy(zero_copy_only=False) for u in make_units(files)]
    return np.concatenate(out)


def litdata_peer(folder: str) -> np.ndarray:
    from litdata import StreamingDataset

    return np.fromiter((len(item["input_ids"]) for item in StreamingDataset(folder)), np.int64)


def lance_peer(folder: str) -> np.ndarray:
    import lance
    import pyarrow.compute as pc

    column = lance.dataset(folder).to_table(columns=["input_ids"]).column("input_ids")
    return pc.list_value_length(column).to_numpy()


def dataset_peer(ds) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.list_value_length(ds.with_format("arrow")[:].column("input_ids")).to_numpy()


def command(source, out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    if isinstance(source, str):
        analyze(AnalyzeConfig(sources=(source,), output=out, length="list:input_ids", progress=False))
    else:
        analyze_dataset(source, out, length="list:input_ids", progress=False)


def timed(expected: np.ndarray, fn, *args) -> float:
    t0 = time.perf_counter()
    got = fn(*args)
    seconds = time.perf_counter() - t0
    if got is not None and not np.array_equal(got, expected):
        raise SystemExit(f"{fn} returned other lengths")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import datasets
    import lance

    lengths = lengths_of(args.items, args.max_len)
    work = tempfile.mkdtemp(prefix="bench-readers-")
    try:
        t0 = time.perf_counter()
        write_litdata(os.path.join(work, "litdata"), lengths)
        lance.write_dataset(table_of(lengths), os.path.join(work, "d.lance"), max_rows_per_file=1 << 20)
        ds = datasets.Dataset(table_of(lengths))
        print(f"wrote {args.items:,} items in {time.perf_counter() - t0:.1f} s")
        cases = {
            "litdata": (os.path.join(work, "litdata"), litdata_peer),
            "lance": (os.path.join(work, "d.lance"), lance_peer),
            "datasets.Dataset": (ds, dataset_peer),
        }
        print("\n| source | library's own read, M items/s | varlen reader, M items/s | ratio | varlen analyze (1 "
              "worker), s |\n|---|---|---|---|---|")
        for name, (source, peer) in cases.items():
            times: dict[str, list] = {"peer": [], "varlen": [], "analyze": []}
            for _ in range(args.repeats):
                times["peer"].append(timed(lengths, peer, source))
                times["varlen"].append(timed(lengths, varlen_reader, source))
                times["analyze"].append(timed(lengths, command, source, os.path.join(work, "m")))
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"| {name} | {args.items / med['peer'] / 1e6:.2f} | {args.items / med['varlen'] / 1e6:.2f} | "
                  f"{med['peer'] / med['varlen']:.1f}x | {med['analyze']:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\npython benchmarks/bench_readers.py --items {args.items} --max-len {args.max_len} "
          f"--repeats {args.repeats}")


if __name__ == "__main__":
    main()
