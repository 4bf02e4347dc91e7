"""``varlen inspect``: any varlen artifact as its config, provenance and statistics.

:func:`inspect_artifact` returns a JSON-ready dict (what ``--json`` prints); :func:`render` turns it
into rich tables with terminal histograms.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import artifacts
from .errors import InputError, UsageError
from .validate import read_plan_metadata

SERIES_BINS = 48
SPARK = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class InspectConfig:
    path: str
    step: Optional[int] = None


def inspect_artifact(config: InspectConfig) -> dict:
    path = config.path
    if os.path.isdir(path):
        if config.step is not None:
            raise UsageError("--step applies to plans, not to metrics or sorted directories")
        manifest = artifacts.read_manifest(path, what="artifact", hint="expected a metrics or sorted directory, or a plan")
        return {"kind": manifest.get("kind", "metrics"), "path": os.path.abspath(path), "manifest": manifest,
                "balance": _balance([p["rows"] for p in manifest.get("parts", [])])}
    if not os.path.exists(path):
        raise InputError(f"{path} does not exist")
    meta, _ = read_plan_metadata(path)
    out = {"kind": "plan", "path": os.path.abspath(path), "metadata": meta, "series": _plan_series(path)}
    if config.step is not None:
        out["step"] = _plan_step(path, config.step, int(meta.get("num_steps", 0)))
    return out


def _balance(rows: list) -> float:
    rows = np.asarray(rows, dtype=np.float64)
    return float(rows.max() / rows.mean()) if len(rows) and rows.mean() > 0 else 1.0


def _plan_series(path: str) -> dict:
    """Per-step tokens, samples, lr_scale and straggler; per-rank totals (no sample ids read)."""
    import pyarrow.parquet as pq

    cols = ["step", "rank", "num_samples", "tokens", "batch_size", "seqlen", "lr_scale"]
    t = pq.read_table(path, columns=cols)
    step = t.column("step").to_numpy()
    rank = t.column("rank").to_numpy()
    if len(step) == 0:
        return {"steps": 0}
    n_steps, n_ranks = int(step.max()) + 1, int(rank.max()) + 1
    tokens = t.column("tokens").to_numpy().astype(np.float64)
    padded = t.column("batch_size").to_numpy().astype(np.float64) * t.column("seqlen").to_numpy()
    samples = t.column("num_samples").to_numpy().astype(np.float64)
    lr = t.column("lr_scale").to_numpy()
    step_tokens = np.bincount(step, weights=tokens, minlength=n_steps)
    step_samples = np.bincount(step, weights=samples, minlength=n_steps)
    step_lr = np.zeros(n_steps)
    step_lr[step] = lr
    rank_cost = np.zeros((n_steps, n_ranks))
    np.add.at(rank_cost, (step, rank), padded)
    mean = rank_cost.mean(axis=1)
    straggler = np.divide(rank_cost.max(axis=1), mean, out=np.ones(n_steps), where=mean > 0)
    return {
        "steps": n_steps,
        "ranks": n_ranks,
        "tokens_per_step": _binned(step_tokens),
        "samples_per_step": _binned(step_samples),
        "lr_scale": _binned(step_lr),
        "straggler": _binned(straggler),
        "straggler_mean": float(straggler.mean()),
        "straggler_max": float(straggler.max()),
        "padded_tokens_per_rank": rank_cost.sum(axis=0).tolist(),
        "real_tokens_per_rank": np.bincount(rank, weights=tokens, minlength=n_ranks).tolist(),
    }


def _binned(values: np.ndarray) -> dict:
    """Min/max and the mean over SERIES_BINS equal slices of the steps (for a sparkline)."""
    edges = np.linspace(0, len(values), min(SERIES_BINS, len(values)) + 1).astype(np.int64)
    sums = np.add.reduceat(values, edges[:-1]) if len(values) else np.zeros(0)
    means = sums / np.maximum(np.diff(edges), 1)
    return {"min": float(values.min()), "max": float(values.max()), "mean": float(values.mean()),
            "binned_mean": means.tolist()}


def _plan_step(path: str, step: int, num_steps: int) -> list:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if step < 0 or step >= num_steps:
        raise UsageError(f"--step {step} is outside the plan's steps 0..{num_steps - 1}")
    pf = pq.ParquetFile(path)
    step_col = pf.schema_arrow.get_field_index("step")
    rows = []
    for rg in range(pf.num_row_groups):
        st = pf.metadata.row_group(rg).column(step_col).statistics
        if st is not None and st.has_min_max and not (st.min <= step <= st.max):
            continue
        t = pf.read_row_group(rg)
        t = t.filter(pc.equal(t.column("step"), step))
        rows.extend(t.drop_columns([c for c in ("sample_lengths", "sample_rows", "sample_starts")
                                    if c in t.column_names]).to_pylist())
    return rows


def sparkline(values: list) -> str:
    arr = np.asarray(values, dtype=np.float64)
    if len(arr) == 0:
        return ""
    lo, hi = arr.min(), arr.max()
    if hi <= lo:
        return SPARK[4] * len(arr)
    idx = np.round((arr - lo) / (hi - lo) * (len(SPARK) - 2)).astype(int) + 1
    return "".join(SPARK[i] for i in idx)


def render(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from .report import _fmt, histogram_lines

    console = Console()
    if info["kind"] != "plan":
        m = info["manifest"]
        t = Table(title=f"{m.get('kind', 'metrics')} directory {info['path']}", show_header=False)
        t.add_column("what", style="bold")
        t.add_column("value")
        for key in ("stage", "varlen_version", "created_at", "host", "world_size", "num_rows", "artifact_id"):
            t.add_row(key, _fmt(m.get(key)))
        t.add_row("dataset", f"{m['dataset']['num_files']} files, {m['dataset']['num_rows']:,} rows, digest {m['dataset']['digest']}")
        if m.get("input"):
            t.add_row("input", f"{m['input'].get('path')} ({m['input'].get('artifact_id')})")
        order = m.get("order", {})
        t.add_row("order", ", ".join(order.get("by", [])) + (" descending" if order.get("descending") else ""))
        t.add_row("parts", f"{len(m['parts'])} (balance max/mean rows {info['balance']:.3f})")
        for key, value in m.get("config", {}).items():
            t.add_row(f"config.{key}", _fmt(value))
        console.print(t)
        s = m["stats"]["length"]
        st = Table(title="length statistics", show_header=False)
        st.add_column("stat", style="bold")
        st.add_column("value", justify="right")
        for key in ("count", "total", "min", "p50", "p90", "p99", "max", "mean"):
            st.add_row(key, _fmt(s.get(key)))
        console.print(st)
        h = Table(title="lengths (log2 bins)")
        h.add_column("length")
        h.add_column("samples", justify="right")
        h.add_column("")
        for row in histogram_lines(s["histogram"]["log2_bins"]):
            h.add_row(*row)
        console.print(h)
        return
    meta, series = info["metadata"], info["series"]
    t = Table(title=f"plan {info['path']}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    for key in ("varlen_version", "created_at", "dp", "grad_accum", "epochs", "num_steps", "num_microbatches",
                "warmup_steps", "base_batch_size", "lr_scaling"):
        t.add_row(key, _fmt(meta.get(key)))
    inp = meta.get("input", {})
    t.add_row("input", f"{inp.get('path')} ({inp.get('kind')}, {inp.get('num_rows')} rows, dataset {inp.get('dataset_digest')})")
    t.add_row("shapes", ", ".join(f"{b or '*'}x{T}" for b, T in (meta.get("shapes") or [])[:16])
              + (" ..." if len(meta.get("shapes") or []) > 16 else ""))
    if meta.get("packing"):
        t.add_row("packing", ", ".join(f"{k}={v}" for k, v in meta["packing"].items()))
    dropped = meta.get("dropped", {})
    t.add_row("dropped", _fmt(dropped.get("count", 0)))
    if meta.get("memory"):  # a plan made with --max-memory: predicted peak per shape and the maximum
        from .memory.budget import memory_rows

        for label, value in memory_rows(meta):
            t.add_row(label, value)
    console.print(t)
    st = Table(title="statistics", show_header=False)
    st.add_column("stat", style="bold")
    st.add_column("value", justify="right")
    for key, value in (meta.get("stats") or {}).items():
        if not isinstance(value, (list, dict)):
            st.add_row(key, _fmt(value))
    console.print(st)
    if series.get("steps"):
        sp = Table(title=f"over {series['steps']:,} steps (each column: mean of 1/{len(series['tokens_per_step']['binned_mean'])} of the steps)")
        sp.add_column("series", style="bold")
        sp.add_column("min", justify="right")
        sp.add_column("max", justify="right")
        sp.add_column("")
        for name in ("tokens_per_step", "samples_per_step", "lr_scale", "straggler"):
            s = series[name]
            sp.add_row(name, _fmt(s["min"]), _fmt(s["max"]), sparkline(s["binned_mean"]))
        console.print(sp)
        rk = Table(title="per-rank balance")
        rk.add_column("rank", justify="right")
        rk.add_column("real tokens", justify="right")
        rk.add_column("padded tokens", justify="right")
        for r, (real, pad) in enumerate(zip(series["real_tokens_per_rank"], series["padded_tokens_per_rank"])):
            rk.add_row(str(r), _fmt(int(real)), _fmt(int(pad)))
        console.print(rk)
    if "step" in info:
        stt = Table(title="microbatches of the step")
        for col in ("rank", "micro", "num_samples", "batch_size", "seqlen", "tokens", "lr_scale", "sample_ids"):
            stt.add_column(col, justify="right")
        for row in info["step"]:
            ids = row["sample_ids"]
            shown = ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")
            stt.add_row(*(_fmt(row[c]) for c in ("rank", "micro", "num_samples", "batch_size", "seqlen", "tokens",
                                                   "lr_scale")), shown)
        console.print(stt)
