"""``varlen calibrate``: adapter over :func:`varlen_cli.memory.calibrate`."""

from __future__ import annotations

from typing import Literal

import typer

from varlen_cli.cli import common

_DTYPE_HELP = "Parameter dtype: float32, bfloat16, float16 (bf16, fp16, fp32 also accepted)."


_HELP = {
    "output": "Memory profile to write (JSON).",
    "model": "Measure: MODULE:FUNCTION (or path/file.py:FUNCTION) returning a torch.nn.Module.",
    "hf_config": "Analytic: a Hugging Face config.json (Llama-family decoder) instead of measuring.",
    "device": "Measure on cpu (peak resident memory of the process) or cuda (peak reserved memory plus the CUDA "
              "context).",
    "optimizer": "Optimizer whose step (and states) the profile includes.",
    "vocab_size": "Random ids are drawn below V (default: the model's embedding size).",
    "shapes": "auto (along the memory limit) or BxT,BxT,... (at least 3, with 2 different T).",
    "max_seqlen": "Longest T calibrated: auto grid (default: the longest T whose B = 1 fits --max-memory, else 2048) "
                  "or analytic fit range (default: the config's max_position_embeddings, at most 32768).",
    "max_memory": "The memory limit you will plan with (e.g. 1.5GiB): the auto grid measures around it, not beyond. "
                  "With --verify: the limit to check (default: the plan's).",
    "calibration_memory": "Auto grid without --max-memory: measure up to this peak, e.g. 8GiB (CPU default: half the "
                          "available RAM; CUDA: the device's memory).",
    "attention": "Analytic: eager materialises B x heads x T^2 scores; sdpa/flash do not.",
    "checkpointing": "Analytic: activation checkpointing per layer.",
    "sharding": "Analytic: which model states are split over --world-size ranks.",
    "world_size": "Analytic: ranks the sharded states are split over.",
    "verify": "Run this plan's largest microbatches (by predicted peak, by B x T, by T) with --model, each in a fresh "
              "process; exit 6 if one peaks above the limit.",
    "verify_count": "--verify: how many of the largest distinct shapes to run per criterion.",
    "memory_profile": "--verify: the profile whose predictions are shown (default: the one the plan was made with).",
}
_NO_DEFAULT = {"show_default": False}


def calibrate_command(
    output: str | None = typer.Option(None, "-o", "--output", help=_HELP["output"], **_NO_DEFAULT),
    model: str | None = typer.Option(None, "--model", help=_HELP["model"], **_NO_DEFAULT),
    hf_config: str | None = typer.Option(None, "--hf-config", help=_HELP["hf_config"], **_NO_DEFAULT),
    device: Literal["cpu", "cuda"] = typer.Option("cpu", "--device", help=_HELP["device"]),
    dtype: str = typer.Option("float32", "--dtype", help=_DTYPE_HELP),
    optimizer: Literal["adamw", "sgd", "none"] = typer.Option("adamw", "--optimizer", help=_HELP["optimizer"]),
    vocab_size: int | None = typer.Option(None, "--vocab-size", help=_HELP["vocab_size"], **_NO_DEFAULT),
    shapes: str = typer.Option("auto", "--shapes", help=_HELP["shapes"]),
    max_seqlen: int | None = typer.Option(None, "--max-seqlen", help=_HELP["max_seqlen"], **_NO_DEFAULT),
    max_memory: str | None = typer.Option(None, "--max-memory", help=_HELP["max_memory"], **_NO_DEFAULT),
    calibration_memory: str | None = typer.Option(None, "--calibration-memory", help=_HELP["calibration_memory"],
                                                  **_NO_DEFAULT),
    attention: Literal["eager", "sdpa", "flash"] = typer.Option("eager", "--attention", help=_HELP["attention"]),
    checkpointing: bool = typer.Option(False, "--checkpointing", help=_HELP["checkpointing"]),
    sharding: Literal["none", "zero1", "zero2", "zero3", "fsdp"] = typer.Option("none", "--sharding",
                                                                                help=_HELP["sharding"]),
    world_size: int = typer.Option(1, "--world-size", help=_HELP["world_size"]),
    verify: str | None = typer.Option(None, "--verify", help=_HELP["verify"], **_NO_DEFAULT),
    verify_count: int = typer.Option(1, "--verify-count", help=_HELP["verify_count"]),
    memory_profile: str | None = typer.Option(None, "--memory-profile", help=_HELP["memory_profile"], **_NO_DEFAULT),
    overwrite: bool = common.OVERWRITE,
    json_output: bool = typer.Option(False, "--json", help="Print the profile (or --verify's measurements) as JSON "
                                                           "instead of tables."),
) -> None:
    """Write a memory profile, peak(B, T) = c0 + c1*B*T + c2*B*T^2, for `varlen plan --max-memory`; or --verify a
    plan's largest microbatches by running them."""
    from varlen_cli.memory.calibrate import CalibrateConfig, calibrate

    config = CalibrateConfig(
        output=output, model=model, hf_config=hf_config, device=device, dtype=dtype, optimizer=optimizer,
        vocab_size=vocab_size, shapes=shapes, max_seqlen=max_seqlen, max_memory=max_memory,
        calibration_memory=calibration_memory, attention=attention, checkpointing=checkpointing, sharding=sharding,
        world_size=world_size, verify=verify, verify_count=verify_count, memory_profile=memory_profile,
        overwrite=overwrite)
    if verify is not None:
        return _verify(config, json_output)
    profile = common.run(calibrate, config)
    if json_output:
        import json

        typer.echo(json.dumps(profile, indent=2, default=str))
    else:
        print_profile(profile, output)


