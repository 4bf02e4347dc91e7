"""The epoch pipeline's first stages: the rows every epoch is planned from (:class:`Rows`), the
inputs every epoch starts from (:func:`epoch_inputs`: samples too long for any microbatch set aside,
the canonical and curriculum orders, the shape map) and the epochs themselves (:func:`plan_epochs`:
microbatches formed by the order's former (:mod:`.orders`) from the epoch's samples, then laid out
as steps x ranks x micro (:mod:`.layout`) from the microbatch table)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..budget import COST_LIMIT, Budget
from ..errors import InputError, UsageError
from . import balance, batching, layout
from .batching import Microbatches
from .config import PlanConfig
from .layout import PLAN_REMEDIES, EpochLayout, Remedies
from .orders import CURRICULAR, EpochInputs, Formers
from .progress import PlanProgress
from .reader import canonical_order
from .shapes import ShapeMap, choose_edges

BYTES_PER_ENTRY = 48
"""Peak memory of planning per sample entry of the plan (a sample once in one epoch), padded plans:
measured 45-58 bytes at 10M-100M samples and one epoch (input included), 27 more per entry of each
further epoch (1M samples, 1 vs 10 epochs; benchmarks/README.md)."""
PACKED_BYTES_PER_ENTRY = 96  # measured 78 a further epoch's entry (entry lengths, rows and starts)
MAX_EPOCHS_PER_RUN = 100_000
"""Epochs one run plans at most: each costs about a millisecond of fixed work however few its samples
(more: ``varlen plan --extend`` lengthens a plan)."""


@dataclass
class Rows:
    """What the planner plans: one row per sample of the input, or per (copy of a) sample of a
    mixture's sources, plus, in a replan's first epoch, the pieces left of samples a ``--split-long``
    parent had started. Epochs hold positions into these arrays.

    ``sample_id``: the id the plan writes; ``length``: the tokens the row takes; ``source``: the
    mixture source of each row (its rows are then in canonical order already: ids repeat);
    ``start``/``full_length`` (pieces only): where the piece starts in its sample and the sample's
    whole length; ``target``: the tokens of each row that carry loss, when the input counts them
    (``target_length``, ``varlen analyze --target-length``). ``base``: rows ``[0, base)`` are the
    input's (every epoch), rows ``[base, len)`` the pieces (only the epochs that name them)."""

    sample_id: np.ndarray
    length: np.ndarray
    source: np.ndarray | None = None
    start: np.ndarray | None = None
    full_length: np.ndarray | None = None
    base: int | None = None
    target: np.ndarray | None = None

    def __post_init__(self):
        if self.base is None:
            self.base = len(self.length)

    def __len__(self) -> int:
        return len(self.length)


FEWER_EPOCHS = "plan fewer epochs (lengthen the plan later with `varlen plan --extend`)"


def check_plan_size(entries_per_epoch: int, epochs: int, packed: bool, what: str,
                    bytes_per_entry: float | None = None, fixed: int = 0, remedy: str = FEWER_EPOCHS) -> None:
    """Refuse, before any work, a plan that would not fit in this machine's memory (an estimate) or
    would take thousands of epochs of fixed work: one line instead of a stall or an out-of-memory kill.
    ``bytes_per_entry``/``fixed``: another planner's estimate (the chunked planner's, whose memory
    grows with the microbatches, not the samples); ``remedy``: what the user can do instead."""
    if epochs > MAX_EPOCHS_PER_RUN:
        raise UsageError(f"--epochs {epochs:,} is more than {MAX_EPOCHS_PER_RUN:,} epochs in one run; plan fewer and "
                         "lengthen the plan with `varlen plan --extend PLAN --epochs E`")
    entries = int(entries_per_epoch) * int(epochs)
    per_entry = bytes_per_entry if bytes_per_entry is not None else \
        (PACKED_BYTES_PER_ENTRY if packed else BYTES_PER_ENTRY)
    need = int(entries * per_entry) + int(fixed)
    have = _available_memory()
    if have is not None and need > have:
        raise UsageError(f"the plan would hold {entries:,} sample entries ({epochs:,} epoch(s) of {what}), about "
                         f"{need / 2**30:,.1f} GiB while planning, more than the {have / 2**30:,.1f} GiB of memory "
                         f"available; {remedy}")


