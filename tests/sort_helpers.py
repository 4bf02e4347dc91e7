"""Builders for ``varlen sort`` tests: metrics directories written by hand, key distributions, a
reference order computed independently of the packed keys, and simulated ranks of the sample sort."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from varlen_cli.runtime import artifacts
from varlen_cli.sort import keys as sk


def write_metrics(path, columns: dict, parts=1, row_group_size: int = 1000, schema: pa.Schema | None = None,
                  with_stats: bool = True) -> str:
    """A metrics directory holding ``columns`` (name -> numpy array), split into ``parts`` parts
    (a count, or a list of row counts)."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    if schema is None:
        types = {"sample_id": pa.int64(), "length": pa.int64(), "difficulty": pa.float64()}
        schema = pa.schema([(name, types.get(name) or pa.from_numpy_dtype(np.asarray(v).dtype))
                            for name, v in columns.items()])
    table = pa.table({f.name: pa.array(columns[f.name], type=f.type) for f in schema}, schema=schema)
    n = len(table)
    if isinstance(parts, int):
        sizes = [artifacts.row_bounds(n, parts, r) for r in range(parts)]
        sizes = [b - a for a, b in sizes]
    else:
        sizes = list(parts)
        assert sum(sizes) == n
    entries, offset = [], 0
    for k, size in enumerate(sizes):
        name = artifacts.part_name(k)
        pq.write_table(table.slice(offset, size), os.path.join(path, name), row_group_size=row_group_size)
        entries.append({"file": name, "rows": size})
        offset += size
    manifest = {
        "format": artifacts.METRICS_FORMAT,
        "format_version": artifacts.FORMAT_VERSION,
        "kind": "metrics",
        "stage": "analyze",
        "config": {"sources": ["hand-made"]},
        "world_size": 1,
        "dataset": {"digest": f"hand-{n}", "root": "/", "num_files": 0, "num_rows": n, "files": []},
        "artifact_id": f"hand-{n}-{len(sizes)}",
        "order": {"by": ["sample_id"], "descending": False},
        "columns": {f.name: str(f.type) for f in schema},
        "num_rows": n,
        "parts": entries,
    }
    if with_stats:
        manifest["stats"] = {"length": {"count": n}, "difficulty": {"count": n}}
    with open(os.path.join(path, artifacts.MANIFEST_NAME), "w") as fh:
        json.dump(manifest, fh)
    return path


def metrics_columns(difficulty, lengths=None, ids=None) -> dict:
    difficulty = np.asarray(difficulty, dtype=np.float64)
    n = len(difficulty)
    if lengths is None:
        lengths = np.where(np.isfinite(difficulty), np.abs(np.nan_to_num(difficulty)), 0).astype(np.int64)
    return {"sample_id": np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64),
            "length": np.asarray(lengths, dtype=np.int64), "difficulty": difficulty}


