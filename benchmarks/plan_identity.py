"""Are two versions of the planner's plans identical? Fingerprints of the plan tables over many configurations.

Run once per version (PYTHONPATH picks the code), then compare the two JSON files:

    PYTHONPATH=/path/to/old python benchmarks/plan_identity.py run --work /tmp/pid --out old.json
    PYTHONPATH=/path/to/new python benchmarks/plan_identity.py run --work /tmp/pid --out new.json
    python benchmarks/plan_identity.py compare old.json new.json [--ignore-keys budget,cost_model]

``--parents DIR`` (with ``run``): the extensions and replans start from the parent plans in ``DIR``
(``NAME.parent.parquet``, e.g. a copy of the old run's ``WORK/plans``) instead of planning their own, so
both versions extend and replan the same files.

Beside plans of one input, the grid holds ``--mix`` plans (sources in id order and sorted, with and
without ``target_length``, fractional weights), ``--extend`` of plain and mixture plans, and
``varlen replan`` of plain and mixture plans (one replan from a step where a ``--split-long`` sample
has chunks on both sides). Every configuration names ``lr_scaling``: the grid compares plans, not
defaults.

Each configuration's fingerprint: a SHA-256 of every column's values (as int64/float64 per row,
list columns flattened with their lengths), the schema's column names and types, and the key-value
metadata with the volatile keys removed (creation time, seconds). The inputs are written once
under ``--work`` (fixed seeds), so both runs plan exactly the same files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

VOLATILE = ("created_at",)


def _write_input(path: str, ids: np.ndarray, lengths: np.ndarray, kind: str, row_group: int,
                 difficulty: np.ndarray | None = None, target: np.ndarray | None = None) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from varlen_cli.runtime import artifacts

    if os.path.exists(os.path.join(path, artifacts.MANIFEST_NAME)):
        return path
    os.makedirs(path, exist_ok=True)
    parts = []
    half = len(ids) // 2
    for k, (lo, hi) in enumerate(((0, half), (half, len(ids)))):  # two parts, several row groups each
        diff = (lengths if difficulty is None else difficulty)[lo:hi].astype(np.float64)
        cols = {"sample_id": ids[lo:hi], "length": lengths[lo:hi], "difficulty": diff}
        if target is not None:
            cols["target_length"] = target[lo:hi]
        t = pa.table(cols)
        pq.write_table(t, os.path.join(path, artifacts.part_name(k)), row_group_size=row_group)
        parts.append({"file": artifacts.part_name(k), "rows": int(hi - lo)})
    manifest = {"format": artifacts.METRICS_FORMAT, "format_version": 1, "kind": kind, "stage": "identity",
                "config": {}, "artifact_id": f"identity-{os.path.basename(path)}", "dataset": {"digest": "identity"},
                "num_rows": int(len(ids)),
                "order": {"by": ["length" if kind == "sorted" else "sample_id"], "descending": False},
                "parts": parts}
    if target is not None:
        manifest["columns"] = {"sample_id": "int64", "length": "int64", "difficulty": "float64",
                               "target_length": "int64"}
    with open(os.path.join(path, artifacts.MANIFEST_NAME), "w") as fh:
        json.dump(manifest, fh)
    return path


def inputs(work: str, n: int) -> dict:
    """metrics (ids 0..N-1), sorted, and metrics with gappy ids and empty samples."""
    rng = np.random.default_rng(1234)
    lengths = np.clip(rng.lognormal(5.5, 1.0, n), 1, 40000).astype(np.int64)
    lengths[rng.random(n) < 0.001] = 0
    ids = np.arange(n, dtype=np.int64)
    out = {"metrics": _write_input(os.path.join(work, "metrics"), ids, lengths, "metrics", 50_000)}
    o = np.argsort(lengths, kind="stable")
    out["sorted"] = _write_input(os.path.join(work, "sorted"), ids[o], lengths[o], "sorted", 70_000)
    gappy = ids * 3 + 7
    nz = np.clip(lengths, 1, None)
    out["gappy"] = _write_input(os.path.join(work, "gappy"), gappy, nz, "metrics", 60_000)
    o = np.argsort(nz, kind="stable")
    out["gappy-sorted"] = _write_input(os.path.join(work, "gappy-sorted"), gappy[o], nz[o], "sorted", 60_000)
    out["plain"] = _write_input(os.path.join(work, "plain"), ids, nz, "metrics", 80_000)
    out["short"] = _write_input(os.path.join(work, "short"), ids[:1000], np.clip(lengths[:1000], 0, 9000), "metrics",
                                300)
    out.update(_mixture_inputs(work, rng))
    return out


def _mixture_inputs(work: str, rng) -> dict:
    """Mixture sources: ``mixa`` (id order), ``mixb`` (sorted by length: rows not in id order), ``mixc``
    (random difficulty, a ``target_length`` column), ``mixlong`` (a few samples longer than every budget)."""
    out = {}
    for name, n, kind in (("mixa", 40_000, "metrics"), ("mixb", 30_000, "sorted"), ("mixc", 20_000, "metrics"),
                          ("mixlong", 10_000, "metrics")):
        lengths = np.clip(rng.lognormal(5.0, 1.1, n), 1, 12_000).astype(np.int64)
        if name == "mixlong":
            lengths[rng.choice(n, 25, replace=False)] = 70_000
        ids = np.arange(n, dtype=np.int64)
        diff = rng.random(n) * 50 if name == "mixc" else None
        target = (lengths * rng.uniform(0.2, 1.0, n)).astype(np.int64) if name == "mixc" else None
        if kind == "sorted":
            o = np.argsort(lengths, kind="stable")
            ids, lengths = ids[o], lengths[o]
        out[name] = _write_input(os.path.join(work, name), ids, lengths, kind, 7_000, diff, target)
    return out


BASE = dict(max_tokens=16384, dp=8, drop_long=True, lr_scaling="linear")
CONFIGS = {
    "bucket-shuffle": dict(BASE),
    "bucket-shuffle-3ep-ga2-seed5": dict(BASE, epochs=3, grad_accum=2, seed=5),
    "bucket-shuffle-sorted-input": dict(BASE, input="sorted"),
    "bucket-shuffle-gappy": dict(BASE, input="gappy", epochs=2),
    "bucket-shuffle-plain-tail-split": dict(BASE, input="plain", dp=7, grad_accum=3, epochs=2),
    "bucket-shuffle-plain-shapes": dict(BASE, input="plain", num_shapes=6, static_shapes=True, compile_warmup=True),
    "bucket-shuffle-pad64-attn": dict(BASE, pad_multiple=64, attention_cost=0.0001),
    "bucket-shuffle-max-samples": dict(BASE, max_samples=32, dp=4),
    "curriculum-2ep": dict(BASE, input="sorted", order="curriculum", epochs=2),
    "curriculum-gappy": dict(BASE, input="gappy-sorted", order="curriculum"),
    "reverse": dict(BASE, input="sorted", order="reverse"),
    "curriculum-then-shuffle": dict(BASE, input="sorted", order="curriculum", epochs=3, curriculum_epochs=1),
    "random-tail-drop": dict(BASE, order="random", tail="drop"),
    "static-shapes": dict(BASE, num_shapes=8, static_shapes=True, epochs=2),
    "shapes-warmup": dict(BASE, num_shapes=4, compile_warmup=True, grad_accum=2),
    "static-warmup-curriculum": dict(BASE, input="sorted", order="curriculum", num_shapes=6, static_shapes=True,
                                     compile_warmup=True),
    "same-shape-per-step": dict(BASE, same_shape_per_step=True, epochs=2, tail="drop"),
    "same-shape-warmup-curriculum": dict(BASE, input="sorted", order="curriculum", same_shape_per_step=True,
                                         tail="drop", compile_warmup=True),
    "schedule-1f1b": dict(BASE, schedule="1f1b", stages=4, grad_accum=4, dp=2),
    "lr-tokens-sqrt": dict(BASE, lr_scaling="sqrt", lr_scale_by="tokens", base_batch_size=100000.0),
    "packing": dict(max_tokens=16384, dp=8, drop_long=True, packing=True, seq_len=4096, max_per_row=16,
                    lr_scaling="linear"),
    "packing-split-long-curriculum": dict(dp=8, packing=True, seq_len=8192, split_long=True, input="sorted",
                                          order="curriculum", epochs=2, lr_scaling="linear"),
    "short-tail-split": dict(BASE, input="short", dp=64, grad_accum=2),
    "short-tail-drop": dict(BASE, input="short", dp=64, grad_accum=8, tail="drop"),
}


MIX = "a=mixa:1,b=mixb:2,c=mixc:0.5"  # names = input keys: resolved to their directories
MIX_NO_TARGET = "a=mixa:1.5,b=mixb:0.3,l=mixlong:1"
MBASE = dict(max_tokens=16384, dp=4, lr_scaling="linear", mix=MIX)
MIX_CONFIGS = {
    "mix-bucket-shuffle-2ep": dict(MBASE, epochs=2),
    "mix-bucket-shuffle-ga3-sqrt-tokens": dict(MBASE, dp=3, grad_accum=3, seed=7, lr_scaling="sqrt",
                                               lr_scale_by="tokens"),
    "mix-random-tail-drop": dict(MBASE, order="random", tail="drop", epochs=2, max_tokens=65536, dp=7),
    "mix-curriculum": dict(MBASE, order="curriculum"),
    "mix-reverse-then-shuffle": dict(MBASE, order="reverse", curriculum_epochs=1, epochs=3),
    "mix-static-warmup": dict(MBASE, num_shapes=5, static_shapes=True, compile_warmup=True, grad_accum=2),
    "mix-same-shape-curriculum": dict(MBASE, order="curriculum", same_shape_per_step=True, tail="drop"),
    "mix-schedule": dict(MBASE, schedule="1f1b", stages=2, grad_accum=4, dp=2),
    "mix-drop-long": dict(MBASE, mix=MIX_NO_TARGET, drop_long=True, epochs=2),
    "mix-packed": dict(MBASE, max_tokens=None, packing=True, seq_len=12288, max_per_row=16, epochs=2),
    "mix-packed-split-long-attn": dict(MBASE, mix=MIX_NO_TARGET, max_tokens=None, packing=True, seq_len=2048,
                                       split_long=True, attention_cost=0.0001, epochs=2),
    "mix-packed-drop-long-curriculum": dict(MBASE, mix=MIX_NO_TARGET, max_tokens=None, packing=True, seq_len=8192,
                                            drop_long=True, order="curriculum"),
}
CONFIGS.update(MIX_CONFIGS)
# --extend: the parent's config, then the epochs of the extended plan
EXTEND_CONFIGS = {
    "extend-plain": dict(parent=dict(BASE, epochs=1), epochs=3),
    "extend-mix": dict(parent=dict(MBASE, epochs=1), epochs=3),
    "extend-mix-packed-split-long": dict(parent=dict(MIX_CONFIGS["mix-packed-split-long-attn"], epochs=1), epochs=2),
    "extend-mix-curriculum-then-shuffle": dict(parent=dict(MBASE, order="curriculum", curriculum_epochs=1, epochs=1),
                                               epochs=3),
}
# varlen replan: the parent's config, then the replan's options; "at": a fraction of the parent's steps,
# or "straddle": the first step at which a --split-long sample has chunks on both sides
REPLAN_CONFIGS = {
    "replan-plain": dict(parent=dict(BASE, epochs=2), at=0.3, dp=5),
    "replan-plain-packed-straddle": dict(parent=dict(dp=4, packing=True, seq_len=2048, split_long=True, epochs=2,
                                                     lr_scaling="linear", input="plain"), at="straddle", dp=3),
    "replan-mix": dict(parent=dict(MBASE, epochs=2), at=0.3, dp=3, grad_accum=2),
    "replan-mix-second-epoch": dict(parent=dict(MBASE, epochs=3, order="random", max_tokens=65536), at=0.6, dp=6),
    "replan-mix-curriculum": dict(parent=dict(MBASE, order="curriculum", epochs=2, curriculum_epochs=1), at=0.2, dp=2),
    "replan-mix-packed": dict(parent=dict(MIX_CONFIGS["mix-packed"]), at=0.25, dp=2),
    "replan-mix-packed-split-long-straddle": dict(parent=dict(MIX_CONFIGS["mix-packed-split-long-attn"]),
                                                  at="straddle", dp=2),
    "replan-mix-packed-split-long-at-0": dict(parent=dict(MIX_CONFIGS["mix-packed-split-long-attn"]), at=0.0, dp=2),
}


def _digest(path: str) -> dict:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    table = pf.read()
    h = hashlib.sha256()
    cols = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        ch = hashlib.sha256(str(col.type).encode())
        if hasattr(col, "offsets"):
            ch.update(np.asarray(col.offsets.to_numpy(zero_copy_only=False), np.int64).tobytes())
            col = col.values
        v = col.to_numpy(zero_copy_only=False)
        ch.update(np.asarray(v, np.float64 if v.dtype.kind == "f" else np.int64).tobytes())
        cols[name] = ch.hexdigest()[:16]
        h.update(f"{name}:{cols[name]};".encode())
    meta = json.loads(pf.schema_arrow.metadata[b"varlen"])
    for key in VOLATILE:
        meta.pop(key, None)
    meta.get("stats", {}).pop("seconds", None)
    meta.get("config", {}).pop("progress", None)
    h.update(json.dumps(meta, sort_keys=True).encode())
    keys = {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in meta.items()}
    return {"table": h.hexdigest()[:16], "rows": table.num_rows, "columns": cols, "keys": keys,
            "metadata": hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]}


def _plan(dirs: dict, cfg: dict, dest: str) -> None:
    from varlen_cli.plan import PlanConfig, plan

    cfg = dict(cfg)
    if cfg.get("mix"):
        cfg["mix"] = ",".join(f"{k}={dirs[v.split(':')[0]]}:{v.split(':')[1]}"
                              for k, v in (e.split("=") for e in cfg["mix"].split(",")))
        cfg["input"] = ""
    else:
        cfg["input"] = dirs[cfg.get("input", "metrics")]
    plan(PlanConfig(output=dest, overwrite=True, progress=False, **cfg))


def _straddle(path: str) -> int:
    """The first step at which a split sample has chunks both before and after (the plan's first epoch)."""
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["epoch", "step", "sample_ids", "sample_starts"]).to_pydict()
    first = {}
    for e, s, ids in zip(t["epoch"], t["step"], t["sample_ids"]):
        for i in ids:
            if e == 0:
                first.setdefault(i, s)
    for e, s, ids, starts in zip(t["epoch"], t["step"], t["sample_ids"], t["sample_starts"]):
        if e == 0 and any(st > 0 and first[i] < s for i, st in zip(ids, starts)):
            return s
    raise SystemExit(f"{path}: no split sample straddles a step")


