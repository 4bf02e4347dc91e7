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
from .runtime.text import LOG_BINS, fmt, histogram_lines

SERIES_BINS = 48  # sparkline columns (``binned_mean`` of each series)
PLOT_BUCKETS = 400  # points of each series in ``buckets`` (``varlen report``'s plots): one a step up to that many
HEAT_BUCKETS = 96  # columns of the per-rank cost heat strip
HEAT_RANKS = 64  # its rows: more ranks are grouped, the busiest of each group shown
TOP_SHAPES = 64  # shapes listed with their counts (all are counted)
FILL_BINS = 20  # packed-row fill histogram: bins of 5 %
DIFFICULTY_IN_MEMORY = 1 << 28  # --metrics difficulties held by sample id (float32: 1 GiB)
STEP_SERIES = ("tokens_per_step", "padded_tokens_per_step", "padding_pct", "samples_per_step", "mean_sample_length",
               "lr_scale", "straggler")
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
    metrics: str | None = doc(None, "Plans: the metrics or sorted directory the plan was built from, for the "
                                    "samples' length histogram and their difficulty over the steps.")
    storage_options: tuple = doc((), STORAGE_OPTION_HELP)


def inspect_artifact(config: InspectConfig) -> dict:
    if rank0.needs_group():  # under torchrun: rank 0 reads, the others get its result
        return rank0.on_rank0(inspect_artifact, config)
    storage.configure(config.storage_options)
    path = config.path
    if _is_directory(path):
        for given, name in ((config.step, "--step"), (config.metrics, "--metrics")):
            if given is not None:
                raise UsageError(f"{name} applies to plans, not to metrics or sorted directories")
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

    metrics = _plan_metrics(meta, config.metrics) if config.metrics else None
    try:
        difficulty = metrics.pop("by_id") if metrics else None
        out = {"kind": "plan", "path": storage.absolute(path), "metadata": meta,
               "series": plan_series(pf, meta, difficulty)}
        if metrics:
            out["metrics"] = metrics
        if config.step is not None:
            out["step"] = _plan_step(pf, config.step, int(meta.get("num_steps", 0)))
    except (OSError, pa.ArrowException) as exc:  # corrupted pages: the file, not varlen
        raise InputError(f"cannot read plan {path}: {str(exc).strip().splitlines()[0] if str(exc) else exc}") from None
    return out


def _plan_metrics(meta: dict, path: str) -> dict:
    """The metrics of a plan's input (``--metrics``): its path, length and difficulty statistics and,
    up to :data:`DIFFICULTY_IN_MEMORY` samples, the difficulty by sample id (``by_id``, float32)."""
    if meta.get("mixture"):
        raise UsageError("--metrics does not apply to a mixture plan (varlen plan --mix): it has one input per source")
    manifest = artifacts.read_manifest(path)
    inp = meta.get("input") or {}
    digest = (manifest.get("dataset") or {}).get("digest")
    if inp.get("dataset_digest") not in (None, digest) or int(inp.get("num_rows", -1)) != int(manifest["num_rows"]):
        raise InputError(f"{path} describes dataset {digest} of {int(manifest['num_rows']):,} samples, the plan was "
                         f"built from {inp.get('dataset_digest')} of {inp.get('num_rows')}: pass the metrics the plan "
                         "was made from")
    out = {"path": storage.absolute(path), "kind": manifest.get("kind", "metrics"), "stats": manifest.get("stats", {}),
           "config": manifest.get("config", {})}
    n = int(manifest["num_rows"])
    if n > DIFFICULTY_IN_MEMORY:
        out["difficulty_skipped"] = (f"the difficulty over the steps is read for up to {DIFFICULTY_IN_MEMORY:,} "
                                     f"samples; {path} has {n:,}")
        return {**out, "by_id": None}
    by_id = np.full(n, np.nan, np.float32)
    chunk = 1 << 22
    for start in range(0, n, chunk):  # a chunk of rows at a time: 4 bytes a sample are kept
        t = artifacts.read_row_range(path, manifest, start, min(n, start + chunk), ["sample_id", "difficulty"])
        ids = t.column("sample_id").to_numpy()
        ok = (ids >= 0) & (ids < n)
        by_id[ids[ok]] = t.column("difficulty").to_numpy()[ok]
    return {**out, "by_id": by_id}


def _is_directory(path: str) -> bool:
    """A local directory, or an object-storage prefix that is not one object (a plan is one)."""
    if not storage.is_remote(path):
        return os.path.isdir(path)
    return not storage.isfile(path)