def _available_memory() -> int | None:
    """Bytes of memory available now (Linux: MemAvailable), else the physical memory, else None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _rows_per_microbatch(c: PlanConfig, budget: Budget) -> int:
    if c.rows_per_microbatch is not None:
        r = c.rows_per_microbatch
        if budget.max_tokens is not None and not bool(budget.fits(r, c.seq_len)):
            raise UsageError(f"--rows-per-microbatch {r} x --seq-len {c.seq_len} exceeds the budget "
                             f"{budget.describe()}")
        return r
    if budget.max_tokens is None:
        return 1
    r = int(budget.cap(np.array([c.seq_len]))[0])
    if r < 1:
        raise UsageError(f"--seq-len {c.seq_len} does not fit the budget {budget.describe()}")
    return r


def _check_cost_range(c: PlanConfig, budget: Budget, rows_per_mb: int | None) -> None:
    """A packed plan's compute cost (tokens + A sum(l^2)) must stay finite over the whole plan."""
    if c.packing and budget.worst_cost(rows_per_mb, c.seq_len) > COST_LIMIT:
        raise UsageError(f"--attention-cost {budget.attention_cost:g} is too large: a microbatch of {rows_per_mb} "
                         f"row(s) of {c.seq_len:,} tokens would cost {budget.worst_cost(rows_per_mb, c.seq_len):.3g}, "
                         "beyond what float64 sums over a plan hold (A is per squared token; realistic values are "
                         "below 1e-3)")


def _too_long(c: PlanConfig, length: np.ndarray, budget: Budget, shape: ShapeMap, remedies: Remedies) -> np.ndarray:
    """Mask of the samples that cannot fit any microbatch; raises unless --drop-long (or none fits)."""
    if c.packing:
        too_long = (length > c.seq_len) if not c.split_long else np.zeros(len(length), bool)
    else:
        too_long = length > _longest_fitting(length, budget, shape)
    error = too_long_error(c, budget, remedies, int(np.count_nonzero(too_long)), len(length),
                           int(length.max()) if len(length) else 0, int(length.min()) if len(length) else 0)
    if error is not None:
        raise error
    return too_long


def too_long_error(c: PlanConfig, budget: Budget, remedies: Remedies, n_long: int, n: int, longest: int,
                   shortest: int) -> InputError | None:
    """The error for ``n_long`` of ``n`` samples too long for any microbatch (None when that is fine:
    none, or --drop-long and some fit); the chunked planner counts them chunk by chunk."""
    budget_name = budget.describe()
    if n_long and n_long == n:
        if c.packing:
            return InputError(f"--seq-len {c.seq_len:,} is below every sample: the shortest has {shortest:,} tokens")
        return InputError(f"the budget is below every sample: {budget_name} fits none of the {n:,} samples (the "
                          f"shortest has {shortest:,} tokens)")
    if n_long and not c.drop_long:
        if c.packing:
            return InputError(f"{n_long:,} samples are longer than --seq-len {c.seq_len:,} (the longest has "
                              f"{longest:,} tokens); {remedies.too_long_packed}")
        return InputError(f"{n_long:,} samples do not fit the budget {budget_name} (the longest has {longest:,} "
                          f"tokens); raise {budget_name.split()[0]}{remedies.or_drop_long}")
    return None


