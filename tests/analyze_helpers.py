"""Builders for the source formats ``varlen analyze`` reads, and a helper to run it and read the result."""

from __future__ import annotations

import gzip
import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from varlen_cli.analyze import AnalyzeConfig, analyze
from varlen_cli.runtime import artifacts

WORDS = ["alpha", "béta", "gamma", "δέλτα", "ε", "zeta", "eta", "théta", "iota", "kappa", "日本語", "x"]


def make_texts(n: int, seed: int = 0) -> list[str]:
    """Varied texts: several words, non-ASCII, some empty, tabs and repeated spaces."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(0, 30))
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), size=k)]
        sep = "  " if i % 7 == 0 else ("\t" if i % 11 == 0 else " ")
        out.append(sep.join(words))
    return out


def text_table(n: int, seed: int = 0, first_id: int = 0) -> pa.Table:
    texts = make_texts(n, seed)
    return pa.table({"id": pa.array(np.arange(first_id, first_id + n), pa.int64()), "text": texts})


def write_parquet(table: pa.Table, path, row_group_size: int = 37) -> str:
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def write_jsonl(table: pa.Table, path, gz: bool = False, blank_lines: bool = False) -> str:
    lines = []
    for i, row in enumerate(table.to_pylist()):
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        if blank_lines and i % 5 == 0:
            lines.append("\n")
    data = "".join(lines).encode()
    if gz:
        with gzip.open(str(path), "wb") as fh:
            fh.write(data)
    else:
        with open(str(path), "wb") as fh:
            fh.write(data)
    return str(path)


def write_arrow_file(table: pa.Table, path, batch_rows: int = 29) -> str:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return str(path)


def write_arrow_stream(table: pa.Table, path, batch_rows: int = 29) -> str:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return str(path)


def write_hf_save_to_disk(table: pa.Table, directory, num_shards: int = 2, batch_rows: int = 50) -> str:
    """The layout ``datasets.Dataset.save_to_disk`` writes: Arrow stream shards, state.json, dataset_info.json."""
    os.makedirs(str(directory), exist_ok=True)
    bounds = np.linspace(0, len(table), num_shards + 1).astype(int)
    names = []
    for k in range(num_shards):
        name = f"data-{k:05d}-of-{num_shards:05d}.arrow"
        write_arrow_stream(table.slice(bounds[k], bounds[k + 1] - bounds[k]), os.path.join(str(directory), name),
                           batch_rows=batch_rows)
        names.append(name)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    with open(os.path.join(str(directory), "state.json"), "w") as fh:
        json.dump(state, fh)
    features = {name: {"dtype": "int64" if pa.types.is_integer(t) else "string", "_type": "Value"}
                for name, t in zip(table.schema.names, table.schema.types)}
    with open(os.path.join(str(directory), "dataset_info.json"), "w") as fh:
        json.dump({"citation": "", "description": "", "features": features, "homepage": "", "license": ""}, fh)
    return str(directory)


def write_text(lines: list[str], path, newline: str = "\n", trailing: bool = True) -> str:
    data = newline.join(lines) + (newline if trailing else "")
    with open(str(path), "wb") as fh:
        fh.write(data.encode())
    return str(path)


def run(out, *sources, **options):
    """analyze(...) with progress off; returns (result, concatenated table in part order)."""
    options.setdefault("progress", False)
    result = analyze(AnalyzeConfig(sources=tuple(str(s) for s in sources), output=str(out), **options))
    return result, read_metrics(out)


def read_metrics(out) -> pa.Table:
    manifest = artifacts.read_manifest(str(out))
    tables = [pq.read_table(os.path.join(str(out), p["file"])) for p in manifest["parts"]]
    return pa.concat_tables(tables)


def ipc_bytes(table: pa.Table) -> bytes:
    """The table as one Arrow IPC stream: equal bytes mean equal schema, values and row order."""
    sink = io.BytesIO()
    table = table.combine_chunks()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1 << 30)
    return sink.getvalue()


def leftovers(parent) -> list[str]:
    """Entries a failed run may have left in the output's folder (final dir or temporary dir)."""
    return sorted(name for name in os.listdir(str(parent)) if name.startswith(("out", ".out")))
