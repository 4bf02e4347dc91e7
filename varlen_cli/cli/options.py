"""Command-line options generated from the stage configs, so each option is declared once.

A command's options are the fields of its config dataclass (``AnalyzeConfig``, ``PlanConfig``,
``ValidateConfig``, ...), declared with :func:`varlen_cli.runtime.choices.doc`::

    max_samples: int | None = doc(None, "Cap on the samples (B) of a microbatch.")

and :func:`config_command` turns them into the typer command's parameters:

- the flag is the field's name with dashes (``max_samples`` -> ``--max-samples``);
- the type is the field's annotation (a ``Literal`` lists its choices in ``--help`` and typer
  refuses other values), the default is the field's default (no default: a required option) and
  the help is the field's ``doc`` help;
- a positional argument's metavar is the field's name in capitals (``plan`` -> ``PLAN``);
- a ``Literal`` field's values are shown as ``<a | b | c>`` (wrapped between values at 80 columns);
- the field's ``doc(..., panel=...)`` names the ``--help`` panel its option is listed in (options of
  one concern together: "LR scaling", "Packing", ...; no panel: the first panel, "Options");
- a ``bool`` field is a flag, ``--x`` when it defaults to False, ``--x/--no-x`` when it defaults to
  True; a default of None (or a required option) is not shown in ``--help``.

**Adding an option to a command is adding a documented field to its config; nothing else.** The
command line, ``varlen run`` (which takes analyze's, sort's and plan's options) and docs/cli.md
(``python -m varlen_cli.cli.reference``; a test fails while it is stale) follow. The command's module
(``varlen_cli/cli/<command>.py``) says only what differs from those rules, in the
:func:`config_command` call: a field shown another way (``Cli``: a positional argument, a short
flag like ``-o``, a metavar, another type on the command line and a function converting the value
for the config), or a field the command line does not offer (``library_only``: tuning knobs of the
Python API). Options of the command line alone (``--json``, simulate's ``--width``) are ordinary
typer parameters of the command function, after its ``config`` parameter; they may not share a
name with a config field.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import typer

from varlen_cli.runtime.choices import PANEL_RUN


@dataclasses.dataclass(frozen=True)
class Cli:
    """How one config field is shown on the command line, where it differs from the rules above."""

    flags: tuple[str, ...] = ()  # e.g. ("-o", "--output"); default: ("--field-name",)
    argument: bool = False  # a positional argument instead of an option
    metavar: str | None = None
    type: Any = None  # the command line's type, when the config's annotation is not one typer reads
    convert: Callable[[Any], Any] | None = None  # command-line value -> config value
    show: Callable[[Any], Any] | None = None  # config default -> command-line default (with ``type``)
    required: bool = False  # required on the command line although the library has a default
    optional: bool = False  # optional on the command line (None) although the library requires it


OUTPUT = Cli(flags=("-o", "--output"))
#: ``storage_options`` of every command that reads or writes object storage (``--storage-option KEY=VALUE``, repeatable)
STORAGE_OPTION = Cli(flags=("--storage-option",), metavar="KEY=VALUE", type=list[str], convert=tuple, show=list)


@dataclasses.dataclass(frozen=True)
class ConfigParameters:
    """The command-line parameters of a config type (typer ``inspect.Parameter`` objects, in field order)."""

    config_type: type
    parameters: tuple[inspect.Parameter, ...]
    converts: dict[str, Callable[[Any], Any]]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parameters)

    def config_values(self, values: dict) -> dict:
        """The config's keyword arguments from the command line's values of these parameters."""
        out = {}
        for name in self.names:
            value = values[name]
            convert = self.converts.get(name)
            out[name] = convert(value) if convert is not None and value is not None else value
        return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ...


def _parameter(f: dataclasses.Field, hint: Any, cli: Cli) -> inspect.Parameter:
    default = _default(f)
    if cli.show is not None and default is not None and default is not ...:
        default = cli.show(default)
    if cli.required:
        default = ...
    elif cli.optional and default is ...:
        default = None
    annotation = cli.type if cli.type is not None else hint
    extra: dict[str, Any] = {"help": f.metadata.get("help", "")}
    if f.metadata.get("panel"):
        extra["rich_help_panel"] = f.metadata["panel"]
    if default is None or default is ... or (isinstance(default, (list, tuple)) and not default):
        extra["show_default"] = False
    if cli.metavar is not None or cli.argument:
        extra["metavar"] = cli.metavar or f.name.upper()  # arguments in capitals, as in the usage lines of docs/
    elif choices(annotation):
        extra["metavar"] = choices_metavar(choices(annotation))
    if cli.argument:
        info = typer.Argument(default, **extra)
    else:
        dashed = "--" + f.name.replace("_", "-")
        flags = cli.flags or ((f"{dashed}/--no-{dashed[2:]}",) if annotation is bool and default is True else (dashed,))
        info = typer.Option(default, *flags, **extra)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def choices(hint: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` hint (also inside ``X | None``); () for other hints."""
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is typing.Literal:
            return tuple(str(v) for v in typing.get_args(candidate))
    return ()