def _verify(config, json_output: bool) -> None:
    from varlen_cli.errors import PlanError
    from varlen_cli.memory.verify import verify_plan

    result = common.run(verify_plan, config)
    if json_output:
        import json

        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        print_verify(result)
    if not result.ok:
        import sys

        sys.stderr.write(f"varlen: error: {result.violation()}\n")
        raise typer.Exit(PlanError.exit_code)


def print_verify(result) -> None:
    from rich.console import Console
    from rich.table import Table

    from varlen_cli.memory.sizes import format_size

    t = Table(title=f"varlen calibrate --verify {result.plan}: limit {format_size(result.limit_bytes)}")
    for col in ("step/rank/micro", "B x T", "largest by", "measured", "predicted", "limit", "% of limit", "ok"):
        t.add_column(col, justify="right")
    for r in result.rows:
        measured = format_size(r.measured_bytes) if r.measured_bytes is not None else "out of memory"
        share = f"{100 * r.measured_bytes / r.limit_bytes:.1f}%" if r.measured_bytes is not None else "-"
        t.add_row(f"{r.step}/{r.rank}/{r.micro}", f"{r.batch_size}x{r.seqlen}", ", ".join(r.largest_by), measured,
                  format_size(r.predicted_bytes) if r.predicted_bytes is not None else "-",
                  format_size(r.limit_bytes), share, "[green]ok[/]" if r.ok else "[red]OVER[/]")
    Console().print(t)


def print_profile(profile: dict, path: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from varlen_cli.memory.sizes import format_size

    fit, err = profile["fit"], profile.get("fit_error") or {}
    t = Table(title=f"varlen calibrate → {path} ({profile['mode']})", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    t.add_row("model", str(profile.get("model")))
    t.add_row("device / dtype / optimizer", " / ".join(str(profile.get(k)) for k in ("device", "dtype", "optimizer")))
    t.add_row("c0 (fixed: process, model, states)", format_size(fit["c0"]))
    t.add_row("c1 (per token)", f"{fit['c1']:,.1f} B")
    t.add_row("c2 (per token x T)", f"{fit['c2']:,.3f} B")
    if err.get("heldout_max_abs_rel") is not None:
        t.add_row("held-out error max / mean", f"{100 * err['heldout_max_abs_rel']:.1f}% / "
                  f"{100 * err['heldout_mean_abs_rel']:.1f}% ({fit['heldout_points']} shapes)")
    if fit.get("method") == "envelope":
        t.add_row("fit", f"upper envelope of the measured peaks, + {format_size(fit.get('allowance', 0))}")
    t.add_row("seconds", f"{profile.get('calibration_seconds', 0):.1f}")
    Console().print(t)
    if profile.get("points"):
        p = Table(title="shapes")
        for col in ("B", "T", "peak", "predicted", "error", "held out"):
            p.add_column(col, justify="right")
        for pt in profile["points"]:
            p.add_row(str(pt["batch_size"]), str(pt["seqlen"]), format_size(pt["peak_bytes"]),
                      format_size(pt["predicted_bytes"]), f"{100 * pt['relative_error']:+.1f}%",
                      "yes" if pt.get("heldout") else "")
        Console().print(p)


def register(app: typer.Typer) -> None:
    app.command("calibrate", no_args_is_help=True)(calibrate_command)
