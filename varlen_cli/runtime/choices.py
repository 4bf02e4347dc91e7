"""Choice options as ``Literal`` types, shared by the stage configs and the typer adapters, and the
one generic check that a config holds allowed values and documented fields.

The configs annotate their choice fields with these types; typer turns the same types into
``--help``'s ``<a|b|c>`` lists and rejects other values before a stage runs. A library caller who
passes a bad string gets one :class:`UsageError` line from :func:`check_choices`.

Config fields are documented once, as ``field(metadata={"help": ...})`` (see :func:`doc`); the
command line's options are generated from those fields (``varlen_cli/cli/options.py``).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from ..errors import UsageError

Device = Literal["cpu", "cuda"]
Order = Literal["curriculum", "reverse", "bucket-shuffle", "random"]
Tail = Literal["split", "drop"]
LrScaling = Literal["linear", "sqrt", "none"]
LrScaleBy = Literal["loss-tokens", "tokens", "samples"]
Ties = Literal["id", "shuffle"]
NanPolicy = Literal["error", "last"]
Engine = Literal["auto", "numpy", "torch"]


def values(choice: Any) -> tuple[str, ...]:
    """The allowed values of a ``Literal`` type."""
    return tuple(typing.get_args(choice))


def doc(default: Any = dataclasses.MISSING, help: str = "", panel: str | None = None, **kwargs) -> Any:
    """A dataclass field with its one documentation string (``metadata["help"]``) and the ``--help``
    panel its option is listed in (``metadata["panel"]``; None: the command's first panel, "Options")."""
    metadata = {"help": help} if panel is None else {"help": help, "panel": panel}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def field_help(config_type: type, name: str) -> str:
    """The documentation string of a config field (``doc(help=...)``)."""
    for f in dataclasses.fields(config_type):
        if f.name == name:
            return f.metadata.get("help", "")
    raise KeyError(name)


def _choice_args(hint: Any) -> tuple | None:
    """The allowed values of a Literal hint (also inside ``X | None``), else None."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def check_choices(config: Any) -> None:
    """Raise a one-line UsageError for the first ``Literal`` field of ``config`` holding another value."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        allowed = _choice_args(hints.get(f.name))
        value = getattr(config, f.name)
        if allowed is None or value is None or value in allowed:
            continue
        flag = "--" + f.name.replace("_", "-")
        raise UsageError(f"{flag} must be one of {', '.join(allowed)} (got {value!r})")


# The --help panel of the options every stage shares (workers, progress, inputs, outputs)
PANEL_RUN = "Workers, inputs and output"
# Help of options several commands share (each config declares its own field with these texts).
OVERWRITE_HELP = "Replace an existing output (written atomically either way)."
ALLOW_STALE_HELP = ("Use metrics even if their source files changed (size, mtime) since `varlen analyze`: for data "
                    "moved or copied on purpose.")
ALLOW_MEMORY_EXTRAPOLATION_HELP = ("Plan with a memory limit beyond the peaks the memory profile measured (its "
                                   "predictions there are extrapolated and can fall short); refused by default: "
                                   "re-run `varlen calibrate --max-memory X` instead.")
PROGRESS_HELP = "Show a progress bar on rank 0 (only on a terminal)."
DEVICE_HELP = "cpu (--nproc: local group; torchrun: gloo) or cuda (nccl)."
NPROC_HELP = ("Local worker processes to launch (on the CPU a torch-free local group; with --device cuda torch's "
              "elastic launcher), capped by the work units and the cores (a note says so); under torchrun leave "
              "at 1.")
#: ``--storage-option``: one help text for every command that reads or writes object storage (a
#: ``storage_options: tuple = doc((), STORAGE_OPTION_HELP)`` field of its config).
STORAGE_OPTION_HELP = ("KEY=VALUE passed to the object-storage filesystem of s3://, gs://, hf://... inputs and "
                       "outputs (repeatable; JSON values parsed); credentials and endpoints otherwise come from the "
                       "standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).")
