"""Each CLI option is declared once, as a documented config field (varlen_cli/cli/options.py): `--help`
says what the field's ``doc`` says and lists its choices, a new field becomes an option with nothing
else to write, and docs/cli.md is the current `--help` of every command."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Literal

import pytest
import typer
from typer.testing import CliRunner

from varlen_cli.cli import COMMANDS, app, click_module, load_command
from varlen_cli.cli.options import Cli, choices_metavar, config_command
from varlen_cli.runtime.choices import check_choices, doc

click = click_module()

# options of the command line alone (how the result is shown), declared in varlen_cli/cli/*.py
CLI_ONLY = {"json_output", "width", "help"}
# config fields each command does not offer (library tuning knobs), and fields `run` sets itself
LIBRARY_ONLY = {"analyze": {"chunk_bytes"}, "sort": {"row_group_size", "engine"}, "plan": {"recorded_input"},
                "run": {"analyze", "sort", "plan"}}


def _config_type(name: str):
    return load_command(name).callback.config_parameters.config_type if name != "run" else _run_config()


def _run_config():
    from varlen_cli.run import RunConfig

    return RunConfig


def _params(name: str) -> dict:
    return {p.name: p for p in load_command(name).params}


def _help(name: str) -> str:
    res = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    return re.sub(r"\s+", " ", res.output)


@pytest.mark.parametrize("name", [c for c in COMMANDS if c != "run"])
def test_every_config_field_is_an_option_with_its_doc(name):
    """Help and choices of each option are the config field's; no other option is declared."""
    config_type = _config_type(name)
    params = _params(name)
    hints = typing.get_type_hints(config_type)
    text = _help(name)
    for f in dataclasses.fields(config_type):
        if f.name in LIBRARY_ONLY.get(name, set()):
            assert f.name not in params
            continue
        assert f.metadata.get("help"), f"{name}: config field {f.name} is undocumented"
        assert params.pop(f.name).help == f.metadata["help"], (name, f.name)
        if typing.get_origin(hints[f.name]) is Literal:  # --help lists the choices
            assert choices_metavar(typing.get_args(hints[f.name])) in text, (name, f.name)
    assert set(params) <= CLI_ONLY, f"{name}: options without a config field: {set(params) - CLI_ONLY}"


def test_run_takes_every_stage_option_once():
    run_params = _params("run")
    text = _help("run")
    for stage in ("analyze", "sort", "plan"):
        hints = typing.get_type_hints(_config_type(stage))
        for pname, p in _params(stage).items():
            if pname in ("sources", "output", "metrics_dir", "input", "single_file"):
                continue
            assert p.help in run_params[pname].help, (stage, pname)  # shared --seed: "sort: ... plan: ..."
            if pname in hints and typing.get_origin(hints[pname]) is Literal:
                assert choices_metavar(typing.get_args(hints[pname])) in text, (stage, pname)


def test_library_rejects_a_bad_choice_in_one_line():
    from varlen_cli.errors import UsageError
    from varlen_cli.sort import SortConfig

    with pytest.raises(UsageError) as info:
        check_choices(SortConfig(metrics_dir="m", output="o", engine="gpu"))
    assert info.value.message == "--engine must be one of auto, numpy, torch (got 'gpu')"


# -- the mechanism, on a config made up here: a new field needs nothing but the field -------------
@dataclasses.dataclass(frozen=True)
class _Demo:
    path: str = doc(help="A path.")
    output: str = doc(help="Where to write.")
    count: int = doc(3, "How many.")
    mode: Literal["fast", "slow"] = doc("fast", "Speed.")
    cap: int | None = doc(None, "An optional cap.")
    strict: bool = doc(False, "Refuse more.")
    colour: bool = doc(True, "Colour the output.")
    knob: int = doc(7, "A tuning knob of the library.")


def _demo_app(seen: list):
    @config_command(_Demo, fields={"path": Cli(argument=True), "output": Cli(flags=("-o", "--output"))},
                    library_only=("knob",))
    def demo(config: _Demo, loud: bool = typer.Option(False, "--loud", help="Shout.")) -> None:
        """A demo command."""
        seen.append((config, loud))

    demo_app = typer.Typer()
    demo_app.command()(demo)
    return demo_app


def test_generated_options_build_the_config():
    seen: list = []
    res = CliRunner().invoke(_demo_app(seen), ["in", "-o", "out", "--count", "5", "--mode", "slow", "--strict",
                                               "--no-colour", "--loud"])
    assert res.exit_code == 0, res.output
    assert seen == [(_Demo(path="in", output="out", count=5, mode="slow", cap=None, strict=True, colour=False), True)]
    seen.clear()
    assert CliRunner().invoke(_demo_app(seen), ["in", "-o", "out"]).exit_code == 0
    assert seen == [(_Demo(path="in", output="out"), False)]  # the config's defaults


def test_generated_options_refuse_what_the_field_refuses():
    seen: list = []
    for args, fragment in ((["in", "-o", "out", "--mode", "warp"], "'warp' is not one of"),
                           (["in"], "Missing option"),
                           (["in", "-o", "out", "--knob", "1"], "No such option: --knob")):
        res = CliRunner().invoke(_demo_app(seen), args)
        assert res.exit_code == 2 and fragment in res.output, (args, res.output)
    assert seen == []


def test_generated_help_shows_the_field_docs():
    res = CliRunner().invoke(_demo_app([]), ["--help"], env={"COLUMNS": "400"})
    text = re.sub(r"\s+", " ", res.output)
    for needle in ("A path.", "How many. [default: 3]", "<fast | slow>", "--colour --no-colour", "An optional cap.",
                   "Shout."):
        assert needle in text, needle
    assert "An optional cap. [default" not in text and "knob" not in text


def test_an_option_declared_twice_is_refused():
    with pytest.raises(TypeError, match="count declared twice"):
        @config_command(_Demo)
        def twice(config: _Demo, count: int = typer.Option(1, "--count", help="How many.")) -> None:
            pass


def test_an_undocumented_field_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        value: int = 1

    with pytest.raises(TypeError, match="Bare.value has no help"):
        config_command(Bare)


# -- docs/cli.md ------------------------------------------------------------------------------------
def test_cli_reference_is_current():
    """docs/cli.md is the `--help` of every command; regenerate it with `python -m varlen_cli.cli.reference`."""
    from varlen_cli.cli import reference

    with open(reference.PATH, encoding="utf-8") as f:
        current = f.read()
    assert current == reference.render(), "docs/cli.md is stale: run `python -m varlen_cli.cli.reference`"
    for name in COMMANDS:
        assert f"## `varlen {name}`" in current
