"""``varlen inspect``: any varlen artifact as its config, provenance and statistics.

:func:`inspect_artifact` returns a JSON-ready dict (what ``--json`` prints); :func:`tables` turns it
into tables of text (:class:`TextTable`, with terminal histograms and sparklines) that the CLI prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from . import format, storage
from .errors import InputError, UsageError
from .runtime import artifacts, rank0
from .runtime.choices import STORAGE_OPTION_HELP, doc
from .runtime.text import fmt, histogram_lines

SERIES_BINS = 48
SPARK = " ▁▂▃▄▅▆▇█"
CHART_STEPS = 48  # steps the per-rank cost chart shows
CHART_RANKS = 16  # ranks it shows one line each for (all ranks count in its "busiest" line)
CHART_SCALE = (0.95, 1.05)  # cost / step mean at the lowest and the highest block


@dataclass(frozen=True)
class InspectConfig:
    """Options of ``varlen inspect``."""

    path: str = doc(help="A metrics directory, a sorted directory or a plan file, local or in object storage "
                         "(s3://...).")
    step: int | None = doc(None, "Plans: also show the microbatches of step N.")
    storage_options: tuple = doc((), STORAGE_OPTION_HELP)


def inspect_artifact(config: InspectConfig) -> dict:
    if rank0.needs_group():  # under torchrun: rank 0 reads, the others get its result
        return rank0.on_rank0(inspect_artifact, config)
    storage.configure(config.storage_options)
    path = config.path
    if _is_directory(path):
        if config.step is not None:
            raise UsageError("--step applies to plans, not to metrics or sorted directories")
        manifest = artifacts.read_manifest(path, what="artifact",
                                           hint="expected a metrics or sorted directory, or a plan")
        return {"kind": manifest.get("kind", "metrics"), "path": storage.absolute(path), "manifest": manifest,
                "balance": _balance([p["rows"] for p in manifest.get("parts", [])])}
    if not storage.is_remote(path) and not os.path.exists(path):
        raise InputError(f"{path} does not exist")
    try:
        pf, meta = format.open_plan_file(path)
    except format.FormatError as exc:
        raise InputError(str(exc)) from None
    import pyarrow as pa

    try:
        out = {"kind": "plan", "path": storage.absolute(path), "metadata": meta, "series": plan_series(pf, meta)}
        if config.step is not None:
            out["step"] = _plan_step(pf, config.step, int(meta.get("num_steps", 0)))
    except (OSError, pa.ArrowException) as exc:  # corrupted pages: the file, not varlen
        raise InputError(f"cannot read plan {path}: {str(exc).strip().splitlines()[0] if str(exc) else exc}") from None
    return out


def _is_directory(path: str) -> bool:
    """A local directory, or an object-storage prefix that is not one object (a plan is one)."""
    if not storage.is_remote(path):
        return os.path.isdir(path)
    return not storage.isfile(path)


def _balance(rows: list) -> float:
    rows = np.asarray(rows, dtype=np.float64)
    return float(rows.max() / rows.mean()) if len(rows) and rows.mean() > 0 else 1.0


def plan_series(pf, meta: dict) -> dict:
    """Per-step tokens, samples, lr_scale and straggler; per-rank totals (no sample ids read) of the
    plan ``pf`` (an open ``pyarrow.parquet.ParquetFile``, :func:`varlen_cli.format.open_plan_file`).

    The straggler is :func:`varlen_cli.format.straggler` over the cost the plan recorded
    (:func:`varlen_cli.format.plan_budget`), so it matches the plan's own statistics. The plan is read
    in windows of whole steps (:mod:`varlen_cli.plan_scan`): memory grows with the steps, not the rows."""
    from . import plan_scan

    budget = format.plan_budget(meta)
    lists = ["sample_lengths"] if budget.needs_segment_lengths else []
    cols = ["step", "rank", "num_samples", "lr_scale", "tokens", "batch_size", "seqlen"]
    series = _SeriesSums(max(int(meta.get("dp", 1)), 1))
    slots = max(series.ranks * int(meta.get("grad_accum", 1)), 1)
    for w in plan_scan.windows(pf, cols, lists, slots):
        if w.n:
            series.add(w, budget)
    if not series.tokens:
        return {"steps": 0}
    return series.result(budget)


class _SeriesSums:
    """Per-step series and per-rank totals of a plan, summed window by window."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.tokens, self.samples, self.lr, self.straggler, self.first_loads = [], [], [], [], []
        self.top = self.mean = 0.0
        self.real = np.zeros(ranks)
        self.padded = np.zeros(ranks)

    def add(self, w, budget) -> None:
        from .budget import segment_sum_squares

        c = w.cols
        step, rank = c["step"].astype(np.int64), c["rank"].astype(np.int64)
        if int(rank.max()) >= self.ranks:  # a damaged plan (validate says so): more ranks than dp
            self._widen(int(rank.max()) + 1)
        local = step - int(step.min())
        steps = int(local.max()) + 1
        sums = (segment_sum_squares(w.values("sample_lengths"), w.offsets("sample_lengths"))
                if budget.needs_segment_lengths else None)
        cost = budget.microbatch_cost(c["tokens"], c["batch_size"], c["seqlen"], sums)
        tokens = c["tokens"].astype(np.float64)
        self.tokens.append(np.bincount(local, weights=tokens, minlength=steps))
        self.samples.append(np.bincount(local, weights=c["num_samples"].astype(np.float64), minlength=steps))
        lr = np.zeros(steps)
        lr[local] = c["lr_scale"]
        self.lr.append(lr)
        loads = format.step_loads(local, rank, cost, self.ranks)
        m = loads.mean(axis=1)
        self.straggler.append(np.where(m > 0, loads.max(axis=1) / np.where(m > 0, m, 1), 1.0))
        self.top, self.mean = self.top + float(loads.max(axis=1).sum()), self.mean + float(m.sum())
        if sum(len(x) for x in self.first_loads) < CHART_STEPS:
            self.first_loads.append(loads[:CHART_STEPS])
        self.real += np.bincount(rank, weights=tokens, minlength=self.ranks)
        self.padded += np.bincount(rank, weights=c["batch_size"].astype(np.float64) * c["seqlen"],
                                   minlength=self.ranks)

    def _widen(self, ranks: int) -> None:
        grow = ranks - self.ranks
        self.real, self.padded = np.pad(self.real, (0, grow)), np.pad(self.padded, (0, grow))
        self.first_loads = [np.pad(x, ((0, 0), (0, grow))) for x in self.first_loads]
        self.ranks = ranks

    def result(self, budget) -> dict:
        straggler = np.concatenate(self.straggler)
        return {
            "steps": len(straggler),
            "ranks": self.ranks,
            "tokens_per_step": _binned(np.concatenate(self.tokens)),
            "samples_per_step": _binned(np.concatenate(self.samples)),
            "lr_scale": _binned(np.concatenate(self.lr)),
            "straggler": _binned(straggler),
            "straggler_mean": float(straggler.mean()),
            "straggler_max": float(straggler.max()),
            "straggler_cost": budget.straggler_spec(),
            "straggler_overhead": self.top / self.mean - 1.0 if self.mean > 0 else 0.0,
            "rank_cost_first_steps": np.concatenate(self.first_loads)[:CHART_STEPS].tolist(),
            "padded_tokens_per_rank": self.padded.tolist(),
            "real_tokens_per_rank": self.real.tolist(),
        }


