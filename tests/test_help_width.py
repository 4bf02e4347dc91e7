"""Every `--help` fits an 80-column terminal (COLUMNS=80): no line is longer, no option name is cut
("--curriculum-ep…"), no choice is broken inside a word, and the options are grouped in panels
(declared with their config fields: varlen_cli/cli/options.py), so `varlen plan --help` stays short."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from varlen_cli.cli import COMMANDS, app, load_command

WIDTH = 80


def _render(args: list[str]) -> str:
    res = CliRunner().invoke(app, args, env={"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH)})
    assert res.exit_code == 0, res.output
    return res.output


def _tokens(text: str) -> set[str]:
    """The words of the help text, box-drawing characters and punctuation around them dropped."""
    return {w.strip("│╭╮╰╯─*,;:()[]") for w in re.split(r"[\s│]+", text)}


@pytest.mark.parametrize("name", [None, *COMMANDS])
def test_help_fits_80_columns_with_every_name_and_choice_whole(name):
    text = _render([name, "--help"] if name else ["--help"])
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    assert "…" not in text, [line for line in lines if "…" in line]
    words = _tokens(text)
    if name is None:
        assert set(COMMANDS) <= words
        return
    for param in load_command(name).params:
        for flag in (*param.opts, *param.secondary_opts):
            if flag.startswith("-"):
                assert flag in words, (name, flag)
        for value in getattr(getattr(param, "type", None), "choices", None) or ():  # Literal fields: click.Choice
            assert str(value) in words, (name, param.name, value)


def test_options_are_grouped_in_panels_and_plan_help_is_short():
    text = _render(["plan", "--help"])
    panels = re.findall(r"╭─ (.+?) ─", text)
    assert panels[:2] == ["Arguments", "Options"] and panels[-1] == "Workers, inputs and output"
    assert {"LR scaling", "Packing (padding-free rows)", "Budget from a memory limit"} <= set(panels)
    assert len(text.splitlines()) < 230  # 356 lines before the panels
    run = re.findall(r"╭─ (.+?) ─", _render(["run", "--help"]))
    assert "plan: LR scaling" in run and run[-1] == "Workers, inputs and output"


def test_simulate_table_and_gantt_fit_an_80_column_terminal(tmp_path):
    """On an 80-column terminal the table's numbers are whole (they were cut: "1.719e…") and a Gantt
    row is one line of 80 - 6 time columns (the default width fits the terminal; rows used to wrap)."""
    import json

    import numpy as np

    from tests.simulate_helpers import write_plan
    from varlen_cli.cli.simulate import count

    rng = np.random.default_rng(0)
    plan = write_plan(tmp_path / "p.parquet", rng.integers(1, 400, size=(3, 8)) * 97, 4096, dp=2)
    args = ["simulate", plan, "--stages", "4", "--gantt-step", "0"]
    res = CliRunner().invoke(app, args, env={"COLUMNS": str(WIDTH), "TTY_COMPATIBLE": "1"})  # rich: a terminal
    assert res.exit_code == 0, res.output
    text = re.sub(r"\x1b\[[0-9;]*m", "", res.stdout)  # the terminal's styles
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH and "…" not in text, text
    words = _tokens(text)
    for one in json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout):
        assert {one["schedule"], f"{one['makespan']:.4g}", f"{one['utilization']:.1%}",
                count(max(one["peak_activation"])), count(sum(one["activation_transfers"]))} <= words, one
    rows = [line for line in lines if re.match(r"w\d+ ", line)]
    assert rows and {len(row) for row in rows} == {WIDTH - 1}  # "w0   " + 74 columns
