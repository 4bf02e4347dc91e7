"""Every command and option has help text and is documented in the README or docs/."""

import glob
import os

import pytest
import typer.main

from varlen_cli.cli import app, click_module

click = click_module()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docs_text() -> str:
    # docs/cli.md is --help itself (generated): the guides must say it in their own words
    paths = [os.path.join(ROOT, "README.md")] + sorted(p for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
                                                       if os.path.basename(p) != "cli.md")
    return "\n".join(open(p).read() for p in paths)


def _commands():
    group = typer.main.get_command(app)
    ctx = click.core.Context(group)
    return [(name, group.get_command(ctx, name)) for name in group.list_commands(ctx)]


EXPECTED = {"analyze", "sort", "plan", "run", "inspect", "validate", "simulate"}


def test_all_stage_commands_exist():
    assert EXPECTED <= {name for name, _ in _commands()}


@pytest.mark.parametrize("name,command", _commands(), ids=[n for n, _ in _commands()])
def test_command_and_options_documented(name, command):
    docs = _docs_text()
    assert command.help and command.help.strip(), f"command {name} has no help"
    assert f"varlen {name}" in docs, f"`varlen {name}` is not in README.md or docs/"
    for param in command.params:
        if param.param_type_name == "option":
            assert param.help and param.help.strip(), f"{name} {param.opts[0]} has no help text"
            longs = [o for o in param.opts + param.secondary_opts if o.startswith("--") and o != "--help"]
            assert any(o in docs for o in longs), f"{name} option {longs} is not documented in README.md or docs/"
        elif param.param_type_name == "argument":
            assert getattr(param, "help", None), f"{name} argument {param.name} has no help text"
