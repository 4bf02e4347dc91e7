"""Per-step learning-rate scales: lr_scale = b / base (linear), sqrt(b / base) (sqrt) or 1 (none).

b is what ``--lr-scale-by`` counts in the step: ``loss-tokens`` (the default) the targets the step's
mean token loss averages over (``step_loss_tokens``), ``tokens`` its real tokens (those that carry
loss with ``--target-length``), ``samples`` its completed samples. The loader's loss is the exact
mean over the step's loss tokens, so the gradient's scale does not depend on the step's size and its
noise falls with its loss tokens: the linear rule over loss tokens keeps the LR per loss token
constant, and under a token budget (steps of near-constant tokens) lr_scale stays about 1. Scaling
by samples instead swings the LR with the samples per step (tens of times within one plan of
variable lengths): it suits a loss averaged per sample."""

from __future__ import annotations

import numpy as np

from .. import format
from ..runtime.choices import LrScaleBy, LrScaling, values

SCALINGS = values(LrScaling)  # the options' own choices (varlen plan --lr-scaling / --lr-scale-by)
SCALE_BY = values(LrScaleBy)


def lr_scales(step_samples: np.ndarray, step_tokens: np.ndarray, step_loss_tokens: np.ndarray, scaling: str,
              scale_by: str, base: float | None) -> tuple[np.ndarray, float]:
    """(lr_scale per step, the base used). The base defaults to the mean step size in the same unit."""
    b = np.asarray({"loss-tokens": step_loss_tokens, "tokens": step_tokens}.get(scale_by, step_samples),
                   dtype=np.float64)
    if base is None:
        base = float(b.mean()) if len(b) else 1.0
    base = float(base)
    if scaling == "none" or base == 0:  # base 0: only empty samples; nothing to scale by
        return np.ones(len(b), np.float64), base
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # a tiny base: inf, refused by the caller
        ratio = b / base
    return (np.sqrt(ratio) if scaling == "sqrt" else ratio), base


UNITS = {"loss-tokens": "loss tokens", "tokens": "tokens", "samples": "samples"}
STEP_COLUMNS = {"loss-tokens": "step_loss_tokens", "tokens": "step_tokens", "samples": "step_samples"}


def step_column(meta: dict) -> str:
    """The plan column that holds each step's b (what :func:`lr_scales` divided by the base) for a plan's
    metadata ``meta``: ``--lr-scale-by tokens`` of an input with ``target_length`` counts the loss tokens;
    plans made before ``lr_scale_by`` was recorded scale by samples."""
    by = meta.get("lr_scale_by") or "samples"
    if by == "tokens" and meta.get("loss_tokens") == format.TARGET_LENGTH_COLUMN:
        return "step_loss_tokens"
    return STEP_COLUMNS.get(by, "step_samples")


def describe(meta: dict) -> str:
    """What a plan's lr_scale means, in words (``varlen inspect``): the rule, the base and the range."""
    mode, by, base = meta.get("lr_scaling", "none"), meta.get("lr_scale_by", "samples"), meta.get("base_batch_size")
    stats = meta.get("stats") or {}
    lo, hi = stats.get("lr_scale_min"), stats.get("lr_scale_max")
    seen = f"; {lo:.3g} to {hi:.3g} in this plan" if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) \
        else ""
    if mode == "none" or not base:
        return "1 at every step: the trainer's LR as it is" + seen
    unit = UNITS.get(by, by)
    rule = f"{unit} of the step / {base:,.6g}"
    rule = rule if mode == "linear" else f"sqrt({rule})"
    why = ("; the loss is their mean, so about 1 under a token budget" if by == "loss-tokens" else
           "; swings with the samples per step: for a loss averaged per sample" if by == "samples" else "")
    return f"your LR x {rule} (1 at a step of {base:,.6g} {unit}{why}){seen}"
