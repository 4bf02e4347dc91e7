"""The options of one step's plan, checked once (:class:`StepSpec`): the planner's own budget
(:func:`varlen_cli.plan.cost_model.resolve_budget` on a :class:`~varlen_cli.plan.config.PlanConfig`),
the padded shapes and, for packed rows, the rows of a microbatch. Every bad value is one
:class:`~varlen_cli.errors.UsageError` line naming the keyword."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import format
from ..budget import Budget, attention_number
from ..errors import UsageError
from ..plan import cost_model
from ..plan.config import MAX_TOKENS_LIMIT, PlanConfig
from ..plan.lr import SCALE_BY, SCALINGS
from ..plan.shapes import ShapeMap


def _count(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= format.INT32_MAX:
        raise UsageError(f"{name} must be an integer between 1 and {format.INT32_MAX:,} (got {value!r})")


@dataclass(frozen=True)
class StepSpec:
    """What a step is planned under (see :func:`varlen_cli.online.plan_step` for each field)."""

    dp: int
    budget: Budget
    shape: ShapeMap
    seq_len: int | None = None  # packed rows of seq_len tokens (None: padded microbatches)
    rows_per_mb: int = 1  # packed: R rows per microbatch
    num_microbatches: int | None = None
    max_per_row: int | None = None
    split: bool = False
    lr_scaling: str = "none"
    lr_scale_by: str = "loss-tokens"
    base_batch_size: float | None = None

    @property
    def packed(self) -> bool:
        return self.seq_len is not None

    @property
    def microbatch_tokens(self) -> int:
        """The tokens one microbatch holds at most (R x seq_len packed; max_tokens padded)."""
        return self.rows_per_mb * self.seq_len if self.packed else int(self.budget.max_tokens)

    def describe(self) -> str:
        """The budget, for messages."""
        a = f" with attention_cost {self.budget.attention_cost:g}" if self.budget.attention_cost else ""
        if self.packed:
            return f"packed rows of seq_len {self.seq_len:,}{a}"
        cap = f", max_samples {self.budget.max_samples:,}" if self.budget.max_samples else ""
        return f"max_tokens {self.budget.max_tokens:,}{a}{cap}"


def make_spec(*, dp, max_tokens=None, seq_len=None, num_microbatches=None, attention_cost=0.0, max_samples=None,
              pad_multiple=1, lr_scaling="none", base_batch_size=None, lr_scale_by="loss-tokens", split=False,
              max_per_row=None) -> StepSpec:
    """The checked :class:`StepSpec` of :func:`varlen_cli.online.plan_step`'s keywords."""
    _count("dp", dp, allow_none=False)
    for name, value in (("num_microbatches", num_microbatches), ("max_samples", max_samples),
                        ("pad_multiple", pad_multiple), ("seq_len", seq_len), ("max_per_row", max_per_row)):
        _count(name, value)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or \
                not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise UsageError(f"max_tokens must be an integer between 1 and 2^53 (got {max_tokens!r})")
    if seq_len is None:
        if max_tokens is None:
            raise UsageError("plan_step needs max_tokens (padded microbatches) or seq_len (packed rows)")
        for name, value in (("split", split), ("max_per_row", max_per_row)):
            if value:
                raise UsageError(f"{name} applies to packed rows (seq_len); a padded microbatch holds whole samples")
    else:
        if max_samples is not None:
            raise UsageError("max_samples does not apply to packed rows (seq_len); use max_per_row")
        if pad_multiple != 1:
            raise UsageError("pad_multiple does not apply to packed rows (seq_len): a packed row has one shape")
    if isinstance(attention_cost, bool) or attention_number(attention_cost) is None or \
            isinstance(attention_cost, str):
        raise UsageError(f"attention_cost must be a finite number >= 0 (got {attention_cost!r})")
    if lr_scaling not in SCALINGS:
        raise UsageError(f"lr_scaling must be one of {', '.join(SCALINGS)} (got {lr_scaling!r})")
    if lr_scale_by not in SCALE_BY:
        raise UsageError(f"lr_scale_by must be one of {', '.join(SCALE_BY)} (got {lr_scale_by!r})")
    if lr_scaling != "none" and base_batch_size is None:
        raise UsageError(f"lr_scaling {lr_scaling!r} needs base_batch_size (the step size at which lr_scale is 1)")
    if base_batch_size is not None and not (isinstance(base_batch_size, (int, float, np.number))
                                            and math.isfinite(base_batch_size) and base_batch_size > 0):
        raise UsageError(f"base_batch_size must be a finite number > 0 (got {base_batch_size!r})")
    config = PlanConfig(input="", output="", max_tokens=None if max_tokens is None else int(max_tokens), dp=int(dp),
                        max_samples=max_samples, attention_cost=float(attention_cost), packing=seq_len is not None,
                        seq_len=seq_len, pad_multiple=int(pad_multiple))
    budget = cost_model.resolve_budget(config)  # the planner's one budget
    if seq_len is None and not bool(budget.fits(1, pad_multiple)):
        raise UsageError(f"max_tokens {max_tokens:,} holds no microbatch: one row of pad_multiple {pad_multiple} "
                         "tokens exceeds it")
    rows = 1
    if seq_len is not None:
        rows = cost_model.rows_per_microbatch(config, budget)
        cost_model.check_cost_range(config, budget, rows)
    return StepSpec(int(dp), budget, ShapeMap(int(pad_multiple)), None if seq_len is None else int(seq_len), rows,
                    None if num_microbatches is None else int(num_microbatches),
                    None if max_per_row is None else int(max_per_row), bool(split), lr_scaling, lr_scale_by,
                    None if base_batch_size is None else float(base_batch_size))
