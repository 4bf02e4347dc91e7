"""``varlen plan``: adapter over :func:`varlen_cli.plan.plan`."""

from __future__ import annotations

from typing import Optional

import typer

from varlen_cli.cli import common


def plan_command(
    input_dir: str = typer.Argument(..., help="Metrics directory (varlen analyze) or sorted directory (varlen sort; needed for --order curriculum/reverse).", show_default=False),
    output: str = typer.Option(..., "-o", "--output", help="Plan file to write (Parquet, one row per microbatch).", show_default=False),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Hard budget: padded B x T of every microbatch (plus A x B x T^2 with --attention-cost). Required unless --packing.", show_default=False),
    dp: int = typer.Option(1, "--dp", help="Data-parallel ranks: every step has dp x grad-accum microbatches."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Microbatches per rank per optimizer step."),
    order: str = typer.Option("bucket-shuffle", "--order", help="curriculum (sorted input's order), reverse, bucket-shuffle (near-equal lengths, batches shuffled) or random (padded fixed-batch baseline)."),
    seed: int = typer.Option(0, "--seed", help="Seed of every shuffle (different per epoch, same plan for the same seed)."),
    epochs: int = typer.Option(1, "--epochs", help="Epochs to plan; every sample once per epoch, steps counted across epochs."),
    curriculum_epochs: Optional[int] = typer.Option(None, "--curriculum-epochs", help="With --order curriculum/reverse: switch to bucket-shuffle after this many epochs.", show_default=False),
    lr_scaling: str = typer.Option("linear", "--lr-scaling", help="Per-step LR scale: linear (b / base), sqrt, or none (1)."),
    lr_scale_by: str = typer.Option("samples", "--lr-scale-by", help="What b counts: samples or tokens of the step."),
    base_batch_size: Optional[float] = typer.Option(None, "--base-batch-size", help="The b at which lr_scale is 1 (default: the plan's mean step size, recorded in the metadata).", show_default=False),
    pad_multiple: int = typer.Option(1, "--pad-multiple", help="Round every padded T up to a multiple of M (8 or 64 suit GPUs)."),
    num_shapes: Optional[int] = typer.Option(None, "--num-shapes", help="At most K distinct T, bucket edges chosen to minimise padding on this data.", show_default=False),
    static_shapes: bool = typer.Option(False, "--static-shapes", help="Also fix B per bucket (padding rows): exactly the K (B, T) shapes of --num-shapes."),
    compile_warmup: bool = typer.Option(False, "--compile-warmup", help="Reorder the first steps so every rank meets every shape early (largest first); recorded as warmup_steps."),
    same_shape_per_step: bool = typer.Option(False, "--same-shape-per-step", help="All microbatches of a step share one B x T (pipeline parallelism)."),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", help="Cap on the samples (B) of a microbatch.", show_default=False),
    attention_cost: float = typer.Option(0.0, "--attention-cost", help="A: a microbatch costs B*T + A*B*T^2 against --max-tokens (bounds attention memory)."),
    drop_long: bool = typer.Option(False, "--drop-long", help="Drop samples that fit no microbatch (ids and count recorded) instead of failing."),
    tail: str = typer.Option("split", "--tail", help="split: split microbatches so every rank gets grad-accum per step (fails only with fewer samples than slots); drop: then drop the smallest tail microbatches (ids recorded)."),
    packing: bool = typer.Option(False, "--packing", help="Padding-free plan: samples packed into rows of --seq-len tokens, R rows per microbatch."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Packed row length T (with --packing).", show_default=False),
    rows_per_microbatch: Optional[int] = typer.Option(None, "--rows-per-microbatch", help="R packed rows per microbatch (default: --max-tokens // --seq-len, else 1).", show_default=False),
    max_per_row: Optional[int] = typer.Option(None, "--max-per-row", help="Cap on the samples in one packed row.", show_default=False),
    split_long: bool = typer.Option(False, "--split-long", help="With --packing: cut samples longer than --seq-len into chunks (recorded as start/length segments)."),
    memory_profile: Optional[str] = typer.Option(None, "--memory-profile", help="Memory profile from `varlen calibrate`: with --max-memory, the budget comes from it (instead of --max-tokens/--attention-cost).", show_default=False),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help="Peak memory per microbatch not to exceed, e.g. 70GiB, 512MB or bytes (needs --memory-profile).", show_default=False),
    memory_margin: float = typer.Option(0.05, "--memory-margin", help="Plan to a predicted peak of max-memory x (1 - margin)."),
    overwrite: bool = common.OVERWRITE,
) -> None:
    """Write a token-budget batch plan (Parquet): microbatches, ranks, steps, shapes and LR scales."""
    from varlen_cli.plan import PlanConfig, plan
    from varlen_cli.plan.stats import print_summary

    config = PlanConfig(
        input=input_dir, output=output, max_tokens=max_tokens, dp=dp, grad_accum=grad_accum, order=order, seed=seed,
        epochs=epochs, curriculum_epochs=curriculum_epochs, lr_scaling=lr_scaling, lr_scale_by=lr_scale_by,
        base_batch_size=base_batch_size, pad_multiple=pad_multiple, num_shapes=num_shapes,
        static_shapes=static_shapes, compile_warmup=compile_warmup, same_shape_per_step=same_shape_per_step,
        max_samples=max_samples, attention_cost=attention_cost, drop_long=drop_long, tail=tail, packing=packing,
        seq_len=seq_len, rows_per_microbatch=rows_per_microbatch, max_per_row=max_per_row, split_long=split_long,
        overwrite=overwrite, memory_profile=memory_profile, max_memory=max_memory, memory_margin=memory_margin,
    )
    result = common.run(plan, config)
    if result is not None:
        print_summary(result)


def register(app: typer.Typer) -> None:
    app.command("plan", no_args_is_help=True)(plan_command)
