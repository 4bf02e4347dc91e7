"""Fixtures for the plan tests: metrics and sorted directories written directly per docs/formats.md,
and invariant checks on a written plan."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from varlen_cli.runtime import artifacts


def write_metrics(path, lengths, difficulty=None, *, sorted_by=None, parts=1, split_points=None, descending=False,
                  targets=None):
    """A metrics directory (sample_id order) or, with ``sorted_by`` ("length" or "difficulty"), a
    sorted directory ordered by (key, sample_id), split into ``parts`` parts (or at ``split_points``);
    ``targets``: a ``target_length`` column (per sample id), as ``analyze --target-length`` writes."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    difficulty = lengths.astype(np.float64) if difficulty is None else np.asarray(difficulty, dtype=np.float64)
    ids = np.arange(n, dtype=np.int64)
    targets = np.asarray(targets, dtype=np.int64) if targets is not None else None
    if sorted_by is not None:
        key = lengths if sorted_by == "length" else difficulty
        order = np.lexsort((ids, -key if descending else key))
        ids, lengths, difficulty = ids[order], lengths[order], difficulty[order]
        targets = targets[order] if targets is not None else None
    os.makedirs(path, exist_ok=True)
    if split_points is None:
        split_points = [n * k // parts for k in range(1, parts)]
    bounds = [0] + list(split_points) + [n]
    part_list = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        t = pa.table({"sample_id": ids[lo:hi], "length": lengths[lo:hi], "difficulty": difficulty[lo:hi],
                      **({"target_length": targets[lo:hi]} if targets is not None else {})})
        pq.write_table(t, os.path.join(path, artifacts.part_name(k)))
        part_list.append({"file": artifacts.part_name(k), "rows": hi - lo})
    manifest = {
        "format": artifacts.METRICS_FORMAT, "format_version": 1,
        "kind": "sorted" if sorted_by else "metrics", "stage": "sort" if sorted_by else "analyze",
        "config": {}, "world_size": len(part_list),
        "dataset": {"digest": "test", "root": "/", "num_files": 1, "num_rows": n, "files": []},
        "artifact_id": f"test-{sorted_by}-{n}",
        "order": {"by": [sorted_by or "sample_id"], "descending": descending, "ties": "id", "seed": 0},
        "columns": {"sample_id": "int64", "length": "int64", "difficulty": "float64",
                    **({"target_length": "int64"} if targets is not None else {})},
        "num_rows": n, "parts": part_list, "stats": {},
    }
    with open(os.path.join(path, artifacts.MANIFEST_NAME), "w") as fh:
        json.dump(manifest, fh)
    return str(path)


def read_plan(path):
    t = pq.read_table(path)
    md = json.loads(pq.read_schema(path).metadata[b"varlen"])
    return t, md


def check_plan(path, lengths, *, max_tokens=None, dp=1, grad_accum=1, attention_cost=0.0, max_samples=None,
               packed=False, seq_len=None):
    """The invariants every plan keeps; returns (table as dict of lists, metadata)."""
    t, md = read_plan(path)
    d = t.to_pydict()
    lengths = np.asarray(lengths)
    m = len(d["step"])
    slots = dp * grad_accum
    assert md["format"] == "varlen-plan"
    assert m == md["num_microbatches"] and m % slots == 0
    steps = np.array(d["step"])
    ranks = np.array(d["rank"])
    micro = np.array(d["micro"])
    # (step, rank, micro) order, complete grid
    assert m == md["num_steps"] * slots
    assert (steps == np.repeat(np.arange(md["num_steps"]), slots)).all()
    assert (ranks == np.tile(np.repeat(np.arange(dp), grad_accum), md["num_steps"])).all()
    assert (micro == np.tile(np.arange(grad_accum), md["num_steps"] * dp)).all()
    ids = d["sample_ids"]
    b = np.array(d["batch_size"], dtype=np.int64)
    T = np.array(d["seqlen"], dtype=np.int64)
    for k in range(m):
        assert d["num_samples"][k] == len(ids[k]) >= 1
        assert b[k] >= d["num_samples"][k] if not packed else True
        if packed:
            assert sum(d["sample_lengths"][k]) == d["tokens"][k]
            rows = np.array(d["sample_rows"][k])
            assert (np.diff(rows) >= 0).all() and rows.max() < b[k]
            per_row = np.bincount(rows, weights=d["sample_lengths"][k])
            assert per_row.max() <= T[k]
        else:
            assert max(lengths[ids[k]]) <= T[k]
            assert d["tokens"][k] == int(lengths[ids[k]].sum())
    if max_tokens is not None:
        cost = b * T + attention_cost * b * T * T
        assert (cost <= max_tokens * (1 + 1e-12)).all(), cost.max()
    if max_samples is not None:
        assert (b <= max_samples).all()
    # step columns and lr
    st = {}
    for k in range(m):
        s = st.setdefault(d["step"][k], [0, 0, set()])
        if packed and "sample_starts" in d:  # a split sample counts once, with its last chunk
            ends = np.asarray(d["sample_starts"][k]) + np.asarray(d["sample_lengths"][k])
            s[0] += int(np.count_nonzero(ends == lengths[np.asarray(ids[k], dtype=np.int64)]))
        else:
            s[0] += d["num_samples"][k]
        s[1] += d["tokens"][k]
        s[2].add(d["lr_scale"][k])
    for k in range(m):
        s = st[d["step"][k]]
        assert d["step_samples"][k] == s[0] and d["step_tokens"][k] == s[1] and len(s[2]) == 1
    base = md["base_batch_size"]
    for k in range(m):
        # step_loss_tokens is checked against the lengths in tests/plan/test_loss_tokens.py
        bb = {"tokens": d["step_tokens"], "loss-tokens": d["step_loss_tokens"]}.get(md["lr_scale_by"],
                                                                                   d["step_samples"])[k]
        if base == 0:
            assert d["lr_scale"][k] == 1.0
            continue
        want = {"linear": bb / base, "sqrt": (bb / base) ** 0.5, "none": 1.0}[md["lr_scaling"]]
        assert abs(d["lr_scale"][k] - want) < 1e-9
    # shapes
    shapes = md["shapes"]
    for k in range(m):
        sb, stt = shapes[d["shape_id"][k]]
        assert stt == T[k] and (sb == 0 or sb == b[k])
    return d, md


def epoch_ids(d, epoch):
    out = []
    for e, ids in zip(d["epoch"], d["sample_ids"]):
        if e == epoch:
            out.extend(ids)
    return out
