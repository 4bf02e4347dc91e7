"""``varlen plan``: adapter over :func:`varlen_cli.plan.plan`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.runtime.choices import LrScaleBy, LrScaling, Order, Tail

# Options whose help does not fit on the signature's line.
INPUT_DIR = typer.Argument(
    None, show_default=False,
    help="Metrics directory (varlen analyze) or sorted directory (varlen sort; needed for --order "
    "curriculum/reverse).",
)
MIX = typer.Option(
    None, "--mix", show_default=False,
    help="Plan a mixture of sources: name=DIR:weight,... (weight 2: every sample twice per epoch, 0.5: a seeded "
    "half); the plan records each sample's source.",
)
EXTEND = typer.Option(
    None, "--extend", show_default=False,
    help="Lengthen this plan to --epochs E: its steps unchanged, new epochs appended (its other options kept; "
    "INPUT_DIR only if its input moved).",
)
OUTPUT = typer.Option(
    ..., "-o", "--output", show_default=False,
    help="Plan file to write (Parquet, one row per microbatch).",
)
MAX_TOKENS = typer.Option(
    None, "--max-tokens", show_default=False,
    help="Hard budget: padded B x T of every microbatch (plus A x B x T^2 with --attention-cost). Required unless "
    "--packing or --max-memory.",
)
ORDER = typer.Option(
    "bucket-shuffle", "--order",
    help="curriculum (sorted input's order), reverse, bucket-shuffle (near-equal lengths, batches shuffled) or "
    "random (padded fixed-batch baseline).",
)
SEED = typer.Option(
    0, "--seed",
    help="Seed of every shuffle (different per epoch, same plan for the same seed).",
)
EPOCHS = typer.Option(
    1, "--epochs",
    help="Epochs to plan; every sample once per epoch, steps counted across epochs.",
)
CURRICULUM_EPOCHS = typer.Option(
    None, "--curriculum-epochs", show_default=False,
    help="With --order curriculum/reverse: switch to bucket-shuffle after this many epochs.",
)
LR_SCALING = typer.Option(
    "linear", "--lr-scaling",
    help="Per-step LR scale: linear (b / base), sqrt, or none (1).",
)
LR_SCALE_BY = typer.Option(
    "samples", "--lr-scale-by",
    help="What b counts: samples or tokens of the step.",
)
BASE_BATCH_SIZE = typer.Option(
    None, "--base-batch-size", show_default=False,
    help="The b at which lr_scale is 1 (default: the plan's mean step size, recorded in the metadata).",
)
PAD_MULTIPLE = typer.Option(
    1, "--pad-multiple",
    help="Round every padded T up to a multiple of M (8 or 64 suit GPUs).",
)
NUM_SHAPES = typer.Option(
    None, "--num-shapes", show_default=False,
    help="At most K distinct T, bucket edges chosen to minimise padding on this data.",
)
STATIC_SHAPES = typer.Option(
    False, "--static-shapes",
    help="Also fix B per bucket (padding rows): exactly the K (B, T) shapes of --num-shapes.",
)
COMPILE_WARMUP = typer.Option(
    False, "--compile-warmup",
    help="Reorder the first steps so every rank meets every shape early (largest first); recorded as warmup_steps.",
)
SAME_SHAPE_PER_STEP = typer.Option(
    False, "--same-shape-per-step",
    help="All microbatches of a step share one B x T (pipeline parallelism).",
)
MAX_SAMPLES = typer.Option(
    None, "--max-samples", show_default=False,
    help="Cap on the samples (B) of a microbatch.",
)
ATTENTION_COST = typer.Option(
    "0", "--attention-cost",
    help="A: a padded microbatch costs B*T + A*B*T^2 against --max-tokens; a packed row costs its tokens + "
    "A*sum(l_i^2) over its segments, and rows are dealt so ranks cost alike. 'auto': from --model-dim/--layers "
    "(docs/packing.md).",
)
MODEL_DIM = typer.Option(None, "--model-dim", show_default=False,
                         help="With --attention-cost auto: the model's hidden size d.")
LAYERS = typer.Option(None, "--layers", show_default=False,
                      help="With --attention-cost auto: the model's transformer layers L.")
VOCAB_SIZE = typer.Option(None, "--vocab-size", show_default=False,
                          help="With --attention-cost auto: vocabulary size V (LM head FLOPs; default 0).")
DROP_LONG = typer.Option(
    False, "--drop-long",
    help="Drop samples that fit no microbatch (ids and count recorded) instead of failing.",
)
TAIL = typer.Option(
    "split", "--tail",
    help="split: split microbatches so every rank gets grad-accum per step (fails only with fewer samples than "
    "slots); drop: then drop the smallest tail microbatches (ids recorded).",
)
PACKING = typer.Option(
    False, "--packing",
    help="Padding-free plan: samples packed into rows of --seq-len tokens, R rows per microbatch.",
)
SEQ_LEN = typer.Option(
    None, "--seq-len", show_default=False,
    help="Packed row length T (with --packing).",
)
ROWS_PER_MICROBATCH = typer.Option(
    None, "--rows-per-microbatch", show_default=False,
    help="R packed rows per microbatch (default: --max-tokens // --seq-len, else 1).",
)
MAX_PER_ROW = typer.Option(
    None, "--max-per-row", show_default=False,
    help="Cap on the samples in one packed row.",
)
SPLIT_LONG = typer.Option(
    False, "--split-long",
    help="With --packing: cut samples longer than --seq-len into chunks (recorded as start/length segments).",
)
SCHEDULE = typer.Option(
    None, "--schedule", show_default=False,
    help="Order each step's microbatches for this parallel schedule (ddp, fsdp, gpipe, 1f1b, lpp, fslpp): the best "
         "simulated of a few orders per step (docs/schedules.md).",
)
STAGES = typer.Option(None, "--stages", show_default=False, help="Pipeline stages of --schedule.")
MEMORY_PROFILE = typer.Option(
    None, "--memory-profile", show_default=False,
    help="Memory profile from `varlen calibrate`: with --max-memory, the budget comes from it (instead of "
         "--max-tokens/--attention-cost).",
)
MAX_MEMORY = typer.Option(
    None, "--max-memory", show_default=False,
    help="Peak memory per microbatch not to exceed, e.g. 70GiB, 512MB or bytes (needs --memory-profile).",
)
MEMORY_MARGIN = typer.Option(0.05, "--memory-margin", help="Plan to a predicted peak of max-memory x (1 - margin).")
CHUNK_SAMPLES = typer.Option(
    1 << 23, "--chunk-samples",
    help="Samples planned together (a chunk): a worker holds one chunk at a time, so memory per worker is bounded "
         "by it; chunks, not workers, define the plan (docs/plan.md, \"Plans at scale\").",
)


def plan_command(
    input_dir: str = INPUT_DIR,
    output: str = OUTPUT,
    max_tokens: int | None = MAX_TOKENS,
    dp: int = typer.Option(1, "--dp", help="Data-parallel ranks: every step has dp x grad-accum microbatches."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Microbatches per rank per optimizer step."),
    order: Order = ORDER,
    seed: int = SEED,
    epochs: int = EPOCHS,
    curriculum_epochs: int | None = CURRICULUM_EPOCHS,
    lr_scaling: LrScaling = LR_SCALING,
    lr_scale_by: LrScaleBy = LR_SCALE_BY,
    base_batch_size: float | None = BASE_BATCH_SIZE,
    pad_multiple: int = PAD_MULTIPLE,
    num_shapes: int | None = NUM_SHAPES,
    static_shapes: bool = STATIC_SHAPES,
    compile_warmup: bool = COMPILE_WARMUP,
    same_shape_per_step: bool = SAME_SHAPE_PER_STEP,
    max_samples: int | None = MAX_SAMPLES,
    attention_cost: str = ATTENTION_COST,
    model_dim: int | None = MODEL_DIM,
    layers: int | None = LAYERS,
    vocab_size: int | None = VOCAB_SIZE,
    drop_long: bool = DROP_LONG,
    tail: Tail = TAIL,
    packing: bool = PACKING,
    seq_len: int | None = SEQ_LEN,
    rows_per_microbatch: int | None = ROWS_PER_MICROBATCH,
    max_per_row: int | None = MAX_PER_ROW,
    split_long: bool = SPLIT_LONG,
    memory_profile: str | None = MEMORY_PROFILE,
    max_memory: str | None = MAX_MEMORY,
    memory_margin: float = MEMORY_MARGIN,
    overwrite: bool = common.OVERWRITE,
    allow_stale: bool = common.ALLOW_STALE,
    schedule: str | None = SCHEDULE,
    stages: int | None = STAGES,
    mix: str | None = MIX,
    extend: str | None = EXTEND,
    progress: bool = common.PROGRESS,
    nproc: int = common.NPROC,
    chunk_samples: int = CHUNK_SAMPLES,
    json_output: bool = common.JSON,
) -> None:
    """Write a token-budget batch plan (Parquet): microbatches, ranks, steps, shapes and LR scales."""
    from varlen_cli.cli import report
    from varlen_cli.plan import PlanConfig, plan
    from varlen_cli.plan.cost_model import from_cli
    from varlen_cli.plan.heap import reuse_freed_memory

    config = PlanConfig(
        input=input_dir, output=output, max_tokens=max_tokens, dp=dp, grad_accum=grad_accum, order=order, seed=seed,
        epochs=epochs, curriculum_epochs=curriculum_epochs, lr_scaling=lr_scaling, lr_scale_by=lr_scale_by,
        base_batch_size=base_batch_size, pad_multiple=pad_multiple, num_shapes=num_shapes,
        static_shapes=static_shapes, compile_warmup=compile_warmup, same_shape_per_step=same_shape_per_step,
        max_samples=max_samples, attention_cost=from_cli(attention_cost), model_dim=model_dim, layers=layers,
        vocab_size=vocab_size, drop_long=drop_long, tail=tail, packing=packing,
        seq_len=seq_len, rows_per_microbatch=rows_per_microbatch, max_per_row=max_per_row, split_long=split_long,
        overwrite=overwrite, allow_stale=allow_stale, schedule=schedule, stages=stages,
        memory_profile=memory_profile, max_memory=max_memory, memory_margin=memory_margin, mix=mix, extend=extend,
        progress=progress, nproc=nproc, chunk_samples=chunk_samples,
    )
    with reuse_freed_memory():  # large plans: freed arrays reused, not unmapped and zeroed again (plan/heap.py)
        result = common.run(plan, config)
    if result is not None and json_output:
        report.print_json(report.plan_json(result))
    elif result is not None:
        report.print_plan(result)


def register(app: typer.Typer) -> None:
    app.command("plan", no_args_is_help=True)(plan_command)
