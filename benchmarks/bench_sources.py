"""Object storage and ``SourceDataset`` benchmarks (issue 24).

Starts moto's S3-protocol server on 127.0.0.1 (a free port, in this process), writes a synthetic
tokenized Parquet corpus locally and uploads the same files to the server, then measures, medians
of ``--repeats`` runs, every comparison in the same run:

* ``analyze``: ``varlen analyze`` of the ``s3://`` prefix vs the local folder (``--length list``);
* ``dataset``: microbatches/s of a shuffled plan (``--order random``) read through
  ``SourceDataset`` (local and s3, the plan's read-ahead on) vs reading the same microbatch sizes
  in ``sample_id`` order (sequential) from the same ``SourceDataset``, vs Hugging Face
  ``datasets`` (``load_dataset("parquet")`` then ``ds[ids]``, local), vs a naive per-sample
  pyarrow read (open the file, read the sample's row group; a prefix of the plan only);
* ``train``: examples/tiny_lm.py's TinyGPT trained on the shuffled plan with
  ``dataloader_for_plan(SourceDataset(...))``: the time each step waits for data vs computes.

    python benchmarks/bench_sources.py --rows 100000 --repeats 3
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
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
VOCAB = 1000


SERVER = ("import logging, sys, time\n"
          "from moto.server import ThreadedMotoServer\n"
          "logging.getLogger('werkzeug').setLevel(logging.WARNING)\n"
          "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n"
          "s.start()\n"
          "print(s.get_host_and_port()[1], flush=True)\n"
          "sys.stdin.read()\n")


def start_server():
    """moto's server in its own process (so that it does not share this process's GIL), on a free
    port of 127.0.0.1; it stops when this process closes its stdin."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    return proc


def write_corpus(folder: str, rows: int, files: int, row_group: int, seed: int = 0) -> list[str]:
    """Token-id lists (log-normal lengths, mean ~128) and a short text column, in ``files`` files."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for k, part in enumerate(np.array_split(np.arange(rows), files)):
        lengths = np.clip(rng.lognormal(4.6, 0.6, size=len(part)).astype(np.int64), 4, 1024)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = rng.integers(0, VOCAB, size=int(offsets[-1]), dtype=np.int32)
        ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        table = pa.table({"input_ids": ids, "text": [f"document {i}" for i in part]})
        path = os.path.join(folder, f"part-{k:03d}.parquet")
        pq.write_table(table, path, row_group_size=row_group)
        paths.append(path)
    return paths


def upload(folder: str, bucket: str) -> str:
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    for name in sorted(os.listdir(folder)):
        client.upload_file(os.path.join(folder, name), bucket, f"corpus/{name}")
    return f"s3://{bucket}/corpus"


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_analyze(local: str, url: str, work: str, repeats: int) -> dict:
    from benchmarks.s3_requests import s3_requests
    from varlen_cli.analyze import AnalyzeConfig, analyze

    def go(src, out):
        return lambda: analyze(AnalyzeConfig(sources=(src,), output=out, length="list:input_ids", overwrite=True,
                                             progress=False))

    t_local, _ = timed(go(local, os.path.join(work, "m-local")), repeats)
    t_s3, _ = timed(go(url, os.path.join(work, "m-s3")), repeats)
    with s3_requests() as log:  # one more run, untimed: what it asks the server for
        go(url, os.path.join(work, "m-s3"))()
    return {"local_s": t_local, "s3_s": t_s3, "requests": log}


def report_requests(log: list, files: int) -> None:
    """Requests of one analyze of the s3 prefix, by operation; Parquet reads split into footer
    (tail) reads and column-chunk reads."""
    from collections import Counter

    ops = Counter(r.op for r in log)
    gets = [r for r in log if r.op == "get_object"]
    ends: dict = {}
    for r in gets:  # the largest end seen per key: the object's end, which only footer reads reach
        ends[r.key] = max(ends.get(r.key, 0), r.range[1] if r.range else 0)
    tails = [r for r in gets if r.range and r.range[1] == ends[r.key]]
    print(f"requests of one s3 analyze ({files} Parquet objects): {len(log)} in all, "
          + ", ".join(f"{op} {n}" for op, n in sorted(ops.items()))
          + f"; get_object: {len(tails)} footer (tail) reads, {len(gets) - len(tails)} column-chunk reads, "
          f"{sum(r.size or 0 for r in gets) / 1e6:.1f} MB, {sum(r.range is None for r in gets)} without a range")


def make_plan(metrics: str, path: str, max_tokens: int) -> None:
    from varlen_cli.plan import PlanConfig, plan

    plan(PlanConfig(input=metrics, output=path, max_tokens=max_tokens, order="random", seed=1, overwrite=True,
                    progress=False))


def fetch_plan(ds, plan_path: str) -> int:
    """Every microbatch of the plan through dataloader_for_plan (fetch + PadCollate): the user's path."""
    from varlen_cli.loader import dataloader_for_plan

    n = 0
    for _ in dataloader_for_plan(ds, plan_path, rank=0, world_size=1, lr_scale="ignore"):
        n += 1
    return n


