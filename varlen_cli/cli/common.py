"""What the command adapters share: the ``--json`` option of the stages and the error-reporting call.

The stage options themselves are generated from the config dataclasses (``varlen_cli/cli/options.py``).
"""

from __future__ import annotations

import os

import typer

JSON = typer.Option(
    False, "--json",
    help="Print the summary as one JSON object on stdout (the table's labels as keys, plus output) instead of the "
         "table; nothing else goes to stdout.",
)


def prints() -> bool:
    """Whether this process reports: under torchrun every rank runs the command (and gets rank 0's
    result), but only rank 0 prints, so ``--json`` gives one document."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or int(os.environ.get("RANK", "0") or 0) == 0


def run(fn, config):
    from varlen_cli.cli import run_command

    return run_command(fn, config)
