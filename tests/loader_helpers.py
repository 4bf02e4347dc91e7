"""Test fixtures for the loader: a small reference planner writing valid plan files.

It follows docs/formats.md (columns, row order, ``varlen`` schema metadata) with simple rules, so
the loader's tests do not depend on ``varlen plan``'s heuristics; the end-to-end tests also use
real plans from ``varlen_cli.plan`` when it is importable.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZED = os.path.join(ROOT, "sample_data", "tokenized.parquet")


def round_up(x, m):
    return -(-np.asarray(x) // m) * m


def _microbatches_dynamic(ids, lengths, max_tokens, pad_multiple):
    """Greedy over ids sorted by length: add while count x padded longest fits the budget."""
    out, cur, longest = [], [], 0
    for i in ids:
        t = int(round_up(max(lengths[i], 1), pad_multiple))
        if cur and (len(cur) + 1) * max(longest, t) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(int(i))
        longest = max(longest, t)
    if cur:
        out.append(cur)
    return out


def _shape_levels(lengths, num_shapes, pad_multiple):
    qs = np.quantile(lengths, np.linspace(0, 1, num_shapes + 1)[1:])
    levels = sorted(set(int(round_up(max(q, 1), pad_multiple)) for q in qs))
    return levels


def write_plan(path, lengths, *, dp=1, grad_accum=1, epochs=1, max_tokens=512, order="random", seed=0,
               static_shapes=False, num_shapes=3, compile_warmup=False, pad_multiple=8, lr_scaling="linear",
               base_batch_size=None, row_group_steps=3, num_rows=None, extra_meta=None):
    """Write a plan for a dataset with these sample ``lengths``; returns the metadata dict."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    rng = np.random.default_rng(seed)
    per_step = dp * grad_accum
    too_long = np.flatnonzero(round_up(np.maximum(lengths, 1), pad_multiple) > max_tokens)
    keep = np.setdiff1d(np.arange(n), too_long)
    levels = _shape_levels(lengths[keep], num_shapes, pad_multiple) if static_shapes else []
    shapes = [[max_tokens // t, t] for t in levels]
    rows, steps_per_epoch, tail = [], [], []
    step = 0
    warmup_steps = 0
    for epoch in range(epochs):
        ids = keep[np.argsort(lengths[keep], kind="stable")]
        if static_shapes:
            level_of = np.searchsorted(levels, round_up(np.maximum(lengths[ids], 1), pad_multiple))
            mbs = []
            for k, (b, _t) in enumerate(shapes):
                group = ids[level_of == k]
                mbs += [[int(x) for x in group[j:j + b]] for j in range(0, len(group), b)]
        else:
            mbs = _microbatches_dynamic(ids, lengths, max_tokens, pad_multiple)
        while len(mbs) % per_step:
            big = max(range(len(mbs)), key=lambda j: len(mbs[j]))
            if len(mbs[big]) < 2:
                tail += mbs.pop()
                continue
            half = len(mbs[big]) // 2
            mbs[big:big + 1] = [mbs[big][:half], mbs[big][half:]]
        if order in ("random", "bucket-shuffle"):
            mbs = [mbs[j] for j in rng.permutation(len(mbs))]
        first = []
        if static_shapes and compile_warmup and epoch == 0:
            warmup_steps = math.ceil(len(shapes) / grad_accum)
            def shape_of(mb):
                return int(np.searchsorted(levels, round_up(max(lengths[mb].max(), 1), pad_multiple)))

            for w in range(warmup_steps):
                for _ in range(dp):
                    for m in range(grad_accum):
                        want = (w * grad_accum + m) % len(shapes)
                        j = next(j for j, mb in enumerate(mbs) if shape_of(mb) == want)
                        first.append(mbs.pop(j))
        mbs = first + mbs
        nsteps = len(mbs) // per_step
        steps_per_epoch.append(nsteps)
        for s in range(nsteps):
            chunk = mbs[s * per_step:(s + 1) * per_step]
            step_samples = sum(len(mb) for mb in chunk)
            step_tokens = int(sum(lengths[mb].sum() for mb in chunk))
            for j, mb in enumerate(chunk):
                t = int(round_up(max(lengths[mb].max(), 1), pad_multiple))
                if static_shapes:
                    shape_id = levels.index(t) if t in levels else int(np.searchsorted(levels, t))
                    b, t = shapes[shape_id]
                else:
                    shape_id, b = -1, len(mb)
                rows.append(dict(epoch=epoch, step=step, rank=j // grad_accum, micro=j % grad_accum,
                                 sample_ids=mb, num_samples=len(mb), seqlen=t, batch_size=b,
                                 tokens=int(lengths[mb].sum()), shape_id=shape_id, step_samples=step_samples,
                                 step_tokens=step_tokens))
            step += 1
    if not static_shapes:  # shapes of dynamic plans: distinct T, B = 0
        ts = sorted({r["seqlen"] for r in rows})
        shapes = [[0, t] for t in ts]
        for r in rows:
            r["shape_id"] = ts.index(r["seqlen"])
    step_samples = np.array([r["step_samples"] for r in rows[::per_step]], dtype=np.float64)
    base = float(base_batch_size or max(1.0, round(float(step_samples.mean())) if len(step_samples) else 1.0))
    ratio = step_samples / base
    scales = {"linear": ratio, "sqrt": np.sqrt(ratio), "none": np.ones_like(ratio)}[lr_scaling]
    for i, r in enumerate(rows):
        r["lr_scale"] = float(scales[i // per_step])
    columns = {
        "epoch": pa.array([r["epoch"] for r in rows], pa.int32()),
        "step": pa.array([r["step"] for r in rows], pa.int64()),
        "rank": pa.array([r["rank"] for r in rows], pa.int32()),
        "micro": pa.array([r["micro"] for r in rows], pa.int32()),
        "sample_ids": pa.array([r["sample_ids"] for r in rows], pa.list_(pa.int64())),
        "num_samples": pa.array([r["num_samples"] for r in rows], pa.int32()),
        "seqlen": pa.array([r["seqlen"] for r in rows], pa.int32()),
        "batch_size": pa.array([r["batch_size"] for r in rows], pa.int32()),
        "tokens": pa.array([r["tokens"] for r in rows], pa.int64()),
        "lr_scale": pa.array([r["lr_scale"] for r in rows], pa.float64()),
        "shape_id": pa.array([r["shape_id"] for r in rows], pa.int32()),
        "step_samples": pa.array([r["step_samples"] for r in rows], pa.int64()),
        "step_tokens": pa.array([r["step_tokens"] for r in rows], pa.int64()),
    }
    meta = {
        "format": "varlen-plan", "format_version": 1, "varlen_version": "test", "created_at": "test",
        "config": {"max_tokens": max_tokens, "dp": dp, "grad_accum": grad_accum, "order": order, "seed": seed,
                   "epochs": epochs, "static_shapes": static_shapes, "compile_warmup": compile_warmup},
        "input": {"path": "test", "kind": "metrics", "artifact_id": "test",
                  "num_rows": n if num_rows is None else num_rows,
                  "dataset_digest": "test"},
        "dp": dp, "grad_accum": grad_accum, "epochs": epochs, "num_steps": step, "steps_per_epoch": steps_per_epoch,
        "num_microbatches": len(rows), "shapes": shapes, "warmup_steps": warmup_steps,
        "base_batch_size": base, "lr_scaling": lr_scaling, "lr_scale_by": "samples", "packing": None,
        "dropped": {"count": int(len(too_long) + len(tail)),
                    "reason": {"too_long": int(len(too_long)), "tail": len(tail)},
                    "sample_ids": sorted(int(x) for x in list(too_long) + tail)},
        "stats": {"steps": step, "microbatches": len(rows)},
    }
    meta.update(extra_meta or {})
    table = pa.table(columns).replace_schema_metadata({"varlen": json.dumps(meta)})
    pq.write_table(table, path, row_group_size=max(1, row_group_steps * per_step))
    return meta


def token_lengths(path=TOKENIZED, column="input_ids"):
    import pyarrow.compute as pc

    return pc.list_value_length(pq.read_table(path, columns=[column]).column(column)).to_numpy()


class SyntheticTokens:
    """A map-style dataset whose sample ``i`` has ``lengths[i]`` tokens that encode ``i``."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": (np.arange(self.lengths[i]) + 1000 * int(i)) % 50021 + 1}


def real_plan(tmp_path, source=TOKENIZED, **options):
    """A plan made by ``varlen analyze`` + ``varlen_cli.plan`` on ``source`` (a broken import fails the test)."""
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.plan import PlanConfig, plan

    metrics = os.path.join(str(tmp_path), "metrics")
    if not os.path.exists(metrics):
        analyze(AnalyzeConfig(sources=(source,), output=metrics, length="list:input_ids", progress=False))
    name = "-".join(f"{k}={v}" for k, v in sorted(options.items()))
    out = os.path.join(str(tmp_path), f"plan-{name}.parquet")
    plan(PlanConfig(input=metrics, output=out, overwrite=True, **options))
    return out
