"""The ``varlen`` command line: one small typer adapter per stage, over the library functions.

Each command lives in its own module (``varlen_cli/cli/<stage>.py``), loaded only when it runs; its
options are generated from its stage's config dataclass (``varlen_cli/cli/options.py``: adding an
option is adding a documented config field). Heavy imports (torch, the stage's work) happen inside
the commands.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import typer

# The commands, in --help order; each is ``varlen_cli/cli/<name>.py`` with ``register(app)``.
COMMANDS = ("analyze", "sort", "plan", "replan", "run", "inspect", "validate", "report", "simulate", "calibrate",
            "export")


class _LazyCommands(typer.core.TyperGroup):
    """The root group, loading a command's module (and so its stage config) only when that command
    runs: the options are generated from the configs, whose modules import numpy and pyarrow."""

    def format_help(self, ctx, formatter) -> None:
        narrow_help_columns()
        return super().format_help(ctx, formatter)

    def list_commands(self, ctx) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            self.commands[cmd_name] = load_command(cmd_name)
        return self.commands.get(cmd_name)


def load_command(name: str):
    """The click command of ``varlen NAME`` (built from its typer adapter)."""
    import importlib

    module = importlib.import_module(f"varlen_cli.cli.{name}")
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    module.register(single)
    command = typer.main.get_command(single)
    typer_format_help = command.format_help

    def format_help(ctx, formatter) -> None:
        narrow_help_columns()
        return typer_format_help(ctx, formatter)

    command.format_help = format_help
    return command


TYPE_COLUMN_WIDTH = 16  # --help's type column at 80 columns (a list of choices wraps between values)


def narrow_help_columns() -> None:
    """``--help`` fits 80 columns with every option name whole: in typer's options tables the names
    keep their width, the type column wraps at :data:`TYPE_COLUMN_WIDTH` and the help text takes the
    rest (rich would otherwise share the width out and cut names: ``--curriculum-ep…``); a wider
    terminal widens the type column in proportion. Patched in
    when help is shown, so a command that runs imports no help formatting."""
    from rich.table import Table
    from typer import rich_utils

    if getattr(rich_utils.Table, "varlen_narrow", False):
        return

    class OptionsTable(Table):
        varlen_narrow = True

        def __rich_console__(self, console, options):
            if len(self.columns) >= 5:  # an options panel: [required,] names x 4, type, help
                self.columns[-1].ratio = 1
                self.columns[-2].max_width = max(TYPE_COLUMN_WIDTH, options.max_width // 5)
            return super().__rich_console__(console, options)

    rich_utils.Table = OptionsTable


app = typer.Typer(
    name="varlen",
    cls=_LazyCommands,
    help="Prepare variable-length datasets for training: analyze lengths, sort, and plan token-budget batches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from varlen_cli import __version__

        typer.echo(f"varlen {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors (also VARLEN_DEBUG=1)."),
    version: bool = typer.Option(False, "--version", help="Print the varlen version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    """varlen: length analysis, distributed sample sort and batch planning for variable-length samples."""
    if debug:
        os.environ["VARLEN_DEBUG"] = "1"


# The output the running command writes and its identity before (see `_signalled`).
_OUTPUT: dict = {"path": None, "before": None}


def _signalled(what: str, code: int) -> int:
    """The exit code for a signal (SIGINT ``interrupted`` 130, SIGTERM ``terminated`` 143), with its
    line; when the command's output was already swapped in, the run succeeded: say so, exit 0."""
    from varlen_cli.runtime.safety import identity

    path = _OUTPUT["path"]
    now = identity(path)
    if path and now is not None and now != _OUTPUT["before"]:
        sys.stderr.write(f"varlen: {what} after {path} was written; it is complete\n")
        return 0
    sys.stderr.write(f"varlen: {what}\n")
    return code


def run_command(fn: Callable[[Any], Any], config: Any) -> Any:
    """Call a stage; a user error becomes one line on stderr and its documented exit code."""
    from varlen_cli.errors import VarlenError
    from varlen_cli.runtime import notes
    from varlen_cli.runtime.safety import Terminated, identity, install_sigterm_handler

    debug = bool(os.environ.get("VARLEN_DEBUG"))
    notes.start(echo=True)  # e.g. a capped --nproc: on stderr when decided, and in --json
    install_sigterm_handler()  # SIGTERM raises, so temporaries are removed on the way out
    output = getattr(config, "output", None)
    _OUTPUT.update(path=output, before=identity(output))
    try:
        return fn(config)
    except VarlenError as exc:
        if debug:
            import traceback

            traceback.print_exc()
            worker_tb = getattr(exc, "worker_traceback", None)
            if worker_tb:
                sys.stderr.write("worker traceback:\n" + worker_tb)
        # Under torchrun every rank runs this; the line says which one failed (the others may only be its
        # victims) and is recorded as the rank's error, so torchrun's summary ends with it
        from varlen_cli.errors.entry import report

        raise typer.Exit(report(exc)) from None
    except KeyboardInterrupt:
        raise typer.Exit(_signalled("interrupted", 130)) from None
    except Terminated:
        raise typer.Exit(_signalled("terminated", Terminated.exit_code)) from None
    except Exception as exc:
        if debug:
            raise
        sys.stderr.write(f"varlen: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)\n")
        raise typer.Exit(1) from None


def click_module():
    """The click that typer runs on: recent typer versions vendor their own copy."""
    try:
        from typer import _click as click  # typer >= 0.25
    except ImportError:  # pragma: no cover - older typer uses click itself
        import click
    return click


def main() -> None:
    """Entry point: typer's own usage errors also become one line on stderr with exit code 2."""
    from varlen_cli.runtime.safety import Terminated

    exceptions = click_module().exceptions
    # A fresh command-line process holds no threads, CUDA context or tokenizer pool yet, so `--nproc`
    # workers can be forked (about twice as fast to start as spawned ones, which re-import torch).
    if sys.platform.startswith("linux"):
        os.environ.setdefault("VARLEN_START_METHOD", "fork")
    try:
        code = app(standalone_mode=False)
    except typer.Exit as exc:  # older typer/click raise it instead of returning the code
        code = getattr(exc, "exit_code", 0)
    except (typer.Abort, KeyboardInterrupt):  # also while printing the result
        code = _signalled("interrupted", 130)
    except Terminated:
        code = _signalled("terminated", Terminated.exit_code)
    except exceptions.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()
            sys.exit(0)
        where = exc.ctx.command_path if exc.ctx is not None else "varlen"
        sys.stderr.write(f"varlen: error: {exc.format_message()} (see `{where} --help`)\n")
        code = 2
    except exceptions.ClickException as exc:
        sys.stderr.write(f"varlen: error: {exc.format_message()}\n")
        code = exc.exit_code
    sys.exit(code if isinstance(code, int) else 0)
