"""The per-step checks: ``step_samples``/``step_tokens``, ``lr_scale``, the straggler statistics and
``step_loss_tokens``, each recomputed from the step's rows; and which entries complete a sample."""

from __future__ import annotations

import numpy as np

from .. import format
from ..budget import Budget
from .arrays import Check, Examples, PlanArrays, segment_reduce
from .keys import Keys
from .split import SplitInfo


def final_entries(a: PlanArrays, split: SplitInfo | None, keys: Keys, meta: dict) -> np.ndarray | None:
    """Per entry: whether it ends its sample (a whole sample, or a split sample's last chunk); None
    when every entry does. Exact with the samples' lengths; without them, the chunk with the largest
    start of its sample in its epoch (``split``: those starts over the whole plan)."""
    if a._final is not None or a.starts is None:
        return a._final
    if a.sample_length is not None:
        final = a.starts + a.lengths == a.sample_length
        a._final = None if final.all() else final
        return a._final
    if split is None or not split.count:
        return None
    k, problem = keys.of(a, meta)
    if problem is not None:
        return None
    a._split, a._final = split.final(a.entry_epoch() * split.size + k, a.starts)
    return a._final


def completed(a: PlanArrays, final: np.ndarray | None) -> np.ndarray:
    """Samples each microbatch completes: its entries, except non-final chunks of split samples."""
    if final is None:
        return a.cols["num_samples"].astype(np.int64)
    return segment_reduce(np.add, final.astype(np.int64), a.offsets)


def _step_sums(step: np.ndarray, values: np.ndarray) -> np.ndarray:
    if not len(step):
        return np.zeros(0)
    local = step - step.min()
    return np.bincount(local, weights=values)[local]


class StepTotals:
    def __init__(self, unknowable: bool):
        self.unknowable, self.bad = unknowable, 0

    def update(self, a: PlanArrays, done: np.ndarray) -> None:
        c = a.cols
        step = c["step"].astype(np.int64)
        bad = _step_sums(step, c["tokens"]) != c["step_tokens"]
        if not self.unknowable:
            bad |= _step_sums(step, done) != c["step_samples"]
        self.bad += int(bad.sum())

    def merge(self, other: StepTotals) -> None:
        self.bad += other.bad

    def result(self) -> Check:
        if self.bad:
            return Check("step totals", False, f"step_samples/step_tokens wrong in {self.bad} rows")
        note = " (step_samples of the first epoch need --metrics)" if self.unknowable else ""
        return Check("step totals", True, "step_samples and step_tokens match their steps" + note)


class Lr:
    def __init__(self, meta: dict, unknowable: bool):
        cfg = meta.get("config") or {}
        self.mode = meta.get("lr_scaling", cfg.get("lr_scaling", "none"))
        self.by = meta.get("lr_scale_by", cfg.get("lr_scale_by", "samples"))
        self.base = meta.get("base_batch_size")
        self.trained_only = meta.get("loss_tokens") == format.TARGET_LENGTH_COLUMN
        self.unknowable = unknowable
        self.nonfinite = self.bad = 0

    @property
    def _plain(self) -> bool:
        return self.mode == "none" or self.base == 0

    def update(self, a: PlanArrays, done: np.ndarray) -> None:
        c = a.cols
        lr = c["lr_scale"].astype(np.float64)
        self.nonfinite += int((~np.isfinite(lr)).sum())
        step = c["step"].astype(np.int64)
        if self._plain:  # base 0: only empty samples, nothing to scale by (plan/lr.py)
            want = np.ones(len(step))
        elif (self.by == "samples" and self.unknowable) or not self._base_ok():
            return
        else:
            if self.by == "loss-tokens" or (self.by == "tokens" and self.trained_only):  # plan/lr.py
                if "step_loss_tokens" not in c:
                    return
                per_step = c["step_loss_tokens"].astype(np.float64)
            else:
                per_step = _step_sums(step, c["tokens"] if self.by == "tokens" else done)
            ratio = per_step / float(self.base)
            want = ratio if self.mode == "linear" else np.sqrt(ratio)
        self.bad += int((~np.isclose(lr, want, rtol=1e-9, atol=1e-12)).sum())

    def merge(self, other: Lr) -> None:
        self.nonfinite += other.nonfinite
        self.bad += other.bad

    def _base_ok(self) -> bool:
        b = self.base
        return isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0

    def result(self) -> Check:
        if self.nonfinite:
            return Check("lr_scale", False, f"{self.nonfinite} rows whose lr_scale is not finite")
        if not self._plain:
            if self.by == "samples" and self.unknowable:
                return Check("lr_scale", True, "needs --metrics for the first epoch of a replanned --split-long plan",
                             skipped=True)
            if not self._base_ok():
                return Check("lr_scale", False, f"metadata has no base_batch_size > 0 (got {self.base!r})")
        if self.bad:
            return Check("lr_scale", False, f"{self.bad} rows whose lr_scale is not {self.mode}({self.by} / "
                         f"{self.base})")
        shown = f" / {self.base:g}" if self.base and self.mode != "none" else ""
        return Check("lr_scale", True, f"{self.mode} in step {self.by}{shown}")


