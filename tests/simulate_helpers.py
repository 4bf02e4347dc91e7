"""Helpers of the simulate tests: a small plan writer and a brute-force event simulation written
from docs/schedules.md, independently of varlen_cli.schedule's job tables and vectorised scheduler."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_plan(path, batch_size, seqlen, *, dp=1, grad_accum=None):
    """A plan file whose step k, position i (rank i // grad_accum) has shape batch_size[k, i] x seqlen[k, i]."""
    batch_size = np.asarray(batch_size, dtype=np.int32)
    seqlen = np.broadcast_to(np.asarray(seqlen, dtype=np.int32), batch_size.shape)
    steps, per_step = batch_size.shape
    grad_accum = per_step // dp if grad_accum is None else grad_accum
    assert dp * grad_accum == per_step
    rows = steps * per_step
    pos = np.arange(rows)
    b, t = batch_size.reshape(-1), seqlen.reshape(-1)
    table = pa.table({
        "epoch": pa.array(np.zeros(rows, np.int32)), "step": pa.array(pos // per_step),
        "rank": pa.array((pos % per_step // grad_accum).astype(np.int32)),
        "micro": pa.array((pos % grad_accum).astype(np.int32)),
        "sample_ids": pa.array([[int(i)] for i in pos], type=pa.list_(pa.int64())),
        "num_samples": pa.array(np.ones(rows, np.int32)), "seqlen": pa.array(t), "batch_size": pa.array(b),
        "tokens": pa.array(b.astype(np.int64) * t), "lr_scale": pa.array(np.ones(rows)),
        "shape_id": pa.array(np.zeros(rows, np.int32)), "step_samples": pa.array(np.full(rows, per_step)),
        "step_tokens": pa.array(np.zeros(rows, np.int64)),
    })
    meta = {"format": "varlen-plan", "format_version": 1, "dp": dp, "grad_accum": grad_accum, "epochs": 1,
            "num_steps": steps, "steps_per_epoch": [steps], "num_microbatches": rows}
    pq.write_table(table.replace_schema_metadata({b"varlen": json.dumps(meta)}), path)
    return str(path)


def brute_force(scheme, costs, tokens, r):
    """Event-by-event greedy schedule of one step: ``{(s, b, d): (worker, start, end)}``, peak activation
    and weight fetches per worker. Jobs are tuples; dependencies, the flush and the in-flight limit are
    checked literally at every event time (no job tables, no chains)."""
    S, N = scheme.stages, scheme.microbatches
    n = N // scheme.units
    jobs = [(s, b, d) for d in "FB" for s in range(S) for b in range(N)]
    order = {job: k for k, job in enumerate(jobs)}
    worker = {job: scheme.compute(*job) for job in jobs}
    key = {job: (scheme.priority(*job), order[job]) for job in jobs}
    dur = {(s, b, d): costs[b] * (1.0 if d == "F" else r) for s, b, d in jobs}

    def preds(job):
        s, b, d = job
        if d == "F":
            return [(s - 1, b, "F")] if s else []
        out = [(s, b, "F")] + ([(s + 1, b, "B")] if s < S - 1 else [])
        if scheme.flush and s == S - 1:
            out += [(S - 1, x, "F") for x in range(N) if x // n == b // n]
        return out

    start, end = {}, {}
    t = 0.0
    while len(start) < len(jobs):
        for w in range(scheme.workers):
            if any(start[j] <= t < end[j] for j in start if worker[j] == w):
                continue  # busy
            ready = []
            for job in jobs:
                if job in start or worker[job] != w or not all(p in end and end[p] <= t for p in preds(job)):
                    continue
                s, b, d = job
                if d == "F" and scheme.in_flight is not None and scheme.in_flight(s) is not None:
                    unit = [x for x in range(N) if x // n == b // n]
                    begun = sum((s, x, "F") in start for x in unit)
                    freed = sum((s, x, "B") in end and end[(s, x, "B")] <= t for x in unit)
                    if begun - freed >= scheme.in_flight(s):
                        continue
                ready.append(job)
            if ready:
                job = min(ready, key=key.get)
                start[job], end[job] = t, t + dur[job]
        later = [e for e in end.values() if e > t]
        if len(start) < len(jobs):
            assert later, "deadlock"
            t = min(later)
    peak, fetches = np.zeros(scheme.workers), np.zeros(scheme.workers)
    for w in range(scheme.workers):
        held = [(start[(s, b, "F")], end[(s, b, "B")], tokens[b]) for s in range(S) for b in range(N)
                if worker[(s, b, "F")] == w]
        for a, _, _ in held:
            peak[w] = max(peak[w], sum(tok for a2, e2, tok in held if a2 <= a < e2))
        mine = sorted((start[j], j) for j in jobs if worker[j] == w)
        prev = None
        for _, (s, _b, _d) in mine:
            if w not in scheme.stored_on(s) and s != prev:
                fetches[w] += 1
            prev = s
    return {j: (worker[j], start[j], end[j]) for j in jobs}, peak, fetches
