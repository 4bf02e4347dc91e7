"""Time DeepSpeed's ``Dist.sample_sort`` (in data_analyzer.py) (the public sample sort that ``varlen
sort`` improves on) and report its balance, for comparison with ``bench_sort.py``.

Run it with a Python that has deepspeed installed (a separate venv: ``DS_BUILD_OPS=0 pip install
--no-build-isolation deepspeed`` after ``torch==2.13.0``)::

    /work/venvs/sort-deepspeed/bin/python benchmarks/bench_sort_deepspeed.py --rows 1000000 --world 1 --keys zipf
    /work/venvs/sort-deepspeed/bin/python benchmarks/bench_sort_deepspeed.py --rows 100000 --world 2 --keys equal

Each rank holds rows/world rows of (difficulty, sample_id) as an int64 tensor [n, 2]; the keys are
the same Zipf lengths as bench_sort.py, or all equal. Prints seconds (the slowest rank), rows per
rank after the sort, and balance (max / mean). Only the sort is timed (no Parquet read/write).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, rows: int, keys: str, out) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # deepspeed.comm wraps the torch group
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import Dist as DSDist

    lo, hi = rows * rank // world, rows * (rank + 1) // world
    rng = np.random.default_rng(rank)
    if keys == "equal":
        diff = np.full(hi - lo, 7, dtype=np.int64)
    else:
        diff = np.minimum(rng.zipf(1.3, hi - lo), 100_000).astype(np.int64)
    tensor = torch.from_numpy(np.stack([diff, np.arange(lo, hi, dtype=np.int64)], axis=1))
    dist.barrier()
    t0 = time.perf_counter()
    result = DSDist.sample_sort(tensor, None, world)
    secs = time.perf_counter() - t0
    got = [None] * world
    dist.all_gather_object(got, (len(result), secs))
    if rank == 0:
        out.put(got)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--keys", choices=["zipf", "equal"], default="zipf")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    print("command: " + " ".join([os.path.basename(sys.executable)] + sys.argv))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args.rows, args.keys, q))
             for r in range(args.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    got = q.get()
    rows = [g[0] for g in got]
    secs = max(g[1] for g in got)
    mean = sum(rows) / len(rows)
    print(f"deepspeed sample_sort: rows={args.rows:,} world={args.world} keys={args.keys} seconds={secs:.2f} "
          f"rows/s={args.rows / secs:,.0f} rows_per_rank={rows} balance={max(rows) / mean:.3f}")


if __name__ == "__main__":
    main()
