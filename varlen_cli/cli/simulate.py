"""``varlen simulate``: adapter over :func:`varlen_cli.schedule.simulate`."""

from __future__ import annotations

import numpy as np
import typer

from varlen_cli.cli import common
from varlen_cli.cli.options import Cli, config_command
from varlen_cli.schedule.simulate import SimulateConfig

MAX_WIDTH = 4096  # a wider chart is no chart (and --width 100000000 would draw for minutes)
PIPED_WIDTH = 96  # the chart's columns when stdout is not a terminal
ROW_LABEL = 5  # "w12  " before a Gantt row


# --stages is asked for on the command line (the library's default of 1 suits ddp/fsdp only)
@config_command(SimulateConfig, fields={"plan": Cli(argument=True), "stages": Cli(required=True)})
def simulate_command(
    config: SimulateConfig,
    width: int | None = typer.Option(None, "--width", min=8, max=MAX_WIDTH, show_default=False,
                                     help=f"Columns of the Gantt chart (default: what fits the terminal; "
                                          f"{PIPED_WIDTH} when the output is not one)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON: one object, a list with --schedule all."),
) -> None:
    """Simulate the plan's steps under parallel schedules: makespan, bubble, peak activations, transfers."""
    from varlen_cli.schedule import simulate

    result = common.run(simulate, config)
    if not common.prints():
        return
    gantt_step = config.gantt_step
    if json_output:
        import json

        objects = [r.to_json() for r in result.results]
        typer.echo(json.dumps(objects if config.schedule == "all" else objects[0]))
        return
    from rich.console import Console

    console = Console()
    if console.is_terminal:  # the chart fits the terminal (rows that wrap are no chart)
        width = width or max(8, console.width - ROW_LABEL - 1)
    else:  # piped: do not wrap the table and the chart at 80 columns
        width = width or PIPED_WIDTH
        console = Console(width=max(120, width + ROW_LABEL + 3))
    console.print(summary_table(result))
    if gantt_step is not None:
        for r in result.results:
            console.print(gantt_chart(r, gantt_step, width))
    if result.trace:
        console.print(f"trace of {result.trace_steps:,} steps → {result.trace} (open it in Perfetto or "
                      "chrome://tracing)")


def summary_table(result):
    from rich import box
    from rich.table import Table

    # no inner borders, short headers (the caption says what they count), each column as wide as its
    # longest value or header word: 80 columns hold every number whole
    caption = "; ".join(filter(None, [UNITS, cost_caption(result.results[0].cost_model)]))
    t = Table(title=f"varlen simulate {result.plan}", caption=caption, caption_justify="left", box=box.SIMPLE_HEAD)
    names = ("schedule", "workers", "makespan", "util.", "bubble", "peak act.", "act. xfer", "weight xfer")
    rows = [(r.schedule, str(r.workers), f"{r.makespan:.4g}", f"{r.utilization:.1%}", f"{r.bubble:.1%}",
             count(r.peak_activation.max()), count(r.activation_transfers.sum()), count(r.weight_transfers.sum()))
            for r in result.results]
    for k, name in enumerate(names):
        width = max([len(row[k]) for row in rows] + [len(word) for word in name.split()])
        t.add_column(name, justify="left" if k == 0 else "right", width=width)
    for row in rows:
        t.add_row(*row)
    return t


def count(value) -> str:
    """A count in a few characters: 87,168; 1.226M; 4.59G (M = 10^6, G = 10^9, T = 10^12)."""
    value = float(value)
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(value) >= limit:
            return f"{value / limit:.4g}{suffix}"
    return f"{value:,.0f}"


UNITS = ("util. = busy time / (workers x makespan); peak act. = the most activations a worker holds, act. xfer = "
         "activations and gradients received, in padded tokens of a stage; weight xfer = stage weights fetched")


def cost_caption(model: dict | None) -> str | None:
    """The cost of a stage's forward, as the table's caption: the plan's budget or the override."""
    if model is None:
        return None
    a = model["attention_cost"]
    formula = {"padded": "B*T + A*B*T^2", "packed": "tokens + A*sum(l_i^2)", "tokens": "tokens (packed)"}[model["kind"]]
    where = ("the plan's budget" if model["source"] == "plan" else
             f"--attention-cost, overriding the plan's A = {model['plan_attention_cost']:g}")
    return f"cost of a stage's forward: {formula}, A = {a:g} ({where})"


_IDS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def gantt_chart(r, step: int, width: int):
    """Worker rows, ``width`` time columns; a cell shows the microbatch running at its middle
    (cyan forward, magenta backward, ``.`` idle)."""
    from rich.text import Text

    makespan = float(r.steps[step]) or 1.0
    text = Text(f"{r.schedule}: step {step}, makespan {makespan:.4g} ({makespan / width:.3g} per column; "
                "cyan forward, magenta backward, id = microbatch of the step)\n")
    by_worker = {}
    for worker, start, end, micro, direction, _stage in r.gantt or []:
        by_worker.setdefault(worker, []).append((start, end, micro, direction))
    columns = (np.arange(width) + 0.5) * makespan / width  # the instant each column shows
    for w in range(r.workers):
        text.append(f"w{w:<3d} ")
        for cell, style in _cells(sorted(by_worker.get(w, [])), columns):
            text.append(cell, style=style)
        text.append("\n")
    return text


def _cells(jobs: list, columns: np.ndarray) -> list[tuple[str, str]]:
    """(text, style) runs of one worker's row: the job running at each column's instant (a worker runs
    one job at a time, so the last job starting before it is the only candidate)."""
    if not jobs:
        return [("." * len(columns), "dim")]
    start, end = np.array([j[0] for j in jobs]), np.array([j[1] for j in jobs])
    at = np.searchsorted(start, columns, side="right") - 1
    hit = (at >= 0) & (columns < end[np.maximum(at, 0)])
    runs: list[tuple[str, str]] = []
    for k in range(len(columns)):
        job = jobs[at[k]] if hit[k] else None
        cell = "." if job is None else _IDS[job[2] % len(_IDS)]
        style = "dim" if job is None else ("bold cyan" if job[3] == "F" else "bold magenta")
        if runs and runs[-1][1] == style and job is None:
            runs[-1] = (runs[-1][0] + cell, style)
        else:
            runs.append((cell, style))
    return runs


def register(app: typer.Typer) -> None:
    app.command("simulate", no_args_is_help=True)(simulate_command)