def _make(name: str, dirs: dict, work: str, parents: str = "") -> str:
    """Write configuration ``name``'s plan (a plan, an extension or a replan); its path. ``parents``: a
    folder of parent plans to extend or replan (another version's, copied) instead of planning them."""
    import json

    import pyarrow.parquet as pq

    from varlen_cli.plan import PlanConfig, plan
    from varlen_cli.plan.replan import ReplanConfig, replan

    dest = os.path.join(work, "plans", f"{name}.parquet")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if name in CONFIGS:
        _plan(dirs, CONFIGS[name], dest)
        return dest
    spec = EXTEND_CONFIGS.get(name) or REPLAN_CONFIGS[name]
    parent = os.path.join(work, "plans", f"{name}.parent.parquet")
    if parents:
        import shutil

        shutil.copyfile(os.path.join(parents, f"{name}.parent.parquet"), parent)
    else:
        _plan(dirs, spec["parent"], parent)
    if name in EXTEND_CONFIGS:
        plan(PlanConfig(input="", output=dest, extend=parent, epochs=spec["epochs"], overwrite=True, progress=False))
        return dest
    steps = json.loads(pq.read_schema(parent).metadata[b"varlen"])["num_steps"]
    at = _straddle(parent) if spec["at"] == "straddle" else int(spec["at"] * steps)
    options = {k: v for k, v in spec.items() if k not in ("parent", "at")}
    replan(ReplanConfig(plan=parent, output=dest, from_step=at, overwrite=True, progress=False, **options))
    return dest


