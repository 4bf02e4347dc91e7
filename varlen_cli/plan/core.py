"""The planner: config, checks, per-epoch microbatch formation, layout, LR, statistics, writing."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from .. import __version__, format
from ..errors import InputError, InternalConsistencyError, UsageError
from ..runtime import artifacts, freshness, rank0, safety
from ..runtime.choices import NPROC_HELP, LrScaleBy, LrScaling, Order, Tail, check_choices, doc, values
from . import balance, batching, cost_model, layout, lr, stats, writer
from .batching import Microbatches
from .layout import EpochLayout
from .orders import CURRICULAR, EpochInputs, Formers
from .progress import PlanProgress
from .shapes import Budget, ShapeMap, choose_edges, pair_ids

MAX_TOKENS_LIMIT = 2**53  # budgets are compared as float64: exact up to here
CHUNK_SAMPLES = 1 << 23  # samples per chunk (varlen_cli/plan/chunked)
ORDERS = values(Order)
TAILS = values(Tail)


@dataclass(frozen=True)
class PlanConfig:
    """Options of ``varlen plan`` (see ``varlen plan --help`` and docs/plan.md)."""

    input: str = doc(help="Metrics directory (varlen analyze) or sorted directory (varlen sort; needed for --order "
                          "curriculum/reverse).")
    output: str = doc(help="Plan file to write (Parquet, one row per microbatch).")
    max_tokens: int | None = doc(None, "Hard budget: padded B x T of every microbatch (plus A x B x T^2 with "
                                       "--attention-cost). Required unless --packing.")
    dp: int = doc(1, "Data-parallel ranks: every step has dp x grad-accum microbatches.")
    grad_accum: int = doc(1, "Microbatches per rank per optimizer step.")
    order: Order = doc("bucket-shuffle", "curriculum (sorted input's order), reverse, bucket-shuffle (near-equal "
                                         "lengths, batches shuffled) or random (padded fixed-batch baseline).")
    seed: int = doc(0, "Seed of every shuffle (different per epoch, same plan for the same seed).")
    epochs: int = doc(1, "Epochs to plan; every sample once per epoch, steps counted across epochs.")
    curriculum_epochs: int | None = doc(None, "With --order curriculum/reverse: switch to bucket-shuffle after this "
                                              "many epochs.")
    lr_scaling: LrScaling = doc("linear", "Per-step LR scale: linear (b / base), sqrt, or none (1).")
    lr_scale_by: LrScaleBy = doc("samples", "What b counts: samples or tokens of the step.")
    base_batch_size: float | None = doc(None, "The b at which lr_scale is 1 (default: the plan's mean step size, "
                                              "recorded in the metadata).")
    pad_multiple: int = doc(1, "Round every padded T up to a multiple of M (8 or 64 suit GPUs).")
    num_shapes: int | None = doc(None, "At most K distinct T, bucket edges chosen to minimise padding on this data.")
    static_shapes: bool = doc(False, "Also fix B per bucket (padding rows): exactly the K (B, T) shapes of "
                                     "--num-shapes.")
    compile_warmup: bool = doc(False, "Reorder the first steps so every rank meets every shape early (largest first); "
                                      "recorded as warmup_steps.")
    same_shape_per_step: bool = doc(False, "All microbatches of a step share one B x T (pipeline parallelism).")
    max_samples: int | None = doc(None, "Cap on the samples (B) of a microbatch.")
    attention_cost: float | str = doc(0.0, "A: a padded microbatch costs B*T + A*B*T^2 against --max-tokens; a packed "
                                           "row costs its tokens + A*sum(l_i^2) over its segments, and rows are "
                                           "dealt so ranks cost alike. 'auto': from --model-dim/--layers "
                                           "(docs/packing.md).")
    model_dim: int | None = doc(None, "With --attention-cost auto: the model's hidden size d.")
    layers: int | None = doc(None, "With --attention-cost auto: the model's transformer layers L.")
    vocab_size: int | None = doc(None, "With --attention-cost auto: vocabulary size V (LM head FLOPs; default 0).")
    drop_long: bool = doc(False, "Drop samples that fit no microbatch (ids and count recorded) instead of failing.")
    tail: Tail = doc("split", "split: split microbatches so every rank gets grad-accum per step (fails only with "
                              "fewer samples than slots); drop: then drop the smallest tail microbatches (ids "
                              "recorded).")
    packing: bool = doc(False, "Padding-free plan: samples packed into rows of --seq-len tokens, R rows per "
                               "microbatch.")
    seq_len: int | None = doc(None, "Packed row length T (with --packing).")
    rows_per_microbatch: int | None = doc(None, "R packed rows per microbatch (default: --max-tokens // --seq-len, "
                                                "else 1).")
    max_per_row: int | None = doc(None, "Cap on the samples in one packed row.")
    split_long: bool = doc(False, "With --packing: cut samples longer than --seq-len into chunks (recorded as "
                                  "start/length segments).")
    overwrite: bool = doc(False, "Replace an existing output (written atomically either way).")
    allow_stale: bool = doc(False, "Use metrics even if their source files changed (size, mtime) since "
                                   "`varlen analyze`: for data moved or copied on purpose.")
    schedule: str | None = doc(None, "Order each step's microbatches for this parallel schedule (ddp, fsdp, gpipe, "
                                     "1f1b, lpp, fslpp): the best simulated of a few orders per step "
                                     "(docs/schedules.md).")
    stages: int | None = doc(None, "Pipeline stages of --schedule.")
    memory_profile: str | None = doc(None, "Memory profile from `varlen calibrate`: with --max-memory, the budget "
                                           "comes from it (instead of --max-tokens/--attention-cost).")
    max_memory: str | None = doc(None, "Peak memory per microbatch not to exceed, e.g. 70GiB, 512MB or bytes (needs "
                                       "--memory-profile).")
    memory_margin: float = doc(0.05, "Plan to a predicted peak of max-memory x (1 - margin).")
    mix: str | None = doc(None, "Plan a mixture of sources: name=DIR:weight,... (weight 2: every sample twice per "
                                "epoch, 0.5: a seeded half); the plan records each sample's source.")
    extend: str | None = doc(None, "Lengthen this plan to --epochs E: its steps unchanged, new epochs appended (its "
                                   "other options kept; INPUT_DIR only if its input moved).")
    progress: bool = doc(True, "Show a progress bar on rank 0 (only on a terminal).")
    nproc: int = doc(1, NPROC_HELP)
    chunk_samples: int = doc(CHUNK_SAMPLES, "Samples planned together (a chunk): a worker holds one chunk at a time, "
                                            "so memory per worker is bounded by it; chunks, not workers, define the "
                                            "plan (docs/plan.md, \"Plans at scale\").")


@dataclass
class PlanResult:
    output: str
    order: str
    num_steps: int
    num_microbatches: int
    stats: dict
    packing: dict | None
    dropped_ids: np.ndarray
    seconds: float
    metadata: dict = field(repr=False, default_factory=dict)
    phases: dict = field(default_factory=dict)  # seconds per phase: read, form, layout, columns, write


# -- checks ----------------------------------------------------------------------------------------
def _positive(name: str, value, allow_none: bool = True) -> None:
    if value is None:
        if not allow_none:
            raise UsageError(f"{name} is required")
        return
    if value < 1:
        raise UsageError(f"{name} must be >= 1 (got {value})")


def check(c: PlanConfig) -> None:
    check_choices(c)
    if not c.input:
        raise UsageError("missing INPUT_DIR: the metrics or sorted directory to plan (or --extend PLAN)")
    if not c.packing and c.max_tokens is None:
        raise UsageError("--max-tokens is required (or --packing --seq-len T)")
    _positive("--max-tokens", c.max_tokens)
    _positive("--dp", c.dp, False)
    _positive("--grad-accum", c.grad_accum, False)
    _positive("--epochs", c.epochs, False)
    _positive("--pad-multiple", c.pad_multiple, False)
    _positive("--num-shapes", c.num_shapes)
    _positive("--max-samples", c.max_samples)
    _positive("--chunk-samples", c.chunk_samples, False)
    _check_ranges(c)
    if c.base_batch_size is not None and not c.base_batch_size > 0:
        raise UsageError(f"--base-batch-size must be > 0 (got {c.base_batch_size})")
    cost_model.check(c)
    if c.curriculum_epochs is not None:
        if c.order not in ("curriculum", "reverse"):
            raise UsageError("--curriculum-epochs needs --order curriculum or reverse")
        if c.curriculum_epochs < 0:
            raise UsageError(f"--curriculum-epochs must be >= 0 (got {c.curriculum_epochs})")
    if c.static_shapes and c.num_shapes is None and not c.packing:
        raise UsageError("--static-shapes needs --num-shapes K (the number of (B, T) shapes)")
    _check_schedule(c)
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


def _check_ranges(c: PlanConfig) -> None:
    """Values the plan's integer columns and the seeded shuffles can hold (one-line UsageErrors)."""
    if not 0 <= c.seed < 2**63:
        raise UsageError(f"--seed must be between 0 and 2^63-1 (got {c.seed})")
    if c.max_tokens is not None and c.max_tokens > MAX_TOKENS_LIMIT:
        raise UsageError(f"--max-tokens must be at most 2^53 (got {c.max_tokens})")
    for name, value in (("--pad-multiple", c.pad_multiple), ("--seq-len", c.seq_len),
                        ("--max-samples", c.max_samples), ("--rows-per-microbatch", c.rows_per_microbatch),
                        ("--max-per-row", c.max_per_row), ("--dp", c.dp), ("--grad-accum", c.grad_accum),
                        ("--num-shapes", c.num_shapes), ("--epochs", c.epochs)):
        if value is not None and value > format.INT32_MAX:
            raise UsageError(f"{name} must be at most {format.INT32_MAX:,} (plans store it as int32; got {value})")
    if c.base_batch_size is not None and not np.isfinite(c.base_batch_size):
        raise UsageError(f"--base-batch-size must be finite (got {c.base_batch_size})")


