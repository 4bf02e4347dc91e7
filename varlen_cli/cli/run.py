"""``varlen run``: adapter over :func:`varlen_cli.run.run`.

Its options are the stage commands' own options, merged from their signatures (so every option of
analyze, sort and plan is available, with the same name and help, and none is declared twice).
Options several stages share (``--seed``, ``--nproc``, ``--device``, ``--overwrite``,
``--progress``) are given once and go to every stage that has them.
"""

from __future__ import annotations

import inspect
import typing

import typer

from varlen_cli.cli import analyze as analyze_cli
from varlen_cli.cli import common
from varlen_cli.cli import plan as plan_cli
from varlen_cli.cli import sort as sort_cli

# Positional inputs and outputs of the stages: `run` sets them itself.
_NOT_FORWARDED = {"sources", "output", "metrics_dir", "input_dir", "single_file"}
_RUN_LEVEL = {"nproc", "device", "overwrite", "progress", "json_output"}
_STAGES = (("analyze", analyze_cli.analyze_command), ("sort", sort_cli.sort_command), ("plan", plan_cli.plan_command))


def _stage_params():
    """{stage: [param names]} and the merged keyword parameters, in stage order, each name once."""
    per_stage, merged = {}, {}
    for stage, fn in _STAGES:
        names = []
        hints = typing.get_type_hints(fn)  # the modules use `from __future__ import annotations`
        for name, param in inspect.signature(fn).parameters.items():
            if name in _NOT_FORWARDED:
                continue
            if name not in _RUN_LEVEL:
                names.append(name)
            merged.setdefault(name, param.replace(annotation=hints[name]))
        per_stage[stage] = names
    return per_stage, merged


_PER_STAGE, _MERGED = _stage_params()


def run_command(sources: list[str], output: str, **options) -> None:
    from varlen_cli.cli import report
    from varlen_cli.run import RunConfig, run

    stage_opts = {stage: {k: options[k] for k in names} for stage, names in _PER_STAGE.items()}
    config = RunConfig(
        sources=tuple(sources), output=output, analyze=stage_opts["analyze"], sort=stage_opts["sort"],
        plan=stage_opts["plan"],
        nproc=options["nproc"], device=options["device"], overwrite=options["overwrite"], progress=options["progress"],
    )
    result = common.run(run, config)
    if result is not None and options["json_output"]:
        report.print_json(report.run_json(result))
        report.warn_empty(result.analyze)
    elif result is not None:
        report.print_run(result)


_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter("sources", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=list[str],
                          default=typer.Argument(..., show_default=False,
                                                 help="Sources, as for `varlen analyze`: files, directories, globs.")),
        inspect.Parameter("output", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                          default=typer.Option(..., "-o", "--output", show_default=False,
                                               help="Output directory: metrics/, sorted/ (when the order needs it), "
                                               "plan.parquet, _run.json.")),
    ]
    + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in _MERGED.values()]
)


def _run_entry(*args, **kwargs):
    bound = _SIGNATURE.bind(*args, **kwargs)
    values = dict(bound.arguments)
    return run_command(values.pop("sources"), values.pop("output"), **values)


_run_entry.__signature__ = _SIGNATURE
_run_entry.__annotations__ = {p.name: p.annotation for p in _SIGNATURE.parameters.values()}
_run_entry.__doc__ = "Run the whole pipeline (analyze, sort when the order needs it, plan) in one launch."


def register(app: typer.Typer) -> None:
    app.command("run", no_args_is_help=True)(_run_entry)
