"""A plan's budget and cost model: the one definition of what a microbatch costs.

* Padded microbatch of B samples at seqlen T: ``B*T + A*B*T^2`` (:func:`padded_cost`); the budget
  bounds it by ``max_tokens`` (and B by ``max_samples``). ``A`` is ``--attention-cost``: a number,
  ``auto`` (from the model's shape) or, with ``--max-memory``, ``c2/c1`` of a memory profile.
* Packed microbatch (R rows of T tokens): the budget bounds ``R*T + A*R*T^2`` the same way (a row
  is a sample of T tokens for the memory it takes); its compute, which the planner balances across
  ranks, is its tokens plus ``A x sum(l_i^2)`` over its segments (:func:`packed_cost`; a split
  chunk counts its own length).
* Two budgets (``--max-target-tokens``, encoder-decoder models): a microbatch also has a padded target
  side B x T_target (the decoder's tokens, the metrics' ``target_length``), bounded the same way
  (``B*T_target + A*B*T_target^2 <= max_target_tokens``, :meth:`Budget.fits`, :meth:`Budget.cap`);
  its compute, which ranks are balanced on and ``varlen simulate`` runs, is :func:`seq2seq_cost`.

:class:`Budget` holds the resolved values; it is built once from the options
(:func:`varlen_cli.plan.cost_model.resolve_budget`), stored once in the plan's metadata under
``budget`` (:meth:`Budget.to_metadata`) and read back by every command that needs it
(:meth:`Budget.from_metadata`): the planner, mixtures, replan, extend, validate, inspect, simulate
and the loader. Imports only numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

AUTO = "auto"
COST_KINDS = ("padded", "packed")
SOURCES = ("given", "flops", "memory")
COST_LIMIT = 2.0 ** 990
"""Largest cost of one microbatch: sums over a plan's (at most 2^31) microbatches then stay finite
in float64. A larger ``--attention-cost`` is refused in one line."""


def is_auto(value) -> bool:
    """Whether ``--attention-cost`` is ``auto`` (derived from the model's shape)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def attention_number(value) -> float | None:
    """``--attention-cost`` as a finite number >= 0, or None when it is not one (``auto`` included)."""
    if is_auto(value) or isinstance(value, bool):
        return None
    try:
        a = float(value if value is not None else 0.0)
    except (TypeError, ValueError):
        return None
    return a if math.isfinite(a) and a >= 0 else None


def padded_cost(batch, seqlen, attention_cost: float = 0.0) -> np.ndarray:
    """``B*T + A*B*T^2`` per microbatch: int64 when ``A`` is 0 (exact), else float64 (inf past its range)."""
    b = np.asarray(batch, dtype=np.int64)
    t = np.asarray(seqlen, dtype=np.int64)
    if attention_cost:
        bf, tf = b.astype(np.float64), t.astype(np.float64)
        with np.errstate(over="ignore"):
            return bf * tf + attention_cost * bf * tf * tf
    return b * t


def seq2seq_cost(batch, seqlen, target_seqlen, attention_cost: float = 0.0) -> np.ndarray:
    """An encoder-decoder microbatch's compute, float64: ``B*(T + T_tgt) + A*B*(T^2 + T_tgt^2 + T*T_tgt)``.

    Each token goes once through its own stack (encoder tokens T, decoder tokens T_tgt: the linear
    part, one unit a token); attention costs A per query-key pair: the encoder's self-attention T^2,
    the decoder's T_tgt^2 and its cross-attention to the encoder's output T*T_tgt (docs/plan.md, "Two
    budgets": the same A and width on both sides, the model's FLOPs up to a constant)."""
    b = np.asarray(batch, dtype=np.float64)
    t, u = np.asarray(seqlen, dtype=np.float64), np.asarray(target_seqlen, dtype=np.float64)
    with np.errstate(over="ignore"):
        linear = b * (t + u)
        return linear + attention_cost * b * (t * t + u * u + t * u) if attention_cost else linear


def packed_cost(tokens, sum_squares, attention_cost: float = 0.0) -> np.ndarray:
    """Tokens + ``A x sum(l_i^2)`` per packed microbatch, as float64 (tokens alone when ``A`` is 0)."""
    if not attention_cost:
        return np.asarray(tokens, dtype=np.float64)
    with np.errstate(over="ignore"):
        return np.asarray(tokens, dtype=np.float64) + attention_cost * np.asarray(sum_squares, dtype=np.float64)


def segment_sum_squares(lengths, offsets) -> np.ndarray:
    """Per microbatch, the sum of ``l^2`` over its segments (``lengths`` flat, CSR ``offsets``), float64."""
    offsets = np.asarray(offsets, dtype=np.int64)
    counts = np.diff(offsets)
    parent = np.repeat(np.arange(len(counts)), counts)
    lf = np.asarray(lengths, dtype=np.float64)
    return np.bincount(parent, weights=lf * lf, minlength=len(counts))[:len(counts)]


@dataclass(frozen=True)
class Budget:
    """The resolved budget of a plan (see the module docstring).

    ``max_tokens``: bound on the padded cost (None: packed plans sized by rows only);
    ``max_samples``: bound on B; ``attention_cost``: A; ``packed``: which cost the plan balances;
    ``source``: where A and ``max_tokens`` came from (``given``, ``flops`` for ``auto``, ``memory``
    for ``--max-memory``); ``model``: ``auto``'s model shape; ``memory``: the memory limit a
    ``--max-memory`` plan keeps (``max_memory`` bytes, ``margin``, ``profile``: the profile's
    provenance and fit), stored under the metadata's own ``memory`` key; ``max_target_tokens``: the
    bound on the target side's padded cost (None: one budget, the source's)."""

    max_tokens: int | None
    max_samples: int | None = None
    attention_cost: float = 0.0
    packed: bool = False
    source: str = "given"
    model: dict | None = None
    memory: dict | None = field(default=None, compare=False)
    max_target_tokens: int | None = None

    # -- the padded cost the budget bounds ----------------------------------------------------
    @property
    def two_sided(self) -> bool:
        """Whether the plan has a target budget too (``--max-target-tokens``)."""
        return self.max_target_tokens is not None

    def target_side(self) -> Budget:
        """The target side's budget alone: ``max_target_tokens`` with the same A and ``max_samples``."""
        return Budget(self.max_target_tokens, self.max_samples, self.attention_cost)

    def cost(self, batch, seqlen) -> np.ndarray:
        return padded_cost(batch, seqlen, self.attention_cost)

    def fits(self, batch, seqlen, target_seqlen=None) -> np.ndarray:
        """Whether B x T (and, given ``target_seqlen`` under two budgets, B x T_target) is within budget."""
        if self.max_tokens is None:
            ok = np.ones(np.broadcast(np.asarray(batch), np.asarray(seqlen)).shape, dtype=bool)
        else:
            ok = self.cost(batch, seqlen) <= self.max_tokens
        if self.max_samples is not None:
            ok &= np.asarray(batch) <= self.max_samples
        if self.two_sided and target_seqlen is not None:
            ok &= self.cost(batch, target_seqlen) <= self.max_target_tokens
        return ok

    def cap(self, seqlen, target_seqlen=None) -> np.ndarray:
        """The most samples a microbatch of seqlen T (and, given ``target_seqlen`` under two budgets,
        target seqlen T_target) may hold (0: not even one fits)."""
        if self.two_sided and target_seqlen is not None:
            return np.minimum(self.cap(seqlen), self.target_side().cap(target_seqlen))
        t = np.asarray(seqlen)
        if t.ndim == 1 and len(t) > 4096 and t.dtype.kind in "iu":
            hi = int(t.max()) if len(t) else 0
            if 0 <= int(t.min()) and hi <= max(1 << 20, len(t) // 4):
                table = self._cap(np.arange(hi + 1, dtype=np.int64))  # a table: one division per T
                if int(table.max()) < 1 << 31:  # int32 result: 4 bytes a sample
                    table = table.astype(np.int32)
                return table[t]
        return self._cap(t.astype(np.int64, copy=False))

    def _cap(self, t: np.ndarray) -> np.ndarray:
        if self.max_tokens is None:
            c = np.full(t.shape, np.iinfo(np.int64).max // 4, dtype=np.int64)
        elif self.attention_cost:
            tf = np.maximum(t, 1).astype(np.float64)
            with np.errstate(over="ignore"):
                c = np.floor(self.max_tokens / (tf + self.attention_cost * tf * tf)).astype(np.int64)
            c = np.maximum(c, 0)
            # float rounding: step down where the exact check fails, up where one more still fits
            c -= (self.cost(c, t) > self.max_tokens) & (c > 0)
            c += self.cost(c + 1, t) <= self.max_tokens
        else:
            c = self.max_tokens // np.maximum(t, 1)
        if self.max_samples is not None:
            c = np.minimum(c, self.max_samples)
        return c

    # -- the compute cost ranks are balanced on (and the straggler measured in) ----------------
    @property
    def needs_segment_lengths(self) -> bool:
        """Whether :meth:`microbatch_cost` needs the per-microbatch sum of squared segment lengths."""
        return self.packed and bool(self.attention_cost)

    def microbatch_cost(self, tokens, batch, seqlen, sum_squares=None, target_seqlen=None) -> np.ndarray:
        """Per microbatch, float64: packed plans :func:`packed_cost` (``sum_squares`` needed when
        :attr:`needs_segment_lengths`), padded plans :func:`padded_cost`, two budgets :func:`seq2seq_cost`
        (``target_seqlen`` needed)."""
        if self.two_sided:
            if target_seqlen is None:
                raise ValueError("a two-budget cost needs the microbatches' target_seqlen")
            return seq2seq_cost(batch, seqlen, target_seqlen, self.attention_cost)
        if self.packed:
            if self.needs_segment_lengths and sum_squares is None:
                raise ValueError("a packed attention cost needs the per-microbatch sum of squared segment lengths")
            return packed_cost(tokens, sum_squares, self.attention_cost)
        return np.asarray(self.cost(batch, seqlen), dtype=np.float64)

    def worst_cost(self, rows_or_batch: int, seqlen: int) -> float:
        """The most one microbatch of B (packed: R rows) x T can cost under this model."""
        b, t = float(rows_or_batch), float(seqlen)
        with np.errstate(over="ignore"):
            return float(b * t + self.attention_cost * b * t * t)

    def straggler_spec(self) -> dict:
        """The cost as ``{"kind": "padded" | "packed" | "tokens", "attention_cost": A}`` (what
        ``varlen inspect`` shows and older plans recorded as ``straggler_cost``)."""
        if self.two_sided:
            return {"kind": "seq2seq", "attention_cost": self.attention_cost}
        if self.packed:
            return {"kind": "packed", "attention_cost": self.attention_cost} if self.attention_cost else {"kind":
                                                                                                          "tokens"}
        return {"kind": "padded", "attention_cost": self.attention_cost}

    def describe(self) -> str:
        """The budget as the user gave it, for messages."""
        if self.source == "memory" and self.memory:
            given = self.memory.get("given") or f"{int(self.memory.get('max_memory', 0)) / 2**20:.2f}MiB"
            return f"--max-memory {given} (max_tokens {self.max_tokens:,} from the profile)"
        if self.two_sided:
            return f"--max-tokens {self.max_tokens:,} and --max-target-tokens {self.max_target_tokens:,}"
        return f"--max-tokens {self.max_tokens:,}" if self.max_tokens is not None else "the packed rows"

    # -- metadata ---------------------------------------------------------------------------------
    def to_metadata(self) -> dict:
        """The plan metadata's ``budget`` entry (the memory limit goes under ``memory``)."""
        out = {"max_tokens": self.max_tokens, "max_samples": self.max_samples,
               "attention_cost": float(self.attention_cost), "cost": "packed" if self.packed else "padded",
               "source": self.source}
        if self.model is not None:
            out["model"] = dict(self.model)
        if self.two_sided:  # only then: a one-budget plan's entry is what it always was
            out["max_target_tokens"] = self.max_target_tokens
        return out

    @classmethod
    def from_metadata(cls, meta: dict) -> Budget:
        """The budget a plan was made with. Plans written before ``budget`` held the cost kind and
        source give them through ``packing``, ``straggler_cost`` and ``cost_model``. A
        :class:`ValueError` (one line) for a malformed entry."""
        entry = meta.get("budget") or {}
        if not isinstance(entry, dict):
            raise ValueError(f"'budget' is {entry!r}, expected an object")
        legacy = meta.get("straggler_cost") if isinstance(meta.get("straggler_cost"), dict) else {}
        a = entry.get("attention_cost", legacy.get("attention_cost", 0.0))
        if attention_number(a if a is not None else 0.0) is None:
            raise ValueError(f"'budget.attention_cost' is {a!r}, expected a finite number >= 0")
        cost = entry.get("cost", "packed" if meta.get("packing") else "padded")
        if cost not in COST_KINDS:
            raise ValueError(f"'budget.cost' is {cost!r}, expected one of {', '.join(COST_KINDS)}")
        for key in ("max_tokens", "max_samples", "max_target_tokens"):
            v = entry.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"'budget.{key}' is {v!r}, expected an integer >= 1 or null")
        source = entry.get("source", (meta.get("cost_model") or {}).get("source", "given"))
        memory = meta.get("memory") if isinstance(meta.get("memory"), dict) else None
        model = entry.get("model") if isinstance(entry.get("model"), dict) else None
        return cls(entry.get("max_tokens"), entry.get("max_samples"), float(a or 0.0), cost == "packed",
                   source if source in SOURCES else "given", model, memory, entry.get("max_target_tokens"))
