"""The planner: config, checks, per-epoch microbatch formation, layout, LR, statistics, writing."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .. import __version__, artifacts
from ..errors import InputError, UsageError
from . import batching, layout, lr, stats, writer
from .shapes import Budget, ShapeMap, choose_edges, pair_ids

ORDERS = ("curriculum", "reverse", "bucket-shuffle", "random")
TAILS = ("split", "drop")


@dataclass(frozen=True)
class PlanConfig:
    """Options of ``varlen plan`` (see ``varlen plan --help`` and docs/plan.md)."""

    input: str
    output: str
    max_tokens: Optional[int] = None
    dp: int = 1
    grad_accum: int = 1
    order: str = "bucket-shuffle"
    seed: int = 0
    epochs: int = 1
    curriculum_epochs: Optional[int] = None
    lr_scaling: str = "linear"
    lr_scale_by: str = "samples"
    base_batch_size: Optional[float] = None
    pad_multiple: int = 1
    num_shapes: Optional[int] = None
    static_shapes: bool = False
    compile_warmup: bool = False
    same_shape_per_step: bool = False
    max_samples: Optional[int] = None
    attention_cost: float = 0.0
    drop_long: bool = False
    tail: str = "split"
    packing: bool = False
    seq_len: Optional[int] = None
    rows_per_microbatch: Optional[int] = None
    max_per_row: Optional[int] = None
    split_long: bool = False
    overwrite: bool = False
    memory_profile: Optional[str] = None  # varlen calibrate's profile: budget from --max-memory (docs/memory.md)
    max_memory: Optional[str] = None
    memory_margin: float = 0.05


@dataclass
class PlanResult:
    output: str
    order: str
    num_steps: int
    num_microbatches: int
    stats: dict
    packing: Optional[dict]
    dropped_ids: np.ndarray
    seconds: float
    metadata: dict = field(repr=False, default_factory=dict)


# -- checks ----------------------------------------------------------------------------------------
def _positive(name: str, value, allow_none: bool = True) -> None:
    if value is None:
        if not allow_none:
            raise UsageError(f"{name} is required")
        return
    if value < 1:
        raise UsageError(f"{name} must be >= 1 (got {value})")


def check_config(c: PlanConfig) -> None:
    if not c.packing and c.max_tokens is None:
        raise UsageError("--max-tokens is required (or --packing --seq-len T)")
    _positive("--max-tokens", c.max_tokens)
    _positive("--dp", c.dp, False)
    _positive("--grad-accum", c.grad_accum, False)
    _positive("--epochs", c.epochs, False)
    _positive("--pad-multiple", c.pad_multiple, False)
    _positive("--num-shapes", c.num_shapes)
    _positive("--max-samples", c.max_samples)
    if c.order not in ORDERS:
        raise UsageError(f"--order must be one of {', '.join(ORDERS)} (got {c.order!r})")
    if c.tail not in TAILS:
        raise UsageError(f"--tail must be one of {', '.join(TAILS)} (got {c.tail!r})")
    if c.lr_scaling not in lr.SCALINGS:
        raise UsageError(f"--lr-scaling must be one of {', '.join(lr.SCALINGS)} (got {c.lr_scaling!r})")
    if c.lr_scale_by not in lr.SCALE_BY:
        raise UsageError(f"--lr-scale-by must be one of {', '.join(lr.SCALE_BY)} (got {c.lr_scale_by!r})")
    if c.base_batch_size is not None and not c.base_batch_size > 0:
        raise UsageError(f"--base-batch-size must be > 0 (got {c.base_batch_size})")
    if not c.attention_cost >= 0:
        raise UsageError(f"--attention-cost must be >= 0 (got {c.attention_cost})")
    if c.curriculum_epochs is not None:
        if c.order not in ("curriculum", "reverse"):
            raise UsageError("--curriculum-epochs needs --order curriculum or reverse")
        if c.curriculum_epochs < 0:
            raise UsageError(f"--curriculum-epochs must be >= 0 (got {c.curriculum_epochs})")
    if c.static_shapes and c.num_shapes is None and not c.packing:
        raise UsageError("--static-shapes needs --num-shapes K (the number of (B, T) shapes)")
    if c.drop_long and c.split_long:
        raise UsageError("--drop-long and --split-long exclude each other")
    if c.packing:
        _positive("--seq-len", c.seq_len, False) if c.seq_len is not None else None
        if c.seq_len is None:
            raise UsageError("--packing needs --seq-len T (the packed row length)")
        _positive("--rows-per-microbatch", c.rows_per_microbatch)
        _positive("--max-per-row", c.max_per_row)
        if c.num_shapes is not None or c.pad_multiple != 1:
            raise UsageError("--num-shapes and --pad-multiple do not apply to --packing (a packed plan has one shape)")
        if c.max_samples is not None:
            raise UsageError("--max-samples does not apply to --packing; use --max-per-row")
    else:
        for name, value in (("--seq-len", c.seq_len), ("--rows-per-microbatch", c.rows_per_microbatch),
                            ("--max-per-row", c.max_per_row)):
            if value is not None:
                raise UsageError(f"{name} needs --packing")
        if c.split_long:
            raise UsageError("--split-long needs --packing (a padded microbatch cannot hold part of a sample)")


def _rows_per_microbatch(c: PlanConfig, budget: Budget) -> int:
    if c.rows_per_microbatch is not None:
        r = c.rows_per_microbatch
        if c.max_tokens is not None and not bool(budget.fits(r, c.seq_len)):
            raise UsageError(f"--rows-per-microbatch {r} x --seq-len {c.seq_len} exceeds the budget "
                             f"--max-tokens {c.max_tokens}")
        return r
    if c.max_tokens is None:
        return 1
    r = int(budget.cap(np.array([c.seq_len]))[0])
    if r < 1:
        raise UsageError(f"--seq-len {c.seq_len} does not fit the budget --max-tokens {c.max_tokens}")
    return r


# -- input -----------------------------------------------------------------------------------------
def read_input(path: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """The manifest, sample ids and lengths of a metrics or sorted directory, in its row order."""
    import pyarrow.parquet as pq

    manifest = artifacts.read_manifest(path, what="metrics or sorted directory",
                                       hint="create one with `varlen analyze` (and `varlen sort` for curriculum order)")
    artifacts.check_fresh(path, manifest, rerun="varlen sort")
    ids, lens = [], []
    for part in manifest.get("parts", []):
        p = os.path.join(path, part["file"])
        try:
            t = pq.read_table(p, columns=["sample_id", "length"])
        except KeyError as exc:
            raise InputError(f"{p} has no column {exc}") from None
        except Exception as exc:  # pyarrow raises several types for bad files
            raise InputError(f"cannot read {p}: {exc}") from None
        if len(t) != int(part["rows"]):
            raise InputError(f"{p} has {len(t):,} rows but {artifacts.MANIFEST_NAME} lists {int(part['rows']):,}")
        ids.append(t.column("sample_id").to_numpy().astype(np.int64, copy=False))
        lens.append(t.column("length").to_numpy().astype(np.int64, copy=False))
    sample_id = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    length = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    if not len(sample_id):
        raise InputError(f"{path} holds no samples")
    if int(length.min()) < 0:
        raise InputError(f"{path} has negative lengths")
    return manifest, sample_id, length


def canonical_order(sample_id: np.ndarray) -> np.ndarray:
    """Positions in increasing sample_id: random and bucket-shuffle plans then do not depend on
    whether the input was a metrics or a sorted directory."""
    n = len(sample_id)
    if n < 2 or bool(np.all(sample_id[1:] > sample_id[:-1])):
        return np.arange(n, dtype=np.int64)
    lo, hi = int(sample_id.min()), int(sample_id.max())
    if lo >= 0 and hi < 2 * n:
        inv = np.full(hi + 1, -1, np.int64)
        inv[sample_id] = np.arange(n, dtype=np.int64)
        out = inv[inv >= 0]
        if len(out) == n:
            return out
    return np.argsort(sample_id, kind="stable").astype(np.int64)


# -- the planner -----------------------------------------------------------------------------------
def plan(config: PlanConfig) -> PlanResult:
    """Run ``varlen plan``: read the input, plan every epoch, write the plan; returns the summary."""
    t0 = time.perf_counter()
    c = config
    if c.memory_profile is not None or c.max_memory is not None:  # budget = max_tokens/attention_cost from memory
        from varlen_cli.memory.budget import plan_config_for_memory

        c = plan_config_for_memory(c)
    check_config(c)
    writer.check_output(c.output, c.overwrite)
    manifest, sample_id, length = read_input(c.input)
    kind = manifest.get("kind", "metrics")
    if c.order in ("curriculum", "reverse") and kind != "sorted":
        raise UsageError(f"--order {c.order} needs a sorted input, but {c.input} is a {kind} directory "
                         f"(sample_id order); sort it first: `varlen sort {c.input} -o SORTED_DIR`")
    budget = Budget(c.max_tokens, c.max_samples, float(c.attention_cost))
    slots = c.dp * c.grad_accum

    # samples that cannot fit at all
    if c.packing:
        rows_per_mb = _rows_per_microbatch(c, budget)
        too_long = (length > c.seq_len) if not c.split_long else np.zeros(len(length), bool)
        shape = ShapeMap(1)
    else:
        rows_per_mb = None
        shape = ShapeMap(c.pad_multiple)
        too_long = budget.cap(shape.pad(length)) < 1
    n_long = int(np.count_nonzero(too_long))
    budget_name = (f"--max-memory {c.max_memory} (max_tokens {c.max_tokens:,} from the profile)" if c.max_memory
                   else f"--max-tokens {c.max_tokens:,}" if c.max_tokens is not None else "")
    if n_long == len(length):
        if c.packing:
            raise InputError(f"--seq-len {c.seq_len:,} is below every sample: the shortest has {int(length.min()):,} tokens")
        raise InputError(f"the budget is below every sample: {budget_name} fits none of the "
                         f"{len(length):,} samples (the shortest has {int(length.min()):,} tokens)")
    if n_long and not c.drop_long:
        longest = int(length.max())
        if c.packing:
            raise InputError(f"{n_long:,} samples are longer than --seq-len {c.seq_len:,} (the longest has {longest:,} "
                             "tokens); pass --split-long, --drop-long or a larger --seq-len")
        raise InputError(f"{n_long:,} samples do not fit the budget {budget_name} (the longest has "
                         f"{longest:,} tokens); raise {budget_name.split()[0]} or pass --drop-long")
    long_pos = np.flatnonzero(too_long)

    # the sequences epochs start from
    if c.order in ("curriculum", "reverse"):
        cur = np.flatnonzero(~too_long) if n_long else np.arange(len(length), dtype=np.int64)
        if c.order == "reverse":
            cur = cur[::-1].copy()
    else:
        cur = None
    canon = canonical_order(sample_id)
    if n_long:
        canon = canon[~too_long[canon]]
    if c.num_shapes is not None and not c.packing:
        shape = ShapeMap(c.pad_multiple, choose_edges(shape.pad(length[canon]), c.num_shapes))

    epochs, tail_dropped, packing_stats = [], [], []
    canon_padded = None  # shape(length[canon]), computed once for all bucket-shuffle epochs
    fixed_batch = None
    for e in range(c.epochs):
        mode = c.order
        if c.curriculum_epochs is not None and e >= c.curriculum_epochs:
            mode = "bucket-shuffle"
        rng = np.random.default_rng([c.seed, e])
        dropped = np.zeros(0, np.int64)
        if c.packing:
            seq = cur if mode in ("curriculum", "reverse") else canon
            from varlen_cli.packing import pack

            p = pack(length[seq], c.seq_len, max_per_row=c.max_per_row,
                     order="curriculum" if mode in ("curriculum", "reverse") else "shuffle",
                     seed=int(rng.integers(1 << 62)), split_long=c.split_long)
            packing_stats.append(p.stats())
            mb, dropped = layout.fix_tail_packed(seq[p.item_sample], p.item_start, p.item_length, p.item_row,
                                                 p.num_rows, rows_per_mb, c.seq_len, slots, c.dp, c.grad_accum, c.tail)
        elif c.same_shape_per_step and mode != "random":
            seq = cur if mode in ("curriculum", "reverse") else canon[rng.permutation(len(canon))]
            mb, dropped = batching.form_same_shape(seq, length, shape, budget, c.static_shapes, slots)
            if len(dropped) and c.tail != "drop":
                raise InputError(layout.tail_message(len(seq), mb.count + slots, c.dp, c.grad_accum))
            if mb.count == 0:
                raise InputError(f"{len(seq):,} samples are fewer than the {slots:,} microbatches of one step "
                                 "(dp x grad-accum); lower --dp/--grad-accum")
            nsteps = mb.count // slots
            if mode in ("curriculum", "reverse"):
                where = np.empty(len(length), np.int64)
                where[seq] = np.arange(len(seq))
                step_off = mb.offsets[::slots]
                key = batching.segment_sum(where[mb.samples], step_off) / np.diff(step_off)
                step_order = np.argsort(key, kind="stable")
            else:
                step_order = rng.permutation(nsteps)
            mb = mb.take((step_order[:, None] * slots + np.arange(slots)[None, :]).reshape(-1))
        else:
            if mode == "random":
                mb, fixed_batch = batching.form_random(canon, length, shape, budget, c.static_shapes, rng)
            elif mode == "bucket-shuffle":
                if canon_padded is None:
                    canon_padded = shape(length[canon])
                seq, seq_padded = batching.bucket_sequence(canon, canon_padded, rng)
                mb = batching.form_sequence(seq, length, shape, budget, c.static_shapes, seq_padded)
                del seq, seq_padded
            else:
                mb = batching.form_sequence(cur, length, shape, budget, c.static_shapes)
            fb = fixed_batch if mode == "random" else None

            def refinalize(samples, offsets, fb=fb):
                return batching.finalize_padded(samples, offsets, length, shape, budget, c.static_shapes, fb)

            mb, dropped = layout.fix_tail_padded(mb, slots, c.dp, c.grad_accum, c.tail, refinalize)
            if mode == "bucket-shuffle":
                cost = np.asarray(budget.cost(mb.batch_size, mb.seqlen), dtype=np.float64)
                mb = mb.take(layout.balanced_shuffle(cost, slots, rng))
            if c.same_shape_per_step:
                layout.same_shape_steps(mb, slots)
        cost = (mb.tokens.astype(np.float64) if c.packing else
                np.asarray(budget.cost(mb.batch_size, mb.seqlen), dtype=np.float64))
        lay = layout.layout_epoch(mb, cost, c.dp, c.grad_accum, warmup=c.compile_warmup and e == 0,
                                  same_shape=c.same_shape_per_step or c.packing, static=c.static_shapes)
        epochs.append((mb.take(lay.order), lay, cost[lay.order], mode))
        tail_dropped.append(dropped)

    return _finish(c, manifest, sample_id, length, epochs, tail_dropped, long_pos, packing_stats, rows_per_mb,
                   budget, shape, slots, t0, fixed_batch)


def _finish(c, manifest, sample_id, length, epochs, tail_dropped, long_pos, packing_stats, rows_per_mb, budget,
            shape, slots, t0, fixed_batch=None) -> PlanResult:
    cols = {k: [] for k in ("epoch", "step", "rank", "micro", "num_samples", "seqlen", "batch_size", "tokens", "cost",
                            "completed")}
    items = {"sample_ids": [], "sample_lengths": [], "sample_rows": [], "sample_starts": []}
    counts_all = []
    steps_per_epoch, samples_per_epoch = [], []
    step0 = 0
    warmup_steps, warmup_missing = 0, 0
    for e, (mb, lay, cost, mode) in enumerate(epochs):
        nsteps = mb.count // slots
        steps_per_epoch.append(nsteps)
        samples_per_epoch.append(len(mb.samples))
        if e == 0:
            warmup_steps, warmup_missing = lay.warmup_steps, lay.warmup_missing
        cols["epoch"].append(np.full(mb.count, e, np.int64))
        cols["step"].append(lay.step + step0)
        cols["rank"].append(lay.rank)
        cols["micro"].append(lay.micro)
        cols["num_samples"].append(np.diff(mb.offsets))
        cols["seqlen"].append(mb.seqlen)
        cols["batch_size"].append(mb.batch_size)
        cols["tokens"].append(mb.tokens)
        cols["cost"].append(cost)
        items["sample_ids"].append(sample_id[mb.samples])
        # Samples each microbatch completes: every entry, except the non-final chunks of a split
        # sample (a split sample counts once, where its last token is), for step_samples.
        if c.packing and c.split_long and len(mb.samples):
            final = mb.item_start + mb.item_length == length[mb.samples]
            parent = np.repeat(np.arange(mb.count), np.diff(mb.offsets))
            cols["completed"].append(np.bincount(parent, weights=final, minlength=mb.count).astype(np.int64))
        else:
            cols["completed"].append(np.diff(mb.offsets))
        if c.packing:
            items["sample_lengths"].append(mb.item_length)
            items["sample_rows"].append(mb.item_row)
            items["sample_starts"].append(mb.item_start)
        step0 += nsteps
    orders = [m for (_, _, _, m) in epochs]

    def cat(v):  # no copy for a single epoch (100M-sample plans: every copy is 800 MB)
        return v[0] if len(v) == 1 else np.concatenate(v)

    col = {k: cat(v) for k, v in cols.items()}
    it = {k: cat(v) for k, v in items.items() if v}
    del epochs[:]
    num_steps = step0
    counts = col["num_samples"].astype(np.int64)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    step = col["step"].astype(np.int64)
    step_samples = np.bincount(step, weights=col["completed"], minlength=num_steps).astype(np.int64)
    step_tokens = np.bincount(step, weights=col["tokens"], minlength=num_steps).astype(np.int64)
    scales, base = lr.lr_scales(step_samples, step_tokens, c.lr_scaling, c.lr_scale_by, c.base_batch_size)

    # shapes: (B, T); B = 0 where it varies (no static shapes)
    fixed_b = c.static_shapes or c.packing
    key_b = col["batch_size"].astype(np.int64) if fixed_b else np.zeros(len(counts), np.int64)
    shape_b, shape_t, shape_id = pair_ids(key_b, col["seqlen"].astype(np.int64))
    shapes = [[int(x), int(y)] for x, y in zip(shape_b.tolist(), shape_t.tolist())]

    b, t = col["batch_size"].astype(np.int64), col["seqlen"].astype(np.int64)
    if c.packing:
        over = int(np.count_nonzero(col["tokens"] > b * t))
        if c.max_tokens is not None:
            over += int(np.count_nonzero(~budget.fits(b, t)))
        budget_tokens = float(c.max_tokens) if c.max_tokens is not None else float(rows_per_mb * c.seq_len)
    else:
        over = int(np.count_nonzero(~budget.fits(b, t)))
        budget_tokens = float(c.max_tokens)
    assert over == 0, f"internal error: {over} microbatches over budget"
    strag = stats.straggler(step, col["rank"].astype(np.int64), col["cost"], c.dp)

    tail_ids = [sample_id[d] for d in tail_dropped]
    long_ids = sample_id[long_pos]
    n_tail = int(sum(len(x) for x in tail_ids))
    dropped_all = np.unique(np.concatenate([long_ids] + tail_ids)) if (len(long_ids) or n_tail) else np.zeros(0, np.int64)
    dropped_count = len(long_ids) * c.epochs + n_tail
    summary = stats.summary(
        num_steps=num_steps, num_microbatches=len(counts), samples=int(counts.sum()), tokens=int(col["tokens"].sum()),
        padded_tokens=int((b * t).sum()), budget_tokens=budget_tokens, strag=strag, shapes=len(shapes), lr=scales,
        dropped=dropped_count, over_budget=over, warmup_steps=warmup_steps, epochs=c.epochs,
        samples_per_epoch=samples_per_epoch, seconds=time.perf_counter() - t0)
    if warmup_missing:
        summary["warmup_missing"] = int(warmup_missing)
    packing = None
    if c.packing:
        rows_used = int((batching.segment_max(it["sample_rows"], offsets) + 1).sum()) if len(counts) else 0
        eff = float(col["tokens"].sum()) / (rows_used * c.seq_len) if rows_used else 1.0
        packing = {"seq_len": int(c.seq_len), "rows_per_microbatch": int(rows_per_mb), "max_per_row": c.max_per_row,
                   "efficiency": eff, "split_long": bool(c.split_long),
                   "split_samples": int(sum(p["split_samples"] for p in packing_stats)),
                   "samples_per_row_mean": float(np.mean([p["samples_per_row_mean"] for p in packing_stats])),
                   "samples_per_row_max": int(max(p["samples_per_row_max"] for p in packing_stats))}
    input_info = {"path": os.path.abspath(c.input), "kind": manifest.get("kind"),
                  "artifact_id": manifest.get("artifact_id"), "num_rows": int(len(sample_id)),
                  "dataset_digest": (manifest.get("dataset") or {}).get("digest")}
    metadata = {
        "format": writer.PLAN_FORMAT, "format_version": writer.PLAN_FORMAT_VERSION,
        "varlen_version": __version__, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": artifacts.config_dict(c), "input": input_info,
        "dp": c.dp, "grad_accum": c.grad_accum, "epochs": c.epochs, "num_steps": num_steps,
        "steps_per_epoch": steps_per_epoch, "num_microbatches": len(counts),
        "orders": orders,
        "shapes": shapes, "warmup_steps": warmup_steps,
        "base_batch_size": base, "lr_scaling": c.lr_scaling, "lr_scale_by": c.lr_scale_by,
        "budget": {"max_tokens": c.max_tokens, "max_samples": c.max_samples, "attention_cost": c.attention_cost},
        "shape_map": shape.to_dict(), "fixed_batch_size": fixed_batch,
        "packing": packing,
        "dropped": {"count": dropped_count, "reason": {"too_long": len(long_ids) * c.epochs, "tail": n_tail},
                    "sample_ids": dropped_all.tolist(), "too_long_ids": long_ids.tolist(),
                    "tail": [{"epoch": e, "sample_ids": ids.tolist()} for e, ids in enumerate(tail_ids) if len(ids)]},
        "stats": summary,
    }
    if c.memory_profile is not None:
        from varlen_cli.memory.budget import plan_memory_metadata

        metadata["memory"] = plan_memory_metadata(c, b, t, shape_id, len(shapes), bool(c.packing),
                                                  it.get("sample_lengths"), offsets)
        summary["predicted_peak_max"] = metadata["memory"]["predicted_peak_max"]
    row_cols = {
        "epoch": col["epoch"].astype(np.int32), "step": step, "rank": col["rank"].astype(np.int32),
        "micro": col["micro"].astype(np.int32), "num_samples": counts.astype(np.int32),
        "seqlen": t.astype(np.int32), "batch_size": b.astype(np.int32), "tokens": col["tokens"].astype(np.int64),
        "lr_scale": scales[step], "shape_id": shape_id.astype(np.int32).reshape(-1),
        "step_samples": step_samples[step], "step_tokens": step_tokens[step],
    }
    if c.packing:
        it = {"sample_ids": it["sample_ids"], "sample_lengths": it["sample_lengths"].astype(np.int32),
              "sample_rows": it["sample_rows"].astype(np.int32), "sample_starts": it["sample_starts"].astype(np.int32)}
    else:
        it = {"sample_ids": it["sample_ids"]}
    writer.write_plan(c.output, c.overwrite, row_cols, offsets, it, metadata, slots)
    summary["seconds"] = time.perf_counter() - t0
    return PlanResult(output=os.path.abspath(c.output), order=c.order, num_steps=num_steps,
                      num_microbatches=len(counts), stats=summary, packing=packing, dropped_ids=dropped_all,
                      seconds=summary["seconds"], metadata=metadata)
