"""``varlen simulate``: adapter over :func:`varlen_cli.schedule.simulate`."""

from __future__ import annotations

import typer

from varlen_cli.cli import common

WORKERS_HELP = ("Workers W (default: dp for ddp/fsdp; groups x S for gpipe/1f1b; lpp/fslpp: groups x R, "
                "default R = S).")
GROUPS_HELP = "Data-parallel groups G of the pipelines (default: the plan's dp); must divide dp x grad_accum."
ATTENTION_HELP = "A: a stage's forward of a microbatch costs B*T + A*B*T^2 (default 0: padded tokens B*T)."
GANTT_HELP = "Draw step N as a Gantt chart: worker rows, time columns, microbatch ids."
SCHEDULE_HELP = ("ddp, fsdp, gpipe, 1f1b, lpp, fslpp, all (side by side), or MODULE:FUNCTION returning a "
                 "varlen_cli.schedule.Scheme.")


def simulate_command(
    plan: str = typer.Argument(..., help="Plan Parquet file written by `varlen plan`.", show_default=False),
    schedule: str = typer.Option("all", "--schedule", help=SCHEDULE_HELP),
    stages: int = typer.Option(..., "--stages", help="Pipeline stages S the model is cut into (equal cost each).",
                               show_default=False),
    workers: int | None = typer.Option(None, "--workers", help=WORKERS_HELP, show_default=False),
    groups: int | None = typer.Option(None, "--groups", help=GROUPS_HELP, show_default=False),
    backward_ratio: float = typer.Option(2.0, "--backward-ratio", help="Backward time / forward time of a job."),
    attention_cost: float = typer.Option(0.0, "--attention-cost", help=ATTENTION_HELP),
    gantt_step: int | None = typer.Option(None, "--gantt-step", help=GANTT_HELP, show_default=False),
    width: int = typer.Option(96, "--width", help="Columns of the Gantt chart."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON: one object, a list with --schedule all."),
) -> None:
    """Simulate the plan's steps under parallel schedules: makespan, bubble, peak activations, transfers."""
    from varlen_cli.schedule import SimulateConfig, simulate

    config = SimulateConfig(plan=plan, schedule=schedule, stages=stages, workers=workers, groups=groups,
                            backward_ratio=backward_ratio, attention_cost=attention_cost, gantt_step=gantt_step)
    result = common.run(simulate, config)
    if json_output:
        import json

        objects = [r.to_json() for r in result.results]
        typer.echo(json.dumps(objects if schedule == "all" else objects[0]))
        return
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped: do not wrap the table and the chart at 80 columns
        console = Console(width=max(120, width + 8))
    console.print(summary_table(result))
    if gantt_step is not None:
        for r in result.results:
            console.print(gantt_chart(r, gantt_step, width))


def summary_table(result):
    from rich.table import Table

    t = Table(title=f"varlen simulate {result.plan}")
    for name in ("schedule", "workers", "makespan", "utilization", "bubble", "peak act. (tokens)",
                 "act. transfers (tokens)", "weight transfers (stages)"):
        t.add_column(name, justify="left" if name == "schedule" else "right")
    for r in result.results:
        t.add_row(r.schedule, str(r.workers), f"{r.makespan:.4g}", f"{r.utilization:.1%}", f"{r.bubble:.1%}",
                  f"{r.peak_activation.max():,.0f}", f"{r.activation_transfers.sum():,.0f}",
                  f"{r.weight_transfers.sum():,.0f}")
    return t


_IDS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def gantt_chart(r, step: int, width: int):
    """Worker rows, ``width`` time columns; a cell shows the microbatch running at its middle
    (cyan forward, magenta backward, ``.`` idle)."""
    from rich.text import Text

    makespan = float(r.steps[step]) or 1.0
    width = max(8, width)
    text = Text(f"{r.schedule}: step {step}, makespan {makespan:.4g} ({makespan / width:.3g} per column; "
                "cyan forward, magenta backward, id = microbatch of the step)\n")
    by_worker = {}
    for worker, start, end, micro, direction, _stage in r.gantt or []:
        by_worker.setdefault(worker, []).append((start, end, micro, direction))
    for w in range(r.workers):
        jobs = sorted(by_worker.get(w, []))
        text.append(f"w{w:<3d} ")
        for col in range(width):
            t = (col + 0.5) * makespan / width
            hit = next((j for j in jobs if j[0] <= t < j[1]), None)
            if hit is None:
                text.append(".", style="dim")
            else:
                text.append(_IDS[hit[2] % len(_IDS)], style="bold cyan" if hit[3] == "F" else "bold magenta")
        text.append("\n")
    return text


def register(app: typer.Typer) -> None:
    app.command("simulate", no_args_is_help=True)(simulate_command)
