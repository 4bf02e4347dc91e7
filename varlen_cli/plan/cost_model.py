"""The attention cost A of ``varlen plan``: given (``--attention-cost 0.00004``) or derived from the
model's shape (``--attention-cost auto --model-dim d --layers L [--vocab-size V]``).

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

from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    from .config import PlanConfig

AUTO = "auto"


def flops_attention_cost(model_dim: int, layers: int, vocab_size: int = 0) -> float:
    """``A = 2 d L / (24 d^2 L + 2 d V)``: attention FLOPs per squared segment length over the linear
    FLOPs per token (see the module docstring)."""
    d, n_layers, v = float(model_dim), float(layers), float(vocab_size or 0)
    return 2.0 * d * n_layers / (24.0 * d * d * n_layers + 2.0 * d * v)


def _number(value) -> float:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise UsageError(f"--attention-cost must be a number >= 0 or 'auto' (got {value!r})") from None
    return float(value)


def from_cli(value: str) -> float | str:
    """``--attention-cost`` as the CLI reads it: a float when it is a number, else the text ('auto';
    anything else is rejected by :func:`check` in one line)."""
    try:
        return float(value)
    except ValueError:
        return value


def check(c: PlanConfig) -> None:
    """One-line UsageErrors for a bad ``--attention-cost`` / ``--model-dim`` / ``--layers`` / ``--vocab-size``."""
    for name, value in (("--model-dim", c.model_dim), ("--layers", c.layers)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1 (got {value})")
    if c.vocab_size is not None and c.vocab_size < 0:
        raise UsageError(f"--vocab-size must be >= 0 (got {c.vocab_size})")
    if isinstance(c.attention_cost, str) and c.attention_cost.strip().lower() == AUTO:
        if c.model_dim is None or c.layers is None:
            raise UsageError("--attention-cost auto needs --model-dim and --layers (the model's shape)")
        return
    if c.model_dim is not None or c.layers is not None or c.vocab_size is not None:
        raise UsageError("--model-dim, --layers and --vocab-size need --attention-cost auto")
    a = _number(c.attention_cost)
    if not a >= 0 or a == float("inf"):
        raise UsageError(f"--attention-cost must be >= 0 (got {c.attention_cost})")


def attention_cost(c: PlanConfig) -> float:
    """The A a plan uses (after :func:`check`)."""
    if isinstance(c.attention_cost, str) and c.attention_cost.strip().lower() == AUTO:
        return flops_attention_cost(c.model_dim, c.layers, c.vocab_size or 0)
    return _number(c.attention_cost or 0.0)


def describe(c: PlanConfig) -> dict:
    """The ``cost_model`` metadata entry: A, where it came from and the formula."""
    a = attention_cost(c)
    out = {"attention_cost": a, "source": "given"}
    if isinstance(c.attention_cost, str) and c.attention_cost.strip().lower() == AUTO:
        out.update(source="flops", model_dim=c.model_dim, layers=c.layers, vocab_size=c.vocab_size or 0,
                   formula="A = 2 d L / (24 d^2 L + 2 d V)")
    out["segment_cost"] = "l + A l^2" if a else "l"
    return out