def _binned(values: np.ndarray) -> dict:
    """Min/max and the mean over SERIES_BINS equal slices of the steps (for a sparkline); values that
    are not finite (a damaged plan: ``varlen validate`` says which) are counted, not averaged."""
    finite = np.isfinite(values)
    edges = np.linspace(0, len(values), min(SERIES_BINS, len(values)) + 1).astype(np.int64)
    clean = np.where(finite, values, 0.0)
    sums = np.add.reduceat(clean, edges[:-1]) if len(values) else np.zeros(0)
    counts = np.add.reduceat(finite.astype(np.int64), edges[:-1]) if len(values) else np.zeros(0)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    kept = values[finite]
    out = {"min": float(kept.min()) if len(kept) else float("nan"),
           "max": float(kept.max()) if len(kept) else float("nan"),
           "mean": float(kept.mean()) if len(kept) else float("nan"), "binned_mean": means.tolist()}
    if not finite.all():
        out["non_finite"] = int((~finite).sum())
    return out


def _plan_step(pf, step: int, num_steps: int) -> list:
    import pyarrow.compute as pc

    if step < 0 or step >= num_steps:
        raise UsageError(f"--step {step} is outside the plan's steps 0..{num_steps - 1}")
    step_col = pf.schema_arrow.get_field_index("step")
    rows = []
    for rg in range(pf.num_row_groups):
        st = pf.metadata.row_group(rg).column(step_col).statistics
        if st is not None and st.has_min_max and not (st.min <= step <= st.max):
            continue
        t = pf.read_row_group(rg)
        t = t.filter(pc.equal(t.column("step"), step))
        rows.extend(t.drop_columns([c for c in format.PACKED_COLUMN_NAMES if c in t.column_names]).to_pylist())
    return rows