def _check_schedule(c: PlanConfig) -> None:
    if c.schedule is None:
        if c.stages is not None:
            raise UsageError("--stages needs --schedule (the parallel schedule to order the steps for)")
        return
    from ..schedule.schemes import SCHEDULES  # only here: not imported by plans without --schedule

    if c.schedule not in SCHEDULES:
        raise UsageError(f"--schedule must be one of {', '.join(SCHEDULES)} (got {c.schedule!r})")
    if c.stages is None:
        raise UsageError("--schedule needs --stages K (the pipeline stages the schedule runs)")
    _positive("--stages", c.stages)


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
def read_input(path: str, allow_stale: bool = False) -> tuple[dict, np.ndarray, np.ndarray]:
    """The manifest, sample ids and lengths of a metrics or sorted directory, in its row order."""
    import pyarrow.parquet as pq

    manifest = artifacts.read_manifest(path, what="metrics or sorted directory",
                                       hint="create one with `varlen analyze` (and `varlen sort` for curriculum order)")
    freshness.check_inputs(path, manifest, allow_stale, rerun="varlen sort")
    parts = manifest.get("parts", [])
    total = sum(int(part["rows"]) for part in parts)
    # streamed row group by row group into the final arrays: pyarrow's pool (which keeps what it
    # freed) then holds one row group, not the whole input
    sample_id, length = np.empty(total, np.int64), np.empty(total, np.int64)
    filled = 0
    for part in parts:
        p = os.path.join(path, part["file"])
        rows = int(part["rows"])
        try:  # ParquetFile, not read_table: that imports pyarrow.dataset and pandas (~0.5 s of start-up)
            pf = pq.ParquetFile(p, memory_map=True)  # no copy of the file into read buffers
            missing = [c for c in ("sample_id", "length") if c not in pf.schema_arrow.names]
            if missing:
                raise InputError(f"{p} has no column {missing[0]!r}")
            if pf.metadata.num_rows != rows:
                raise InputError(f"{p} has {pf.metadata.num_rows:,} rows but {artifacts.MANIFEST_NAME} lists "
                                 f"{rows:,}")
            for rg in range(pf.num_row_groups):
                t = pf.read_row_group(rg, columns=["sample_id", "length"])
                _fill(sample_id, filled, t, "sample_id", p)
                _fill(length, filled, t, "length", p)
                filled += len(t)
                del t
        except InputError:
            raise
        except Exception as exc:  # pyarrow raises several types for bad files
            raise InputError(f"cannot read {p}: {exc}") from None
    _release_arrow_memory()
    if not len(sample_id):
        raise InputError(f"{path} holds no samples")
    if int(length.min()) < 0:
        raise InputError(f"{path} has negative lengths")
    if int(length.max()) > format.INT32_MAX:
        raise InputError(f"{path} has a sample of {int(length.max()):,} tokens; plans hold lengths up to "
                         f"{format.INT32_MAX:,} (int32)")
    return manifest, sample_id, length