def _longest_fitting(length: np.ndarray, budget: Budget, shape: ShapeMap) -> int:
    """The longest length (up to the input's longest) one sample of which fits a microbatch, -1 for none.
    Whether one sample fits falls with its length (its T = pad(l) and its cost grow with l), so a
    binary search on the scalar test classifies every sample as the per-sample test would, in one pass."""
    def fits(x: int) -> bool:
        return bool(budget.fits(1, shape.pad(np.array([x], np.int64)))[0])

    lo, hi = -1, max(int(length.max()), 0) if len(length) else 0  # fits(lo) or lo == -1; the answer is <= hi
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def epoch_inputs(c: PlanConfig, rows: Rows, budget: Budget,
                 remedies: Remedies = PLAN_REMEDIES) -> tuple[EpochInputs, np.ndarray]:
    """The sequences epochs start from (long samples removed) and the positions of the long ones.
    Only the input's rows (``rows.base``) enter them; a replan adds its pieces to its first epoch."""
    length = rows.length
    base = length[:rows.base] if rows.base < len(length) else length
    rows_per_mb = _rows_per_microbatch(c, budget) if c.packing else None
    _check_cost_range(c, budget, rows_per_mb)
    shape = ShapeMap(1 if c.packing else c.pad_multiple)
    too_long = _too_long(c, base, budget, shape, remedies)
    n_long = int(np.count_nonzero(too_long))
    ordered = None
    if c.order in CURRICULAR:
        ordered = np.flatnonzero(~too_long) if n_long else np.arange(len(base), dtype=np.int64)
        if c.order == "reverse":
            ordered = ordered[::-1].copy()
    if rows.source is not None:  # a mixture's virtual rows: their own order is the canonical one
        canon = np.arange(rows.base, dtype=np.int32 if rows.base < 1 << 31 else np.int64)
    else:
        canon = canonical_order(rows.sample_id if rows.base == len(length) else rows.sample_id[:rows.base])
    if n_long:  # canon = arange (ids in row order): no gather
        canon = canon[~too_long] if batching.is_identity(canon) else canon[~too_long[canon]]
    if c.num_shapes is not None and not c.packing:
        shape = ShapeMap(c.pad_multiple, choose_edges(shape.pad(length[canon]), c.num_shapes))
    inputs = EpochInputs(c, length, shape, budget, c.dp * c.grad_accum, ordered, canon, rows_per_mb, remedies)
    return inputs, np.flatnonzero(too_long)


@dataclass
class PlannedEpoch:
    mb: Microbatches  # in layout order
    layout: EpochLayout
    cost: np.ndarray  # per microbatch, layout order
    mode: str  # the order this epoch was planned in
    dropped: np.ndarray  # input positions its tail dropped
    packing_stats: dict | None
    schedule_order: dict | None = None  # --schedule: the simulated gain of the step order (schedule/order.py)


def epoch_mode(c: PlanConfig, epoch: int) -> str:
    """The order epoch ``epoch`` is planned in (curriculum epochs, then bucket-shuffle)."""
    if c.curriculum_epochs is not None and epoch >= c.curriculum_epochs:
        return "bucket-shuffle"
    return c.order


def plan_epochs(c: PlanConfig, inputs: EpochInputs, first_epoch: int = 0,
                bar: PlanProgress | None = None) -> tuple[list[PlannedEpoch], int | None]:
    """Every epoch formed by its order's strategy and laid out; also the random order's fixed batch size.
    ``first_epoch``: the number of the first epoch (seed stream, curriculum switch), for ``varlen replan``."""
    formers = Formers()
    epochs = []
    for e in range(first_epoch, first_epoch + c.epochs):
        mode = epoch_mode(c, e)
        rng = np.random.default_rng([c.seed, e])
        if bar is not None:
            bar.phase(f"form epoch {e - first_epoch + 1}/{c.epochs}")
        formed = formers.for_epoch(c, mode).form(inputs, mode, rng)
        if bar is not None:
            bar.phase(f"layout epoch {e - first_epoch + 1}/{c.epochs}")
        epochs.append(lay_out(c, inputs.budget, formed, mode, warmup=c.compile_warmup and e == 0))
    return epochs, formers.random.fixed_batch


def lay_out(c: PlanConfig, budget: Budget, formed, mode: str, warmup: bool) -> PlannedEpoch:
    """Steps x ranks x micro of one epoch's microbatch table (costs balanced across ranks)."""
    mb = formed.mb
    cost = balance.microbatch_cost(mb, budget)
    lay = layout.layout_epoch(mb, cost, c.dp, c.grad_accum, warmup=warmup,
                              same_shape=c.same_shape_per_step or c.packing, static=c.static_shapes,
                              ranked=formed.ranked)
    ordered = None
    if c.schedule is not None:  # schedule-aware order within each step
        from ..schedule.order import reorder_layout

        lay, ordered = reorder_layout(lay, cost, mb.batch_size.astype(np.float64) * mb.seqlen, dp=c.dp,
                                      grad_accum=c.grad_accum, schedule=c.schedule, stages=c.stages)
    return PlannedEpoch(mb.take(lay.order), lay, cost[lay.order], mode, formed.dropped, formed.packing_stats,
                        ordered)