def sparkline(values: list) -> str:
    arr = np.asarray(values, dtype=np.float64)
    if len(arr) == 0:
        return ""
    finite = np.isfinite(arr)
    if not finite.any():
        return "?" * len(arr)
    lo, hi = arr[finite].min(), arr[finite].max()
    if hi <= lo:
        return "".join(SPARK[4] if ok else "?" for ok in finite)
    idx = np.round((np.where(finite, arr, lo) - lo) / (hi - lo) * (len(SPARK) - 2)).astype(int) + 1
    return "".join(SPARK[i] if ok else "?" for i, ok in zip(idx, finite))


@dataclass
class TextTable:
    """A table of text cells for the CLI to print: ``columns`` are ``(header, justify)`` pairs."""

    title: str
    columns: list
    rows: list = field(default_factory=list)
    show_header: bool = True


def _key_value(title: str, justify: str = "left") -> TextTable:
    return TextTable(title, [("what", "left"), ("value", justify)], show_header=False)


def tables(info: dict) -> list[TextTable]:
    """The text tables ``varlen inspect`` shows for ``info`` (from :func:`inspect_artifact`)."""
    if info["kind"] != "plan":
        return _directory_tables(info)
    out = _plan_tables(info)
    if info["series"].get("steps"):
        out += _series_tables(info["series"])
    if "step" in info:
        out.append(_step_table(info["step"]))
    return out


def _directory_tables(info: dict) -> list[TextTable]:

    m = info["manifest"]
    t = _key_value(f"{m.get('kind', 'metrics')} directory {info['path']}")
    for key in ("stage", "varlen_version", "created_at", "host", "world_size", "num_rows", "artifact_id"):
        t.rows.append((key, fmt(m.get(key))))
    ds = m["dataset"]
    t.rows.append(("dataset", f"{ds['num_files']} files, {ds['num_rows']:,} rows, digest {ds['digest']}"))
    if m.get("input"):
        t.rows.append(("input", f"{m['input'].get('path')} ({m['input'].get('artifact_id')})"))
    order = m.get("order", {})
    t.rows.append(("order", ", ".join(order.get("by", [])) + (" descending" if order.get("descending") else "")))
    t.rows.append(("parts", f"{len(m['parts'])} (balance max/mean rows {info['balance']:.3f})"))
    t.rows += [(f"config.{key}", fmt(value)) for key, value in m.get("config", {}).items()]
    s = m["stats"]["length"]
    st = TextTable("length statistics", [("stat", "left"), ("value", "right")], show_header=False)
    st.rows = [(key, fmt(s.get(key))) for key in ("count", "total", "min", "p50", "p90", "p99", "max", "mean")]
    h = TextTable("lengths (log2 bins)", [("length", "left"), ("samples", "right"), ("", "left")])
    h.rows = list(histogram_lines(s["histogram"]["log2_bins"]))
    return [t, st, h]


def _plan_tables(info: dict) -> list[TextTable]:

    meta = info["metadata"]
    t = _key_value(f"plan {info['path']}")
    for key in ("varlen_version", "dp", "grad_accum", "epochs", "num_steps", "num_microbatches",
                "warmup_steps", "base_batch_size", "lr_scaling", "lr_scale_by"):
        t.rows.append((key, fmt(meta.get(key))))
    from .plan.lr import describe

    t.rows.append(("lr_scale", describe(meta)))
    inp = meta.get("input", {})
    t.rows.append(("input", f"{inp.get('path')} ({inp.get('kind')}, {inp.get('num_rows')} rows, "
                            f"dataset {inp.get('dataset_digest')})"))
    shapes = meta.get("shapes") or []
    shown = ", ".join(f"{b or '*'}x{T}" for b, T in shapes[:16])
    t.rows.append(("shapes", shown + (" ..." if len(shapes) > 16 else "")))
    if meta.get("packing"):
        t.rows.append(("packing", ", ".join(f"{k}={v}" for k, v in meta["packing"].items())))
    t.rows.append(("dropped", fmt(meta.get("dropped", {}).get("count", 0))))
    budget = format.plan_budget(meta)
    if budget.memory:  # a plan made with --max-memory: predicted peak per shape and the maximum
        from .memory.budget import memory_rows

        t.rows.extend(memory_rows(budget.memory, shapes))
    t.rows.append(("budget", ", ".join(f"{k}={v}" for k, v in budget.to_metadata().items() if k != "model")))
    t.rows.append(("straggler cost", ", ".join(f"{k}={v}" for k, v in budget.straggler_spec().items())))
    st = TextTable("statistics", [("stat", "left"), ("value", "right")], show_header=False)
    st.rows = [(key, fmt(value)) for key, value in (meta.get("stats") or {}).items()
               if not isinstance(value, (list, dict))]
    if meta.get("lineage"):  # varlen replan / plan --extend
        t.rows.append(("lineage", ", ".join(f"{k}={v}" for k, v in meta["lineage"].items() if k != "parent_path")))
    return [t, st] + _mixture_tables(meta)