TARGET_COLUMN = "target_length"  # metrics column of the tokens that carry loss (analyze --target-length)


def read_targets(c: PlanConfig, path: str, manifest: dict) -> np.ndarray | None:
    """The input's ``target_length`` column (row order, as :func:`read_input`), or None without one."""
    import pyarrow.parquet as pq

    if TARGET_COLUMN not in (manifest.get("columns") or {}):
        return None
    if c.packing and c.split_long:
        raise UsageError(f"--split-long cannot tell which chunk of a split sample holds its {TARGET_COLUMN} loss "
                         f"tokens (analyze --target-length); pack without --split-long")
    parts = [pq.read_table(os.path.join(path, part["file"]), columns=[TARGET_COLUMN]).column(0)
             for part in manifest.get("parts", [])]
    return np.concatenate([p.to_numpy() for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)


def _fill(out: np.ndarray, at: int, table, name: str, path: str) -> None:
    """Copy a column into ``out[at:]`` chunk by chunk (as numpy views: ``to_numpy`` imports pandas, ~0.3 s)."""
    from .arrow_io import to_numpy

    for chunk in table.column(name).chunks:
        if chunk.null_count:
            raise InputError(f"{path} has missing values in column {name!r}")
        if len(chunk):
            out[at:at + len(chunk)] = to_numpy(chunk)
        at += len(chunk)


def _release_arrow_memory() -> None:
    import pyarrow as pa

    try:
        pa.default_memory_pool().release_unused()
    except AttributeError:  # pragma: no cover - older pyarrow
        pass


def canonical_order(sample_id: np.ndarray) -> np.ndarray:
    """Positions in increasing sample_id: random and bucket-shuffle plans then do not depend on
    whether the input was a metrics or a sorted directory."""
    n = len(sample_id)
    if n < 2 or bool(np.all(sample_id[1:] > sample_id[:-1])):
        return np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64)  # positions: 4 bytes a sample
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
    """Run ``varlen plan``: read the input, plan every epoch, write the plan; returns the summary.
    Plans of a metrics or sorted directory are planned by chunks (``plan/chunked``), on ``--nproc``
    workers or the ranks of a torchrun job; ``--extend`` and ``--mix`` run on rank 0."""
    if config.extend is not None or config.mix is not None:
        if config.nproc != 1:
            raise UsageError("--nproc applies to plans of one metrics or sorted directory, not to --extend or --mix")
        if rank0.needs_group():  # under torchrun: rank 0 plans and writes, the others wait
            return rank0.on_rank0(plan, config)
        if config.extend is not None:  # varlen plan --extend PLAN --epochs E (plan/replan.py)
            from .replan import run_extend

            return run_extend(config)
        from .mixture import plan_mixture  # varlen plan --mix a=DIR:w,... (plan/mixture.py)

        return plan_mixture(config)
    t0 = time.perf_counter()
    c = _resolved(config)
    from ..runtime.dist import check_nproc
    from .chunked.run import plan_chunked

    check_nproc(c.nproc)
    return plan_chunked(c, t0)


