"""``varlen calibrate``: adapter over :func:`varlen_cli.memory.calibrate` (options: ``CalibrateConfig``'s
fields)."""

from __future__ import annotations

import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import OUTPUT, config_command
from varlen_cli.memory.calibrate import CalibrateConfig


@config_command(CalibrateConfig, fields={"output": OUTPUT})
def calibrate_command(
    config: CalibrateConfig,
    json_output: bool = typer.Option(False, "--json", help="Print the profile (or --verify's measurements) as JSON "
                                                           "instead of tables."),
) -> None:
    """Write a memory profile, peak(B, T) = c0 + c1*B*T + c2*B*T^2, for `varlen plan --max-memory`.

    With --verify PLAN: run the plan's largest microbatches with --model, each in a fresh process, and
    compare the measured peaks with the limit (exit 6 above it).
    """
    from varlen_cli.memory.calibrate import calibrate

    if config.verify is not None:
        return _verify(config, json_output)
    profile = common.run(calibrate, config)
    if not common.prints():
        return
    if json_output:
        import json

        typer.echo(json.dumps(profile, indent=2, default=str))
    else:
        print_profile(profile, config.output)


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
