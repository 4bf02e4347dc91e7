"""``plan_step``: one optimizer step over a buffer of samples, planned by the planner's own pieces
(:mod:`.form`), and the :class:`StepPlan` it returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..plan.lr import lr_scales
from .form import Slots, form_packed, form_padded
from .refine import refine
from .spec import StepSpec, make_spec
from .units import units_of


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step: ``ranks[r][m]`` holds the indices (into the step's lengths) of rank ``r``'s
    microbatch ``m``; every rank has :attr:`num_microbatches` of them.

    ``seqlens``, ``batch_sizes``, ``tokens``: ``(dp, G)`` arrays, each microbatch's padded T (packed:
    ``seq_len``), padded B (packed: rows R) and real tokens. ``cost``: each rank's cost on the cost
    model (padded ``B*T + A*B*T^2`` per microbatch; packed ``tokens + A*sum(l^2)``). ``loss_tokens``:
    the step's loss targets over all ranks (``sum(max(l - 1, 0))``), the exact normaliser of a summed
    token loss. ``empty_microbatches``: microbatches holding no sample (only when the step has fewer
    samples, or packed items, than ``dp x G``; an empty one is one padding row). Packed steps also
    give, per microbatch, each entry's ``entry_starts`` / ``entry_lengths`` / ``entry_rows`` (a split
    sample is several entries of the same index)."""

    ranks: list
    seqlens: np.ndarray
    batch_sizes: np.ndarray
    tokens: np.ndarray
    cost: np.ndarray
    loss_tokens: int
    lr_scale: float
    num_microbatches: int
    empty_microbatches: int
    num_samples: int
    num_tokens: int
    seq_len: int | None = None
    entry_starts: list | None = None
    entry_lengths: list | None = None
    entry_rows: list | None = None

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def packed(self) -> bool:
        return self.seq_len is not None

    @property
    def imbalance(self) -> float:
        """The busiest rank's cost over the mean rank cost (1.0: balanced)."""
        mean = float(self.cost.mean()) if len(self.cost) else 0.0
        return float(self.cost.max()) / mean if mean > 0 else 1.0

    @property
    def padded_tokens(self) -> int:
        """Tokens the microbatches take with their padding (B x T, packed: R x seq_len)."""
        return int((self.seqlens * self.batch_sizes).sum())

    @property
    def padding(self) -> float:
        """Padded-but-empty tokens over all padded tokens."""
        padded = self.padded_tokens
        return 1.0 - self.num_tokens / padded if padded else 0.0


def plan_step(lengths, *, dp, max_tokens=None, seq_len=None, num_microbatches=None, attention_cost=0.0, groups=None,
              max_samples=None, pad_multiple=1, lr_scaling="none", base_batch_size=None, lr_scale_by="loss-tokens",
              split=False, max_per_row=None) -> StepPlan:
    """Plan one optimizer step over ``lengths`` (a buffer of samples) for ``dp`` data-parallel ranks.

    Padded microbatches with ``max_tokens`` (a hard bound on ``B x T``, plus ``A x B x T^2`` with
    ``attention_cost`` A; ``max_samples`` bounds B, ``pad_multiple`` rounds T up), or packed rows of
    ``seq_len`` tokens (R rows a microbatch: as many as ``max_tokens`` holds, else 1; ``split``: a
    sample longer than a row is cut into rows, else refused; ``max_per_row`` caps the samples of a row).
    Every rank gets ``num_microbatches`` microbatches, or the fewest the budget allows, the same on
    every rank; ``groups`` (an id per sample) keeps each group inside one microbatch. ``lr_scale`` is
    ``b / base_batch_size`` (``linear``), its square root (``sqrt``) or 1 (``none``), ``b`` counting the
    step's ``lr_scale_by`` (samples, tokens or loss-tokens). Deterministic: the same inputs give the
    same plan in every process. A sample (or group) that fits no microbatch raises one
    :class:`~varlen_cli.errors.InputError` line; a bad option one :class:`~varlen_cli.errors.UsageError`.
    """
    spec = make_spec(dp=dp, max_tokens=max_tokens, seq_len=seq_len, num_microbatches=num_microbatches,
                     attention_cost=attention_cost, max_samples=max_samples, pad_multiple=pad_multiple,
                     lr_scaling=lr_scaling, base_batch_size=base_batch_size, lr_scale_by=lr_scale_by, split=split,
                     max_per_row=max_per_row)
    return plan_with(spec, lengths, groups)


def check_lengths(lengths) -> np.ndarray:
    """The step's lengths as int64 (one line for anything but a 1-D array of integers >= 0)."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise InputError(f"lengths must be a 1-D array, got shape {arr.shape}")
    if len(arr) and arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f" or not np.all(np.isfinite(arr)) or not np.all(arr == np.floor(arr)):
            raise InputError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if len(arr) and int(arr.min()) < 0:
        raise InputError(f"lengths must be >= 0: {int(np.count_nonzero(arr < 0)):,} are negative")
    return arr


def plan_with(spec: StepSpec, lengths, groups=None) -> StepPlan:
    """:func:`plan_step` under an already checked :class:`~varlen_cli.online.spec.StepSpec`."""
    lengths = check_lengths(lengths)
    units = units_of(len(lengths), groups)
    slots = form_packed(spec, lengths, units) if spec.packed else form_padded(spec, lengths, units)
    slots = refine(spec, lengths, slots, units)
    return _step_plan(spec, lengths, slots)


def _step_plan(spec: StepSpec, lengths: np.ndarray, slots: Slots) -> StepPlan:
    dp, g = spec.dp, slots.per_rank
    bounds = list(zip(slots.offsets[:-1].tolist(), slots.offsets[1:].tolist()))

    def nested(a: np.ndarray | None) -> list | None:  # [rank][micro] views of a per-entry array
        if a is None:
            return None
        parts = [a[lo:hi] for lo, hi in bounds]
        return [parts[r * g:(r + 1) * g] for r in range(dp)]

    samples, tokens = len(lengths), int(lengths.sum())
    loss_tokens = tokens - int(np.count_nonzero(lengths))
    scale = lr_scales(np.array([samples]), np.array([tokens]), np.array([loss_tokens]), spec.lr_scaling,
                      spec.lr_scale_by, spec.base_batch_size)[0]
    rank_cost = slots.cost.reshape(dp, g).sum(axis=1) if g else np.zeros(dp)
    return StepPlan(nested(slots.entries), slots.seqlen.reshape(dp, g), slots.batch.reshape(dp, g),
                    slots.tokens.reshape(dp, g), rank_cost, loss_tokens, float(scale[0]), g, slots.empty, samples,
                    tokens, spec.seq_len, nested(slots.entry_start), nested(slots.entry_length),
                    nested(slots.entry_row))
