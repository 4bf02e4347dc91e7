"""`--help` lists the allowed values of every choice option, and every option's help says exactly what
its config field's documentation (``doc(help=...)``) says."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

import pytest
from typer.testing import CliRunner

from varlen_cli.cli import analyze as analyze_cli
from varlen_cli.cli import app
from varlen_cli.cli import plan as plan_cli
from varlen_cli.cli import sort as sort_cli
from varlen_cli.runtime.choices import check_choices, field_help

# the CLI parameter name -> config field name, where they differ
RENAMED = {"input_dir": "input"}
# options of the command line only (how it prints the result), not of the library's config
CLI_ONLY = {"json_output"}


def _config(stage: str):
    if stage == "analyze":
        from varlen_cli.analyze import AnalyzeConfig

        return AnalyzeConfig
    if stage == "sort":
        from varlen_cli.sort import SortConfig

        return SortConfig
    from varlen_cli.plan import PlanConfig

    return PlanConfig


STAGES = [("analyze", analyze_cli.analyze_command), ("sort", sort_cli.sort_command), ("plan", plan_cli.plan_command)]


def _literal_fields(config_type) -> dict:
    hints = typing.get_type_hints(config_type)
    return {name: typing.get_args(hint) for name, hint in hints.items() if typing.get_origin(hint) is typing.Literal}


@pytest.mark.parametrize("stage,command", STAGES, ids=[s for s, _ in STAGES])
def test_help_lists_every_choice(stage, command):
    choices = _literal_fields(_config(stage))
    assert choices, stage
    res = CliRunner().invoke(app, [stage, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert res.exit_code == 0, res.output
    text = re.sub(r"\s+", " ", res.output)
    params = inspect.signature(command).parameters
    for name, allowed in choices.items():
        if name not in params:  # library-only choices (sort's engine)
            continue
        assert f"--{name.replace('_', '-')}" in text
        assert "<" + "|".join(allowed) + ">" in text, (name, allowed)


@pytest.mark.parametrize("stage,command", STAGES, ids=[s for s, _ in STAGES])
def test_cli_help_equals_config_docs(stage, command):
    config_type = _config(stage)
    names = {f.name for f in dataclasses.fields(config_type)}
    hints = typing.get_type_hints(command)
    config_hints = typing.get_type_hints(config_type)
    for name, param in inspect.signature(command).parameters.items():
        if name in CLI_ONLY:
            continue
        field = RENAMED.get(name, name)
        assert field in names, f"{stage}: CLI option {name} has no config field"
        assert param.default.help == field_help(config_type, field), (stage, name)
        if typing.get_origin(config_hints[field]) is typing.Literal:
            assert hints[name] == config_hints[field], (stage, name)  # typer gets the same choices
    for f in dataclasses.fields(config_type):
        assert f.metadata.get("help"), f"{stage}: config field {f.name} is undocumented"


def test_library_rejects_a_bad_choice_in_one_line():
    from varlen_cli.errors import UsageError
    from varlen_cli.sort import SortConfig

    with pytest.raises(UsageError) as info:
        check_choices(SortConfig(metrics_dir="m", output="o", engine="gpu"))
    assert info.value.message == "--engine must be one of auto, numpy, torch (got 'gpu')"
