"""The options of ``varlen plan`` (:class:`PlanConfig`), its result (:class:`PlanResult`) and the
checks of the options (:func:`check`): a leaf module every other planner module may import."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import format, storage
from ..budget import attention_number, is_auto
from ..errors import UsageError
from ..memory.sizes import parse_size
from ..runtime.choices import (
    ALLOW_MEMORY_EXTRAPOLATION_HELP,
    NPROC_HELP,
    PANEL_RUN,
    STORAGE_OPTION_HELP,
    LrScaleBy,
    LrScaling,
    Order,
    Tail,
    check_choices,
    doc,
    values,
)

MAX_TOKENS_LIMIT = 2**53  # budgets are compared as float64: exact up to here
CHUNK_SAMPLES = 1 << 23  # samples per chunk (varlen_cli/plan/chunked)
ORDERS = values(Order)
TAILS = values(Tail)
# --help panels (varlen_cli/cli/options.py): the options of one concern together
BATCHES, LR, SHAPES = "Order, tail and batch size", "LR scaling", "Shapes (compilers, pipelines)"
ATTENTION, PACKING = "Attention cost", "Packing (padding-free rows)"
MEMORY, SCHEDULE, DERIVED = "Budget from a memory limit", "Pipeline schedule", "Mixtures and longer plans"


@dataclass(frozen=True)
class PlanConfig:
    """Options of ``varlen plan`` (see ``varlen plan --help`` and docs/plan.md)."""

    input: str = doc(help="Metrics directory (varlen analyze) or sorted directory (varlen sort; needed for --order "
                          "curriculum/reverse); local or an s3://... prefix.")
    output: str = doc(help="Plan file to write (Parquet, one row per microbatch); local or an s3://... object.")
    max_tokens: int | None = doc(None, "Hard budget: padded B x T of every microbatch (plus A x B x T^2 with "
                                       "--attention-cost). Required unless --packing or --max-memory.")
    max_target_tokens: int | None = doc(None, "Second budget (encoder-decoder): padded B x T_target of every "
                                              "microbatch; T_target: the longest target_length (analyze "
                                              "--target-length), column target_seqlen.")
    dp: int = doc(1, "Data-parallel ranks: every step has dp x grad-accum microbatches.")
    grad_accum: int = doc(1, "Microbatches per rank per optimizer step.")
    order: Order = doc("bucket-shuffle", "curriculum (sorted input's order), reverse, bucket-shuffle (near-equal "
                                         "lengths, batches shuffled) or random (padded fixed-batch baseline).")
    seed: int = doc(0, "Seed of every shuffle (different per epoch, same plan for the same seed).")
    epochs: int = doc(1, "Epochs to plan; every sample once per epoch, steps counted across epochs.")
    curriculum_epochs: int | None = doc(None, "With --order curriculum/reverse: switch to bucket-shuffle after this "
                                              "many epochs.", panel=BATCHES)
    lr_scaling: LrScaling = doc("linear", "Per-step LR scale: linear (b / base), sqrt, or none (1).", panel=LR)
    lr_scale_by: LrScaleBy = doc("loss-tokens", "What b counts: the step's loss tokens (the targets its mean loss "
                                                "averages over: lr_scale about 1 under a token budget), its tokens, "
                                                "or its samples.", panel=LR)
    base_batch_size: float | None = doc(None, "The b at which lr_scale is 1 (default: the plan's mean step size, "
                                              "recorded in the metadata).", panel=LR)
    pad_multiple: int = doc(1, "Round every padded T up to a multiple of M (8 or 64 suit GPUs).", panel=SHAPES)
    num_shapes: int | None = doc(None, "At most K distinct T, bucket edges chosen to minimise padding on this data.",
                                 panel=SHAPES)
    static_shapes: bool = doc(False, "Also fix B per bucket (padding rows): exactly the K (B, T) shapes of "
                                     "--num-shapes.", panel=SHAPES)
    compile_warmup: bool = doc(False, "Reorder the first steps so every rank meets every shape early (largest first); "
                                      "recorded as warmup_steps.", panel=SHAPES)
    same_shape_per_step: bool = doc(False, "All microbatches of a step share one B x T (pipeline parallelism).",
                                    panel=SHAPES)
    max_samples: int | None = doc(None, "Cap on the samples (B) of a microbatch.", panel=BATCHES)
    attention_cost: float | str = doc(0.0, "A: a padded microbatch costs B*T + A*B*T^2 against --max-tokens; a packed "
                                           "row costs its tokens + A*sum(l_i^2) over its segments, and rows are "
                                           "dealt so ranks cost alike. 'auto': from --model-dim/--layers "
                                           "(docs/packing.md).", panel=ATTENTION)
    model_dim: int | None = doc(None, "With --attention-cost auto: the model's hidden size d.", panel=ATTENTION)
    layers: int | None = doc(None, "With --attention-cost auto: the model's transformer layers L.", panel=ATTENTION)
    vocab_size: int | None = doc(None, "With --attention-cost auto: vocabulary size V (LM head FLOPs; default 0).",
                                 panel=ATTENTION)
    drop_long: bool = doc(False, "Drop samples that fit no microbatch (ids and count recorded) instead of failing.",
                          panel=BATCHES)
    tail: Tail = doc("split", "split: split microbatches so every rank gets grad-accum per step (fails only with "
                              "fewer samples than slots); drop: then drop the smallest tail microbatches (ids "
                              "recorded).", panel=BATCHES)
    packing: bool = doc(False, "Padding-free plan: samples packed into rows of --seq-len tokens, R rows per "
                               "microbatch.", panel=PACKING)
    seq_len: int | None = doc(None, "Packed row length T (with --packing).", panel=PACKING)
    rows_per_microbatch: int | None = doc(None, "R packed rows per microbatch (default: --max-tokens // --seq-len, "
                                                "else 1).", panel=PACKING)
    max_per_row: int | None = doc(None, "Cap on the samples in one packed row.", panel=PACKING)
    split_long: bool = doc(False, "With --packing: cut samples longer than --seq-len into chunks (recorded as "
                                  "start/length segments).", panel=PACKING)
    memory_profile: str | None = doc(None, "Memory profile from `varlen calibrate`: with --max-memory, the budget "
                                           "comes from it (instead of --max-tokens/--attention-cost).", panel=MEMORY)
    max_memory: str | None = doc(None, "Peak memory per microbatch not to exceed, e.g. 70GiB, 512MB or bytes (needs "
                                       "--memory-profile).", panel=MEMORY)
    memory_margin: float = doc(0.05, "Plan to a predicted peak of max-memory x (1 - margin).", panel=MEMORY)
    allow_memory_extrapolation: bool = doc(False, ALLOW_MEMORY_EXTRAPOLATION_HELP, panel=MEMORY)
    overwrite: bool = doc(False, "Replace an existing output (written atomically either way).", panel=PANEL_RUN)
    allow_stale: bool = doc(False, "Use metrics even if their source files changed (size, mtime) since "
                                   "`varlen analyze`: for data moved or copied on purpose.", panel=PANEL_RUN)
    schedule: str | None = doc(None, "Order each step's microbatches for this parallel schedule (ddp, fsdp, gpipe, "
                                     "1f1b, lpp, fslpp): the best simulated of a few orders per step "
                                     "(docs/schedules.md).", panel=SCHEDULE)
    stages: int | None = doc(None, "Pipeline stages of --schedule.", panel=SCHEDULE)
    mix: str | None = doc(None, "Plan a mixture of sources: name=DIR:weight,... (weight 2: every sample twice per "
                                "epoch, 0.5: a seeded half); the plan records each sample's source.", panel=DERIVED)
    extend: str | None = doc(None, "Lengthen this plan to --epochs E: its steps unchanged, new epochs appended (its "
                                   "other options kept; INPUT_DIR only if its input moved).", panel=DERIVED)
    progress: bool = doc(True, "Show a progress bar on rank 0 (only on a terminal).", panel=PANEL_RUN)
    nproc: int = doc(1, NPROC_HELP, panel=PANEL_RUN)
    chunk_samples: int = doc(CHUNK_SAMPLES, "Samples planned together (a chunk): a worker holds one chunk at a time, "
                                            "so memory per worker is bounded by it; chunks, not workers, define the "
                                            "plan (docs/plan.md, \"Plans at scale\").", panel=PANEL_RUN)
    storage_options: tuple = doc((), STORAGE_OPTION_HELP, panel=PANEL_RUN)
    recorded_input: str | None = doc(None, "Library only: the input path the plan's metadata records, when the "
                                           "input is built somewhere else first (varlen run: in a temporary "
                                           "directory, swapped in afterwards).")


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
    write_segments: int = 0  # segments the workers wrote in parallel and rank 0 joined (0: one writer streamed it)
    layout_shared: bool = False  # every worker laid out a share of each epoch (False: one worker, or too little memory)


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
    storage.parse_options(c.storage_options)
    if not c.input:
        raise UsageError("missing INPUT_DIR: the metrics or sorted directory to plan (or --extend PLAN)")
    _check_memory(c)
    if not c.packing and c.max_tokens is None and c.max_memory is None:
        raise UsageError("--max-tokens is required (or --max-memory with --memory-profile, or --packing --seq-len T)")
    _positive("--max-tokens", c.max_tokens)
    _positive("--dp", c.dp, False)
    _positive("--grad-accum", c.grad_accum, False)
    _positive("--epochs", c.epochs, False)
    _positive("--pad-multiple", c.pad_multiple, False)
    _positive("--num-shapes", c.num_shapes)
    _positive("--max-samples", c.max_samples)
    _positive("--chunk-samples", c.chunk_samples, False)
    _check_ranges(c)
    _check_target(c)
    if c.base_batch_size is not None and not c.base_batch_size > 0:
        raise UsageError(f"--base-batch-size must be > 0 (got {c.base_batch_size})")
    _check_attention(c)
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


TARGET_EXCLUDES = (
    ("packing", "--packing", "a packed row has no target side; plan padded microbatches"),
    ("max_memory", "--max-memory", "a memory profile is measured on one sequence; give --max-tokens"),
    ("static_shapes", "--static-shapes", "a shape would be (B, T, T_target); --num-shapes and --pad-multiple apply "
                                         "to both sides"),
    ("compile_warmup", "--compile-warmup", "its warm-up covers the (B, T) shapes only"),
    ("same_shape_per_step", "--same-shape-per-step", "a step would need one T_target too"),
)
"""The options ``--max-target-tokens`` refuses, each with why (docs/plan.md, "Two budgets")."""


def _check_target(c: PlanConfig) -> None:
    """``--max-target-tokens``: an integer in range (beside ``--max-tokens``, which :func:`check` requires
    without ``--packing``/``--max-memory``), and none of :data:`TARGET_EXCLUDES`."""
    if c.max_target_tokens is None:
        return
    for name, option, why in TARGET_EXCLUDES:
        if getattr(c, name):
            raise UsageError(f"--max-target-tokens does not apply with {option}: {why}")
    _positive("--max-target-tokens", c.max_target_tokens)
    if c.max_target_tokens > MAX_TOKENS_LIMIT:
        raise UsageError(f"--max-target-tokens must be at most 2^53 (got {c.max_target_tokens})")


def _check_attention(c: PlanConfig) -> None:
    """One-line UsageErrors for a bad ``--attention-cost`` / ``--model-dim`` / ``--layers`` / ``--vocab-size``."""
    for name, value in (("--model-dim", c.model_dim), ("--layers", c.layers)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1 (got {value})")
    if c.vocab_size is not None and c.vocab_size < 0:
        raise UsageError(f"--vocab-size must be >= 0 (got {c.vocab_size})")
    if is_auto(c.attention_cost):
        if c.model_dim is None or c.layers is None:
            raise UsageError("--attention-cost auto needs --model-dim and --layers (the model's shape)")
        return
    if c.model_dim is not None or c.layers is not None or c.vocab_size is not None:
        raise UsageError("--model-dim, --layers and --vocab-size need --attention-cost auto")
    if isinstance(c.attention_cost, str):
        try:
            float(c.attention_cost)
        except ValueError:
            raise UsageError(f"--attention-cost must be a number >= 0 or 'auto' (got {c.attention_cost!r})") from None
    if attention_number(c.attention_cost) is None:
        raise UsageError(f"--attention-cost must be >= 0 (got {float(c.attention_cost)})")


def _check_memory(c: PlanConfig) -> None:
    """``--max-memory`` and ``--memory-profile`` (the profile itself is read by the budget's resolution)."""
    if c.memory_profile is None and c.max_memory is None:
        if c.allow_memory_extrapolation:
            raise UsageError("--allow-memory-extrapolation applies to --max-memory with --memory-profile")
        return
    if c.memory_profile is None or c.max_memory is None:
        raise UsageError("--max-memory and --memory-profile go together")
    parse_size(c.max_memory)
    if not 0 <= c.memory_margin < 1:
        raise UsageError(f"--memory-margin must be in [0, 1) (got {c.memory_margin})")
    if c.max_tokens is not None:
        raise UsageError("--max-tokens and --max-memory exclude each other (the budget comes from the profile)")
    if is_auto(c.attention_cost) or attention_number(c.attention_cost) != 0.0:
        raise UsageError("--attention-cost and --max-memory exclude each other (A comes from the profile)")


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