def run(args) -> None:
    from varlen_cli.errors import VarlenError

    dirs = inputs(args.work, args.samples)
    out = {}
    for name in list(CONFIGS) + list(EXTEND_CONFIGS) + list(REPLAN_CONFIGS):
        if args.only and name not in args.only.split(","):
            continue
        try:
            dest = _make(name, dirs, args.work, args.parents)
        except VarlenError as exc:  # a refusal is part of the fingerprint too
            out[name] = {"refused": str(exc), "table": "refused", "rows": 0, "columns": {}, "metadata": ""}
            print(f"{name:<32} refused: {exc}", flush=True)
            continue
        out[name] = _digest(dest)
        print(f"{name:<32} {out[name]['table']} rows {out[name]['rows']:,}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)


def compare(args) -> None:
    a, b = (json.load(open(p)) for p in (args.a, args.b))
    ignore = {k for k in args.ignore_keys.split(",") if k}

    def view(entry: dict) -> dict:
        """What must match: every column, the rows, the metadata (or, with --ignore-keys, its other keys)."""
        keys = {k: v for k, v in entry.get("keys", {}).items() if k not in ignore}
        meta = keys if ignore else entry.get("metadata")
        return {"columns": entry.get("columns"), "rows": entry.get("rows"), "metadata": meta,
                "refused": entry.get("refused")}

    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {args.a if name in a else args.b}")
            bad += 1
            continue
        va, vb = view(a[name]), view(b[name])
        if va != vb:
            diff = sorted(c for c in set(va["columns"]) | set(vb["columns"])
                          if va["columns"].get(c) != vb["columns"].get(c))
            ka, kb = a[name].get("keys", {}), b[name].get("keys", {})
            keys = sorted(k for k in set(ka) | set(kb) if k not in ignore and ka.get(k) != kb.get(k))
            refused = b[name].get("refused") or a[name].get("refused")
            print(f"{name}: DIFFERENT (columns {diff}, metadata keys {keys}"
                  + (f"; refused: {refused}" if refused else "") + ")")
            bad += 1
        else:
            print(f"{name}: identical ({a[name]['rows']:,} rows)")
    print(f"{len(set(a) | set(b)) - bad} identical, {bad} different"
          + (f" (metadata keys {', '.join(sorted(ignore))} not compared)" if ignore else ""))
    sys.exit(1 if bad else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--samples", type=int, default=300_000)
    r.add_argument("--only", default="")
    r.add_argument("--parents", default="", help="extend and replan these parent plans (NAME.parent.parquet, "
                                                 "another version's) instead of planning them")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--ignore-keys", default="", help="metadata keys changed on purpose (comma-separated)")
    args = p.parse_args()
    {"run": run, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
