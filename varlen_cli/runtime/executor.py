"""One executor for every stage: run a stage's ``run_in_group`` on 1..N workers.

A stage is two public functions over its config dataclass (which has ``output``, ``overwrite``,
``nproc`` and ``device`` fields):

- ``check(config)``: validate the options and inputs before any worker starts (cheap, rank-free);
- ``run_in_group(config, d, out, t0)``: the work of one rank of the process group ``d``
  (:class:`~varlen_cli.runtime.dist.Dist`), writing into the shared temporary output ``out``
  (:class:`~varlen_cli.runtime.artifacts.AtomicDir`); returns the result on rank 0.

:func:`execute` runs a stage as world size 1 in this process, under torchrun, or in ``nproc``
local workers; :func:`run_in_session` runs it inside a process group that already exists (what
``varlen run`` does to chain stages in one launch).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from .. import storage
from . import artifacts, remote_output, safety
from .dist import cap_workers, run_distributed, session

RunInGroup = Callable[[Any, Any, artifacts.AtomicDir, float], Any]


def run_in_session(run_in_group: RunInGroup, config: Any) -> Any:
    """One worker's run of a stage: join (or reuse) the process group, share the atomic output."""
    t0 = time.perf_counter()
    if hasattr(config, "storage_options"):  # --storage-option, in every worker process
        storage.configure(config.storage_options)
    with session(config.device) as d, artifacts.atomic_dir_for_group(d, config.output, config.overwrite) as out:
        return run_in_group(config, d, out, t0)


def execute(run_in_group: RunInGroup, config: Any, count_units: Callable[[], tuple[int, str]] | None = None) -> Any:
    """Run a (checked) stage on ``config.nproc`` workers; the result on rank 0, None elsewhere.

    ``count_units()``: the stage's work units and what one is; ``nproc`` is capped by them and the
    cores (:func:`~varlen_cli.runtime.dist.cap_workers`)."""
    entry = functools.partial(run_in_session, run_in_group)
    if count_units is not None:
        config = cap_workers(config, count_units)
    if storage.is_remote(config.output):  # object storage: no lock, no rename (see remote_output)
        if hasattr(config, "storage_options"):
            storage.configure(config.storage_options)
        remote_output.check(config.output, config.overwrite, safety.stage_inputs(config))
        return run_distributed(entry, config, config.nproc)
    safety.check_no_overlap(config.output, safety.stage_inputs(config))
    out = artifacts.AtomicDir(config.output, config.overwrite)
    out.check()
    if config.nproc == 1:  # in this process (or a torchrun rank): atomic_dir_for_group locks on rank 0
        return run_distributed(entry, config, config.nproc)
    with safety.output_lock(out.path, config.output):  # the launcher holds the lock; its workers inherit it
        try:
            return run_distributed(entry, config, config.nproc)
        except BaseException:
            safety.clean_leftovers(out.path)
            raise