class Straggler:
    """The straggler in the plan's own cost model (:meth:`varlen_cli.budget.Budget.microbatch_cost`),
    recomputed from the columns; fails when the plan's recorded statistics say otherwise."""

    def __init__(self, meta: dict, budget: Budget):
        self.meta, self.budget = meta, budget
        self.dp = int(meta["dp"])
        self.parts: list = []  # (first row, per-step straggler, sum of the steps' top loads, of their means)
        self.missing_lengths = False

    def update(self, a: PlanArrays) -> None:
        c = a.cols
        if not a.count:
            return
        if self.budget.two_sided and format.TARGET_SEQLEN_COLUMN not in c:
            self.missing_lengths = True  # the cost of two budgets needs target_seqlen
            return
        sum_squares = None
        if self.budget.needs_segment_lengths:
            if a.lengths is None:
                self.missing_lengths = True
                return
            from ..budget import segment_sum_squares

            sum_squares = segment_sum_squares(a.lengths, a.offsets)
        cost = self.budget.microbatch_cost(c["tokens"], c["batch_size"], c["seqlen"], sum_squares,
                                           c.get(format.TARGET_SEQLEN_COLUMN))
        step = c["step"].astype(np.int64)
        step = step - step.min()
        rank = c["rank"].astype(np.int64)
        load = format.step_loads(step, rank, cost, self.dp)
        self.parts.append((a.first_row, format.straggler(step, rank, cost, self.dp), float(load.max(axis=1).sum()),
                           float(load.mean(axis=1).sum())))

    def merge(self, other: Straggler) -> None:
        self.parts += other.parts
        self.missing_lengths |= other.missing_lengths

    def result(self) -> Check:
        if self.missing_lengths:
            return Check("straggler", False, "a two-budget cost needs target_seqlen" if self.budget.two_sided
                         else "a packed attention cost needs sample_lengths")
        if not self.parts:
            return Check("straggler", True, "no steps")
        parts = sorted(self.parts, key=lambda p: p[0])  # plan order: the sums as one pass adds them
        per_step = np.concatenate([p[1] for p in parts])
        top = mean = 0.0
        for p in parts:
            top += p[2]
            mean += p[3]
        overhead = top / mean - 1.0 if mean > 0 else 0.0
        what = ", ".join(f"{k}={v}" for k, v in self.budget.straggler_spec().items())
        stats = self.meta.get("stats") or {}
        for key, value in (("straggler_mean", per_step.mean()), ("straggler_max", per_step.max())):
            recorded = stats.get(key)
            if isinstance(recorded, (int, float)) and not np.isclose(float(recorded), float(value), rtol=1e-9,
                                                                     atol=1e-12):
                return Check("straggler", False, f"metadata says {key} {recorded:.6g}, the plan has {value:.6g} "
                             f"(cost {what})")
        return Check("straggler", True, f"mean {per_step.mean():.3f}, max {per_step.max():.3f}, overhead "
                     f"{100 * overhead:.2f}% in cost {what}")


class LossTokens:
    """``step_loss_tokens`` (when the plan has it) against the targets counted from the lengths, or
    from the metrics' ``target_length`` for plans that count it (:func:`varlen_cli.format.loss_targets`)."""

    def __init__(self, unknowable: bool, target_length: bool = False):
        self.unknowable, self.target_length = unknowable, target_length
        self.present = self.known = True  # known: every window came with what the targets are counted from
        self.bad, self.steps = 0, Examples()

    def update(self, a: PlanArrays, final: np.ndarray | None) -> None:
        if "step_loss_tokens" not in a.cols:
            self.present = False
            return
        if self.target_length:  # analyze --target-length: not derived from the lengths
            if a.sample_target is None:
                self.known = False
                return
            targets = segment_reduce(np.add, format.loss_targets(None, target=a.sample_target), a.offsets)
        else:
            entry_len = a.lengths if a.lengths is not None else a.sample_length
            if entry_len is None:
                self.known = False
                return
            if self.unknowable:
                return
            if final is None and (not len(entry_len) or int(entry_len.min()) > 0):  # l - 1 per entry, in one pass
                targets = segment_reduce(np.add, entry_len, a.offsets) - np.diff(a.offsets)
            else:
                targets = segment_reduce(np.add, format.loss_targets(entry_len, final), a.offsets)
        step = a.cols["step"].astype(np.int64)
        bad = _step_sums(step, targets).astype(np.int64) != a.cols["step_loss_tokens"]
        self.bad += int(bad.sum())
        self.steps.add(bad, step, a.first_row)

    def merge(self, other: LossTokens) -> None:
        self.present &= other.present
        self.known &= other.known
        self.bad += other.bad
        self.steps.merge(other.steps)

    def result(self) -> Check:
        if not self.present:
            return Check("loss tokens", True, "plan has no step_loss_tokens column (older plan)", skipped=True)
        if not self.known:
            return Check("loss tokens", True, "needs --metrics: the plan counts the metrics' target_length "
                         "(assistant tokens)" if self.target_length else "needs --metrics for a padded plan",
                         skipped=True)
        if self.unknowable and not self.target_length:
            return Check("loss tokens", True, "needs --metrics for the first epoch of a replanned --split-long plan",
                         skipped=True)
        if self.bad:
            return Check("loss tokens", False, f"step_loss_tokens wrong in {self.bad} rows (e.g. steps {self.steps})")
        what = "the metrics' target_length" if self.target_length else "the samples' lengths"
        return Check("loss tokens", True, f"step_loss_tokens = targets counted from {what}")