def _resolved(config: PlanConfig) -> PlanConfig:
    """The config with a ``--max-memory`` budget resolved, checked."""
    c = config
    if c.memory_profile is not None or c.max_memory is not None:  # budget = max_tokens/attention_cost from memory
        from varlen_cli.memory.budget import plan_config_for_memory

        c = plan_config_for_memory(c)
    check(c)
    return c


def plan_in_group(config: PlanConfig, d) -> PlanResult | None:
    """``plan`` by every rank of an existing process group ``d`` (``varlen run``); rank 0's result."""
    t0 = time.perf_counter()
    from .chunked.run import plan_in_group as chunked

    return chunked(_resolved(config), d, t0)


def plan_in_memory(config: PlanConfig) -> PlanResult:
    """The single-process planner on the whole input at once (what ``plan`` ran before chunks;
    kept for comparisons in tests and benchmarks)."""
    t0 = time.perf_counter()
    c = config
    if c.memory_profile is not None or c.max_memory is not None:
        from varlen_cli.memory.budget import plan_config_for_memory

        c = plan_config_for_memory(c)
    check(c)
    safety.check_no_overlap(c.output, [c.input])
    writer.check_output(c.output, c.overwrite)
    with PlanProgress(c.progress, c.epochs) as bar:
        bar.phase("read")
        manifest, sample_id, length = read_input(c.input, c.allow_stale)
        target = read_targets(c, c.input, manifest)
        kind = manifest.get("kind", "metrics")
        if c.order in CURRICULAR and kind != "sorted":
            raise UsageError(f"--order {c.order} needs a sorted input, but {c.input} is a {kind} directory "
                             f"(sample_id order); sort it first: `varlen sort {c.input} -o SORTED_DIR`")
        budget = Budget(c.max_tokens, c.max_samples, cost_model.attention_cost(c))
        inputs, long_pos = epoch_inputs(c, sample_id, length, budget)
        epochs, fixed_batch = plan_epochs(c, inputs, bar=bar)
        bar.phase("columns")
        cols, items = assemble_columns(c, sample_id, length, epochs, inputs.slots, target)
        bar.phase("write")
        result = finish(c, manifest, sample_id, epochs, cols, items, long_pos, inputs, fixed_batch, t0)
    result.phases = dict(bar.seconds)
    return result


def _too_long(c: PlanConfig, length: np.ndarray, budget: Budget, shape: ShapeMap) -> np.ndarray:
    """Mask of the samples that cannot fit any microbatch; raises unless --drop-long (or none fits)."""
    if c.packing:
        too_long = (length > c.seq_len) if not c.split_long else np.zeros(len(length), bool)
    else:
        too_long = length > _longest_fitting(length, budget, shape)
    n_long = int(np.count_nonzero(too_long))
    error = too_long_error(c, n_long, len(length), int(length.max()) if len(length) else 0,
                           int(length.min()) if len(length) else 0)
    if error is not None:
        raise error
    return too_long


def too_long_error(c: PlanConfig, n_long: int, n: int, longest: int, shortest: int) -> InputError | None:
    """The error for ``n_long`` of ``n`` samples too long for any microbatch (None when that is fine:
    none, or --drop-long and some fit)."""
    budget_name = (f"--max-memory {c.max_memory} (max_tokens {c.max_tokens:,} from the profile)" if c.max_memory
                   else f"--max-tokens {c.max_tokens:,}" if c.max_tokens is not None else "")
    if n_long and n_long == n:
        if c.packing:
            return InputError(f"--seq-len {c.seq_len:,} is below every sample: the shortest has {shortest:,} tokens")
        return InputError(f"the budget is below every sample: {budget_name} fits none of the {n:,} samples (the "
                          f"shortest has {shortest:,} tokens)")
    if n_long and not c.drop_long:
        if c.packing:
            return InputError(f"{n_long:,} samples are longer than --seq-len {c.seq_len:,} (the longest has "
                              f"{longest:,} tokens); pass --split-long, --drop-long or a larger --seq-len")
        return InputError(f"{n_long:,} samples do not fit the budget {budget_name} (the longest has {longest:,} "
                          f"tokens); raise {budget_name.split()[0]} or pass --drop-long")
    return None


