"""Summary statistics of a plan: stored in the metadata and printed by the CLI."""

from __future__ import annotations

import numpy as np


def straggler(step: np.ndarray, rank: np.ndarray, cost: np.ndarray, dp: int) -> np.ndarray:
    """Per step: the busiest rank's cost / the mean rank cost (1.0 = balanced)."""
    if not len(step):
        return np.zeros(0)
    steps = int(step.max()) + 1
    load = np.bincount(step * dp + rank, weights=cost, minlength=steps * dp).reshape(steps, dp)
    mean = load.mean(axis=1)
    return np.where(mean > 0, load.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)


def summary(*, num_steps: int, num_microbatches: int, samples: int, tokens: int, padded_tokens: int,
            budget_tokens: float, strag: np.ndarray, shapes: int, lr: np.ndarray, dropped: int,
            over_budget: int, warmup_steps: int, epochs: int, samples_per_epoch: list, seconds: float) -> dict:
    return {
        "steps": int(num_steps),
        "microbatches": int(num_microbatches),
        "samples": int(samples),
        "samples_per_epoch": [int(x) for x in samples_per_epoch],
        "tokens": int(tokens),
        "padded_tokens": int(padded_tokens),
        "padding_pct": 100.0 * (1 - tokens / padded_tokens) if padded_tokens else 0.0,
        "budget_fill_pct": 100.0 * tokens / (num_microbatches * budget_tokens) if num_microbatches and budget_tokens else 0.0,
        "mean_samples_per_microbatch": samples / num_microbatches if num_microbatches else 0.0,
        "straggler_mean": float(strag.mean()) if len(strag) else 1.0,
        "straggler_max": float(strag.max()) if len(strag) else 1.0,
        "distinct_shapes": int(shapes),
        "lr_scale_min": float(lr.min()) if len(lr) else 1.0,
        "lr_scale_max": float(lr.max()) if len(lr) else 1.0,
        "dropped": int(dropped),
        "over_budget_microbatches": int(over_budget),
        "warmup_steps": int(warmup_steps),
        "epochs": int(epochs),
        "seconds": float(seconds),
    }


def print_summary(result) -> None:
    """The rich table ``varlen plan`` prints at the end."""
    from rich.table import Table

    from ..report import _fmt, console

    s = result.stats
    t = Table(title=f"varlen plan → {result.output}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    rows = [
        ("order", result.order), ("epochs", s["epochs"]), ("steps", s["steps"]),
        ("microbatches", s["microbatches"]), ("samples", s["samples"]), ("tokens", s["tokens"]),
        ("samples / microbatch", s["mean_samples_per_microbatch"]),
        ("padding %", f"{s['padding_pct']:.2f}"), ("budget fill %", f"{s['budget_fill_pct']:.2f}"),
        ("straggler mean / max", f"{s['straggler_mean']:.3f} / {s['straggler_max']:.3f}"),
        ("distinct shapes", s["distinct_shapes"]),
        ("lr_scale min / max", f"{s['lr_scale_min']:.3f} / {s['lr_scale_max']:.3f}"),
        ("dropped samples", s["dropped"]),
    ]
    if s.get("warmup_steps"):
        rows.append(("compile warm-up steps", s["warmup_steps"]))
    if result.packing:
        rows.append(("packing efficiency %", f"{100 * result.packing['efficiency']:.3f}"))
    if result.metadata.get("memory"):
        from ..memory.budget import memory_rows

        rows += memory_rows(result.metadata)
    rows.append(("seconds", s["seconds"]))
    for label, value in rows:
        t.add_row(label, _fmt(value))
    console().print(t)
