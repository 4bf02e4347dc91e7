"""Per-step figures for the trackers (TensorBoard, W&B, trackio, DeepSpeed's monitor, ...): what the
plan says of the optimizer step a batch belongs to, known on every rank without a collective.

A plan row holds one rank's microbatch; the step's figures across ranks (padded tokens, the
straggler, per-rank real tokens) come from the plan file, read once per window of steps
(:class:`StepFigureTable`, scalar columns only, vectorised: :func:`varlen_cli.format.step_figures`,
the same code ``varlen inspect`` and ``varlen report`` use). :meth:`Plan.microbatch
<varlen_cli.loader.Plan.microbatch>` attaches the step's :class:`StepFigures` to every microbatch,
so the collated batch carries them (``batch["info"].figures``) and :func:`plan_metrics` turns them
into the dict any logger takes. Imports numpy and pyarrow only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import format
from ..errors import PlanError

WINDOW_ROWS = 1 << 16  # plan rows (microbatches) whose figures are computed at a time
COLUMNS = ("step", "rank", "tokens", "batch_size", "seqlen", "num_samples", "lr_scale", "step_samples")


@dataclass(frozen=True)
class StepFigures:
    """One optimizer step of a plan, over all its ranks and microbatches."""

    step: int  # the plan's global step
    tokens: int  # real tokens
    padded_tokens: int  # B x T summed over the step's microbatches
    samples: int  # samples the step completes (the plan's step_samples, what lr_scale counts)
    lr_scale: float
    straggler: float  # the busiest rank's cost / the mean rank's (the plan's budget); 1.0 balanced
    seqlen_max: int  # the largest padded T of the step
    rank_tokens_min: int  # real tokens per rank: the least, the most and the mean
    rank_tokens_max: int
    rank_tokens_mean: float

    @property
    def padding_pct(self) -> float:
        return 100.0 * (1.0 - self.tokens / self.padded_tokens) if self.padded_tokens > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """The figures under their tracker names: ``varlen/*`` and verl's ``global_seqlen/*`` (per-rank
        real tokens)."""
        return {
            "varlen/tokens": float(self.tokens), "varlen/padded_tokens": float(self.padded_tokens),
            "varlen/padding_pct": self.padding_pct, "varlen/samples": float(self.samples),
            "varlen/lr_scale": self.lr_scale, "varlen/straggler": self.straggler,
            "varlen/seqlen_max": float(self.seqlen_max),
            "global_seqlen/min": float(self.rank_tokens_min), "global_seqlen/max": float(self.rank_tokens_max),
            "global_seqlen/mean": self.rank_tokens_mean,
            "global_seqlen/minmax_diff": float(self.rank_tokens_max - self.rank_tokens_min),
        }


METRIC_NAMES = tuple(StepFigures(0, 0, 0, 0, 0.0, 1.0, 0, 0, 0, 0.0).metrics())


class StepFigureTable:
    """The :class:`StepFigures` of a plan file's steps, computed window by window (up to
    :data:`WINDOW_ROWS` rows of whole steps from the step asked for; the window in use is kept)."""

    def __init__(self, parquet, meta: dict):
        self.pf = parquet
        self.budget = format.plan_budget(meta)
        self.dp, self.accum = int(meta["dp"]), int(meta["grad_accum"])
        self.num_steps = int(meta["num_steps"])
        md = parquet.metadata
        self.first_rows = np.concatenate([[0], np.cumsum([md.row_group(g).num_rows
                                                          for g in range(md.num_row_groups)])]).astype(np.int64)
        self.lo = self.hi = 0
        self.arrays: dict = {}
        self.cache: dict = {}  # step -> StepFigures, for the window in use

    def figures(self, step: int) -> StepFigures:
        """The figures of global ``step`` (one object a step, shared by its microbatches)."""
        cached = self.cache.get(step)
        if cached is not None:
            return cached
        if not 0 <= step < self.num_steps:
            raise PlanError(f"step {step} is out of range: the plan has {self.num_steps} steps")
        if not self.lo <= step < self.hi:
            self._load(step)
        self.cache[step] = self._make(step)
        return self.cache[step]

    def _make(self, step: int) -> StepFigures:
        a, i = self.arrays, step - self.lo
        return StepFigures(step=step, tokens=int(a["tokens"][i]), padded_tokens=int(a["padded_tokens"][i]),
                           samples=int(a["step_samples"][i]), lr_scale=float(a["lr_scale"][i]),
                           straggler=float(a["straggler"][i]), seqlen_max=int(a["seqlen_max"][i]),
                           rank_tokens_min=int(a["rank_tokens_min"][i]), rank_tokens_max=int(a["rank_tokens_max"][i]),
                           rank_tokens_mean=float(a["rank_tokens_mean"][i]))

    def _load(self, step: int) -> None:
        per_step = self.dp * self.accum
        lo, hi = step, min(self.num_steps, step + max(1, WINDOW_ROWS // per_step))
        first, last = lo * per_step, hi * per_step  # rows
        groups = list(range(int(np.searchsorted(self.first_rows, first, side="right")) - 1,
                            int(np.searchsorted(self.first_rows, last, side="left"))))
        columns = list(dict.fromkeys(COLUMNS + tuple(format.plan_cost_columns(self.budget))))
        table = self.pf.read_row_groups(groups, columns=columns)
        table = table.slice(first - int(self.first_rows[groups[0]]), last - first)
        c = {name: table.column(name).to_numpy() for name in COLUMNS}
        local = c["step"].astype(np.int64) - lo
        if len(local) != last - first or np.any(local != np.arange(last - first) // per_step):
            raise PlanError(f"the plan's rows are not in (step, rank, micro) order around step {step}")
        cost = format.table_cost(table, self.budget)  # the plan's budget: the straggler of its statistics
        fig = format.step_figures(local, c["rank"].astype(np.int64), c, cost, self.dp)
        fig["step_samples"] = c["step_samples"][::per_step]
        fig["lr_scale"] = c["lr_scale"][::per_step]
        self.lo, self.hi, self.arrays, self.cache = lo, hi, fig, {}


def _figures_of(batch) -> StepFigures:
    info = batch.get("info") if isinstance(batch, dict) else batch
    figures = getattr(info, "figures", None)
    if figures is None:
        raise PlanError("this batch carries no plan figures: collate it with varlen's PadCollate or PackedCollate "
                        "over a plan's loader (dataloader_for_plan)")
    return figures


def plan_metrics(batch) -> dict[str, float]:
    """The figures of the optimizer step ``batch`` belongs to (a collated batch, or its ``info``), for
    any logger, once per optimizer step: ``varlen/tokens``, ``varlen/padded_tokens``,
    ``varlen/padding_pct``, ``varlen/samples``, ``varlen/lr_scale``, ``varlen/straggler``,
    ``varlen/seqlen_max`` and ``global_seqlen/min``, ``max``, ``mean``, ``minmax_diff`` (the real
    tokens each rank runs in the step). Every rank gets the same values, from the plan (no collective)."""
    return _figures_of(batch).metrics()


def plan_metric_events(batch, step: int) -> list[tuple[str, float, int]]:
    """:func:`plan_metrics` as DeepSpeed monitor events ``(name, value, step)``, for
    ``engine.monitor.write_events(plan_metric_events(batch, engine.global_steps))`` after
    ``engine.step()`` (the DeepSpeed integration's hook)."""
    return [(name, value, int(step)) for name, value in plan_metrics(batch).items()]
