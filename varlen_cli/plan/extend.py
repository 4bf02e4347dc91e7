"""``varlen plan --extend PLAN --epochs E``: a plan's rows, unchanged, followed by the rows of more epochs.

:func:`extend` plans the new epochs with the parent's options and budget (:mod:`.parent`), numbered
after the parent's, and appends their rows to the parent's: steps and epochs shifted, shape ids
remapped onto the parent's ``shapes`` list (new shapes appended), metadata and statistics recomputed
for the whole, which then passes the plan's own check (:mod:`varlen_cli.checks`) before it is
swapped in. Every plan, a mixture's (``--mix``) included, is extended in bounded memory
(:mod:`.extend_stream`: the chunked planner, ``--nproc`` workers, and the parent's row groups copied
as they are).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from .. import storage
from ..errors import UsageError
from ..runtime import safety
from ..runtime.choices import ALLOW_MEMORY_EXTRAPOLATION_HELP, NPROC_HELP, STORAGE_OPTION_HELP, doc
from ..runtime.dist import check_nproc
from . import writer
from .config import PlanConfig, PlanResult
from .parent import config_record, continued_input, open_parent, parent_config, recorded_input


@dataclass(frozen=True)
class ExtendConfig:
    """Options of ``varlen plan --extend PLAN --epochs E``."""

    plan: str = doc(help="The plan to lengthen.")
    output: str = doc(help="The extended plan file to write.")
    epochs: int = doc(help="Epochs of the extended plan (more than the plan has).")
    input: str | None = doc(None, "The plan's metrics/sorted directory, if it moved (default: the recorded path).")
    overwrite: bool = doc(False, "Replace an existing output (written atomically either way).")
    allow_stale: bool = doc(False, "Use metrics even if their source files changed since `varlen analyze`.")
    allow_memory_extrapolation: bool = doc(False, ALLOW_MEMORY_EXTRAPOLATION_HELP)
    storage_options: tuple = doc((), STORAGE_OPTION_HELP)
    nproc: int = doc(1, NPROC_HELP)
    progress: bool = doc(True, "Show a progress bar on rank 0 (only on a terminal).")


def extend(config: ExtendConfig) -> PlanResult:
    """Run ``varlen plan --extend``: the plan's rows unchanged, then epochs up to ``config.epochs``."""
    t0 = time.perf_counter()
    storage.configure(config.storage_options)  # the plan's input and the output may be in object storage
    check_nproc(config.nproc)
    parent = open_parent(config.plan)
    if config.epochs <= parent.epochs:
        raise UsageError(f"--epochs {config.epochs} must be more than the {parent.epochs} epoch(s) of "
                         f"{parent.path} to extend it")
    if parent.mixture and config.input:
        raise UsageError("INPUT_DIR does not apply to a mixture plan: its sources are recorded in it")
    inputs = [s.get("path") for s in parent.mixture["sources"]] if parent.mixture else \
        [config.input or recorded_input(parent)]
    safety.check_no_overlap(config.output, [config.plan] + [p for p in inputs if p])
    writer.check_output(config.output, config.overwrite)
    c = parent_config(parent, input=config.input, output=config.output, epochs=config.epochs - parent.epochs,
                      overwrite=config.overwrite, allow_stale=config.allow_stale,
                      storage_options=config.storage_options)
    c = dataclasses.replace(c, nproc=config.nproc, progress=config.progress)
    if config.allow_memory_extrapolation:  # this run's opt-in, recorded like the parent's (config_record)
        c = dataclasses.replace(c, allow_memory_extrapolation=True)
    budget = parent.budget
    if budget.memory:  # the recorded limit, re-checked as every planning command checks it
        from ..memory.budget import check_calibrated_range

        check_calibrated_range(budget.memory, c.allow_memory_extrapolation)
    before = parent.lineage
    whole = dataclasses.replace(c, epochs=config.epochs)  # the options the extended plan records
    record = config_record(whole, budget)
    lineage = {**before, "kind": "extend", "parent": parent.fingerprint,
               "parent_path": os.path.abspath(parent.path), "parent_steps": parent.num_steps,
               "parent_epochs": parent.epochs}
    first_epoch = int(before.get("first_epoch", 0)) + parent.epochs
    from .extend_stream import extend_streamed  # the chunked planner, the parent's row groups copied

    _, mixture = continued_input(parent, c)  # the parent's input, unchanged (from the manifests)
    return extend_streamed(parent, c, budget, record, lineage, first_epoch, t0, **mixture)


EXTEND_KEEPS = ("input", "output", "epochs", "overwrite", "allow_stale", "allow_memory_extrapolation", "extend",
                "progress", "storage_options", "nproc")  # others: refused


def run_extend(given: PlanConfig) -> PlanResult:
    """``plan(PlanConfig(extend=PLAN, epochs=E, output=OUT))``: refuses options that would change the plan."""
    defaults = PlanConfig(input="", output="")
    for f in dataclasses.fields(PlanConfig):
        if f.name not in EXTEND_KEEPS and getattr(given, f.name) != getattr(defaults, f.name):
            option = "--" + f.name.replace("_", "-")
            raise UsageError(f"{option} cannot be combined with --extend: the extended plan keeps the plan's options "
                             "(use `varlen replan` to change the layout)")
    return extend(ExtendConfig(plan=given.extend, output=given.output, epochs=given.epochs, input=given.input or None,
                               overwrite=given.overwrite, allow_stale=given.allow_stale,
                               allow_memory_extrapolation=given.allow_memory_extrapolation,
                               storage_options=given.storage_options, nproc=given.nproc, progress=given.progress))
