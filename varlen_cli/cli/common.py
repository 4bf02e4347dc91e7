"""Options shared by several commands, so they read the same everywhere."""

from __future__ import annotations

import typer

from ..runtime.choices import NPROC_HELP, STORAGE_OPTION_HELP

NPROC = typer.Option(1, "--nproc", help=NPROC_HELP)
DEVICE = typer.Option("cpu", "--device", help="cpu (--nproc: local group; torchrun: gloo) or cuda (nccl).")
OVERWRITE = typer.Option(False, "--overwrite", help="Replace an existing output (written atomically either way).")
ALLOW_STALE = typer.Option(
    False, "--allow-stale",
    help="Use metrics even if their source files changed (size, mtime) since `varlen analyze`: for data moved or "
         "copied on purpose.",
)
STORAGE_OPTION = typer.Option([], "--storage-option", metavar="KEY=VALUE", show_default=False,
                              help=STORAGE_OPTION_HELP)
PROGRESS = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on rank 0 (only on a terminal).")
JSON = typer.Option(
    False, "--json",
    help="Print the summary as one JSON object on stdout (the table's labels as keys, plus output) instead of the "
         "table; nothing else goes to stdout.",
)


def run(fn, config):
    from varlen_cli.cli import run_command

    return run_command(fn, config)
