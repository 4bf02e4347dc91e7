"""docs/cli.md, the command-line reference: every command's ``--help``, generated.

    python -m varlen_cli.cli.reference           # rewrite docs/cli.md
    python -m varlen_cli.cli.reference --check   # exit 1 (and say so) when docs/cli.md is stale

``tests/test_cli_reference.py`` runs the check, so a changed option (a config field, see
``varlen_cli/cli/options.py``) fails the tests until the reference is regenerated.
"""

from __future__ import annotations

import os
import re
import sys

WIDTH = 100  # columns of the rendered help
PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "cli.md")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

HEADER = """# Command-line reference

Generated from `varlen COMMAND --help` by `python -m varlen_cli.cli.reference`; do not edit by
hand (a test fails when this file is stale). Every option is a field of the command's config
dataclass (`varlen_cli/cli/options.py`), so the same names and defaults work from Python. The
guides: [analyze](analyze.md), [sort](sort.md), [plan](plan.md), [packing](packing.md),
[run, inspect, validate](commands.md), [simulate](schedules.md), [calibrate](memory.md).
"""


def help_text(args: list[str]) -> str:
    """``varlen ARGS --help`` as plain text, ``WIDTH`` columns wide, trailing spaces removed."""
    from typer.testing import CliRunner

    from varlen_cli.cli import app

    env = {"COLUMNS": str(WIDTH), "NO_COLOR": "1", "TERM": "dumb", "FORCE_COLOR": None, "PY_COLORS": None}
    result = CliRunner().invoke(app, [*args, "--help"], env=env)
    if result.exit_code != 0:
        raise RuntimeError(f"varlen {' '.join(args)} --help exited {result.exit_code}: {result.output}")
    lines = [line.rstrip() for line in _ANSI.sub("", result.stdout).splitlines()]
    return "\n".join(lines).strip("\n") + "\n"


def render() -> str:
    """The whole reference (Markdown)."""
    from varlen_cli.cli import COMMANDS

    parts = [HEADER, "## `varlen`\n\n```text\n" + help_text([]) + "```\n"]
    for name in COMMANDS:
        parts.append(f"## `varlen {name}`\n\n```text\n" + help_text([name]) + "```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if argv == ["--check"]:
        current = open(PATH, encoding="utf-8").read() if os.path.exists(PATH) else ""
        if current != text:
            sys.stderr.write(f"{PATH} is stale: run `python -m varlen_cli.cli.reference`\n")
            return 1
        return 0
    if argv:
        sys.stderr.write("usage: python -m varlen_cli.cli.reference [--check]\n")
        return 2
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
