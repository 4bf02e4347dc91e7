"""``varlen report PLAN -o REPORT.html``: a plan at a glance, as one self-contained page or image.

:func:`report` reads the plan through ``varlen inspect`` (:func:`varlen_cli.inspect.inspect_artifact`:
windows of whole steps, series kept in buckets of steps, so memory is bounded whatever the plan's
size), draws its plots (:mod:`.figures`) and writes the HTML page (:mod:`.page`, inline SVG, no
dependency) or, with ``format="png"``, one PNG of every plot (:mod:`.png`, needs Pillow: the
``varlen-cli[report]`` extra). The output is written atomically and replaced only with ``overwrite``
when ``varlen report`` made it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Literal

from .. import storage
from ..errors import InputError, OutputError, UsageError
from ..runtime import artifacts, rank0
from ..runtime.choices import PANEL_RUN, STORAGE_OPTION_HELP, doc

EXTENSIONS = {"html": (".html", ".htm"), "png": (".png",)}


@dataclass(frozen=True)
class ReportConfig:
    """Options of ``varlen report``."""

    plan: str = doc(help="Plan Parquet file written by `varlen plan` (local or in object storage).")
    output: str = doc(help="The report to write (a local file): REPORT.html, or REPORT.png with --format png.")
    metrics: str | None = doc(None, "The metrics or sorted directory the plan was built from: the samples' own "
                                    "length histogram, and their difficulty over the steps of a curriculum plan.")
    format: Literal["html", "png"] = doc("html", "html: one self-contained page (inline SVG, opens offline); "
                                                 "png: every plot in one image (needs Pillow: the report extra of "
                                                 "varlen-cli).")
    overwrite: bool = doc(False, "Replace an existing report (only one varlen wrote).", panel=PANEL_RUN)
    storage_options: tuple = doc((), STORAGE_OPTION_HELP, panel=PANEL_RUN)


@dataclass
class ReportResult:
    """What :func:`report` wrote: the path, its format and size, the plots (ids, in page order)."""

    output: str
    format: str
    figures: list = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0


def check(config: ReportConfig) -> None:
    """Refuse, before reading the plan, what cannot work: a remote output, an output named for the
    other format, ``png`` without Pillow."""
    if config.format not in EXTENSIONS:
        raise UsageError(f"--format {config.format!r} is not one of html, png")
    if storage.is_remote(config.output):
        raise UsageError(f"-o {config.output}: a report is written to a local file (copy it to object storage after)")
    ext = os.path.splitext(config.output)[1].lower()
    other = next((f for f, names in EXTENSIONS.items() if ext in names and f != config.format), None)
    if other is not None:
        raise UsageError(f"-o {config.output} names a {other} file but --format is {config.format}: pass --format "
                         f"{other}, or name it {os.path.splitext(config.output)[0]}{EXTENSIONS[config.format][0]}")
    if config.format == "png":
        from .png import pillow

        pillow()


def report(config: ReportConfig) -> ReportResult:
    """Draw the plan ``config.plan`` and write the report ``config.output`` (see the module docstring)."""
    if rank0.needs_group():  # under torchrun: rank 0 writes, the others get its result
        return rank0.on_rank0(report, config)
    t0 = time.perf_counter()
    check(config)
    from ..inspect import InspectConfig, inspect_artifact
    from .figures import figures

    info = inspect_artifact(InspectConfig(path=config.plan, metrics=config.metrics,
                                          storage_options=config.storage_options))
    if info["kind"] != "plan":
        raise InputError(f"{config.plan} is a {info['kind']} directory, not a plan: `varlen report` draws plans "
                         "(`varlen inspect` shows directories)")
    figs = figures(info)
    if config.format == "png":
        from .png import png_image

        data = png_image(info, figs)
    else:
        from .page import html_page

        data = html_page(info, figs).encode("utf-8")
    inputs = [p for p in (config.plan, config.metrics) if p]
    with artifacts.atomic_file(config.output, config.overwrite, inputs=inputs, kind="report") as out:
        try:
            with open(out.tmp, "wb") as fh:
                fh.write(data)
        except OSError as exc:  # a full disk, a read-only folder: the user's, not varlen's
            raise OutputError(f"cannot write {config.output}: {exc.strerror or exc}") from None
    return ReportResult(output=os.path.abspath(config.output), format=config.format, figures=[f.id for f in figs],
                        bytes=len(data), seconds=time.perf_counter() - t0)