def _longest_fitting(length: np.ndarray, budget: Budget, shape: ShapeMap) -> int:
    """The longest length (up to the input's longest) one sample of which fits a microbatch, -1 for none.
    Whether one sample fits falls with its length (its T = pad(l) and its cost grow with l), so a
    binary search on the scalar test classifies every sample as the per-sample test would, in one pass."""
    def fits(x: int) -> bool:
        return bool(budget.fits(1, shape.pad(np.array([x], np.int64)))[0])

    lo, hi = -1, max(int(length.max()), 0) if len(length) else 0  # fits(lo) or lo == -1; the answer is <= hi
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def epoch_inputs(c: PlanConfig, sample_id: np.ndarray, length: np.ndarray,
                  budget: Budget) -> tuple[EpochInputs, np.ndarray]:
    """The sequences epochs start from (long samples removed) and the positions of the long ones."""
    rows_per_mb = _rows_per_microbatch(c, budget) if c.packing else None
    shape = ShapeMap(1 if c.packing else c.pad_multiple)
    too_long = _too_long(c, length, budget, shape)
    n_long = int(np.count_nonzero(too_long))
    ordered = None
    if c.order in CURRICULAR:
        ordered = np.flatnonzero(~too_long) if n_long else np.arange(len(length), dtype=np.int64)
        if c.order == "reverse":
            ordered = ordered[::-1].copy()
    canon = canonical_order(sample_id)
    if n_long:  # canon = arange (ids in row order): no gather
        canon = canon[~too_long] if batching.is_identity(canon) else canon[~too_long[canon]]
    if c.num_shapes is not None and not c.packing:
        shape = ShapeMap(c.pad_multiple, choose_edges(shape.pad(length[canon]), c.num_shapes))
    inputs = EpochInputs(c, length, shape, budget, c.dp * c.grad_accum, ordered, canon, rows_per_mb)
    return inputs, np.flatnonzero(too_long)


@dataclass
class PlannedEpoch:
    mb: Microbatches  # in layout order
    layout: EpochLayout
    cost: np.ndarray  # per microbatch, layout order
    mode: str  # the order this epoch was planned in
    dropped: np.ndarray  # input positions its tail dropped
    packing_stats: dict | None
    schedule_order: dict | None = None  # --schedule: the simulated gain of the step order (schedule/order.py)


def plan_epochs(c: PlanConfig, inputs: EpochInputs, first_epoch: int = 0,
                 bar: PlanProgress | None = None) -> tuple[list[PlannedEpoch], int | None]:
    """Every epoch formed by its order's strategy and laid out; also the random order's fixed batch size.
    ``first_epoch``: the number of the first epoch (seed stream, curriculum switch), for ``varlen replan``."""
    formers = Formers()
    epochs = []
    for e in range(first_epoch, first_epoch + c.epochs):
        mode = c.order
        if c.curriculum_epochs is not None and e >= c.curriculum_epochs:
            mode = "bucket-shuffle"
        rng = np.random.default_rng([c.seed, e])
        if bar is not None:
            bar.phase(f"form epoch {e - first_epoch + 1}/{c.epochs}")
        formed = formers.for_epoch(c, mode).form(inputs, mode, rng)
        mb = formed.mb
        cost = (balance.microbatch_cost(mb, inputs.budget.attention_cost) if c.packing else
                np.asarray(inputs.budget.cost(mb.batch_size, mb.seqlen), dtype=np.float64))
        if bar is not None:
            bar.phase(f"layout epoch {e - first_epoch + 1}/{c.epochs}")
        lay = layout.layout_epoch(mb, cost, c.dp, c.grad_accum, warmup=c.compile_warmup and e == 0,
                                  same_shape=c.same_shape_per_step or c.packing, static=c.static_shapes,
                                  ranked=formed.ranked)
        ordered = None
        if c.schedule is not None:  # schedule-aware order within each step
            from ..schedule.order import reorder_layout

            lay, ordered = reorder_layout(lay, cost, mb.batch_size.astype(np.float64) * mb.seqlen, dp=c.dp,
                                          grad_accum=c.grad_accum, schedule=c.schedule, stages=c.stages)
        epochs.append(PlannedEpoch(mb.take(lay.order), lay, cost[lay.order], mode, formed.dropped,
                                   formed.packing_stats, ordered))
    return epochs, formers.random.fixed_batch


