"""What the command adapters share: the ``--json`` option of the stages and the error-reporting call.

The stage options themselves are generated from the config dataclasses (``varlen_cli/cli/options.py``).
"""

from __future__ import annotations

import typer

JSON = typer.Option(
    False, "--json",
    help="Print the summary as one JSON object on stdout (the table's labels as keys, plus output) instead of the "
         "table; nothing else goes to stdout.",
)


def run(fn, config):
    from varlen_cli.cli import run_command

    return run_command(fn, config)
