"""A plan's summary statistics as sums over its rows: fed windows of whole steps, mergeable.

``varlen plan --extend`` recomputes the statistics of a parent plan and its appended epochs without
holding either's columns (issue 25): every quantity of :func:`varlen_cli.plan.stats.summary` is a sum,
a count, a minimum or a maximum over steps or microbatches, so each part is summed window by window
(:meth:`Totals.update`) and the parts are added (:meth:`Totals.merge`). The per-step straggler is the
busiest rank's cost over the mean rank cost (``format.straggler``), computed per window, as windows
hold whole steps; the ``memory`` entry's predicted peaks are maxima per shape and overall.
"""

from __future__ import annotations

import numpy as np

from .. import format
from ..budget import Budget, segment_sum_squares
from . import stats

ROW_COLUMNS = ("epoch", "step", "rank", "num_samples", "seqlen", "batch_size", "tokens", "lr_scale", "shape_id")
TARGET_COLUMNS = (format.TARGET_SEQLEN_COLUMN, "step_loss_tokens")  # two budgets: the target side's sums


class Totals:
    """Sums over the rows of (part of) a plan of ``dp x grad_accum`` rows a step, under ``budget``;
    ``memory``: the plan's recorded ``memory`` entry (its profile) when it has one, ``num_shapes``
    the size of its ``shapes`` list (the shape ids the rows use)."""

    def __init__(self, budget: Budget, dp: int, grad_accum: int, memory: dict | None = None, num_shapes: int = 0):
        self.budget, self.dp, self.slots = budget, dp, dp * grad_accum
        self.memory = memory
        self.microbatches = self.samples = self.tokens = self.padded = 0
        self.strag_sum, self.strag_max, self.strag_steps = 0.0, None, 0
        self.top = self.mean = 0.0
        self.lr_min = self.lr_max = None
        self.peak_per_shape = np.zeros(num_shapes)
        self.peak_max = self.peak_max_per_segment = None
        self.targets = self.target_padded = 0  # two budgets

    @property
    def columns(self) -> tuple:
        """The row columns :meth:`update` reads (:data:`ROW_COLUMNS`; two budgets: :data:`TARGET_COLUMNS` too)."""
        return ROW_COLUMNS + (TARGET_COLUMNS if self.budget.two_sided else ())

    @property
    def needs_lengths(self) -> bool:
        """Whether :meth:`update` needs the rows' segment lengths (a packed attention cost or memory entry)."""
        return self.budget.needs_segment_lengths or (self.memory is not None and self.budget.packed)

    def update(self, cols: dict, lengths: np.ndarray | None = None, offsets: np.ndarray | None = None) -> None:
        """Add rows of whole steps: ``cols`` per row (:data:`ROW_COLUMNS`); ``lengths``/``offsets`` the
        rows' ``sample_lengths`` as CSR (when :attr:`needs_lengths`)."""
        n = len(cols["step"])
        if not n:
            return
        b, t = cols["batch_size"].astype(np.int64), cols["seqlen"].astype(np.int64)
        tokens = cols["tokens"].astype(np.int64)
        sumsq = segment_sum_squares(lengths, offsets) if lengths is not None else None
        target = cols[format.TARGET_SEQLEN_COLUMN].astype(np.int64) if self.budget.two_sided else None
        cost = self.budget.microbatch_cost(tokens, b, t, sumsq if self.budget.needs_segment_lengths else None, target)
        if target is not None:
            self.target_padded += int((b * target).sum())
            self.targets += int(cols["step_loss_tokens"][::self.slots].astype(np.int64).sum())
        self.microbatches += n
        self.samples += int(cols["num_samples"].astype(np.int64).sum())
        self.tokens += int(tokens.sum())
        self.padded += int((b * t).sum())
        step = cols["step"].astype(np.int64)
        load = format.step_loads(step - step[0], cols["rank"].astype(np.int64), cost, self.dp)
        m = load.mean(axis=1)
        strag = np.where(m > 0, load.max(axis=1) / np.where(m > 0, m, 1), 1.0)
        self.strag_sum += float(strag.sum())
        self.strag_steps += len(strag)
        self.strag_max = _max(self.strag_max, float(strag.max()))
        self.top += float(load.max(axis=1).sum())
        self.mean += float(m.sum())
        lr = cols["lr_scale"][::self.slots]
        self.lr_min = _min(self.lr_min, float(lr.min()))
        self.lr_max = _max(self.lr_max, float(lr.max()))
        if self.memory is not None:
            self._memory(b, t, cols["shape_id"], lengths, offsets)

    def _memory(self, b, t, shape_id, lengths, offsets) -> None:
        from ..memory.budget import plan_memory_metadata

        part = plan_memory_metadata(self.memory, b, t, shape_id, len(self.peak_per_shape), self.budget.packed,
                                    lengths, offsets)
        np.maximum(self.peak_per_shape, np.asarray(part["predicted_peak_per_shape"]), out=self.peak_per_shape)
        self.peak_max = _max(self.peak_max, part["predicted_peak_max"])
        if "predicted_peak_max_per_segment" in part:
            self.peak_max_per_segment = _max(self.peak_max_per_segment, part["predicted_peak_max_per_segment"])

    def merge(self, other: Totals) -> None:
        """Add the rows ``other`` (same budget, layout and shapes) was fed."""
        for name in ("microbatches", "samples", "tokens", "padded", "strag_sum", "strag_steps", "top", "mean",
                     "targets", "target_padded"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, pick in (("strag_max", _max), ("lr_min", _min), ("lr_max", _max), ("peak_max", _max),
                           ("peak_max_per_segment", _max)):
            setattr(self, name, pick(getattr(self, name), getattr(other, name)))
        np.maximum(self.peak_per_shape, other.peak_per_shape, out=self.peak_per_shape)

    def summary(self, *, budget_tokens: float, shapes: int, dropped: int, warmup_steps: int, epochs: int,
                samples_per_epoch: list, seconds: float) -> dict:
        """``stats.summary`` of the rows fed, with ``straggler_overhead``."""
        strag_mean = self.strag_sum / self.strag_steps if self.strag_steps else 1.0
        out = stats.summary(
            num_steps=self.microbatches // self.slots, num_microbatches=self.microbatches, samples=self.samples,
            tokens=self.tokens, padded_tokens=self.padded, budget_tokens=budget_tokens,
            strag=(strag_mean, self.strag_max if self.strag_max is not None else 1.0), shapes=shapes,
            lr=(self.lr_min, self.lr_max) if self.lr_min is not None else np.zeros(0), dropped=dropped,
            over_budget=0, warmup_steps=warmup_steps, epochs=epochs, samples_per_epoch=samples_per_epoch,
            seconds=seconds)
        out["straggler_overhead"] = self.top / self.mean - 1.0 if self.mean > 0 else 0.0
        if self.budget.two_sided:
            out.update(stats.target_summary(self.targets, self.target_padded))
        return out

    def memory_entry(self) -> dict:
        """The plan's ``memory`` entry (``memory.budget.plan_memory_metadata``'s) from the maxima fed."""
        from ..memory.budget import coefficients, plan_memory_metadata

        out = plan_memory_metadata(self.memory, np.zeros(0), np.zeros(0), np.zeros(0, np.int64),
                                   len(self.peak_per_shape), self.budget.packed)
        out["predicted_peak_per_shape"] = [float(v) for v in self.peak_per_shape]
        out["predicted_peak_max"] = (self.peak_max if self.peak_max is not None
                                     else float(coefficients(self.memory["profile"])[0]))
        if self.peak_max_per_segment is not None:
            out["predicted_peak_max_per_segment"] = self.peak_max_per_segment
        return out


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)
