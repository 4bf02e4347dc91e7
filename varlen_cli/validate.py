"""``varlen validate``: re-check every invariant of a plan, independently of the planner.

The checks read the plan (and optionally the metrics directory it was built from) and recompute
everything from scratch, vectorised: a plan of millions of microbatches validates in seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from . import format
from .errors import InputError
from .runtime import artifacts, freshness, rank0

MAX_EXAMPLES = 5


@dataclass(frozen=True)
class ValidateConfig:
    """Options of ``varlen validate``."""

    plan: str
    metrics: str | None = None
    allow_stale: bool = False
    max_memory: str | None = None  # check predicted peaks (docs/memory.md)
    memory_profile: str | None = None


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False


@dataclass
class ValidateResult:
    plan: str
    checks: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def violations(self) -> list:
        return [c for c in self.checks if not c.ok]


def _read_plan_metadata(path: str) -> tuple[dict, object]:
    """The plan's metadata and Parquet schema (:func:`varlen_cli.format.read_plan_metadata`); an
    :class:`InputError` for anything else."""
    if not os.path.exists(path):
        raise InputError(f"plan {path} does not exist")
    try:
        return format.read_plan_metadata(path)
    except format.FormatError as exc:
        raise InputError(str(exc)) from None


def validate(config: ValidateConfig) -> ValidateResult:
    """Check a plan; returns every check's outcome (``result.ok`` when all hold)."""
    import pyarrow.parquet as pq

    if rank0.needs_group():  # under torchrun: rank 0 checks, the others wait for its result
        return rank0.on_rank0(validate, config)
    meta, schema = _read_plan_metadata(config.plan)
    problems = format.plan_schema_problems(schema, meta)
    result = ValidateResult(config.plan)
    result.checks.append(Check("columns", not problems, "; ".join(problems) if problems else
                               f"{len(schema.names)} columns"))
    if problems:
        return result
    import pyarrow as pa

    if not meta.get("mixture"):  # every plan but mixtures: read in windows, a bitmap per epoch (validate_scan)
        return _validate_scan(config, meta, result)
    try:
        table = pq.read_table(config.plan)
    except (OSError, pa.ArrowException) as exc:  # corrupted pages: the file, not varlen
        raise InputError(f"cannot read plan {config.plan}: {str(exc).strip().splitlines()[0] if str(exc) else exc}") \
            from None
    cols = _columns(table)
    pcfg = meta.get("config", {})
    dp, accum = int(meta["dp"]), int(meta["grad_accum"])
    packing = meta.get("packing")

    lengths = None
    if config.metrics:
        manifest = artifacts.read_manifest(config.metrics)
        freshness.check_inputs(config.metrics, manifest, config.allow_stale, rerun="varlen sort")
        fp = _check_fingerprint(meta, manifest, config.metrics)
        result.checks.append(fp)
        if fp.ok:  # lengths of another dataset would only produce noise
            lengths = _metrics_lengths(config.metrics, manifest)
    n_samples = int(meta.get("input", {}).get("num_rows") or 0)  # None for a mixture plan
    if lengths is not None and len(cols["flat_ids"]) and (cols["flat_ids"].min() < 0
                                                          or cols["flat_ids"].max() >= len(lengths)):
        lengths = None  # ids outside the metrics: the coverage check reports them

    result.checks.append(_check_layout(cols, dp, accum, meta))
    result.checks.append(_check_counts(cols, packed=bool(packing)))
    result.checks.append(_check_coverage(cols, meta, n_samples, packing, lengths))
    budget_cfg = {**pcfg, "attention_cost": (meta.get("budget") or {}).get("attention_cost", 0.0)}  # "auto" resolved
    result.checks.append(_check_budget(cols, budget_cfg, packing, lengths))
    result.checks.append(_check_shapes(cols, meta, pcfg))
    result.checks.append(_check_step_totals(cols))
    result.checks.append(_check_lr(cols, meta))
    if config.max_memory is not None or config.memory_profile is not None:
        from .memory.budget import memory_check

        result.checks.append(Check("memory", *memory_check(cols["batch_size"], cols["seqlen"], meta,
                                                           config.max_memory, config.memory_profile)))
    result.checks.append(_check_straggler(table, cols, meta))
    if meta.get("loss_tokens") == "target_length":  # analyze --target-length: not derived from the lengths
        result.checks.append(Check("loss tokens", True, "the plan counts the metrics' target_length (assistant "
                                   "tokens), not lengths", skipped=True))
    else:
        result.checks.append(_check_loss_tokens(cols, packing, lengths))
    return result