def sequential_batches(sizes: list[int]) -> list[np.ndarray]:
    """The same microbatch sizes, consecutive sample ids (the order the files are stored in)."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [np.arange(starts[k], starts[k + 1]) for k in range(len(sizes))]


def fetch_batches(ds, batches: list[np.ndarray], read_ahead: int = 4) -> int:
    """Fetch each microbatch's items as the plan's loader does (PlanDataset, with the read-ahead of
    the next ``read_ahead`` microbatches), without collating."""
    from varlen_cli.loader import PlanDataset
    from varlen_cli.loader.sampler import MicrobatchIndices

    wrapped = PlanDataset(ds, check_order=False)
    for k, ids in enumerate(batches):
        wrapped.__getitems__(MicrobatchIndices(ids.tolist(), None, None, batches[k + 1:k + 1 + read_ahead]))
    return len(batches)


def fetch_hf(ds, batches: list[np.ndarray]) -> int:
    for ids in batches:
        ds[ids.tolist()]
    return len(batches)


def fetch_naive(paths: list[str], file_rows: np.ndarray, batches: list[np.ndarray], opener) -> int:
    """Per sample: open the file, find and read its row group, take the row."""
    starts = np.concatenate([[0], np.cumsum(file_rows)])
    for ids in batches:
        for sid in ids.tolist():
            f = int(np.searchsorted(starts, sid, side="right") - 1)
            pf = opener(paths[f])
            row, g = sid - starts[f], 0
            while row >= pf.metadata.row_group(g).num_rows:
                row -= pf.metadata.row_group(g).num_rows
                g += 1
            pf.read_row_group(g, columns=["input_ids"]).slice(row, 1).to_pylist()
    return len(batches)


def interleaved(variants: dict, repeats: int) -> dict:
    """Median seconds of each variant, the variants run in turn within each repeat (so that a change
    of the machine's load affects them alike)."""
    times: dict = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_dataset(work: str, url: str, paths: list[str], repeats: int, naive_batches: int,
                  small_cache_batches: int) -> dict:
    from varlen_cli import storage
    from varlen_cli.loader import Plan, SourceDataset

    plan_path = os.path.join(work, "plan.parquet")
    plan = Plan.open(plan_path)
    batches = [mb.sample_ids for mb in plan.microbatches(0, 0, 0, plan.num_steps)]
    sizes = [len(b) for b in batches]
    out: dict = {"microbatches": len(batches), "samples": int(sum(sizes)),
                 "small_cache_batches": min(small_cache_batches, len(batches))}
    table = pa.concat_tables([pq.read_table(p, columns=["input_ids"]) for p in paths]).combine_chunks()
    offsets, flat = table.column("input_ids").chunk(0).offsets.to_numpy(), \
        table.column("input_ids").chunk(0).values.to_numpy()
    memory = [{"input_ids": flat[offsets[i]:offsets[i + 1]]} for i in range(len(offsets) - 1)]
    variants = {}
    for where, metrics in (("local", os.path.join(work, "m-local")), ("s3", os.path.join(work, "m-s3"))):
        def fetch(order, metrics=metrics, cache=1 << 30):
            return lambda: fetch_batches(SourceDataset(metrics, columns=["input_ids"], cache_bytes=cache), order)

        variants[f"{where}_shuffled_s"] = fetch(batches)
        variants[f"{where}_sequential_s"] = fetch(sequential_batches(sizes))
        variants[f"{where}_loader_s"] = lambda m=metrics: fetch_plan(SourceDataset(m, columns=["input_ids"]),
                                                                     plan_path)
    variants["memory_loader_s"] = lambda: fetch_plan(memory, plan_path)
    out.update(interleaved(variants, repeats))
    data_bytes = table.nbytes
    for where in ("local", "s3"):
        metrics = os.path.join(work, f"m-{where}")
        ds = SourceDataset(metrics, columns=["input_ids"], cache_bytes=data_bytes // 4)
        out[f"{where}_small_cache_s"], _ = timed(lambda ds=ds: fetch_batches(ds, batches[:small_cache_batches]), 1)
    file_rows = np.array([pq.ParquetFile(p).metadata.num_rows for p in paths])
    prefix = batches[:naive_batches]
    out["naive_batches"] = len(prefix)
    out["local_naive_s"], _ = timed(lambda: fetch_naive(paths, file_rows, prefix, pq.ParquetFile), 1)
    remote = [f"{url}/{os.path.basename(p)}" for p in paths]
    out["s3_naive_s"], _ = timed(lambda: fetch_naive(remote, file_rows, prefix[:max(1, len(prefix) // 5)],
                                                     storage.parquet_file), 1)
    out["s3_naive_batches"] = max(1, len(prefix) // 5)
    try:
        import datasets
    except ImportError:
        return out
    cache_dir = os.path.join(work, "hf-cache")
    t = time.perf_counter()
    hf = datasets.load_dataset("parquet", data_files=paths, split="train", cache_dir=cache_dir)
    out["hf_load_s"] = time.perf_counter() - t
    out["hf_shuffled_s"], _ = timed(lambda: fetch_hf(hf, batches), repeats)
    return out


def bench_train(work: str, steps: int) -> dict:
    """TinyGPT (examples/tiny_lm.py defaults) on the shuffled plan, data from SourceDataset."""
    import torch
    from tiny_lm import TinyGPT, loss_sum

    from varlen_cli.loader import Plan, SourceDataset, dataloader_for_plan

    torch.manual_seed(0)
    plan = Plan.open(os.path.join(work, "plan.parquet"))
    loader = dataloader_for_plan(SourceDataset(os.path.join(work, "m-local"), columns=["input_ids"]), plan,
                                 rank=0, world_size=1, lr_scale="ignore")  # the timing's loop has no LR schedule
    model = TinyGPT(VOCAB, max(mb.seqlen for mb in plan.microbatches(0, 0, 0, plan.num_steps)) + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data_s, step_s, it = [], [], iter(loader)
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        loss = loss_sum(model(batch["input_ids"], batch["attention_mask"]), batch["labels"]) / batch["loss_tokens"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        data_s.append(t1 - t0)
        step_s.append(time.perf_counter() - t1)
    return {"steps": len(step_s), "data_ms": 1e3 * statistics.median(data_s),
            "compute_ms": 1e3 * statistics.median(step_s), "data_share": sum(data_s) / (sum(data_s) + sum(step_s))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--row-group", type=int, default=5000)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--naive-batches", type=int, default=20, help="plan microbatches the naive reads do")
    p.add_argument("--small-cache-batches", type=int, default=200,
                   help="plan microbatches read with a cache of 1/4 of the data")
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--parts", default="analyze,dataset,train", help="which measurements to run (comma-separated)")
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench-sources-")
    server = start_server()
    paths = write_corpus(os.path.join(work, "corpus"), args.rows, args.files, args.row_group)
    url = upload(os.path.join(work, "corpus"), "bench-sources")
    size_mb = sum(os.path.getsize(p) for p in paths) / 1e6
    print(f"corpus: {args.rows} rows, {args.files} Parquet files, {size_mb:.1f} MB, row groups of {args.row_group}")

    parts = set(args.parts.split(","))
    a = bench_analyze(os.path.join(work, "corpus"), url, work, args.repeats if "analyze" in parts else 1)
    if "analyze" in parts:
        print(f"analyze --length list:input_ids: local {a['local_s']:.2f} s, s3 {a['s3_s']:.2f} s "
              f"(s3/local {a['s3_s'] / a['local_s']:.2f}x)")
        report_requests(a["requests"], args.files)
    make_plan(os.path.join(work, "m-local"), os.path.join(work, "plan.parquet"), args.max_tokens)
    if "dataset" in parts:
        report_dataset(bench_dataset(work, url, paths, args.repeats, args.naive_batches, args.small_cache_batches),
                       args.max_tokens)
    if "train" in parts:
        t = bench_train(work, args.train_steps)
        print(f"train (TinyGPT, {t['steps']} microbatches): data {t['data_ms']:.1f} ms vs compute "
              f"{t['compute_ms']:.1f} ms per microbatch (median); data is {100 * t['data_share']:.1f}% of the loop")
    server.stdin.close()
    server.wait(timeout=30)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def report_dataset(d: dict, max_tokens: int) -> None:
    n = d["microbatches"]
    print(f"plan: {n} microbatches, {d['samples']} samples, order random, max-tokens {max_tokens}")
    print("| reader | where | microbatches/s | vs sequential (same store) |")
    print("|---|---|---|---|")
    for where in ("local", "s3"):
        seq = n / d[f"{where}_sequential_s"]
        rows = [("SourceDataset, shuffled plan", n / d[f"{where}_shuffled_s"]),
                ("SourceDataset, same sizes in sample_id order (sequential)", seq),
                ("SourceDataset, shuffled, whole dataloader_for_plan (+ PadCollate)", n / d[f"{where}_loader_s"]),
                ("SourceDataset, shuffled, cache = 1/4 of the data",
                 d["small_cache_batches"] / d[f"{where}_small_cache_s"]),
                ("naive per-sample pyarrow read",
                 d["naive_batches" if where == "local" else "s3_naive_batches"] / d[f"{where}_naive_s"])]
        for name, rate in rows:
            print(f"| {name} | {where} | {rate:.1f} | {rate / seq:.2f}x |")
    print(f"| in-memory list of numpy arrays, whole dataloader_for_plan (+ PadCollate) | memory | "
          f"{n / d['memory_loader_s']:.1f} | - |")
    if "hf_shuffled_s" in d:
        rate = n / d["hf_shuffled_s"]
        print(f"| HF datasets ds[ids], shuffled (after a {d['hf_load_s']:.1f} s load_dataset) | local | {rate:.1f} | "
              f"{rate / (n / d['local_sequential_s']):.2f}x |")


if __name__ == "__main__":
    main()