def _concat(parts: list) -> np.ndarray:
    """No copy for a single epoch (100M-sample plans: every copy is 800 MB)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def assemble_columns(c: PlanConfig, sample_id: np.ndarray, length: np.ndarray, epochs: list[PlannedEpoch],
                     slots: int, target: np.ndarray | None = None) -> tuple[dict, dict]:
    """Per-microbatch columns (all epochs, plan order) and per-sample-entry items of the plan.
    ``target``: per input row, the tokens that carry loss (``target_length``), when the input has them."""
    cols = {k: [] for k in ("epoch", "step", "rank", "micro", "num_samples", "seqlen", "batch_size", "tokens", "cost",
                            "completed", "targets")}
    items = {"sample_ids": [], "sample_lengths": [], "sample_rows": [], "sample_starts": []}
    step0 = 0
    identity = batching.is_identity(sample_id)  # ids 0..N-1 in row order (metrics directories): no gather
    any_empty = bool(len(length)) and int(length.min()) == 0
    for e, ep in enumerate(epochs):
        mb, lay = ep.mb, ep.layout
        cols["epoch"].append(np.full(mb.count, e, np.int64))
        cols["step"].append(lay.step + step0)
        cols["rank"].append(lay.rank)
        cols["micro"].append(lay.micro)
        cols["num_samples"].append(np.diff(mb.offsets))
        cols["seqlen"].append(mb.seqlen)
        cols["batch_size"].append(mb.batch_size)
        cols["tokens"].append(mb.tokens)
        cols["cost"].append(ep.cost)
        # identity: the positions are the ids (int32 where they fit; the writer widens them chunk by chunk)
        items["sample_ids"].append(mb.samples if identity else sample_id[mb.samples])
        completed, lost = _completed_and_lost(c, mb, length, any_empty)
        cols["completed"].append(completed)
        cols["targets"].append(mb.tokens.astype(np.int64) - lost if target is None else _target_sums(mb, target))
        if c.packing:
            items["sample_lengths"].append(mb.item_length)
            items["sample_rows"].append(mb.item_row)
            items["sample_starts"].append(mb.item_start)
        step0 += mb.count // slots
    return ({k: _concat(v) for k, v in cols.items()}, {k: _concat(v) for k, v in items.items() if v})


def _target_sums(mb: Microbatches, target: np.ndarray) -> np.ndarray:
    """Per microbatch, the ``target_length`` of its samples (every entry is a whole sample here)."""
    parent = np.repeat(np.arange(mb.count), np.diff(mb.offsets))
    return np.bincount(parent, weights=target[mb.samples], minlength=mb.count).astype(np.int64)


def _completed_and_lost(c: PlanConfig, mb: Microbatches, length: np.ndarray,
                        any_empty: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per microbatch: the samples it completes (every entry, except the non-final chunks of a split
    sample, which counts once, where its last token is; for step_samples) and the tokens without a
    loss target (shifted labels: the last token of each non-empty sample; a non-final chunk of a
    split sample keeps its last token's target, the next chunk's first)."""
    counts = np.diff(mb.offsets)
    if not c.packing and not any_empty:  # every entry a whole non-empty sample: one of each per entry
        return counts, counts.astype(np.int64)
    parent = np.repeat(np.arange(mb.count), counts)
    final = True
    completed = counts
    if c.packing and c.split_long and len(mb.samples):
        final = mb.item_start + mb.item_length == length[mb.samples]
        completed = np.bincount(parent, weights=final, minlength=mb.count).astype(np.int64)
    entry_len = mb.item_length if c.packing else length[mb.samples]
    lost = np.bincount(parent, weights=(entry_len > 0) & final, minlength=mb.count).astype(np.int64)
    return completed, lost


def _budget_tokens(c: PlanConfig, budget: Budget, rows_per_mb: int | None, b: np.ndarray, t: np.ndarray,
                   tokens: np.ndarray) -> float:
    """The per-microbatch token budget; checks no microbatch is over it and every T fits int32."""
    if c.packing:
        over = int(np.count_nonzero(tokens > b * t))
        if c.max_tokens is not None:
            over += int(np.count_nonzero(~budget.fits(b, t)))
        budget_tokens = float(c.max_tokens) if c.max_tokens is not None else float(rows_per_mb * c.seq_len)
    else:
        over = int(np.count_nonzero(~budget.fits(b, t)))
        budget_tokens = float(c.max_tokens)
    if over:
        raise InternalConsistencyError(f"{over} microbatches over budget")
    if len(t) and int(t.max()) > format.INT32_MAX:  # a padded T over int32 (e.g. a huge --pad-multiple)
        raise UsageError(f"a microbatch would have seqlen {int(t.max()):,}, more than plans store "
                         f"({format.INT32_MAX:,}, int32); lower --pad-multiple or --max-tokens")
    return budget_tokens


