"""The budget of ``varlen plan``, resolved once from the options (:func:`resolve_budget`): ``max_tokens``
and the attention cost A given (``--max-tokens N --attention-cost 0.00004``), A derived from the
model's shape (``--attention-cost auto --model-dim d --layers L [--vocab-size V]``), or both from a
memory profile (``--memory-profile P --max-memory X``, :mod:`varlen_cli.memory.budget`). Replans
start from the parent's recorded budget instead (:func:`rebudget`).

The limits the budget sets, also here: the longest sample one microbatch holds (:func:`longest_fitting`),
the rows of a packed microbatch (:func:`rows_per_microbatch`), the range of a packed cost
(:func:`check_cost_range`), the refusal of samples that fit no microbatch (:func:`too_long_error`), and
of a plan too big for this machine's memory (:func:`check_plan_size`, :func:`available_memory`).

A segment of ``l`` tokens costs ``l + A l^2`` in units of "one token through the linear layers".
Forward FLOPs of a decoder-only transformer (a multiply-add counted as 2 FLOPs; the backward pass
is about 2x the forward for both parts, so the ratio is the same for training):

* linear part, per token: ``L x 24 d^2`` (attention projections Q, K, V, O: ``4 x 2 d^2``; MLP with a
  4d hidden size, or a SwiGLU of hidden 8d/3: ``16 d^2``) plus the LM head ``2 d V``;
* attention, per query-key pair: ``L x 4 d`` (``Q K^T``: 2d, ``P V``: 2d); a causal segment of
  ``l`` tokens has ``l (l + 1) / 2 ~ l^2 / 2`` pairs, so ``L x 2 d x l^2``.

Hence ``A = 2 d L / (24 d^2 L + 2 d V) = L / (12 d L + V)``; with ``V = 0`` it is ``1 / (12 d)``
(e.g. d = 4096: A = 1/49,152, attention equals the linear part at l = 49k tokens). This counts
FLOPs, not time: FlashAttention runs below the matmuls' FLOP rate, so a measured A is often larger
(``varlen calibrate`` measures time per step on a grid; when it can record a profile, ``auto`` should
read A from it -- see docs/packing.md).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..budget import COST_LIMIT, Budget, attention_number, is_auto
from ..errors import InputError, UsageError
from .config import PlanConfig
from .layout import Remedies
from .shapes import ShapeMap

FLOPS_FORMULA = "A = 2 d L / (24 d^2 L + 2 d V)"


def flops_attention_cost(model_dim: int, layers: int, vocab_size: int = 0) -> float:
    """``A = 2 d L / (24 d^2 L + 2 d V)``: attention FLOPs per squared segment length over the linear
    FLOPs per token (see the module docstring)."""
    d, n_layers, v = float(model_dim), float(layers), float(vocab_size or 0)
    return 2.0 * d * n_layers / (24.0 * d * d * n_layers + 2.0 * d * v)


def from_cli(value: str) -> float | str:
    """``--attention-cost`` as the CLI reads it: a float when it is a number, else the text ('auto';
    anything else is rejected by :func:`varlen_cli.plan.config.check` in one line)."""
    try:
        return float(value)
    except ValueError:
        return value


def resolve_budget(c: PlanConfig) -> Budget:
    """The plan's budget from its (checked) options: the one place ``max_tokens`` and A are derived
    (a number, ``auto``, or a memory profile and ``--max-memory``)."""
    if c.max_memory is not None:
        from ..memory.budget import budget_for_memory, memory_limit

        memory = memory_limit(c.memory_profile, c.max_memory, c.memory_margin)
        max_tokens, a = budget_for_memory(memory, c.max_memory, c.allow_memory_extrapolation)
        return Budget(max_tokens, c.max_samples, a, bool(c.packing), "memory", None, memory)
    if is_auto(c.attention_cost):
        model = {"model_dim": c.model_dim, "layers": c.layers, "vocab_size": c.vocab_size or 0,
                 "formula": FLOPS_FORMULA}
        a = flops_attention_cost(c.model_dim, c.layers, c.vocab_size or 0)
        return Budget(c.max_tokens, c.max_samples, a, bool(c.packing), "flops", model,
                      max_target_tokens=c.max_target_tokens)
    return Budget(c.max_tokens, c.max_samples, attention_number(c.attention_cost) or 0.0, bool(c.packing),
                  max_target_tokens=c.max_target_tokens)


def rebudget(parent: Budget, *, max_tokens: int | None = None, max_memory=None, memory_profile: str | None = None,
             memory_margin: float | None = None, allow_memory_extrapolation: bool = False) -> Budget:
    """A parent plan's budget for ``varlen replan``: unchanged, or with a new ``--max-tokens`` (A and
    any memory limit kept: the limit is re-checked on the new plan), or a new ``--max-memory`` (from
    ``--memory-profile`` or the profile the parent recorded; refused beyond the profile's measured
    range unless ``allow_memory_extrapolation``, as in :func:`resolve_budget`)."""
    if max_tokens is not None and (max_memory is not None or memory_profile is not None):
        raise UsageError("--max-tokens and --max-memory exclude each other (the budget comes from the profile)")
    if allow_memory_extrapolation and max_memory is None and memory_profile is None:
        raise UsageError("--allow-memory-extrapolation applies to a new --max-memory (or --memory-profile)")
    if max_tokens is not None:
        if max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1 (got {max_tokens})")
        return dataclasses.replace(parent, max_tokens=int(max_tokens),
                                   source="given" if parent.source == "memory" else parent.source)
    if max_memory is None and memory_profile is None:
        return parent
    if parent.two_sided:
        raise UsageError("--max-memory does not apply to a plan with --max-target-tokens (a memory profile is "
                         "measured on one sequence); give --max-tokens")
    from ..memory.budget import budget_for_memory, memory_limit
    from ..memory.sizes import parse_size

    recorded = parent.memory or {}
    if memory_profile is None and not recorded.get("profile"):
        raise UsageError("--max-memory needs --memory-profile (the plan records no memory profile)")
    if max_memory is None and "max_memory" not in recorded:
        raise UsageError("--memory-profile needs --max-memory (the plan records no memory limit)")
    margin = float(recorded.get("margin", 0.05) if memory_margin is None else memory_margin)
    if not 0 <= margin < 1:
        raise UsageError(f"--memory-margin must be in [0, 1) (got {margin})")
    limit = max_memory if max_memory is not None else recorded["max_memory"]
    if memory_profile is not None:
        memory = memory_limit(memory_profile, limit, margin)
    else:
        memory = {**recorded, "max_memory": parse_size(limit), "margin": margin, "given": str(limit)}
    max_tokens, a = budget_for_memory(memory, limit, allow_memory_extrapolation)
    return Budget(max_tokens, parent.max_samples, a, parent.packed, "memory", None, memory)


# -- the limits the budget sets ---------------------------------------------------------------------
def rows_per_microbatch(c: PlanConfig, budget: Budget) -> int:
    """R, the packed rows of a microbatch: ``--rows-per-microbatch`` (checked against the budget), else
    as many rows of ``--seq-len`` as the budget holds (1 without ``--max-tokens``)."""
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


def check_cost_range(c: PlanConfig, budget: Budget, rows_per_mb: int | None) -> None:
    """A packed plan's compute cost (tokens + A sum(l^2)) must stay finite over the whole plan."""
    if c.packing and budget.worst_cost(rows_per_mb, c.seq_len) > COST_LIMIT:
        raise UsageError(f"--attention-cost {budget.attention_cost:g} is too large: a microbatch of {rows_per_mb} "
                         f"row(s) of {c.seq_len:,} tokens would cost {budget.worst_cost(rows_per_mb, c.seq_len):.3g}, "
                         "beyond what float64 sums over a plan hold (A is per squared token; realistic values are "
                         "below 1e-3)")


