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


# -- the README's command block runs as written ----------------------------------------------------
SKIP_MARK = "# needs "  # a trailing comment saying what a line needs that a test machine lacks (a GPU, a model)


def readme_commands() -> list[str]:
    """The shell lines of the README's block under "## The commands", continuation lines joined,
    comment lines and blank lines dropped."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## The commands", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines, pending = [], ""
    for raw in block.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def test_readme_block_is_found_and_marks_what_it_skips():
    commands = readme_commands()
    assert commands[0] == "mkdir -p out" and len(commands) > 15
    skipped = [c for c in commands if SKIP_MARK in c]
    assert any(c.split()[1] == "calibrate" for c in skipped)  # a GPU and the user's model
    assert all(c.split(SKIP_MARK, 1)[1].strip() for c in skipped)  # each says what it needs
    assert len(skipped) <= len(commands) // 3  # most of the block runs on the sample data


@pytest.mark.slow
def test_readme_commands_run_in_order_in_a_fresh_directory(tmp_path):
    """Every line of the README's command block, in order, in an empty directory holding only
    sample_data/ (and `varlen` on PATH: this interpreter's): each exits 0."""
    import subprocess
    import sys

    work = tmp_path / "fresh"
    work.mkdir()
    os.symlink(os.path.join(ROOT, "sample_data"), work / "sample_data")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "varlen").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m varlen_cli "$@"\n')
    (bin_dir / "varlen").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=ROOT,
               VARLEN_NO_PROGRESS="1")
    ran = []
    for command in readme_commands():
        if SKIP_MARK in command:
            continue
        result = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
        ran.append(command)
    assert os.path.isfile(work / "out" / "plan-dp3.parquet") and os.path.isfile(work / "out" / "run" / "_run.json")
    assert len(ran) == len([c for c in readme_commands() if SKIP_MARK not in c]) > 10