def _validate_scan(config: ValidateConfig, meta: dict, result: ValidateResult) -> ValidateResult:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .validate_scan import MetricsLengths, scan

    lengths = None
    if config.metrics:
        manifest = artifacts.read_manifest(config.metrics)
        freshness.check_inputs(config.metrics, manifest, config.allow_stale, rerun="varlen sort")
        fp = _check_fingerprint(meta, manifest, config.metrics)
        result.checks.append(fp)
        if fp.ok:  # lengths of another dataset would only produce noise
            lengths = MetricsLengths(config.metrics, manifest)
    try:
        pf = pq.ParquetFile(config.plan)
        result.checks += scan(config, meta, pf, lengths)
    except (OSError, pa.ArrowException) as exc:  # corrupted pages: the file, not varlen
        raise InputError(f"cannot read plan {config.plan}: {str(exc).strip().splitlines()[0] if str(exc) else exc}") \
            from None
    return result


def _columns(table) -> dict:
    import pyarrow.compute as pc

    out = {name: table.column(name).to_numpy() for name in table.column_names
           if name not in format.PLAN_LIST_COLUMNS}
    ids = table.column("sample_ids").combine_chunks()
    out["flat_ids"] = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    out["flat_parent"] = pc.list_parent_indices(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    out["list_len"] = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    for name in format.PACKED_COLUMN_NAMES + ("source",):
        if name in table.column_names:
            out["flat_" + name] = pc.list_flatten(table.column(name).combine_chunks()).to_numpy(
                zero_copy_only=False).astype(np.int64)
    return out


def _examples(mask: np.ndarray, values: np.ndarray) -> str:
    where = np.flatnonzero(mask)[:MAX_EXAMPLES]
    return ", ".join(str(int(v)) for v in values[where])


def _check_fingerprint(meta: dict, manifest: dict, metrics_path: str) -> Check:
    inp = meta.get("input", {})
    want_digest = inp.get("dataset_digest")
    have_digest = manifest.get("dataset", {}).get("digest")
    if want_digest and have_digest and want_digest != have_digest:
        return Check("fingerprint", False, f"plan was built from dataset {want_digest}, {metrics_path} describes "
                     f"{have_digest}; re-run `varlen analyze` and `varlen plan`")
    if int(inp.get("num_rows", -1)) != int(manifest.get("num_rows", -2)):
        return Check("fingerprint", False, f"plan input had {inp.get('num_rows')} samples, {metrics_path} has "
                     f"{manifest.get('num_rows')}; re-run `varlen plan`")
    if inp.get("artifact_id") not in (None, manifest.get("artifact_id")) and manifest.get("kind") == inp.get("kind"):
        return Check("fingerprint", False, f"plan was built from another {inp.get('kind')} artifact "
                     f"({inp.get('artifact_id')}, now {manifest.get('artifact_id')}); re-run `varlen plan`")
    return Check("fingerprint", True, f"dataset {have_digest}")


def _metrics_lengths(path: str, manifest: dict) -> np.ndarray:
    table = artifacts.read_row_range(path, manifest, 0, int(manifest["num_rows"]), ["sample_id", "length"])
    ids = table.column("sample_id").to_numpy()
    lengths = np.zeros(int(manifest["num_rows"]), dtype=np.int64)
    lengths[ids] = table.column("length").to_numpy()
    return lengths


def _check_layout(c: dict, dp: int, accum: int, meta: dict) -> Check:
    n = len(c["step"])
    if n % (dp * accum):
        return Check("layout", False, f"{n} microbatches is not a multiple of dp x grad_accum = {dp * accum}")
    steps = n // (dp * accum)
    want_step = np.repeat(np.arange(steps), dp * accum)
    want_rank = np.tile(np.repeat(np.arange(dp), accum), steps)
    want_micro = np.tile(np.arange(accum), steps * dp)
    problems = []
    for name, want in (("step", want_step), ("rank", want_rank), ("micro", want_micro)):
        bad = c[name] != want
        if bad.any():
            problems.append(f"{name} out of (step, rank, micro) order at rows {_examples(bad, np.arange(n))}")
    if int(meta.get("num_steps", steps)) != steps:
        problems.append(f"metadata says {meta.get('num_steps')} steps, the plan has {steps}")
    epochs = c["epoch"]
    if n and (np.diff(epochs) < 0).any():
        problems.append("epochs decrease")
    if problems:
        return Check("layout", False, "; ".join(problems))
    return Check("layout", True, f"{steps} steps x {dp} ranks x {accum} microbatches")


def _check_counts(c: dict, packed: bool) -> Check:
    bad = c["num_samples"] != c["list_len"]
    # Packed plans: batch_size is the number of rows R, each holding several samples.
    bad_b = np.zeros(len(bad), dtype=bool) if packed else c["batch_size"] < c["num_samples"]
    if bad.any() or bad_b.any():
        return Check("counts", False, f"num_samples != len(sample_ids) in {int(bad.sum())} rows; batch_size < "
                     f"num_samples in {int(bad_b.sum())} rows")
    return Check("counts", True, "num_samples and batch_size consistent")


def _dropped_per_epoch(meta: dict, epochs: int, n: int) -> np.ndarray:
    """(epochs, n) bool: the samples each epoch leaves out (too long: every epoch; --tail drop: its
    own epoch). Plans without the per-epoch lists fall back to the union for every epoch."""
    info = meta.get("dropped") or {}
    mask = np.zeros((epochs, n), dtype=bool)
    if "too_long_ids" in info:
        ids = np.asarray(info.get("too_long_ids", []), dtype=np.int64)
        mask[:, ids[(ids >= 0) & (ids < n)]] = True
        for entry in info.get("tail", []):
            e, ids = int(entry["epoch"]), np.asarray(entry["sample_ids"], dtype=np.int64)
            if 0 <= e < epochs:
                mask[e, ids[(ids >= 0) & (ids < n)]] = True
    else:
        ids = np.asarray(info.get("sample_ids", []), dtype=np.int64)
        mask[:, ids[(ids >= 0) & (ids < n)]] = True
    return mask


def _check_coverage(c: dict, meta: dict, n: int, packing, lengths) -> Check:
    if meta.get("mixture"):  # varlen plan --mix: per source and weight (plan/mixture.py)
        from .plan.mixture import coverage_problems

        problems = coverage_problems(c["flat_ids"], c["flat_source"], c["epoch"][c["flat_parent"]], meta)
        return Check("coverage", not problems, "; ".join(problems) or "every source's samples as often as its weight "
                     "in each epoch")
    dropped = np.asarray(meta.get("dropped", {}).get("sample_ids", []), dtype=np.int64)
    ids, parent = c["flat_ids"], c["flat_parent"]
    if len(ids) and (ids.min() < 0 or ids.max() >= max(n, 1)):
        return Check("coverage", False, f"sample ids outside 0..{n - 1}")
    epoch = c["epoch"][parent].astype(np.int64)
    epochs = int(meta.get("epochs", int(epoch.max()) + 1 if len(epoch) else 1))
    split = bool(packing and packing.get("split_long"))
    problems = []
    if split and lengths is not None and "flat_sample_starts" in c:
        # Tokens of every sample exactly once per epoch: chunks tile [0, length).
        key = epoch * n + ids
        order = np.lexsort((c["flat_sample_starts"], key))
        k, s, ln = key[order], c["flat_sample_starts"][order], c["flat_sample_lengths"][order]
        first = np.concatenate([[True], k[1:] != k[:-1]])
        expect_start = np.where(first, 0, np.concatenate([[0], (s + ln)[:-1]]))
        if (s != expect_start).any():
            problems.append("split chunks overlap or leave gaps")
        covered = np.zeros(epochs * n, dtype=np.int64)
        np.add.at(covered, k, ln)
        counts = covered.reshape(epochs, n)
        want = np.broadcast_to(lengths, (epochs, n)).copy()
        want[_dropped_per_epoch(meta, epochs, n)] = 0
        bad = counts != want
        if bad.any():
            problems.append(f"{int(bad.sum())} (epoch, sample) pairs do not have all their tokens exactly once")
    else:
        counts = np.bincount(epoch * n + ids, minlength=epochs * n).reshape(epochs, max(n, 1))[:, :n]
        expected = np.ones((epochs, n), dtype=np.int64)
        expected[_dropped_per_epoch(meta, epochs, n)] = 0
        dup = counts > expected
        miss = counts < expected
        consumed = int((meta.get("lineage") or {}).get("consumed_samples") or 0)  # varlen replan: done before
        if consumed and int(miss[0].sum()) == consumed:
            miss[0] = False
        if dup.any():
            problems.append(f"{int(dup.sum())} samples appear more than once in an epoch (e.g. ids "
                            f"{_examples(dup.any(axis=0), np.arange(n))})")
        if miss.any():
            problems.append(f"{int(miss.sum())} samples are missing from an epoch and not listed as dropped (e.g. ids "
                            f"{_examples(miss.any(axis=0), np.arange(n))})")
    if problems:
        return Check("coverage", False, "; ".join(problems))
    return Check("coverage", True, f"{n - len(dropped)} samples exactly once in each of {epochs} epochs"
                 + (f", {len(dropped)} listed as dropped" if len(dropped) else ""))


def _check_budget(c: dict, pcfg: dict, packing, lengths) -> Check:
    problems = []
    if packing:
        T = int(packing["seq_len"])
        if "flat_sample_rows" in c:
            R = c["batch_size"][c["flat_parent"]]
            bad_row = c["flat_sample_rows"] >= R
            if bad_row.any():
                problems.append(f"{int(bad_row.sum())} entries in a row beyond batch_size")
            row_key = c["flat_parent"] * int(c["batch_size"].max() or 1) + c["flat_sample_rows"]
            fill = np.bincount(row_key, weights=c["flat_sample_lengths"]) if len(row_key) else np.zeros(0)
            over = fill > T
            if over.any():
                problems.append(f"{int(over.sum())} packed rows hold more than seq_len {T} tokens")
            cap = packing.get("max_per_row")
            if cap:
                per_row = np.bincount(row_key) if len(row_key) else np.zeros(0)
                if (per_row > int(cap)).any():
                    problems.append(f"{int((per_row > int(cap)).sum())} rows hold more than {cap} samples")
        detail = f"every packed row <= {T} tokens"
    else:
        max_tokens = pcfg.get("max_tokens")
        attn = float(pcfg.get("attention_cost") or 0.0)
        B, T = c["batch_size"].astype(np.float64), c["seqlen"].astype(np.float64)
        cost = B * T + attn * B * T * T
        if max_tokens is not None:
            over = cost > float(max_tokens) + 1e-9
            if over.any():
                problems.append(f"{int(over.sum())} microbatches over the budget {max_tokens} (e.g. rows "
                                f"{_examples(over, np.arange(len(over)))})")
        max_samples = pcfg.get("max_samples")
        if max_samples and (c["num_samples"] > int(max_samples)).any():
            problems.append(f"microbatches with more than --max-samples {max_samples} samples")
        detail = f"B x T{' + A x B x T^2' if attn else ''} <= {max_tokens} in every microbatch"
    if lengths is not None and not packing:
        longest = np.zeros(len(c["seqlen"]), dtype=np.int64)
        if len(c["flat_ids"]):
            np.maximum.at(longest, c["flat_parent"], lengths[c["flat_ids"]])
        short = longest > c["seqlen"]
        if short.any():
            problems.append(f"{int(short.sum())} microbatches have a sample longer than their seqlen")
        tok = np.bincount(c["flat_parent"], weights=lengths[c["flat_ids"]], minlength=len(c["seqlen"]))
        if (tok.astype(np.int64) != c["tokens"]).any():
            problems.append("tokens column differs from the sum of the samples' lengths")
    if problems:
        return Check("budget", False, "; ".join(problems))
    return Check("budget", True, detail)


def _check_shapes(c: dict, meta: dict, pcfg: dict) -> Check:
    problems = []
    T = c["seqlen"]
    k = pcfg.get("num_shapes")
    distinct_t = len(np.unique(T))
    if k and distinct_t > int(k):
        problems.append(f"{distinct_t} distinct seqlens, more than --num-shapes {k}")
    shapes = meta.get("shapes") or []
    if len(shapes):
        sid = c["shape_id"]
        if sid.min() < 0 or sid.max() >= len(shapes):
            problems.append("shape_id outside the metadata's shapes")
        else:
            shape_arr = np.asarray(shapes, dtype=np.int64).reshape(-1, 2)
            want_b, want_t = shape_arr[sid, 0], shape_arr[sid, 1]
            if (want_t != T).any():
                problems.append(f"{int((want_t != T).sum())} rows whose seqlen differs from their shape")
            fixed_b = want_b > 0
            if (fixed_b & (want_b != c["batch_size"])).any():
                problems.append("rows whose batch_size differs from their static shape")
    if pcfg.get("static_shapes"):
        pairs = len(np.unique(c["batch_size"].astype(np.int64) * (1 << 32) + T))
        if k and pairs != int(k) and distinct_t == int(k):
            problems.append(f"static shapes: {pairs} (B, T) pairs for {k} buckets")
    if pcfg.get("same_shape_per_step"):
        step = c["step"]
        key = c["batch_size"].astype(np.int64) * (1 << 32) + T
        order = np.lexsort((key, step))
        s, kk = step[order], key[order]
        same_step = s[1:] == s[:-1]
        if (same_step & (kk[1:] != kk[:-1])).any():
            problems.append("a step mixes shapes (--same-shape-per-step)")
    if problems:
        return Check("shapes", False, "; ".join(problems))
    return Check("shapes", True, f"{distinct_t} distinct seqlens, {len(shapes)} shapes")


def _completed(c: dict) -> np.ndarray:
    """Samples each microbatch completes: its entries, except the non-final chunks of split samples
    (a split sample counts once per epoch, in the microbatch with its last chunk)."""
    if "flat_sample_starts" not in c or not len(c["flat_ids"]) or not c["flat_sample_starts"].any():
        return c["num_samples"]  # no split samples (ids may repeat in an epoch: mixture plans)
    return np.bincount(c["flat_parent"], weights=_final_entries(c), minlength=len(c["step"]))


def _final_entries(c: dict) -> np.ndarray:
    """Per entry: whether it is a sample's last (or only) chunk in its epoch."""
    ids, parent = c["flat_ids"], c["flat_parent"]
    key = c["epoch"][parent].astype(np.int64) * (int(ids.max()) + 1) + ids
    order = np.lexsort((c["flat_sample_starts"], key))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = key[order][1:] != key[order][:-1]
    final = np.zeros(len(key), dtype=bool)
    final[order[last]] = True
    return final


def _check_step_totals(c: dict) -> Check:
    step = c["step"]
    samples = np.bincount(step, weights=_completed(c))
    tokens = np.bincount(step, weights=c["tokens"])
    bad = (samples[step] != c["step_samples"]) | (tokens[step] != c["step_tokens"])
    if bad.any():
        return Check("step totals", False, f"step_samples/step_tokens wrong in {int(bad.sum())} rows")
    return Check("step totals", True, "step_samples and step_tokens match their steps")


def _check_lr(c: dict, meta: dict) -> Check:
    mode = meta.get("lr_scaling", meta.get("config", {}).get("lr_scaling", "none"))
    by = meta.get("lr_scale_by", meta.get("config", {}).get("lr_scale_by", "samples"))
    base = meta.get("base_batch_size")
    step = c["step"]
    if by == "tokens" and meta.get("loss_tokens") == "target_length":  # tokens that carry loss (assistant-only)
        per_step = c["step_loss_tokens"].astype(np.float64)
    else:
        per_step = np.bincount(step, weights=c["tokens"] if by == "tokens" else _completed(c))[step]
    if mode == "none":
        want = np.ones(len(step))
    else:
        if not base:
            return Check("lr_scale", False, "metadata has no base_batch_size")
        ratio = per_step / float(base)
        want = ratio if mode == "linear" else np.sqrt(ratio)
    if not np.all(np.isfinite(c["lr_scale"])):
        return Check("lr_scale", False, f"{int((~np.isfinite(c['lr_scale'])).sum())} rows whose lr_scale is not finite")
    bad = ~np.isclose(c["lr_scale"], want, rtol=1e-9, atol=1e-12)
    if bad.any():
        return Check("lr_scale", False, f"{int(bad.sum())} rows whose lr_scale is not {mode}({by} / {base})")
    return Check("lr_scale", True, f"{mode} in step {by}" + (f" / {base:g}" if base and mode != "none" else ""))


def _check_straggler(table, c: dict, meta: dict) -> Check:
    """The straggler in the plan's own cost model (:func:`varlen_cli.format.plan_straggler_cost`),
    recomputed from the columns; fails when the plan's recorded statistics say otherwise."""
    spec = format.plan_straggler_cost(meta)
    if not len(c["step"]):
        return Check("straggler", True, "no steps")
    cost = format.table_cost(table, spec)
    step, rank, dp = c["step"].astype(np.int64), c["rank"].astype(np.int64), int(meta["dp"])
    per_step = format.straggler(step, rank, cost, dp)
    overhead = format.straggler_overhead(step, rank, cost, dp)
    what = ", ".join(f"{k}={v}" for k, v in spec.items())
    detail = (f"mean {per_step.mean():.3f}, max {per_step.max():.3f}, overhead {100 * overhead:.2f}% "
              f"in cost {what}")
    stats = meta.get("stats") or {}
    for key, value in (("straggler_mean", per_step.mean()), ("straggler_max", per_step.max())):
        if key in stats and not np.isclose(float(stats[key]), float(value), rtol=1e-9, atol=1e-12):
            return Check("straggler", False, f"metadata says {key} {stats[key]:.6g}, the plan has {value:.6g} "
                         f"(cost {what})")
    return Check("straggler", True, detail)


def _check_loss_tokens(c: dict, packing, lengths) -> Check:
    """``step_loss_tokens`` (when the plan has it) against the targets counted from the lengths:
    ``max(l - 1, 0)`` per sample, ``l`` for a non-final chunk of a split sample."""
    if "step_loss_tokens" not in c:
        return Check("loss tokens", True, "plan has no step_loss_tokens column (older plan)", skipped=True)
    if packing and "flat_sample_lengths" in c:
        entry_len = c["flat_sample_lengths"]
    elif lengths is not None:
        entry_len = lengths[c["flat_ids"]]
    else:
        return Check("loss tokens", True, "needs --metrics for a padded plan", skipped=True)
    final = np.ones(len(entry_len), dtype=bool)
    if "flat_sample_starts" in c and len(entry_len) and c["flat_sample_starts"].any():
        final = _final_entries(c)  # split samples (ids may also repeat in an epoch without: mixture copies)
    parent, step = c["flat_parent"], c["step"]
    targets = np.bincount(parent, weights=np.where(final, np.maximum(entry_len - 1, 0), entry_len),
                          minlength=len(step))
    want = np.bincount(step, weights=targets)[step] if len(step) else np.zeros(0)
    bad = want.astype(np.int64) != c["step_loss_tokens"]
    if bad.any():
        return Check("loss tokens", False, f"step_loss_tokens wrong in {int(bad.sum())} rows (e.g. steps "
                     f"{_examples(bad, step)})")
    return Check("loss tokens", True, "step_loss_tokens = targets counted from the samples' lengths")

