"""The epoch pipeline's first stages: the inputs every epoch starts from (:func:`epoch_inputs`:
samples too long for any microbatch set aside, the canonical and curriculum orders, the shape map)
and the epochs themselves (:func:`plan_epochs`: microbatches formed by the order's former
(:mod:`.orders`), then laid out as steps x ranks x micro (:mod:`.layout`))."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError, UsageError
from . import balance, batching, layout
from .batching import Microbatches
from .config import PlanConfig
from .layout import EpochLayout
from .orders import CURRICULAR, EpochInputs, Formers
from .progress import PlanProgress
from .reader import canonical_order
from .shapes import Budget, ShapeMap, choose_edges


def _rows_per_microbatch(c: PlanConfig, budget: Budget) -> int:
    if c.rows_per_microbatch is not None:
        r = c.rows_per_microbatch
        if c.max_tokens is not None and not bool(budget.fits(r, c.seq_len)):
            raise UsageError(f"--rows-per-microbatch {r} x --seq-len {c.seq_len} exceeds the budget "
                             f"--max-tokens {c.max_tokens}")
        return r
    if c.max_tokens is None:
        return 1
    r = int(budget.cap(np.array([c.seq_len]))[0])
    if r < 1:
        raise UsageError(f"--seq-len {c.seq_len} does not fit the budget --max-tokens {c.max_tokens}")
    return r



def _too_long(c: PlanConfig, length: np.ndarray, budget: Budget, shape: ShapeMap) -> np.ndarray:
    """Mask of the samples that cannot fit any microbatch; raises unless --drop-long (or none fits)."""
    if c.packing:
        too_long = (length > c.seq_len) if not c.split_long else np.zeros(len(length), bool)
    else:
        too_long = length > _longest_fitting(length, budget, shape)
    n_long = int(np.count_nonzero(too_long))
    budget_name = (f"--max-memory {c.max_memory} (max_tokens {c.max_tokens:,} from the profile)" if c.max_memory
                   else f"--max-tokens {c.max_tokens:,}" if c.max_tokens is not None else "")
    if n_long == len(length):
        if c.packing:
            raise InputError(f"--seq-len {c.seq_len:,} is below every sample: the shortest has "
                             f"{int(length.min()):,} tokens")
        raise InputError(f"the budget is below every sample: {budget_name} fits none of the "
                         f"{len(length):,} samples (the shortest has {int(length.min()):,} tokens)")
    if n_long and not c.drop_long:
        longest = int(length.max())
        if c.packing:
            raise InputError(f"{n_long:,} samples are longer than --seq-len {c.seq_len:,} (the longest has "
                             f"{longest:,} tokens); pass --split-long, --drop-long or a larger --seq-len")
        raise InputError(f"{n_long:,} samples do not fit the budget {budget_name} (the longest has "
                         f"{longest:,} tokens); raise {budget_name.split()[0]} or pass --drop-long")
    return too_long


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


def epoch_inputs(c: PlanConfig, sample_id: np.ndarray, length: np.ndarray,
                  budget: Budget) -> tuple[EpochInputs, np.ndarray]:
    """The sequences epochs start from (long samples removed) and the positions of the long ones."""
    rows_per_mb = _rows_per_microbatch(c, budget) if c.packing else None
    shape = ShapeMap(1 if c.packing else c.pad_multiple)
    too_long = _too_long(c, length, budget, shape)
    n_long = int(np.count_nonzero(too_long))
    ordered = None
    if c.order in CURRICULAR:
        ordered = np.flatnonzero(~too_long) if n_long else np.arange(len(length), dtype=np.int64)
        if c.order == "reverse":
            ordered = ordered[::-1].copy()
    canon = canonical_order(sample_id)
    if n_long:  # canon = arange (ids in row order): no gather
        canon = canon[~too_long] if batching.is_identity(canon) else canon[~too_long[canon]]
    if c.num_shapes is not None and not c.packing:
        shape = ShapeMap(c.pad_multiple, choose_edges(shape.pad(length[canon]), c.num_shapes))
    inputs = EpochInputs(c, length, shape, budget, c.dp * c.grad_accum, ordered, canon, rows_per_mb)
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


def plan_epochs(c: PlanConfig, inputs: EpochInputs, first_epoch: int = 0,
                 bar: PlanProgress | None = None) -> tuple[list[PlannedEpoch], int | None]:
    """Every epoch formed by its order's strategy and laid out; also the random order's fixed batch size.
    ``first_epoch``: the number of the first epoch (seed stream, curriculum switch), for ``varlen replan``."""
    formers = Formers()
    epochs = []
    for e in range(first_epoch, first_epoch + c.epochs):
        mode = c.order
        if c.curriculum_epochs is not None and e >= c.curriculum_epochs:
            mode = "bucket-shuffle"
        rng = np.random.default_rng([c.seed, e])
        if bar is not None:
            bar.phase(f"form epoch {e - first_epoch + 1}/{c.epochs}")
        formed = formers.for_epoch(c, mode).form(inputs, mode, rng)
        mb = formed.mb
        cost = (balance.microbatch_cost(mb, inputs.budget.attention_cost) if c.packing else
                np.asarray(inputs.budget.cost(mb.batch_size, mb.seqlen), dtype=np.float64))
        if bar is not None:
            bar.phase(f"layout epoch {e - first_epoch + 1}/{c.epochs}")
        lay = layout.layout_epoch(mb, cost, c.dp, c.grad_accum, warmup=c.compile_warmup and e == 0,
                                  same_shape=c.same_shape_per_step or c.packing, static=c.static_shapes,
                                  ranked=formed.ranked)
        ordered = None
        if c.schedule is not None:  # schedule-aware order within each step
            from ..schedule.order import reorder_layout

            lay, ordered = reorder_layout(lay, cost, mb.batch_size.astype(np.float64) * mb.seqlen, dp=c.dp,
                                          grad_accum=c.grad_accum, schedule=c.schedule, stages=c.stages)
        epochs.append(PlannedEpoch(mb.take(lay.order), lay, cost[lay.order], mode, formed.dropped,
                                   formed.packing_stats, ordered))
    return epochs, formers.random.fixed_batch
