"""The budget of ``varlen plan``, resolved once from the options (:func:`resolve_budget`): ``max_tokens``
and the attention cost A given (``--max-tokens N --attention-cost 0.00004``), A derived from the
model's shape (``--attention-cost auto --model-dim d --layers L [--vocab-size V]``), or both from a
memory profile (``--memory-profile P --max-memory X``, :mod:`varlen_cli.memory.budget`). Replans
start from the parent's recorded budget instead (:func:`rebudget`).

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

from ..budget import Budget, attention_number, is_auto
from ..errors import UsageError
from .config import PlanConfig

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
        max_tokens, a = budget_for_memory(memory, c.max_memory)
        return Budget(max_tokens, c.max_samples, a, bool(c.packing), "memory", None, memory)
    if is_auto(c.attention_cost):
        model = {"model_dim": c.model_dim, "layers": c.layers, "vocab_size": c.vocab_size or 0,
                 "formula": FLOPS_FORMULA}
        a = flops_attention_cost(c.model_dim, c.layers, c.vocab_size or 0)
        return Budget(c.max_tokens, c.max_samples, a, bool(c.packing), "flops", model)
    return Budget(c.max_tokens, c.max_samples, attention_number(c.attention_cost) or 0.0, bool(c.packing))


def rebudget(parent: Budget, *, max_tokens: int | None = None, max_memory=None, memory_profile: str | None = None,
             memory_margin: float | None = None) -> Budget:
    """A parent plan's budget for ``varlen replan``: unchanged, or with a new ``--max-tokens`` (A and
    any memory limit kept: the limit is re-checked on the new plan), or a new ``--max-memory`` (from
    ``--memory-profile`` or the profile the parent recorded)."""
    if max_tokens is not None and (max_memory is not None or memory_profile is not None):
        raise UsageError("--max-tokens and --max-memory exclude each other (the budget comes from the profile)")
    if max_tokens is not None:
        if max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1 (got {max_tokens})")
        return dataclasses.replace(parent, max_tokens=int(max_tokens),
                                   source="given" if parent.source == "memory" else parent.source)
    if max_memory is None and memory_profile is None:
        return parent
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
    max_tokens, a = budget_for_memory(memory, limit)
    return Budget(max_tokens, parent.max_samples, a, parent.packed, "memory", None, memory)