def choices_metavar(values: tuple[str, ...]) -> str:
    """``<a | b | c>``: a choice option's values in ``--help``, spaced so that a narrow terminal wraps
    the list between values, never inside one."""
    return "<" + " | ".join(values) + ">"


def config_parameters(config_type: type, fields: dict[str, Cli] | None = None,
                      library_only: tuple[str, ...] = ()) -> ConfigParameters:
    """The command-line parameters of ``config_type``'s fields (all but ``library_only``)."""
    fields = dict(fields or {})
    hints = typing.get_type_hints(config_type)
    names = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted((set(fields) | set(library_only)) - names)
    if unknown:
        raise TypeError(f"{config_type.__name__} has no field(s) {', '.join(unknown)}")
    params, converts = [], {}
    for f in dataclasses.fields(config_type):
        if f.name in library_only:
            continue
        if not f.metadata.get("help"):
            raise TypeError(f"{config_type.__name__}.{f.name} has no help: declare it with doc(default, help)")
        cli = fields.get(f.name, Cli())
        params.append(_parameter(f, hints[f.name], cli))
        if cli.convert is not None:
            converts[f.name] = cli.convert
    return ConfigParameters(config_type, tuple(params), converts)


def last_panel_last(parameters: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """``parameters`` with those of the shared panel (workers, inputs and output) moved to the end: typer
    lists the panels in the order their first option comes."""
    shared = [p for p in parameters if getattr(p.default, "rich_help_panel", None) == PANEL_RUN]
    return [p for p in parameters if p not in shared] + shared


def config_command(config_type: type, fields: dict[str, Cli] | None = None,
                   library_only: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorate ``fn(config, **cli_only)`` into a typer command whose options are ``config_type``'s fields
    (see the module docstring) followed by ``fn``'s own command-line-only parameters."""
    generated = config_parameters(config_type, fields, library_only)

    def decorate(fn: Callable) -> Callable:
        own = list(inspect.signature(fn).parameters.values())[1:]  # after `config`
        own_hints = typing.get_type_hints(fn)
        clash = sorted({p.name for p in own} & set(generated.names))
        if clash:
            raise TypeError(f"{fn.__name__}: {', '.join(clash)} declared twice (a config field is already an option)")
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=own_hints[p.name]) for p in own]

        @functools.wraps(fn)
        def command(**values):
            config = config_type(**generated.config_values(values))
            return fn(config, **{p.name: values[p.name] for p in own})

        parameters = last_panel_last([*generated.parameters, *own])
        command.__signature__ = inspect.Signature(parameters)
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        del command.__wrapped__  # typer must read the generated signature, not fn's
        command.config_parameters = generated
        return command

    return decorate