def _packing_info(c: PlanConfig, rows_per_mb: int, epochs: list[PlannedEpoch], items: dict, offsets: np.ndarray,
                  tokens: np.ndarray) -> dict:
    packing_stats = [ep.packing_stats for ep in epochs]
    rows_used = int((batching.segment_max(items["sample_rows"], offsets) + 1).sum()) if len(offsets) > 1 else 0
    eff = float(tokens.sum()) / (rows_used * c.seq_len) if rows_used else 1.0
    return {"seq_len": int(c.seq_len), "rows_per_microbatch": int(rows_per_mb), "max_per_row": c.max_per_row,
            "efficiency": eff, "split_long": bool(c.split_long),
            "split_samples": int(sum(p["split_samples"] for p in packing_stats)),
            "samples_per_row_mean": float(np.mean([p["samples_per_row_mean"] for p in packing_stats])),
            "samples_per_row_max": int(max(p["samples_per_row_max"] for p in packing_stats))}


@dataclass
class Dropped:
    """Samples the plan leaves out: too long for any microbatch (every epoch) or dropped by --tail drop."""

    long_ids: np.ndarray
    tail_ids: list  # per epoch
    epochs: int

    @property
    def tail_count(self) -> int:
        return int(sum(len(x) for x in self.tail_ids))

    @property
    def count(self) -> int:
        return len(self.long_ids) * self.epochs + self.tail_count

    def all_ids(self) -> np.ndarray:
        if not (len(self.long_ids) or self.tail_count):
            return np.zeros(0, np.int64)
        return np.unique(np.concatenate([self.long_ids] + self.tail_ids))

    def to_dict(self, all_ids: np.ndarray) -> dict:
        return {"count": self.count, "reason": {"too_long": len(self.long_ids) * self.epochs, "tail": self.tail_count},
                "sample_ids": all_ids.tolist(), "too_long_ids": self.long_ids.tolist(),
                "tail": [{"epoch": e, "sample_ids": ids.tolist()} for e, ids in enumerate(self.tail_ids) if len(ids)]}


