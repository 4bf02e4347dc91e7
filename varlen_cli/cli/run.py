"""``varlen run``: adapter over :func:`varlen_cli.run.run`.

Its options are the stage commands' own options (generated from ``AnalyzeConfig``, ``SortConfig``
and ``PlanConfig``, see ``varlen_cli/cli/options.py``), merged: every option of analyze, sort and
plan is available, with the same name and help, and none is declared twice. Options several stages
share (``--seed``, ``--nproc``, ``--device``, ``--overwrite``, ``--progress``) are given once and go
to every stage that has them.
"""

from __future__ import annotations

import copy
import inspect

import typer

from varlen_cli.cli import analyze as analyze_cli
from varlen_cli.cli import common
from varlen_cli.cli import plan as plan_cli
from varlen_cli.cli import sort as sort_cli
from varlen_cli.cli.options import OUTPUT, Cli, config_parameters
from varlen_cli.run import RunConfig
from varlen_cli.runtime.choices import PANEL_RUN

# Positional inputs and outputs of the stages: `run` sets them itself.
_NOT_FORWARDED = {"sources", "output", "metrics_dir", "input", "single_file"}
_RUN_LEVEL = {"nproc", "device", "overwrite", "progress", "json_output"}
_STAGES = (("analyze", analyze_cli.analyze_command), ("sort", sort_cli.sort_command), ("plan", plan_cli.plan_command))
_OWN = config_parameters(
    RunConfig, {"sources": Cli(argument=True, metavar="SOURCE", type=list[str], convert=tuple), "output": OUTPUT},
    library_only=("analyze", "sort", "plan", "nproc", "device", "overwrite", "progress"),
)


def _stage_params():
    """{stage: [param names]} and the merged keyword parameters, in stage order, each name once (an option
    of several stages with different help, like ``--seed``, says what it does in each)."""
    per_stage, merged, helps = {}, {}, {}
    for stage, fn in _STAGES:
        names = []
        for name, param in inspect.signature(fn).parameters.items():
            if name in _NOT_FORWARDED:
                continue
            if name not in _RUN_LEVEL:
                names.append(name)
            merged.setdefault(name, _in_panel(param, PANEL_RUN if name in _RUN_LEVEL else _stage_panel(stage, param)))
            helps.setdefault(name, {}).setdefault(param.default.help, []).append(stage)
        per_stage[stage] = names
    for name, by_help in helps.items():
        if len(by_help) > 1:
            info = copy.copy(merged[name].default)
            info.help = " ".join(f"{' and '.join(stages)}: {text}" for text, stages in by_help.items())
            merged[name] = merged[name].replace(default=info)
    return per_stage, dict(sorted(merged.items(), key=lambda item: item[1].default.rich_help_panel == PANEL_RUN))


def _stage_panel(stage: str, param) -> str:
    """A stage option's --help panel under `run`: the stage's own panel, named after the stage."""
    panel = param.default.rich_help_panel
    return stage if panel is None else panel if panel == PANEL_RUN else f"{stage}: {panel}"


def _in_panel(param, panel: str):
    info = copy.copy(param.default)
    info.rich_help_panel = panel
    return param.replace(default=info)


_PER_STAGE, _MERGED = _stage_params()


def _stage_options(stage: str, fn, options: dict) -> dict:
    """The stage config's keyword arguments (converted as the stage's own command converts them)."""
    names = [n for n in _PER_STAGE[stage] if n in fn.config_parameters.names]
    return {n: fn.config_parameters.converts.get(n, lambda v: v)(options[n]) if options[n] is not None else None
            for n in names}


def run_command(sources: list[str], output: str, **options) -> None:
    from varlen_cli.cli import summary
    from varlen_cli.run import run

    stage_opts = {stage: _stage_options(stage, fn, options) for stage, fn in _STAGES}
    config = RunConfig(
        **_OWN.config_values({"sources": sources, "output": output}), analyze=stage_opts["analyze"],
        sort=stage_opts["sort"], plan=stage_opts["plan"],
        nproc=options["nproc"], device=options["device"], overwrite=options["overwrite"], progress=options["progress"],
    )
    result = common.run(run, config)
    if result is not None and options["json_output"]:
        summary.print_json(summary.run_json(result))
        summary.warn_empty(result.analyze)
    elif result is not None:
        summary.print_run(result)


_SIGNATURE = inspect.Signature(list(_OWN.parameters) + list(_MERGED.values()))


def _run_entry(**kwargs):
    return run_command(kwargs.pop("sources"), kwargs.pop("output"), **kwargs)


_run_entry.__signature__ = _SIGNATURE
_run_entry.__annotations__ = {p.name: p.annotation for p in _SIGNATURE.parameters.values()}
_run_entry.__doc__ = "Run the whole pipeline (analyze, sort when the order needs it, plan) in one launch."


def register(app: typer.Typer) -> None:
    app.command("run", no_args_is_help=True)(_run_entry)