def _balance(rows: list) -> float:
    rows = np.asarray(rows, dtype=np.float64)
    return float(rows.max() / rows.mean()) if len(rows) and rows.mean() > 0 else 1.0


def plan_series(pf, meta: dict, difficulty: np.ndarray | None = None) -> dict:
    """Per-step series (tokens, padded tokens, padding %, samples, mean sample length, lr_scale,
    straggler), per-rank totals and cost, the shapes used, the length histogram, packed-row fill and
    mixture shares of the plan ``pf`` (an open ``pyarrow.parquet.ParquetFile``,
    :func:`varlen_cli.format.open_plan_file`); with ``difficulty`` (by sample id) the samples'
    difficulty over the steps.

    The per-step figures are :func:`varlen_cli.format.step_figures` under the cost the plan recorded
    (:func:`varlen_cli.format.plan_budget`), so they match the plan's own statistics and the trackers'.
    The plan is read in windows of whole steps (:mod:`varlen_cli.checks.scan`), sample ids only for
    ``difficulty``, and every series is kept in buckets of steps (:mod:`varlen_cli.runtime.series`):
    memory is bounded by a window and the buckets, whatever the plan's size."""
    from .checks import scan

    budget = format.plan_budget(meta)
    names = pf.schema_arrow.names
    packed = bool(meta.get("packing")) and {"sample_lengths", "sample_rows"} <= set(names)
    lists = (["sample_lengths"] if packed or budget.needs_segment_lengths else []) + (["sample_rows"] if packed else [])
    lists += (["source"] if meta.get("mixture") and "source" in names else [])
    lists += (["sample_ids"] if difficulty is not None else [])
    cols = ["step", "rank", "num_samples", "lr_scale", "tokens", "batch_size", "seqlen"]
    cols += [format.TARGET_SEQLEN_COLUMN] if budget.two_sided else []
    ranks = max(int(meta.get("dp", 1)), 1)
    slots = max(ranks * int(meta.get("grad_accum", 1)), 1)
    series = _SeriesSums(ranks, -(-pf.metadata.num_rows // slots), meta, packed, difficulty)
    for w in scan.windows(pf, cols, lists, slots):
        if w.n:
            series.add(w, budget)
    if not series.seen:
        return {"steps": 0}
    return series.result(budget)


class _SeriesSums:
    """Per-step series (in buckets), per-rank totals, shapes and entry figures of a plan, summed
    window by window."""

    def __init__(self, ranks: int, total: int, meta: dict, packed: bool, difficulty: np.ndarray | None):
        from .runtime.series import BucketMatrix, Buckets

        self.ranks, self.seen, self.packed, self.difficulty = ranks, 0, packed, difficulty
        self.series = {name: (Buckets(total, SERIES_BINS), Buckets(total, PLOT_BUCKETS)) for name in STEP_SERIES}
        self.heat = BucketMatrix(total, HEAT_BUCKETS, ranks)
        self.first_loads = []
        self.top = self.mean = 0.0
        self.real = np.zeros(ranks)
        self.padded = np.zeros(ranks)
        self.shapes: dict = {}
        self.lengths = np.zeros(LOG_BINS, np.int64)
        self.fill = np.zeros(FILL_BINS, np.int64)
        self.fill_sum = 0.0
        sources = (meta.get("mixture") or {}).get("sources") or []
        self.source_names = [s.get("name") for s in sources]
        self.sources = BucketMatrix(total, PLOT_BUCKETS, len(self.source_names)) if sources else None
        self.hardness = Buckets(total, PLOT_BUCKETS) if difficulty is not None else None

    def add(self, w, budget) -> None:
        from .budget import segment_sum_squares

        c = w.cols
        step, rank = c["step"].astype(np.int64), c["rank"].astype(np.int64)
        if int(rank.max()) >= self.ranks:  # a damaged plan (validate says so): more ranks than dp
            self._widen(int(rank.max()) + 1)
        local = step - int(step.min())
        sums = (segment_sum_squares(w.values("sample_lengths"), w.offsets("sample_lengths"))
                if budget.needs_segment_lengths else None)
        cost = budget.microbatch_cost(c["tokens"], c["batch_size"], c["seqlen"], sums,
                                      c.get(format.TARGET_SEQLEN_COLUMN))
        fig = format.step_figures(local, rank, c, cost, self.ranks)
        positions = self.seen + np.arange(len(fig["tokens"]))
        for name, values in _step_values(fig, local, c["lr_scale"]).items():
            ok = np.isfinite(values) | (name != "mean_sample_length")  # a step without samples has no mean
            for buckets in self.series[name]:
                buckets.add(positions[ok], values[ok])
        loads = fig["loads"]
        m = loads.mean(axis=1)
        ratio = loads / np.where(m > 0, m, 1.0)[:, None]
        self.heat.add(np.repeat(positions, self.ranks), np.tile(np.arange(self.ranks), len(positions)), ratio.ravel())
        self.top, self.mean = self.top + float(loads.max(axis=1).sum()), self.mean + float(m.sum())
        if sum(len(x) for x in self.first_loads) < CHART_STEPS:
            self.first_loads.append(loads[:CHART_STEPS])
        tokens = c["tokens"].astype(np.float64)
        self.real += np.bincount(rank, weights=tokens, minlength=self.ranks)
        self.padded += np.bincount(rank, weights=c["batch_size"].astype(np.float64) * c["seqlen"],
                                   minlength=self.ranks)
        self._add_shapes(c)
        self._add_entries(w, self.seen + local)
        self.seen += len(positions)

    def _add_shapes(self, c: dict) -> None:
        key = (c["batch_size"].astype(np.int64) << 32) | (c["seqlen"].astype(np.int64) & 0xFFFFFFFF)
        values, counts = np.unique(key, return_counts=True)
        for k, n in zip(values.tolist(), counts.tolist()):
            self.shapes[k] = self.shapes.get(k, 0) + n

    def _add_entries(self, w, row_position: np.ndarray) -> None:
        """The length histogram, packed-row fill, mixture shares and difficulty of a window's entries."""
        from .runtime.text import log2_histogram

        c = w.cols
        if self.packed:
            self.lengths += log2_histogram(w.values("sample_lengths"))
            bins, fill_sum = packed_row_fill(c["batch_size"], c["seqlen"], w.values("sample_lengths"),
                                             w.values("sample_rows"), w.parent("sample_lengths"))
            self.fill += bins
            self.fill_sum += fill_sum
        else:  # each sample at its microbatch's padded length T
            exponent = np.frexp(np.maximum(c["seqlen"], 0).astype(np.float64))[1]
            self.lengths += np.bincount(np.minimum(exponent, LOG_BINS - 1), weights=c["num_samples"],
                                        minlength=LOG_BINS).astype(np.int64)
        if self.sources is not None:
            src = w.values("source").astype(np.int64)
            ok = (src >= 0) & (src < len(self.source_names))
            self.sources.add(row_position[w.parent("source")][ok], src[ok], np.ones(int(ok.sum())))
        if self.hardness is not None:
            ids = w.values("sample_ids").astype(np.int64)
            ok = (ids >= 0) & (ids < len(self.difficulty))
            self.hardness.add(row_position[w.parent("sample_ids")][ok], self.difficulty[ids[ok]])

    def _widen(self, ranks: int) -> None:
        grow = ranks - self.ranks
        self.real, self.padded = np.pad(self.real, (0, grow)), np.pad(self.padded, (0, grow))
        self.first_loads = [np.pad(x, ((0, 0), (0, grow))) for x in self.first_loads]
        self.heat.grow(ranks)
        self.ranks = ranks

    def result(self, budget) -> dict:
        out = {"steps": self.seen, "ranks": self.ranks, "bucket_edges": self.series["straggler"][1].edges.tolist()}
        for name, (coarse, fine) in self.series.items():
            out[name] = {**coarse.summary(), "binned_mean": coarse.means().tolist(), "buckets": fine.to_json()}
        out.update({
            "straggler_mean": out["straggler"]["mean"],
            "straggler_max": out["straggler"]["max"],
            "straggler_cost": budget.straggler_spec(),
            "straggler_overhead": self.top / self.mean - 1.0 if self.mean > 0 else 0.0,
            "rank_cost_first_steps": np.concatenate(self.first_loads)[:CHART_STEPS].tolist(),
            "rank_cost_heat": _heat_rows(self.heat),
            "padded_tokens_per_rank": self.padded.tolist(),
            "real_tokens_per_rank": self.real.tolist(),
            "shapes": _top_shapes(self.shapes),
            "length_histogram": {"of": "sample_lengths" if self.packed else "seqlen",
                                 "log2_bins": _trimmed(self.lengths)},
        })
        if self.packed:
            rows = int(self.fill.sum())
            out["row_fill"] = {"bins": self.fill.tolist(), "rows": rows, "mean": self.fill_sum / rows if rows else 0.0}
        if self.sources is not None:
            counts = self.sources.sums
            total = counts.sum(axis=0)
            out["source_shares"] = {"sources": self.source_names, "entries": counts.sum(axis=1).tolist(),
                                    "buckets": (counts / np.where(total > 0, total, 1.0)).tolist()}
        if self.hardness is not None:
            out["difficulty"] = {**self.hardness.summary(), "buckets": self.hardness.to_json()}
        return out


def _step_values(fig: dict, local: np.ndarray, lr_scale: np.ndarray) -> dict:
    """The per-step series of one window (:data:`STEP_SERIES`) from its :func:`format.step_figures`."""
    tokens, padded, samples = fig["tokens"], fig["padded_tokens"], fig["samples"]
    lr = np.zeros(len(tokens))
    lr[local] = lr_scale
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"tokens_per_step": tokens, "padded_tokens_per_step": padded,
                "padding_pct": np.where(padded > 0, 100.0 * (1.0 - tokens / np.where(padded > 0, padded, 1)), 0.0),
                "samples_per_step": samples, "mean_sample_length": np.where(samples > 0, tokens / samples, np.nan),
                "lr_scale": lr, "straggler": fig["straggler"]}


def packed_row_fill(rows, seqlen, lengths, entry_rows, parent) -> tuple[np.ndarray, float]:
    """Counts of packed rows by the fraction of their T that real tokens fill (:data:`FILL_BINS` bins of
    equal width; full rows in the last), and the sum of the fractions. ``rows``/``seqlen``: each
    microbatch's R and T; ``lengths``/``entry_rows``/``parent``: each entry's tokens, row and microbatch.
    Every row counts, the empty padding rows too."""
    rows = np.maximum(np.asarray(rows, np.int64), 0)
    first = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    entry_rows = np.asarray(entry_rows, np.int64)
    ok = (entry_rows >= 0) & (entry_rows < rows[parent])  # a damaged plan's rows are not counted
    total = int(rows.sum())
    used = np.bincount(first[parent[ok]] + entry_rows[ok], weights=np.asarray(lengths, np.float64)[ok],
                       minlength=total)[:total]
    length = np.repeat(np.maximum(np.asarray(seqlen, np.float64), 1.0), rows)
    fill = np.clip(used / length, 0.0, 1.0)
    return np.bincount(np.minimum((fill * FILL_BINS).astype(np.int64), FILL_BINS - 1), minlength=FILL_BINS), \
        float(fill.sum())


def _heat_rows(heat) -> dict:
    """The per-rank cost heat strip: per row (a rank, or a group of ranks when there are more than
    :data:`HEAT_RANKS`: the busiest of the group) and bucket, the rank's mean cost over the step's mean."""
    ranks = len(heat.sums)
    mean = heat.sums / np.maximum(heat.steps(), 1.0)[None, :]
    group = np.arange(ranks) * min(ranks, HEAT_RANKS) // max(ranks, 1)
    rows = [mean[group == g].max(axis=0) for g in range(int(group.max()) + 1)] if ranks else []
    bounds = [[int(np.flatnonzero(group == g)[0]), int(np.flatnonzero(group == g)[-1])] for g in range(len(rows))]
    return {"bucket_edges": heat.edges.tolist(), "rows": bounds, "ratio": [r.tolist() for r in rows]}


def _top_shapes(shapes: dict) -> dict:
    """The shapes used: how many, and the :data:`TOP_SHAPES` most used as ``[B, T, microbatches]``."""
    ranked = sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))
    top = [[k >> 32, k & 0xFFFFFFFF, n] for k, n in ranked[:TOP_SHAPES]]
    total = sum(shapes.values())
    return {"distinct": len(shapes), "microbatches": total, "top": top,
            "other_microbatches": total - sum(n for _, _, n in top)}


def _trimmed(bins: np.ndarray) -> list:
    """A log2 histogram without its empty high bins (as ``varlen analyze`` writes them)."""
    last = int(np.flatnonzero(bins).max()) + 1 if bins.any() else 1
    return bins[:last].tolist()


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
    what = {"tokens": "tokens", "packed": "tokens + A sum(l^2)", "padded": "B T + A B T^2",
            "seq2seq": "B (T + T_t) + A B (T^2 + T_t^2 + T T_t)"}.get(kind, kind)
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
    if step_rows and format.TARGET_SEQLEN_COLUMN in step_rows[0]:  # two budgets
        names = names[:5] + (format.TARGET_SEQLEN_COLUMN,) + names[5:]
    stt = TextTable("microbatches of the step", [(c, "right") for c in names + ("sample_ids",)])
    for row in step_rows:
        ids = row["sample_ids"]
        shown = ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")
        stt.rows.append(tuple(fmt(row[c]) for c in names) + (shown,))
    return stt