def build_metadata(c: PlanConfig, manifest: dict, num_rows: int, epochs: list[PlannedEpoch], *, num_steps: int,
                   num_microbatches: int, shapes: list, base_batch_size, inputs: EpochInputs, fixed_batch: int | None,
                   packing: dict | None, dropped: dict, summary: dict) -> dict:
    """The plan's key-value metadata (see docs/plan.md)."""
    input_info = {"path": os.path.abspath(c.input),
                  # the input as seen from the plan's folder: still right after a move of both (varlen run's swap)
                  "relative_path": os.path.relpath(os.path.abspath(c.input),
                                                   os.path.dirname(os.path.abspath(c.output))),
                  "kind": manifest.get("kind"),
                  "artifact_id": manifest.get("artifact_id"), "num_rows": int(num_rows),
                  "dataset_digest": (manifest.get("dataset") or {}).get("digest")}
    return {
        "format": format.PLAN_FORMAT, "format_version": format.PLAN_FORMAT_VERSION,
        format.STRAGGLER_COST_KEY: format.straggler_cost(c.packing, inputs.budget.attention_cost),
        "cost_model": cost_model.describe(c),
        "varlen_version": __version__, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": artifacts.config_dict(c), "input": input_info,
        "dp": c.dp, "grad_accum": c.grad_accum, "epochs": c.epochs, "num_steps": num_steps,
        "steps_per_epoch": [ep.mb.count // inputs.slots for ep in epochs], "num_microbatches": num_microbatches,
        "orders": [ep.mode for ep in epochs],
        "shapes": shapes, "warmup_steps": epochs[0].layout.warmup_steps,
        "base_batch_size": base_batch_size, "lr_scaling": c.lr_scaling, "lr_scale_by": c.lr_scale_by,
        "budget": {"max_tokens": c.max_tokens, "max_samples": c.max_samples,
                   "attention_cost": inputs.budget.attention_cost},
        "shape_map": inputs.shape.to_dict(), "fixed_batch_size": fixed_batch,
        "packing": packing,
        "dropped": dropped,
        "stats": summary,
    }


def finish(c: PlanConfig, manifest: dict, sample_id: np.ndarray, epochs: list[PlannedEpoch], col: dict, it: dict,
            long_pos: np.ndarray, inputs: EpochInputs, fixed_batch: int | None, t0: float,
            extra_metadata: dict | None = None) -> PlanResult:
    """Step columns, LR, shapes, statistics and metadata (updated with ``extra_metadata``); writes the plan.
    ``items`` may hold a ``source`` entry list (mixture plans)."""
    num_steps = sum(ep.mb.count // inputs.slots for ep in epochs)
    counts = col["num_samples"].astype(np.int64)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    step = col["step"].astype(np.int64)
    step_samples = np.bincount(step, weights=col["completed"], minlength=num_steps).astype(np.int64)
    step_tokens = np.bincount(step, weights=col["tokens"], minlength=num_steps).astype(np.int64)
    step_loss_tokens = np.bincount(step, weights=col["targets"], minlength=num_steps).astype(np.int64)
    trained_only = TARGET_COLUMN in (manifest.get("columns") or {})  # tokens: those that carry loss
    scales, base = lr.lr_scales(step_samples, step_loss_tokens if trained_only else step_tokens, c.lr_scaling,
                                c.lr_scale_by, c.base_batch_size)
    if not np.all(np.isfinite(scales)):
        raise UsageError(f"--base-batch-size {c.base_batch_size} gives a non-finite lr_scale; give a larger base "
                         "batch size")

    # shapes: (B, T); B = 0 where it varies (no static shapes)
    fixed_b = c.static_shapes or c.packing
    key_b = col["batch_size"].astype(np.int64) if fixed_b else np.zeros(len(counts), np.int64)
    shape_b, shape_t, shape_id = pair_ids(key_b, col["seqlen"].astype(np.int64))
    shapes = [[int(x), int(y)] for x, y in zip(shape_b.tolist(), shape_t.tolist())]

    b, t = col["batch_size"].astype(np.int64), col["seqlen"].astype(np.int64)
    budget_tokens = _budget_tokens(c, inputs.budget, inputs.rows_per_mb, b, t, col["tokens"])
    strag = format.straggler(step, col["rank"].astype(np.int64), col["cost"], c.dp)
    dropped = Dropped(sample_id[long_pos], [sample_id[ep.dropped] for ep in epochs], c.epochs)
    dropped_all = dropped.all_ids()
    lay0 = epochs[0].layout
    summary = stats.summary(
        num_steps=num_steps, num_microbatches=len(counts), samples=int(counts.sum()), tokens=int(col["tokens"].sum()),
        padded_tokens=int((b * t).sum()), budget_tokens=budget_tokens, strag=strag, shapes=len(shapes), lr=scales,
        dropped=dropped.count, over_budget=0, warmup_steps=lay0.warmup_steps, epochs=c.epochs,
        samples_per_epoch=[len(ep.mb.samples) for ep in epochs], seconds=time.perf_counter() - t0)
    summary["straggler_overhead"] = format.straggler_overhead(step, col["rank"].astype(np.int64), col["cost"], c.dp)
    if lay0.warmup_missing:
        summary["warmup_missing"] = int(lay0.warmup_missing)
    if c.lr_scaling != "none" and c.lr_scale_by == "samples":
        # steps of non-final --split-long chunks only: they complete no sample, so their lr_scale is 0
        idle = int(np.count_nonzero((step_samples == 0) & (step_tokens > 0)))
        if idle:
            summary["zero_lr_scale_steps"] = idle
    packing = (_packing_info(c, inputs.rows_per_mb, epochs, it, offsets, col["tokens"]) if c.packing else None)
    metadata = build_metadata(c, manifest, len(sample_id), epochs, num_steps=num_steps, num_microbatches=len(counts),
                              shapes=shapes, base_batch_size=base, inputs=inputs, fixed_batch=fixed_batch,
                              packing=packing, dropped=dropped.to_dict(dropped_all), summary=summary)
    if trained_only:
        metadata["loss_tokens"] = TARGET_COLUMN
    metadata.update(extra_metadata or {})
    if c.schedule is not None:
        from ..schedule.order import combined_report

        metadata["schedule"] = combined_report(c.schedule, c.stages, [ep.schedule_order for ep in epochs])
    if c.memory_profile is not None:
        from varlen_cli.memory.budget import plan_memory_metadata

        metadata["memory"] = plan_memory_metadata(c, b, t, shape_id, len(shapes), bool(c.packing),
                                                  it.get("sample_lengths"), offsets)
        summary["predicted_peak_max"] = metadata["memory"]["predicted_peak_max"]
    del epochs[:]
    row_cols = {
        "epoch": col["epoch"].astype(np.int32), "step": step, "rank": col["rank"].astype(np.int32),
        "micro": col["micro"].astype(np.int32), "num_samples": counts.astype(np.int32),
        "seqlen": t.astype(np.int32), "batch_size": b.astype(np.int32), "tokens": col["tokens"].astype(np.int64),
        "lr_scale": scales[step], "shape_id": shape_id.astype(np.int32).reshape(-1),
        "step_samples": step_samples[step], "step_tokens": step_tokens[step],
        "step_loss_tokens": step_loss_tokens[step],
    }
    source = {"source": it["source"]} if "source" in it else {}
    if c.packing:
        it = {"sample_ids": it["sample_ids"], "sample_lengths": it["sample_lengths"].astype(np.int32),
              "sample_rows": it["sample_rows"].astype(np.int32), "sample_starts": it["sample_starts"].astype(np.int32),
              **source}
    else:
        it = {"sample_ids": it["sample_ids"], **source}
    writer.write_plan(c.output, c.overwrite, row_cols, offsets, it, metadata, inputs.slots)
    summary["seconds"] = time.perf_counter() - t0
    return PlanResult(output=os.path.abspath(c.output), order=c.order, num_steps=num_steps,
                      num_microbatches=len(counts), stats=summary, packing=packing, dropped_ids=dropped_all,
                      seconds=summary["seconds"], metadata=metadata)
