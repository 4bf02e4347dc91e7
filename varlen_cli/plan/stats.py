"""Summary statistics of a plan: stored in the metadata and printed by the CLI."""

from __future__ import annotations

import numpy as np


def summary(*, num_steps: int, num_microbatches: int, samples: int, tokens: int, padded_tokens: int,
            budget_tokens: float, strag: np.ndarray | tuple, shapes: int, lr: np.ndarray | tuple, dropped: int,
            over_budget: int, warmup_steps: int, epochs: int, samples_per_epoch: list, seconds: float) -> dict:
    """``strag``: the per-step straggler (or its (mean, max) over steps, summed part by part:
    :mod:`.totals`); ``lr``: the per-step LR scales (or their (min, max))."""
    strag_mean, strag_max = strag if isinstance(strag, tuple) else (
        (float(strag.mean()), float(strag.max())) if len(strag) else (1.0, 1.0))
    lr_min, lr_max = lr if isinstance(lr, tuple) else ((float(lr.min()), float(lr.max())) if len(lr) else (1.0, 1.0))
    return {
        "steps": int(num_steps),
        "microbatches": int(num_microbatches),
        "samples": int(samples),
        "samples_per_epoch": [int(x) for x in samples_per_epoch],
        "tokens": int(tokens),
        "padded_tokens": int(padded_tokens),
        "padding_pct": 100.0 * (1 - tokens / padded_tokens) if padded_tokens else 0.0,
        "budget_fill_pct": (100.0 * tokens / (num_microbatches * budget_tokens)
                            if num_microbatches and budget_tokens else 0.0),
        "mean_samples_per_microbatch": samples / num_microbatches if num_microbatches else 0.0,
        "straggler_mean": float(strag_mean),
        "straggler_max": float(strag_max),
        "distinct_shapes": int(shapes),
        "lr_scale_min": float(lr_min),
        "lr_scale_max": float(lr_max),
        "dropped": int(dropped),
        "over_budget_microbatches": int(over_budget),
        "warmup_steps": int(warmup_steps),
        "epochs": int(epochs),
        "seconds": float(seconds),
    }


def target_summary(targets: int, target_padded: int) -> dict:
    """A two-budget plan's target side in its summary: the padded B x T_target and the padding in it."""
    return {"target_padded_tokens": int(target_padded),
            "target_padding_pct": 100.0 * (1 - targets / target_padded) if target_padded else 0.0}