def _mixture_tables(meta: dict) -> list[TextTable]:
    """Mixture plans (varlen plan --mix): tokens per source per epoch."""
    mix = meta.get("mixture")
    if not mix:
        return []
    epochs = int(meta.get("epochs", 1))
    mt = TextTable("tokens per source per epoch", [("source", "left"), ("weight", "right"), ("samples/epoch", "right")]
                   + [(f"epoch {e}", "right") for e in range(epochs)])
    for s in mix["sources"]:
        mt.rows.append((s["name"], fmt(s["weight"]), fmt(s["samples_per_epoch"]),
                        *[fmt(x) for x in s["tokens_per_epoch"]]))
    return [mt]


def _series_tables(series: dict) -> list[TextTable]:

    bins = len(series["tokens_per_step"]["binned_mean"])
    sp = TextTable(f"over {series['steps']:,} steps (each column: mean of 1/{bins} of the steps)",
                   [("series", "left"), ("min", "right"), ("max", "right"), ("", "left")])
    for name in ("tokens_per_step", "samples_per_step", "lr_scale", "straggler"):
        s = series[name]
        sp.rows.append((name, fmt(s["min"]), fmt(s["max"]), sparkline(s["binned_mean"])))
        if s.get("non_finite"):
            sp.rows.append((f"  {name} not finite", fmt(s["non_finite"]), "", "steps (varlen validate reports them)"))
    if "straggler_overhead" in series:
        sp.rows.append(("straggler overhead", f"{100 * series['straggler_overhead']:.2f}%", "",
                        "sum of the busiest rank's cost / sum of the mean, - 1"))
    out = [sp]
    if series.get("rank_cost_first_steps"):
        out.append(rank_cost_chart(series["rank_cost_first_steps"], series.get("straggler_cost", {})))
    rk = TextTable("per-rank balance", [("rank", "right"), ("real tokens", "right"), ("padded tokens", "right")])
    for r, (real, pad) in enumerate(zip(series["real_tokens_per_rank"], series["padded_tokens_per_rank"])):
        rk.rows.append((str(r), fmt(int(real)), fmt(int(pad))))
    return out + [rk]


def _blocks(ratio: np.ndarray) -> str:
    lo, hi = CHART_SCALE
    idx = np.clip(np.round((ratio - lo) / (hi - lo) * (len(SPARK) - 2)), 0, len(SPARK) - 2).astype(int) + 1
    return "".join(SPARK[i] for i in idx)


def rank_cost_chart(loads: list, cost_spec: dict) -> TextTable:
    """Per-rank cost of the first steps as text: one line per rank (the first :data:`CHART_RANKS`), one
    block per step, the block's height the rank's cost / the step's mean cost on the fixed scale
    :data:`CHART_SCALE` (▁ at or below 0.95, █ at or above 1.05, ▄/▅ balanced), and a last line with
    the busiest rank of each step (its max / mean as the same blocks, and the worst value)."""
    arr = np.asarray(loads, dtype=np.float64)
    mean = arr.mean(axis=1, keepdims=True)
    ratio = np.where(mean > 0, arr / np.where(mean > 0, mean, 1.0), 1.0)
    kind = cost_spec.get("kind", "tokens")
    what = {"tokens": "tokens", "packed": "tokens + A sum(l^2)", "padded": "B T + A B T^2"}.get(kind, kind)
    lo, hi = CHART_SCALE
    t = TextTable(f"per-rank cost ({what}) / step mean, steps 0..{len(arr) - 1}: ▁ <= {lo}, █ >= {hi}",
                  [("rank", "right"), ("cost per step", "left"), ("max / mean", "right")])
    for r in range(min(arr.shape[1], CHART_RANKS)):
        t.rows.append((str(r), _blocks(ratio[:, r]), f"{ratio[:, r].max():.3f}"))
    busiest = ratio.max(axis=1)
    t.rows.append(("busiest", _blocks(busiest), f"{busiest.max():.3f}"))
    return t


def _step_table(step_rows: list) -> TextTable:

    names = ("rank", "micro", "num_samples", "batch_size", "seqlen", "tokens", "lr_scale")
    stt = TextTable("microbatches of the step", [(c, "right") for c in names + ("sample_ids",)])
    for row in step_rows:
        ids = row["sample_ids"]
        shown = ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")
        stt.rows.append(tuple(fmt(row[c]) for c in names) + (shown,))
    return stt