# -- the key distributions ----------------------------------------------------------------
def distribution(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "all-equal":
        return np.full(n, 7.0)
    if kind == "90%-one-value":
        d = rng.integers(1, 5000, n).astype(np.float64)
        d[rng.random(n) < 0.9] = 512.0
        return d
    if kind == "zipf":
        return np.minimum(rng.zipf(1.3, n), 1 << 20).astype(np.float64)
    if kind == "sorted":
        return np.sort(rng.integers(1, 4096, n)).astype(np.float64)
    if kind == "reverse":
        return np.sort(rng.integers(1, 4096, n))[::-1].astype(np.float64)
    raise ValueError(kind)


DISTRIBUTIONS = ("all-equal", "90%-one-value", "zipf", "sorted", "reverse")


# -- reference order: plain Python tuples, no packing ---------------------------------------------
def reference_order(columns: dict, by, descending=False, ties="id", seed=0, nan="error") -> np.ndarray:
    """Row indices in sorted order, from Python's sort on explicit key tuples (small inputs only)."""
    ids = columns["sample_id"]
    tie = sk.shuffle_hash(ids, seed) if ties == "shuffle" else ids
    keys = []
    for i in range(len(ids)):
        key = []
        for name in by:
            v = columns[name][i].item()
            if isinstance(v, float) and math.isnan(v):
                key.append((1, 0))
            else:
                v = int(v) if isinstance(v, (bool, int)) else v
                key.append((0, -v if descending else v))
        key.append(int(tie[i]))
        keys.append(tuple(key))
    return np.array(sorted(range(len(ids)), key=keys.__getitem__), dtype=np.int64)


# -- simulated ranks ---------------------------------------------------------------------------------
def simulate(columns: dict, world_size: int, spec: sk.KeySpec):
    """The sample sort over ``world_size`` simulated ranks in this process, with the library's key,
    splitter and merge functions. Returns (per-rank output columns, per-rank row counts)."""
    n = len(columns["sample_id"])
    P = world_size
    bounds = [artifacts.row_bounds(n, P, r) for r in range(P)]
    local = [{k: v[a:b] for k, v in columns.items()} for a, b in bounds]
    stats = sk.merge_stats([sk.local_stats(spec, c) for c in local])
    sk.check_nans(spec, stats, "test")
    lay = sk.layout(spec, stats)
    sorted_words, sorted_cols = [], []
    for c in local:
        m = len(c["sample_id"])
        words = sk.pack(spec, stats, lay, c, m)
        order = sk.lex_order(words)
        sorted_words.append([w[order] for w in words])
        sorted_cols.append({k: v[order] for k, v in c.items()})
    if n == 0:
        return sorted_cols, [0] * P
    targets = sk.split_targets(n, P)
    positions = sk.split_positions(sorted_words, targets, sk.word_bounds(lay), reduce=lambda x: x)
    sends = [sk.send_counts(p, len(w[0])) for p, w in zip(positions, sorted_words)]
    outs, rows = [], []
    for dst in range(P):
        runs_w, runs_c = [], []
        for src in range(P):
            a = int(sends[src][:dst].sum())
            b = a + int(sends[src][dst])
            runs_w.append([w[a:b] for w in sorted_words[src]])
            runs_c.append({k: v[a:b] for k, v in sorted_cols[src].items()})
        words = [np.concatenate([r[j] for r in runs_w]) for j in range(lay.words)]
        order = sk.lex_order(words, runs=True)
        outs.append({k: np.concatenate([r[k] for r in runs_c])[order] for k in columns})
        rows.append(len(order))
    return outs, rows


def concat(outs: list, name: str) -> np.ndarray:
    return np.concatenate([o[name] for o in outs])


def read_sorted(path) -> pa.Table:
    """A sorted directory's rows: its parts concatenated in name order."""
    with open(os.path.join(str(path), artifacts.MANIFEST_NAME)) as fh:
        manifest = json.load(fh)
    tables = [pq.read_table(os.path.join(str(path), p["file"])) for p in manifest["parts"]]
    return pa.concat_tables(tables) if tables else None


def manifest_of(path) -> dict:
    with open(os.path.join(str(path), artifacts.MANIFEST_NAME)) as fh:
        return json.load(fh)


def leftovers(directory) -> list:
    """Names in ``directory`` (temporary outputs start with '.')."""
    return sorted(os.listdir(str(directory)))


# -- several sorts in one launch of worker processes ------------------------------------------------
def sort_many(configs: list) -> list:
    """Entry for ``dist.launch``: run several sorts in the same worker processes (one process group
    that every sort reuses: the launcher's torch-free local group, or a gloo group created here under
    ``VARLEN_LAUNCHER=torch``), to keep multi-process tests fast."""
    from varlen_cli.runtime import local_group
    from varlen_cli.runtime.executor import run_in_session
    from varlen_cli.sort import run_in_group

    if local_group.current() is not None:
        return [run_in_session(run_in_group, c) for c in configs]
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    try:
        results = [run_in_session(run_in_group, c) for c in configs]
        tdist.barrier()  # every rank is done with the group before any tears it down (a SIGABRT at exit)
        return results
    finally:
        tdist.destroy_process_group()  # the elastic worker then ends with os._exit (multiprocessing)
