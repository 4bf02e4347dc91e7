"""docs/cli.md, the command-line reference: every command's ``--help``, generated.

    python -m varlen_cli.cli.reference           # rewrite docs/cli.md
    python -m varlen_cli.cli.reference --check   # exit 1 (and say so) when docs/cli.md is stale
    python -m varlen_cli.cli.reference --stdout  # print it (in this process's terminal settings)

``tests/test_cli_reference.py`` runs the check, so a changed option (a config field, see
``varlen_cli/cli/options.py``) fails the tests until the reference is regenerated.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

WIDTH = 100  # columns of the rendered help
PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "cli.md")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_COLOUR_ENV = ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS", "_TYPER_FORCE_DISABLE_TERMINAL", "COLUMNS", "LINES")

HEADER = """# Command-line reference

Generated from `varlen COMMAND --help` by `python -m varlen_cli.cli.reference`; do not edit by
hand (a test fails when this file is stale). Every option is a field of the command's config
dataclass (`varlen_cli/cli/options.py`), so the same names and defaults work from Python. The
guides: [analyze](analyze.md), [sort](sort.md), [plan](plan.md), [packing](packing.md),
[run, inspect, validate, report](commands.md), [simulate](schedules.md), [calibrate](memory.md).
"""


def help_text(args: list[str]) -> str:
    """``varlen ARGS --help`` as plain text, ``WIDTH`` columns wide, trailing spaces removed (in this
    process: see :func:`render` for why the reference is rendered in a fresh one)."""
    from typer.testing import CliRunner

    from varlen_cli.cli import app

    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(WIDTH)})
    if result.exit_code != 0:
        raise RuntimeError(f"varlen {' '.join(args)} --help exited {result.exit_code}: {result.output}")
    lines = [line.rstrip() for line in _ANSI.sub("", result.stdout).splitlines()]
    return "\n".join(lines).strip("\n") + "\n"


def _render_here() -> str:
    from varlen_cli.cli import COMMANDS

    parts = [HEADER, "## `varlen`\n\n```text\n" + help_text([]) + "```\n"]
    for name in COMMANDS:
        parts.append(f"## `varlen {name}`\n\n```text\n" + help_text([name]) + "```\n")
    return "\n".join(parts)


def render() -> str:
    """The whole reference (Markdown), rendered in a fresh interpreter: typer reads the terminal width
    and colour settings once, when it is first imported (a test that ran before with another width
    would change the result)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in _COLOUR_ENV}
    env.update(COLUMNS=str(WIDTH), TERMINAL_WIDTH=str(WIDTH), NO_COLOR="1", TERM="dumb",
               PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    result = subprocess.run([sys.executable, "-m", "varlen_cli.cli.reference", "--stdout"], env=env,
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"rendering the CLI reference failed: {result.stderr[-2000:]}")
    return result.stdout


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--stdout"]:  # what render() runs
        sys.stdout.write(_render_here())
        return 0
    text = render()
    if argv == ["--check"]:
        current = open(PATH, encoding="utf-8").read() if os.path.exists(PATH) else ""
        if current != text:
            sys.stderr.write(f"{PATH} is stale: run `python -m varlen_cli.cli.reference`\n")
            return 1
        return 0
    if argv:
        sys.stderr.write("usage: python -m varlen_cli.cli.reference [--check | --stdout]\n")
        return 2
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