def longest_fitting(length: np.ndarray, budget: Budget, shape: ShapeMap) -> int:
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


def too_long_error(c: PlanConfig, budget: Budget, remedies: Remedies, n_long: int, n: int, longest: int,
                   shortest: int, longest_target: int = 0) -> InputError | None:
    """The error for ``n_long`` of ``n`` samples too long for any microbatch (None when that is fine:
    none, or --drop-long and some fit); the chunked planner counts them chunk by chunk. Under two budgets
    a sample is too long when either side fits no microbatch (``longest_target``: the longest target)."""
    budget_name = budget.describe()
    if budget.two_sided and n_long and (n_long == n or not c.drop_long):
        what = "none of the" if n_long == n else f"{n_long:,} of the"
        return InputError(f"the budgets {budget_name} fit {what} {n:,} samples (the longest has {longest:,} tokens, "
                          f"the longest target {longest_target:,}); raise --max-tokens or --max-target-tokens"
                          + (remedies.or_drop_long if n_long < n else ""))
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


MAX_EPOCHS_PER_RUN = 100_000
"""Epochs one run plans at most: each costs about a millisecond of fixed work however few its samples
(more: ``varlen plan --extend`` lengthens a plan)."""
FEWER_EPOCHS = "plan fewer epochs (lengthen the plan later with `varlen plan --extend`)"


def check_plan_size(entries_per_epoch: int, epochs: int, what: str, bytes_per_entry: float, fixed: int = 0,
                    remedy: str = FEWER_EPOCHS) -> None:
    """Refuse, before any work, a plan that would not fit in this machine's memory (``bytes_per_entry``
    per sample entry of every epoch, plus ``fixed``: an estimate) or would take thousands of epochs of
    fixed work: one line instead of a stall or an out-of-memory kill. ``remedy``: what the user can do."""
    if epochs > MAX_EPOCHS_PER_RUN:
        raise UsageError(f"--epochs {epochs:,} is more than {MAX_EPOCHS_PER_RUN:,} epochs in one run; plan fewer and "
                         "lengthen the plan with `varlen plan --extend PLAN --epochs E`")
    entries = int(entries_per_epoch) * int(epochs)
    need = int(entries * bytes_per_entry) + int(fixed)
    have = available_memory()
    if have is not None and need > have:
        raise UsageError(f"the plan would hold {entries:,} sample entries ({epochs:,} epoch(s) of {what}), about "
                         f"{need / 2**30:,.1f} GiB while planning, more than the {have / 2**30:,.1f} GiB of memory "
                         f"available; {remedy}")


def available_memory() -> int | None:
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
