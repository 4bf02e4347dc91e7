"""The driver: :class:`PlanChecks` runs every check of a plan over windows of whole steps (and merges
the checks of windows shared out among workers); :func:`run_checks` over one window."""

from __future__ import annotations

import numpy as np

from .. import format
from ..budget import Budget
from .arrays import Check, PlanArrays
from .budget import BudgetCheck, Shapes
from .coverage import Coverage
from .keys import keys_of
from .layout import Counts, Layout
from .split import SplitInfo, split_info
from .steps import LossTokens, Lr, StepTotals, Straggler, completed, final_entries


class PlanChecks:
    """Every check of a plan, fed windows of whole steps in plan order (:meth:`update`), then
    :meth:`results` (the file's columns and fingerprint are :mod:`varlen_cli.validate`'s).
    ``split``: the plan's split samples (:func:`split_info`), needed for ``--split-long`` plans checked
    without the samples' lengths; ``lengths``: whether windows come with ``sample_length``.

    ``mergeable``: the windows of a plan may be shared out among several PlanChecks (each fed its
    windows in plan order, e.g. the workers writing a plan's segments), which are then joined with
    :meth:`merge` (in any order; picklable between processes): the merged :meth:`results` are those
    of one PlanChecks fed every window. Such a PlanChecks keeps one bitmap per epoch it met until
    the end (a streaming one only the current epoch's). ``spill``: a directory (the caller's) where a
    streaming one puts the chunks of split samples until their check at the end (else held in memory)."""

    def __init__(self, meta: dict, *, split: SplitInfo | None = None, lengths: bool = False, max_memory=None,
                 profile_path: str | None = None, mergeable: bool = False, spill: str | None = None,
                 background: bool = False):
        self.meta = meta
        self.error: str | None = None
        try:
            self.budget = Budget.from_metadata(meta)
        except ValueError as exc:
            self.error = f"malformed metadata: {exc}"
            return
        self.split = split
        self.keys = keys_of(meta)
        # a replan's first epoch of a split plan, without the samples' lengths: which chunk ends a sample
        # whose last chunk was consumed before the replan is unknown
        unknowable = (split is not None and split.count > 0 and not lengths
                      and "consumed_samples" in (meta.get("lineage") or {}))
        self.layout, self.counts = Layout(meta), Counts(bool(meta.get("packing")))
        self.coverage, self.budget_check = Coverage(meta, split), BudgetCheck(meta, self.budget)
        self.coverage.keep = mergeable
        if spill is not None and not mergeable:  # split chunks to files under spill, checked a key range at a time
            expected = split.later + split.count if split is not None else self.keys.size // 16
            self.coverage.spill_to(spill, expected, lengths)
        self.shapes, self.steps, self.lr = Shapes(meta), StepTotals(unknowable), Lr(meta, unknowable)
        self.straggler = Straggler(meta, self.budget)
        self.loss = LossTokens(unknowable, meta.get("loss_tokens") == format.TARGET_LENGTH_COLUMN)
        self.memory = [] if (max_memory is not None or profile_path is not None or self.budget.memory) else None
        self.memory_args = (max_memory, profile_path)
        self.broken = False  # list columns that disagree, negative ids: only layout and counts are meaningful
        self._worker = self._pending = None  # background: a thread checks coverage while the rest goes on
        if background and not mergeable:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(1, thread_name_prefix="varlen-coverage")

    def update(self, a: PlanArrays) -> None:
        if self.error is not None:
            return
        self.layout.update(a)
        if not self.counts.update(a):
            self.broken = True
        if self.broken:
            return
        final = final_entries(a, self.split, self.keys, self.meta)
        done = completed(a, final)
        if self._worker is None:
            self.coverage.update(a)
        else:  # windows in order: the previous one's first (numpy's gathers and scatters release the GIL)
            self._wait()
            self._pending = self._worker.submit(self.coverage.update, a)
        self.budget_check.update(a)
        self.shapes.update(a)
        self.steps.update(a, done)
        self.lr.update(a, done)
        if self.memory is not None:
            self.memory.append((a.first_row, a.cols["batch_size"].astype(np.int32), a.cols["seqlen"].astype(np.int32)))
        self.straggler.update(a)
        self.loss.update(a, final)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the background coverage check and end its thread (results() does it too)."""
        if self._worker is not None:
            try:
                self._wait()
            finally:
                self._worker.shutdown()
                self._worker = None

    def merge(self, other: PlanChecks) -> None:
        """Add the windows ``other`` (made with the same metadata, ``mergeable``) was fed."""
        if self.error is not None:
            return
        self.broken |= other.broken
        for part in ("layout", "counts", "coverage", "budget_check", "shapes", "steps", "lr", "straggler", "loss"):
            getattr(self, part).merge(getattr(other, part))
        if self.memory is not None:
            self.memory += other.memory

    def results(self) -> list[Check]:
        if self.error is not None:
            return [Check("budget", False, self.error)]
        self.close()
        checks = [self.layout.result(), self.counts.result()]
        if self.broken:
            return checks
        checks += [self.coverage.result(), self.budget_check.result(), self.shapes.result(), self.steps.result(),
                   self.lr.result()]
        if self.memory is not None:
            from ..memory.budget import memory_check

            windows = sorted(self.memory, key=lambda m: m[0])
            b = np.concatenate([m[1] for m in windows]) if windows else np.zeros(0, np.int32)
            t = np.concatenate([m[2] for m in windows]) if windows else np.zeros(0, np.int32)
            ok, detail = memory_check(b, t, self.budget, *self.memory_args)
            checks.append(Check("memory", ok, detail))
        checks += [self.straggler.result(), self.loss.result()]
        return checks


def run_checks(a: PlanArrays, meta: dict, *, max_memory=None, profile_path: str | None = None) -> list[Check]:
    """Every check of a plan held whole in arrays (one window)."""
    split = split_info([a], meta) if a.starts is not None and a.sample_length is None else None
    checks = PlanChecks(meta, split=split, lengths=a.sample_length is not None, max_memory=max_memory,
                        profile_path=profile_path)
    checks.update(a)
    return checks.results()
